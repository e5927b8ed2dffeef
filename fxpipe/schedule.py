"""Pipeline schedules as data: per-stage action lists for gpipe, 1f1b and 2bw, checked and lowered.

A schedule is a dict ``{stage: [Action, ...]}``: what one rank of that stage does, in order.
Nothing here runs a model or touches a process group; the runtime interprets the lists, the
simulator (:mod:`fxpipe.simulate`) times them, and :func:`validate` proves the invariants.

Actions
-------
``Action(stage, kind, index, version)`` prints as ``{stage}{KIND}{index}[v{version}]`` and
``Action.parse`` reads that string back (``str(Action.parse(s)) == s``)::

    1F3v0        stage 1, forward of micro-batch 3 on weight version 0
    1R3v0        stage 1 recomputes micro-batch 3's forward (activation recomputation) before 1B3v0
    1B3v0        stage 1, backward of micro-batch 3 on weight version 0
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

``index`` is the micro-batch ``k`` for F, R, B, SEND_* and RECV_*, and the batch ``t`` for UPDATE
and the reductions. Micro-batches are numbered 1..steps*m over the whole run; batch ``t``
(1-indexed) holds micro-batches ``(t-1)*m+1 .. t*m``. ``version`` is set on F, R and B only.

Weight versions (DESIGN.md, "Weight-update semantics")
------------------------------------------------------
* gpipe, 1f1b: micro-batches of batch ``t`` use ``W(t-1)``; ``UPDATE t`` runs after the stage's
  last backward of batch ``t`` and before its first forward of batch ``t+1`` (a flush).
* 2bw (PipeDream-2BW, arXiv 2006.09503, section 3.1): micro-batch ``k`` uses
  ``max(floor((k-1)/m) - 1, 0)`` for its forward and its backward on every stage, so
  ``W(t+1) = W(t) - lr * grad f(W(t-1))``. ``UPDATE t`` (producing ``W(t)``) runs after the
  stage's last backward of batch ``t`` and before its first forward of batch ``t+2`` — the first
  forward that uses ``W(t)``. At most two versions are alive per stage. No flush between steps.
* Gradient buffers: a stage accumulates batch ``t``'s gradient in one accumulator. Without a
  reduction, ``UPDATE t`` therefore precedes the stage's first backward of batch ``t+1``. A
  ``*_START t`` hands the accumulated gradient over to the reduction (the runtime swaps in a
  zeroed spare accumulator), so batch ``t+1`` can accumulate while batch ``t`` reduces; then
  ``UPDATE t`` precedes the next ``*_START t+1``: at most two gradient buffers per stage.
  The validator checks both rules.

Orders the generators produce (stage ``i`` of ``d``, ``m`` micro-batches per batch)
--------------------------------------------------------------------------------
* gpipe: ``F1..Fm`` then ``B1..Bm`` in the same (increasing) order, then ``UPDATE``.
* 1f1b (PipeDream-Flush): per batch, ``min(d-i, m)`` warm-up forwards, then alternate B, F
  until the forwards run out, then the remaining backwards, then ``UPDATE``. (The same list as
  "d-i-1 warm-up, then F,B pairs": at most ``d-i`` micro-batches are in flight on stage i.)
* 2bw: the 1f1b pattern over all ``steps*m`` micro-batches at once (no flush), with ``UPDATE t``
  inserted after the last backward of batch ``t``. DESIGN.md's example, d=2, m=2::

      stage 0: F1 F2 B1 F3 B2 U1 F4 B3 F5 B4 U2 F6 ...      (F5 onwards on version 1)
      stage 1: F1 B1 F2 B2 U1 F3 B3 F4 B4 U2 F5 B5 ...
                                      ^ W(1) goes into the spare buffer while batch 2 runs on W(0)

When batch ``t`` has reductions (``width > 1``, tied stages, ``clip``), the stage issues
``DP_START t`` / ``TIED_START t`` right after its last backward of batch ``t`` (or, with ``clip``
alone, ``NORM_START t``: its local gradient is already final), and joins — ``DP_WAIT t``,
``TIED_WAIT t``, ``NORM_START t`` (after those waits: the norm is that of the reduced gradient),
``NORM_WAIT t``, ``UPDATE t`` — as late as the rules allow: before its first forward of batch
``t+2`` (2bw; flush: ``t+1``) or before issuing batch ``t+1``'s reductions, whichever comes
first. In 2bw every stage thus waits right before the forward of micro-batch ``(t+1)*m+1`` (the
last stage right after its last backward of batch ``t+1``), and a whole batch of compute overlaps
the reductions (PipeDream-2BW, arXiv 2006.09503, section 3.1: the update is delayed by one step).
With ``clip`` after other reductions, stage ``s > 0`` joins them and posts ``NORM_START t``
earlier, before ``F((t+1)*m+1-s)`` (a tied stage: not before ``F(t*m+d)``, so stage 0 has
started the tied all-reduce), keeping ``NORM_WAIT t`` and ``UPDATE t`` in place: the posts form a
cut that no p2p message crosses backwards, so the norm all-reduce cannot deadlock, and stage 0,
which waits for it first, finds the later stages' parts already posted.

Point-to-point posting semantics (what the runtime must do)
-----------------------------------------------------------
* ``SEND_ACT k`` directly follows ``F k``, ``SEND_GRAD k`` directly follows ``B k``: post an
  asynchronous send (``isend``) of the tensor just produced; never block on it in program
  order (wait on its handle only before the buffer is reused or at the end of the list).
* ``RECV_ACT k`` / ``RECV_GRAD k`` post an asynchronous receive (``irecv``) into a fresh buffer
  and return at once. ``F k`` waits on the ``RECV_ACT k`` handle before it runs, ``B k`` on the
  ``RECV_GRAD k`` handle. Receives are posted as early as the channel order allows (below), so
  the transfer overlaps the compute in between.
* Channels: the p2p operations between stages ``i`` and ``i+1`` form one FIFO channel. Its order
  is the order of stage ``i``'s computations (``F k`` gives act ``k``, ``B k`` expects grad ``k``),
  and both ranks post their halves in exactly that order, so the n-th p2p operation stage ``i``
  posts to ``i+1`` is the counterpart of the n-th one ``i+1`` posts to ``i``. Each receive sits
  right after the previous operation of its channel in the rank's list (or at the list start).
  The runtime must keep one in-order queue per peer (CUDA: one stream per peer holding both its
  sends and receives, which NCCL pairs one-for-one; never a send and a receive with the same
  peer on two unpaired streams), or batch each send with its adjacent receive.
* ``*_START t`` issues an asynchronous collective on the reduction queue; ``*_WAIT t`` blocks
  the compute order until it finished. All members of a group issue their collectives in the
  same order (the validator checks it).

:func:`validate` replays the lists under the strictest of these semantics (a receive or send
completes only when both halves are posted and everything before it in the channel finished;
F/B/WAIT block) and reports a deadlock with the blocked actions.

Ranks: with data-parallel width ``w``, rank ``= replica * d + stage`` (a pipeline replica owns
consecutive ranks, so its p2p stays on one node); every replica of a stage runs the same list.
See :func:`rank_of` and :func:`stage_and_replica`.

Stream lowering: :func:`lower_to_streams` maps one rank's list onto the streams ``compute``,
``p2p_prev``, ``p2p_next`` and ``reduce`` with the events each op waits for (see there).
"""

