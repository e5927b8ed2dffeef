"""Independent single-device references for the pipeline's update semantics (docs/design.md).

Nothing here imports fxpipe: these loops are what the pipelined numbers must equal.

* :func:`train_flush` — plain gradient-accumulation training, ``W(t+1) = W(t) - lr*grad f(W(t))``:
  what 1f1b (PipeDream-Flush) and gpipe must reproduce.
* :func:`train_2bw` — PipeDream-2BW, ``W(t+1) = W(t) - lr*grad f(W(t-1))``: batch ``t``'s
  gradient is computed on the weights after ``max(t-2, 0)`` updates and applied to the newest.
* :func:`train_mixed` — either of them with fp32 master weights, a 16-bit compute copy under
  ``torch.autocast``, fp32 gradient accumulation and (fp16) dynamic loss scaling.
* :func:`train_adama` — AdamA's optimizer accumulation, from the paper's equations.
"""

from __future__ import annotations

import copy

import torch


def _micro(batch, m):
    x, y = batch
    xs = [c for c in (x.chunk(m) if isinstance(x, torch.Tensor) else _chunk_dict(x, m))]
    ys = y.chunk(m) if isinstance(y, torch.Tensor) else [None] * m
    return list(zip(xs, ys))


def _chunk_dict(d, m):
    parts = {k: v.chunk(m) for k, v in d.items()}
    return [{k: parts[k][i] for k in d} for i in range(m)]


def _loss(model, x, y, loss_fn):
    out = model(**x) if isinstance(x, dict) else model(x)
    if loss_fn is None:
        return out.loss if hasattr(out, "loss") else out
    return loss_fn(out, y)


def _mean_grad(model, batch, m, loss_fn):
    """Mean gradient over the batch's m micro-batches (loss scaled by 1/m) and the mean loss."""
    model.zero_grad(set_to_none=True)
    total = 0.0
    for x, y in _micro(batch, m):
        loss = _loss(model, x, y, loss_fn)
        (loss / m).backward()
        total += float(loss.detach())
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}, total / m


def _clip(grads, max_norm):
    if max_norm is None:
        return grads
    norm = torch.sqrt(sum(g.double().pow(2).sum() for g in grads.values()))
    coef = min(1.0, max_norm / (float(norm) + 1e-6))
    return {n: g * coef for n, g in grads.items()}


def train_flush(model, batches, m, loss_fn, optimizer_factory, max_grad_norm=None):
    """Gradient accumulation over m micro-batches, one step per batch. Returns (losses, model)."""
    model = copy.deepcopy(model)
    opt = optimizer_factory(list(model.named_parameters()))
    losses = []
    for batch in batches:
        grads, loss = _mean_grad(model, batch, m, loss_fn)
        grads = _clip(grads, max_grad_norm)
        for n, p in model.named_parameters():
            p.grad = grads.get(n)
        opt.step()
        losses.append(loss)
    return losses, model


def train_2bw(model, batches, m, loss_fn, optimizer_factory, max_grad_norm=None):
    """W(t) = W(t-1) - lr * g_t where g_t is batch t's mean gradient at W(max(t-2, 0)).
    Buffers are not versioned: every forward reads and updates the one set (BatchNorm statistics
    advance once per micro-batch, in order, as in eager training). Returns (losses, model holding
    the newest weights and the buffers after the last forward)."""
    model = copy.deepcopy(model)
    opt = optimizer_factory(list(model.named_parameters()))
    snapshots = [{n: p.detach().clone() for n, p in model.named_parameters()}]  # snapshots[v] = W(v)
    probe = copy.deepcopy(model)  # computes gradients on an older version; owns the buffers
    losses = []
    for t, batch in enumerate(batches, start=1):
        with torch.no_grad():
            for n, p in probe.named_parameters():
                p.copy_(snapshots[max(t - 2, 0)][n])
        grads, loss = _mean_grad(probe, batch, m, loss_fn)
        grads = _clip(grads, max_grad_norm)
        for n, p in model.named_parameters():
            p.grad = grads.get(n)
        opt.step()
        snapshots.append({n: p.detach().clone() for n, p in model.named_parameters()})
        losses.append(loss)
    with torch.no_grad():
        for (_, b), (_, pb) in zip(model.named_buffers(), probe.named_buffers()):
            b.copy_(pb)
    return losses, model


