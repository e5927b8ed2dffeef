"""The fused 2BW weight update: one pass from (gradient, version t, state) to version t+1.

PipeDream-2BW (Narayanan et al., ICML 2021) keeps two weight versions per stage and writes
``W(t+1) = W(t) - lr * step(grad)`` into the *other* buffer while micro-batches still read
``W(t)``'s. This kernel reads the accumulated flat gradient, an optional clip factor, the
current version and the float32 optimizer state, and in one pass writes the new version into
``out`` (``out is weights`` updates in place) and the new state in place.

Optimizers, with ``torch.optim``'s exact formulas (``maximize=False``, no ``amsgrad``):

* SGD:   ``g += wd*w``; ``buf = g`` at step 1 else ``buf = momentum*buf + (1-dampening)*g``;
  ``g = g + momentum*buf`` (nesterov) or ``g = buf``; ``w -= lr*g``.
* Adam:  ``g += wd*w``; ``m = lerp(m, g, 1-beta1)``; ``v = beta2*v + (1-beta2)*g*g``;
  ``w -= lr/(1-beta1**t) * m / (sqrt(v)/sqrt(1-beta2**t) + eps)``.
* AdamW: as Adam, but ``w *= 1 - lr*wd`` instead of adding ``wd*w`` to the gradient.

The clip factor multiplies the gradient first (``clip_grad_norm_`` then ``step``); the caller
computes it, e.g. ``torch.clamp(max_norm / (norm + 1e-6), max=1.0)``, and may pass it as a 0-d
device tensor so the GPU never waits for the host. The step count ``t`` is a python int so the
bias corrections are computed once on the host. Weights may be fp32/bf16/fp16; the state is
float32 and all math is float32, rounded once when the new version is stored. Mixed precision
steps the fp32 master in place (``out is weights``) and passes ``copy``, its 16-bit compute
copy, which the same pass writes: per element AdamW then reads grad, master and two moments and
writes master, moments and copy (30 bytes with a 2-byte copy), the least the update can move.

Per step on a stage (after the last micro-batch's ``accumulate``)::

    ops.update(spec, t, acc, weights[cur], weights[1 - cur], state, clip=clip_factor, lr=lr_t)

The torch reference is ``reference.update_reference`` (same signature; the CPU path).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._jit import launch_config, store_rounded
from .optim import OptimizerSpec, adam_scalars
from .reference import check_update_args, update_reference

__all__ = ["update", "update_reference"]

_SGD, _ADAM, _ADAMW = 0, 1, 2
_OPTIMIZER_CODES = {"sgd": _SGD, "adam": _ADAM, "adamw": _ADAMW}


@triton.jit
def _update_kernel(
    grad_ptr,  # *grad: the accumulated flat gradient of the step (fp32/bf16/fp16); read
    w_ptr,  # *weights: version t of the stage's flat weights; read
    out_ptr,  # *out: where version t+1 goes (the other buffer, or w_ptr itself); written
    copy_ptr,  # *copy: a bf16/fp16 copy of version t+1 (mixed precision), written when HAS_COPY
    s1_ptr,  # *state 1 (fp32): SGD momentum_buffer or Adam exp_avg; read and written in place
    s2_ptr,  # *state 2 (fp32): Adam exp_avg_sq; read and written in place (unused by SGD)
    clip_ptr,  # *clip: 1-element float tensor, read only when CLIP == 2
    n,  # number of elements
    clip,  # python-float clip factor when CLIP == 1
    lr, weight_decay,
    momentum, dampening,  # SGD
    beta2, one_minus_beta1, one_minus_beta2, eps, step_size, bias_correction2_sqrt,  # Adam/AdamW
    OPTIMIZER: tl.constexpr,  # 0 SGD, 1 Adam, 2 AdamW
    CLIP: tl.constexpr,  # 0 none, 1 python float, 2 tensor in memory
    HAS_WEIGHT_DECAY: tl.constexpr,
    HAS_MOMENTUM: tl.constexpr,
    NESTEROV: tl.constexpr,
    FIRST_STEP: tl.constexpr,  # SGD: torch starts the momentum buffer as the gradient itself
    LERP_FROM_END: tl.constexpr,  # torch's lerp formula switches at weight 0.5; mirror it
    HAS_COPY: tl.constexpr,
    BLOCK: tl.constexpr,
):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    g = tl.load(grad_ptr + offsets, mask=mask).to(tl.float32)
    w = tl.load(w_ptr + offsets, mask=mask).to(tl.float32)
    if CLIP == 1:
        g = g * clip
    if CLIP == 2:
        g = g * tl.load(clip_ptr).to(tl.float32)
    if OPTIMIZER == 0:
        if HAS_WEIGHT_DECAY:
            g = g + weight_decay * w
        if HAS_MOMENTUM:
            if FIRST_STEP:
                buf = g  # the buffer may hold anything before step 1: never read it
            else:
                buf = tl.load(s1_ptr + offsets, mask=mask) * momentum + (1.0 - dampening) * g
            tl.store(s1_ptr + offsets, buf, mask=mask)
            if NESTEROV:
                g = g + momentum * buf
            else:
                g = buf
        w = w - lr * g
    else:
        if HAS_WEIGHT_DECAY:
            if OPTIMIZER == 2:
                w = w * (1.0 - lr * weight_decay)
            else:
                g = g + weight_decay * w
        m = tl.load(s1_ptr + offsets, mask=mask)
        if LERP_FROM_END:
            m = g - (g - m) * (1.0 - one_minus_beta1)
        else:
            m = m + one_minus_beta1 * (g - m)
        v = tl.load(s2_ptr + offsets, mask=mask) * beta2 + one_minus_beta2 * g * g
        tl.store(s1_ptr + offsets, m, mask=mask)
        tl.store(s2_ptr + offsets, v, mask=mask)
        denom = tl.sqrt(v) / bias_correction2_sqrt + eps  # eps after the bias correction, as torch
        w = w - step_size * m / denom
    store_rounded(out_ptr + offsets, w, mask)
    if HAS_COPY:
        store_rounded(copy_ptr + offsets, w, mask)


def update(spec: OptimizerSpec, step: int, grad: torch.Tensor, weights: torch.Tensor, out: torch.Tensor,
           state: dict[str, torch.Tensor], *, clip: float | torch.Tensor | None = None,
           lr: float | None = None, copy: torch.Tensor | None = None, block: int | None = None) -> torch.Tensor:
    """Fused optimizer step ``step`` (1-based): ``out = new weights``, ``state`` updated; returns ``out``.

    ``grad``, ``weights`` and ``out`` are 1-D contiguous buffers of one length (``out`` the other
    version's buffer or ``weights`` itself); ``state`` is ``init_state(spec, n, device)``;
    ``lr`` overrides ``spec.lr`` for this step (a scheduler's value). ``copy`` (mixed precision:
    ``out`` is the fp32 master) also receives the new weights rounded to its bf16/fp16, in the
    same pass.
    """
    clip, lr = check_update_args(spec, step, grad, weights, out, state, clip, lr, copy=copy)
    n = grad.numel()
    BLOCK, options = launch_config(_update_kernel, "update", grad.device, block)
    if n == 0:
        return out
    b1, b2 = spec.betas
    step_size, bias_correction2_sqrt = (adam_scalars(spec, step, lr) if spec.kind != "sgd" else (0.0, 1.0))
    names = spec.state_names
    s1 = state[names[0]] if names else grad  # placeholders are never dereferenced (constexpr-dead)
    s2 = state[names[1]] if len(names) > 1 else grad
    clip_mode = 0 if clip is None else (2 if isinstance(clip, torch.Tensor) else 1)
    _update_kernel[(triton.cdiv(n, BLOCK),)](
        grad, weights, out, copy if copy is not None else out, s1, s2, clip if clip_mode == 2 else grad, n,
        clip if clip_mode == 1 else 1.0,
        lr, spec.weight_decay, spec.momentum, spec.dampening,
        b2, 1.0 - b1, 1.0 - b2, spec.eps, step_size, bias_correction2_sqrt,
        OPTIMIZER=_OPTIMIZER_CODES[spec.kind], CLIP=clip_mode, HAS_WEIGHT_DECAY=spec.weight_decay != 0,
        HAS_MOMENTUM=spec.momentum != 0, NESTEROV=spec.nesterov, FIRST_STEP=step == 1,
        LERP_FROM_END=(1.0 - b1) >= 0.5, HAS_COPY=copy is not None, BLOCK=BLOCK, **options)
    return out