from __future__ import annotations

import enum
import re
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from typing import NamedTuple

from fxpipe.errors import ScheduleError

__all__ = [
    "SCHEDULES",
    "Action",
    "Kind",
    "StreamOp",
    "actions_by_rank",
    "batch_of",
    "compute_only",
    "format_actions",
    "generate",
    "lower_to_streams",
    "rank_of",
    "stage_and_replica",
    "validate",
    "version_of",
]

SCHEDULES = ("gpipe", "1f1b", "2bw")


class Kind(str, enum.Enum):
    """What an action does; the value is how it prints inside an action string."""

    F = "F"
    R = "R"  # recompute the forward of a micro-batch right before its backward
    B = "B"
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

    def __str__(self) -> str:  # "F", not "Kind.F"
        return self.value


COMPUTE = frozenset({Kind.F, Kind.R, Kind.B})
SENDS = frozenset({Kind.SEND_ACT, Kind.SEND_GRAD})
RECVS = frozenset({Kind.RECV_ACT, Kind.RECV_GRAD})
P2P = SENDS | RECVS
STARTS = frozenset({Kind.DP_START, Kind.TIED_START, Kind.NORM_START})
WAITS = frozenset({Kind.DP_WAIT, Kind.TIED_WAIT, Kind.NORM_WAIT})
PER_BATCH = STARTS | WAITS | {Kind.UPDATE}
_WAIT_OF = {Kind.DP_START: Kind.DP_WAIT, Kind.TIED_START: Kind.TIED_WAIT, Kind.NORM_START: Kind.NORM_WAIT}
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
    index: int  # micro-batch k (F, R, B, SEND_*, RECV_*) or batch t (UPDATE, reductions)
    version: int | None = None  # weight version used by F, R, B; None elsewhere

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

    @property
    def produces(self) -> int | None:
        """The weight version an UPDATE produces (``UPDATE t`` produces ``W(t)``)."""
        return self.index if self.kind is Kind.UPDATE else None

    def counterpart(self) -> Action:
        """The matching half of a SEND/RECV on the peer stage (``0SEND_ACT3`` -> ``1RECV_ACT3``)."""
        if self.kind not in P2P:
            raise ScheduleError(f"{self} is not a SEND/RECV: only p2p actions have a counterpart")
        kind, delta = _COUNTERPART[self.kind]
        return Action(self.stage + delta, kind, self.index)


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


def rank_of(stage: int, replica: int, stages: int) -> int:
    """Global rank of ``stage`` in data-parallel ``replica``: ``replica * stages + stage``."""
    return replica * stages + stage


