"""Plain-torch references of every kernel, and the argument checks both paths share.

These are what the CPU runtime runs (``backend(...) == "torch"``) and what the kernel tests
compare against. They import no Triton, so the CPU path never pays for it and never fixes
Triton's interpreter mode before a test has set ``TRITON_INTERPRET``. All math is float32
whatever the buffers' dtype, rounded once on store, like the kernels; float64 buffers, which only
the references take (``dtypes=REFERENCE_DTYPES``), are computed in float64 with float64 state.

The update references follow ``torch.optim``'s single-tensor code op for op (``lerp_`` for
Adam's first moment, ``addcmul_``, ``(sqrt(v) / sqrt(bias_correction2)) + eps``, ``addcdiv``),
so for float32 buffers they give torch.optim's numbers; the kernels agree to float32 rounding.
"""
from __future__ import annotations

import torch

from .errors import (FLOAT_DTYPES, REFERENCE_DTYPES, KernelError, check_disjoint, check_flat, check_no_partial_overlap,
                     check_scalar)
from .optim import OptimizerSpec, adam_scalars, check_state, check_step, state_dtype

# ---------------------------------------------------------------------------------------------
# argument checks (shared with the Triton launch wrappers)
# ---------------------------------------------------------------------------------------------


def check_accumulate_args(acc, grad, scale, dtypes=FLOAT_DTYPES):
    op = "accumulate"
    check_flat(op, "grad", grad, dtypes=dtypes)
    check_flat(op, "acc", acc, numel=grad.numel(), device=grad.device, dtypes=dtypes)
    if (acc.dtype == torch.float64) != (grad.dtype == torch.float64):
        raise KernelError(f"{op}: expected float64 acc and grad together (float64 buffers accumulate in float64), "
                          f"found acc {acc.dtype} and grad {grad.dtype}; keep one flat buffer per dtype")
    check_no_partial_overlap(op, "acc", acc, "grad", grad)
    return check_scalar(op, "scale", scale, grad.device)


def check_update_args(spec, step, grad, weights, out, state, clip, lr, dtypes=FLOAT_DTYPES, copy=None):
    op = "update"
    if not isinstance(spec, OptimizerSpec):
        raise KernelError(f"{op}: expected spec to be an OptimizerSpec, found {type(spec).__name__}; "
                          f"build it with OptimizerSpec.from_torch(functools.partial(torch.optim.AdamW, ...))")
    check_step(op, step)
    check_flat(op, "grad", grad, dtypes=dtypes)
    n, device = grad.numel(), grad.device
    check_flat(op, "weights", weights, numel=n, device=device, dtypes=dtypes)
    check_flat(op, "out", out, numel=n, device=device, dtypes=dtypes)
    if out.dtype != weights.dtype:
        raise KernelError(f"{op}: expected out (the next version's buffer) to have the weights' dtype "
                          f"{weights.dtype}, found {out.dtype}; pass the other buffer of the same dtype group")
    check_no_partial_overlap(op, "out", out, "weights", weights)
    check_disjoint(op, "grad", grad, "out", out)
    if copy is not None:
        check_flat(op, "copy", copy, numel=n, device=device, dtypes=(torch.bfloat16, torch.float16))
        for name, t in (("grad", grad), ("weights", weights), ("out", out)):
            check_disjoint(op, name, t, "copy", copy)
        if out.dtype != torch.float32:
            raise KernelError(f"{op}: a low-precision copy is written from float32 master weights; found out "
                              f"{out.dtype}. Pass the fp32 master as weights/out and its 16-bit copy as copy")
    check_state(op, spec, state, n, device, state_dtype(weights.dtype))
    for k in spec.state_names:
        for name, t in (("grad", grad), ("weights", weights), ("out", out)):
            check_no_partial_overlap(op, f"state[{k!r}]", state[k], name, t)
    clip = None if clip is None else check_scalar(op, "clip", clip, device)
    lr = spec.lr if lr is None else float(lr)
    if not lr >= 0:
        raise KernelError(f"{op}: expected lr >= 0, found {lr}")
    return clip, lr


