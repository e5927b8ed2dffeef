"""Gradient accumulation over a stage's flat gradient buffer, in one launch.

    acc  = scale * grad     (overwrite=True: the first micro-batch of a step)
    acc += scale * grad     (every later micro-batch)

``scale`` is usually ``1/m`` for m micro-batches of a mean loss (a python float, or a 0-d tensor,
e.g. an AMP unscale factor, read on the device). ``acc`` and ``grad`` may differ in dtype
(a float32 accumulator for bf16 gradients); the sum is float32, rounded once on store.

Where the runtime uses it. If autograd accumulates straight into ``.grad`` tensors that are
views of the flat buffer, autograd's own ``+=`` does the work and this kernel is never called.
So on the GPU path the runtime must take each micro-batch's gradients out of autograd and route
them through the kernel::

    # once per stage: flat buffers per dtype; the parameters are views into `weights`
    scratch = torch.empty_like(acc)              # one micro-batch's gradient, flat
    views = [scratch[o:o + p.numel()].view_as(p) for p, o in zip(params, offsets)]
    # every micro-batch i (0-based) of a step, after its forward:
    grads = torch.autograd.grad(outputs, params, grad_outputs)   # per-parameter tensors
    torch._foreach_copy_(views, grads)           # (or a backward hook writing into `views`)
    ops.accumulate(acc, scratch, 1.0 / m, overwrite=(i == 0))    # ONE launch for the stage

``overwrite`` saves zeroing the accumulator between steps. The CPU runtime calls
``accumulate_reference`` (same signature) through ``fxpipe.kernels.ops(device)``.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._jit import launch_config, store_rounded
from .reference import accumulate_reference, check_accumulate_args

__all__ = ["accumulate", "accumulate_reference"]


@triton.jit
def _accumulate_kernel(
    acc_ptr,  # *acc: the flat accumulator (fp32/bf16/fp16); read unless OVERWRITE, always written
    grad_ptr,  # *grad: this micro-batch's flat gradient (fp32/bf16/fp16); read
    scale_ptr,  # *scale: a 1-element float tensor, read only when SCALE_IN_MEMORY
    n,  # number of elements of both buffers
    scale,  # the python-float multiplier when not SCALE_IN_MEMORY
    OVERWRITE: tl.constexpr,  # first micro-batch: do not read acc (it may hold anything, even NaN)
    SCALE_IN_MEMORY: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # int64 offsets: a large stage's buffer can pass 2**31 elements.
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    if SCALE_IN_MEMORY:
        scale = tl.load(scale_ptr).to(tl.float32)
    # Load, compute in fp32, round once on store: the interpreter would otherwise do bf16/fp16
    # arithmetic on raw bits.
    total = tl.load(grad_ptr + offsets, mask=mask).to(tl.float32) * scale
    if not OVERWRITE:
        total = tl.load(acc_ptr + offsets, mask=mask).to(tl.float32) + total
    store_rounded(acc_ptr + offsets, total, mask)


def accumulate(acc: torch.Tensor, grad: torch.Tensor, scale: float | torch.Tensor = 1.0, *,
               overwrite: bool = False, block: int | None = None) -> torch.Tensor:
    """Fused ``acc (+)= scale * grad`` over 1-D contiguous buffers of equal length; returns ``acc``."""
    scale = check_accumulate_args(acc, grad, scale)
    n = grad.numel()
    BLOCK, options = launch_config(_accumulate_kernel, "accumulate", grad.device, block)
    if n == 0:
        return acc
    in_memory = isinstance(scale, torch.Tensor)
    _accumulate_kernel[(triton.cdiv(n, BLOCK),)](
        acc, grad, scale if in_memory else grad, n, 0.0 if in_memory else scale,
        OVERWRITE=bool(overwrite), SCALE_IN_MEMORY=in_memory, BLOCK=BLOCK, **options)
    return acc
