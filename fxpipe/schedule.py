"""Pipeline schedules as data: per-rank action lists for gpipe, 1f1b, 2bw and zb, checked and lowered.

A schedule is what each rank of a pipeline replica (its *lane*) does, in order: a
:class:`Program` hands out one *segment* per step (ending with ``END_STEP t``), a *drain* for a
flush and an *eval* pass, all generated on demand and periodic, so nothing grows with the run.
:func:`generate` concatenates the segments of a fixed number of steps and a flush into
``{lane: [Action, ...]}``. A lane runs one stage (lane ``s`` is stage ``s``), or under
interleaved 1F1B (``chunks`` > 1) several: stage ``j`` on lane ``j mod (stages / chunks)``. Nothing here
runs a model or touches a process group; the runtime executes the lists, the simulator
(:mod:`fxpipe.simulate`) times them, and :func:`validate` proves the invariants. docs/design.md
("The schedule IR", "The NCCL contract") explains the design; this docstring is the reference.

Actions
-------
``Action(stage, kind, index, version)`` prints as ``{stage}{KIND}{index}[v{version}]`` and
``Action.parse`` reads that string back (``str(Action.parse(s)) == s``)::

    1F3v0        stage 1, forward of micro-batch 3 on weight version 0
    1R3v0        stage 1 recomputes micro-batch 3's forward (activation recomputation) right before 1B3v0
    1B3v0        stage 1, backward of micro-batch 3 on weight version 0
    1I3v0        zb: stage 1, input-gradient half of micro-batch 3's backward (what SEND_GRAD3 sends)
    1W3v0        zb: stage 1, weight-gradient half of micro-batch 3's backward (deferred; frees it)
    0SEND_ACT3   stage 0 posts the send of micro-batch 3's activations to stage 1
    1RECV_ACT3   stage 1 posts the receive of those activations from stage 0
    1SEND_GRAD3  stage 1 posts the send of the gradient of its input to stage 0
    0RECV_GRAD3  stage 0 posts the receive of that gradient from stage 1
    0DP_START1   issue the data-parallel all-reduce of batch 1's gradients (replicas of stage 0)
    0DP_WAIT1    wait for it
    0TIED_START1 issue the tied-weight gradient sum of batch 1 (the stages holding a tied copy)
    0TIED_WAIT1  wait for it
    0NORM_START1 issue the all-reduce of batch 1's squared gradient norm (all stages of a replica)
    0NORM_WAIT1  wait for it (the global norm is then known: clip, then update)
    0UPDATE1     optimizer step with batch 1's gradients: produces weight version W(1)
    0LOSS1       post the all-reduce that gives every rank batch 1's mean loss (right before END_STEP1)
    0END_STEP1   step 1's segment ends: return to the caller (what follows needs batch 2)
    1EVAL3       eval_step: forward-only pass of micro-batch 3, newest weights, eval mode

Each kind is declared once in :data:`SPEC` (stream, index type, what it posts, what it waits
for); every consumer reads it. ``index`` is the micro-batch ``k`` for F, R, B, I, W, EVAL, SEND_*
and RECV_*, and the batch ``t`` for the rest. Micro-batches are numbered 1..steps*m over the whole run;
batch ``t`` (1-indexed) holds micro-batches ``(t-1)*m+1 .. t*m``. ``version`` is set on F, R, B, I, W.

Weight versions (docs/design.md, "Weight-update semantics")
-----------------------------------------------------------
* gpipe, 1f1b, zb: micro-batches of batch ``t`` use ``W(t-1)``; ``UPDATE t`` runs after the stage's
  last backward of batch ``t`` and before its first forward of batch ``t+1`` (a flush).
* 2bw (PipeDream-2BW, arXiv 2006.09503, section 3.1): micro-batch ``k`` uses
  ``max(floor((k-1)/m) - 1, 0)`` for its forward and its backward on every stage, so
  ``W(t+1) = W(t) - lr * grad f(W(t-1))``. ``UPDATE t`` (producing ``W(t)``) runs after the
  stage's last backward of batch ``t`` and before its first forward of batch ``t+2`` — the first
  forward that uses ``W(t)``. At most two versions are alive per stage. No flush between steps.
* Gradient buffers (:func:`gradient_buffers`): a stage accumulates batch ``t``'s gradient in one
  accumulator. Without a reduction, ``UPDATE t`` therefore precedes the stage's first backward of
  batch ``t+1``. A flush schedule joins its reductions and runs ``UPDATE t`` before batch
  ``t+1``'s first forward anyway, so one accumulator is all it keeps. A 2bw stage with reductions
  (``width > 1``, a tied weight, ``clip``) keeps a second accumulator, so batch ``t+1``
  accumulates while batch ``t`` reduces; ``UPDATE t`` then precedes the next ``*_START t+1``.
  The validator checks both rules.

Orders the generators produce (stage ``i`` of ``d``, ``m`` micro-batches per batch)
--------------------------------------------------------------------------------
* gpipe: ``F1..Fm`` then ``B1..Bm`` in the same (increasing) order, then ``UPDATE``.
* 1f1b (PipeDream-Flush): per batch, ``min(d-i, m)`` warm-up forwards, then alternate B, F
  until the forwards run out, then the remaining backwards, then ``UPDATE``.
* A ``lookahead`` L (2bw and 1f1b) gives every stage but the last L warm-up forwards more
  (:func:`warmup`), so each runs that far ahead of its successor; d=2, m=4, 1f1b, L=1::

      stage 0: F1 F2 F3 B1 F4 B2 B3 B4 U1      (1F1B's order: F1 F2 B1 F3 B2 F4 B3 B4 U1)
      stage 1: F1 B1 F2 B2 F3 B3 F4 B4 U1
* zb (ZB-H1, Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024, section 3): 1f1b's
  order, with the backward of some micro-batches split into ``I k`` (input gradient, on the
  critical path: its ``SEND_GRAD k`` follows) and ``W k`` (weight gradient): on stage ``i``,
  the first ``D_i = min(d, m) - min(d - i, m)`` of each batch, whose ``W`` waits for the
  cool-down, and the cool-down's own (the backwards no forward follows), whose ``I`` the
  previous stage is waiting for (:func:`zb_split`). After each ``I``, the oldest pending ``W``
  runs while more than ``D_i`` are pending; the rest run after the last ``I``, filling the
  cool-down's bubble. The steady state's backwards stay whole ``B k``: there 1F1B has no bubble
  for a ``W`` to fill, and a split backward costs more than a whole one (the gradients ``I``
  records for ``W`` are read back cold; about 10% on the last stage of ``benchmarks/limit.py``'s
  GPT). So stage ``i`` holds at most ``min(d, m)`` micro-batches in flight (F done, W or B not
  yet): 1f1b's first-stage peak, on every stage (:func:`zb_bounds`). A stage with
  recomputation defers nothing (``R k, B k``, or ``R k, I k, W k`` where it splits, adjacent:
  at most one micro-batch's recomputed activations alive; ``min(d - i, m)`` in flight, as
  1f1b). All backwards of batch ``t`` precede ``UPDATE t``: a flush, 1f1b's numbers. d=2, m=4
  (the first stage's ``I`` is empty: it sends no gradient, its ``W`` is the whole backward)::

      stage 0: F1 F2 B1 F3 B2 F4 I3 W3 I4 W4 U1
      stage 1: F1 I1 F2 B2 F3 B3 F4 I4 W1 W4 U1
                  ^ W1 deferred to the cool-down: stage 1 holds 2 micro-batches, as stage 0 does

  Timed with F = I = W = 1 (simulate's default split of B = 2), a step takes 13 against
  1f1b's 15: ``m(F+I+W) + (d-1)(F+I-W)`` against ``(m+d-1)(F+B)``, as with every backward
  split; a split that costs more than B is paid on fewer micro-batches (with I = W = 1.1,
  13.4 against 13.8).
* 1f1b with ``chunks`` = v > 1 (interleaved 1F1B, :func:`_interleaved`): a lane runs its v
  stages' forwards in rounds of d micro-batches (d = stages / v lanes) and their backwards in
  the same rounds with the stages reversed, after ``2(d - r - 1) + (v - 1)d`` warm-up forwards
  on lane r; a flush, as 1f1b. Each lane's list holds all its stages' actions; the channels
  between two lanes share one queue, in the order of :func:`_send_order`
  (:func:`_with_p2p_lanes`); a collective several of a lane's stages take part in is posted by
  each of them before any waits for it, and the lane joins it once (:class:`fxpipe.deps.Rendezvous`).
* 2bw: the 1f1b pattern over all micro-batches at once (no flush), with ``UPDATE t`` after the
  last backward of batch ``t``. The design's example, d=2, m=2::

      stage 0: F1 F2 B1 | F3 B2 U1 F4 B3 | F5 B4 U2 F6 ...   (F5 onwards on version 1)
      stage 1: F1 B1 F2 B2 U1 | F3 B3 F4 B4 U2 | F5 B5 ...
                                     ^ W(1) goes into the spare buffer while batch 2 runs on W(0)

  (``|`` = ``END_STEP``: right before the stage's first forward of the next batch.)

Reductions: ``DP_START t`` right after the stage's last backward of batch ``t`` (zb: its last W). The cross-stage
collectives sit at *cuts* that every stage marks in the same order (:func:`_core_list` gives the
positions): 2bw ``TIED_START t`` right after each stage's last backward of batch ``t`` (on stage
``s``: before ``F(tm+d-s)``, with a lookahead ``F(tm+``:func:`warmup```)``), 2bw ``NORM_START t``
before ``F((t+1)m+1-s)`` (with a tied weight
not before ``F(tm+d)``), after ``DP_WAIT t``/``TIED_WAIT t`` (the norm is of the reduced
gradient); 1f1b/gpipe after each batch's last backward. Joins (``*_WAIT t``, ``UPDATE t``) sit
as late as the version rule allows: before the first forward of batch ``t+2`` (2bw; flush:
``t+1``) or before batch ``t+1``'s reductions, so 2bw overlaps a batch of compute with them.

Point-to-point posting (what the runtime does)
----------------------------------------------
* ``SEND_ACT k`` directly follows ``F k``, ``SEND_GRAD k`` directly follows ``B k`` (zb: ``I k``): an
  asynchronous send of the tensor just produced, never waited for in program order.
* ``RECV_ACT k`` / ``RECV_GRAD k`` post an asynchronous receive into a fresh buffer; ``F k`` waits
  for ``RECV_ACT k``, ``B k`` (zb: ``I k``) for ``RECV_GRAD k`` (:func:`waits_for`).
* Channels: the operations between stages ``i`` and ``i+1`` form one queue. A message belongs to
  the phase (between two cuts) of the F or B that sends it; the channel carries phase 0's
  messages, then phase 1's, ..., each phase in stage ``i``'s compute order, and both ranks post
  their halves in that order, each receive right after its previous channel operation or at its
  phase's start (as early as matching allows, so transfers overlap compute). So at every
  ``END_STEP`` both sides have posted the same operations, and every collective sits at one
  consistent point of every rank's post order (NCCL's rules (a) and (b), docs/design.md).

:func:`validate` replays the lists through :class:`fxpipe.deps.Rendezvous` (posts complete in
post order, pairs matched in order, collectives once every member posted) and reports
mismatches and deadlocks with the blocked posts.

Ranks: with data-parallel width ``w``, every replica of a stage runs the same list. The IR
numbers ranks replica-major, rank ``= replica * d + stage`` (a pipeline replica owns consecutive
ranks, so its p2p stays on one node); a plan may place them stage-major instead
(``Plan.layout``, rank ``= stage * w + replica``). See :func:`rank_of` and :func:`stage_and_replica`.

Stream lowering: :func:`lower_to_streams` maps one rank's list onto the streams ``compute``,
``p2p_prev``, ``p2p_next`` and ``reduce`` with the events each op waits for (see there).
"""

from __future__ import annotations

import enum
import functools
import re
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import NamedTuple

from fxpipe.deps import CommOp, CommOrderError, Rendezvous, interleave
from fxpipe.errors import ScheduleError

__all__ = [
    "SCHEDULES",
    "versions_of",
    "gradient_buffers",
    "min_microbatches",
    "Action",
    "Kind",
    "KindSpec",
    "Program",
    "SPEC",
    "StreamOp",
    "actions_by_rank",
    "batch_of",
    "compute_only",
    "format_actions",
    "generate",
    "lower_to_streams",
    "norm_every_step",
    "rank_of",
    "stage_and_replica",
    "LAYOUTS",
    "stream_of",
    "validate",
    "version_of",
    "waits_for",
    "zb_bounds",
    "zb_split",
    "LOOKAHEAD_SCHEDULES",
    "check_lookahead",
    "check_chunks",
    "eval_lanes",
    "interleaved_holds",
    "interleaved_in_flight",
    "lane_of",
    "lanes_of",
    "warmup",
]

#: Every schedule, the default first: the one list the API, the planner and the CLI accept.
SCHEDULES = ("2bw", "1f1b", "gpipe", "zb")
#: The schedules in 1F1B order, which take a ``lookahead`` (:func:`warmup`).
LOOKAHEAD_SCHEDULES = ("2bw", "1f1b")


