"""Timing a schedule without running it: simulator, and text / Chrome-trace / SVG timelines.

:func:`simulate` replays per-stage action lists (:mod:`fxpipe.schedule`) on the streams of
:func:`fxpipe.schedule.lower_to_streams`: each rank's ``compute`` stream runs F/R/B/UPDATE in
order, each stage pair shares one FIFO p2p channel (a SEND and its RECV run together, for
``costs.p2p``, once both are at the head of their streams and the send's producer finished), and
collectives run on the ``reduce`` stream once every member issued them. The result holds one
:class:`Event` per action with its start and end, the makespan, the steady-state step time, the
bubble fraction and the peak number of micro-batches in flight per stage.

Bubble fraction: ``1 - busy / (d * makespan)`` where ``busy`` sums the compute time (F, R, B,
UPDATE, EVAL) of all d stages. For one step of gpipe or 1f1b with equal stage costs and free
communication this is exactly ``(d-1)/(m+d-1)`` (GPipe, Huang et al. 2019, section 2.2).

Renderings, all from a :class:`Timeline` (simulated, or recorded from a real run with
:func:`timeline_from_events`): :func:`format_grid` (time slots x ranks for a terminal),
:func:`chrome_trace` (``{"traceEvents": [...]}`` for chrome://tracing or ui.perfetto.dev),
:func:`render_svg` (one self-contained SVG file: no scripts, links or fonts to fetch), and
:func:`write_schedule_dumps`, which writes all three for ``fxpipe inspect``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import statistics
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple
from pathlib import Path
from xml.sax.saxutils import escape

from fxpipe.deps import CommOp, Rendezvous
from fxpipe.errors import ScheduleError
from fxpipe.schedule import (
    COLLECTIVES,
    COMPUTE,
    PER_BATCH,
    SPEC,
    WAITS,
    Action,
    Kind,
    _groups,
    batch_of,
    comm_op,
    format_actions,
    lower_to_streams,
    stream_of,
    versions_of,
)

__all__ = [
    "Costs",
    "Event",
    "Timeline",
    "chrome_trace",
    "format_grid",
    "idle_by_rank",
    "render_svg",
    "simulate",
    "timeline_from_events",
    "write_schedule_dumps",
]


@dataclass(frozen=True)
class Costs:
    """Seconds (or any one unit) per action; a number applies to every stage, a sequence is per stage."""

    forward: float | Sequence[float] = 1.0
    """Forward of one micro-batch on a stage."""
    backward: float | Sequence[float] = 2.0
    """Backward of one micro-batch (without recomputation)."""
    backward_input: float | Sequence[float] | None = None
    """zb's ``I``: the input-gradient half of a backward; None = half of ``backward``."""
    backward_weight: float | Sequence[float] | None = None
    """zb's ``W``: the weight-gradient half; None = ``backward`` minus ``backward_input``. On the
    first stage, which sends no gradient, the runtime runs the whole backward in ``W``: there
    ``I`` costs 0 and ``W`` costs ``backward``."""
    recompute: float | Sequence[float] | None = None
    """Recomputed forward before a backward; None = the forward time again."""
    p2p: float | Sequence[float] = 0.0
    """One activation or gradient transfer between neighbouring stages; a sequence is per
    boundary, entry s between stage s and s + 1 (a cluster's links differ inside and across
    nodes)."""
    update: float | Sequence[float] = 0.0
    """Optimizer step of one stage."""
    reduce: float = 0.0
    """One asynchronous reduction (data-parallel all-reduce, tied-weight sum, norm all-reduce)."""
    cores: float | None = None
    """The stages share one host's cores (CPU ranks): while k of them compute, each runs at
    ``min(1, cores / k)`` of its own speed, so the times above are of a stage computing alone.
    None: every stage has a device of its own."""

    @classmethod
    def of_plan(cls, plan) -> "Costs | None":
        """The costs a plan predicts (``fxpipe.plan.Plan``: its per-stage times, the links its
        cuts cross, its device's update and split prices): what the planner simulates to place
        zb's cuts and what the dumps draw. None for a plan without stages."""
        from .cluster import stage_links

        if not plan.stage_plans:
            return None
        # each boundary's link: a cluster's intra- or inter-node one, as the planner priced it
        links = (stage_links(plan.cluster, plan.stages, plan.width, plan.layout) if plan.cluster is not None
                 else None)
        return cls.of_stages(plan.stage_plans, plan.device, schedule=plan.schedule, precision=plan.precision,
                             width=plan.width, links=links)

    @classmethod
    def of_stages(cls, sps, dev, *, schedule: str, precision: str, width: int, links=None) -> "Costs":
        """The costs of stage plans (``fxpipe.plan.StagePlan``) on ``dev`` (a DeviceModel):
        ``links`` (latency, bandwidth) per boundary, None for ``dev``'s own p2p link."""
        backward = [sp.backward_time - (sp.forward_time if sp.recompute else 0.0) for sp in sps]
        if links is None:
            links = [(dev.p2p_latency, dev.p2p_bandwidth)] * (len(sps) - 1)
        return cls(
            forward=[sp.forward_time for sp in sps],
            backward=backward,
            backward_input=[dev.backward_input_share * b for b in backward],
            backward_weight=[dev.backward_weight_share * b for b in backward],
            p2p=[lat + sp.send_bytes / bw for sp, (lat, bw) in zip(sps, links)] or 0.0,
            # one copy of the weights at each update where the runtime keeps two versions (2bw's
            # W(t-1)) or a master (mixed precision's rounded compute copy)
            update=[dev.update_time(sp.param_bytes, copies=int(versions_of(schedule) > 1 or precision != "fp32"))
                    for sp in sps],
            # replicas run the same timeline on the same host: each one's stages get 1/width of it
            cores=dev.host_cores / width if dev.host_cores is not None else None,
        )

    def measured(self, times: Mapping[tuple[int, Kind], float]) -> "Costs":
        """These costs with a run's own compute times in place of the predicted ones: ``times``
        is seconds per action by (stage, kind), as :meth:`fxpipe.profile.Profile.action_times`
        gives them (one per stage: average replicas' times first). A stage's whole backward is
        its ``B``, or its ``I`` plus its ``W`` under zb (the first stage's ``W`` is its whole
        backward; a stage zb cannot split runs it whole in ``I``); where only a whole backward
        was timed, its ``I`` and ``W`` keep these costs' predicted split of it. What a stage has
        no timed action for keeps its value here. ``cores`` becomes None: a time measured while
        other ranks computed already holds the slowdown sharing the cores caused. Transfers and
        reductions keep their predicted times. Simulating a schedule at its run's own costs
        checks the schedule model apart from the cost model (``benchmarks/limit.py`` prints both)."""
        lengths = [len(v) for v in (getattr(self, f.name) for f in dataclasses.fields(self))
                   if isinstance(v, Sequence)]
        stages = max([1 + s for s, _ in times] + lengths, default=1)

        def timed(s: int, *kinds: Kind) -> float | None:
            return sum(times[s, k] for k in kinds) if all((s, k) in times for k in kinds) else None

        fields: dict[str, list[float]] = {}
        for name, kind in (("forward", Kind.F), ("recompute", Kind.R), ("update", Kind.UPDATE)):
            per = [timed(s, kind) for s in range(stages)]
            if any(t is not None for t in per):
                fields[name] = [self.per_stage(name, s) if t is None else t for s, t in enumerate(per)]
        if any(timed(s, k) is not None for s in range(stages) for k in (Kind.B, Kind.I, Kind.W)):
            whole, first, second = [], [], []
            for s in range(stages):
                i, w = timed(s, Kind.I), timed(s, Kind.W)
                b = timed(s, Kind.B)
                b = b if b is not None else i + w if i is not None and w is not None else self.per_stage("backward", s)
                if i is None or w is None:  # the halves untimed: the predicted split of this backward
                    predicted = self.per_stage("backward", s)
                    i = b * (self.per_stage("backward_input", s) / predicted if predicted > 0 else 0.5)
                    w = b - i
                whole.append(b)
                first.append(i)
                second.append(w)
            fields.update(backward=whole, backward_input=first, backward_weight=second)
        return dataclasses.replace(self, **fields, cores=None)

    def per_stage(self, name: str, stage: int) -> float:
        value = getattr(self, name)
        if value is None and name == "recompute":
            value = self.forward
        if value is None and name == "backward_input":
            return self.per_stage("backward", stage) / 2
        if value is None and name == "backward_weight":
            return self.per_stage("backward", stage) - self.per_stage("backward_input", stage)
        if isinstance(value, (int, float)):
            return float(value)
        if stage >= len(value):
            what = (f"one per boundary between stages (boundary {stage}, between stage {stage} and {stage + 1}, "
                    f"is missing)" if name == "p2p" else f"one per stage (stage {stage} is missing)")
            raise ScheduleError(f"Costs.{name} has {len(value)} entries, expected {what}")
        return float(value[stage])