def train_mixed(model, batches, m, loss_fn, optimizer_factory, *, dtype, schedule="2bw", device_type="cpu",
                scaler=None, max_grad_norm=None, cast_params=True):
    """Mixed precision as a careful single-device script does it: the optimizer steps fp32 master
    weights; each batch's forwards run a ``dtype`` copy of them under
    ``torch.autocast(device_type, dtype)`` (the loss too); each micro-batch's gradient (of the
    16-bit copy) is added into an fp32 sum (a frozen weight, or one no micro-batch reached, gets none, and the
    optimizer skips it, as in eager). Batch t computes on the copy of the master after
    ``max(t-2, 0)`` updates under 2bw, ``t-1`` otherwise. ``cast_params=False``: the copy stays
    fp32 and autocast alone rounds what its cast lists say, as in plain eager autocast (a
    BatchNorm model, whose batch_norm autocast runs on the fp32 parameters, needs it); a set of
    names: only those parameters' copies are ``dtype``. The
    returned master holds the buffers after the last forward (BatchNorm statistics).

    ``scaler``: None, or ``(init_scale, growth_factor, backoff_factor, growth_interval)`` for
    dynamic loss scaling with ``torch.amp.GradScaler``'s rule: a batch's backwards use the scale
    in force after the update that wrote the weights it reads; a non-finite gradient skips the
    update and backs the scale off. Returns (losses, master model, skipped batches)."""
    master = copy.deepcopy(model)
    opt = optimizer_factory(list(master.named_parameters()))
    probe = copy.deepcopy(model)  # the compute copy; owns the buffers
    for n, p in probe.named_parameters():
        low = cast_params if isinstance(cast_params, bool) else n in cast_params
        p.data = p.data.to(dtype if low else p.dtype)
    names = [n for n, _ in probe.named_parameters()]
    snapshots = [{n: p.detach().clone() for n, p in master.named_parameters()}]
    scale, tracker = (float(scaler[0]), 0) if scaler else (1.0, 0)
    scales = {0: scale}
    losses, skipped = [], []
    for t, batch in enumerate(batches, start=1):
        v = max(t - 2, 0) if schedule == "2bw" else t - 1
        with torch.no_grad():
            for n, p in probe.named_parameters():
                p.copy_(snapshots[v][n])
        s = scales[v]
        params = [p for _, p in probe.named_parameters()]
        grads = {n: torch.zeros_like(p, dtype=torch.float32) for n, p in zip(names, params) if p.requires_grad}
        reached = set()  # a weight no micro-batch reached gets no gradient (None), as in eager
        total = 0.0
        for x, y in _micro(batch, m):
            with torch.autocast(device_type, dtype=dtype):
                loss = _loss(probe, x, y, loss_fn)
            trainable = [(n, p) for n, p in zip(names, params) if p.requires_grad]  # frozen: no gradient
            gs = torch.autograd.grad(loss.float() * s / m, [p for _, p in trainable], allow_unused=True)
            for (n, _), g in zip(trainable, gs):
                if g is not None:
                    grads[n] += g.float()
                    reached.add(n)
            total += float(loss.detach().float())
        finite = all(bool(torch.isfinite(g).all()) for g in grads.values())
        if scaler:
            _, growth, backoff, interval = scaler
            if not finite:
                scale, tracker = scale * backoff, 0
            else:
                tracker += 1
                if tracker == interval:
                    scale, tracker = scale * growth, 0
            scales[t] = scale
        else:
            scales[t] = 1.0
        if finite:
            grads = _clip({n: g / s for n, g in grads.items()}, max_grad_norm)
            for n, p in master.named_parameters():
                p.grad = grads[n] if n in reached else None
            opt.step()
        else:
            skipped.append(t)
        snapshots.append({n: p.detach().clone() for n, p in master.named_parameters()})
        losses.append(total / m)
    with torch.no_grad():
        for (_, b), (_, pb) in zip(master.named_buffers(), probe.named_buffers()):
            b.copy_(pb)
    return losses, master, skipped


def train_adama(model, batches, m, loss_fn, *, lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
                schedule="2bw"):
    """AdamA (Zhang et al., "Adam Accumulation to Reduce Memory Footprints of both Activations and
    Gradients"), from the paper's equations: for the m micro-batch gradients g_i of a step (each of
    the loss / m), ``v1 = beta1*v1`` and ``v2 = beta2*v2`` once, then ``v1 += (1-beta1)*g_i`` and
    ``v2 += (1-beta2)*g_i**2`` for each; then AdamW's decoupled decay and
    ``w -= lr/(1-beta1**t) * v1 / (sqrt(v2)/sqrt(1-beta2**t) + eps)``. Batch t's gradients are
    taken at the weights after ``max(t-2, 0)`` updates under 2bw, ``t-1`` otherwise. Returns
    (losses, model)."""
    model = copy.deepcopy(model)
    probe = copy.deepcopy(model)
    b1, b2 = betas
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    v1 = {n: torch.zeros_like(p) for n, p in model.named_parameters() if p.requires_grad}
    v2 = {n: torch.zeros_like(p) for n, p in model.named_parameters() if p.requires_grad}
    snapshots = [{n: p.detach().clone() for n, p in model.named_parameters()}]
    losses = []
    for t, batch in enumerate(batches, start=1):
        v = max(t - 2, 0) if schedule == "2bw" else t - 1
        with torch.no_grad():
            for n, p in probe.named_parameters():
                p.copy_(snapshots[v][n])
        params = dict(probe.named_parameters())
        total = 0.0
        for i, (x, y) in enumerate(_micro(batch, m)):
            loss = _loss(probe, x, y, loss_fn)
            gs = torch.autograd.grad(loss / m, [params[n] for n in names], allow_unused=True)
            with torch.no_grad():
                for n, g in zip(names, gs):
                    g = torch.zeros_like(v1[n]) if g is None else g
                    if i == 0:
                        v1[n].mul_(b1)
                        v2[n].mul_(b2)
                    v1[n].add_((1 - b1) * g)
                    v2[n].add_((1 - b2) * g * g)
            total += float(loss.detach())
        with torch.no_grad():
            for n, p in model.named_parameters():
                if n not in v1:
                    continue
                p.mul_(1 - lr * weight_decay)
                denom = v2[n].sqrt() / (1 - b2 ** t) ** 0.5 + eps
                p.sub_(lr / (1 - b1 ** t) * v1[n] / denom)
        snapshots.append({n: p.detach().clone() for n, p in model.named_parameters()})
        losses.append(total / m)
    return losses, model
