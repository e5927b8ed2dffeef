"""Checkpoint cost: how long ``Pipeline.save`` holds training up, against a blocking save.

    python benchmarks/checkpoint.py            # about a minute on 2 CPU cores
    python benchmarks/checkpoint.py --rounds 5 --steps 10

Two gloo ranks (one thread each) train the demo GPT (2bw, d = 2, AdamW, m = 4 micro-batches of 8
sequences of 32 tokens) and checkpoint it three times each way (``--rounds``), alternating:

* ``pipe.save(dir)``: flush, copy the state to host memory, return; a thread writes the files
  (``torch.distributed.checkpoint.async_save``). Its stall is the time ``save`` takes; the
  write's own time is measured to the end of ``wait_for_checkpoint``;
* blocking: the same flush and the same state dict written by ``torch.distributed.checkpoint.save``
  before returning (the baseline, ratio 1.00).

Prints per way the median stall (the slower rank's), the ratio to the blocking save, and the
median step time for scale.
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
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from tabulate import tabulate


def _rank(rank: int, world: int, tmp: str, rounds: int, steps_between: int) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=rank, world_size=world)
    import fxpipe
    from fxpipe import checkpoint
    from fxpipe.demo import GPT, GPTConfig, fibonacci_batch, lm_loss

    torch.manual_seed(0)
    cfg = GPTConfig()
    model = GPT(cfg)
    x, y = fibonacci_batch(32, cfg.block_size, cfg.vocab_size, torch.Generator().manual_seed(1))
    pipe = fxpipe.compile(model, (x[:8],), loss_fn=lm_loss, microbatches=4, stages=2, schedule="2bw",
                          verbose=False, optimizer=functools.partial(torch.optim.AdamW, lr=1e-3))
    steps, stalls = [], {"async": [], "write": [], "blocking": []}
    for _ in range(5):
        pipe.step(x, y)
    for r in range(rounds):
        for _ in range(steps_between):
            t0 = time.perf_counter()
            pipe.step(x, y)
            steps.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        pipe.save(os.path.join(tmp, "async"))
        stalls["async"].append(time.perf_counter() - t0)
        pipe.wait_for_checkpoint()
        stalls["write"].append(time.perf_counter() - t0)
        pipe.step(x, y)
        t0 = time.perf_counter()
        pipe.flush()
        dcp.save(checkpoint.state(pipe, None), checkpoint_id=os.path.join(tmp, f"blocking-{r}"),
                 process_group=pipe._checkpoint_pg())
        stalls["blocking"].append(time.perf_counter() - t0)
    gathered = [None] * world
    dist.all_gather_object(gathered, (steps, stalls))
    if rank == 0:
        torch.save(gathered, os.path.join(tmp, "result.pt"))
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3, help="checkpoints each way, alternating (default 3)")
    ap.add_argument("--steps", type=int, default=20, help="training steps before each round's checkpoints (default 20)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(_rank, args=(2, tmp, args.rounds, args.steps), nprocs=2, start_method="spawn", join=True)
        per_rank = torch.load(os.path.join(tmp, "result.pt"), weights_only=False)
        size = sum(os.path.getsize(os.path.join(tmp, "blocking-0", f)) for f in os.listdir(os.path.join(tmp, "blocking-0")))
    worst = {k: [max(r[1][k][i] for r in per_rank) for i in range(args.rounds)] for k in per_rank[0][1]}
    step = statistics.median(max(r[0][i] for r in per_rank) for i in range(len(per_rank[0][0])))
    base = statistics.median(worst["blocking"])
    rows = [
        ["blocking dcp.save (baseline)", base * 1e3, 1.0],
        ["pipe.save (async): stall", statistics.median(worst["async"]) * 1e3, statistics.median(worst["async"]) / base],
        ["pipe.save: until written", statistics.median(worst["write"]) * 1e3, statistics.median(worst["write"]) / base],
    ]
    print(f"machine: {os.cpu_count()} cores, torch {torch.__version__}, gloo, 2 ranks x 1 thread; demo GPT, 2bw d=2, "
          f"AdamW; checkpoint {size / 2**20:.1f} MiB; median step {step * 1e3:.1f} ms\n")
    print(tabulate(rows, headers=["", "median ms (slower rank)", "ratio"], floatfmt=".2f"))


if __name__ == "__main__":
    main()