@dataclass(frozen=True)
class Event:
    """One action on a timeline: ``rank``, the action string, its stream and ``[start, end)``."""

    rank: int
    action: str
    stream: str
    start: float
    end: float

    @property
    def kind(self) -> Kind:
        return Action.parse(self.action).kind


@dataclass
class Timeline:
    """A set of events with the numbers derived from it (see the module docstring)."""

    events: list[Event]
    makespan: float
    step_time: float
    bubble: float
    peak_in_flight: dict[int, int] = field(default_factory=dict)
    recorded: bool = False
    """From a real run's records (:func:`timeline_from_events`): times are seconds of the run."""
    starts: dict[int, float] = field(default_factory=dict)
    """Where a rank's recording started, when later than the first event (see :meth:`window`)."""

    @property
    def ranks(self) -> list[int]:
        return sorted({e.rank for e in self.events})

    def window(self, rank: int) -> tuple[float, float]:
        """``[start, end)`` of the time ``rank`` is accounted for: the whole timeline, or from
        ``starts[rank]`` where its recording started later."""
        t0 = min((e.start for e in self.events), default=0.0)
        return self.starts.get(rank, t0), t0 + self.makespan

    def busy(self, rank: int) -> float:
        """The time ``rank`` spends computing (forward, backward and update work): the rest of its
        window is its share of the bubble."""
        return sum(e.end - e.start for e in self.events if e.rank == rank and _is_busy(e))

    def steady_idle(self, rank: int) -> float:
        """``rank``'s idle share of a steady step: 1 less its busy time per step (over its
        ``UPDATE``s, one a step) over :attr:`step_time`. A schedule whose ranks compute at a given
        pace reaches at most 1 less this share of that pace's throughput."""
        steps = len(_updates(self.events, rank))
        if steps == 0:
            raise ValueError(f"rank {rank} runs no UPDATE in this timeline: it has no steps to share its time among")
        return 1.0 - self.busy(rank) / steps / self.step_time

    def action_times(self) -> dict[tuple[int, Kind], float]:
        """The mean time of one action per (stage, kind) of training's compute kinds (F, R, B, I,
        W) and ``UPDATE``: what :meth:`fxpipe.profile.Profile.action_times` measures in a run,
        here as this timeline ran them (a simulation's with the cores' sharing included)."""
        by: dict[tuple[int, Kind], list[float]] = {}
        for e in self.events:
            a = Action.parse(e.action)
            if a.kind in COMPUTE or a.kind is Kind.UPDATE:
                by.setdefault((a.stage, a.kind), []).append(e.end - e.start)
        return {key: sum(v) / len(v) for key, v in sorted(by.items())}


# The work a rank is busy with: the bubble is the rest (eval passes are forward work too).
_BUSY = COMPUTE | {Kind.UPDATE, Kind.EVAL}


def _is_busy(e: Event) -> bool:
    return e.stream == "compute" and e.kind in _BUSY


