"""Spawn gloo ranks on loopback that run many pipeline cases inside ONE process group.

Each rank starts once (start-up costs seconds), joins a file-store rendezvous, runs every case
with ``fxpipe.compile`` exactly as a ``torchrun`` script would, and saves what it saw; the
parent compares against the single-device references. :func:`run_ranks` kills every rank
after ``timeout`` seconds, so a deadlock fails the test instead of hanging it.
"""

from __future__ import annotations

import faulthandler
import importlib
import os
import sys
import tempfile
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _rank_main(rank: int, world: int, store: str, out_dir: str, case_names: list[str], backend: str,
               timeout: float) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    os.environ["LOCAL_RANK"] = str(rank)  # as torchrun sets it: fxpipe picks cuda:LOCAL_RANK under NCCL
    torch.set_num_threads(1)
    import fxpipe
    from tests.cases import CASES, build

    # If the parent is about to kill us for a deadlock, say where every rank is stuck.
    faulthandler.dump_traceback_later(max(timeout - 5, 1), exit=False, file=sys.stderr)
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        for name in case_names:
            case = CASES[name]
            model, example, batches, loss_fn, opt = build(case)
            try:
                pipe = fxpipe.compile(
                    model, example, loss_fn=loss_fn, optimizer=opt, microbatches=case.microbatches,
                    schedule=case.schedule, stages=case.stages, max_grad_norm=case.max_grad_norm,
                    recompute=case.recompute or None, verbose=False, lookahead=case.lookahead, chunks=case.chunks,
                )
                # every other step without a host sync: the loss comes back as a tensor
                losses = [pipe.step(x, y, sync=i % 2 == 0) for i, (x, y) in enumerate(batches)]
                losses = [None if v is None else float(v) for v in losses]
                state = pipe.state_dict()
                # this rank's own stage, on every replica (data-parallel replicas > 0 gave {})
                local = pipe.state_dict(local=True)
                local_ok = all(torch.equal(v, state[k]) for k, v in local.items())
                grad_norm = pipe.grad_norm  # state_dict flushed: the last step's, on every rank
                evaluated = pipe.eval_step(*batches[0])
                result = {"losses": losses, "state": state if rank == 0 else None, "eval": evaluated, "error": None,
                          "local_state": (sorted(local), local_ok), "lookahead": pipe.plan.lookahead,
                          "grad_norm": grad_norm}
            except Exception:  # report, and keep the ranks in step for the next case
                result = {"losses": None, "state": None, "error": traceback.format_exc()}
                print(f"rank {rank} case {name} failed:\n{result['error']}", flush=True)
            torch.save(result, os.path.join(out_dir, f"{name}.rank{rank}.pt"))
            dist.barrier()
    finally:
        _destroy(rank, world, timeout, wait=sys.exc_info()[0] is None)


def _destroy(rank: int, world: int, timeout: float, wait: bool = True) -> None:
    """Tear the group down once every rank is done with it. A rank can leave its last collective
    while a peer is still reading what it sent (gloo completes a send once its bytes are out), and
    destroying the group then can abort that peer ("terminate called without an active
    exception"): so the ranks meet in the group's store first, as fxpipe's own teardown does
    (``pipeline._finish_at_exit``)."""
    from fxpipe.pipeline import _meet_at_exit

    _meet_at_exit(dist.distributed_c10d._get_default_store(), rank, world, timeout, wait=wait)
    dist.destroy_process_group()


def _function_main(rank: int, world: int, store: str, out_dir: str, target: str, timeout: float) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    faulthandler.dump_traceback_later(max(timeout - 5, 1), exit=False, file=sys.stderr)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        module, name = target.split(":")
        fn = getattr(importlib.import_module(module), name)
        result = {"value": fn(rank, world), "error": None}
    except Exception:
        result = {"value": None, "error": traceback.format_exc()}
    torch.save(result, os.path.join(out_dir, f"fn.rank{rank}.pt"))
    _destroy(rank, world, timeout)


def _spawn(main, world: int, args: tuple, what: str, timeout: float, tmp: str) -> None:
    store = os.path.join(tmp, "store")
    ctx = mp.start_processes(main, args=(world, store, tmp, *args, timeout), nprocs=world, join=False,
                             start_method="spawn")
    deadline = time.monotonic() + timeout
    try:
        while not ctx.join(timeout=1.0):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{world} ranks did not finish {what} within {timeout:.0f} s (deadlock?)")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()


def run_ranks(world: int, case_names: list[str], timeout: float = 240.0, backend: str = "gloo") -> dict[str, list[dict]]:
    """Run the named cases on ``world`` spawned ranks (``backend="nccl"``: one GPU per rank);
    returns case -> [result per rank]."""
    with tempfile.TemporaryDirectory() as tmp:
        _spawn(_rank_main, world, (case_names, backend), str(case_names), timeout, tmp)
        return {
            name: [torch.load(os.path.join(tmp, f"{name}.rank{r}.pt"), weights_only=False) for r in range(world)]
            for name in case_names
        }


def run_function(world: int, target: str, timeout: float = 120.0) -> list[dict]:
    """Run ``target`` ("module:function", called as ``fn(rank, world)`` inside an initialised
    gloo group) on ``world`` spawned ranks; returns ``[{"value", "error"} per rank]``."""
    with tempfile.TemporaryDirectory() as tmp:
        _spawn(_function_main, world, (target,), target, timeout, tmp)
        return [torch.load(os.path.join(tmp, f"fn.rank{r}.pt"), weights_only=False) for r in range(world)]
