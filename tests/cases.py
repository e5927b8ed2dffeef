"""Training cases shared by the single-process and the multi-process pipeline tests.

A :class:`Case` names a model, a schedule, a depth/width and an optimizer; :func:`build` makes
the model, the data and the callables deterministically (so every rank and the reference build
the same things), and :func:`reference` trains the same model with the independent loops of
``tests/reference.py``. :func:`compare` returns a list of human-readable mismatches.
"""

from __future__ import annotations

import functools
import random
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tests.models import bert_tiny, cnn_bn, gpt2_tiny, llama_tiny, resnet_tiny, rmsnorm_residual
from tests.reference import train_2bw, train_flush


@dataclass(frozen=True)
class Case:
    name: str
    # "rmsnorm" (x * weight saved by reference), "gpt2" (tied weights), "llama", "bert" (mask input),
    # "cnn" and "resnet" (BatchNorm: buffers every forward updates)
    model: str = "rmsnorm"
    schedule: str = "2bw"
    stages: int = 2
    width: int = 1
    microbatches: int = 4
    # "sgd" (momentum), "adamw", "groups" (AdamW, no decay on biases/norms).
    optimizer: str = "sgd"
    max_grad_norm: float | None = None
    recompute: bool = False
    steps: int = 10
    mb: int = 2  # micro-batch size
    # The Hugging Face models train with Adam in float64. Adam divides each gradient by its own
    # running RMS, so a gradient element that is (nearly) zero turns float32 rounding noise into
    # steps of ~lr whose sign depends on summation order. GPT-2's attention key bias has a
    # mathematically zero gradient (softmax ignores a shift shared by all keys), so any two
    # correct implementations differ there by ~1e-3; Llama's exported graph sums some gradient
    # contributions in another order than eager (~1e-11 apart), which Adam lifts to ~1e-5. In
    # float64 the noise is far below eps and the comparison is as sharp as for every other case.
    dtype: torch.dtype = torch.float32
    # With dropout no single-device reference draws the same masks: such a case is compared with
    # the same pipeline run in ONE process (fxpipe seeds per (seed, micro-batch, stage)).
    dropout: float = 0.0
    # forwards every stage but the last runs ahead of 1F1B's order (None: the planner's: 1 under
    # 2bw with m > d, else 0); the numbers must not change
    lookahead: int | None = None
    # stages per rank (interleaved 1F1B, 1f1b only): ``stages`` counts them all
    chunks: int | None = None

    @property
    def lanes(self) -> int:
        """Ranks per replica."""
        return self.stages // (self.chunks or 1)


def _groups_factory(named, lr=2e-2):
    """A name-based parameter-group factory: no weight decay for biases and norm weights."""
    decay, no_decay = [], []
    for name, p in named:
        (no_decay if name.endswith("bias") or "norm" in name or "ln" in name else decay).append(p)
    return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}], lr=lr)


def optimizer_factory(kind: str):
    if kind == "sgd":
        return functools.partial(torch.optim.SGD, lr=0.05, momentum=0.9)
    if kind == "adamw":
        return functools.partial(torch.optim.AdamW, lr=2e-2)
    if kind == "groups":
        return _groups_factory
    raise ValueError(kind)


def lm_loss(out, y):
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))