def _updates(events: Iterable[Event], rank: int) -> list[float]:
    """When ``rank``'s steps end: the ends of its first stage's UPDATEs (one a step; a rank of an
    interleaved pipeline updates each of its stages)."""
    ours = [(Action.parse(e.action).stage, e.end) for e in events if e.rank == rank and e.kind is Kind.UPDATE]
    first = min((s for s, _ in ours), default=None)
    return sorted(end for s, end in ours if s == first)


def _derive(events: list[Event]) -> Timeline:
    """Makespan, steady-state step time, bubble and peak in-flight micro-batches of a set of events."""
    if not events:
        return Timeline([], 0.0, 0.0, 0.0, {})
    t0 = min(e.start for e in events)
    makespan = max(e.end for e in events) - t0
    ranks = sorted({e.rank for e in events})
    busy = sum(e.end - e.start for e in events if _is_busy(e))
    bubble = 1.0 - busy / (len(ranks) * makespan) if makespan > 0 else 0.0
    # Steady-state time per batch: the median spacing of the first rank's updates (on shared
    # cores the steps that fill or drain the pipeline run faster than the steady ones).
    updates = _updates(events, ranks[0])
    step_time = statistics.median(b - a for a, b in zip(updates, updates[1:])) if len(updates) >= 2 else makespan
    peak: dict[int, int] = {}
    for r in ranks:
        live = best = 0
        for e in sorted((e for e in events if e.rank == r), key=lambda e: (e.start, e.end)):
            if e.kind is Kind.F:
                live += 1
                best = max(best, live)
            elif e.kind is Kind.B or e.kind is Kind.W:  # zb: a micro-batch is in flight until its W
                live -= 1
        peak[r] = best
    return Timeline(sorted(events, key=lambda e: (e.start, e.rank, e.end)), makespan, step_time, bubble, peak)


def simulate(actions_by_stage: Mapping[int, Sequence[Action]], costs: Costs | None = None, *,
             chunks: int = 1) -> Timeline:
    """Time one pipeline replica's lists (``generate``'s dict) under ``costs``. With ``chunks`` >
    1 (interleaved 1F1B) the lists are per lane: a lane's stages share its streams, and each
    action takes its own stage's cost.

    Each rank's streams (:func:`fxpipe.schedule.lower_to_streams`) run their ops in order, an op
    once its local waits are done. A communication op is posted to :class:`fxpipe.deps.Rendezvous`
    (the engine the validator and the single-process driver use, with each stream as its own
    lane) and runs, for its cost, from the moment the engine matches it with its counterpart or
    every member of its collective. Replicas of a stage run identical timelines, so a
    data-parallel all-reduce (a group of one stage here) costs ``costs.reduce`` with no
    cross-replica waiting. Raises :class:`ScheduleError` on a p2p order mismatch (the engine's
    :class:`~fxpipe.deps.CommOrderError`) or a deadlock, as :func:`fxpipe.schedule.validate` would.
    """
    costs = costs or Costs()
    d = len(actions_by_stage) * chunks
    ops = {s: lower_to_streams(actions_by_stage[s], d, chunks) for s in actions_by_stage}
    streams: dict[tuple[int, str], list] = defaultdict(list)
    for s, lst in ops.items():
        for op in lst:
            streams[s, op.stream].append(op)
    head = {key: 0 for key in streams}
    free = {key: 0.0 for key in streams}
    done: dict[tuple[int, str], float] = {}
    events: list[Event] = []
    posted: set[tuple[int, str]] = set()  # streams whose head op is posted and not complete

    def ready(key) -> float | None:
        op = streams[key][head[key]]
        times = [done.get((key[0], w)) for w in op.waits]
        if any(t is None for t in times):
            return None
        return max([free[key], *times])

    def duration(lane: int, a: Action) -> float:
        name, s = SPEC[a.kind].cost, a.stage
        if s == 0 and a.kind in (Kind.I, Kind.W):  # the first stage's W is its whole backward
            return 0.0 if a.kind is Kind.I else costs.per_stage("backward", s)
        if name == "p2p":  # both ends of a transfer take their boundary's time
            return costs.per_stage(name, s if a.kind in (Kind.SEND_ACT, Kind.RECV_GRAD) else s - 1)
        return 0.0 if name is None else costs.per_stage(name, s)

    def finish(key, start: float, end: float) -> None:
        op = streams[key][head[key]]
        events.append(Event(key[0], str(op.action), key[1], start, end))
        done[key[0], op.records] = end
        free[key] = end
        head[key] += 1

    def complete(matched: list[CommOp]) -> None:
        """The engine matched these posts: they run together from the last one's ready time."""
        start = max(o.payload[1] for o in matched)
        for o in matched:
            if o.held:  # a rank's earlier part of a collective: its stream went on when it was posted
                continue
            key = o.payload[0]
            posted.discard(key)
            finish(key, start, start + duration(key[0], streams[key][head[key]].action))

    # Compute on a shared host (``costs.cores``): a stream's compute op holds a share of the
    # cores from its start until its work (seconds alone) is done; the clock advances from one
    # start or finish to the next. Everything else runs at once, as without sharing.
    running: dict[tuple[int, str], list[float]] = {}  # key -> [start, seconds of work left]
    starting: dict[tuple[int, str], float] = {}  # key -> start of its head op, not reached yet
    now = 0.0

    def shares(key, a: Action) -> bool:
        return costs.cores is not None and key[1] == "compute" and duration(key[0], a) > 0

    engine = Rendezvous(_groups(actions_by_stage, chunks), on_complete=complete, lane=lambda op: op.payload[0])
    while True:
        progress = True
        while progress:
            progress = False
            for key in list(streams):
                while head[key] < len(streams[key]) and key not in posted and key not in running:
                    t = ready(key)
                    if t is None:
                        break
                    a = streams[key][head[key]].action
                    if shares(key, a):
                        starting[key] = t
                        break
                    progress = True
                    if SPEC[a.kind].comm is None:
                        finish(key, t, t + duration(key[0], a))
                        continue
                    op = comm_op(a, d, chunks)
                    op.payload = (key, t)
                    posted.add(key)
                    engine.post(op)  # completes it, and whatever it unblocks, when matched
                    if op.held:  # an earlier part of the rank's sum: handed over, the stream goes on
                        posted.discard(key)
                        finish(key, t, t)
        if not running and not starting:
            break
        rate = min(1.0, costs.cores / len(running)) if running else 1.0
        ends = {key: now + left / rate for key, (_, left) in running.items()}
        t = min([*ends.values(), *starting.values()])
        for key, work in running.items():
            work[1] -= (t - now) * rate
        now = t
        for key in [k for k, end in ends.items() if end <= now]:
            start, _ = running.pop(key)
            finish(key, start, now)
        for key in [k for k, start in starting.items() if start <= now]:
            running[key] = [starting.pop(key), duration(key[0], streams[key][head[key]].action)]
    stuck = [(k, streams[k][head[k]].action) for k in streams if head[k] < len(streams[k])]
    if stuck:
        where = "; ".join(f"{'stage' if chunks == 1 else 'lane'} {k[0]} {k[1]} at {a}" for k, a in sorted(stuck))
        raise ScheduleError(
            f"the simulated streams deadlock: {where}. Expected every op to become ready; "
            f"run fxpipe.schedule.validate on these lists to see the offending action"
        )
    return _derive(events)


