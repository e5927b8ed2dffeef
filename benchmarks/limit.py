"""The physical limit, and how close each pipeline schedule gets to it, with every millisecond accounted for.

    python benchmarks/limit.py                # about 23 minutes on 2 CPU cores (the AMD EPYC host)
    python benchmarks/limit.py --rounds 1     # one round, about 8 minutes
    python benchmarks/limit.py --check        # the simulator on configurations it was not calibrated on (about 6 minutes)
    python benchmarks/limit.py --saved        # per stage, the peak of autograd-saved tensors under 1f1b and zb
    python benchmarks/limit.py --runtime      # what fxpipe's runtime adds to the same work, on one thread (about 3 minutes)

The pinned configuration (issue #15): a GPT (vocab 512, d_model 256, 8 layers, 4 heads, sequence
64, untied embeddings), a global batch of 32 in m = 4 micro-batches of 8, Adam (lr 1e-3), two
gloo ranks with one thread each. Every system below trains exactly this:

* ``limit``: two copies of the whole model trained at once in two single-thread processes (no
  bubble, no communication, the same optimizer, both cores busy): the summed throughput, over
  the window in which both are training, is the most any 2-rank pipeline can reach on this
  machine;
* fxpipe ``2bw``, ``1f1b``, ``gpipe`` and ``zb`` (ZB-H1), the split the planner picks, and
  ``1f1b chunks=2``: interleaved 1F1B, 4 stages on the 2 ranks, 1F1B's semantics with a smaller
  bubble (``--only "fxpipe 1f1b chunks=3"`` or ``chunks=4``: 6 or 8 stages);
* torch.distributed.pipelining (PiPPy) ``ScheduleGPipe`` and ``Schedule1F1B`` split at the same
  layer boundary, its ``ScheduleInterleavedZeroBubble``, which needs 2 stages per rank (4 stages
  on 2 ranks, split every 2 layers), and its ``ScheduleInterleaved1F1B`` on the same 4 stages.

Every run is a fresh pair of processes (so each one's peak memory is its own, counted from its
first training step; each settles glibc's heap first, as fxpipe does on a CPU rank:
:func:`fxpipe.device.settle_heap`), the systems
alternate within each of ``--rounds`` rounds, and each reports the median over rounds of its
throughput: samples in the measured steps over the slower rank's wall time for them (the
ranks meet after ``--warmup`` steps, and one more step, untimed, refills a pipeline that the
meeting drained: :func:`_timed`). The limit
runs first and again right after every system, so each run of a system is bracketed by two
limit runs about a minute apart: its share of the limit is its rate over their mean, and the
table gives the median of those shares over the rounds (``--no-brackets``: one limit run per
round, first, as before 2026-11-28), with the ratios of the medians printed beside them and,
round by round, each system's samples/s, share and the two limit runs around it. Beside each
fxpipe schedule it prints the simulator's prediction of the step time (the plan's costs through
:func:`fxpipe.simulate.simulate`), the error of the same schedule replayed at the run's own mean
action times (:meth:`fxpipe.simulate.Costs.measured`: the schedule model alone, apart from the
cost model) and, per rank, where the step went (:mod:`fxpipe.profile`). From that replay it
prints each schedule's own bubble (a rank's idle share of a steady step), the share of the limit
it leaves, and what that makes of issue #15's 1.10x for fxpipe 1f1b over PiPPy's 1F1B.
"""

from __future__ import annotations

import argparse
import bisect
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from tabulate import tabulate

VOCAB, WIDTH, LAYERS, HEADS, SEQ = 512, 256, 8, 4, 64
M, MB = 4, 8
BATCH = M * MB

STEPS_SIMULATED = 8  # steps of a schedule replayed or predicted
FXPIPE = ("2bw", "1f1b", "gpipe", "zb")
PIPPY = ("pippy gpipe", "pippy 1f1b", "pippy interleaved zb", "pippy interleaved 1f1b")
#: 2bw in 1F1B's own order beside the planner's (which runs one forward ahead: docs/design.md,
#: "Lookahead"), measured side by side
SYSTEMS = ("limit",) + tuple(f"fxpipe {s}" for s in FXPIPE) + ("fxpipe 2bw lookahead=0", "fxpipe 1f1b chunks=2") + PIPPY
#: more stages per rank, measured on request (--only): more messages, a smaller bubble
MORE = ("fxpipe 1f1b chunks=3", "fxpipe 1f1b chunks=4")


def _model():
    from fxpipe.demo import GPT, GPTConfig

    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=VOCAB, block_size=SEQ, n_layer=LAYERS, n_head=HEADS, n_embd=WIDTH,
                         tie_weights=False))


