"""Kernel tests run the Triton kernels on CPU through Triton's interpreter.

Triton fixes interpreter mode when a kernel is decorated (its module imported), so the variable
is set here, before any test module imports ``fxpipe.kernels.accumulate`` & co. Importing the
``fxpipe.kernels`` package itself imports no Triton, so an earlier ``import fxpipe`` is harmless.
"""
import os

os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

#: Lengths: a single element, shorter than a block, one past a power of two, many blocks + a tail.
LENGTHS = (1, 1000, 4097, 33333)
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
#: (rtol, atol) for comparing a kernel's output with the reference: two roundings of the dtype (2 ulp),
#: because the float32 math may round differently (torch fuses some multiply-adds) and flip the final
#: rounding, and a chained step then starts from inputs already one rounding apart.
TOL = {torch.float32: (2e-6, 1e-7), torch.bfloat16: (2 * 2**-7, 1e-6), torch.float16: (2 * 2**-10, 1e-7)}


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(0)