def timeline_from_events(events: Iterable[tuple[int, str, float, float]], *, apart: bool = False) -> Timeline:
    """Build a :class:`Timeline` from a real run's records ``(rank, action_str, start_s, end_s)``.

    The runtime records each action it executes; the renderers then draw the measured run
    exactly as they draw a simulated one. ``apart``: each rank started recording on its own (one
    process per rank, each at its own ``step()`` call), so a rank's time before its first record
    is unknown, not idle: its :meth:`Timeline.window` starts there, and the bubble is the idle
    share of the ranks' windows (``1 - busy / sum of the windows``). Without ``apart`` (one
    process drives every rank) all windows start at the first record.
    """
    out = []
    for rank, text, start, end in events:
        a = Action.parse(text)
        out.append(Event(int(rank), str(a), stream_of(a), float(start), float(end)))
    tl = _derive(out)
    tl.recorded = True
    if apart:
        for e in tl.events:  # sorted by start
            tl.starts.setdefault(e.rank, e.start)
    spans = sum(b - a for a, b in map(tl.window, tl.ranks))
    tl.bubble = 1.0 - sum(map(tl.busy, tl.ranks)) / spans if spans > 0 else 0.0
    return tl


# ---------------------------------------------------------------------------------------------
# Renderings


def format_grid(timeline: Timeline, streams: Sequence[str] = ("compute",)) -> str:
    """Time slots x ranks text grid: one row per distinct start time, the action running per rank.

    ``.`` marks an idle rank (a bubble).
    """
    evs = [e for e in timeline.events if e.stream in streams and e.end > e.start]
    ranks = timeline.ranks
    times = sorted({e.start for e in evs})
    rows = [["time"] + [f"rank {r}" for r in ranks]]
    by_rank = defaultdict(list)
    for e in evs:
        by_rank[e.rank].append(e)
    for t in times:
        row = [f"{t:g}"]
        for r in ranks:
            cell = next((e.action for e in by_rank[r] if e.start <= t < e.end), ".")
            row.append(cell)
        rows.append(row)
    widths = [max(len(row[c]) for row in rows) for c in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows]
    lines.append(
        f"makespan {timeline.makespan:g}  step time {timeline.step_time:g}  bubble {timeline.bubble:.3f}  "
        f"peak in flight {timeline.peak_in_flight}"
    )
    return "\n".join(lines)


_STREAM_TID = {"compute": 0, "p2p_prev": 1, "p2p_next": 2, "reduce": 3}


def chrome_trace(timeline: Timeline, time_unit_us: float = 1e6) -> dict:
    """Chrome-trace / Perfetto JSON: one ``ph: "X"`` event per action, ``pid`` = rank, ``tid`` = stream.

    ``time_unit_us``: microseconds per timeline unit (1e6 when the timeline is in seconds).
    """
    trace: list[dict] = []
    for r in timeline.ranks:
        trace.append({"name": "process_name", "ph": "M", "pid": r, "tid": 0, "args": {"name": f"rank {r}"}})
        for name, tid in _STREAM_TID.items():
            trace.append({"name": "thread_name", "ph": "M", "pid": r, "tid": tid, "args": {"name": name}})
    for e in timeline.events:
        a = Action.parse(e.action)
        trace.append(
            {
                "name": e.action,
                "cat": a.kind.value,
                "ph": "X",
                "ts": e.start * time_unit_us,
                "dur": (e.end - e.start) * time_unit_us,
                "pid": e.rank,
                "tid": _STREAM_TID.get(e.stream, 4),
                "args": {"stage": a.stage, "index": a.index, "version": a.version},
            }
        )
    return {"traceEvents": trace, "displayTimeUnit": "ms"}


class _Look(NamedTuple):
    """How a drawn kind looks: ``word`` says what it is (legend, tooltips, the key), ``fill`` its
    colour; ``letter`` labels a compute box (legend "F forward"); ``what`` names what a collective
    reduces (the legend lists those present: "all-reduce: DP grads, loss")."""

    word: str
    fill: str
    letter: str | None = None
    what: str | None = None

    @property
    def legend(self) -> str:
        return f"{self.letter} {self.word}" if self.letter else self.word