def stage_and_replica(rank: int, stages: int) -> tuple[int, int]:
    """Inverse of :func:`rank_of`: ``(stage, replica)`` of a global rank."""
    return rank % stages, rank // stages


def actions_by_rank(by_stage: Mapping[int, list[Action]], width: int = 1) -> dict[int, list[Action]]:
    """Expand per-stage lists to every rank of ``width`` data-parallel replicas (same list per replica)."""
    d = len(by_stage)
    return {rank_of(s, r, d): list(by_stage[s]) for r in range(width) for s in range(d)}


def compute_only(actions: Iterable[Action]) -> str:
    """The F/R/B/UPDATE skeleton of a list as one string, e.g. ``"0F1v0 0F2v0 0B1v0 ..."``."""
    return " ".join(str(a) for a in actions if a.kind in COMPUTE or a.kind is Kind.UPDATE)


# ---------------------------------------------------------------------------------------------
# Generators


def _check_args(schedule: str, stages: int, microbatches: int, steps: int, width: int) -> None:
    if schedule not in SCHEDULES:
        raise ScheduleError(f"unknown schedule {schedule!r}: expected one of {', '.join(SCHEDULES)}")
    for name, value in (("stages", stages), ("microbatches", microbatches), ("steps", steps), ("width", width)):
        if not isinstance(value, int) or value < 1:
            raise ScheduleError(f"{name} must be an int >= 1, found {value!r}")
    if schedule == "2bw" and microbatches < stages:
        # With m < d stage 0's warm-up would run a forward of batch t+2 before batch t's last
        # backward, so no UPDATE position could give it W(t) (DESIGN.md: a batch is m >= d).
        raise ScheduleError(
            f"2bw needs at least as many micro-batches as stages (m >= d), found m={microbatches} < "
            f"d={stages}: pass microbatches={stages} or more, or use schedule='1f1b'"
        )


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


def _compute_order(schedule: str, stage: int, d: int, m: int, steps: int) -> list[tuple[Kind, int]]:
    if schedule == "2bw":
        # PipeDream-2BW (arXiv 2006.09503, fig. 3): 1F1B with d - i micro-batches in flight on
        # stage i, across step boundaries.
        return _one_f_one_b(1, steps * m, d - stage)
    order: list[tuple[Kind, int]] = []
    for t in range(1, steps + 1):
        first, last = (t - 1) * m + 1, t * m
        if schedule == "1f1b":
            order += _one_f_one_b(first, last, d - stage)
        else:  # gpipe: every forward, then every backward in the same order
            order += [(Kind.F, k) for k in range(first, last + 1)]
            order += [(Kind.B, k) for k in range(first, last + 1)]
    return order


def _tied_group(tied: bool | Sequence[int] | None, d: int) -> tuple[int, ...]:
    if not tied:
        return ()
    group = (0, d - 1) if tied is True else tuple(sorted(set(tied)))
    for s in group:
        if not 0 <= s < d:
            raise ScheduleError(f"tied stage {s} is out of range: expected stages in 0..{d - 1}, found {tied!r}")
    return group if len(group) >= 2 else ()  # a tied weight on one stage needs no cross-stage sum


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
) -> dict[int, list[Action]]:
    """Action lists ``{stage: [Action, ...]}`` of one pipeline replica for ``steps`` optimizer steps.

    ``schedule``: "gpipe", "1f1b" or "2bw"; ``stages`` = d; ``microbatches`` = m per step.
    ``width``: data-parallel width w (adds DP_START/DP_WAIT when w > 1; every replica runs the
    same lists, see :func:`actions_by_rank`). ``recompute``: one bool, or one per stage (adds
    ``R k`` before ``B k``). ``tied``: True for a tied weight on the first and last stage, or the
    stages holding copies (adds TIED_START/TIED_WAIT there). ``clip``: global gradient-norm
    clipping (adds NORM_START/NORM_WAIT on every stage). The orders are drawn in the module
    docstring; ``validate`` accepts every list this returns.

    >>> [str(a) for a in generate("2bw", 2, 2, 2)[1] if a.kind in COMPUTE | {Kind.UPDATE}]
    ['1F1v0', '1B1v0', '1F2v0', '1B2v0', '1UPDATE1', '1F3v0', '1B3v0', '1F4v0', '1B4v0', '1UPDATE2']
    """
    _check_args(schedule, stages, microbatches, steps, width)
    d, m = stages, microbatches
    if recompute is None or isinstance(recompute, bool):
        recompute = [bool(recompute)] * d
    recompute = list(recompute)
    if len(recompute) != d:
        raise ScheduleError(f"recompute needs one bool per stage: expected {d}, found {len(recompute)}")
    group = _tied_group(tied, d)
    cores = {
        s: _core_list(schedule, s, d, m, steps, recompute[s], width > 1, s in group, clip) for s in range(d)
    }
    return _with_p2p(cores, d)


