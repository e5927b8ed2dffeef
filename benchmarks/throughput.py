"""Training throughput: fxpipe against torch.distributed.pipelining on the same ranks, side by side.

    python benchmarks/throughput.py              # about a minute on 2 CPU cores
    python benchmarks/throughput.py --steps 10   # shorter

One process group of 2 gloo ranks (one thread each) trains the demo GPT (untied embeddings, so
both libraries see the same plain model) with AdamW, m = 4 micro-batches of 8 sequences of 32
tokens per step, in turn with:

* ``torch.distributed.pipelining`` (PiPPy) ``Schedule1F1B``, split by hand before the middle block
  (its API needs a split point; it has no partitioner) — the baseline, ratio 1.00;
* fxpipe ``schedule="1f1b"`` (same schedule and numerics; fxpipe's planner picks the cut);
* fxpipe ``schedule="2bw"`` (no flush between steps);

and, for scale, plain single-process training (gradient accumulation, one thread) on rank 0 alone.
Each configuration runs twice, alternating, and reports its better median ms/step (steps after
two warm-up steps; a shared machine drifts). Prints ms/step, samples/s and the ratio.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from tabulate import tabulate

M, MB, SEQ = 4, 8, 32


def _model():
    from fxpipe.demo import GPT, GPTConfig

    torch.manual_seed(0)
    return GPT(GPTConfig(n_layer=4, n_embd=128, vocab_size=256, block_size=SEQ, tie_weights=False))


def _data(steps: int):
    from fxpipe.demo import fibonacci_batch

    g = torch.Generator().manual_seed(0)
    return [fibonacci_batch(M * MB, SEQ, 256, g) for _ in range(steps)]


def _pippy(rank: int, batches) -> list[float]:
    from torch.distributed.pipelining import Schedule1F1B, SplitPoint, pipeline

    from fxpipe.demo import lm_loss

    x0 = batches[0][0]
    pipe = pipeline(_model(), mb_args=(x0[:MB],), split_spec={"blocks.2": SplitPoint.BEGINNING})
    stage = pipe.build_stage(rank, torch.device("cpu"))
    opt = torch.optim.AdamW(stage.submod.parameters(), lr=1e-3)
    sched = Schedule1F1B(stage, M, loss_fn=lm_loss)
    times = []
    for x, y in batches:
        t0 = time.perf_counter()
        if rank == 0:
            sched.step(x)
        else:
            sched.step(target=y, losses=[])
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - t0)
    return times


def _fxpipe(schedule: str, batches) -> list[float]:
    import fxpipe
    from fxpipe.demo import lm_loss

    pipe = fxpipe.compile(_model(), (batches[0][0][:MB],), loss_fn=lm_loss, microbatches=M, stages=2,
                          schedule=schedule, optimizer=functools.partial(torch.optim.AdamW, lr=1e-3), verbose=False)
    times = []
    for x, y in batches:
        t0 = time.perf_counter()
        pipe.step(x, y)
        times.append(time.perf_counter() - t0)
    pipe.flush()
    return times


def _single(batches) -> list[float]:
    from fxpipe.demo import lm_loss

    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    times = []
    for x, y in batches:
        t0 = time.perf_counter()
        for xs, ys in zip(x.chunk(M), y.chunk(M)):
            (lm_loss(model(xs), ys) / M).backward()
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - t0)
    return times


def _rank(rank: int, world: int, store: str, out: str, steps: int) -> None:
    from fxpipe.device import settle_heap

    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    settle_heap()  # before any system runs, as fxpipe's compile would for the ones after it
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    batches = _data(steps + 2)
    results: dict[str, list[float]] = {}
    for _ in range(2):
        for name, fn in (("pippy", lambda: _pippy(rank, batches)), ("fxpipe 1f1b", lambda: _fxpipe("1f1b", batches)),
                         ("fxpipe 2bw", lambda: _fxpipe("2bw", batches))):
            dist.barrier()
            times = fn()
            results.setdefault(name, []).append(statistics.median(times[2:]))
        dist.barrier()
        if rank == 0:
            results.setdefault("single", []).append(statistics.median(_single(batches)[2:]))
        dist.barrier()
    # a step ends on different ranks at different times: the slower rank's median is the rate
    gathered = [None] * world
    dist.all_gather_object(gathered, results)
    if rank == 0:
        torch.save(gathered, out)
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.pt")
        mp.start_processes(_rank, args=(2, os.path.join(tmp, "store"), out, args.steps), nprocs=2,
                           start_method="spawn", join=True)
        per_rank = torch.load(out)
    best = {name: max(min(r[name]) for r in per_rank if name in r) for name in per_rank[0]}
    base = best["pippy"]
    samples = M * MB
    rows = [[name, world, best[name] * 1e3, samples / best[name], base / best[name]]
            for name, world in (("single", 1), ("pippy", 2), ("fxpipe 1f1b", 2), ("fxpipe 2bw", 2))]
    rows[0][0] = "plain torch, one process (for scale)"
    rows[1][0] = "torch.distributed.pipelining Schedule1F1B (baseline)"
    print(f"machine: {os.cpu_count()} cores, torch {torch.__version__}, gloo, 1 thread per rank; "
          f"demo GPT 4x128, {M} micro-batches of {MB}x{SEQ} tokens, AdamW\n")
    print(tabulate(rows, headers=["", "ranks", "ms/step", "samples/s", "vs baseline"], floatfmt=".2f"))


if __name__ == "__main__":
    main()