# Every drawn kind, in legend order. Kinds not listed are not drawn: END_STEP only marks where
# step() returns. Compute kinds get a labelled box in the rank's row, the rest a box in the thin
# row under it.
_LOOK: dict[Kind, _Look] = {
    Kind.F: _Look("forward", "#4e79a7", "F"),
    Kind.R: _Look("recomputed forward", "#a0cbe8", "R"),
    Kind.B: _Look("backward", "#59a14f", "B"),
    Kind.I: _Look("input-gradient backward", "#8cd17d", "I"),
    Kind.W: _Look("weight-gradient backward", "#b6992d", "W"),
    Kind.UPDATE: _Look("optimizer step", "#e15759", "U"),
    Kind.EVAL: _Look("eval forward", "#f28e2b", "E"),
    Kind.SEND_ACT: _Look("send/recv activations", "#bab0ac"),
    Kind.RECV_ACT: _Look("send/recv activations", "#bab0ac"),
    Kind.SEND_GRAD: _Look("send/recv gradients", "#8c8c8c"),
    Kind.RECV_GRAD: _Look("send/recv gradients", "#8c8c8c"),
    Kind.DP_START: _Look("all-reduce", "#b07aa1", what="DP grads"),
    Kind.TIED_START: _Look("all-reduce", "#b07aa1", what="tied grads"),
    Kind.NORM_START: _Look("all-reduce", "#b07aa1", what="grad norm"),
    Kind.LOSS: _Look("all-reduce", "#b07aa1", what="loss"),
    **{k: _Look("wait for an all-reduce", "#dcc3d6") for k in WAITS},
}
assert {k for k, look in _LOOK.items() if look.what} == COLLECTIVES, "every collective needs its _LOOK row"
# The kinds a box's label and tooltip number by micro-batch (and weight version).
_PER_MICROBATCH = frozenset(k for k, look in _LOOK.items() if look.letter) - {Kind.UPDATE}
_IDLE_FILL, _IDLE_HATCH = "#ececec", "#bdbdbd"
_CHAR = 0.6  # width of a monospace character, in font sizes (DejaVu Sans Mono: 0.602)


def _unit(unit: str | None) -> tuple[float, str]:
    """(factor from timeline units to displayed units, displayed unit's name): seconds show as ms."""
    if unit == "s":
        return 1e3, "ms"
    return 1.0, unit or "units"


def _num(x: float) -> str:
    """Four significant digits without an exponent: 172.9, 33.21, 0.4662, 1200."""
    return f"{x:.0f}" if abs(x) >= 1000 else f"{x:.4g}"


def _ticks(span: float) -> list[tuple[float, str]]:
    """Round tick values 0, s, 2s, ... <= span, s in {1, 2, 2.5, 5} x 10^n, about ten of them."""
    if span <= 0:
        return [(0.0, "0")]
    raw = span / 10
    mag = 10.0 ** math.floor(math.log10(raw))
    step = next(f * mag for f in (1, 2, 2.5, 5, 10) if f * mag >= raw * (1 - 1e-9))
    decimals = 0
    while decimals < 9 and abs(step * 10**decimals - round(step * 10**decimals)) > 1e-6:
        decimals += 1
    return [(i * step, f"{i * step:.{decimals}f}") for i in range(int(span / step + 1e-9) + 1)]


def _infer_microbatches(timeline: Timeline) -> int | None:
    """Micro-batches per step, from the forwards a rank runs between two END_STEPs (every stage's
    segment of step t holds exactly batch t's forwards, :mod:`fxpipe.schedule`); None without one."""
    counts = []
    for r in timeline.ranks:
        n = 0
        for e in timeline.events:
            if e.rank != r:
                continue
            if e.kind is Kind.F:
                n += 1
            elif e.kind is Kind.END_STEP:
                counts.append(n)
                n = 0
    return max(counts) if counts and max(counts) > 0 else None


def _step_of(a: Action, m: int | None) -> int | None:
    """The step (batch) an action belongs to; None for an eval pass or an unknown ``m``."""
    if a.kind in PER_BATCH:
        return a.index
    if a.kind is Kind.EVAL or m is None:
        return None
    return batch_of(a.index, m)


def _within(a: Action, m: int | None) -> int:
    """A micro-batch's number within its step (1..m); the run-wide index when ``m`` is unknown."""
    t = _step_of(a, m)
    return a.index if t is None or a.kind in PER_BATCH else a.index - (t - 1) * m


def _label(a: Action, m: int | None, staged: bool = False) -> list[tuple[str, ...]]:
    """A compute box's labels (lines each), the most complete first: ``F3v2`` (micro-batch 3 of
    its step, weight version 2), the same on two lines, ``F3``, ``F``; ``U5`` (the update with
    step 5's gradients), ``U``. ``staged`` (a rank of several stages): ``s1:F3v2``, ``s1:F3``,
    ``s1:U5``, then the unstaged forms."""
    letter = _LOOK[a.kind].letter
    if a.kind is Kind.UPDATE:
        plain = [(f"U{a.index}",), (letter,)]
    else:
        k = _within(a, m)
        plain = ([(f"{letter}{k}",), (letter,)] if a.version is None else
                 [(f"{letter}{k}v{a.version}",), (f"{letter}{k}", f"v{a.version}"), (f"{letter}{k}",), (letter,)])
    if not staged:
        return plain
    s = f"s{a.stage}:"
    return [(s + plain[0][0],), (s + plain[0][0][:-len(f"v{a.version}")] if a.version is not None else s + letter,
                                 *((f"v{a.version}",) if a.version is not None else ()))] + plain


def _describe(a: Action, m: int | None) -> str:
    """One action in words (each box's tooltip)."""
    t = _step_of(a, m)
    if a.kind is Kind.UPDATE:
        return f"optimizer step with step {a.index}'s gradients (makes weight version {a.index})"
    if a.kind in _PER_MICROBATCH:
        where = f"micro-batch {_within(a, m)} of step {t}" if t is not None else f"micro-batch {a.index}"
        version = "" if a.version is None else f", weight version {a.version}"
        return f"{_LOOK[a.kind].word} of {where}{version}"
    look = _LOOK.get(a.kind)
    what = (look.what or look.word) if look else a.kind.value
    return f"{what} ({'step' if a.kind in PER_BATCH else 'micro-batch'} {a.index})"