def _core_list(
    schedule: str, stage: int, d: int, m: int, steps: int, recompute: bool, dp: bool, tied: bool, clip: bool
) -> list[Action]:
    """Compute, reductions and UPDATEs of one stage, without SEND/RECV."""
    out: list[Action] = []
    order = _compute_order(schedule, stage, d, m, steps)
    last_b = {batch_of(k, m): pos for pos, (kind, k) in enumerate(order) if kind is Kind.B}
    pending: list[int] = []  # batches whose reductions started but whose UPDATE is still due
    joined: set[int] = set()  # pending batches whose gradient reductions were joined (norm posted)

    def join(t: int) -> None:
        if t in joined:
            return
        joined.add(t)
        if dp:
            out.append(Action(stage, Kind.DP_WAIT, t))
        if tied:
            out.append(Action(stage, Kind.TIED_WAIT, t))
        if clip and (dp or tied):
            # The norm is that of the summed, replica-averaged gradient: start it after both waits.
            out.append(Action(stage, Kind.NORM_START, t))

    def finish(t: int) -> None:
        join(t)
        if clip:
            out.append(Action(stage, Kind.NORM_WAIT, t))
        out.append(Action(stage, Kind.UPDATE, t))

    def norm_cut(t: int) -> int:
        """The micro-batch before whose forward this stage joins batch t's reductions and posts
        its norm (2bw with clipping after other reductions). Stage 0 waits for the norm right
        there (before batch t+2's first forward, F((t+1)m+1)); stage s posts it s forwards
        earlier, which in 1F1B order is the same consistent cut (no p2p message crosses it
        backwards) but reached about s backward-times sooner, so stage 0 finds every stage's part
        posted instead of waiting for the last stage's final forward and backward of the batch.
        A tied weight's all-reduce joined there needs stage 0's TIED_START t, posted after its
        B(tm), which precedes its F(tm+d): never earlier than that."""
        cut = (t + 1) * m + 1 - stage
        return max(cut, t * m + d) if tied else cut

    early_norm = schedule == "2bw" and clip and (dp or tied) and stage > 0
    for pos, (kind, k) in enumerate(order):
        t = batch_of(k, m)
        if early_norm and kind is Kind.F:
            for p in pending:
                if k >= norm_cut(p):
                    join(p)
        # Join point of pending reductions: as late as the version rule allows, i.e. before a
        # forward that needs W(t) (flush: batch t+1; 2bw: batch t+2, the window of arXiv
        # 2006.09503 section 3.1), so 2bw overlaps the reductions with a batch of compute.
        need = t - (1 if schedule == "2bw" else 0)
        while pending and kind is Kind.F and pending[0] < need:
            finish(pending.pop(0))
        v = version_of(schedule, k, m)
        if kind is Kind.B and recompute:
            out.append(Action(stage, Kind.R, k, v))
        out.append(Action(stage, kind, k, v))
        if kind is Kind.B and last_b[t] == pos:
            while pending:
                # Batch t-1's reduction must end before batch t's starts: at most two gradient
                # buffers (the accumulator and the one being reduced).
                finish(pending.pop(0))
            if dp or tied or clip:
                # The norm is a barrier over all stages, joined at a consistent cut (norm_cut).
                if dp:
                    out.append(Action(stage, Kind.DP_START, t))
                if tied:
                    out.append(Action(stage, Kind.TIED_START, t))
                if clip and not (dp or tied):
                    out.append(Action(stage, Kind.NORM_START, t))  # the local gradient is final
                pending.append(t)
            else:
                finish(t)  # nothing to overlap: update at once, as in DESIGN.md's example
    while pending:
        finish(pending.pop(0))
    return out


def _with_p2p(cores: dict[int, list[Action]], d: int) -> dict[int, list[Action]]:
    """Insert SEND after each F/B and each RECV right after its channel predecessor (module doc)."""
    lists: dict[int, list[Action]] = {}
    for s, core in cores.items():
        lst: list[Action] = []
        for a in core:
            lst.append(a)
            if a.kind is Kind.F and s < d - 1:
                lst.append(Action(s, Kind.SEND_ACT, a.index))
            elif a.kind is Kind.B and s > 0:
                lst.append(Action(s, Kind.SEND_GRAD, a.index))
        lists[s] = lst
    # Channel (i, i+1) follows stage i's compute order. Receives are then placed, per channel, right
    # after the previous channel operation of the same rank: as early as FIFO matching allows.
    for i in range(d - 1):
        channel = [
            (Kind.SEND_ACT, a.index) if a.kind is Kind.F else (Kind.RECV_GRAD, a.index)
            for a in cores[i]
            if a.kind in (Kind.F, Kind.B)
        ]
        for s, mine in ((i, channel), (i + 1, [(_COUNTERPART[k][0], idx) for k, idx in channel])):
            lists[s] = _place_receives(lists[s], s, mine)
    return lists


