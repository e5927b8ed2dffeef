"""Soak: a long 2bw run must not slow down or grow, step after step.

    python benchmarks/soak.py                  # 20,000 steps, several minutes on 2 CPU cores
    python benchmarks/soak.py --steps 2000     # shorter

Four gloo ranks (one thread each) train a tiny demo GPT (2 layers, 16 wide, tied embedding) with
fxpipe: 2bw, d = 2 stages, w = 2 replicas, global-norm clipping, m = 2 micro-batches of 1
sequence. Every rank times each ``step``; the table shows, per window of 1,000 steps, the median
and slowest step (over ranks) and rank 0's resident memory at the window's end, then the slowest
single step of the run against the median. A schedule whose state grew with the run would show
rising step times, periodic stalls (regeneration) and rising memory.
"""

from __future__ import annotations

import argparse
import functools
import os
import resource
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from tabulate import tabulate

WINDOW = 1000


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def _rank(rank: int, world: int, store: str, out: str, steps: int) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    import fxpipe
    from fxpipe.demo import GPT, GPTConfig, fibonacci_batch, lm_loss

    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_embd=16, n_head=2, vocab_size=32, block_size=8))
    g = torch.Generator().manual_seed(0)
    batches = [fibonacci_batch(4, 8, 32, g) for _ in range(16)]  # m * w = 4 sequences per step
    pipe = fxpipe.compile(model, (batches[0][0][:1],), loss_fn=lm_loss, microbatches=2, stages=2,
                          schedule="2bw", max_grad_norm=1.0, verbose=False,
                          optimizer=functools.partial(torch.optim.AdamW, lr=1e-3))
    assert (pipe.plan.stages, pipe.plan.width) == (2, 2), pipe.plan
    times, rss = [], []
    for i in range(steps):
        x, y = batches[i % len(batches)]
        t0 = time.perf_counter()
        pipe.step(x, y)
        times.append(time.perf_counter() - t0)
        if (i + 1) % WINDOW == 0:
            rss.append(_rss_mib())
    pipe.flush()
    gathered = [None] * world
    dist.all_gather_object(gathered, (times, rss))
    if rank == 0:
        torch.save(gathered, out)
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20_000)
    args = ap.parse_args()
    world = 4
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.pt")
        mp.start_processes(_rank, args=(world, os.path.join(tmp, "store"), out, args.steps), nprocs=world,
                           start_method="spawn", join=True)
        per_rank = torch.load(out)
    times = [max(r[0][i] for r in per_rank) for i in range(args.steps)]  # a step is as slow as its slowest rank
    rows = []
    for w in range(args.steps // WINDOW):
        window = times[w * WINDOW:(w + 1) * WINDOW]
        rows.append([f"{w * WINDOW + 1}-{(w + 1) * WINDOW}", statistics.median(window) * 1e3, max(window) * 1e3,
                     per_rank[0][1][w]])
    median = statistics.median(times[WINDOW:] or times)
    worst = max(range(WINDOW, args.steps) if args.steps > WINDOW else range(args.steps), key=times.__getitem__)
    print(f"machine: {os.cpu_count()} cores, torch {torch.__version__}, gloo, 4 ranks x 1 thread; "
          f"tiny GPT, 2bw d=2 w=2 m=2, clip; {args.steps} steps\n")
    print(tabulate(rows, headers=["steps", "median ms/step", "slowest ms/step", "rank 0 RSS MiB"], floatfmt=".2f"))
    print(f"\nslowest single step after the first window: step {worst + 1}, {times[worst] * 1e3:.2f} ms "
          f"= {times[worst] / median:.1f}x the median ({median * 1e3:.2f} ms); "
          f"rank 0 RSS {per_rank[0][1][0]:.1f} -> {per_rank[0][1][-1]:.1f} MiB")


if __name__ == "__main__":
    main()
