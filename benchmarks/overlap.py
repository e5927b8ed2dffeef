"""Reduction overlap: how much of the cross-stage reductions' time the 2bw pipeline hides.

    python benchmarks/overlap.py             # about a minute on 2 CPU cores
    python benchmarks/overlap.py --steps 10  # shorter

Trains the demo GPT with 2bw on gloo ranks: its embedding and lm_head are tied, so the first and
last stage all-reduce that gradient; clipping makes every stage all-reduce its squared gradient
norm; with w = 2 every stage also all-reduces its gradients with its replica. fxpipe starts batch
t's reductions after its last backward (the cross-stage ones at cuts every rank reaches in the
same order, docs/design.md) and joins them (``*_WAIT`` actions) only before UPDATE t, while batch
t+1's forwards and backwards run. For each rank this prints:

* ``alone``: the same reductions (one batch's START and WAIT actions, run by the runtime's own
  code) with nothing else to do, all ranks in step — what they cost if nothing hid them;
* ``exposed``: the time per step the rank actually spent inside those START and WAIT actions
  while training (posting, and blocking on what had not finished: the part not hidden);
* ``hidden`` = 1 - exposed / alone, and the step time for scale.

Configurations: d=2 on 2 ranks (tied + norm) and d=2, w=2 on 4 ranks (data parallel + tied + norm).
Medians over the measured steps and over 10 standalone repetitions.
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


def _rank(rank: int, world: int, store: str, out: str, steps: int, width: int) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    import fxpipe
    from fxpipe.demo import GPT, GPTConfig, fibonacci_batch, lm_loss
    from fxpipe.schedule import STARTS, WAITS, Action

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    cfg = GPTConfig(n_layer=4, n_embd=128, vocab_size=2048, block_size=32)
    m, mb = 4, 4
    g = torch.Generator().manual_seed(0)
    batches = [fibonacci_batch(m * mb * width, 32, cfg.vocab_size, g) for _ in range(steps + 2)]
    torch.manual_seed(0)
    pipe = fxpipe.compile(GPT(cfg), (batches[0][0][:mb],), loss_fn=lm_loss, microbatches=m, stages=2,
                          optimizer=functools.partial(torch.optim.AdamW, lr=1e-3), max_grad_norm=1.0, verbose=False)
    for x, y in batches[:2]:  # warm-up: plan, build, connect, reach the steady state
        pipe.step(x, y)
    pipe.record = True
    pipe.timeline.clear()
    times = []
    for x, y in batches[2:]:  # no barrier here: 2bw ranks are legitimately a step apart
        t0 = time.perf_counter()
        pipe.step(x, y)
        times.append(time.perf_counter() - t0)
    pipe.flush()

    def family(a: Action) -> str:  # TIED_WAIT -> "TIED"
        return a.kind.value.rsplit("_", 1)[0]

    exposed: dict[str, float] = {}
    for _, name, start, end in pipe.timeline:
        a = Action.parse(name)
        if a.kind in STARTS or a.kind in WAITS:
            exposed[family(a)] = exposed.get(family(a), 0.0) + (end - start) / len(times)
    # The same reductions alone: replay one batch's START/WAIT actions, in list order, as a batch
    # number no step uses, every rank together; each action timed, summed per reduction.
    (r, wk), = pipe.workers.items()
    first_steps = [a for t in (1, 2) for a in pipe.program.segment(wk.index, t)] + pipe.program.drain(wk.index, 2)
    mine = [a for a in first_steps if (a.kind in STARTS or a.kind in WAITS) and a.index == 1]
    alone: dict[str, list[float]] = {}
    for rep in range(11):
        batch = 10**6 + rep
        dist.barrier()
        spent: dict[str, float] = {}
        for a in mine:
            t0 = time.perf_counter()
            wk.run(Action(a.stage, a.kind, batch))
            spent[family(a)] = spent.get(family(a), 0.0) + time.perf_counter() - t0
        if rep:  # the first repetition warms up
            for k, v in spent.items():
                alone.setdefault(k, []).append(v)
    row = [rank, statistics.median(times), {k: statistics.median(v) for k, v in alone.items()}, exposed]
    rows = [None] * world
    dist.all_gather_object(rows, row)
    if rank == 0:
        torch.save(rows, out)
    dist.destroy_process_group()


def run(world: int, width: int, steps: int) -> list:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.pt")
        mp.start_processes(_rank, args=(world, os.path.join(tmp, "store"), out, steps, width), nprocs=world,
                           start_method="spawn", join=True)
        return torch.load(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20)
    args = ap.parse_args()
    print(f"machine: {os.cpu_count()} cores, torch {torch.__version__}, gloo, 1 thread per rank\n")
    table = []
    for world, width, what in ((2, 1, "d=2"), (4, 2, "d=2 w=2")):
        for rank, step, alone, exposed in run(world, width, args.steps):
            for kind in ("DP", "TIED", "NORM"):
                if kind in alone:
                    table.append([what, rank, kind, step * 1e3, alone[kind] * 1e3, exposed.get(kind, 0.0) * 1e3,
                                  1 - exposed.get(kind, 0.0) / alone[kind]])
    print(tabulate(table, headers=["config", "rank", "reduction", "step ms", "alone ms", "exposed ms/step",
                                   "hidden"], floatfmt=".2f"))


if __name__ == "__main__":
    main()