def _place_receives(lst: list[Action], stage: int, channel: list[tuple[Kind, int]]) -> list[Action]:
    after: dict[Action | None, list[Action]] = defaultdict(list)
    prev: Action | None = None
    for kind, idx in channel:
        a = Action(stage, kind, idx)
        if kind in RECVS:
            after[prev].append(a)
        prev = a
    out: list[Action] = []

    def emit_after(anchor: Action | None) -> None:
        # A receive anchored on another receive follows it directly (anchors chain in order).
        for r in after.get(anchor, ()):
            out.append(r)
            emit_after(r)

    emit_after(None)
    for a in lst:
        out.append(a)
        emit_after(a)
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
    def __init__(self, by_stage: Mapping[int, Sequence[Action]], width: int) -> None:
        self.by_stage = by_stage
        self.d = len(by_stage)
        self.width = width

    def where(self, stage: int) -> str:
        ranks = [rank_of(stage, r, self.d) for r in range(self.width)]
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
) -> None:
    """Raise :class:`ScheduleError` unless the lists obey every invariant of ``schedule``.

    Checks, per stage: the stage field, one F and one B per micro-batch with F before B (and R
    between them, only where recompute is on); each F/R/B on the version of :func:`version_of`
    (so the same on every stage); SEND after the F/B that produced its tensor and each RECV
    before its consumer; at most ``d - i`` micro-batches in flight on stage i (1f1b, 2bw) or
    ``m`` (gpipe); at most 2 weight versions alive (2bw) or 1 (flush); one UPDATE per batch in
    its window (after the last B of batch t, before the first B of batch t+1 and the first F of
    batch t+2 for 2bw, t+1 otherwise); each reduction started after the last B of batch t and
    waited for before UPDATE t; the reductions that ``width``/``tied``/``clip`` require (when
    those are given). Then it replays all stages together with blocking semantics (module
    docstring) and reports mismatched p2p orders and deadlocks. ``steps`` defaults to what the
    lists hold. The message names the action, its stage and ranks, and shows the grid around it.
    """
    _check_args(schedule, stages, microbatches, steps or 1, width)
    if sorted(actions_by_stage) != list(range(stages)):
        raise ScheduleError(
            f"expected one action list per stage 0..{stages - 1}, found keys {sorted(actions_by_stage)}: "
            f"pass generate(...)'s dict (one pipeline replica)"
        )
    ck = _Checker(actions_by_stage, width)
    m, d = microbatches, stages
    if steps is None:
        ks = [a.index for lst in actions_by_stage.values() for a in lst if a.kind is Kind.F]
        steps = max(batch_of(max(ks), m), 1) if ks else 1
    total = steps * m
    if isinstance(recompute, bool):
        recompute = [recompute] * d
    group = _tied_group(tied, d) if tied is not None else None
    for s in range(d):
        _check_stage(ck, s, schedule, d, m, steps, total, recompute, group, clip, width)
    _check_collective_order(ck, d)
    _replay(ck)


