"""Test set-up shared by every folder: the repo root on sys.path (for ``tests.models``) and one
thread per process, so the 2-core machine stays responsive under multi-process tests.

The default suite checks the CPU path. On a machine with a GPU, ``compile``'s ``device="auto"``
would pick it and change what the tests compare (CUDA's dropout streams against the CPU ranks',
``calibrate`` on the GPU for a model built on the CPU), so a run that is not ``tests/gpu`` alone
hides the GPUs from itself and the ranks it starts. ``pytest tests/gpu`` keeps them: the GPU
checks run on their own (``tests/kernels`` switches Triton to its interpreter for a session).
"""

import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
torch.set_num_threads(1)

GPU_TESTS = Path(__file__).resolve().parent / "gpu"


def pytest_configure(config):
    paths = [Path(str(a).split("::")[0]).resolve() for a in config.args]
    if not paths or not all(p == GPU_TESTS or GPU_TESTS in p.parents for p in paths):
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # before anything asks CUDA for its devices