class Kind(str, enum.Enum):
    """What an action does; the value is how it prints inside an action string."""

    F = "F"
    R = "R"  # recompute the forward of a micro-batch right before its backward
    B = "B"
    I = "I"  # zb: the input-gradient half of a backward (on the critical path: its SEND_GRAD follows)
    W = "W"  # zb: the weight-gradient half of a backward, deferred to fill bubbles
    SEND_ACT = "SEND_ACT"
    RECV_ACT = "RECV_ACT"
    SEND_GRAD = "SEND_GRAD"
    RECV_GRAD = "RECV_GRAD"
    UPDATE = "UPDATE"
    DP_START = "DP_START"
    DP_WAIT = "DP_WAIT"
    TIED_START = "TIED_START"
    TIED_WAIT = "TIED_WAIT"
    NORM_START = "NORM_START"
    NORM_WAIT = "NORM_WAIT"
    END_STEP = "END_STEP"  # step t's segment ends: return to the caller, the rest needs batch t+1
    EVAL = "EVAL"  # forward-only pass of micro-batch k with the newest weights, eval mode (eval_step)
    LOSS = "LOSS"  # post the all-reduce that gives every rank batch t's mean loss

    def __str__(self) -> str:  # "F", not "Kind.F"
        return self.value


class KindSpec(NamedTuple):
    """What one kind of action is. Each kind is declared once, in :data:`SPEC`; the validator, the
    simulator, the stream lowering and the runtime all read it from there."""

    stream: str  # "compute" (in list order), "p2p" (one queue per peer pair), "reduce"
    per_batch: bool  # the index is a batch t (else a micro-batch k)
    comm: str | None  # "send", "recv", "collective" or None: what it posts
    waits: "Kind | None"  # the action of the same index on the same rank it consumes (waits_for)
    cost: str | None  # the simulate.Costs field that times it


SPEC: dict[Kind, KindSpec] = {
    Kind.F: KindSpec("compute", False, None, Kind.RECV_ACT, "forward"),
    Kind.R: KindSpec("compute", False, None, None, "recompute"),
    Kind.B: KindSpec("compute", False, None, Kind.RECV_GRAD, "backward"),
    Kind.I: KindSpec("compute", False, None, Kind.RECV_GRAD, "backward_input"),
    Kind.W: KindSpec("compute", False, None, None, "backward_weight"),
    Kind.SEND_ACT: KindSpec("p2p", False, "send", None, "p2p"),
    Kind.RECV_ACT: KindSpec("p2p", False, "recv", None, "p2p"),
    Kind.SEND_GRAD: KindSpec("p2p", False, "send", None, "p2p"),
    Kind.RECV_GRAD: KindSpec("p2p", False, "recv", None, "p2p"),
    Kind.UPDATE: KindSpec("compute", True, None, None, "update"),
    Kind.DP_START: KindSpec("reduce", True, "collective", None, "reduce"),
    Kind.DP_WAIT: KindSpec("compute", True, None, Kind.DP_START, None),
    Kind.TIED_START: KindSpec("reduce", True, "collective", None, "reduce"),
    Kind.TIED_WAIT: KindSpec("compute", True, None, Kind.TIED_START, None),
    Kind.NORM_START: KindSpec("reduce", True, "collective", None, "reduce"),
    Kind.NORM_WAIT: KindSpec("compute", True, None, Kind.NORM_START, None),
    Kind.END_STEP: KindSpec("compute", True, None, None, None),
    Kind.EVAL: KindSpec("compute", False, None, Kind.RECV_ACT, "forward"),
    Kind.LOSS: KindSpec("reduce", True, "collective", None, None),
}
assert set(SPEC) == set(Kind), "every Kind needs its SPEC entry"

COMPUTE = frozenset({Kind.F, Kind.R, Kind.B, Kind.I, Kind.W})
GRAD_SOURCES = frozenset({Kind.B, Kind.I})  # what produces the gradient SEND_GRAD k sends
LAST_BACKWARD = frozenset({Kind.B, Kind.W})  # what ends a micro-batch's backward (frees its activations)
BACKWARDS = GRAD_SOURCES | LAST_BACKWARD  # a micro-batch's backward, whole or in halves
SENDS = frozenset(k for k, v in SPEC.items() if v.comm == "send")
RECVS = frozenset(k for k, v in SPEC.items() if v.comm == "recv")
P2P = SENDS | RECVS
COLLECTIVES = frozenset(k for k, v in SPEC.items() if v.comm == "collective")
WAITS = frozenset(k for k, v in SPEC.items() if v.waits in COLLECTIVES)
STARTS = frozenset(SPEC[w].waits for w in WAITS)  # the gradient reductions, each with its join
PER_BATCH = frozenset(k for k, v in SPEC.items() if v.per_batch)
_WAIT_OF = {SPEC[w].waits: w for w in WAITS}
_START_OF = {w: s for s, w in _WAIT_OF.items()}
# The p2p counterpart on the neighbouring stage, and which neighbour it is (+1 = next stage).
_COUNTERPART = {
    Kind.SEND_ACT: (Kind.RECV_ACT, +1),
    Kind.RECV_ACT: (Kind.SEND_ACT, -1),
    Kind.SEND_GRAD: (Kind.RECV_GRAD, -1),
    Kind.RECV_GRAD: (Kind.SEND_GRAD, +1),
}
_KIND_BY_NAME = {k.value: k for k in Kind}
_ACTION_RE = re.compile(r"^(\d+)([A-Z_]+)(\d+)(?:v(\d+))?$")


class Action(NamedTuple):
    """One step of one stage's list; prints as ``1F3v0`` and parses back with :meth:`parse`."""

    stage: int
    kind: Kind
    index: int  # micro-batch k (F, R, B, I, W, EVAL, SEND_*, RECV_*) or batch t (UPDATE, reductions, LOSS, END_STEP)
    version: int | None = None  # weight version used by F, R, B, I, W; None elsewhere

    def __str__(self) -> str:
        v = "" if self.version is None else f"v{self.version}"
        return f"{self.stage}{self.kind.value}{self.index}{v}"

    __repr__ = __str__  # lists of actions print as a readable schedule in test failures

    @classmethod
    def parse(cls, text: str) -> Action:
        """Read an action string such as ``"1F3v0"`` or ``"0UPDATE2"``."""
        match = _ACTION_RE.match(text.strip())
        kind = _KIND_BY_NAME.get(match.group(2)) if match else None
        if match is None or kind is None:
            raise ScheduleError(
                f"cannot parse action {text!r}: expected '<stage><KIND><index>[v<version>]' with KIND "
                f"one of {', '.join(_KIND_BY_NAME)}, e.g. '1F3v0' or '0UPDATE1'"
            )
        version = None if match.group(4) is None else int(match.group(4))
        return cls(int(match.group(1)), kind, int(match.group(3)), version)

    @property
    def microbatch(self) -> int | None:
        """The micro-batch this action works on, or None for per-batch actions."""
        return None if self.kind in PER_BATCH else self.index

    @property
    def batch(self) -> int | None:
        """The batch of an UPDATE or a reduction, or None for per-micro-batch actions."""
        return self.index if self.kind in PER_BATCH else None

    @property
    def peer(self) -> int | None:
        """The stage at the other end of a SEND/RECV, or None for other kinds."""
        if self.kind not in P2P:
            return None
        return self.stage + _COUNTERPART[self.kind][1]

    def counterpart(self) -> Action:
        """The matching half of a SEND/RECV on the peer stage (``0SEND_ACT3`` -> ``1RECV_ACT3``)."""
        if self.kind not in P2P:
            raise ScheduleError(f"{self} is not a SEND/RECV: only p2p actions have a counterpart")
        kind, delta = _COUNTERPART[self.kind]
        return Action(self.stage + delta, kind, self.index)


def waits_for(a: Action, stages: int) -> Action | None:
    """The action of ``a``'s own list that must have completed before ``a`` runs (its only wait):
    ``F k`` and ``EVAL k`` consume ``RECV_ACT k`` (not on the first stage), ``B k`` and zb's
    ``I k`` consume ``RECV_GRAD k`` (not on the last), ``X_WAIT t`` joins ``X_START t`` (as
    :data:`SPEC` declares); None for everything else."""
    kind = SPEC[a.kind].waits
    if kind is None or (kind is Kind.RECV_ACT and a.stage == 0) or (kind is Kind.RECV_GRAD and a.stage == stages - 1):
        return None
    return Action(a.stage, kind, a.index)


def stream_of(a: Action, stages: int | None = None, chunks: int = 1) -> str:
    """The stream an action runs on: compute, reduce, or p2p_prev / p2p_next (one per peer);
    with ``chunks`` > 1 (interleaved 1F1B, a lane's stages reach their peers through the same
    ranks) one p2p stream per peer lane, ``p2p:<lane>``."""
    stream = SPEC[a.kind].stream
    if stream == "p2p":
        if chunks > 1:
            return f"p2p:{lane_of(a.peer, stages, chunks)}"
        return "p2p_next" if a.peer > a.stage else "p2p_prev"
    return stream


def versions_of(schedule: str) -> int:
    """Weight versions alive per stage: two under 2bw (W(t) and W(t-1), a delay of one step),
    one otherwise."""
    return 2 if schedule == "2bw" else 1


def batch_of(k: int, microbatches: int) -> int:
    """Batch ``t`` (1-indexed) that micro-batch ``k`` (1-indexed) belongs to."""
    return (k - 1) // microbatches + 1


def version_of(schedule: str, k: int, microbatches: int) -> int:
    """Weight version micro-batch ``k`` uses for its forward and backward on every stage."""
    t = batch_of(k, microbatches)
    if schedule == "2bw":
        # PipeDream-2BW (arXiv 2006.09503, eq. in section 3.1): delay exactly 1, so batch t
        # computes on W(t-2); batches 1 and 2 both start from W(0).
        return max(t - 2, 0)
    return t - 1


#: Where the d x w (stage, replica) pairs go among the ranks (:func:`rank_of`).
LAYOUTS = ("replica", "stage")


def rank_of(stage: int, replica: int, stages: int, width: int = 1, layout: str = "replica") -> int:
    """Global rank of ``stage`` in data-parallel ``replica``. ``layout="replica"`` (the default,
    replica-major): a replica's stages on consecutive ranks, ``replica * stages + stage``, so a
    node holds whole pipelines. ``"stage"`` (stage-major): a stage's replicas on consecutive
    ranks, ``stage * width + replica``, so a stage's data-parallel all-reduce stays inside a
    node and the pipeline crosses nodes (PipeDream-2BW's placement on multi-GPU servers). The
    plan says which (``Plan.layout``); the schedule IR itself numbers ranks replica-major."""
    if layout == "stage":
        return stage * width + replica
    return replica * stages + stage


def stage_and_replica(rank: int, stages: int, width: int = 1, layout: str = "replica") -> tuple[int, int]:
    """Inverse of :func:`rank_of`: ``(stage, replica)`` of a global rank."""
    if layout == "stage":
        return rank // width, rank % width
    return rank % stages, rank // stages


def actions_by_rank(by_stage: Mapping[int, list[Action]], width: int = 1,
                    layout: str = "replica") -> dict[int, list[Action]]:
    """Expand per-stage lists to every rank of ``width`` data-parallel replicas (same list per
    replica), the ranks placed by ``layout`` (:func:`rank_of`)."""
    d = len(by_stage)
    return {rank_of(s, r, d, width, layout): list(by_stage[s]) for r in range(width) for s in range(d)}


def compute_only(actions: Iterable[Action]) -> str:
    """The compute (F, R, B, I, W) and UPDATE skeleton of a list as one string, e.g. ``"0F1v0 0F2v0 0B1v0 ..."``."""
    return " ".join(str(a) for a in actions if a.kind in COMPUTE or a.kind is Kind.UPDATE)


# ---------------------------------------------------------------------------------------------
# Generators