def _check_stage(ck, s, schedule, d, m, steps, total, recompute, group, clip, width) -> None:  # noqa: C901
    lst = ck.by_stage[s]
    first_f: dict[int, int] = {}
    first_b: dict[int, int] = {}
    last_b: dict[int, int] = {}
    done: dict[tuple[Kind, int], int] = {}
    in_flight: dict[int, int] = {}  # micro-batch -> version, F done and B not yet
    newest = 0
    started: dict[tuple[Kind, int], int] = {}
    limit = m if schedule == "gpipe" else d - s
    max_versions = 2 if schedule == "2bw" else 1

    def check_versions(alive: set[int], where: str) -> None:
        if len(alive) > max_versions:
            ck.fail(
                s, pos, f"{len(alive)} weight versions alive{where} ({', '.join(f'W({v})' for v in sorted(alive))}), "
                f"expected at most {max_versions} for {schedule}",
                "Run the UPDATE after the backwards of the micro-batches that use the oldest version",
            )

    for pos, a in enumerate(lst):
        if not isinstance(a, Action):
            ck.fail(s, pos, f"expected an Action, found {type(a).__name__} {a!r}", "Build lists with Action(...)")
        if a.stage != s:
            ck.fail(s, pos, f"the action names stage {a.stage} but sits in stage {s}'s list", "Move it to its stage")
        if (a.kind, a.index) in done:
            ck.fail(s, pos, f"{a.kind}{a.index} appears twice (first at position {done[a.kind, a.index]})", "Drop one")
        done[a.kind, a.index] = pos
        k, t = a.index, a.index
        if a.kind in COMPUTE or a.kind in P2P:
            if not 1 <= k <= total:
                ck.fail(s, pos, f"micro-batch {k} is outside 1..{total} (steps={steps}, m={m})", "Fix the index")
            t = batch_of(k, m)
        if a.kind in COMPUTE:
            want = version_of(schedule, k, m)
            if a.version != want:
                rule = "max(floor((k-1)/m) - 1, 0)" if schedule == "2bw" else "t - 1 for batch t"
                ck.fail(
                    s, pos, f"micro-batch {k} uses version {a.version}, expected {want} ({schedule}: {rule}, m={m})",
                    "Every stage must run a micro-batch's F and B on the same version",
                )
            if want > newest or want < newest - 1:
                ck.fail(
                    s, pos, f"version {want} is not alive here (newest produced: W({newest}))",
                    f"Run UPDATE{want} before the first forward that uses W({want})",
                )
        if a.kind is Kind.F:
            first_f.setdefault(t, pos)
            if s > 0 and (Kind.RECV_ACT, k) not in done:
                ck.fail(s, pos, f"no RECV_ACT{k} posted before the forward that consumes it", f"Insert {s}RECV_ACT{k} before it")
            in_flight[k] = a.version
            if len(in_flight) > limit:
                ck.fail(
                    s, pos, f"{len(in_flight)} micro-batches of activations in flight, expected at most {limit} "
                    f"({schedule} on stage {s} of {d})", "Run a backward before this forward",
                )
        elif a.kind is Kind.R:
            if (Kind.F, k) not in done:
                ck.fail(s, pos, f"recompute of micro-batch {k} before its forward", f"Move it after {s}F{k}")
            if recompute is not None and not recompute[s]:
                ck.fail(s, pos, f"stage {s} recomputes although recompute[{s}] is False", "Drop the R action")
        elif a.kind is Kind.B:
            if (Kind.F, k) not in done:
                ck.fail(s, pos, f"backward of micro-batch {k} before its forward", f"Move {s}F{k} before it")
            if recompute is not None and recompute[s] and (Kind.R, k) not in done:
                ck.fail(s, pos, f"recompute is on for stage {s} but {s}R{k} does not precede this backward", f"Insert {s}R{k}")
            if s < d - 1 and (Kind.RECV_GRAD, k) not in done:
                ck.fail(s, pos, f"no RECV_GRAD{k} posted before the backward that consumes it", f"Insert {s}RECV_GRAD{k} before it")
            first_b.setdefault(t, pos)
            last_b[t] = pos
            in_flight.pop(k, None)
            handed_off = any((kind, t - 1) in started for kind in STARTS)
            if t > 1 and (Kind.UPDATE, t - 1) not in done and not handed_off:
                ck.fail(
                    s, pos, f"first backward of batch {t} before UPDATE{t - 1}",
                    f"Run UPDATE{t - 1} earlier: without a reduction holding batch {t - 1}'s gradient "
                    f"the stage has one gradient accumulator",
                )
        elif a.kind in SENDS:
            source = Kind.F if a.kind is Kind.SEND_ACT else Kind.B
            if (source, k) not in done:
                ck.fail(s, pos, f"sends micro-batch {k} before {s}{source}{k} produced it", f"Move it after {s}{source}{k}")
        if a.kind in P2P and not 0 <= a.peer < d:
            ck.fail(s, pos, f"peer stage {a.peer} does not exist (d={d})", "Drop it: first/last stages have no such peer")
        if a.kind in STARTS:
            started[a.kind, t] = pos
            if t > 1 and (Kind.UPDATE, t - 1) not in done:
                ck.fail(
                    s, pos, f"reduction of batch {t} issued while UPDATE{t - 1} is still due",
                    f"Run UPDATE{t - 1} first: at most two gradient buffers (accumulator and one in reduction)",
                )
            if t not in last_b or any(
                b.kind is Kind.B and batch_of(b.index, m) == t for b in lst[pos + 1:]
            ):
                ck.fail(s, pos, f"reduction of batch {t} issued before the stage's last backward of batch {t}", "Move it after that backward")
            if a.kind is Kind.NORM_START:
                for w in (Kind.DP_WAIT, Kind.TIED_WAIT):
                    if (_START_OF[w], t) in started and (w, t) not in done:
                        ck.fail(s, pos, f"gradient norm started before {w}{t}", f"Wait {w}{t} first: the norm is of the reduced gradient")
        if a.kind in WAITS and (_START_OF[a.kind], t) not in started:
            ck.fail(s, pos, f"waits for {_START_OF[a.kind]}{t}, which was not issued before", f"Insert {s}{_START_OF[a.kind]}{t} after the last backward of batch {t}")
        if a.kind is Kind.UPDATE:
            # the new version counts before the update's other checks report (their order matters)
            check_versions({t} | set(in_flight.values()), " after it")
            if not 1 <= t <= steps:
                ck.fail(s, pos, f"batch {t} is outside 1..{steps}", "Fix the index")
            if t != newest + 1:
                ck.fail(s, pos, f"produces W({t}) but the newest version is W({newest})", f"Updates run in order: UPDATE{newest + 1} next")
            if t not in last_b or any(b.kind is Kind.B and batch_of(b.index, m) == t for b in lst[pos + 1:]):
                ck.fail(s, pos, f"UPDATE{t} before the stage's last backward of batch {t}", "Move it after that backward")
            for (kind, tb), p in started.items():
                if tb == t and (_WAIT_OF[kind], t) not in done:
                    ck.fail(s, pos, f"{kind}{t} (position {p}) is not waited for before UPDATE{t}", f"Insert {s}{_WAIT_OF[kind]}{t} before the update")
            newest = t
        check_versions({newest} | set(in_flight.values()), "")
    # Windows and completeness once the whole list is known.
    ahead = 2 if schedule == "2bw" else 1
    for t in range(1, steps + 1):
        if (Kind.UPDATE, t) not in done:
            ck.fail(s, len(lst) - 1, f"no UPDATE{t}: every batch's gradients must be applied", f"Insert {s}UPDATE{t} after the last backward of batch {t}")
        upd = done[Kind.UPDATE, t]
        if t + ahead in first_f and first_f[t + ahead] < upd:
            ck.fail(
                s, first_f[t + ahead], f"forward of batch {t + ahead} before UPDATE{t} (position {upd}) produced the version it needs",
                f"Move UPDATE{t} before it",
            )
        for kind in STARTS:
            wait = _WAIT_OF[kind]
            if (kind, t) in done and (wait, t) not in done:
                ck.fail(s, done[kind, t], f"{kind}{t} is never waited for", f"Insert {s}{wait}{t} before UPDATE{t}")
        required = []
        if width > 1:
            required.append(Kind.DP_START)
        if group is not None and s in group:
            required.append(Kind.TIED_START)
        if clip:
            required.append(Kind.NORM_START)
        for kind in required:
            if (kind, t) not in done:
                ck.fail(s, upd, f"missing {kind}{t} (width={width}, tied={group}, clip={clip})", f"Insert {s}{kind}{t} after the last backward of batch {t}")
    for k in range(1, steps * m + 1):
        for kind in (Kind.F, Kind.B):
            if (kind, k) not in done:
                ck.fail(s, len(lst) - 1, f"no {kind}{k}: expected one F and one B for each of micro-batches 1..{steps * m}", f"Insert {s}{kind}{k}")
        for kind, present in ((Kind.SEND_ACT, s < d - 1), (Kind.RECV_ACT, s > 0), (Kind.SEND_GRAD, s > 0), (Kind.RECV_GRAD, s < d - 1)):
            if present and (kind, k) not in done:
                ck.fail(s, len(lst) - 1, f"no {kind}{k} on stage {s}", f"Insert {s}{kind}{k} (see the posting rules in fxpipe.schedule)")