def _data(steps: int):
    g = torch.Generator().manual_seed(0)
    return [(torch.randint(0, VOCAB, (BATCH, SEQ), generator=g), torch.randint(0, VOCAB, (BATCH, SEQ), generator=g))
            for _ in range(steps)]


def _optimizer(params):
    return torch.optim.Adam(params, lr=1e-3)


def _peak_rss_reset() -> None:
    """Start a new peak-RSS window (Linux: writing 5 to clear_refs resets VmHWM)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def _peak_rss() -> float:
    """Peak resident memory (MiB) since the last reset."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def _timed(step, batches, warmup: int, start=None, batch: int = BATCH, stamps: list | None = None,
           cpu: dict | None = None) -> tuple[float, int]:
    """(seconds for the timed steps, samples in them): ``warmup`` steps, then all ranks meet, then
    one more step untimed, then the rest of ``batches``, timed; ``start`` runs right before them.
    The untimed step refills the pipeline the meeting drained: 2bw's first stage runs into batch
    t+1 while the last finishes batch t, and never waits for it in training, but after a barrier
    the last stage waits once for the first stage's update and forward (66 ms of a 12-step window
    in one run, 0.7%); a flushing schedule drains every step, so there it is one more step
    like the others. The peak resident memory is counted from the
    first step on: training's, not the setup's (fxpipe's calibration, PiPPy's export). ``stamps``
    gets the system-wide monotonic clock at the start and after each timed step. ``cpu`` gets the
    CPU time per timed step, in ms: ``main`` of the calling thread (the one that computes; time
    blocked in a wait is not CPU time) and ``process`` of all its threads (gloo's too)."""
    _peak_rss_reset()
    for x, y in batches[:warmup]:
        step(x, y)
    if dist.is_initialized():
        dist.barrier()
    step(*batches[warmup])
    if start is not None:
        start()
    t0, main0, process0 = time.perf_counter(), time.thread_time(), time.process_time()
    if stamps is not None:
        stamps.append(time.monotonic())
    for x, y in batches[warmup + 1:]:
        step(x, y)
        if stamps is not None:
            stamps.append(time.monotonic())
    steps = len(batches) - warmup - 1
    if cpu is not None:
        cpu.update(main=1e3 * (time.thread_time() - main0) / steps, process=1e3 * (time.process_time() - process0) / steps)
    return time.perf_counter() - t0, batch * steps


def _eager_step(model):
    """A training step as a plain script writes it: the m micro-batches' backwards accumulated
    in ``.grad``, then the optimizer."""
    from fxpipe.demo import lm_loss

    opt = _optimizer(model.parameters())

    def step(x, y):
        for xs, ys in zip(x.chunk(M), y.chunk(M)):
            (lm_loss(model(xs), ys) / M).backward()
        opt.step()
        opt.zero_grad()

    return step


def _limit(rank: int, batches, warmup: int) -> dict:
    stamps: list[float] = []
    cpu: dict = {}
    seconds, samples = _timed(_eager_step(_model()), batches, warmup, stamps=stamps, cpu=cpu)
    return {"seconds": seconds, "samples": samples, "stamps": stamps, "cpu": cpu}