def _idle(timeline: Timeline, rank: int) -> tuple[float, list[tuple[float, float]]]:
    """Idle time of ``rank`` over its window (no F, R, B, UPDATE or EVAL running) and its gaps."""
    t0, t1 = timeline.window(rank)
    spans = sorted((e.start, e.end) for e in timeline.events if e.rank == rank and _is_busy(e))
    gaps, at = [], t0
    for s, e in spans:
        if s > at:
            gaps.append((at, s))
        at = max(at, e)
    if at < t1:
        gaps.append((at, t1))
    return sum(e - s for s, e in gaps), gaps


def idle_by_rank(timeline: Timeline) -> dict[int, float]:
    """Each rank's idle time over its :meth:`Timeline.window` (the ``makespan`` for a simulated
    one): the time no F, R, B, UPDATE or EVAL runs on it. ``sum(idle) / sum(windows)`` is the
    timeline's bubble."""
    return {r: _idle(timeline, r)[0] for r in timeline.ranks}


def _window_text(timeline: Timeline, m: int | None, total_steps: int | None) -> str:
    """Which part of a run the timeline covers: ``steps 5-6 of 6, then the flush, t = ... s``."""
    ends: dict[int, float] = {}
    steps: set[int] = set()
    for e in timeline.events:
        if e.kind is Kind.END_STEP:
            steps.add(Action.parse(e.action).index)
            ends[e.rank] = max(ends.get(e.rank, e.start), e.start)
    if steps:
        work = COMPUTE | {Kind.UPDATE}  # an eval pass after the last step is no flush
        flush = any(e.kind in work and e.rank in ends and e.start >= ends[e.rank] for e in timeline.events)
    else:  # no segment ends: the steps whose work is shown
        steps = {t for e in timeline.events if e.kind in _BUSY and (t := _step_of(Action.parse(e.action), m))}
        flush = False
    parts = []
    if steps:
        lo, hi = min(steps), max(steps)
        text = f"step {lo}" if lo == hi else f"steps {lo}-{hi}"
        parts.append(text + (f" of {total_steps}" if total_steps else "") + (", then the flush" if flush else ""))
    elif any(e.kind is Kind.EVAL for e in timeline.events):
        parts.append("an eval pass")
    t0 = min((e.start for e in timeline.events), default=0.0)
    if timeline.recorded:
        parts.append(f"t = {t0:.3f}-{t0 + timeline.makespan:.3f} s of the run")
    return ", ".join(parts)


def _hatch(x0: float, x1: float, y: float, h: float, pitch: float = 6.0) -> str:
    """Path data for 45-degree hatching of the box [x0, x1] x [y, y + h], clipped to it."""
    d = []
    xs = x0 - h
    while xs < x1:
        a, b = max(xs, x0), min(xs + h, x1)  # the line runs from (xs, y+h) to (xs+h, y)
        if b > a:
            d.append(f"M{a:.1f} {y + h - (a - xs):.1f}L{b:.1f} {y + h - (b - xs):.1f}")
        xs += pitch
    return "".join(d)