def _groups(by_stage: Mapping[int, Sequence[Action]]) -> dict[Kind, list[int]]:
    """Which stages take part in each cross-stage collective (DP stays inside one stage)."""
    members: dict[Kind, list[int]] = {Kind.TIED_START: [], Kind.NORM_START: []}
    for s, lst in by_stage.items():
        for kind in members:
            if any(a.kind is kind for a in lst):
                members[kind].append(s)
    return members


def _check_collective_order(ck: _Checker, d: int) -> None:
    seqs: dict[int, list[tuple[Kind, int, int]]] = {
        s: [(a.kind, a.index, p) for p, a in enumerate(ck.by_stage[s]) if a.kind in (Kind.TIED_START, Kind.NORM_START)]
        for s in range(d)
    }
    for kind, members in _groups(ck.by_stage).items():
        ref = None
        for s in members:
            batches = [(t, p) for k, t, p in seqs[s] if k is kind]
            if ref is None:
                ref = (s, batches)
            elif [t for t, _ in batches] != [t for t, _ in ref[1]]:
                pos = next((p for (t, p), (u, _) in zip(batches, ref[1]) if t != u), batches[-1][1] if batches else 0)
                ck.fail(s, pos, f"{kind} batches {[t for t, _ in batches]} differ from stage {ref[0]}'s {[t for t, _ in ref[1]]}", "Every member of a collective group must issue the same collectives in the same order")