def _gpt2():
    """Hugging Face GPT-2 of the pinned size (tied embeddings, its own loss from ``labels``)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(n_layer=LAYERS, n_embd=WIDTH, n_head=HEADS, vocab_size=VOCAB, n_positions=SEQ,
                                      use_cache=False, bos_token_id=0, eos_token_id=0))


def _fxpipe(rank: int, schedule: str, batches, warmup: int, *, m: int = M, model: str = "gpt",
            device_model=None, lookahead: int | None = None, chunks: int = 1) -> dict:
    """Train with fxpipe on every rank as one pipeline (d = world size). Without ``device_model``
    the plan is ``cost_mode="calibrated"`` (this model timed on every rank at once, each run followed by one on rank 0 alone); with one,
    the plan prices this configuration with it (a check of a calibration made elsewhere)."""
    import fxpipe
    from fxpipe.demo import lm_loss
    from fxpipe.profile import Profile
    from fxpipe.schedule import generate
    from fxpipe.simulate import Costs, simulate

    mb = BATCH // M  # micro-batches of the pinned size; m of them per step (m a multiple of M)
    batches = [(x.repeat(m // M, 1), y.repeat(m // M, 1)) for x, y in batches]
    if model == "gpt2":
        batches = [({"input_ids": x, "labels": x}, None) for x, _ in batches]
        example, net, loss = {"input_ids": batches[0][0]["input_ids"][:mb], "labels": batches[0][0]["labels"][:mb]}, _gpt2(), None
    else:
        example, net, loss = (batches[0][0][:mb],), _model(), lm_loss
    mode = dict(cost_mode="calibrated") if device_model is None else dict(device_model=device_model)
    pipe = fxpipe.compile(net, example, loss_fn=loss, microbatches=m, stages=dist.get_world_size() * chunks,
                          schedule=schedule, optimizer=_optimizer, verbose=False, lookahead=lookahead,
                          chunks=chunks, **mode)
    profile, cpu = Profile(), {}
    seconds, samples = _timed(pipe.step, batches, warmup, start=lambda: setattr(pipe, "profile", profile),
                              batch=m * mb, cpu=cpu)
    pipe.profile = None
    pipe.flush()
    plan = pipe.plan
    costs = Costs.of_plan(plan)
    actions = generate(schedule, plan.stages, plan.microbatches, STEPS_SIMULATED, lookahead=plan.lookahead,
                       chunks=plan.chunks)
    times: list = [None] * dist.get_world_size()  # every rank's own stages' action times
    dist.all_gather_object(times, profile.action_times())
    by_stage: dict = {}  # one rank per stage here (width 1); replicas' times would be averaged
    for t in times:
        for key, took in t.items():
            by_stage.setdefault(key, []).append(took)
    measured = {k: statistics.mean(v) for k, v in by_stage.items()}
    replay = simulate(actions, costs.measured(measured), chunks=plan.chunks)
    replayed = replay.step_time
    idle = statistics.mean(map(replay.steady_idle, replay.ranks))  # the schedule's own bubble at these times
    predicted = simulate(actions, costs, chunks=plan.chunks)
    simulated = predicted.action_times()  # the simulator's, the cores' sharing included
    per_action = [(s, k.value, 1e3 * simulated[s, k], 1e3 * measured[s, k])
                  for s, k in sorted(measured) if (s, k) in simulated]
    return {"seconds": seconds, "samples": samples, "profile": profile.summary(), "cpu": cpu,
            "predicted": predicted.step_time, "replayed": replayed, "idle": idle, "per_action": per_action,
            "lookahead": plan.lookahead, "cores": costs.cores, "stages": [(sp.first_module or "<input>", 1e3 * costs.per_stage("forward", i),
                                                1e3 * costs.per_stage("backward", i), 1e3 * costs.per_stage("update", i))
                                               for i, sp in enumerate(plan.stage_plans)]}


def _calibrated_on_pinned(batches):
    """The cost model calibrated on the pinned GPT (every rank at once, each run followed by one on rank 0 alone), for the checks."""
    import fxpipe
    from fxpipe.cost import DeviceModel

    example = (batches[0][0][:BATCH // M],)
    gm = fxpipe.trace(_model(), example)
    return DeviceModel.cpu().calibrate(gm, example, optimizer=_optimizer, barrier=dist.barrier,
                                       host_ranks=dist.get_world_size(), alone=dist.get_rank() == 0,
                                       split=True).measure_p2p()


def _pippy(rank: int, name: str, batches, warmup: int) -> dict:
    from torch.distributed.pipelining import (Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B,
                                              ScheduleInterleavedZeroBubble, SplitPoint, pipeline)

    from fxpipe.demo import lm_loss

    interleaved = name.startswith("pippy interleaved")
    cuts = (2, 4, 6) if interleaved else (LAYERS // 2,)
    pipe = pipeline(_model(), mb_args=(batches[0][0][:MB],),
                    split_spec={f"blocks.{c}": SplitPoint.BEGINNING for c in cuts})
    world = dist.get_world_size()
    stage_ids = (rank, rank + world) if interleaved else (rank,)
    stages = [pipe.build_stage(s, torch.device("cpu")) for s in stage_ids]
    params = [p for s in stages for p in s.submod.parameters()]
    opt = _optimizer(params)
    if interleaved:
        kind = ScheduleInterleavedZeroBubble if name == "pippy interleaved zb" else ScheduleInterleaved1F1B
        sched = kind(stages, M, loss_fn=lm_loss)
    else:
        sched = (ScheduleGPipe if name == "pippy gpipe" else Schedule1F1B)(stages[0], M, loss_fn=lm_loss)
    first, last = 0 in stage_ids, pipe.num_stages - 1 in stage_ids

    def step(x, y):
        args = (x,) if first else ()
        kwargs = {"target": y, "losses": []} if last else {}
        sched.step(*args, **kwargs)
        opt.step()
        opt.zero_grad()

    cpu: dict = {}
    seconds, samples = _timed(step, batches, warmup, cpu=cpu)
    return {"seconds": seconds, "samples": samples, "cpu": cpu}


def _worker(rank: int, world: int, name: str, store: str, out: str, steps: int, warmup: int) -> None:
    from fxpipe.device import settle_heap

    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    settle_heap()  # every system's processes start as fxpipe's CPU ranks do: only what they run differs
    batches = _data(warmup + 1 + steps)  # the untimed step after the ranks meet: _timed
    if name == "limit":  # two independent trainers: no process group, just both cores busy
        barrier = _FileBarrier(store, world)
        barrier.wait(rank)
        result = _limit(rank, batches, warmup)
    else:
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
        if name.startswith("check"):  # "check <schedule> <model> m=<m>"
            _, schedule, model, m = name.split()
            result = _fxpipe(rank, schedule, batches, warmup, m=int(m[2:]), model=model,
                             device_model=_calibrated_on_pinned(batches))
        elif name.startswith("fxpipe"):  # "fxpipe <schedule>[ lookahead=<n>][ chunks=<v>]"
            _, schedule, *options = name.split()
            given = dict(o.split("=") for o in options)
            result = _fxpipe(rank, schedule, batches, warmup, lookahead=int(given["lookahead"]) if "lookahead" in given else None,
                             chunks=int(given.get("chunks", 1)))
        else:
            result = _pippy(rank, name, batches, warmup)
        dist.barrier()
        dist.destroy_process_group()
    result["peak_mib"] = _peak_rss()
    torch.save(result, f"{out}.{rank}")


class _FileBarrier:
    """Start two process-group-less trainers together (a file per arrived rank)."""

    def __init__(self, path: str, world: int):
        self.path, self.world = path + ".barrier", world

    def wait(self, rank: int) -> None:
        open(f"{self.path}.{rank}", "w").close()
        while not all(os.path.exists(f"{self.path}.{r}") for r in range(self.world)):
            time.sleep(0.01)


def run(name: str, steps: int, warmup: int, world: int = 2) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result")
        mp.start_processes(_worker, args=(world, name, os.path.join(tmp, "store"), out, steps, warmup), nprocs=world,
                           start_method="spawn", join=True)
        return [torch.load(f"{out}.{r}", weights_only=False) for r in range(world)]


#: The simulator's checks on configurations the calibration never ran: the cost model is
#: calibrated on the pinned GPT (whole model, every rank at once, each run followed by one on rank 0 alone) and prices these with it.
CHECKS = (("pinned GPT, m = 8", "gpt", 8, 2), ("pinned GPT, d = 4 on 4 ranks", "gpt", 4, 4),
          ("HF GPT-2 8x256 (tied, its own loss)", "gpt2", 4, 2))


def checks(steps: int, warmup: int) -> None:
    rows = []
    for label, model, m, world in CHECKS:
        for schedule in FXPIPE:
            ranks = run(f"check {schedule} {model} m={m}", steps, warmup, world)
            measured = max(r["seconds"] for r in ranks) / steps
            predicted, replayed = ranks[0]["predicted"], ranks[0]["replayed"]
            rows.append([label, schedule, 1e3 * measured, 1e3 * predicted, 100 * (predicted / measured - 1),
                         1e3 * replayed, 100 * (replayed / measured - 1)])
            print(f"check: {label}, {schedule}: measured {1e3 * measured:.0f} ms/step, simulated "
                  f"{1e3 * predicted:.0f}, at the run's own action times {1e3 * replayed:.0f}", file=sys.stderr)
    print("\nThe simulator on configurations it was not calibrated on (one run each); last, the schedule "
          "replayed at the run's own action times (the schedule model alone):\n")
    print(tabulate(rows, headers=["configuration", "schedule", "ms/step", "simulated ms/step", "sim error %",
                                  "replayed ms/step", "replay error %"], floatfmt=".1f"))


def saved_peaks() -> None:
    """Per stage, the peak of autograd-saved tensors alive (MiB, each storage counted once) over one
    step of the pinned configuration, in one process: 1f1b against zb, beside the activations the
    planner priced the stage at. Sampled after every action through a saved-tensor hook of the
    caller's, which fxpipe's own (zb) wraps; under zb with the gradients each ``I`` recorded for
    its ``W`` (fxpipe.backward.PendingWeights) added."""
    import collections
    import weakref

    import fxpipe
    from fxpipe.demo import lm_loss

    (x, y), = _data(1)
    rows = []
    for schedule in ("1f1b", "zb"):
        torch.manual_seed(0)
        pipe = fxpipe.compile(_model(), (x[:MB],), loss_fn=lm_loss, optimizer=_optimizer, microbatches=M, stages=2,
                              schedule=schedule, verbose=False)
        pipe.step(x, y)  # set-up outside the measurement
        live: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        stage = [None]
        peak = collections.Counter()

        class Box:
            def __init__(self, t):
                self.t = t.detach()

        def pack(t):
            box = Box(t)
            live[box] = (stage[0], t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
            return box

        for r, worker in pipe.workers.items():
            def traced(a, run=worker.run, r=r):
                stage[0] = r
                run(a)
                mine = {ptr: n for owner, ptr, n in live.values() if owner == r}
                for ctx in pipe.workers[r].ctx.values():  # zb: the anchors' gradients kept for W
                    for call in getattr(ctx.get("pending"), "calls", ()):  # fxpipe.backward._Call
                        grads = [*call.grads, *(g for _, _, g in call.direct)]
                        mine.update((g.untyped_storage().data_ptr(), g.untyped_storage().nbytes()) for g in grads)
                peak[r] = max(peak[r], sum(mine.values()))
            worker.run = traced
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda box: box.t):
            pipe.step(x, y)
        priced = [sp.memory_activations / 2**20 for sp in pipe.plan.stage_plans]
        rows.append([schedule] + [x for r in sorted(pipe.workers) for x in (peak[r] / 2**20, priced[r])])
    print(tabulate(rows, headers=["schedule", "stage 0 MiB", "planner's price", "stage 1 MiB", "planner's price"],
                   floatfmt=".1f"))


def runtime_cost(rounds: int, schedules=FXPIPE) -> None:
    """What fxpipe's runtime adds to the same work, apart from the host's drift and from the
    pipeline: in this one process, on one thread, a step of the limit's eager trainer alternates
    with a step of each schedule's single-process pipeline (both stages here, the in-process hub
    copying the boundary tensors; :class:`fxpipe.comm.LocalHub`), ``rounds`` times. Each step's
    CPU time is set against the eager step's of the same round, and the table gives the median of
    those ratios. Neither the bubble (one thread runs every stage's actions back to back) nor
    gloo is in it; what is: fxpipe's Python around the operators, the weight store (versions,
    accumulation into flat buffers, the per-step norm), zb's split backward."""
    import fxpipe
    from fxpipe.demo import lm_loss
    from fxpipe.device import settle_heap

    torch.set_num_threads(1)
    settle_heap()
    batches = _data(8)
    eager = "eager (a limit trainer's step)"
    steps = {eager: _eager_step(_model())}
    for schedule in schedules:
        pipe = fxpipe.compile(_model(), (batches[0][0][:MB],), loss_fn=lm_loss, optimizer=_optimizer,
                              microbatches=M, stages=2, schedule=schedule, verbose=False)
        steps[f"fxpipe {schedule}, both stages in one process"] = pipe.step
    for step in steps.values():  # warm-up: the allocator, lazily built kernels, 2bw's versions
        for x, y in batches[:2]:
            step(x, y)
    cpu: dict[str, list[float]] = {name: [] for name in steps}
    for r in range(rounds):
        for name, step in steps.items():
            x, y = batches[r % len(batches)]
            start = time.thread_time()
            step(x, y)
            cpu[name].append(time.thread_time() - start)
    rows = [[name, 1e3 * statistics.median(got), statistics.median(b / a for a, b in zip(cpu[eager], got))]
            for name, got in cpu.items()]
    print(f"\nThe same work on one thread ({rounds} alternating rounds, one step of each per round): "
          "CPU ms per step, and the median over rounds of its ratio to the eager step's in the same round\n")
    print(tabulate(rows, headers=["step", "CPU ms/step", "vs eager"], floatfmt=(".1f", ".1f", ".3f")))


