"""AdamA: optimizer accumulation, so a step keeps no gradient buffer (opt-in, Adam/AdamW only).

Zhang et al., "Adam Accumulation to Reduce Memory Footprints of both Activations and Gradients
for Large-scale DNN Training" (AdamA), fold each micro-batch gradient into Adam's moments as
soon as it exists and free it, instead of summing gradients and then running Adam. With
``g_i = scale * grad_i`` (``scale = 1/M``), for the M micro-batches of step t:

    first micro-batch:   m = beta1 * m            v = beta2 * v
    every micro-batch:   m += (1 - beta1) * g_i   v += (1 - beta2) * g_i**2
    after the last one:  w  = w * (1 - lr*wd)     (AdamW only)
                         w -= lr/(1-beta1**t) * m / (sqrt(v)/sqrt(1-beta2**t) + eps)

``m`` equals Adam's (the sum is linear); ``v`` holds the sum of squares, not the square of the
sum, so AdamA is a different optimizer from Adam with gradient accumulation (equal for M = 1),
and ``reference.adama_*_reference`` is written from these equations, not from torch.optim.

How the runtime uses it, per step t with M micro-batches::

    for i in range(M):                     # micro-batch i's backward produced `grad` (flat or a slice)
        ops.adama_accumulate(spec, grad, state, scale=1 / M, first=(i == 0))
        del grad                           # nothing is kept between micro-batches
    ops.adama_update(spec, t, weights[cur], weights[1 - cur], state, lr=lr_t)

The kernels take any contiguous slice, so a backward hook can fold each parameter's gradient
into ``{"exp_avg": m[o:o+n], "exp_avg_sq": v[o:o+n]}`` the moment it is produced, which is the
paper's memory saving: no stage-sized gradient accumulator survives between micro-batches.
Global-norm clipping is impossible here (the whole gradient never exists at once).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._jit import launch_config, store_rounded
from .optim import OptimizerSpec, adam_scalars
from .reference import (adama_accumulate_reference, adama_update_reference, check_adama_accumulate_args,
                        check_adama_update_args)

__all__ = ["adama_accumulate", "adama_update", "adama_accumulate_reference", "adama_update_reference"]


@triton.jit
def _adama_accumulate_kernel(
    grad_ptr,  # *grad: one micro-batch's gradient (fp32/bf16/fp16), flat or a parameter's slice; read
    m_ptr,  # *exp_avg (fp32): read and written in place
    v_ptr,  # *exp_avg_sq (fp32): read and written in place
    scale_ptr,  # *scale: 1-element float tensor, read only when SCALE_IN_MEMORY
    n,  # number of elements
    scale, beta1, beta2, one_minus_beta1, one_minus_beta2,
    FIRST: tl.constexpr,  # first micro-batch of the step: decay the moments once
    SCALE_IN_MEMORY: tl.constexpr,
    BLOCK: tl.constexpr,
):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    if SCALE_IN_MEMORY:
        scale = tl.load(scale_ptr).to(tl.float32)
    g = tl.load(grad_ptr + offsets, mask=mask).to(tl.float32) * scale
    m = tl.load(m_ptr + offsets, mask=mask)
    v = tl.load(v_ptr + offsets, mask=mask)
    if FIRST:
        m = m * beta1
        v = v * beta2
    tl.store(m_ptr + offsets, m + g * one_minus_beta1, mask=mask)
    tl.store(v_ptr + offsets, v + g * one_minus_beta2 * g, mask=mask)


@triton.jit
def _adama_update_kernel(
    w_ptr,  # *weights: version t (fp32/bf16/fp16); read
    out_ptr,  # *out: version t+1 (the other buffer, or w_ptr itself); written
    m_ptr,  # *exp_avg (fp32): read
    v_ptr,  # *exp_avg_sq (fp32): read
    n,  # number of elements
    decay, step_size, bias_correction2_sqrt, eps,
    HAS_DECAY: tl.constexpr,  # AdamW's decoupled weight decay
    BLOCK: tl.constexpr,
):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    w = tl.load(w_ptr + offsets, mask=mask).to(tl.float32)
    if HAS_DECAY:
        w = w * decay
    denom = tl.sqrt(tl.load(v_ptr + offsets, mask=mask)) / bias_correction2_sqrt + eps
    w = w - step_size * tl.load(m_ptr + offsets, mask=mask) / denom
    store_rounded(out_ptr + offsets, w, mask)


def adama_accumulate(spec: OptimizerSpec, grad: torch.Tensor, state: dict[str, torch.Tensor], *,
                     scale: float | torch.Tensor = 1.0, first: bool, block: int | None = None) -> None:
    """Fold ``scale * grad`` into ``state["exp_avg"]``/``state["exp_avg_sq"]`` in place (one launch)."""
    scale = check_adama_accumulate_args(spec, grad, state, scale)
    n = grad.numel()
    BLOCK, options = launch_config(_adama_accumulate_kernel, "adama_accumulate", grad.device, block)
    if n == 0:
        return
    b1, b2 = spec.betas
    in_memory = isinstance(scale, torch.Tensor)
    _adama_accumulate_kernel[(triton.cdiv(n, BLOCK),)](
        grad, state["exp_avg"], state["exp_avg_sq"], scale if in_memory else grad, n,
        0.0 if in_memory else scale, b1, b2, 1.0 - b1, 1.0 - b2,
        FIRST=bool(first), SCALE_IN_MEMORY=in_memory, BLOCK=BLOCK, **options)


def adama_update(spec: OptimizerSpec, step: int, weights: torch.Tensor, out: torch.Tensor,
                 state: dict[str, torch.Tensor], *, lr: float | None = None,
                 block: int | None = None) -> torch.Tensor:
    """AdamA's step ``step`` (1-based) from the folded moments into ``out``; returns ``out``."""
    lr = check_adama_update_args(spec, step, weights, out, state, lr)
    n = weights.numel()
    BLOCK, options = launch_config(_adama_update_kernel, "adama_update", weights.device, block)
    if n == 0:
        return out
    step_size, bias_correction2_sqrt = adam_scalars(spec, step, lr)
    has_decay = spec.kind == "adamw" and spec.weight_decay != 0
    _adama_update_kernel[(triton.cdiv(n, BLOCK),)](
        weights, out, state["exp_avg"], state["exp_avg_sq"], n,
        1.0 - lr * spec.weight_decay, step_size, bias_correction2_sqrt, spec.eps,
        HAS_DECAY=has_decay, BLOCK=BLOCK, **options)
    return out