def render_svg(
    timeline: Timeline,
    title: str = "fxpipe schedule",
    width: int = 1200,
    *,
    unit: str | None = None,
    microbatches: int | None = None,
    total_steps: int | None = None,
) -> str:
    """A self-contained SVG of a timeline (no scripts, links, fonts or references to fetch).

    One row per rank: its compute boxes (F, R, B, UPDATE, EVAL), labelled when wide enough
    (``F3v2``: forward of micro-batch 3 of its step on weight version 2; ``U5``: the update with
    step 5's gradients; ``s2:F3v2``, stage 2's, where a rank runs several), idle time hatched grey and summed at the row's label, and a thin row
    below for communication. Above the rows, one bracket per step over its micro-batches. The time axis
    starts at the window's start; the header says which steps and times the window holds, the
    makespan and the bubble (%); the legend lists exactly the kinds drawn (idle only where a rank
    is idle), the key the label format.

    ``unit``: what the timeline's numbers are: ``"s"`` (seconds, drawn in ms: the plan's predicted
    costs; the default for a recorded timeline) or None for the abstract units of a :class:`Costs`.
    A recorded timeline's rank rows start at the rank's first record (:meth:`Timeline.window`).
    ``microbatches``: m, to number micro-batches within their step (inferred from the END_STEPs
    when None; without any, the run-wide index is shown). ``total_steps``: the run's length, for
    "steps 5-6 of 6".
    """
    ranks = timeline.ranks
    unit = unit or ("s" if timeline.recorded else None)
    factor, uname = _unit(unit)
    m = microbatches or _infer_microbatches(timeline)
    t0 = min((e.start for e in timeline.events), default=0.0)
    span = timeline.makespan
    left, right = 150, 24
    scale = (width - left - right) / span if span > 0 else 0.0

    def x_of(t: float) -> float:
        return left + (t - t0) * scale

    def fits(text: str, w: float, size: float = 10) -> bool:
        return w >= _CHAR * size * len(text) + 2

    # Zero-length events are left out, but for an unpriced UPDATE (a tick: where the version changes).
    drawn = [(e, Action.parse(e.action)) for e in timeline.events
             if e.kind in _LOOK and (e.end > e.start or e.kind is Kind.UPDATE)]
    held = {r: sorted({Action.parse(e.action).stage for e in timeline.events if e.rank == r}) for r in ranks}
    staged = any(len(h) > 1 for h in held.values())  # an interleaved pipeline: say whose stage a box is
    body: list[str] = []

    # Header: title, the window and its numbers, the key to the labels.
    window = _window_text(timeline, m, total_steps)
    share = "the ranks' recorded time" if timeline.starts else \
        f"{len(ranks)} rank{'s' * (len(ranks) != 1)} x makespan"
    summary = (f"{window}; " if window else "") + (
        f"makespan {_num(span * factor)} {uname}; bubble {100 * timeline.bubble:.1f}% (idle share of {share})"
    )
    example = next((a for _, a in drawn if a.kind in _PER_MICROBATCH and a.version is not None), None)
    key = []
    if example is not None:
        of = f"micro-batch {_within(example, m)} (of {m}) of its step" if m else \
            f"micro-batch {example.index} (numbered across the run)"
        whose = f"stage {example.stage}'s " if staged else ""
        key.append(f"{_label(example, m, staged)[0][0]} = {whose}{_LOOK[example.kind].word} of {of} on weight version "
                   f"{example.version}")
    elif (example := next((a for _, a in drawn if a.kind is Kind.EVAL), None)) is not None:  # an eval pass
        key.append(f"{_label(example, m)[0][0]} = {_LOOK[Kind.EVAL].word} of micro-batch {example.index} of the batch "
                   f"(newest weights)")
    update = next((a for _, a in drawn if a.kind is Kind.UPDATE), None)
    if update is not None:
        key.append(f"U{update.index} = optimizer step with step {update.index}'s gradients")
    # Idle per rank over its window; hatching, its key and its legend entry only where there is some
    # (gaps below a billionth of the makespan are rounding, not time a reader could see).
    idle_of = {r: _idle(timeline, r) for r in ranks}
    idle_of = {r: (total, [(a, b) for a, b in gaps if b - a > 1e-9 * span]) for r, (total, gaps) in idle_of.items()}
    any_idle = any(gaps for _, gaps in idle_of.values())
    if any_idle:
        key.append("hatched = idle")
    header = [(title, 13, "bold"), (summary, 11, None), ("key: " + "; ".join(key), 10, None)]
    y = 4
    for text, size, weight in header:
        y += size + 5
        bold = f' font-weight="{weight}"' if weight else ""
        body.append(f'<text x="6" y="{y}" font-size="{size}"{bold}>{escape(text)}</text>')
    y += 8

    # Steps: a bracket over each step's micro-batches (F, R, B on all ranks; its UPDATE is labelled
    # with the step), in as few lanes as overlap allows, with a gap between neighbours in a lane.
    spans: dict[int, list[float]] = {}
    for e, a in drawn:
        t = _step_of(a, m) if a.kind in COMPUTE else None
        if t is not None:
            s = spans.setdefault(t, [e.start, e.end])
            s[0], s[1] = min(s[0], e.start), max(s[1], e.end)
    lanes: list[float] = []
    brackets = []
    for t, (s, e) in sorted(spans.items()):
        lane = next((i for i, end in enumerate(lanes) if (s - end) * scale >= 8), len(lanes))
        lanes[lane:lane + 1] = [e]
        brackets.append((t, s, e, lane))
    steps_top = y
    for t, s, e, lane in brackets:
        x1, x2, yl = x_of(s), x_of(e), steps_top + lane * 14 + 11
        body.append(f'<path d="M{x1:.1f} {yl + 3}V{yl}H{x2:.1f}V{yl + 3}" fill="none" stroke="#555555"/>')
        text = next((c for c in (f"step {t}", str(t)) if fits(c, x2 - x1, 9)), None)
        if text:
            body.append(f'<text x="{(x1 + x2) / 2:.1f}" y="{yl - 2}" font-size="9" text-anchor="middle">{text}</text>')
    y += len(lanes) * 14 + (4 if lanes else 0)

    # One row per rank: idle gaps hatched, compute boxes, communication below.
    row_h, comm_h, gap = 28, 10, 10
    for r in ranks:
        stage = f"stage {held[r][0]}" if len(held[r]) == 1 else f"stages {', '.join(map(str, held[r]))}"
        idle, gaps = idle_of[r]
        start, end = timeline.window(r)
        pct = 100 * idle / (end - start) if end > start else 0.0
        if start > t0:  # a recording: this rank's earlier work is not in it
            w = x_of(start) - left
            body.append(f'<rect x="{left}" y="{y}" width="{w:.2f}" height="{row_h}" fill="#ffffff" stroke="#bbbbbb" '
                        f'stroke-dasharray="2 2"><title>before this rank\'s first record</title></rect>')
            if fits("not recorded", w, 9):
                body.append(f'<text x="{left + w / 2:.1f}" y="{y + row_h / 2 + 3}" font-size="9" text-anchor="middle" '
                            f'fill="#888888">not recorded</text>')
        body.append(f'<text x="6" y="{y + 11}">rank {r}, {stage}</text>')
        body.append(f'<text x="6" y="{y + 24}" fill="#555555">idle {_num(idle * factor)} {uname} ({pct:.1f}%)</text>')
        for s, e in gaps:
            x1, x2 = x_of(s), x_of(e)
            body.append(f'<rect x="{x1:.2f}" y="{y}" width="{x2 - x1:.2f}" height="{row_h}" fill="{_IDLE_FILL}">'
                        f'<title>idle {_num((e - s) * factor)} {uname}</title></rect>')
            if x2 - x1 > 2:
                body.append(f'<path d="{_hatch(x1, x2, y, row_h)}" stroke="{_IDLE_HATCH}" stroke-width="1"/>')
        for e, a in sorted(drawn, key=lambda ea: ea[0].end == ea[0].start):  # ticks on top of boxes
            if e.rank != r:
                continue
            box = _is_busy(e)
            x, w = x_of(e.start), max((e.end - e.start) * scale, 2.5 if box else 0.5)
            yy, hh = (y, row_h) if box else (y + row_h + 1, comm_h)
            fill = _LOOK[a.kind].fill
            tip = (f"{e.action}: {_describe(a, m)}, {_num((e.start - t0) * factor)}-{_num((e.end - t0) * factor)} "
                   f"{uname} ({_num((e.end - e.start) * factor)} {uname})")
            body.append(f'<rect x="{x:.2f}" y="{yy}" width="{w:.2f}" height="{hh}" fill="{fill}" stroke="#ffffff" '
                        f'stroke-width="0.5"><title>{escape(tip)}</title></rect>')
            lines = next((c for c in _label(a, m, staged) if all(fits(t, w) for t in c)), ()) if box else ()
            ink = "#000000" if a.kind in (Kind.R, Kind.I) else "#ffffff"
            for i, text in enumerate(lines):
                ty = yy + hh / 2 + 3.5 + (i - (len(lines) - 1) / 2) * 11
                body.append(f'<text x="{x + w / 2:.2f}" y="{ty:.1f}" text-anchor="middle" fill="{ink}">'
                            f"{escape(text)}</text>")
        y += row_h + 1 + comm_h + gap

    # Time axis from the window's start, with round ticks and faint grid lines behind the rows.
    axis_y = y
    grid = []
    for value, text in _ticks(span * factor):
        x = left + value / factor * scale
        grid.append(f'<line x1="{x:.1f}" y1="{steps_top}" x2="{x:.1f}" y2="{axis_y}" stroke="#dddddd"/>')
        body.append(f'<line x1="{x:.1f}" y1="{axis_y}" x2="{x:.1f}" y2="{axis_y + 4}" stroke="#333333"/>')
        body.append(f'<text x="{x:.1f}" y="{axis_y + 15}" text-anchor="middle">{text}</text>')
    body.append(f'<line x1="{left}" y1="{axis_y}" x2="{left + span * scale:.2f}" y2="{axis_y}" stroke="#333333"/>')
    origin = f" (t = {t0:.3f} s of the run)" if timeline.recorded else ""
    what = uname if unit else "abstract units (those of the simulator's Costs, not seconds)"
    body.append(f'<text x="{left}" y="{axis_y + 29}">time in {what} since the window\'s start{origin}</text>')

    # Legend: exactly the kinds drawn, then idle where there is any.
    entries: dict[str, str] = {}
    reduced = sorted({_LOOK[a.kind].what for _, a in drawn if a.kind in COLLECTIVES})
    order = {k: i for i, k in enumerate(_LOOK)}
    for _, a in sorted(drawn, key=lambda ea: order[ea[1].kind]):
        name, fill = _LOOK[a.kind].legend, _LOOK[a.kind].fill
        if a.kind in COLLECTIVES:
            name = f"{name}: {', '.join(reduced)}"
        elif a.kind is Kind.UPDATE and not any(e.end > e.start for e, b in drawn if b.kind is Kind.UPDATE):
            name += " (not priced: a tick)"
        entries.setdefault(name, fill)
    items = [(name, f'fill="{fill}"') for name, fill in entries.items()]
    if any_idle:
        items.append(("idle (hatched)", None))
    lx, ly = left, axis_y + 44
    for name, fill in items:
        w = 16 + _CHAR * 10 * len(name) + 18
        if lx + w > width - right and lx > left:
            lx, ly = left, ly + 16
        if fill is None:
            body.append(f'<rect x="{lx}" y="{ly}" width="12" height="12" fill="{_IDLE_FILL}"/>')
            body.append(f'<path d="{_hatch(lx, lx + 12, ly, 12, 4)}" stroke="{_IDLE_HATCH}"/>')
        else:
            body.append(f'<rect x="{lx}" y="{ly}" width="12" height="12" {fill}/>')
        body.append(f'<text x="{lx + 16}" y="{ly + 10}" class="legend">{escape(name)}</text>')
        lx += w
    thin = [name for name in entries if name.startswith(("send", "all-reduce", "wait"))]
    if thin:
        ly += 16
        what = ", ".join(name.split(":")[0] for name in thin)
        body.append(f'<text x="{left}" y="{ly + 10}" fill="#555555">thin row under each rank: {escape(what)}</text>')
    height = ly + 22
    return "\n".join([
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" font-family="monospace" font-size="10">',
        f"<title>{escape(title)}</title>",
        f'<rect width="{width}" height="{height}" fill="#ffffff"/>',
        *grid,
        *body,
        "</svg>",
    ]) + "\n"


