"""deps: the one dependency model of an action list, shared by the validator, the simulator and
the single-process driver.

Two things decide when an action of :mod:`fxpipe.schedule` may run or finish:

* **Local waits** (:func:`fxpipe.schedule.waits_for`, beside the kind table it reads): ``F k``
  and ``EVAL k`` consume ``RECV_ACT k``, ``B k`` and ``I k`` consume ``RECV_GRAD k``, ``X_WAIT t``
  joins ``X_START t``. Nothing else in a rank's list waits: posts return at once, compute runs
  in list order.
* **Communication** (:class:`Rendezvous`): NCCL's matching rules, which fxpipe adopts as its
  contract (docs/design.md, "The NCCL contract"):

  (a) between two ranks, both directions form ONE ordered queue: the n-th operation rank a posts
      towards b is matched with the n-th operation b posts towards a, which must be its
      counterpart (a send against a receive of the same tensors);
  (b) every rank's posts, collectives included, fit one global order. The engine enforces this
      by completing each rank's posts strictly in post order, an operation only once every
      participant has it at the head of its own queue: a cycle in the posting order is then a
      deadlock here, as it can be on GPUs.

  gloo matches per direction and tag and runs collectives on their own threads, so a gloo run
  cannot show a violation; this engine does, in one process and without tensors.

:func:`fxpipe.schedule.validate` runs it with labels only (zero cost), :class:`fxpipe.comm.LocalHub`
with real tensors (the single-process driver), and :func:`fxpipe.simulate.simulate` with times
(each of a rank's streams a lane of its own). What an action waits for comes from one table,
``fxpipe.schedule.SPEC``: the validator and the single-process driver (``StageWorker.ready``)
read it through :func:`fxpipe.schedule.waits_for`, the simulator through
:func:`fxpipe.schedule.lower_to_streams`.
"""

from __future__ import annotations

from collections import defaultdict, deque
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from fxpipe.errors import ScheduleError

__all__ = ["CommOp", "Rendezvous", "CommOrderError", "interleave"]


def interleave(lists: Mapping[Any, Sequence[Any]], ready: Callable[[Any, Any], bool],
               run: Callable[[Any, int], None]) -> dict[Any, int]:
    """Run several ranks' lists in one process, each in its own order: repeatedly, for each list,
    ``run(key, position)`` its head while ``ready(key, head)``, until no list can go on. Returns
    the position each unfinished list stopped at (empty when every list ran to its end): a deadlock
    under ``ready``'s dependency model. The validator's replay and the single-process driver both
    run their lists through this; only the simulator, which advances a clock, has its own loop."""
    pos = dict.fromkeys(lists, 0)
    progress = True
    while progress:
        progress = False
        for key, lst in lists.items():
            while pos[key] < len(lst) and ready(key, lst[pos[key]]):
                run(key, pos[key])
                pos[key] += 1
                progress = True
    return {key: p for key, p in pos.items() if p < len(lists[key])}


class CommOrderError(ScheduleError):
    """Two ranks' posts break the NCCL matching contract (names both ranks and both ops)."""


@dataclass(eq=False)
class CommOp:
    """One posted communication operation of one rank.

    ``kind``: "send", "recv" or "collective"; ``peer`` for p2p, ``group`` for collectives.
    ``signature``: what must agree with the matched operation(s) (tensor shapes and dtypes, or
    for the validator the action's kind and index); ``label`` names it in errors (an action).
    ``payload``: whatever the owner needs at completion (tensors in :class:`fxpipe.comm.LocalHub`).
    """

    rank: int
    kind: str
    label: str
    signature: Hashable = None
    peer: int | None = None
    group: str | None = None
    payload: Any = None
    partners: list["CommOp"] = field(default_factory=list)
    member: Hashable = None  # which of a rank's members posts a collective (its stage), where it holds several
    gathered: list["CommOp"] = field(default_factory=list)  # a rank's other parts of this collective
    held: bool = False  # a part the rank did not join with: in no queue, it completes with the one it did
    done: bool = False

    def __str__(self) -> str:
        where = f"to rank {self.peer}" if self.kind == "send" else (
            f"from rank {self.peer}" if self.kind == "recv" else f"on group {self.group!r}")
        return f"rank {self.rank}: {self.kind} {where} ({self.label})"