def build(case: Case):
    """(model, example_inputs, batches, loss_fn, optimizer_factory); batches are (inputs, target)."""
    g = torch.Generator().manual_seed(1234)
    n = case.microbatches * case.width * case.mb
    if case.model == "rmsnorm":
        model, example = rmsnorm_residual(batch=case.mb, dropout=case.dropout)
        batches = [
            (torch.randint(0, 50, (n, 8), generator=g), torch.randint(0, 50, (n, 8), generator=g))
            for _ in range(case.steps)
        ]
        loss_fn = lm_loss
    elif case.model == "cnn":
        model, example = cnn_bn(batch=case.mb)
        batches = [(torch.randn(n, 3, 8, 8, generator=g), torch.randint(0, 10, (n,), generator=g)) for _ in range(case.steps)]
        loss_fn = F.cross_entropy
    elif case.model == "resnet":
        model, example = resnet_tiny(batch=case.mb, labels=True)
        batches = [({"pixel_values": torch.randn(n, 3, 16, 16, generator=g), "labels": torch.randint(0, 10, (n,), generator=g)}, None)
                   for _ in range(case.steps)]
        loss_fn = None
    elif case.model == "bert":
        model, example = bert_tiny(batch=case.mb, seq=8, labels=True)
        batches = []
        for _ in range(case.steps):
            ids = torch.randint(0, 100, (n, 8), generator=g)
            mask = (torch.rand(n, 8, generator=g) > 0.2).long()  # padding the later stages must see
            mask[:, 0] = 1
            batches.append(({"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}, None))
        loss_fn = None
    elif case.model in ("gpt2", "llama"):
        factory = gpt2_tiny if case.model == "gpt2" else llama_tiny
        model, example = factory(batch=case.mb, seq=8, labels=True, dropout=case.dropout)
        batches = []
        for _ in range(case.steps):
            ids = torch.randint(0, 100, (n, 8), generator=g)
            batches.append(({"input_ids": ids, "labels": ids.clone()}, None))
        loss_fn = None  # the model's own .loss
    else:
        raise ValueError(case.model)
    model = model.to(case.dtype)
    if case.dtype != torch.float32:  # float inputs (images) in the model's dtype too
        from torch.utils._pytree import tree_map

        cast = functools.partial(tree_map, lambda v: v.to(case.dtype) if torch.is_tensor(v) and v.is_floating_point() else v)
        example, batches = cast(example), cast(batches)
    return model, example, batches, loss_fn, optimizer_factory(case.optimizer)


def single_process(case: Case, **extra):
    """(per-step losses, state dict) of ``case`` pipelined with every stage in this process."""
    import fxpipe

    model, example, batches, loss_fn, opt = build(case)
    pipe = fxpipe.compile(
        model, example, loss_fn=loss_fn, optimizer=opt, microbatches=case.microbatches, schedule=case.schedule,
        stages=case.stages, max_grad_norm=case.max_grad_norm, recompute=case.recompute or None, verbose=False,
        lookahead=case.lookahead, chunks=case.chunks, **extra,
    )
    return [pipe.step(x, y) for x, y in batches], pipe.state_dict()


def reference(case: Case, device: str = "cpu"):
    """(per-step losses, final state dict on the CPU) of the single-device reference, trained on
    ``device``."""
    model, _, batches, loss_fn, opt = build(case)
    if device != "cpu":
        model = model.to(device)
        batches = [tuple(_to(part, device) for part in batch) for batch in batches]
    train = train_2bw if case.schedule == "2bw" else train_flush
    m = case.microbatches * case.width  # w replicas of m micro-batches = one batch of m*w
    losses, trained = train(model, batches, m, loss_fn, opt, max_grad_norm=case.max_grad_norm)
    return losses, {k: v.cpu() for k, v in trained.state_dict().items()}


def _to(x, device):
    if isinstance(x, dict):
        return {k: v.to(device) for k, v in x.items()}
    return x.to(device) if isinstance(x, torch.Tensor) else x


def compare(case: Case, losses, state, rtol: float = 1e-5, device: str = "cpu") -> list[str]:
    """Mismatches between a pipelined run and the reference (trained on ``device``), each naming
    the step or key."""
    ref_losses, ref_state = reference(case, device)
    bad = []
    for t, (a, b) in enumerate(zip(losses, ref_losses), start=1):
        if abs(a - b) > rtol * max(abs(b), 1e-12):
            bad.append(f"{case.name}: step {t} loss {a!r} != reference {b!r}")
    if len(losses) != len(ref_losses):
        bad.append(f"{case.name}: {len(losses)} losses, reference has {len(ref_losses)}")
    for key, ref in ref_state.items():
        if key not in state:
            bad.append(f"{case.name}: state_dict lacks {key!r}")
            continue
        if not ref.is_floating_point():  # e.g. BatchNorm's num_batches_tracked
            if not torch.equal(state[key], ref):
                bad.append(f"{case.name}: {key!r} is {state[key].tolist()}, reference {ref.tolist()}")
            continue
        if key not in state:
            bad.append(f"{case.name}: state_dict lacks {key!r}")
            continue
        err = (state[key].float() - ref.float()).abs().max().item()
        # Relative to the parameter's size, but never below 1e-4: a parameter whose true value
        # stays exactly 0 (BERT's key bias: softmax ignores it, so its gradient is rounding noise
        # and it drifts to ~1e-11 in any implementation) is then compared absolutely at 1e-9.
        scale = max(ref.float().abs().max().item(), 1e-4)
        if err > rtol * scale:
            bad.append(f"{case.name}: parameter {key!r} differs from the reference by {err:.3g} (scale {scale:.3g})")
    return bad


CASES = {
    c.name: c
    for c in [
        # single-process and 2-rank cases (d = 2)
        Case("2bw_sgd", schedule="2bw", optimizer="sgd"),
        Case("2bw_adamw_clip", schedule="2bw", optimizer="adamw", max_grad_norm=0.5),
        Case("2bw_groups", schedule="2bw", optimizer="groups"),
        Case("2bw_recompute", schedule="2bw", optimizer="sgd", recompute=True),
        Case("1f1b_sgd", schedule="1f1b", optimizer="sgd"),
        Case("1f1b_adamw", schedule="1f1b", optimizer="adamw", max_grad_norm=0.5),
        Case("gpipe_sgd", schedule="gpipe", optimizer="sgd"),
        Case("gpipe_adamw", schedule="gpipe", optimizer="adamw"),
        Case("gpt2_2bw", model="gpt2", schedule="2bw", optimizer="sgd", max_grad_norm=1.0),
        Case("gpt2_1f1b", model="gpt2", schedule="1f1b", optimizer="sgd"),
        Case("gpt2_2bw_adamw", model="gpt2", schedule="2bw", optimizer="groups", max_grad_norm=1.0, dtype=torch.float64),
        Case("gpt2_1f1b_adamw", model="gpt2", schedule="1f1b", optimizer="adamw", dtype=torch.float64),
        Case("llama_2bw_adamw", model="llama", schedule="2bw", optimizer="groups", max_grad_norm=1.0, dtype=torch.float64),
        Case("llama_1f1b_sgd", model="llama", schedule="1f1b", optimizer="sgd"),
        Case("bert_2bw", model="bert", schedule="2bw", optimizer="sgd", max_grad_norm=1.0),
        # zb (ZB-H1): 1f1b's numbers with the drain's backwards split into I and a deferred W
        Case("zb_adamw_clip", schedule="zb", optimizer="adamw", max_grad_norm=0.5),
        Case("zb_recompute", schedule="zb", optimizer="sgd", recompute=True),
        Case("gpt2_zb", model="gpt2", schedule="zb", optimizer="sgd", max_grad_norm=1.0),
        Case("gpt2_zb_adamw", model="gpt2", schedule="zb", optimizer="groups", max_grad_norm=1.0, dtype=torch.float64),
        Case("d4_gpt2_zb", model="gpt2", schedule="zb", stages=4, optimizer="sgd", max_grad_norm=1.0),
        Case("d4_llama_zb_recompute", model="llama", schedule="zb", stages=4, optimizer="adamw", recompute=True,
             dtype=torch.float64),
        # fewer micro-batches than stages (1f1b and zb take it; stage s holds min(d - s, m))
        Case("d4_m2_gpt2_1f1b", model="gpt2", schedule="1f1b", stages=4, microbatches=2, optimizer="sgd",
             max_grad_norm=1.0),
        Case("d4_m3_gpt2_zb", model="gpt2", schedule="zb", stages=4, microbatches=3, optimizer="adamw",
             dtype=torch.float64),
        # lookahead (2bw's default is 1 here): 1F1B's own order, one forward ahead under 1f1b,
        # two ahead on three stages with recomputation
        Case("2bw_adamw_lookahead0", schedule="2bw", optimizer="adamw", max_grad_norm=0.5, lookahead=0),
        Case("1f1b_adamw_lookahead1", schedule="1f1b", optimizer="adamw", max_grad_norm=0.5, lookahead=1),
        Case("d3_m6_gpt2_2bw_lookahead2", model="gpt2", schedule="2bw", stages=3, microbatches=6, optimizer="sgd",
             max_grad_norm=1.0, recompute=True, lookahead=2),
        # three stages
        Case("d3_2bw_sgd", schedule="2bw", stages=3, optimizer="sgd", max_grad_norm=0.5),
        Case("d3_2bw_adamw", schedule="2bw", stages=3, optimizer="groups"),
        Case("d3_gpt2_2bw", model="gpt2", schedule="2bw", stages=3, optimizer="sgd", max_grad_norm=1.0),
        Case("d3_gpt2_2bw_adamw", model="gpt2", schedule="2bw", stages=3, optimizer="adamw", dtype=torch.float64),
        Case("d3_llama_2bw_adamw", model="llama", schedule="2bw", stages=3, optimizer="adamw", dtype=torch.float64),
        # data parallel: w = 2 replicas of a 2-stage pipeline (4 ranks)
        Case("w2_2bw_adamw", schedule="2bw", stages=2, width=2, optimizer="adamw", max_grad_norm=0.5),
        Case("w2_1f1b_sgd", schedule="1f1b", stages=2, width=2, optimizer="sgd"),
        Case("w2_gpt2_2bw", model="gpt2", schedule="2bw", stages=2, width=2, optimizer="sgd", max_grad_norm=1.0),
        Case("w2_gpipe_recompute", schedule="gpipe", stages=2, width=2, optimizer="sgd", recompute=True),
        # dropout: compared with the single-process run, not the references
        Case("dropout_2bw", model="gpt2", schedule="2bw", optimizer="adamw", dropout=0.2, recompute=True),
        Case("d3_dropout_1f1b", schedule="1f1b", stages=3, optimizer="sgd", dropout=0.3),
        # four stages: the tied weight spans stages 0 and 3, recomputation everywhere
        Case("d4_gpt2_2bw", model="gpt2", schedule="2bw", stages=4, optimizer="sgd", max_grad_norm=1.0, recompute=True),
        # interleaved 1F1B: several stages per rank (Case.chunks), on stages / chunks ranks
        Case("i2_gpt2_1f1b", model="gpt2", schedule="1f1b", stages=4, chunks=2, optimizer="sgd", max_grad_norm=1.0),
        Case("i2_adamw_clip", schedule="1f1b", stages=4, chunks=2, optimizer="adamw", max_grad_norm=0.5),
        Case("i2_llama_recompute", model="llama", schedule="1f1b", stages=4, chunks=2, optimizer="adamw",
             recompute=True, dtype=torch.float64),
        Case("i3_gpt2_1f1b", model="gpt2", schedule="1f1b", stages=6, chunks=3, optimizer="groups",
             dtype=torch.float64),
        Case("i2_d3_m6_1f1b", schedule="1f1b", stages=6, chunks=2, microbatches=6, optimizer="sgd", max_grad_norm=0.5),
        Case("i2_w2_gpt2_1f1b", model="gpt2", schedule="1f1b", stages=4, width=2, chunks=2, optimizer="sgd",
             max_grad_norm=1.0),
        Case("i2_dropout_1f1b", model="gpt2", schedule="1f1b", stages=4, chunks=2, optimizer="adamw", dropout=0.2),
        # buffers a forward updates (BatchNorm statistics) or reads (BERT's position ids), with
        # recomputation: weights AND running statistics equal eager training
        Case("cnn_2bw_recompute", model="cnn", schedule="2bw", optimizer="sgd", recompute=True, steps=6),
        Case("cnn_1f1b_recompute", model="cnn", schedule="1f1b", optimizer="adamw", recompute=True, steps=6),
        Case("cnn_gpipe_recompute", model="cnn", schedule="gpipe", optimizer="sgd", recompute=True, steps=6),
        Case("resnet_2bw_recompute", model="resnet", schedule="2bw", optimizer="sgd", recompute=True, steps=6),
        Case("resnet_1f1b_recompute", model="resnet", schedule="1f1b", optimizer="sgd", recompute=True, steps=6),
        Case("resnet_gpipe_recompute", model="resnet", schedule="gpipe", optimizer="sgd", recompute=True, steps=6),
        # zb splits their backwards: convolutions' and gains' weight gradients computed by W itself
        # (float64: zb adds the deferred Ws' gradients last, and the convolutions' biases before
        # BatchNorm have a zero gradient that AdamW turns from float32 rounding into lr-sized steps)
        Case("cnn_zb", model="cnn", schedule="zb", optimizer="adamw", steps=6, dtype=torch.float64),
        Case("resnet_zb", model="resnet", schedule="zb", optimizer="sgd", steps=6),
        Case("bert_2bw_recompute", model="bert", schedule="2bw", optimizer="sgd", recompute=True, steps=6),
        Case("bert_1f1b_recompute", model="bert", schedule="1f1b", optimizer="sgd", recompute=True, steps=6),
        Case("bert_gpipe_recompute", model="bert", schedule="gpipe", optimizer="sgd", recompute=True, steps=6),
    ]
}


MODELS = ("rmsnorm", "gpt2", "llama", "bert", "cnn", "resnet")


def draw(seed: int, count: int, world: int = 1) -> list[Case]:
    """``count`` seeded random combinations of model, schedule, depth, micro-batch count,
    optimizer, clipping, recomputation and lookahead, each a :class:`Case` named by its draw.
    ``world`` 1: every stage in one process, d of 2-4; else d divides ``world`` and the width is
    ``world / d``. With w > 1 no BatchNorm model is drawn: each replica keeps its own running
    statistics, as DDP without buffer broadcast, which no single-device reference does."""
    from fxpipe.schedule import LOOKAHEAD_SCHEDULES, SCHEDULES, min_microbatches

    rng = random.Random(seed)
    depths = (2, 3, 4) if world == 1 else tuple(d for d in (2, 3, 4) if world % d == 0)
    cases = []
    for i in range(count):
        schedule, d = rng.choice(SCHEDULES), rng.choice(depths)
        w = 1 if world == 1 else world // d
        model = rng.choice(MODELS if w == 1 else tuple(m for m in MODELS if m not in ("cnn", "resnet")))
        lookahead = rng.choice((None, 0, 1)) if schedule in LOOKAHEAD_SCHEDULES else None
        least = min_microbatches(schedule, d, lookahead or 0)
        m = rng.choice(sorted({least, d + 1, 2 * d} - set(range(least))))
        optimizer = rng.choice(("sgd", "adamw", "groups"))
        clip, recompute = rng.choice((None, 0.5)), rng.choice((False, True))
        # Adam turns float32 rounding of zero gradients (GPT-2's key bias, a bias feeding a
        # BatchNorm) into lr-sized steps: those runs compare in float64 (see Case.dtype)
        dtype = torch.float32 if optimizer == "sgd" else torch.float64
        name = f"random{world}-{i}-{model}-{schedule}-d{d}" + (f"w{w}" if w > 1 else "") + f"-m{m}-{optimizer}"
        name += ("-clip" if clip else "") + ("-recompute" if recompute else "")
        name += "" if lookahead is None else f"-lookahead{lookahead}"
        cases.append(Case(name, model=model, schedule=schedule, stages=d, width=w, microbatches=m,
                          optimizer=optimizer, max_grad_norm=clip, recompute=recompute, steps=4, dtype=dtype,
                          lookahead=lookahead))
    return cases


# Drawn cases for gloo ranks (tests/dist/test_pipeline_dist.py): registered here, since every
# spawned rank looks its cases up by name.
RANDOM_SEED = 2026
RANDOM = {world: draw(RANDOM_SEED + world, count, world) for world, count in ((2, 12), (4, 12))}
CASES.update((c.name, c) for cases in RANDOM.values() for c in cases)


def eval_loss(case: Case, state) -> float:
    """Mean loss of the first batch's micro-batches under ``state``, model in eval mode."""
    import torch

    model, _, batches, loss_fn, _ = build(case)
    model.load_state_dict(state)
    model.eval()
    x, y = batches[0]
    m = case.microbatches * case.width
    xs = [dict(zip(x, parts)) for parts in zip(*(v.chunk(m) for v in x.values()))] if isinstance(x, dict) else x.chunk(m)
    ys = y.chunk(m) if y is not None else [None] * m
    with torch.no_grad():
        losses = [
            (model(**xi).loss if loss_fn is None else loss_fn(model(xi), yi)) for xi, yi in zip(xs, ys)
        ]
    return float(sum(float(v) for v in losses) / m)


# ---------------------------------------------------------------------------------------------
# mixed precision: the demo GPT, GPT-2 (tied weights) and Llama, 20 AdamW steps at lr 2e-4

MIXED_STEPS = 20


def build_mixed(model: str, steps: int = MIXED_STEPS, microbatches: int = 4, mb: int = 2):
    """(model, example, batches, loss_fn, optimizer_factory) for the mixed-precision tests."""
    g = torch.Generator().manual_seed(7)
    n = microbatches * mb
    opt = functools.partial(torch.optim.AdamW, lr=2e-4)
    if model == "gpt":
        from fxpipe.demo import GPT, GPTConfig, fibonacci_batch
        from fxpipe.demo import lm_loss as demo_loss

        torch.manual_seed(0)
        net = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32))
        batches = [fibonacci_batch(n, 16, 64, g) for _ in range(steps)]
        return net, (batches[0][0][:mb],), batches, demo_loss, opt
    net, example = {"gpt2": gpt2_tiny, "llama": llama_tiny}[model](batch=mb)
    ids = [torch.randint(0, 100, (n, example["input_ids"].shape[1]), generator=g) for _ in range(steps)]
    example = {"input_ids": ids[0][:mb], "labels": ids[0][:mb]}
    return net, example, [({"input_ids": x, "labels": x}, None) for x in ids], None, opt


def relative_update_error(initial: dict, final: dict, reference: dict) -> float:
    """||dW - dW_ref|| / ||dW_ref|| over all parameters, dW = final - initial (float64, on the
    CPU: ``Pipeline.state_dict`` gives CPU tensors, a reference trained on a GPU has its own)."""
    num = den = 0.0
    for n, w0 in initial.items():
        w0 = w0.detach().cpu().double()
        d_ref = reference[n].detach().cpu().double() - w0
        num += float((final[n].detach().cpu().double() - w0 - d_ref).pow(2).sum())
        den += float(d_ref.pow(2).sum())
    return (num / den) ** 0.5