def _check_args(schedule: str, stages: int, microbatches: int, steps: int, width: int, lookahead: int = 0,
                chunks: int = 1) -> None:
    if schedule not in SCHEDULES:
        raise ScheduleError(f"unknown schedule {schedule!r}: expected one of {', '.join(SCHEDULES)}")
    for name, value in (("stages", stages), ("microbatches", microbatches), ("steps", steps), ("width", width),
                        ("chunks", chunks)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ScheduleError(f"{name} must be an int >= 1, found {value!r}")
    check_lookahead(schedule, lookahead)
    check_chunks(schedule, stages, microbatches, chunks, lookahead)
    if microbatches < (least := min_microbatches(schedule, stages, lookahead)):
        if lookahead:
            fewer = f", or lookahead={microbatches - stages}" if microbatches >= stages else ""
            raise ScheduleError(f"2bw with lookahead={lookahead} needs m >= d + lookahead micro-batches, found "
                                f"m={microbatches} with d={stages}: pass microbatches={least} or more{fewer}")
        raise ScheduleError(f"{schedule} needs at least as many micro-batches as stages (m >= d), found "
                            f"m={microbatches} < d={stages}: pass microbatches={least} or more, or use "
                            f"schedule='1f1b'")


def min_microbatches(schedule: str, stages: int, lookahead: int = 0) -> int:
    """The fewest micro-batches a step of ``schedule`` may have on ``stages`` stages: ``stages``
    under 2bw (``stages + lookahead`` with a lookahead), 1 otherwise. 2bw needs m >= d for its
    version rule: with fewer, stage 0's warm-up would run a forward of batch t+2 before batch t's
    last backward, so no UPDATE position could give it W(t) (docs/design.md: a batch is m >= d).
    Each forward of lookahead moves that warm-up one further, and at m = d + lookahead - 1 the
    stages would reach the cross-stage collectives of consecutive batches in different orders
    (one stage is the last and runs none ahead). 1f1b and zb take any m (with m < d stage s holds
    min(d - s, m) micro-batches, so the later stages hold fewer than gpipe's m). The generator
    and the planner both read this rule."""
    if schedule != "2bw":
        return 1
    return stages + (lookahead if stages > 1 else 0)


def check_chunks(schedule: str, stages: int, microbatches: int, chunks: int, lookahead: int = 0) -> None:
    """Raise :class:`ScheduleError` unless ``chunks`` stages per rank (interleaved 1F1B,
    :func:`_interleaved`) fit the rest: only ``schedule="1f1b"`` interleaves, without a
    lookahead; ``stages`` must be a multiple of ``chunks`` (``d = stages / chunks`` ranks per
    replica), and ``microbatches`` a multiple of ``d`` (forwards go through a rank's stages in
    rounds of ``d`` micro-batches)."""
    if chunks == 1:
        return
    if schedule != "1f1b":
        raise ScheduleError(f"chunks={chunks} interleaves stages on each rank, which only schedule='1f1b' does "
                            f"(interleaved 1F1B); found schedule={schedule!r}: pass chunks=1, or schedule='1f1b'")
    if lookahead:
        raise ScheduleError(f"chunks={chunks} (interleaved 1F1B) takes no lookahead, found lookahead={lookahead}: "
                            f"pass lookahead=0")
    if stages % chunks:
        raise ScheduleError(f"chunks={chunks} stages per rank need a multiple of {chunks} stages, found "
                            f"stages={stages}: pass stages={stages - stages % chunks or chunks} or "
                            f"{stages - stages % chunks + chunks}")
    d = stages // chunks
    if d < 2:
        raise ScheduleError(f"chunks={chunks} with stages={stages} puts every stage on one rank, where interleaving "
                            f"has no bubble to shrink: pass chunks=1, or stages={2 * chunks} or more")
    if microbatches % d:
        raise ScheduleError(f"interleaved 1F1B on {d} ranks per replica runs forwards in rounds of {d} "
                            f"micro-batches, so microbatches must be a multiple of {d}; found "
                            f"microbatches={microbatches}: pass {microbatches - microbatches % d or d} or "
                            f"{microbatches - microbatches % d + d}")


def check_lookahead(schedule: str, lookahead: int) -> None:
    """Raise :class:`ScheduleError` unless ``lookahead`` is an int >= 0 that ``schedule`` takes
    (:func:`warmup`: only the 1F1B-ordered 2bw and 1f1b run forwards ahead)."""
    if isinstance(lookahead, bool) or not isinstance(lookahead, int) or lookahead < 0:
        raise ScheduleError(f"lookahead must be an int >= 0, found {lookahead!r}")
    if lookahead and schedule not in LOOKAHEAD_SCHEDULES:
        raise ScheduleError(f"lookahead={lookahead} runs forwards ahead of 1F1B's order, which only "
                            f"{' and '.join(LOOKAHEAD_SCHEDULES)} follow; found schedule={schedule!r}: pass lookahead=0, "
                            f"or schedule='2bw' or '1f1b'")


def warmup(stage: int, stages: int, lookahead: int = 0) -> int:
    """How many forwards stage ``stage`` of ``stages`` runs before its first backward, and so
    how many micro-batches it holds at most (2bw, 1f1b; a flush also stops at m): 1F1B's
    ``d - s``, and ``lookahead`` more on every stage but the last.

    In 1F1B's steady state each neighbour's next action waits for the message the other has just
    sent, with no time to spare, so any delay on either rank idles the other. A lookahead of one
    runs each stage one forward further ahead: its successor finds the next activations already
    there and goes on through a hiccup of its predecessor, at the price of one more micro-batch's
    activations held (docs/design.md, "Lookahead"). The last stage runs each backward right after
    its forward (the loss is there): it has nothing to run ahead. Numbers are unchanged: every
    micro-batch keeps its weight version and each stage its order of backwards."""
    return stages - stage + (lookahead if stage < stages - 1 else 0)


def _one_f_one_b(first: int, last: int, warmup: int) -> list[tuple[Kind, int]]:
    """``warmup`` forwards, then B, F alternating, then the remaining backwards, over k=first..last.

    With warmup=2, first=1, last=4::

        F1 F2 B1 F3 B2 F4 B3 B4
    """
    n = last - first + 1
    warmup = min(warmup, n)
    order = [(Kind.F, first + j) for j in range(warmup)]
    for j in range(n):
        order.append((Kind.B, first + j))
        if warmup + j < n:
            order.append((Kind.F, first + warmup + j))
    return order


def _splits(j: int, n: int, warmup: int, defer: int) -> bool:
    """Whether the ``j``-th backward (from 0) of a batch of ``n`` on a zb stage runs split into
    ``I`` and ``W`` (:func:`_zero_bubble`): one of the first ``defer``, whose ``W`` waits for the
    cool-down, or one of the cool-down's (no forward follows it)."""
    return j < defer or warmup + j >= n


def _zero_bubble(first: int, last: int, warmup: int, defer: int) -> list[tuple[Kind, int]]:
    """ZB-H1 over k=first..last: 1f1b's order, with the backwards of the first ``defer``
    micro-batches and of the cool-down split into ``I k`` and ``W k`` (:func:`_splits`); after
    each ``I``, the oldest ``W`` runs while more than ``defer`` of them are due, and the rest run
    after the last ``I`` (Qi et al., ICLR 2024, figure 3: they fill the cool-down's bubble). The
    steady state's backwards stay whole: there a deferred ``W`` fills no bubble, and a split
    backward costs more than a whole one. With warmup=1, defer=1, first=1, last=4::

        F1 I1 F2 B2 F3 B3 F4 I4 W1 W4
    """
    n = last - first + 1
    warmup = min(warmup, n)
    order = [(Kind.F, first + j) for j in range(warmup)]
    due: list[int] = []  # micro-batches past their I, W not yet run
    for j in range(n):
        k = first + j
        if _splits(j, n, warmup, defer):
            order.append((Kind.I, k))
            due.append(k)
            while len(due) > defer:
                order.append((Kind.W, due.pop(0)))
        else:
            order.append((Kind.B, k))
        if warmup + j < n:
            order.append((Kind.F, first + warmup + j))
    order += [(Kind.W, k) for k in due]
    return order


def zb_bounds(stage: int, stages: int, microbatches: int, recompute: bool = False) -> tuple[int, int]:
    """``(in flight, deferred)`` of stage ``stage`` under zb: at most ``min(d, m)`` micro-batches
    between their F and their W (ZB-H1: the peak of 1f1b's first stage, on every stage), of
    which at most ``min(d, m) - min(d - i, m)`` have run their I (weight passes deferred). A
    stage that recomputes defers none (``R k, I k, W k`` adjacent, so at most one micro-batch's
    recomputed activations are alive), and holds ``min(d - i, m)`` as under 1f1b."""
    warmup = min(stages - stage, microbatches)
    if recompute:
        return warmup, 0
    limit = min(stages, microbatches)
    return limit, limit - warmup


def zb_split(stage: int, stages: int, microbatches: int, k: int, recompute: bool = False) -> bool:
    """Whether micro-batch ``k``'s backward on stage ``stage`` runs split into ``I k`` and
    ``W k`` under zb (else as one ``B k``): what the runtime's forward prepares for and the
    validator checks (:func:`_zero_bubble`)."""
    m = microbatches
    return _splits((k - 1) % m, m, min(stages - stage, m), zb_bounds(stage, stages, m, recompute)[1])


def _compute_order(schedule: str, stage: int, d: int, m: int, steps: int,
                   recompute: bool = False, lookahead: int = 0) -> list[tuple[Kind, int]]:
    if schedule == "zb":
        defer = zb_bounds(stage, d, m, recompute)[1]
        order: list[tuple[Kind, int]] = []
        for t in range(1, steps + 1):
            order += _zero_bubble((t - 1) * m + 1, t * m, d - stage, defer)
        return order
    if schedule == "2bw":
        # PipeDream-2BW (arXiv 2006.09503, fig. 3): 1F1B with d - i micro-batches in flight on
        # stage i (plus the lookahead on all but the last), across step boundaries.
        return _one_f_one_b(1, steps * m, warmup(stage, d, lookahead))
    order: list[tuple[Kind, int]] = []
    for t in range(1, steps + 1):
        first, last = (t - 1) * m + 1, t * m
        if schedule == "1f1b":
            order += _one_f_one_b(first, last, warmup(stage, d, lookahead))
        else:  # gpipe: every forward, then every backward in the same order
            order += [(Kind.F, k) for k in range(first, last + 1)]
            order += [(Kind.B, k) for k in range(first, last + 1)]
    return order


def lanes_of(stages: int, chunks: int = 1) -> int:
    """Ranks a pipeline replica of ``stages`` stages runs on when each holds ``chunks`` of them
    (interleaved 1F1B, :func:`_interleaved`): ``stages // chunks``."""
    return stages // chunks


def lane_of(stage: int, stages: int, chunks: int = 1) -> int:
    """The rank within its replica (its *lane*) that runs ``stage``: stage ``j`` on lane
    ``j mod (stages / chunks)``, so lane ``r`` holds stages ``r, r + d, r + 2d, ...`` (its chunks)
    and a micro-batch crosses the lanes ``chunks`` times. With one chunk a lane is a stage."""
    return stage % lanes_of(stages, chunks)


def _interleaved(first: int, m: int, lane: int, d: int, v: int) -> list[tuple[Kind, int, int]]:
    """Interleaved 1F1B (Narayanan et al., SC 2021, section 2.2) for the micro-batches
    ``first .. first + m - 1`` of one batch on ``lane`` of ``d``, which holds the ``v`` stages
    ``lane, lane + d, ...``: ``(kind, k, stage)`` in run order.

    Forwards go through the lane's stages in rounds of ``d`` micro-batches (stage ``lane`` for
    micro-batches 1..d, then stage ``lane + d`` for the same ones, ...), backwards through the
    same rounds with the stages in reverse. Lane ``r`` warms up with ``2(d - r - 1) + (v - 1)d``
    forwards (capped at ``m v``), then alternates a forward and a backward, then finishes the
    backwards. d = 2, v = 2, m = 4 (``s:k``)::

        lane 0: F0:1 F0:2 F2:1 F2:2 F0:3 B2:1 F0:4 B2:2 F2:3 B0:1 F2:4 B0:2 B2:3 B2:4 B0:3 B0:4
        lane 1: F1:1 F1:2 F3:1 B3:1 F3:2 B3:2 F1:3 B1:1 F1:4 B1:2 F3:3 B3:3 F3:4 B3:4 B1:3 B1:4
    """
    n = m * v

    def at(i: int, kind: Kind) -> tuple[Kind, int, int]:
        chunk = (i // d) % v
        if kind is Kind.B:
            chunk = v - 1 - chunk
        return kind, first + (i // (d * v)) * d + i % d, chunk * d + lane

    warm = min(2 * (d - lane - 1) + (v - 1) * d, n)
    order = [at(i, Kind.F) for i in range(warm)]
    for j in range(n):
        if warm + j < n:
            order.append(at(warm + j, Kind.F))
        order.append(at(j, Kind.B))
    return order


@functools.lru_cache(maxsize=256)
def interleaved_holds(stage: int, stages: int, chunks: int, microbatches: int,
                      recompute: tuple[bool, ...] = ()) -> tuple[int, int, int]:
    """``(micro-batches, inputs, gradients)``: the most micro-batches stage ``stage`` holds
    between their F and their B under interleaved 1F1B, the most boundary inputs it holds
    (received or their receive posted, until the micro-batch's B) and the most gradient receives
    it has posted and not yet consumed, read from one step of its lane's list (every step of a
    flush is the same) with the stages' ``recompute`` (one bool each; none: off), which moves the
    receives: what the planner's memory model counts for it."""
    lst = _build("1f1b", stages, microbatches, 1, list(recompute) or [False] * stages, False, (), False, 0, chunks)[
        lane_of(stage, stages, chunks)]
    held, inputs, grads = set(), set(), set()
    most = [0, 0, 0]
    for a in (a for a in lst if a.stage == stage):
        if a.kind is Kind.F:
            held.add(a.index)
        elif a.kind is Kind.RECV_ACT:
            inputs.add(a.index)
        elif a.kind is Kind.RECV_GRAD:
            grads.add(a.index)
        elif a.kind is Kind.B:
            held.discard(a.index)
            inputs.discard(a.index)
            grads.discard(a.index)
        most = [max(x, len(y)) for x, y in zip(most, (held, inputs, grads))]
    return most[0], most[1], most[2]


def interleaved_in_flight(lane: int, stages: int, chunks: int, microbatches: int) -> int:
    """The most (micro-batch, stage) pairs lane ``lane`` holds between their F and their B under
    interleaved 1F1B (:func:`_interleaved`): its warm-up forwards and one more, at most ``m v``."""
    d = lanes_of(stages, chunks)
    return min(2 * (d - lane - 1) + (chunks - 1) * d + 1, microbatches * chunks)


def _tied_group(tied: bool | Sequence[int] | None, d: int) -> tuple[int, ...]:
    if not tied:
        return ()
    group = (0, d - 1) if tied is True else tuple(sorted(set(tied)))
    for s in group:
        if not 0 <= s < d:
            raise ScheduleError(f"tied stage {s} is out of range: expected stages in 0..{d - 1}, found {tied!r}")
    return group if len(group) >= 2 else ()  # a tied weight on one stage needs no cross-stage sum


def _options(schedule, stages, microbatches, steps, width, recompute, tied,
             lookahead: int = 0, chunks: int = 1) -> tuple[list[bool], tuple[int, ...]]:
    _check_args(schedule, stages, microbatches, steps, width, lookahead, chunks)
    if recompute is None or isinstance(recompute, bool):
        recompute = [bool(recompute)] * stages
    recompute = list(recompute)
    if len(recompute) != stages:
        raise ScheduleError(f"recompute needs one bool per stage: expected {stages}, found {len(recompute)}")
    return recompute, _tied_group(tied, stages)


def generate(
    schedule: str,
    stages: int,
    microbatches: int,
    steps: int = 1,
    *,
    width: int = 1,
    recompute: bool | Sequence[bool] | None = None,
    tied: bool | Sequence[int] | None = None,
    clip: bool = False,
    lookahead: int = 0,
    chunks: int = 1,
) -> dict[int, list[Action]]:
    """Action lists ``{lane: [Action, ...]}`` of one pipeline replica for ``steps`` optimizer
    steps followed by a flush: exactly what the runtime executes for ``steps`` calls of
    ``Pipeline.step`` and one ``flush`` (the segments of :class:`Program`, concatenated).

    ``schedule``: "gpipe", "1f1b", "2bw" or "zb"; ``stages`` = d; ``microbatches`` = m per step.
    ``width``: data-parallel width w (adds DP_START/DP_WAIT when w > 1; every replica runs the
    same lists, see :func:`actions_by_rank`). ``recompute``: one bool, or one per stage (adds
    ``R k`` before ``B k``). ``tied``: True for a tied weight on the first and last stage, or the
    stages holding copies (adds TIED_START/TIED_WAIT there). ``clip``: global gradient-norm
    clipping (adds NORM_START/NORM_WAIT on every stage). ``lookahead``: 2bw and 1f1b only, the
    forwards every stage but the last runs ahead of 1F1B's order (:func:`warmup`). ``chunks``: 1f1b only, the
    stages each rank holds (interleaved 1F1B, :func:`_interleaved`): the lists are then one per
    *lane* (a rank of the replica, :func:`lane_of`), each holding its stages' actions in the order
    it runs them; with one chunk a lane is a stage. ``END_STEP t`` marks where step t's
    segment ends. The orders are drawn in the module docstring; ``validate`` accepts every list
    this returns.

    >>> [str(a) for a in generate("2bw", 2, 2, 2)[1] if a.kind in COMPUTE | {Kind.UPDATE}]
    ['1F1v0', '1B1v0', '1F2v0', '1B2v0', '1UPDATE1', '1F3v0', '1B3v0', '1F4v0', '1B4v0', '1UPDATE2']
    """
    recompute, group = _options(schedule, stages, microbatches, steps, width, recompute, tied, lookahead, chunks)
    return _build(schedule, stages, microbatches, steps, recompute, width > 1, group, clip, lookahead, chunks)


def _raw(schedule, d, m, steps, recompute, dp, group, clip, lookahead, chunks=1) -> dict[int, list[Action]]:
    """Lists of a run of exactly ``steps`` batches with END_STEP 1..steps-1 and p2p inserted."""
    if chunks > 1:
        n = lanes_of(d, chunks)
        cores = {r: _interleaved_core(r, n, chunks, m, steps, recompute, dp, group, clip) for r in range(n)}
        return _with_p2p_lanes(cores, d, chunks)
    cores = {s: _core_list(schedule, s, d, m, steps, recompute[s], dp, group, clip, lookahead) for s in range(d)}
    return _with_p2p(cores, d)


def _end_of(lst: Sequence[Action], t: int) -> int:
    """The position right after the last ``END_STEP t`` of a lane's list (where step t's segment
    ends: a lane of several stages has one per stage, adjacent)."""
    return max(i for i, a in enumerate(lst) if a.kind is Kind.END_STEP and a.index == t) + 1


def _build(schedule, d, m, steps, recompute, dp, group, clip, lookahead, chunks=1) -> dict[int, list[Action]]:
    """Steps 1..``steps`` as a longer run executes them (its lists through ``END_STEP steps``),
    then the drain: what a run of exactly ``steps`` batches still has to do, in its order. The
    two parts agree on every channel at the boundary (validate checks it), so stopping there and
    draining never reorders a rank pair's posts."""
    longer = _raw(schedule, d, m, steps + 1, recompute, dp, group, clip, lookahead, chunks)
    exact = _raw(schedule, d, m, steps, recompute, dp, group, clip, lookahead, chunks)
    out = {}
    for s in longer:
        cut = _end_of(longer[s], steps)
        done = set(longer[s][:cut])
        out[s] = longer[s][:cut] + [a for a in exact[s] if a not in done]
    return out


def _shift(a: Action, steps: int, schedule: str, m: int) -> Action:
    """``a`` moved ``steps`` batches later (versions follow the global rule)."""
    if steps == 0:
        return a
    if a.kind in PER_BATCH:
        return a._replace(index=a.index + steps)
    k = a.index + steps * m
    return a._replace(index=k, version=None if a.version is None else version_of(schedule, k, m))


class Program:
    """One pipeline replica's schedule as bounded, periodic data, generated step by step.

    A run is a sequence of *epochs*: the pipeline fills at the epoch's first step and drains at a
    flush. Within an epoch, :meth:`segment` gives what a stage does for step ``t`` (ending with
    ``END_STEP t``) and :meth:`drain` what it does to finish every batch given so far. From the
    epoch's :attr:`PERIOD_FROM`-th step on, a segment is the previous one moved by one batch
    (tests/unit/test_schedule.py checks it), so memory and time per step do not depend on how
    long the run is: segments are cut from lists of at most ``PERIOD_FROM + 1`` steps and moved.
    """

    PERIOD_FROM = 4

    def __init__(self, schedule: str, stages: int, microbatches: int, *, width: int = 1,
                 recompute: bool | Sequence[bool] | None = None, tied: bool | Sequence[int] | None = None,
                 clip: bool = False, lookahead: int = 0, chunks: int = 1):
        self.schedule, self.stages, self.microbatches, self.lookahead = schedule, stages, microbatches, lookahead
        self.chunks, self.lanes = chunks, lanes_of(stages, chunks)
        recompute, group = _options(schedule, stages, microbatches, 1, width, recompute, tied, lookahead, chunks)
        self._args = (schedule, stages, microbatches, recompute, width > 1, group, clip, lookahead, chunks)
        self._parts: dict[int, dict[int, tuple[list[Action], list[Action]]]] = {}
        self._eval: dict[int, list[Action]] | None = None

    def _local(self, j: int) -> dict[int, tuple[list[Action], list[Action]]]:
        """{lane: (segment j, drain after j)} of an epoch starting at batch 1 (j <= PERIOD_FROM)."""
        if j not in self._parts:
            schedule, d, m, *options = self._args
            lists = _build(schedule, d, m, j, *options)
            parts = {}
            for s, lst in lists.items():
                end = _end_of(lst, j)
                start = _end_of(lst, j - 1) if j > 1 else 0
                parts[s] = (lst[start:end], lst[end:])
            self._parts[j] = parts
        return self._parts[j]

    def _moved(self, stage: int, t: int, epoch_start: int, which: int) -> list[Action]:
        j = t - epoch_start
        if j < 1:
            raise ScheduleError(f"step {t} is not after the epoch start {epoch_start}")
        base = min(j, self.PERIOD_FROM)
        by = epoch_start + j - base
        return [_shift(a, by, self.schedule, self.microbatches) for a in self._local(base)[stage][which]]

    def segment(self, lane: int, t: int, epoch_start: int = 0) -> list[Action]:
        """Lane ``lane``'s actions for step ``t`` of the epoch that began after batch
        ``epoch_start`` (with one chunk a lane is a stage: :func:`lane_of`)."""
        return self._moved(lane, t, epoch_start, 0)

    def drain(self, lane: int, t: int, epoch_start: int = 0) -> list[Action]:
        """What lane ``lane`` runs at a flush after step ``t`` (empty when nothing is in flight)."""
        return self._moved(lane, t, epoch_start, 1)

    @classmethod
    def of_plan(cls, plan, tied: Sequence[int] | None = None, accumulate: str = "gradients") -> Program:
        """The Program ``fxpipe.compile`` runs for ``plan`` (a :class:`fxpipe.plan.Plan`), its
        tied-weight stages ``tied`` and its ``accumulate`` option; the pipeline, ``pipe.dump()``
        and ``fxpipe inspect`` (a default compile) all build theirs here, so what they draw is
        what runs. NORM_START/NORM_WAIT run every step (:func:`norm_every_step`)."""
        return cls(plan.schedule, plan.stages, plan.microbatches, width=plan.width, recompute=list(plan.recompute),
                   tied=list(tied) if tied else None, clip=norm_every_step(accumulate), lookahead=plan.lookahead,
                   chunks=plan.chunks)

    def lists(self, steps: int) -> dict[int, list[Action]]:
        """``{lane: segments 1..steps, then the drain}``: a run of ``steps`` calls of
        ``Pipeline.step`` and one ``flush`` (what :func:`generate` returns for the same options)."""
        return {r: [a for t in range(1, steps + 1) for a in self.segment(r, t)] + self.drain(r, steps)
                for r in range(self.lanes)}

    def norm_done(self, t: int, through: int, epoch_start: int = 0) -> bool:
        """Whether every stage has run ``NORM_WAIT t`` by the end of its segment of step
        ``through`` (all of batch t's norm parts are known everywhere)."""
        first = max(t, epoch_start + 1)
        return all(any(Action(s, Kind.NORM_WAIT, t) in self.segment(lane_of(s, self.stages, self.chunks), T, epoch_start)
                       for T in range(first, through + 1)) for s in range(self.stages))

    def eval(self, lane: int) -> list[Action]:
        """A forward-only pass over one batch (``eval_step``, after a flush): stage ``lane``
        evaluates micro-batches 1..m in order, each receive posted one micro-batch ahead; a lane
        of an interleaved pipeline runs its stages' forwards in interleaved 1F1B's order
        (:func:`eval_lanes`)."""
        if self.chunks == 1:
            return eval_list(lane, self.stages, self.microbatches)
        if self._eval is None:
            self._eval = eval_lanes(self.stages, self.chunks, self.microbatches)
        return list(self._eval[lane])


def norm_every_step(accumulate: str = "gradients") -> bool:
    """Whether a compiled pipeline's Program posts NORM_START/NORM_WAIT every step (``clip``).
    It does whether or not ``max_grad_norm`` is set: the norm all-reduce both clips and checks
    every step for non-finite gradients (under 2bw it brings the second gradient buffer of
    :func:`gradient_buffers`). Not under ``accumulate="optimizer"`` (AdamA): its UPDATE must
    follow each batch's last backward on the stage (one set of moments, no gradient)."""
    return accumulate != "optimizer"


def gradient_buffers(schedule: str, reduces: bool) -> int:
    """Flat gradient accumulators a stage keeps (AdamA, which keeps none, aside). A flush schedule
    (gpipe, 1f1b, zb) joins batch ``t``'s reductions and runs ``UPDATE t`` before batch ``t+1``'s
    first forward, so its one accumulator is free again before any gradient of batch ``t+1``
    arrives. 2bw joins them only before batch ``t+2``'s first forward, overlapping them with
    batch ``t+1``'s compute, so a 2bw stage that ``reduces`` (``width > 1``, a tied weight shared
    with another stage, the per-step norm of :func:`norm_every_step`) accumulates batch ``t+1``
    in a second one meanwhile."""
    return 2 if schedule == "2bw" and reduces else 1


def eval_lanes(stages: int, chunks: int, microbatches: int) -> dict[int, list[Action]]:
    """:func:`eval_list` for an interleaved pipeline, one list per lane: the forwards of
    interleaved 1F1B (:func:`_interleaved`, its rounds of ``d`` micro-batches through the lane's
    stages) as ``EVAL``, then every stage's ``LOSS1``, with sends and receives placed as training's
    are (:func:`_with_p2p_lanes`)."""
    d = lanes_of(stages, chunks)
    cores = {}
    for r in range(d):
        core = [Action(s, Kind.EVAL, k) for kind, k, s in _interleaved(1, microbatches, r, d, chunks) if kind is Kind.F]
        cores[r] = (core + [Action(s, Kind.LOSS, 1) for s in range(r, stages, d)], [])
    return _with_p2p_lanes(cores, stages, chunks)


def eval_list(stage: int, stages: int, microbatches: int) -> list[Action]:
    """``RECV_ACT1``, then per micro-batch k: ``RECV_ACT k+1``, ``EVAL k``, ``SEND_ACT k`` (the
    receives only past the first stage, the sends only before the last), then ``LOSS1``."""
    out: list[Action] = []
    recv = stage > 0
    if recv:
        out.append(Action(stage, Kind.RECV_ACT, 1))
    for k in range(1, microbatches + 1):
        if recv and k < microbatches:
            out.append(Action(stage, Kind.RECV_ACT, k + 1))
        out.append(Action(stage, Kind.EVAL, k))
        if stage < stages - 1:
            out.append(Action(stage, Kind.SEND_ACT, k))
    out.append(Action(stage, Kind.LOSS, 1))  # every rank gets the batch's loss
    return out


def _core_list(
    schedule: str, stage: int, d: int, m: int, steps: int, recompute: bool, dp: bool, group: tuple[int, ...], clip: bool,
    lookahead: int = 0,
) -> tuple[list[Action], list[tuple[str, int]]]:
    """Compute, reductions, UPDATEs and END_STEP markers of one stage (no SEND/RECV), and its
    *cuts*: ``(label, i)``, the stage's list from index i on lies after the cut.

    A cut is a point of the run that every stage reaches in the same order: END_STEP t, and the
    post of each cross-stage collective (TIED_START t, NORM_START t), which a stage outside the
    collective's group still marks. :func:`_with_p2p` posts every p2p message on both of its
    sides between the same two cuts, so each collective sits at one consistent point of every
    rank's post order (NCCL's rule (b), docs/design.md).

    Positions, as "right before the stage's forward of micro-batch c" (for stage s of d):

    * END_STEP t: c = tm + 1 on every stage: the first forward that needs batch t+1's data.
    * 2bw TIED_START t: right after the stage's last backward of batch t (c = tm + w, w the
      stage's :func:`warmup`: on stage 0 without lookahead tm + d).
    * 2bw NORM_START t: c = (t+1)m + 1 - a_s, not before tm + d with a tied weight, where a_s is
      how many forwards stage s runs behind stage 0 (s in 1F1B's order; with a ``lookahead`` L
      the last stage, which runs none ahead, d - 1 + L): on stage 0 this is where it must have
      the norm (before batch t+2's first forward); later stages post as much sooner as they run
      behind, so stage 0 finds their parts posted and does not wait there.
      1f1b/gpipe: both right after batch t's backwards.

    Without a lookahead, neighbouring stages' positions differ by 0 or 1 forward, which in 1F1B
    order is exactly what a consistent cut needs: a message sent before it is received before it
    or posted early. With a ``lookahead`` a stage reaches each position given as a forward
    (END_STEP, NORM_START) that many backwards sooner, and the last stage's NORM_START sits
    1 + lookahead forwards before its neighbour's; a stage's receives of the gradients still due
    are then posted early, and :func:`validate` replays every such list.
    """
    out: list[Action] = []
    cuts: list[tuple[str, int]] = []
    tied = stage in group
    reduces = dp or tied or clip
    two_bw = schedule == "2bw"
    order = _compute_order(schedule, stage, d, m, steps, recompute, lookahead)
    ahead = warmup(stage, d, lookahead)
    # how many forwards this stage runs behind stage 0 (s in 1F1B's order; the last stage, which
    # takes no lookahead, that many more): 2bw's NORM_START comes that much sooner here
    behind = warmup(0, d, lookahead) - ahead
    last_b = {batch_of(k, m): pos for pos, (kind, k) in enumerate(order) if kind in LAST_BACKWARD}
    pending: list[int] = []  # batches whose gradients are handed to reductions, UPDATE still due
    cut_due: list[int] = []  # 2bw: batches done here whose TIED/NORM cuts are still ahead
    posted: set[tuple[str, int]] = set()
    b_done = 0  # the newest micro-batch whose backward ran here (1F1B order: increasing)

    def cut(label: str, t: int) -> None:
        posted.add((label, t))
        cuts.append((f"{label}{t}", len(out)))

    def post_tied(t: int) -> None:
        if group and ("TIED", t) not in posted:
            if tied:
                out.append(Action(stage, Kind.TIED_START, t))
            cut("TIED", t)

    def post_norm(t: int) -> None:
        if clip and ("NORM", t) not in posted:
            post_tied(t)
            # The norm is that of the summed, replica-averaged gradient: join those first.
            if dp:
                out.append(Action(stage, Kind.DP_WAIT, t))
            if tied:
                out.append(Action(stage, Kind.TIED_WAIT, t))
            out.append(Action(stage, Kind.NORM_START, t))
            cut("NORM", t)

    def finish(t: int) -> None:
        post_tied(t)
        if clip:
            post_norm(t)
            out.append(Action(stage, Kind.NORM_WAIT, t))
        else:
            if dp:
                out.append(Action(stage, Kind.DP_WAIT, t))
            if tied:
                out.append(Action(stage, Kind.TIED_WAIT, t))
        out.append(Action(stage, Kind.UPDATE, t))

    def reached(c: int) -> bool:
        """Whether the point right before F(c) is behind us: in 1F1B order B(c - w) directly
        precedes F(c) (w: :func:`warmup`), so in the cool-down, where F(c) no longer exists, it is
        after B(c - w)."""
        return b_done >= c - ahead

    for pos, (kind, k) in enumerate(order):
        t = batch_of(k, m)
        if two_bw:
            for p in list(cut_due):
                if reached(max((p + 1) * m + 1 - behind, p * m + d if group else 0)):
                    post_norm(p)
        if kind is Kind.F and k > 1 and (k - 1) % m == 0:
            # Every rank posts the loss all-reduce of step t-1 where it returns: the last stage
            # has all of that batch's losses there, and no compute waits for it.
            out.append(Action(stage, Kind.LOSS, t - 1))
            cut("LOSS", t - 1)
            out.append(Action(stage, Kind.END_STEP, t - 1))
            cut("END", t - 1)
        if two_bw:
            for p in list(cut_due):
                if b_done >= p * m:  # right after this stage's last backward of batch p
                    post_tied(p)
                if ("TIED", p) in posted or not group:
                    if ("NORM", p) in posted or not clip:
                        cut_due.remove(p)
        if kind is Kind.F:
            # Join pending reductions as late as the version rule allows: before a forward that
            # needs W(p) (flush: batch p+1; 2bw: batch p+2, the window of arXiv 2006.09503 §3.1),
            # so 2bw overlaps the reductions with a batch of compute.
            need = t - (1 if two_bw else 0)
            while pending and pending[0] < need:
                finish(pending.pop(0))
        v = version_of(schedule, k, m)
        if kind in GRAD_SOURCES and recompute:
            out.append(Action(stage, Kind.R, k, v))
        out.append(Action(stage, kind, k, v))
        if kind is Kind.B:
            b_done = k
        if kind in LAST_BACKWARD and last_b[t] == pos:
            # Batch t-1's reductions end before batch t's start: at most two gradient buffers.
            while pending:
                finish(pending.pop(0))
            if reduces:
                if dp:
                    out.append(Action(stage, Kind.DP_START, t))
                pending.append(t)
            else:
                out.append(Action(stage, Kind.UPDATE, t))  # nothing to overlap: as in DESIGN's example
            if two_bw:
                cut_due.append(t)
            else:
                post_tied(t)  # flush schedules: every stage is past batch t here
    for t in sorted(set(pending) | set(cut_due)):
        post_tied(t)
        if t in pending:
            finish(t)
    return out, cuts


def _interleaved_core(
    lane: int, d: int, v: int, m: int, steps: int, recompute: Sequence[bool], dp: bool, group: tuple[int, ...],
    clip: bool,
) -> tuple[list[Action], list[tuple[str, int]]]:
    """:func:`_core_list` of one lane under interleaved 1F1B (``v`` > 1 chunks): the compute of
    :func:`_interleaved`, batch by batch (a flush), with the same cuts at the same places.

    Per batch ``t``: a stage's ``DP_START t`` (or, where it reduces nothing, its ``UPDATE t``)
    right after its own last backward of the batch; the tied stages' ``TIED_START t`` and the
    TIED cut after the lane's last backward; at the start of batch ``t + 1``, every stage's
    ``LOSS t``, the LOSS cut, every stage's ``END_STEP t`` and the END cut, then the joins. A
    collective that several of the lane's stages take part in (``NORM``, ``LOSS``, a tied weight
    on two of them) is posted by each of them, one right after another, before any of them waits
    for it: the rank sums their parts and joins the others once (:class:`fxpipe.deps.Rendezvous`),
    so every stage's ``*_START`` precedes the first ``*_WAIT``."""
    out: list[Action] = []
    cuts: list[tuple[str, int]] = []
    mine = [c * d + lane for c in range(v)]
    tied = [s for s in mine if s in group]
    reduces = {s: dp or s in group or clip for s in mine}

    def cut(label: str, t: int) -> None:
        cuts.append((f"{label}{t}", len(out)))

    def finish(t: int) -> None:
        for s in mine:
            if dp and reduces[s]:
                out.append(Action(s, Kind.DP_WAIT, t))
            if s in tied:
                out.append(Action(s, Kind.TIED_WAIT, t))
        if clip:
            out.extend(Action(s, Kind.NORM_START, t) for s in mine)
            cut("NORM", t)
            out.extend(Action(s, Kind.NORM_WAIT, t) for s in mine)
        out.extend(Action(s, Kind.UPDATE, t) for s in mine if reduces[s])

    for t in range(1, steps + 1):
        if t > 1:
            out.extend(Action(s, Kind.LOSS, t - 1) for s in mine)
            cut("LOSS", t - 1)
            out.extend(Action(s, Kind.END_STEP, t - 1) for s in mine)
            cut("END", t - 1)
            finish(t - 1)
        order = _interleaved((t - 1) * m + 1, m, lane, d, v)
        last = {s: max(pos for pos, (kind, _, at) in enumerate(order) if kind is Kind.B and at == s) for s in mine}
        for pos, (kind, k, s) in enumerate(order):
            if kind is Kind.B and recompute[s]:
                out.append(Action(s, Kind.R, k, t - 1))
            out.append(Action(s, kind, k, t - 1))
            if pos == last[s]:
                if not reduces[s]:
                    out.append(Action(s, Kind.UPDATE, t))
                elif dp:
                    out.append(Action(s, Kind.DP_START, t))
        out.extend(Action(s, Kind.TIED_START, t) for s in tied)
        if group:
            cut("TIED", t)
    finish(steps)
    return out, cuts


def _send_order(lists: Mapping[int, Sequence[Action]], stages: int) -> dict[Action, int]:
    """Each send of the lanes' lists (no receives yet) -> its place in a run of them in which
    every lane runs its list in order, an F or B starts once the message it consumes was sent,
    and F, R and B take 1, 1 and 2 (the other actions no time): the sends in the order of their
    times (ties by lane). Any such run orders the sends consistently with both every lane's list
    and every message's causes; timing it keeps it close to a real run's."""
    cost = {Kind.F: 1.0, Kind.EVAL: 1.0, Kind.R: 1.0, Kind.B: 2.0}
    clock = dict.fromkeys(lists, 0.0)
    pos = dict.fromkeys(lists, 0)
    when: dict[Action, tuple[float, int]] = {}
    while True:
        best = None
        for r, lst in lists.items():
            if pos[r] == len(lst):
                continue
            need = waits_for(lst[pos[r]], stages)
            if need is not None and need.kind in RECVS:
                if need.counterpart() not in when:
                    continue
                start = max(clock[r], when[need.counterpart()][0])
            else:
                start = clock[r]
            if best is None or start < best[0]:
                best = (start, r)
        if best is None:
            break
        start, r = best
        a = lists[r][pos[r]]
        clock[r] = start + cost.get(a.kind, 0.0)
        if a.kind in SENDS:
            when[a] = (clock[r], -r)
        pos[r] += 1
    if any(pos[r] < len(lst) for r, lst in lists.items()):
        raise ScheduleError(f"internal: interleaved 1F1B's compute deadlocks at {pos}")
    return {a: i for i, a in enumerate(sorted(when, key=lambda a: when[a]))}


def _with_p2p_lanes(cores: dict[int, tuple[list[Action], list[tuple[str, int]]]], stages: int,
                    chunks: int) -> dict[int, list[Action]]:
    """:func:`_with_p2p` for lanes that hold several stages (interleaved 1F1B).

    Sends follow their F/B, as there. Between two lanes every channel of their stages shares one
    queue (NCCL's rule (a) is per pair of ranks), in the order the sends happen when the lanes run
    their compute in list order, each F and B waiting for the message it consumes
    (:func:`fxpipe.deps.interleave`; a flush keeps each batch's messages in its phase). A lane
    posts its sends in that order by construction. It posts each receive right after its own
    last send that came before the message's in that run (and not before the sender's phase
    opens on it): early, so the transfer overlaps compute, yet after every post of its own the
    message could be waiting for, since under rule (b) a receive holds back the rank's later
    posts until it completes. The message was sent before its consumer ran, so the receive
    precedes its consumer. The run is timed (:func:`_send_order`), so that "came before" is
    close to what happens, and each receive is posted about when its message can be sent."""
    labels = {r: [label for label, _ in cuts] for r, (_, cuts) in cores.items()}
    if any(v != labels[0] for v in labels.values()):
        raise ScheduleError(f"internal: lanes disagree on the order of their cuts: {labels}")
    lists: dict[int, list[Action]] = {}
    phase_of: dict[Action, int] = {}  # send -> the phase of the F/B it follows
    opens: dict[int, dict[int, int]] = {}  # lane -> phase -> where it opens in the lane's list
    for r, (core, cuts) in cores.items():
        lst: list[Action] = []
        bounds = [i for _, i in cuts]
        phase = 0
        opens[r] = {0: 0}
        for i, a in enumerate(core):
            while phase < len(bounds) and bounds[phase] <= i:
                phase += 1
                opens[r][phase] = len(lst)
            lst.append(a)
            send = (Action(a.stage, Kind.SEND_ACT, a.index) if a.kind in (Kind.F, Kind.EVAL) and a.stage < stages - 1 else
                    Action(a.stage, Kind.SEND_GRAD, a.index) if a.kind is Kind.B and a.stage > 0 else None)
            if send is not None:
                lst.append(send)
                phase_of[send] = phase
        while phase < len(bounds):
            phase += 1
            opens[r][phase] = len(lst)
        lists[r] = lst
    sent = _send_order(lists, stages)
    out: dict[int, list[Action]] = {}
    for r, lst in lists.items():
        mine = [(sent[a], i) for i, a in enumerate(lst) if a.kind in SENDS]  # in run order
        at: dict[int, list[tuple[int, Action]]] = defaultdict(list)  # insert before position -> receives
        for a, seq in sent.items():
            if lane_of(a.peer, stages, chunks) != r:
                continue
            before = [i for s, i in mine if s < seq]
            where = max(before[-1] + 1 if before else 0, opens[r][phase_of[a]])
            at[where].append((seq, a.counterpart()))
        merged: list[Action] = []
        for i in range(len(lst) + 1):
            merged += [recv for _, recv in sorted(at.get(i, ()))]
            if i < len(lst):
                merged.append(lst[i])
        out[r] = merged
    return out


def _with_p2p(cores: dict[int, tuple[list[Action], list[tuple[str, int]]]], d: int) -> dict[int, list[Action]]:
    """Insert SEND after each F/B and each RECV right after its channel predecessor (module doc).

    The cuts of :func:`_core_list` split the run into phases. The channel between stages i and
    i+1 carries the messages of phase 0, then phase 1, ...: a message belongs to the phase of
    the F or B that sends it; within a phase, stage i's compute order decides. Each side posts a
    receive in its sender's phase, right after its previous operation on the channel (or at the
    phase's start), so at every cut both sides of every channel have posted the same operations.
    """
    labels = {s: [label for label, _ in cuts] for s, (_, cuts) in cores.items()}
    if any(v != labels[0] for v in labels.values()):
        raise ScheduleError(f"internal: stages disagree on the order of their cuts: {labels}")
    lists: dict[int, list[Action]] = {}
    phase_of: dict[tuple[int, Kind, int], int] = {}  # (stage, F|B, k) -> phase
    opens: dict[int, dict[int, Action | None]] = {}  # stage -> phase -> first action (None: end)
    for s, (core, cuts) in cores.items():
        lst: list[Action] = []
        bounds = [i for _, i in cuts]
        phase = 0
        opens[s] = {}
        for i, a in enumerate(core):
            while phase < len(bounds) and bounds[phase] <= i:
                phase += 1
                opens[s][phase] = a
            lst.append(a)
            if a.kind is Kind.F and s < d - 1:
                lst.append(Action(s, Kind.SEND_ACT, a.index))
            elif a.kind in GRAD_SOURCES and s > 0:
                lst.append(Action(s, Kind.SEND_GRAD, a.index))
            if a.kind is Kind.F or a.kind in GRAD_SOURCES:  # a B and an I both send the gradient
                phase_of[s, Kind.F if a.kind is Kind.F else Kind.B, a.index] = phase
        while phase < len(bounds):
            phase += 1
            opens[s][phase] = None
        lists[s] = lst
    for i in range(d - 1):
        messages = sorted(
            (phase_of[i, Kind.F, a.index] if a.kind is Kind.F else phase_of[i + 1, Kind.B, a.index], pos,
             Kind.SEND_ACT if a.kind is Kind.F else Kind.RECV_GRAD, a.index)
            for pos, a in enumerate(cores[i][0]) if a.kind is Kind.F or a.kind in GRAD_SOURCES
        )
        channel = [(phase, Action(i, kind, k)) for phase, _, kind, k in messages]
        lists[i] = _place_receives(lists[i], channel, opens[i])
        lists[i + 1] = _place_receives(lists[i + 1], [(phase, a.counterpart()) for phase, a in channel], opens[i + 1])
    return lists


def _place_receives(lst: list[Action], channel: list[tuple[int, Action]], opens: Mapping[int, Action | None]
                    ) -> list[Action]:
    """``lst`` with the receives of ``channel`` (one side of a queue between two ranks, in queue
    order, each with its phase) placed: each right after the previous operation of the queue
    when that is in the same phase, else where its phase opens (``opens``)."""
    after: dict[Action, list[Action]] = defaultdict(list)  # receive follows this action directly
    before: dict[Action | None, list[tuple[int, Action]]] = defaultdict(list)  # opens a phase
    prev: tuple[int, Action] | None = None
    for phase, a in channel:
        if a.kind in RECVS:
            if prev is not None and prev[0] == phase:
                after[prev[1]].append(a)
            else:  # first message of its phase on this channel: post it where the phase opens
                before[opens[phase] if phase else lst[0] if lst else None].append((phase, a))
        prev = (phase, a)
    out: list[Action] = []

    def emit_after(anchor: Action) -> None:
        # A receive anchored on another receive follows it directly (anchors chain in order).
        for r in after.get(anchor, ()):
            out.append(r)
            emit_after(r)

    def emit_before(a: Action | None) -> None:
        for _, r in sorted(before.get(a, ()), key=lambda pr: pr[0]):
            out.append(r)
            emit_after(r)

    for a in lst:
        emit_before(a)
        out.append(a)
        emit_after(a)
    emit_before(None)
    return out


# ---------------------------------------------------------------------------------------------
# Rendering for messages


def format_actions(
    by_rank: Mapping[int, Sequence[Action]], mark: tuple[int, int] | None = None, rows: range | None = None
) -> str:
    """Step x rank grid of the lists (row = position in the list); ``mark=(rank, pos)`` is starred."""
    ranks = sorted(by_rank)
    n = max((len(v) for v in by_rank.values()), default=0)
    rows = rows if rows is not None else range(n)
    cells = [["step"] + [f"rank {r}" for r in ranks]]
    for p in rows:
        row = [str(p)]
        for r in ranks:
            text = str(by_rank[r][p]) if p < len(by_rank[r]) else ""
            row.append(f"*{text}*" if mark == (r, p) else text)
        cells.append(row)
    widths = [max(len(row[c]) for row in cells) for c in range(len(cells[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in cells)


def _excerpt(by_stage: Mapping[int, Sequence[Action]], stage: int, pos: int) -> str:
    n = max(len(v) for v in by_stage.values())
    return format_actions(by_stage, (stage, pos), range(max(pos - 3, 0), min(pos + 4, n)))


# ---------------------------------------------------------------------------------------------
# Validator


class _Checker:
    def __init__(self, by_lane: Mapping[int, Sequence[Action]], width: int, chunks: int = 1) -> None:
        self.by_lane = by_lane  # what runs: one list per rank of a replica
        self.lanes = len(by_lane)
        self.d = self.lanes * chunks  # stages
        self.chunks = chunks
        # each stage's own actions, in its lane's order (a lane of one stage: its list)
        self.by_stage = by_lane if chunks == 1 else {
            s: [a for a in by_lane[lane_of(s, self.d, chunks)] if a.stage == s] for s in range(self.d)}
        self.width = width

    def lane(self, stage: int) -> int:
        return lane_of(stage, self.d, self.chunks)

    def where(self, stage: int) -> str:
        ranks = [rank_of(self.lane(stage), r, self.lanes) for r in range(self.width)]
        return f"stage {stage} (rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))})"

    def fail(self, stage: int, pos: int, message: str, fix: str) -> None:
        action = self.by_stage[stage][pos] if pos < len(self.by_stage[stage]) else None
        raise ScheduleError(
            f"{action} at position {pos} on {self.where(stage)}: {message}. {fix}\n"
            f"{_excerpt(self.by_stage, stage, pos)}"
        )


def validate(
    actions_by_stage: Mapping[int, Sequence[Action]],
    schedule: str,
    stages: int,
    microbatches: int,
    steps: int | None = None,
    *,
    width: int = 1,
    recompute: bool | Sequence[bool] | None = None,
    tied: bool | Sequence[int] | None = None,
    clip: bool | None = None,
    lookahead: int = 0,
    chunks: int = 1,
) -> None:
    """Raise :class:`ScheduleError` unless the lists obey every invariant of ``schedule``.

    ``actions_by_stage`` holds one list per lane (:func:`generate`'s dict): per stage, unless
    ``chunks`` > 1 (interleaved 1F1B), where the per-stage checks below read each stage's actions
    out of its lane's list, a lane holds at most :func:`interleaved_in_flight` micro-batches
    over its stages, and the replay runs the lanes.

    Checks, per stage: the stage field, one F and one B per micro-batch with F before B (and R
    between them, only where recompute is on, as the compute right before its B or I: one
    recomputed micro-batch alive) -- under zb, where :func:`zb_split` says it splits, one F, I
    and W each, F before I before W, and no B (elsewhere one F and one B, no I or W), and on a
    recomputing stage W directly after its I; each F/R/B/I/W on the version of
    :func:`version_of`
    (so the same on every stage); SEND after the F/B that produced its tensor and each RECV
    before its consumer; at most ``d - i`` micro-batches in flight on stage i (1f1b, 2bw; plus
    ``lookahead`` on all but the last stage, :func:`warmup`) or
    ``m`` (gpipe), or ``min(d, m)`` between F and W (zb, of which at most ``min(d - i, m)``
    before their I; ``min(d - i, m)`` where the stage recomputes, see :func:`zb_bounds`); at
    most 2 weight versions alive (2bw) or 1 (flush); one UPDATE per batch in its window (after
    the last B of batch t, before the first B of batch t+1 and the first F of batch t+2 for 2bw,
    t+1 otherwise); each reduction started after the last B of batch t and
    waited for before UPDATE t; the reductions that ``width``/``tied``/``clip`` require (when
    those are given); in lists with END_STEPs (:class:`Program`'s), END_STEP 1..steps in order,
    each directly after its LOSS, and every forward of batch t between END_STEP t-1 and END_STEP
    t (:func:`_check_steps`), with both sides of every channel level at each END_STEP. Then it
    replays all stages together with blocking semantics (module
    docstring) and reports mismatched p2p orders and deadlocks. ``steps`` defaults to what the
    lists hold. The message names the action, its stage and ranks, and shows the grid around it.
    """
    _check_args(schedule, stages, microbatches, steps or 1, width, lookahead, chunks)
    n = lanes_of(stages, chunks)
    if sorted(actions_by_stage) != list(range(n)):
        what = f"stage 0..{stages - 1}" if chunks == 1 else f"lane 0..{n - 1} ({stages} stages, {chunks} per lane)"
        raise ScheduleError(
            f"expected one action list per {what}, found keys {sorted(actions_by_stage)}: "
            f"pass generate(...)'s dict (one pipeline replica)"
        )
    ck = _Checker(actions_by_stage, width, chunks)
    if chunks > 1:
        _check_lanes(ck, microbatches)
    m, d = microbatches, stages
    if steps is None:
        ks = [a.index for lst in actions_by_stage.values() for a in lst if a.kind is Kind.F]
        steps = max(batch_of(max(ks), m), 1) if ks else 1
    if isinstance(recompute, bool):
        recompute = [recompute] * d
    group = _tied_group(tied, d) if tied is not None else None
    segments = any(a.kind is Kind.END_STEP for lst in actions_by_stage.values() for a in lst)
    for s in range(d):
        _StageCheck(ck, s, schedule, d, m, steps, recompute, group, clip, width, lookahead).run()
        if segments:
            _check_steps(ck, s, m, steps)
    if segments:
        _check_boundaries(ck)
    _replay(ck)


class _StageCheck:
    """One stage's list, read in order: the rules common to every action, then its kind's order
    rules (:data:`_ORDER_RULES`: one method per kind group), then, once the list is read, what
    the whole list must hold (:meth:`complete`). A new kind adds its rules here."""

    def __init__(self, ck: _Checker, s: int, schedule: str, d: int, m: int, steps: int,
                 recompute: Sequence[bool] | None, group, clip: bool, width: int, lookahead: int = 0) -> None:
        self.ck, self.s, self.schedule, self.d, self.m, self.steps = ck, s, schedule, d, m, steps
        self.recompute, self.group, self.clip, self.width = recompute, group, clip, width
        self.lst = ck.by_stage[s]
        self.zb = schedule == "zb"
        self.rc = recompute is not None and recompute[s]
        # micro-batches between F and W (B), and how many of them may have run their I (zb's deferred W)
        self.limit, deferred = (zb_bounds(s, d, m, self.rc) if self.zb else
                                (m if schedule == "gpipe" or ck.chunks > 1 else warmup(s, d, lookahead), 0))
        self.whole = self.limit - deferred  # between F and I: whole activations
        self.reduced = {a.index for a in self.lst if a.kind in STARTS}  # batches whose gradient is reduced
        self.max_versions = versions_of(schedule)
        self.pos = 0
        self.first_f: dict[int, int] = {}
        self.last_b: dict[int, int] = {}
        self.done: dict[tuple[Kind, int], int] = {}
        self.in_flight: dict[int, int] = {}  # micro-batch -> version, F done and B (zb: W) not yet
        self.before_i: set[int] = set()
        self.started: dict[tuple[Kind, int], int] = {}
        self.newest = 0

    def fail(self, message: str, fix: str, pos: int | None = None) -> None:
        self.ck.fail(self.s, self.pos if pos is None else pos, message, fix)

    def backward(self, k: int) -> tuple[Kind, ...]:
        """What micro-batch k's backward is on this stage: ``I`` and ``W`` where zb splits it
        (:func:`zb_split`), else ``B``."""
        if self.zb and zb_split(self.s, self.d, self.m, k, self.rc):
            return (Kind.I, Kind.W)
        return (Kind.B,)

    def run(self) -> None:
        for self.pos, a in enumerate(self.lst):
            k, t = self.common(a)
            for rule in _ORDER_RULES.get(a.kind, ()):
                rule(self, a, k, t)
            self.check_versions({self.newest} | set(self.in_flight.values()), "")
        self.complete()

    def check_versions(self, alive: set[int], where: str) -> None:
        if len(alive) > self.max_versions:
            self.fail(
                f"{len(alive)} weight versions alive{where} ({', '.join(f'W({v})' for v in sorted(alive))}), "
                f"expected at most {self.max_versions} for {self.schedule}",
                "Run the UPDATE after the backwards of the micro-batches that use the oldest version",
            )

    def common(self, a) -> tuple[int, int]:
        """What every action must be (an Action of this stage, once, of a kind this schedule has,
        within the run), and a compute action's weight version; returns (micro-batch k, batch t)."""
        s, schedule, m = self.s, self.schedule, self.m
        if not isinstance(a, Action):
            self.fail(f"expected an Action, found {type(a).__name__} {a!r}", "Build lists with Action(...)")
        if a.stage != s:
            self.fail(f"the action names stage {a.stage} but sits in stage {s}'s list", "Move it to its stage")
        if (a.kind, a.index) in self.done:
            self.fail(f"{a.kind}{a.index} appears twice (first at position {self.done[a.kind, a.index]})", "Drop one")
        self.done[a.kind, a.index] = self.pos
        k, t = a.index, a.index
        if a.kind in BACKWARDS and a.kind not in self.backward(k):
            self.fail(f"{schedule} has no {a.kind}{k} on stage {s} (its backward of micro-batch {k} is "
                      f"{' + '.join(map(str, self.backward(k)))})",
                      f"Use {' and '.join(f'{s}{b}{k}' for b in self.backward(k))} instead")
        if a.kind in COMPUTE or a.kind in P2P:
            if not 1 <= k <= self.steps * m:
                self.fail(f"micro-batch {k} is outside 1..{self.steps * m} (steps={self.steps}, m={m})", "Fix the index")
            t = batch_of(k, m)
        if a.kind in COMPUTE:
            want = version_of(schedule, k, m)
            if a.version != want:
                rule = "max(floor((k-1)/m) - 1, 0)" if schedule == "2bw" else "t - 1 for batch t"
                self.fail(f"micro-batch {k} uses version {a.version}, expected {want} ({schedule}: {rule}, m={m})",
                          "Every stage must run a micro-batch's F and B on the same version")
            if want > self.newest or want < self.newest - 1:
                self.fail(f"version {want} is not alive here (newest produced: W({self.newest}))",
                          f"Run UPDATE{want} before the first forward that uses W({want})")
        return k, t

    def forward(self, a, k: int, t: int) -> None:
        s, zb, rc = self.s, self.zb, self.rc
        self.first_f.setdefault(t, self.pos)
        if s > 0 and (Kind.RECV_ACT, k) not in self.done:
            self.fail(f"no RECV_ACT{k} posted before the forward that consumes it", f"Insert {s}RECV_ACT{k} before it")
        self.in_flight[k] = a.version
        if len(self.in_flight) > self.limit:
            what = f"min(d, m) = {self.limit}, zb" if zb and not rc else f"{self.limit} ({self.schedule}"
            self.fail(
                f"{len(self.in_flight)} micro-batches of activations in flight, expected at most {what} "
                f"on stage {s} of {self.d}{', recomputing' if rc and zb else ''})",
                "Run a backward before this forward" + (" (a W frees its micro-batch)" if zb else ""),
            )
        self.before_i.add(k)
        if len(self.before_i) > self.whole:
            self.fail(
                f"{len(self.before_i)} micro-batches between their F and their I, expected at most "
                f"min(d - s, m) = {self.whole} (zb on stage {s} of {self.d}: only a micro-batch past its I may "
                f"wait for its W, holding just what W reads; the planner prices the stage so)",
                "Run an I before this forward",
            )

    def recomputed_forward(self, a, k: int, t: int) -> None:
        s = self.s
        if (Kind.F, k) not in self.done:
            self.fail(f"recompute of micro-batch {k} before its forward", f"Move it after {s}F{k}")
        if self.recompute is not None and not self.recompute[s]:
            self.fail(f"stage {s} recomputes although recompute[{s}] is False", "Drop the R action")
        if any((b, k) in self.done for b in GRAD_SOURCES):
            self.fail(f"recompute of micro-batch {k} after its backward", f"Move it right before {s}{self.backward(k)[0]}{k}")

    def gradient_source(self, a, k: int, t: int) -> None:
        """B, or zb's I: the pass that makes the gradient SEND_GRAD k sends."""
        s, done = self.s, self.done
        if (Kind.F, k) not in done:
            self.fail(f"backward of micro-batch {k} before its forward", f"Move {s}F{k} before it")
        if self.recompute is not None and self.recompute[s] and (Kind.R, k) not in done:
            self.fail(f"recompute is on for stage {s} but {s}R{k} does not precede this backward", f"Insert {s}R{k}")
        if self.rc or (Kind.R, k) in done:
            # One recomputed micro-batch alive at a time (what the planner prices): R k is the
            # compute right before the backward that frees it, as W k right after I k below.
            prev = _previous_compute(self.lst, self.pos)
            if prev != Action(s, Kind.R, k, a.version):
                self.fail(f"stage {s} recomputes, so {a.kind}{k} must directly follow R{k} (found {prev} before it)",
                          f"Move {s}R{k} right before it: an earlier recompute keeps its activations alive alongside "
                          f"other micro-batches'")
        if s < self.d - 1 and (Kind.RECV_GRAD, k) not in done:
            self.fail(f"no RECV_GRAD{k} posted before the backward that consumes it", f"Insert {s}RECV_GRAD{k} before it")
        self.before_i.discard(k)
        if a.kind is Kind.B:
            self.last_b[t] = self.pos
            self.in_flight.pop(k, None)
        # An I already writes batch t's gradient on a stage that cannot split (runtime fallback).
        # a second gradient buffer holds batch t-1's (2bw with reductions, gradient_buffers)
        handed_off = (t - 1) in self.reduced and gradient_buffers(self.schedule, reduces=True) == 2
        if t > 1 and (Kind.UPDATE, t - 1) not in done and not handed_off:
            self.fail(f"first backward of batch {t} before UPDATE{t - 1}",
                      f"Run UPDATE{t - 1} earlier: the stage has one gradient accumulator (under {self.schedule!r} "
                      f"without a reduction holding batch {t - 1}'s gradient)")

    def weight_pass(self, a, k: int, t: int) -> None:
        s = self.s
        if (Kind.I, k) not in self.done:
            self.fail(f"weight pass of micro-batch {k} before its input-gradient pass", f"Move {s}I{k} before it")
        if self.rc:
            prev = _previous_compute(self.lst, self.pos)
            if prev != Action(s, Kind.I, k, a.version):
                self.fail(f"stage {s} recomputes, so W{k} must directly follow I{k} (found {prev} before it)",
                          "Deferring it would keep the recomputed activations alive: put it right after the I")
        self.last_b[t] = self.pos
        self.in_flight.pop(k, None)

    def send(self, a, k: int, t: int) -> None:
        s = self.s
        source = Kind.F if a.kind is Kind.SEND_ACT else self.backward(k)[0]
        if (source, k) not in self.done:
            self.fail(f"sends micro-batch {k} before {s}{source}{k} produced it", f"Move it after {s}{source}{k}")

    def peer(self, a, k: int, t: int) -> None:
        if not 0 <= a.peer < self.d:
            self.fail(f"peer stage {a.peer} does not exist (d={self.d})", "Drop it: first/last stages have no such peer")

    def reduction_start(self, a, k: int, t: int) -> None:
        done = self.done
        self.started[a.kind, t] = self.pos
        if t > 1 and (Kind.UPDATE, t - 1) not in done:
            self.fail(f"reduction of batch {t} issued while UPDATE{t - 1} is still due",
                      f"Run UPDATE{t - 1} first: at most two gradient buffers (accumulator and one in reduction)")
        if t not in self.last_b or self.backward_follows(t):
            self.fail(f"reduction of batch {t} issued before the stage's last backward of batch {t}",
                      "Move it after that backward")
        if a.kind is Kind.NORM_START:
            for w in (Kind.DP_WAIT, Kind.TIED_WAIT):
                if (_START_OF[w], t) in self.started and (w, t) not in done:
                    self.fail(f"gradient norm started before {w}{t}",
                              f"Wait {w}{t} first: the norm is of the reduced gradient")

    def reduction_wait(self, a, k: int, t: int) -> None:
        if (_START_OF[a.kind], t) not in self.started:
            self.fail(f"waits for {_START_OF[a.kind]}{t}, which was not issued before",
                      f"Insert {self.s}{_START_OF[a.kind]}{t} after the last backward of batch {t}")

    def update(self, a, k: int, t: int) -> None:
        s = self.s
        # the new version counts before the update's other checks report (their order matters)
        self.check_versions({t} | set(self.in_flight.values()), " after it")
        if not 1 <= t <= self.steps:
            self.fail(f"batch {t} is outside 1..{self.steps}", "Fix the index")
        if t != self.newest + 1:
            self.fail(f"produces W({t}) but the newest version is W({self.newest})",
                      f"Updates run in order: UPDATE{self.newest + 1} next")
        if t not in self.last_b or self.backward_follows(t):
            self.fail(f"UPDATE{t} before the stage's last backward of batch {t}", "Move it after that backward")
        for (kind, tb), p in self.started.items():
            if tb == t and (_WAIT_OF[kind], t) not in self.done:
                self.fail(f"{kind}{t} (position {p}) is not waited for before UPDATE{t}",
                          f"Insert {s}{_WAIT_OF[kind]}{t} before the update")
        self.newest = t

    def backward_follows(self, t: int) -> bool:
        """Whether a backward of batch ``t`` comes after the current position."""
        return any(b.kind in BACKWARDS and batch_of(b.index, self.m) == t for b in self.lst[self.pos + 1:])

    def complete(self) -> None:
        """What the whole list must hold once every action is read: each batch's UPDATE before the
        forwards that need its version, every started reduction waited for, the reductions the
        configuration needs, and every micro-batch's compute and messages."""
        s, d, m, steps, done, last = self.s, self.d, self.m, self.steps, self.done, len(self.lst) - 1
        ahead = versions_of(self.schedule)  # batch t + ahead is the first to read W(t): one step later under 2bw
        required = [kind for kind, needed in ((Kind.DP_START, self.width > 1),
                                              (Kind.TIED_START, self.group is not None and s in self.group),
                                              (Kind.NORM_START, self.clip)) if needed]
        for t in range(1, steps + 1):
            if (Kind.UPDATE, t) not in done:
                self.fail(f"no UPDATE{t}: every batch's gradients must be applied",
                          f"Insert {s}UPDATE{t} after the last backward of batch {t}", last)
            upd = done[Kind.UPDATE, t]
            if t + ahead in self.first_f and self.first_f[t + ahead] < upd:
                self.fail(f"forward of batch {t + ahead} before UPDATE{t} (position {upd}) produced the version it "
                          f"needs", f"Move UPDATE{t} before it", self.first_f[t + ahead])
            for kind in STARTS:
                wait = _WAIT_OF[kind]
                if (kind, t) in done and (wait, t) not in done:
                    self.fail(f"{kind}{t} is never waited for", f"Insert {s}{wait}{t} before UPDATE{t}", done[kind, t])
            for kind in required:
                if (kind, t) not in done:
                    self.fail(f"missing {kind}{t} (width={self.width}, tied={self.group}, clip={self.clip})",
                              f"Insert {s}{kind}{t} after the last backward of batch {t}", upd)
        for k in range(1, steps * m + 1):
            for kind in (Kind.F, *self.backward(k)):
                if (kind, k) not in done:
                    each = ", ".join(f"{s}{x}{k}" for x in (Kind.F, *self.backward(k)))
                    self.fail(f"no {kind}{k}: expected {each} for micro-batch {k} of 1..{steps * m}"
                              + (" (zb_split says which micro-batches zb splits)" if self.zb else ""),
                              f"Insert {s}{kind}{k}", last)
            for kind, present in ((Kind.SEND_ACT, s < d - 1), (Kind.RECV_ACT, s > 0), (Kind.SEND_GRAD, s > 0),
                                  (Kind.RECV_GRAD, s < d - 1)):
                if present and (kind, k) not in done:
                    self.fail(f"no {kind}{k} on stage {s}", f"Insert {s}{kind}{k} (see the posting rules in "
                              f"fxpipe.schedule)", last)


# The order rules of each kind, in the order they are checked (after the common ones).
_ORDER_RULES: dict[Kind, tuple[Callable[..., None], ...]] = {
    Kind.F: (_StageCheck.forward,),
    Kind.R: (_StageCheck.recomputed_forward,),
    Kind.B: (_StageCheck.gradient_source,),
    Kind.I: (_StageCheck.gradient_source,),
    Kind.W: (_StageCheck.weight_pass,),
    Kind.SEND_ACT: (_StageCheck.send, _StageCheck.peer),
    Kind.SEND_GRAD: (_StageCheck.send, _StageCheck.peer),
    Kind.RECV_ACT: (_StageCheck.peer,),
    Kind.RECV_GRAD: (_StageCheck.peer,),
    Kind.UPDATE: (_StageCheck.update,),
    **{k: (_StageCheck.reduction_start,) for k in STARTS},
    **{k: (_StageCheck.reduction_wait,) for k in WAITS},
}


def _previous_compute(lst: Sequence[Action], pos: int) -> Action | None:
    """The compute or update action last before position ``pos`` of ``lst``."""
    return next((b for b in reversed(lst[:pos]) if b.kind in COMPUTE or b.kind is Kind.UPDATE), None)


def _groups(by_lane: Mapping[int, Sequence[Action]], chunks: int = 1) -> dict[str, list[int]]:
    """Collective groups of one replica: the lanes issuing each cross-stage kind, a lane once per
    stage of it that takes part (:class:`fxpipe.deps.Rendezvous` sums a rank's parts before it
    joins), and each stage's data-parallel group (its replicas run the same list, so one stands
    for all of them)."""
    d = len(by_lane) * chunks
    groups: dict[str, list[int]] = {}
    for kind in (Kind.TIED_START, Kind.NORM_START, Kind.LOSS):
        groups[kind.value] = sorted(r for r, lst in by_lane.items() for s in {a.stage for a in lst if a.kind is kind})
    groups.update({f"{Kind.DP_START.value}:{s}": [lane_of(s, d, chunks)] for s in range(d)})
    return groups


def comm_op(a: Action, stages: int | None = None, chunks: int = 1) -> CommOp:
    """The :class:`~fxpipe.deps.CommOp` that posting ``a`` makes in the validator's replay (its
    lane as the rank, its peer stage's lane as the peer; with one chunk, the stages)."""
    spec = SPEC[a.kind]
    lane = a.stage if chunks == 1 else lane_of(a.stage, stages, chunks)
    if spec.comm == "collective":
        group = f"{a.kind.value}:{a.stage}" if a.kind is Kind.DP_START else a.kind.value
        return CommOp(lane, "collective", str(a), (a.kind, a.index), group=group, member=a.stage)
    data = "act" if a.kind in (Kind.SEND_ACT, Kind.RECV_ACT) else "grad"
    peer = a.peer if chunks == 1 else lane_of(a.peer, stages, chunks)
    return CommOp(lane, spec.comm, str(a), (data, a.index), peer=peer)


def _check_steps(ck: _Checker, s: int, m: int, steps: int) -> None:
    """Where stage ``s``'s segments end. ``step(t)`` hands the runtime batch t and runs each list
    through ``END_STEP t``. The generator puts ``END_STEP t`` right before the stage's first
    forward of batch t+1, on every stage and schedule, and ``LOSS t`` directly before it. 2bw is
    no exception: its backwards, reductions and UPDATEs of batch t may follow ``END_STEP t`` (its
    first stages run ``B`` of batch t after it), never its forwards. So each stage has
    ``END_STEP 1..steps`` once each, in order; every forward of batch t lies after
    ``END_STEP t-1`` (earlier, step t-1 would need inputs the caller passes only at step t) and
    before ``END_STEP t`` (later, step t would return before the batch's losses exist; the drain
    after the last one holds no forward); ``LOSS t`` directly precedes ``END_STEP t``."""
    lst = ck.by_stage[s]
    ends: dict[int, int] = {}
    for pos, a in enumerate(lst):
        if a.kind is Kind.END_STEP:
            due = len(ends) + 1
            if a.index != due or due > steps:
                expected = f"END_STEP{due} next" if due <= steps else f"no more (steps={steps})"
                ck.fail(s, pos, f"END_STEP{a.index} where {expected}: expected END_STEP1..{steps}, one per step, in "
                        f"order", "Each step's segment ends once, after the previous one: fix or drop this END_STEP")
            ends[a.index] = pos
            before = lst[pos - 1] if pos else None
            if before != Action(s, Kind.LOSS, a.index):
                ck.fail(s, pos, f"END_STEP{a.index} is not directly preceded by LOSS{a.index} (found {before})",
                        f"Put {s}LOSS{a.index} right before it: every rank posts the loss all-reduce of step "
                        f"{a.index} where it returns from that step")
    if len(ends) < steps:
        ck.fail(s, len(lst) - 1, f"no END_STEP{len(ends) + 1}: expected END_STEP1..{steps}, one per step",
                f"Insert {s}LOSS{len(ends) + 1} {s}END_STEP{len(ends) + 1} right before the stage's first forward of "
                f"batch {len(ends) + 2} (at the end of the list for the last step)")
    for pos, a in enumerate(lst):
        if a.kind is Kind.LOSS and lst[pos + 1:pos + 2] != [Action(s, Kind.END_STEP, a.index)]:
            ck.fail(s, pos, f"LOSS{a.index} is not directly followed by END_STEP{a.index}",
                    f"Move it right before {s}END_STEP{a.index}")
        if a.kind is not Kind.F:
            continue
        t = batch_of(a.index, m)
        if t > 1 and pos < ends[t - 1]:
            ck.fail(s, pos, f"forward of batch {t} before END_STEP{t - 1} (position {ends[t - 1]}): step {t - 1} would "
                    f"run it before the caller passes batch {t}",
                    f"Move {s}END_STEP{t - 1} (with its LOSS) right before the stage's first forward of batch {t}")
        if pos > ends[t]:
            ck.fail(s, pos, f"forward of batch {t} after END_STEP{t} (position {ends[t]}): step {t} would return "
                    f"before its forwards ran", f"Move {s}END_STEP{t} (with its LOSS) after the stage's last forward "
                    f"of batch {t}, right before its first forward of batch {t + 1}")


def _check_boundaries(ck: _Checker) -> None:
    """At every END_STEP t, both sides of every channel have posted the same operations: a rank
    that stops there (the caller has no batch t+1 yet) leaves no post without its counterpart."""
    lists = ck.by_lane
    pairs = {tuple(sorted((ck.lane(a.stage), ck.lane(a.peer)))) for lst in lists.values() for a in lst if a.kind in P2P}
    for i, j in sorted(pairs):
        for me, peer in ((i, j), (j, i)):
            count = 0
            for pos, a in enumerate(lists[me]):
                if a.kind in P2P and ck.lane(a.peer) == peer:
                    count += 1
                elif a.kind is Kind.END_STEP:
                    theirs = 0
                    for b in lists[peer]:
                        if b.kind is Kind.END_STEP and b.index == a.index:
                            break
                        theirs += b.kind in P2P and ck.lane(b.peer) == me
                    else:
                        ck.fail(a.stage, ck.by_stage[a.stage].index(a), f"lane {peer} has no END_STEP{a.index}",
                                "Every stage ends every step")
                    if theirs != count:
                        ck.fail(
                            a.stage, ck.by_stage[a.stage].index(a),
                            f"{count} operations with {_lane_name(ck, peer)} are posted before this boundary, but "
                            f"{_lane_name(ck, peer)} posts {theirs} before its END_STEP{a.index}",
                            "A receive belongs to the step of its send: post it after END_STEP on both sides",
                        )


def _lane_name(ck: _Checker, lane: int) -> str:
    return f"stage {lane}" if ck.chunks == 1 else f"lane {lane}"


def _check_lanes(ck: _Checker, m: int) -> None:
    """Interleaved 1F1B: each lane holds at most :func:`interleaved_in_flight` (micro-batch,
    stage) pairs between their F and their B, over all its stages."""
    for r, lst in ck.by_lane.items():
        limit = interleaved_in_flight(r, ck.d, ck.chunks, m)
        held: set[tuple[int, int]] = set()
        for a in lst:
            if a.kind is Kind.F:
                held.add((a.stage, a.index))
                if len(held) > limit:
                    ck.fail(a.stage, ck.by_stage[a.stage].index(a),
                            f"lane {r} holds {len(held)} micro-batches in flight over its stages, more than "
                            f"interleaved 1F1B's {limit}", "Run a backward before this forward")
            elif a.kind is Kind.B:
                held.discard((a.stage, a.index))


def _replay(ck: _Checker) -> None:
    """Run all stages together under the dependency model of :mod:`fxpipe.deps` (local waits,
    NCCL's pairing and one global post order); raise on a mismatch or a deadlock."""
    d, lists = ck.d, ck.by_lane
    engine = Rendezvous(_groups(lists, ck.chunks))
    posted: dict[Action, CommOp] = {}

    def ready(r: int, a: Action) -> bool:
        need = waits_for(a, d)
        return need is None or (need in posted and posted[need].done)

    def run(r: int, pos: int) -> None:
        a = lists[r][pos]
        if SPEC[a.kind].comm is not None:
            try:
                posted[a] = engine.post(comm_op(a, d, ck.chunks))
            except CommOrderError as e:
                ck.fail(a.stage, ck.by_stage[a.stage].index(a), str(e), "See the posting rules in fxpipe.schedule")

    stopped = interleave({r: lists[r] for r in range(ck.lanes)}, ready, run)
    if stopped or len(engine.queue):
        blocked = "; ".join(f"{_lane_name(ck, r)} at {lists[r][i]} (position {i})" for r, i in sorted(stopped.items()))
        r = min(stopped) if stopped else min(engine.queue)
        a = lists[r][stopped[r]] if stopped else Action.parse(engine.queue[r][0].label)
        s, pos = a.stage, ck.by_stage[a.stage].index(a)
        ck.fail(
            s, pos, f"deadlock: {blocked or 'every list ended'}; posts never completed: {' | '.join(engine.blocked())}",
            "A receive's matching send is never reached, or two ranks post in orders that form a cycle: post sends "
            "right after their F/B and receives before their consumer, in channel order",
        )


# ---------------------------------------------------------------------------------------------
# Stream lowering


class StreamOp(NamedTuple):
    """One action placed on a stream: it waits for ``waits`` (event names), then records ``records``.

    Event names are action strings of the same rank (``"1F3v0"``): an op records the event named
    after its own action when it finishes.
    """

    action: Action
    stream: str  # "compute", "p2p_prev", "p2p_next" or "reduce"
    waits: tuple[str, ...]
    records: str


def lower_to_streams(actions: Sequence[Action], stages: int | None = None, chunks: int = 1) -> list[StreamOp]:
    """Place one rank's list on streams, with the events each op must wait for.

    * ``compute`` (in list order): F, R, B, zb's I and W, UPDATE and the ``*_WAIT`` joins: each
      waits for the one action ``SPEC`` names (``F k`` for ``RECV_ACT k`` when the stage
      receives, ``B k`` and ``I k`` for ``RECV_GRAD k``, ``X_WAIT t`` for ``X_START t``). Compute never waits for a send: the runtime keeps the sent tensor
      alive until the send finishes (its work handle holds it, and the runtime keeps the handle until it completes).
    * ``p2p_prev`` / ``p2p_next``: every SEND and RECV with the previous / next stage, both
      directions on one stream in list order, so each matches the peer's op one-for-one (no
      unpaired concurrent NCCL send and receive). ``SEND_ACT k`` waits only for ``F k`` (an eval
      pass's ``EVAL k``),
      ``SEND_GRAD k`` only for ``B k`` (zb: ``I k``, which computes the input gradient); a RECV
      waits for nothing: it receives into a fresh buffer from the caching allocator, so no
      compute has to finish first.
    * ``reduce``: ``DP_START``/``TIED_START`` wait for the last backward pass before them in the
      list (B, or zb's I or W: the batch's gradients are then complete); ``NORM_START`` also waits for ``DP_START``/
      ``TIED_START`` of its batch, whose completion the reduced gradient needs.
    """
    key = {(a.stage, a.kind, a.index): str(a) for a in actions}  # a lane holds several stages
    ops: list[StreamOp] = []
    last_b: str | None = None
    for a in actions:
        stream = stream_of(a, stages, chunks)
        need = SPEC[a.kind].waits  # the one local wait of deps' model (waits_for)
        waits: list[str] = []
        if need is not None and (a.stage, need, a.index) in key:
            waits.append(key[a.stage, need, a.index])
        elif need in STARTS:  # a join without its start never becomes ready
            waits.append(str(Action(a.stage, need, a.index)))
        if a.kind in BACKWARDS:
            last_b = str(a)
        elif a.kind in SENDS:
            if a.kind is Kind.SEND_ACT:  # a training forward, or an eval pass's (Program.eval)
                source = Kind.EVAL if (a.stage, Kind.EVAL, a.index) in key else Kind.F
            else:
                source = Kind.I if (a.stage, Kind.I, a.index) in key else Kind.B
            if (a.stage, source, a.index) not in key:
                raise ScheduleError(f"{a} sends a tensor that no {a.stage}{source}{a.index} in this list produces: put the send after it")
            waits.append(key[a.stage, source, a.index])
        elif stream == "reduce":
            if last_b is not None:
                waits.append(last_b)
            if a.kind is Kind.NORM_START:
                waits += [key[a.stage, k, a.index] for k in (Kind.DP_START, Kind.TIED_START) if (a.stage, k, a.index) in key]
        ops.append(StreamOp(a, stream, tuple(waits), str(a)))
    return ops
