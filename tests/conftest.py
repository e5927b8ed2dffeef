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

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
torch.set_num_threads(1)

GPU_TESTS = Path(__file__).resolve().parent / "gpu"


def pytest_configure(config):
    paths = [Path(str(a).split("::")[0]).resolve() for a in config.args]
    if not paths or not all(p == GPU_TESTS or GPU_TESTS in p.parents for p in paths):
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # before anything asks CUDA for its devices


def _probe(read):
    """One reading of torch's state; torch's private readers differ between releases (the GPU
    machines ran torch 2.11), and one this torch lacks reads the same before and after."""
    try:
        return read()
    except (AttributeError, TypeError):
        return "not readable on this torch"


def _torch_state() -> dict:
    """What one test could leave set for the next in this process: modes on the dispatch and
    function stacks, default saved-tensor hooks (zb's ``I`` installs some), autocast, grad and
    inference mode, the thread's dispatch-key sets, the default dtype, deterministic algorithms
    and the number of intra-op threads."""
    C = torch._C
    return {
        "torch dispatch modes": _probe(C._len_torch_dispatch_stack),
        "torch function modes": _probe(C._len_torch_function_stack),
        "default saved-tensor hooks": _probe(lambda: repr(C._autograd._top_saved_tensors_default_hooks(False))),
        "autocast": _probe(C._is_any_autocast_enabled),
        "grad mode": torch.is_grad_enabled(),
        "inference mode": torch.is_inference_mode_enabled(),
        "dispatch keys excluded": _probe(lambda: repr(C._dispatch_tls_local_exclude_set())),
        "dispatch keys included": _probe(lambda: repr(C._dispatch_tls_local_include_set())),
        "default dtype": torch.get_default_dtype(),
        "deterministic algorithms": torch.are_deterministic_algorithms_enabled(),
        "intra-op threads": torch.get_num_threads(),
    }


@pytest.fixture(autouse=True)
def _leaves_torch_as_it_found_it():
    """Fails the test that leaves global torch state changed, naming what it left, instead of
    letting a later test fail for a reason of its own that it does not have."""
    before = _torch_state()
    yield
    after = _torch_state()
    left = {k: (before[k], after[k]) for k in before if before[k] != after[k]}
    assert not left, "the test left torch's global state changed (before, after): " + repr(left)