def throughput(name: str, ranks: list[dict]) -> float:
    if name == "limit":  # two independent trainers: their rates, while both ran, add up
        return _together(ranks)
    return ranks[0]["samples"] / max(r["seconds"] for r in ranks)


def _together(ranks: list[dict]) -> float:
    """The limit's trainers' summed rate over the window in which all of them were training.
    Each rate over its own whole run would count the tail of the trainer that finishes last,
    which runs with the other core idle (alone on a host whose two cores slow each other down);
    a pipeline's ranks never run like that. Steps are counted fractionally at the window's ends
    (linear between a trainer's step stamps)."""
    start = max(r["stamps"][0] for r in ranks)
    end = min(r["stamps"][-1] for r in ranks)
    steps = sum(_steps_by(r["stamps"], end) - _steps_by(r["stamps"], start) for r in ranks)
    return ranks[0]["samples"] / (len(ranks[0]["stamps"]) - 1) * steps / (end - start)


def _steps_by(stamps: list[float], t: float) -> float:
    """How many steps a trainer with these stamps (start, then after each step) had done at ``t``."""
    i = min(max(bisect.bisect_right(stamps, t) - 1, 0), len(stamps) - 2)
    return i + min(max((t - stamps[i]) / (stamps[i + 1] - stamps[i]), 0.0), 1.0)


