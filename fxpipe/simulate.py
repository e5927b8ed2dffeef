"""Timing a schedule without running it: simulator, and text / Chrome-trace / SVG timelines.

:func:`simulate` replays per-stage action lists (:mod:`fxpipe.schedule`) on the streams of
:func:`fxpipe.schedule.lower_to_streams`: each rank's ``compute`` stream runs F/R/B/UPDATE in
order, each stage pair shares one FIFO p2p channel (a SEND and its RECV run together, for
``costs.p2p``, once both are at the head of their streams and the send's producer finished), and
collectives run on the ``reduce`` stream once every member issued them. The result holds one
:class:`Event` per action with its start and end, the makespan, the steady-state step time, the
bubble fraction and the peak number of micro-batches in flight per stage.

Bubble fraction: ``1 - busy / (d * makespan)`` where ``busy`` sums the compute time (F, R, B,
UPDATE) of all d stages. For one step of gpipe or 1f1b with equal stage costs and free
communication this is exactly ``(d-1)/(m+d-1)`` (GPipe, Huang et al. 2019, section 2.2).

Renderings, all from a :class:`Timeline` (simulated, or recorded from a real run with
:func:`timeline_from_events`): :func:`format_grid` (time slots x ranks for a terminal),
:func:`chrome_trace` (``{"traceEvents": [...]}`` for chrome://tracing or ui.perfetto.dev),
:func:`render_svg` (one self-contained SVG file: no scripts, links or fonts to fetch), and
:func:`write_schedule_dumps`, which writes all three for ``fxpipe inspect``.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from xml.sax.saxutils import escape

from fxpipe.deps import CommOp, Rendezvous
from fxpipe.errors import ScheduleError
from fxpipe.schedule import (
    COMPUTE,
    SPEC,
    WAITS,
    Action,
    Kind,
    _groups,
    comm_op,
    format_actions,
    lower_to_streams,
    stream_of,
)

__all__ = [
    "Costs",
    "Event",
    "Timeline",
    "chrome_trace",
    "format_grid",
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
    recompute: float | Sequence[float] | None = None
    """Recomputed forward before a backward; None = the forward time again."""
    p2p: float = 0.0
    """One activation or gradient transfer between neighbouring stages."""
    update: float = 0.0
    """Optimizer step of one stage."""
    reduce: float = 0.0
    """One asynchronous reduction (data-parallel all-reduce, tied-weight sum, norm all-reduce)."""

    def per_stage(self, name: str, stage: int) -> float:
        value = getattr(self, name)
        if value is None and name == "recompute":
            value = self.forward
        if isinstance(value, (int, float)):
            return float(value)
        if stage >= len(value):
            raise ScheduleError(f"Costs.{name} has {len(value)} entries, expected one per stage (stage {stage} is missing)")
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

    @property
    def ranks(self) -> list[int]:
        return sorted({e.rank for e in self.events})


def _derive(events: list[Event], steps_hint: int | None = None) -> Timeline:
    """Makespan, steady-state step time, bubble and peak in-flight micro-batches of a set of events."""
    if not events:
        return Timeline([], 0.0, 0.0, 0.0, {})
    t0 = min(e.start for e in events)
    makespan = max(e.end for e in events) - t0
    ranks = sorted({e.rank for e in events})
    busy = sum(e.end - e.start for e in events if e.stream == "compute" and e.kind in COMPUTE | {Kind.UPDATE})
    bubble = 1.0 - busy / (len(ranks) * makespan) if makespan > 0 else 0.0
    # Steady-state time per batch: the spacing of the first rank's updates.
    first = ranks[0]
    updates = sorted(e.end for e in events if e.rank == first and e.kind is Kind.UPDATE)
    step_time = (updates[-1] - updates[0]) / (len(updates) - 1) if len(updates) >= 2 else makespan
    peak: dict[int, int] = {}
    for r in ranks:
        live = best = 0
        for e in sorted((e for e in events if e.rank == r), key=lambda e: (e.start, e.end)):
            if e.kind is Kind.F:
                live += 1
                best = max(best, live)
            elif e.kind is Kind.B:
                live -= 1
        peak[r] = best
    return Timeline(sorted(events, key=lambda e: (e.start, e.rank, e.end)), makespan, step_time, bubble, peak)


def simulate(actions_by_stage: Mapping[int, Sequence[Action]], costs: Costs | None = None) -> Timeline:
    """Time one pipeline replica's lists (``generate``'s dict) under ``costs``.

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
    ops = {s: lower_to_streams(actions_by_stage[s]) for s in actions_by_stage}
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

    def duration(s: int, a: Action) -> float:
        name = SPEC[a.kind].cost
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
            key = o.payload[0]
            posted.discard(key)
            finish(key, start, start + duration(key[0], streams[key][head[key]].action))

    engine = Rendezvous(_groups(actions_by_stage), on_complete=complete, lane=lambda op: op.payload[0])
    progress = True
    while progress:
        progress = False
        for key in list(streams):
            while head[key] < len(streams[key]) and key not in posted:
                t = ready(key)
                if t is None:
                    break
                a = streams[key][head[key]].action
                progress = True
                if SPEC[a.kind].comm is None:
                    finish(key, t, t + duration(key[0], a))
                    continue
                op = comm_op(a)
                op.payload = (key, t)
                posted.add(key)
                engine.post(op)  # completes it, and whatever it unblocks, when matched
    stuck = [(k, streams[k][head[k]].action) for k in streams if head[k] < len(streams[k])]
    if stuck:
        where = "; ".join(f"stage {k[0]} {k[1]} at {a}" for k, a in sorted(stuck))
        raise ScheduleError(
            f"the simulated streams deadlock: {where}. Expected every op to become ready; "
            f"run fxpipe.schedule.validate on these lists to see the offending action"
        )
    return _derive(events)


