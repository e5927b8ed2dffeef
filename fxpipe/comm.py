"""comm: point-to-point and collective communication behind one small interface.

The runtime talks to its peers only through a :class:`Comm`: asynchronous ``isend``/``irecv``
between ranks and an asynchronous SUM ``all_reduce`` over a named group of ranks, each returning
a :class:`Handle`. Two implementations share every line of the runtime:

* :class:`DistComm` — ``torch.distributed`` (gloo on CPU, NCCL on CUDA). One process per rank;
  ``Handle.ready()`` is always true because ``wait()`` blocks on the real work object.
* :class:`LocalHub` / :class:`LocalComm` — every rank in ONE process (the debugging mode). A send
  completes at once into a mailbox; a receive or reduction is ready once its peers have posted.
  The driver interleaves the ranks, running each until its next action is not ready, so the
  single-process mode executes the very same action lists, in the same per-rank order, and
  computes the same numbers.

Groups are named by the caller (``"dp:1"``, ``"tied:0"``, ``"all"``) and created once, in the
same order on every rank, before training starts.
"""

from __future__ import annotations

from collections import defaultdict, deque
from typing import Sequence

import torch
import torch.distributed as dist

__all__ = ["Handle", "Comm", "DistComm", "LocalHub", "LocalComm"]


class Handle:
    """An asynchronous operation: ``ready()`` says whether ``wait()`` would return at once."""

    def ready(self) -> bool:
        return True

    def wait(self) -> None:
        return None


class _DistHandle(Handle):
    def __init__(self, works):
        self.works = [w for w in works if w is not None]

    def ready(self) -> bool:
        return True  # wait() blocks; one process per rank, so blocking is the right thing

    def wait(self) -> None:
        for w in self.works:
            w.wait()
        self.works = []


class Comm:
    rank: int
    world_size: int

    def isend(self, tensors: Sequence[torch.Tensor], peer: int) -> Handle:
        raise NotImplementedError

    def irecv(self, tensors: Sequence[torch.Tensor], peer: int) -> Handle:
        raise NotImplementedError

    def all_reduce(self, tensor: torch.Tensor, group: str) -> Handle:
        raise NotImplementedError


class DistComm(Comm):
    """``torch.distributed`` point-to-point and collectives on the default process group."""

    _instances = 0

    def __init__(self, groups: dict[str, Sequence[int]]):
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.groups = {}
        # new_group is collective over the whole world: every rank creates every group, in the
        # same (sorted) order, even the groups it is not a member of.
        for name in sorted(groups):
            ranks = sorted(groups[name])
            g = dist.new_group(ranks) if len(ranks) < self.world_size else dist.group.WORLD
            if self.rank in ranks:
                self.groups[name] = (g, ranks)
        # gloo matches point-to-point messages FIFO per (peer, tag). Within a pipeline the
        # schedule makes both sides post in the same order; a tag per pipeline (every rank
        # builds its pipelines in the same order) keeps two pipelines' messages apart.
        DistComm._instances += 1
        self.tag = DistComm._instances

    def isend(self, tensors, peer):
        return _DistHandle([dist.isend(t.contiguous(), peer, tag=self.tag) for t in tensors])

    def irecv(self, tensors, peer):
        return _DistHandle([dist.irecv(t, peer, tag=self.tag) for t in tensors])

    def all_reduce(self, tensor, group):
        g, ranks = self.groups[group]
        if len(ranks) == 1:
            return Handle()
        return _DistHandle([dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=g, async_op=True)])


class _LocalRecv(Handle):
    def __init__(self, hub: "LocalHub", key, tensors):
        self.hub, self.key, self.tensors, self.done = hub, key, list(tensors), False

    def ready(self) -> bool:
        if not self.done and self.hub.mail[self.key]:
            payload = self.hub.mail[self.key].popleft()
            if len(payload) != len(self.tensors):
                raise RuntimeError(f"message of {len(payload)} tensors for a receive of {len(self.tensors)}")
            for dst, src in zip(self.tensors, payload):
                dst.copy_(src)
            self.done = True
        return self.done

    def wait(self) -> None:
        if not self.ready():
            raise RuntimeError(f"receive {self.key} waited on before its send was posted")


class _LocalReduce(Handle):
    def __init__(self, op: "_ReduceOp"):
        self.op = op

    def ready(self) -> bool:
        return self.op.complete()

    def wait(self) -> None:
        if not self.ready():
            raise RuntimeError("all_reduce waited on before every member posted")


class _ReduceOp:
    def __init__(self, size: int):
        self.size = size
        self.posted: dict[int, torch.Tensor] = {}  # rank -> its tensor
        self.reduced = False

    def complete(self) -> bool:
        if not self.reduced and len(self.posted) == self.size:
            # Sum in rank order, whatever order the driver interleaved the ranks in; every
            # member gets the same bits.
            tensors = [self.posted[r] for r in sorted(self.posted)]
            total = tensors[0].clone()
            for t in tensors[1:]:
                total += t
            for t in tensors:
                t.copy_(total)
            self.reduced = True
        return self.reduced


class LocalHub:
    """Shared state of all ranks living in one process."""

    def __init__(self, world_size: int, groups: dict[str, Sequence[int]]):
        self.world_size = world_size
        self.groups = {k: sorted(v) for k, v in groups.items()}
        self.mail: dict[tuple[int, int], deque] = defaultdict(deque)
        # per group: a FIFO of reductions; the n-th all_reduce of each member joins the n-th op
        self.reduce_ops: dict[str, list[_ReduceOp]] = defaultdict(list)
        self.reduce_count: dict[tuple[str, int], int] = defaultdict(int)

    def comm(self, rank: int) -> "LocalComm":
        return LocalComm(self, rank)


class LocalComm(Comm):
    def __init__(self, hub: LocalHub, rank: int):
        self.hub, self.rank, self.world_size = hub, rank, hub.world_size

    def isend(self, tensors, peer):
        # Copy now: the sender may reuse its buffers, as after a completed real send.
        self.hub.mail[(self.rank, peer)].append([t.detach().clone() for t in tensors])
        return Handle()

    def irecv(self, tensors, peer):
        return _LocalRecv(self.hub, (peer, self.rank), tensors)

    def all_reduce(self, tensor, group):
        ranks = self.hub.groups[group]
        if self.rank not in ranks:
            raise RuntimeError(f"rank {self.rank} is not in group {group!r} {ranks}")
        if len(ranks) == 1:
            return Handle()
        # The n-th all_reduce a member posts on a group joins that group's n-th operation.
        n = self.hub.reduce_count[(group, self.rank)]
        self.hub.reduce_count[(group, self.rank)] += 1
        ops = self.hub.reduce_ops[group]
        while len(ops) <= n:
            ops.append(_ReduceOp(len(ranks)))
        op = ops[n]
        op.posted[self.rank] = tensor
        return _LocalReduce(op)