def _whole_runs(ranks: list[dict]) -> float:
    """The limit as runs before the overlap window counted it: each trainer's rate over its own run."""
    return sum(r["samples"] / r["seconds"] for r in ranks)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=None, help="alternating rounds (3; for --runtime, 20)")
    ap.add_argument("--steps", type=int, default=10, help="measured steps per run (after --warmup and one untimed step)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--only", nargs="*", choices=SYSTEMS + MORE, default=SYSTEMS,
                    help=f"run just these systems (also: {', '.join(MORE)})")
    ap.add_argument("--no-brackets", action="store_true",
                    help="run the limit once per round, first (as before 2026-11-28), not also after every system")
    ap.add_argument("--check", action="store_true",
                    help="instead: the simulator on other configurations (m = 8, d = 4 on 4 ranks, HF GPT-2)")
    ap.add_argument("--saved", action="store_true",
                    help="instead: per stage, the peak of autograd-saved tensors under 1f1b and zb (one process, seconds)")
    ap.add_argument("--runtime", action="store_true",
                    help="instead: what fxpipe's runtime adds to the same work, on one thread against eager training")
    args = ap.parse_args()
    if args.rounds is None:
        args.rounds = 20 if args.runtime else 3
    if args.runtime:
        runtime_cost(args.rounds)
        return
    if args.saved:
        saved_peaks()
        return
    if args.check:
        checks(args.steps, args.warmup)
        return
    results: dict[str, list[list[dict]]] = {n: [] for n in args.only}

    def measure(name: str, r: int) -> float:
        results[name].append(run(name, args.steps, args.warmup))
        got = throughput(name, results[name][-1])
        print(f"round {r + 1}: {name}: {got:.1f} samples/s", file=sys.stderr)
        return got

    if "limit" not in args.only or args.no_brackets:
        for r in range(args.rounds):
            for name in args.only:
                measure(name, r)
        report(results)
        return
    # Brackets: the limit runs first, then again right after every system, so that each
    # system's share is of the limit measured just before and just after it (the host's pace
    # drifts by a fifth from one minute to the next; one limit run per round is minutes away
    # from most systems).
    brackets: dict[str, list[tuple[float, float]]] = {n: [] for n in args.only if n != "limit"}
    last = measure("limit", 0)
    for r in range(args.rounds):
        for name in brackets:
            measure(name, r)
            before, last = last, measure("limit", r)
            brackets[name].append((before, last))
    report(results, brackets)


