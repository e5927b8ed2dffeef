"""Soak: a long 2bw run must not slow down or grow, step after step.

    python benchmarks/soak.py                  # 20,000 steps, several minutes on 2 CPU cores
    python benchmarks/soak.py --steps 2000     # shorter
    python benchmarks/soak.py --save-every 500 # and a checkpoint every 500 steps, the 2 newest kept
    python benchmarks/soak.py --schedule zb --microbatches 4   # another schedule, another m

Four gloo ranks (one thread each) train a tiny demo GPT (2 layers, 16 wide, tied embedding) with
fxpipe: 2bw (or ``--schedule``), d = 2 stages, w = 2 replicas, global-norm clipping, m = 2
micro-batches (or ``--microbatches``) of 1 sequence. Every rank times each ``step``; the table
shows, per window of 1,000 steps, the median and slowest step (over ranks) and rank 0's and the
largest rank's resident memory at the window's end, then the slowest
single step of the run against the median. A schedule whose state grew with the run would show
rising step times, periodic stalls (regeneration) and rising memory. With ``--save-every N``
every rank also calls ``pipe.save(dir, keep=2)`` every N steps (an asynchronous write beside
training), and the table adds the checkpoints on disk at each window's end and the steps that
saved, timed apart: the disk must stay bounded and memory must not grow with the saves.
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


def _disk(root: str) -> tuple[int, float]:
    """(checkpoints, MiB) under ``root``."""
    dirs = [d for d in os.listdir(root) if d.startswith("step-")]
    size = sum(os.path.getsize(os.path.join(path, f)) for path, _, files in os.walk(root) for f in files)
    return len(dirs), size / 2**20


def _rank(rank: int, world: int, store: str, out: str, steps: int, save_every: int, ckpt: str, schedule: str,
          m: int) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    import fxpipe
    from fxpipe.demo import GPT, GPTConfig, fibonacci_batch, lm_loss

    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_embd=16, n_head=2, vocab_size=32, block_size=8))
    g = torch.Generator().manual_seed(0)
    batches = [fibonacci_batch(m * 2, 8, 32, g) for _ in range(16)]  # m * w sequences per step
    pipe = fxpipe.compile(model, (batches[0][0][:1],), loss_fn=lm_loss, microbatches=m, stages=2,
                          schedule=schedule, max_grad_norm=1.0, verbose=False,
                          optimizer=functools.partial(torch.optim.AdamW, lr=1e-3))
    assert (pipe.plan.stages, pipe.plan.width) == (2, 2), pipe.plan
    times, rss, disk = [], [], []
    for i in range(steps):
        x, y = batches[i % len(batches)]
        t0 = time.perf_counter()
        pipe.step(x, y)
        if save_every and (i + 1) % save_every == 0:
            pipe.save(ckpt, keep=2)  # returns once the state is in host memory; a thread writes
        times.append(time.perf_counter() - t0)
        if (i + 1) % WINDOW == 0:
            rss.append(_rss_mib())
            if save_every and rank == 0:
                disk.append(_disk(ckpt))
    pipe.wait_for_checkpoint()
    pipe.flush()
    gathered = [None] * world
    dist.all_gather_object(gathered, (times, rss, disk))
    if rank == 0:
        torch.save(gathered, out)
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20_000)
    ap.add_argument("--save-every", type=int, default=0, help="steps between checkpoints (0: none); 2 are kept")
    ap.add_argument("--schedule", default="2bw", choices=["2bw", "1f1b", "gpipe", "zb"])
    ap.add_argument("--microbatches", type=int, default=2, help="m, micro-batches of one sequence per replica")
    args = ap.parse_args()
    world = 4
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.pt")
        mp.start_processes(_rank, args=(world, os.path.join(tmp, "store"), out, args.steps, args.save_every,
                                        os.path.join(tmp, "checkpoints"), args.schedule, args.microbatches),
                           nprocs=world, start_method="spawn", join=True)
        per_rank = torch.load(out)
    times = [max(r[0][i] for r in per_rank) for i in range(args.steps)]  # a step is as slow as its slowest rank
    saving = {i for i in range(args.steps) if args.save_every and (i + 1) % args.save_every == 0}
    rows = []
    for w in range(args.steps // WINDOW):
        window = [times[i] for i in range(w * WINDOW, (w + 1) * WINDOW) if i not in saving]
        row = [f"{w * WINDOW + 1}-{(w + 1) * WINDOW}", statistics.median(window) * 1e3, max(window) * 1e3,
               per_rank[0][1][w], max(r[1][w] for r in per_rank)]
        if args.save_every:
            row += [*per_rank[0][2][w]]
        rows.append(row)
    plain = [i for i in range(WINDOW if args.steps > WINDOW else 0, args.steps) if i not in saving]
    median = statistics.median(times[i] for i in plain)
    worst = max(plain, key=times.__getitem__)
    saves = f", a checkpoint every {args.save_every} steps (keep=2)" if args.save_every else ""
    print(f"machine: {os.cpu_count()} cores, torch {torch.__version__}, gloo, 4 ranks x 1 thread; "
          f"tiny GPT, {args.schedule} d=2 w=2 m={args.microbatches}, clip; {args.steps} steps{saves}\n")
    headers = ["steps", "median ms/step", "slowest ms/step", "rank 0 RSS MiB", "largest RSS MiB"]
    if args.save_every:
        headers += ["checkpoints on disk", "disk MiB"]
    print(tabulate(rows, headers=headers, floatfmt=".2f"))
    print(f"\nslowest single step after the first window: step {worst + 1}, {times[worst] * 1e3:.2f} ms "
          f"= {times[worst] / median:.1f}x the median ({median * 1e3:.2f} ms); "
          f"rank 0 RSS {per_rank[0][1][0]:.1f} -> {per_rank[0][1][-1]:.1f} MiB; largest growth over ranks "
          f"{max(r[1][-1] - r[1][0] for r in per_rank):.2f} MiB")
    if saving:
        spent = sorted(times[i] for i in saving)
        print(f"the {len(spent)} steps that saved (the save's flush and copy to host memory included): median "
              f"{statistics.median(spent) * 1e3:.2f} ms, slowest {spent[-1] * 1e3:.2f} ms")


if __name__ == "__main__":
    main()
