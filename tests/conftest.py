"""Test set-up shared by every folder: the repo root on sys.path (for ``tests.models``) and one
thread per process, so the 2-core machine stays responsive under multi-process tests."""

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
torch.set_num_threads(1)