def check_adama_spec(op: str, spec) -> None:
    if not isinstance(spec, OptimizerSpec) or spec.kind not in ("adam", "adamw"):
        found = spec.kind if isinstance(spec, OptimizerSpec) else type(spec).__name__
        raise KernelError(f"{op}: expected an Adam or AdamW OptimizerSpec for AdamA, found {found}; AdamA "
                          f"accumulates into Adam's moments, so it needs torch.optim.Adam (without weight decay) "
                          f"or AdamW; use accumulate + update for SGD")
    if spec.kind == "adam" and spec.weight_decay != 0:
        raise KernelError(f"{op}: AdamA with Adam's coupled weight decay (weight_decay={spec.weight_decay}) is not "
                          f"supported: the L2 term would have to enter every micro-batch fold; use AdamW "
                          f"(decoupled decay) or weight_decay=0")


def check_adama_accumulate_args(spec, grad, state, scale):
    op = "adama_accumulate"
    check_adama_spec(op, spec)
    check_flat(op, "grad", grad)
    check_state(op, spec, state, grad.numel(), grad.device)
    return check_scalar(op, "scale", scale, grad.device)


def check_adama_update_args(spec, step, weights, out, state, lr):
    op = "adama_update"
    check_adama_spec(op, spec)
    check_step(op, step)
    check_flat(op, "weights", weights)
    n, device = weights.numel(), weights.device
    check_flat(op, "out", out, numel=n, device=device, dtypes=(weights.dtype,))
    check_no_partial_overlap(op, "out", out, "weights", weights)
    check_state(op, spec, state, n, device)
    lr = spec.lr if lr is None else float(lr)
    if not lr >= 0:
        raise KernelError(f"{op}: expected lr >= 0, found {lr}")
    return lr


# ---------------------------------------------------------------------------------------------
# references
# ---------------------------------------------------------------------------------------------


#: Elements per slice the references work on: elementwise math is exact slice by slice, and small
#: temporaries stay in cache and in malloc's free lists (stage-sized ones are fresh pages every call).
_CHUNK = 1 << 16


def _slices(n: int):
    for start in range(0, n, _CHUNK):
        yield slice(start, min(start + _CHUNK, n))


def _target(src: torch.Tensor, dst: torch.Tensor, compute: torch.dtype) -> torch.Tensor:
    """A ``compute``-dtype tensor holding ``src`` to compute the new values in: ``dst`` itself
    when it has that dtype."""
    if dst.dtype != compute:
        return src.to(compute)
    if dst.data_ptr() != src.data_ptr():
        dst.copy_(src)
    return dst


def accumulate_reference(acc: torch.Tensor, grad: torch.Tensor, scale: float | torch.Tensor = 1.0,
                         *, overwrite: bool = False) -> torch.Tensor:
    """``acc = scale * grad`` (``overwrite=True``, first micro-batch) or ``acc += scale * grad``."""
    scale = check_accumulate_args(acc, grad, scale, REFERENCE_DTYPES)
    if acc.dtype == grad.dtype and acc.dtype in (torch.float32, torch.float64) and not isinstance(scale, torch.Tensor):
        # No temporary, so no slicing: torch may fuse scale*g + acc into one rounding where the
        # kernel rounds twice (within 1 ulp).
        torch.mul(grad, scale, out=acc) if overwrite else acc.add_(grad, alpha=scale)
        return acc
    compute = state_dtype(acc.dtype)  # float32, or float64 for float64 buffers
    for s in _slices(grad.numel()):
        a, g = acc[s], grad[s]
        total = g.to(compute) * scale
        if overwrite:
            a.copy_(total)
        elif a.dtype == compute:
            a.add_(total)
        else:
            a.copy_(a.to(compute) + total)
    return acc


