"""Fused gradient accumulation vs its torch reference: odd lengths, dtypes, poisoned outputs."""
import pytest
import torch
from conftest import DTYPES, LENGTHS, TOL

from fxpipe.kernels import KernelError, accumulate_reference
from fxpipe.kernels.accumulate import accumulate

PAIRS = [(d, d) for d in DTYPES] + [(torch.float32, torch.bfloat16), (torch.float32, torch.float16)]


@pytest.mark.parametrize("n", LENGTHS)
@pytest.mark.parametrize("acc_dtype,grad_dtype", PAIRS, ids=lambda d: str(d).replace("torch.", ""))
def test_accumulate_matches_reference(n, acc_dtype, grad_dtype, gen):
    grads = [torch.randn(n, generator=gen).to(grad_dtype) for _ in range(3)]
    got = torch.full((n,), float("nan"), dtype=acc_dtype)  # poisoned: the overwrite must write every element
    want = torch.full((n,), float("nan"), dtype=acc_dtype)
    scale = 1 / 3
    for i, g in enumerate(grads):
        accumulate(got, g, scale, overwrite=i == 0)
        accumulate_reference(want, g, scale, overwrite=i == 0)
        assert torch.isfinite(got).all(), f"micro-batch {i}: element(s) left unwritten"
        rtol, atol = TOL[acc_dtype]
        torch.testing.assert_close(got, want, rtol=rtol, atol=atol)
    exact = sum(g.double() for g in grads) / 3  # and both are close to the true mean
    rtol, atol = TOL[acc_dtype]
    torch.testing.assert_close(got.double(), exact, rtol=4 * rtol + (1e-2 if grad_dtype != torch.float32 else 0),
                               atol=1e-2 if grad_dtype != torch.float32 else 1e-6)


def test_many_programs_and_tensor_scale(gen):
    n = 33333  # 33 programs with BLOCK=1024, the GPU block size, with a ragged tail
    g = torch.randn(n, generator=gen)
    acc = torch.randn(n, generator=gen)
    want = acc.clone()
    scale = torch.tensor(0.25)  # a 0-d device tensor: no host sync on a GPU
    accumulate(acc, g, scale, block=1024)
    accumulate_reference(want, g, scale)
    torch.testing.assert_close(acc, want, rtol=1e-6, atol=1e-7)


def test_slice_of_flat_buffer_and_empty(gen):
    flat = torch.zeros(100)
    g = torch.randn(40, generator=gen)
    accumulate(flat[30:70], g, 2.0, overwrite=True)  # a parameter's slice of the stage buffer
    torch.testing.assert_close(flat[30:70], 2 * g)
    assert flat[:30].eq(0).all() and flat[70:].eq(0).all()
    accumulate(torch.empty(0), torch.empty(0))


@pytest.mark.parametrize("fn", [accumulate, accumulate_reference])
def test_errors_say_expected_and_found(fn):
    with pytest.raises(KernelError, match=r"expected acc to have 10 elements.*found 9"):
        fn(torch.zeros(9), torch.zeros(10))
    with pytest.raises(KernelError, match=r"expected grad to be contiguous"):
        fn(torch.zeros(5), torch.zeros(10)[::2])
    with pytest.raises(KernelError, match=r"expected grad to be a 1-D flat buffer, found shape \(2, 5\)"):
        fn(torch.zeros(10), torch.zeros(2, 5))
    # the kernel takes no float64; the reference takes it, for float64 acc and grad together
    message = r"expected acc dtype in .*found float64" if fn is accumulate else r"expected float64 acc and grad together"
    with pytest.raises(KernelError, match=message):
        fn(torch.zeros(10, dtype=torch.float64), torch.zeros(10))
    with pytest.raises(KernelError, match=r"scale to be a 0-d tensor or a python float"):
        fn(torch.zeros(10), torch.zeros(10), torch.ones(2))
    buf = torch.zeros(20)
    with pytest.raises(KernelError, match="partially overlap"):
        fn(buf[0:10], buf[5:15])