def shares(rates: list[float], brackets: list[tuple[float, float]]) -> list[float]:
    """Each run's rate as a share of the limit around it: the mean of the limit runs right before
    and right after it (one system's runs, one per round)."""
    return [rate / ((before + after) / 2) for rate, (before, after) in zip(rates, brackets, strict=True)]


def report(results: dict[str, list[list[dict]]], brackets: dict[str, list[tuple[float, float]]] | None = None) -> None:
    """The tables. ``brackets``: per system, per round, the limit runs right before and after
    it (:func:`main`); without, each round's one limit run stands for the whole round."""
    systems = [n for n in results if n != "limit"]
    rounds = len(results[systems[0]]) if systems else len(results["limit"])
    rates = {n: [throughput(n, rs) for rs in runs] for n, runs in results.items()}
    rate = {n: statistics.median(v) for n, v in rates.items()}
    # each system's median round (by throughput): its breakdowns, CPU times and peaks
    medians = {n: sorted(runs, key=lambda rs: throughput(n, rs))[len(runs) // 2] for n, runs in results.items()}
    limit = rate.get("limit")
    base = rate.get("pippy 1f1b")
    around = "the limit runs right before and right after it" if brackets is not None else "its round's limit run"
    share: dict[str, list[float]] = {}
    if limit:
        if brackets is None:
            brackets = {n: [(got, got) for got in rates["limit"]] for n in systems}
        share = {n: shares(rates[n], brackets[n]) for n in systems}
        share["limit"] = [1.0] * rounds
    rows = []
    for name, middle in medians.items():
        measured_ms = 1e3 * BATCH / rate[name]  # the median round's rate, per step of BATCH samples
        predicted, replayed = middle[0].get("predicted"), middle[0].get("replayed")
        # the median round's own step time, which the replay (that round's action times) matches
        own_ms = 1e3 * max(r["seconds"] for r in middle) * BATCH / middle[0]["samples"]
        rows.append([
            _LABELS.get(name, name), rate[name], 100 * statistics.median(share[name]) if limit else None,
            statistics.median(a / b for a, b in zip(share[name], share["pippy 1f1b"])) if limit and base
            else rate[name] / base if base else None,
            " / ".join(f"{r['peak_mib']:.0f}" for r in middle),
            measured_ms if name != "limit" else None,
            1e3 * predicted if predicted else None,
            100 * (1e3 * predicted / measured_ms - 1) if predicted else None,
            100 * (1e3 * replayed / own_ms - 1) if replayed else None,
        ])
    print(f"machine: {os.cpu_count()} cores, torch {torch.__version__}; GPT {LAYERS}x{WIDTH}, vocab {VOCAB}, "
          f"sequence {SEQ}; {M} micro-batches of {MB}; Adam; 2 gloo ranks, 1 thread each; median of "
          f"{rounds} alternating rounds\n")
    print(tabulate(rows, headers=["system", "samples/s", "% of limit", "vs PiPPy 1F1B", "peak MiB (rank 0 / 1)",
                                  "ms/step", "simulated ms/step", "sim error %", "replay error %"],
                   # the ratio to three places: a target of 1.10x must not read as met at 1.096
                   floatfmt=("", ".1f", ".1f", ".3f", "", ".1f", ".1f", ".1f", ".1f"), missingval="-"))
    if limit:
        print(f"\n% of limit: the median over rounds of each run's rate over the mean of {around}; vs PiPPy "
              "1F1B: the median over rounds of that share over PiPPy 1F1B's in the same round. As ratios of "
              "the medians instead (each system's median rate over the limit's, and over PiPPy 1F1B's): "
              + "; ".join(f"{_LABELS.get(n, n).split(' (')[0]} {100 * rate[n] / limit:.1f}%"
                          + (f", {rate[n] / base:.3f}x" if base else "") for n in systems))
    print("\nsim error: the plan's predicted step time against the measured one. replay error: the same "
          "schedule simulated at the run's own mean action times (fxpipe.profile's, F/B/I/W/UPDATE per "
          "stage), against that run: the schedule model alone, without the cost model's prediction.")
    idle = {n: 100 * middle[0]["idle"] for n, middle in medians.items() if middle[0].get("idle") is not None}
    if idle:
        print("\nthe schedules' own bubble: in that replay a rank is idle, on average, for this share of a steady "
              "step: " + "; ".join(f"{_LABELS.get(n, n)} {pct:.1f}%" for n, pct in idle.items())
              + ". Its ranks computing at a limit trainer's pace, a schedule reaches at most 100% less that "
              "share of the limit.")
        if "fxpipe 1f1b" in idle and limit and base:
            ceiling = 100 - idle["fxpipe 1f1b"]
            print(f"So fxpipe 1f1b with one stage per rank reaches at most about {ceiling:.1f}% of the limit here, "
                  f"and 1.10x PiPPy 1F1B would need PiPPy's at or below {ceiling / 1.10:.1f}% (it read "
                  f"{100 * statistics.median(share['pippy 1f1b']):.1f}%).")
        interleaved = [n for n in idle if "chunks=" in n]
        if interleaved and limit:
            print("Interleaved 1F1B (fxpipe 1f1b with chunks=v, PiPPy's ScheduleInterleaved1F1B) keeps 1F1B's "
                  "semantics (every micro-batch of a step on the same weights, one update after the flush) with v "
                  f"stages per rank, whose bubble is (d - 1) / (vm + d - 1): {100 / (2 * M + 1):.1f}% of a step at "
                  f"v = 2 against 1F1B's {100 / (M + 1):.0f}%, for v times the messages. In the replay: "
                  + "; ".join(f"{_LABELS.get(n, n)} {idle[n]:.1f}%" for n in interleaved)
                  + (f"; PiPPy's read {100 * statistics.median(share['pippy interleaved 1f1b']):.1f}% of the limit"
                     if "pippy interleaved 1f1b" in share else "") + ".")
    if limit:
        print("\nthe limit, every run in order: summed rates while both trainers ran (the table's), and each "
              "trainer's rate over its own whole run, summed (the runs before 2026-11-27): "
              + "; ".join(f"{throughput('limit', rs):.1f} and {_whole_runs(rs):.1f}" for rs in results["limit"]))
    if rounds > 1:  # the rounds themselves: the host drifts between them
        print("\nround by round (samples/s" + (", % of the limit around it: before / after)" if limit else ")"))
        per_round = []
        for name in systems:
            row = [_LABELS.get(name, name)]
            for r, got in enumerate(rates[name]):
                row.append(f"{got:.1f}" + (f" ({100 * share[name][r]:.1f}%: {brackets[name][r][0]:.1f} / "
                                           f"{brackets[name][r][1]:.1f})" if limit else ""))
            per_round.append(row)
        print(tabulate(per_round, headers=["system"] + [f"round {r + 1}" for r in range(rounds)]))
    print("\nCPU time per step (ms, median round; per rank, or per trainer for the limit): the main thread, which "
          "computes (a wait blocked is not CPU time), and the whole process (gloo's threads too). A limit "
          "trainer computes the whole model: half of its main thread's time is one pipeline rank's share, and "
          "the last column is every rank's main thread together over a limit trainer's (the mean of the limit's "
          "two in its median round): the same work, so above 1 is what the system adds to it, or the host's "
          "pace in its run.")
    trainer = statistics.mean(r["cpu"]["main"] for r in medians["limit"]) if "limit" in medians else None
    cpu_rows = []
    for name, middle in medians.items():
        together = trainer if name == "limit" else sum(r["cpu"]["main"] for r in middle)
        cpu_rows.append([_LABELS.get(name, name)] + [f"{r['cpu']['main']:.0f} / {r['cpu']['process']:.0f}"
                                                     for r in middle]
                        + [f"{together / trainer:.3f}" if trainer else "-"])
    ranks = len(cpu_rows[0]) - 2
    print(tabulate(cpu_rows, headers=["system"] + [f"rank {r}: main / process" for r in range(ranks)]
                   + ["all ranks / a limit trainer"], disable_numparse=True))
    for name, middle in medians.items():
        if not name.startswith("fxpipe"):
            continue
        print(f"\n{name}: where each rank's step went (ms per step, median round)")
        cores = f"{middle[0]['cores']:.2f}" if middle[0]["cores"] is not None else "-"
        print(f"lookahead {middle[0]['lookahead']}; simulator's costs (the ranks' cores, as calibrated: {cores}): " + "; ".join(f"stage {i} from {first}: F {f:.1f}, B {b:.1f}, UPDATE {u:.1f} ms"
                                                for i, (first, f, b, u) in enumerate(middle[0]["stages"])))
        keys = list(middle[0]["profile"])
        print(tabulate([[f"rank {r}"] + [middle[r]["profile"][k] for k in keys] for r in range(len(middle))],
                       headers=[""] + keys, floatfmt=".1f"))
        print("one action's time (ms): the simulator's mean, the ranks' sharing of the cores included, "
              "against the run's own (fxpipe.profile's), per stage: " + "; ".join(
                  f"{s}{k} {sim:.1f} / {got:.1f}" + (f" ({100 * (sim / got - 1):+.0f}%)" if got >= 1.0 else "")
                  for s, k, sim, got in middle[0]["per_action"]))


_LABELS = {
    "limit": "physical limit: 2 whole models, 1 process each",
    "pippy gpipe": "PiPPy ScheduleGPipe",
    "pippy 1f1b": "PiPPy Schedule1F1B (baseline)",
    "pippy interleaved zb": "PiPPy ScheduleInterleavedZeroBubble (4 stages on 2 ranks)",
    "pippy interleaved 1f1b": "PiPPy ScheduleInterleaved1F1B (4 stages on 2 ranks)",
    "fxpipe zb": "fxpipe zb (ZB-H1)",
    "fxpipe 2bw lookahead=0": "fxpipe 2bw, lookahead=0 (1F1B's order)",
    "fxpipe 1f1b chunks=2": "fxpipe 1f1b, chunks=2 (interleaved: 4 stages on 2 ranks)",
    "fxpipe 1f1b chunks=3": "fxpipe 1f1b, chunks=3 (interleaved: 6 stages on 2 ranks)",
    "fxpipe 1f1b chunks=4": "fxpipe 1f1b, chunks=4 (interleaved: 8 stages on 2 ranks)",
}


if __name__ == "__main__":
    main()