def update_reference(spec: OptimizerSpec, step: int, grad: torch.Tensor, weights: torch.Tensor,
                     out: torch.Tensor, state: dict[str, torch.Tensor], *,
                     clip: float | torch.Tensor | None = None, lr: float | None = None,
                     copy: torch.Tensor | None = None) -> torch.Tensor:
    """One ``torch.optim`` step on flat buffers: ``out = step(weights, clip * grad)``; state in
    place; ``copy`` (bf16/fp16, optional) also receives ``out`` rounded (mixed precision's
    compute copy of the fp32 master)."""
    clip, lr = check_update_args(spec, step, grad, weights, out, state, clip, lr, REFERENCE_DTYPES, copy)
    compute = state_dtype(weights.dtype)
    if spec.kind != "sgd":
        step_size, bias_correction2_sqrt = adam_scalars(spec, step, lr)
    for s in _slices(grad.numel()):
        g = grad[s].to(compute)
        if clip is not None:
            g = g * clip  # clipping scales the gradient before weight decay, as clip_grad_norm_ + step does
        o = out[s]
        w = _target(weights[s], o, compute)
        if spec.kind == "sgd":
            if spec.weight_decay != 0:
                g = g.add(w, alpha=spec.weight_decay)
            if spec.momentum != 0:
                buf = state["momentum_buffer"][s]
                if step == 1:
                    buf.copy_(g)  # torch.optim.SGD: the first buffer is the gradient, undampened
                else:
                    buf.mul_(spec.momentum).add_(g, alpha=1 - spec.dampening)
                g = g.add(buf, alpha=spec.momentum) if spec.nesterov else buf
            w.add_(g, alpha=-lr)
        else:
            b1, b2 = spec.betas
            if spec.weight_decay != 0:
                if spec.kind == "adamw":
                    w.mul_(1 - lr * spec.weight_decay)
                else:
                    g = g.add(w, alpha=spec.weight_decay)
            m, v = state["exp_avg"][s], state["exp_avg_sq"][s]
            m.lerp_(g, 1 - b1)
            v.mul_(b2).addcmul_(g, g, value=1 - b2)
            denom = v.sqrt().div_(bias_correction2_sqrt).add_(spec.eps)
            w.addcdiv_(m, denom, value=-step_size)
        if w is not o:
            o.copy_(w)
        if copy is not None:
            copy[s].copy_(o)
    return out


def adama_accumulate_reference(spec: OptimizerSpec, grad: torch.Tensor, state: dict[str, torch.Tensor], *,
                               scale: float | torch.Tensor = 1.0, first: bool) -> None:
    """Fold one micro-batch gradient into Adam's moments (AdamA, Zhang et al.).

    With ``g_i = scale * grad`` (``scale = 1/M`` for M micro-batches of a mean loss):
    at the first micro-batch of a step ``m = beta1*m``, ``v = beta2*v``; then for every micro-batch
    ``m += (1-beta1) * g_i`` and ``v += (1-beta2) * g_i**2``. So ``m`` ends as Adam's
    ``beta1*m + (1-beta1)*sum_i g_i`` but ``v`` as ``beta2*v + (1-beta2)*sum_i g_i**2``, not Adam's
    ``(sum_i g_i)**2``: the sum of squares is what lets each ``g_i`` be freed at once.
    """
    scale = check_adama_accumulate_args(spec, grad, state, scale)
    b1, b2 = spec.betas
    for s in _slices(grad.numel()):
        m, v = state["exp_avg"][s], state["exp_avg_sq"][s]
        if first:
            m.mul_(b1)
            v.mul_(b2)
        g = grad[s]
        if g.dtype == torch.float32 and not isinstance(scale, torch.Tensor):
            # No temporary at all (the point of AdamA): the scale goes into the constants, which
            # rounds within a few ulp of the kernel's (g*scale)*(1-beta) order.
            m.add_(g, alpha=(1 - b1) * scale)
            v.addcmul_(g, g, value=(1 - b2) * scale * scale)
        else:
            g = g.float() * scale
            m.add_(g, alpha=1 - b1)
            v.addcmul_(g, g, value=1 - b2)


def adama_update_reference(spec: OptimizerSpec, step: int, weights: torch.Tensor, out: torch.Tensor,
                           state: dict[str, torch.Tensor], *, lr: float | None = None) -> torch.Tensor:
    """AdamA's weight update from the folded moments, with Adam's bias corrections for ``step``.

    ``out = w*(1 - lr*wd) - lr/(1-beta1**t) * m / (sqrt(v)/sqrt(1-beta2**t) + eps)``
    (the decay factor only for AdamW). The moments are not touched.
    """
    lr = check_adama_update_args(spec, step, weights, out, state, lr)
    step_size, bias_correction2_sqrt = adam_scalars(spec, step, lr)
    for s in _slices(weights.numel()):
        o = out[s]
        w = _target(weights[s], o, torch.float32)
        if spec.kind == "adamw" and spec.weight_decay != 0:
            w.mul_(1 - lr * spec.weight_decay)
        denom = state["exp_avg_sq"][s].sqrt().div_(bias_correction2_sqrt).add_(spec.eps)
        w.addcdiv_(state["exp_avg"][s], denom, value=-step_size)
        if w is not o:
            o.copy_(w)
    return out