def write_schedule_dumps(
    out_dir: str | Path,
    actions_by_stage: Mapping[int, Sequence[Action]],
    costs: Costs | None = None,
    *,
    name: str = "schedule",
    timeline: Timeline | None = None,
    title: str | None = None,
    unit: str | None = None,
    microbatches: int | None = None,
    total_steps: int | None = None,
    chunks: int = 1,
) -> dict[str, Path]:
    """Write ``{name}.txt`` (action grid + time grid + summary), ``{name}.json`` (Chrome trace) and
    ``{name}.svg`` (picture) into ``out_dir``; return their paths keyed "txt", "json", "svg".

    ``actions_by_stage``: ``fxpipe.schedule.generate(...)``'s dict. ``timeline``: draw this one
    (e.g. :func:`timeline_from_events` of a real run) instead of simulating ``costs``. ``title``
    (default ``name``), ``unit`` (``"s"`` when the costs or the recording are seconds),
    ``microbatches`` and ``total_steps`` go to :func:`render_svg`. ``chunks``: stages per rank (the
    lists are per lane, :func:`fxpipe.schedule.generate`).
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tl = timeline if timeline is not None else simulate(actions_by_stage, costs, chunks=chunks)
    paths = {"txt": out / f"{name}.txt", "json": out / f"{name}.json", "svg": out / f"{name}.svg"}
    text = [
        f"# {name}: action lists (row = position in each rank's list)",
        format_actions(actions_by_stage),
        "",
        "# timeline (compute stream)",
        format_grid(tl),
        "",
    ]
    paths["txt"].write_text("\n".join(text), encoding="utf-8")
    paths["json"].write_text(json.dumps(chrome_trace(tl), indent=1), encoding="utf-8")
    svg = render_svg(tl, title=title or name, unit=unit, microbatches=microbatches, total_steps=total_steps)
    paths["svg"].write_text(svg, encoding="utf-8")
    return paths