def _replay(ck: _Checker) -> None:
    """Run all stages together with blocking semantics; raise on mismatch or deadlock."""
    d = ck.d
    lists = ck.by_stage
    pc = [0] * d
    posted: dict[tuple[int, int], list[Action]] = defaultdict(list)  # (me, peer) -> my p2p posts
    matched: dict[tuple[int, int], int] = defaultdict(int)  # (low, high) -> completed count
    complete: set[Action] = set()
    coll_posted: dict[Kind, dict[int, list[int]]] = defaultdict(lambda: defaultdict(list))
    members = _groups(lists)

    def pump(lo: int, hi: int) -> None:
        a_side, b_side = posted[lo, hi], posted[hi, lo]
        n = matched[lo, hi]
        while n < len(a_side) and n < len(b_side):
            a, b = a_side[n], b_side[n]
            if a.counterpart() != b:
                pos = lists[lo].index(a)
                ck.fail(
                    lo, pos, f"p2p order mismatch with stage {hi}: this is operation {n + 1} between the two "
                    f"stages, but stage {hi}'s operation {n + 1} is {b}",
                    f"Post the p2p operations of a stage pair in the same order on both ranks (here: {a.counterpart()})",
                )
            complete.update((a, b))
            n += 1
        matched[lo, hi] = n

    progress = True
    while progress:
        progress = False
        for s in range(d):
            while pc[s] < len(lists[s]):
                a = lists[s][pc[s]]
                need: Action | None = None
                if a.kind is Kind.F and s > 0:
                    need = Action(s, Kind.RECV_ACT, a.index)
                elif a.kind is Kind.B and s < d - 1:
                    need = Action(s, Kind.RECV_GRAD, a.index)
                elif a.kind in WAITS:
                    need = Action(s, _START_OF[a.kind], a.index)
                if need is not None and need not in complete:
                    break
                if a.kind in P2P:
                    posted[s, a.peer].append(a)
                    pump(min(s, a.peer), max(s, a.peer))
                elif a.kind is Kind.DP_START:
                    complete.add(a)  # replicas run identical lists: the all-reduce meets itself
                elif a.kind in STARTS:
                    seq = coll_posted[a.kind]
                    seq[s].append(a.index)
                    n = len(seq[s])
                    if all(len(seq[g]) >= n for g in members[a.kind]):
                        complete.update(Action(g, a.kind, a.index) for g in members[a.kind])
                pc[s] += 1
                progress = True
    stuck = [s for s in range(d) if pc[s] < len(lists[s])]
    if stuck:
        blocked = "; ".join(f"stage {s} at {lists[s][pc[s]]} (position {pc[s]})" for s in stuck)
        s = stuck[0]
        ck.fail(
            s, pc[s], f"deadlock: every unfinished stage is blocked ({blocked})",
            "A receive's matching send is never reached: post sends right after their F/B and receives before their consumer, in channel order",
        )
    for (lo, hi), n in list(matched.items()):
        for me, peer in ((lo, hi), (hi, lo)):
            if len(posted[me, peer]) > n:
                a = posted[me, peer][n]
                ck.fail(me, lists[me].index(a), f"never matched: stage {peer} posts no {a.counterpart()}", f"Insert {a.counterpart()} on stage {peer}")


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


def lower_to_streams(actions: Sequence[Action]) -> list[StreamOp]:
    """Place one rank's list on streams, with the events each op must wait for.

    * ``compute`` (in list order): F, R, B, UPDATE and the ``*_WAIT`` joins. ``F k`` waits only
      for ``RECV_ACT k`` (when the stage receives), ``B k`` only for ``RECV_GRAD k``, ``X_WAIT t``
      only for ``X_START t``. Compute never waits for a send: the runtime keeps the sent tensor
      alive until the send finishes (``Tensor.record_stream`` on CUDA, the work handle on CPU).
    * ``p2p_prev`` / ``p2p_next``: every SEND and RECV with the previous / next stage, both
      directions on one stream in list order, so each matches the peer's op one-for-one (no
      unpaired concurrent NCCL send and receive). ``SEND_ACT k`` waits only for ``F k``,
      ``SEND_GRAD k`` only for ``B k``; a RECV waits for nothing: it receives into a fresh buffer
      from the caching allocator, so no compute has to finish first.
    * ``reduce``: ``DP_START``/``TIED_START`` wait for the last B before them in the list (the
      batch's gradients are then complete); ``NORM_START`` also waits for ``DP_START``/
      ``TIED_START`` of its batch, whose completion the reduced gradient needs.
    """
    key = {(a.kind, a.index): str(a) for a in actions}
    ops: list[StreamOp] = []
    last_b: str | None = None
    for a in actions:
        waits: list[str] = []
        if a.kind in COMPUTE or a.kind is Kind.UPDATE or a.kind in WAITS:
            stream = "compute"
            if a.kind is Kind.F and (Kind.RECV_ACT, a.index) in key:
                waits.append(key[Kind.RECV_ACT, a.index])
            elif a.kind is Kind.B and (Kind.RECV_GRAD, a.index) in key:
                waits.append(key[Kind.RECV_GRAD, a.index])
            elif a.kind in WAITS:
                waits.append(key.get((_START_OF[a.kind], a.index), str(Action(a.stage, _START_OF[a.kind], a.index))))
            if a.kind is Kind.B:
                last_b = str(a)
        elif a.kind in P2P:
            stream = "p2p_next" if a.peer > a.stage else "p2p_prev"
            if a.kind in SENDS:
                source = Kind.F if a.kind is Kind.SEND_ACT else Kind.B
                if (source, a.index) not in key:
                    raise ScheduleError(f"{a} sends a tensor that no {a.stage}{source}{a.index} in this list produces: put the send after it")
                waits.append(key[source, a.index])
        else:
            stream = "reduce"
            if last_b is not None:
                waits.append(last_b)
            if a.kind is Kind.NORM_START:
                waits += [key[k, a.index] for k in (Kind.DP_START, Kind.TIED_START) if (k, a.index) in key]
        ops.append(StreamOp(a, stream, tuple(waits), str(a)))
    return ops
