"""Checkpoint-and-resume runs shared by the single-process and the multi-process tests.

A tiny GPT (tied embedding, optional dropout) trained with AdamW, a LambdaLR schedule and
clipping. :func:`run` trains ``steps`` batches of the fixed data stream from step ``start``
(loading the checkpoint at ``load`` first, saving at ``save`` after), and returns what a
comparison needs: the per-step losses and the final weights in float64.
"""

from __future__ import annotations

import functools

import torch

GLOBAL_BATCH = 8  # sequences per step: m * b * w for every layout the tests use
SEQ = 8


def model(dropout: float = 0.1):
    from fxpipe.demo import GPT, GPTConfig

    torch.manual_seed(0)
    return GPT(GPTConfig(n_layer=2, n_embd=16, n_head=2, vocab_size=32, block_size=SEQ, dropout=dropout))


def batch(step: int):
    """The data stream: batch ``step`` (1-based) of every run, whatever its layout."""
    from fxpipe.demo import fibonacci_batch

    return fibonacci_batch(GLOBAL_BATCH, SEQ, 32, torch.Generator().manual_seed(1000 + step))


def compile(schedule: str, stages: int, microbatches: int, *, width: int = 1, dropout: float = 0.1, lazy: bool = False,
            kernels: str = "off", world: int | None = None, dtype: torch.dtype = torch.float32, trainable=None,
            **options):
    """The pipeline of one layout (``optimizer``, ``lr_scheduler``, ``loss_fn``: the defaults
    above unless given; ``trainable(name)``: whether a parameter trains, by default all).
    ``world``: ranks of the process group (None: one process, where ``width`` > 1 comes from a
    plan made for ``stages * width`` ranks). Runs of different layouts are compared in float64
    (``dtype``): the attention key bias has a zero gradient, and Adam turns float32 rounding noise
    there into lr-sized steps that depend on summation order."""
    import fxpipe
    from fxpipe.demo import lm_loss

    net = model(dropout).to(dtype)
    for n, p in net.named_parameters():
        p.requires_grad_(trainable is None or trainable(n))
    b = GLOBAL_BATCH // (microbatches * width)
    example = (batch(0)[0][:b],)
    plan = None
    if world is None and width > 1:
        plan = fxpipe.plan(net, example, stages=stages, microbatches=microbatches, schedule=schedule,
                           world_size=stages * width, clip=True)
    return fxpipe.compile(
        net, None if lazy else example, loss_fn=options.pop("loss_fn", lm_loss), microbatches=microbatches, schedule=schedule,
        stages=None if plan is not None else stages, plan=plan, max_grad_norm=0.5, verbose=False, kernels=kernels,
        optimizer=options.pop("optimizer", functools.partial(torch.optim.AdamW, lr=1e-2, weight_decay=0.1)),
        lr_scheduler=options.pop("lr_scheduler", schedule_lr), **options,
    )


def schedule_lr(opt):
    """The default lr schedule: ``lr / (1 + 0.3 s)`` after ``s`` updates."""
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1.0 + 0.3 * s))


def run(pipe, start: int, steps: int, *, load: str | None = None, save: str | None = None) -> dict:
    """Train batches ``start+1 .. start+steps``; returns losses and the final float64 weights."""
    extra = pipe.load(load) if load else None
    if extra is not None:
        assert extra == {"next_batch": start + 1}, extra
    losses = [float(pipe.step(*batch(t))) for t in range(start + 1, start + steps + 1)]
    if save:
        pipe.save(save, extra={"next_batch": start + steps + 1})
        pipe.wait_for_checkpoint()
    state = {k: v.double() for k, v in pipe.state_dict().items()}
    return {"losses": losses, "state": state, "steps": pipe.steps}


def max_rel_diff(a: dict, b: dict) -> float:
    """Largest relative difference of per-step losses and of every weight."""
    worst = 0.0
    for x, y in zip(a["losses"], b["losses"]):
        worst = max(worst, abs(x - y) / max(abs(y), 1e-12))
    for k in b["state"]:
        x, y = a["state"][k], b["state"][k]
        worst = max(worst, float(((x - y).abs().max() / y.abs().max().clamp_min(1e-12))))
    return worst


def poisoning(backward, batch: int = 3):
    """``backward`` (``StageWorker._do_b``, or zb's ``_do_w``, which accumulates a split backward's
    weight gradients) that then, after stage 1's first backward of ``batch``, writes a NaN into one
    of that stage's weight gradients of ``batch``."""

    def run(self, a):
        backward(self, a)
        if self.index == 1 and a.index == (batch - 1) * self.cfg.microbatches + 1:
            views = self.store.grad_views_of(batch)
            views[next(s.name for s in self.store.layout.slots if s.requires_grad)].view(-1)[0] = float("nan")

    return run