class Rendezvous:
    """Matches and completes posts under rules (a) and (b) (module docstring).

    ``groups``: collective group name -> member ranks. A rank listed ``n`` times holds ``n``
    members (the stages of an interleaved lane): each of them posts its part of each collective
    (``CommOp.member`` says which), and the rank joins once, when the last of its members posted
    its part (the others enter no queue; they complete with it). ``on_complete(ops)`` is called once per completed operation with every
    participant's :class:`CommOp` (the two halves of a p2p transfer, or every part of a
    collective, in rank order). Raises :class:`CommOrderError` the
    moment a post cannot be matched with its counterpart.

    ``lane(op)``: the queue an operation completes in order within; by default its rank, which is
    rule (b). The simulator times each of a rank's streams (``p2p_prev``, ``p2p_next``,
    ``reduce``) on its own and passes ``(rank, stream)``: the matching (rule (a), collective
    membership and signatures) is the same code either way.
    """

    def __init__(self, groups: Mapping[str, Sequence[int]], on_complete: Callable[[list[CommOp]], None] | None = None,
                 lane: Callable[[CommOp], Hashable] | None = None):
        self.groups = {name: sorted(ranks) for name, ranks in groups.items()}
        self.on_complete = on_complete
        self.lane = lane or (lambda op: op.rank)
        self.queue: dict[Hashable, deque[CommOp]] = defaultdict(deque)  # lane -> posted, not complete
        self._unmatched: dict[tuple, deque[CommOp]] = defaultdict(deque)  # (rank, peer|group) -> posts
        self._parts: dict[tuple, dict[Hashable, deque[CommOp]]] = defaultdict(dict)  # (rank, group) -> member -> parts

    def post(self, op: CommOp) -> CommOp:
        if op.kind in ("send", "recv"):
            if op.peer == op.rank or op.peer is None:
                raise CommOrderError(f"{op}: a point-to-point operation needs another rank as its peer")
            self.queue[self.lane(op)].append(op)
            mine, theirs = self._unmatched[op.rank, op.peer], self._unmatched[op.peer, op.rank]
            mine.append(op)
            if theirs:
                self._pair(mine.popleft(), theirs.popleft())
        else:
            members = self.groups.get(op.group)
            if members is None or op.rank not in members:
                raise CommOrderError(f"{op}: rank {op.rank} is not a member of group {op.group!r} {members}")
            if (count := members.count(op.rank)) > 1:
                parts = self._parts[op.rank, op.group]
                parts.setdefault(op.member, deque()).append(op)
                op.held = True
                if len(parts) > count:
                    raise CommOrderError(f"{op}: rank {op.rank} holds {count} members of group {op.group!r}, but "
                                         f"parts came from {len(parts)}: {sorted(map(str, parts))}")
                if len(parts) < count or not all(parts.values()):
                    return op  # the rank joins when its last member posts
                heads = [q.popleft() for q in parts.values()]
                op.held, op.gathered = False, [h for h in heads if h is not op]
            self.queue[self.lane(op)].append(op)
            self._unmatched[op.rank, op.group].append(op)
            waiting = [self._unmatched[r, op.group] for r in sorted(set(members))]
            if all(waiting):
                ops = [q.popleft() for q in waiting]
                for o in ops[1:] + [g for o in ops for g in o.gathered]:
                    if o.signature != ops[0].signature:
                        raise CommOrderError(
                            f"collective mismatch on group {op.group!r}: {ops[0]} is matched with {o}, "
                            f"which differs ({ops[0].signature} vs {o.signature}). Every member must post the "
                            f"same collectives in the same order"
                        )
                for o in ops:
                    o.partners = ops
                    for g in o.gathered:
                        g.partners = ops
        self.pump()
        return op

    def _pair(self, a: CommOp, b: CommOp) -> None:
        if {a.kind, b.kind} != {"send", "recv"} or a.signature != b.signature:
            n = "the same position"
            raise CommOrderError(
                f"point-to-point order mismatch between ranks {a.rank} and {b.rank}: {a} is matched with {b} "
                f"(both are at {n} of the queue between the two ranks, which NCCL pairs in post order; "
                f"expected a {'receive' if a.kind == 'send' else 'send'} of {a.signature}, found a {b.kind} of "
                f"{b.signature}). Post each pair's operations in the same order on both ranks"
            )
        ops = sorted((a, b), key=lambda o: o.rank)
        a.partners = b.partners = ops

    def pump(self) -> None:
        """Complete every operation whose participants all have it at the head of their queue."""
        progress = True
        while progress:
            progress = False
            for key in list(self.queue):
                q = self.queue[key]
                if not q or not q[0].partners:
                    continue
                ops = q[0].partners
                if all(self.queue[self.lane(o)] and self.queue[self.lane(o)][0] is o for o in ops):
                    for o in ops:
                        self.queue[self.lane(o)].popleft()
                        o.done = True
                        for g in o.gathered:
                            g.done = True
                    if self.on_complete is not None:
                        self.on_complete(sorted(ops + [g for o in ops for g in o.gathered],
                                                key=lambda o: (o.rank, str(o.member))))
                    progress = True
            for key in [k for k, q in self.queue.items() if not q]:
                del self.queue[key]

    def blocked(self) -> list[str]:
        """One line per lane (rank) with posts still incomplete: the head op and what it waits for."""
        lines = []
        for key in sorted(self.queue, key=str):
            head = self.queue[key][0]
            if not head.partners:
                why = "no matching post yet"
            else:
                late = [o for o in head.partners if self.queue[self.lane(o)][0] is not o]
                why = "; ".join(f"rank {o.rank} first completes {self.queue[self.lane(o)][0].label}" for o in late)
            lines.append(f"{head} waits: {why}")
        return lines

    def __len__(self) -> int:
        """Posts not yet completed, summed over ranks (bounded-state tests read it)."""
        return (sum(len(q) for q in self.queue.values()) + sum(len(q) for q in self._unmatched.values())
                + sum(len(q) for p in self._parts.values() for q in p.values()))