def timeline_from_events(events: Iterable[tuple[int, str, float, float]]) -> Timeline:
    """Build a :class:`Timeline` from a real run's records ``(rank, action_str, start_s, end_s)``.

    The runtime records each action it executes; the renderers then draw the measured run
    exactly as they draw a simulated one.
    """
    out = []
    for rank, text, start, end in events:
        a = Action.parse(text)
        out.append(Event(int(rank), str(a), stream_of(a), float(start), float(end)))
    return _derive(out)


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


_COLOURS = {
    Kind.F: "#4e79a7",
    Kind.R: "#a0cbe8",
    Kind.B: "#59a14f",
    Kind.UPDATE: "#e15759",
    Kind.SEND_ACT: "#bab0ac",
    Kind.RECV_ACT: "#bab0ac",
    Kind.SEND_GRAD: "#9c9c9c",
    Kind.RECV_GRAD: "#9c9c9c",
}
_REDUCE_COLOUR = "#b07aa1"


def render_svg(timeline: Timeline, title: str = "fxpipe schedule", width: int = 1200) -> str:
    """A self-contained SVG: one row per rank (compute on top, communication below), coloured boxes
    labelled ``k`` or ``kvN`` (micro-batch and version) or ``Ut`` (update), a time axis and a legend."""
    ranks = timeline.ranks
    left, top, row_h, comm_h, gap = 70, 40, 28, 10, 8
    span = timeline.makespan or 1.0
    t0 = min((e.start for e in timeline.events), default=0.0)
    scale = (width - left - 20) / span
    height = top + len(ranks) * (row_h + comm_h + gap) + 50
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" font-family="monospace" font-size="10">',
        f'<title>{escape(title)}</title>',
        f'<text x="{left}" y="16" font-size="13">{escape(title)} — makespan {timeline.makespan:g}, '
        f'bubble {timeline.bubble:.3f}</text>',
    ]
    for i, r in enumerate(ranks):
        y = top + i * (row_h + comm_h + gap)
        out.append(f'<text x="4" y="{y + row_h * 0.65:.1f}">rank {r}</text>')
        out.append(f'<rect x="{left}" y="{y}" width="{span * scale:.2f}" height="{row_h}" fill="#f4f4f4"/>')
        for e in (e for e in timeline.events if e.rank == r):
            a = Action.parse(e.action)
            x = left + (e.start - t0) * scale
            w = max((e.end - e.start) * scale, 0.5)
            compute = e.stream == "compute"
            if compute and a.kind in WAITS:
                continue  # zero-length joins clutter the picture; the reduce row shows the collective
            yy, hh = (y, row_h) if compute else (y + row_h + 1, comm_h)
            colour = _COLOURS.get(a.kind, _REDUCE_COLOUR)
            label = (
                f"U{a.index}" if a.kind is Kind.UPDATE
                else f"{a.kind.value}{a.index}" + ("" if a.version is None else f"v{a.version}")
            )
            out.append(
                f'<rect x="{x:.2f}" y="{yy}" width="{w:.2f}" height="{hh}" fill="{colour}" stroke="#ffffff" '
                f'stroke-width="0.5"><title>{escape(e.action)} [{e.start:g}, {e.end:g})</title></rect>'
            )
            if compute and w > 7 * len(label):
                out.append(
                    f'<text x="{x + w / 2:.2f}" y="{yy + hh * 0.65:.1f}" text-anchor="middle" fill="#ffffff">'
                    f"{escape(label)}</text>"
                )
    axis_y = top + len(ranks) * (row_h + comm_h + gap) + 4
    out.append(f'<line x1="{left}" y1="{axis_y}" x2="{left + span * scale:.2f}" y2="{axis_y}" stroke="#333333"/>')
    for j in range(11):
        x = left + span * scale * j / 10
        out.append(f'<text x="{x:.1f}" y="{axis_y + 14}" text-anchor="middle">{t0 + span * j / 10:.3g}</text>')
    legend = [("F", _COLOURS[Kind.F]), ("R", _COLOURS[Kind.R]), ("B", _COLOURS[Kind.B]),
              ("UPDATE", _COLOURS[Kind.UPDATE]), ("p2p", _COLOURS[Kind.SEND_ACT]), ("reduce", _REDUCE_COLOUR)]
    for j, (name, colour) in enumerate(legend):
        x = left + j * 90
        out.append(f'<rect x="{x}" y="{axis_y + 24}" width="12" height="12" fill="{colour}"/>')
        out.append(f'<text x="{x + 16}" y="{axis_y + 34}">{name}</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


def write_schedule_dumps(
    out_dir: str | Path,
    actions_by_stage: Mapping[int, Sequence[Action]],
    costs: Costs | None = None,
    *,
    name: str = "schedule",
    timeline: Timeline | None = None,
) -> dict[str, Path]:
    """Write ``{name}.txt`` (action grid + time grid + summary), ``{name}.json`` (Chrome trace) and
    ``{name}.svg`` (picture) into ``out_dir``; return their paths keyed "txt", "json", "svg".

    ``actions_by_stage``: ``fxpipe.schedule.generate(...)``'s dict. ``timeline``: draw this one
    (e.g. :func:`timeline_from_events` of a real run) instead of simulating ``costs``.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tl = timeline if timeline is not None else simulate(actions_by_stage, costs)
    paths = {"txt": out / f"{name}.txt", "json": out / f"{name}.json", "svg": out / f"{name}.svg"}
    text = [
        f"# {name}: action lists (row = position in each rank's list)",
        format_actions(actions_by_stage),
        "",
        "# timeline (compute stream)",
        format_grid(tl),
        "",
    ]
    paths["txt"].write_text("\n".join(text))
    paths["json"].write_text(json.dumps(chrome_trace(tl), indent=1))
    paths["svg"].write_text(render_svg(tl, title=name))
    return paths
