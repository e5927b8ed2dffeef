"""comm: point-to-point and collective communication behind one small interface.

The runtime talks to its peers only through a :class:`Comm`: asynchronous ``isend``/``irecv``
between ranks and an asynchronous SUM ``all_reduce`` over a named group of ranks, each returning
a :class:`Handle`. Two implementations share every line of the runtime:

* :class:`DistComm` — ``torch.distributed`` (gloo on CPU, NCCL on CUDA). One process per rank;
  ``Handle.ready()`` asks the work objects (gloo reports a send or a receive complete only once
  it was waited for, however long ago its data moved), ``wait()`` blocks on them.
* :class:`LocalHub` / :class:`LocalComm` — every rank in ONE process (the debugging mode), under
  NCCL's matching rules, which it enforces (:mod:`fxpipe.deps`): an operation completes only
  against its counterpart at the same position of the pair's queue, each rank's posts complete
  in post order, and a collective once every member posted it. The driver interleaves the
  ranks, running each until its next action waits for an incomplete operation, so the
  single-process mode executes the very same action lists, in the same per-rank order, and
  computes the same numbers.

Groups have the names below (:data:`EVERY_RANK`, :func:`dp_group`, :func:`tied_group`); the
pipeline's ``Topology.groups`` creates each once, in the same order on every rank, before
training starts, and the runtime posts on them by the same names.
"""

from __future__ import annotations

import datetime
import time
from collections import deque
from typing import Sequence

import torch
import torch.distributed as dist

from .deps import CommOp, Rendezvous
from .errors import PeerError

__all__ = ["Handle", "Comm", "DistComm", "LocalHub", "LocalComm", "EVERY_RANK", "dp_group", "tied_group"]

_REPORT_CHARS = 1000  # of a rank's reason for stopping, as its peers quote it

#: Every rank: the loss (every rank returns it) and the gradient norm (every rank decides alike).
EVERY_RANK = "all"


def dp_group(stage: int) -> str:
    """The replicas of ``stage``: its data-parallel gradient all-reduce."""
    return f"dp:{stage}"


def tied_group(stages: Sequence[int]) -> str:
    """Every replica of ``stages``, which hold copies of one tied parameter: its gradient sum."""
    return f"tied:{'-'.join(map(str, stages))}"


class Handle:
    """An asynchronous operation: ``ready()`` says whether ``wait()`` would return at once."""

    def ready(self) -> bool:
        return True

    def wait(self) -> None:
        return None


class _DistHandle(Handle):
    def __init__(self, works, tensors=(), *, comm: "DistComm | None" = None, label: str = "", peer: str = "",
                 unpack: "tuple[torch.Tensor, Sequence[torch.Tensor]] | None" = None):
        self.works = [w for w in works if w is not None]
        self.tensors = tensors  # kept alive until the operation completed
        self.comm, self.label, self.peer = comm, label, peer
        self.unpack = unpack  # a receive of several tensors: (the message, the tensors it fills)

    def ready(self) -> bool:
        return all(w.is_completed() for w in self.works)

    def wait(self) -> None:
        timeout = self.comm.timeout if self.comm is not None else None
        start = time.perf_counter()
        for w in self.works:
            try:
                w.wait(timeout) if timeout is not None else w.wait()
            except RuntimeError as e:
                raise self.comm.failure(self.label, self.peer, time.perf_counter() - start, e) from e
        if self.comm is not None:
            self.comm.waited += time.perf_counter() - start
        if self.unpack is not None:
            _unpack(*self.unpack)
        self.works, self.tensors, self.unpack = [], (), None


#: What gloo's errors say where a peer's connection failed (it raises a plain RuntimeError)
_CONNECTION_FAILED = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "Connection refused")


def peer_failed(e: BaseException, *, timeouts: bool = False) -> bool:
    """Whether ``e``, raised by torch.distributed, says a peer did not answer: a DistError, or
    gloo's plain RuntimeError of a failed connection (and, with ``timeouts``, of a timed-out
    collective or store wait: "Timed out waiting 20000ms for send operation to complete", "Wait
    timeout")."""
    text = str(e)
    return isinstance(e, dist.DistError) or any(s in text for s in _CONNECTION_FAILED) or (
        timeouts and any(s in text.lower() for s in ("timed out", "wait timeout")))


class Comm:
    rank: int
    world_size: int
    waited: float = 0.0  # seconds this rank spent blocked in Handle.wait (fxpipe.profile reads it)

    # ``label`` names the operation (the action that posts it) in errors and recordings.
    def isend(self, tensors: Sequence[torch.Tensor], peer: int, label: str = "") -> Handle:
        raise NotImplementedError

    def irecv(self, tensors: Sequence[torch.Tensor], peer: int, label: str = "") -> Handle:
        raise NotImplementedError

    def all_reduce(self, tensor: torch.Tensor, group: str, label: str = "", member: int | None = None) -> Handle:
        """Sum ``tensor`` over ``group`` in place. ``member``: which of this rank's members of the
        group posts (its stage), where the rank holds several (an interleaved lane's stages): the
        rank sums its members' parts and joins the group once, when the last of them posted, and
        every part then holds the total (the earlier parts' handles are not ready before)."""
        raise NotImplementedError

    def report(self, error: str) -> None:
        """Tell the other ranks why this rank stopped (one line), for the errors their waits on it
        will raise. In one process there is no one else to tell."""

    def withdraw(self) -> None:
        """Take back this rank's report: it went on (a refused batch it caught), and a later
        error of a peer must not quote it."""

    def reports(self) -> dict[int, str]:
        """Rank -> the reason it reported (:meth:`report`), for every other rank that did."""
        return {}

    def failed_first(self) -> str:
        """``rank(s) [1] failed first (rank 1: ValueError in action 1F5v1: ...)`` from the other
        ranks' reports, for an error of this rank that theirs caused; "" where none reported."""
        reported = self.reports()
        if not reported:
            return ""
        said = "; ".join(f"rank {r}: {reason}" for r, reason in sorted(reported.items()))
        return f"rank(s) {sorted(reported)} failed first ({said})"


class DistComm(Comm):
    """``torch.distributed`` point-to-point and collectives on the default process group.

    ``timeout`` (seconds) bounds every wait on the host (gloo: a wait that expires, or a peer
    whose connection closes, raises :class:`~fxpipe.errors.PeerError` naming this rank, the
    peer and the action). None waits as the backend does: on NCCL a host-side wait would block
    the CPU thread that keeps the GPU fed, so there the process group's watchdog enforces the
    group's timeout, and :attr:`last_posted` tells what this rank posted last.

    A rank that fails on its own (its loss function raised, its batch was refused) leaves its
    reason in the process group's store (:meth:`report`), and a peer whose wait on it then fails
    quotes that reason in its :class:`~fxpipe.errors.PeerError`, so that every rank's log says
    what went wrong, not only the rank that saw it. The store is where ``init_process_group``
    keeps it (``torch.distributed``'s own accessor; a torch without it, or a store that does not
    answer, leaves the errors as they were).
    """

    _instances = 0

    def __init__(self, groups: dict[str, Sequence[int]], timeout: float | None = None):
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.timeout = None if timeout is None else datetime.timedelta(seconds=timeout)
        self.last_posted = ""  # the label of the newest operation this rank posted
        self.groups = {}
        self.members: dict[str, int] = {}  # group -> this rank's members of it (its stages in it)
        self._parts: dict[str, dict[int | None, deque[tuple[torch.Tensor, _Part]]]] = {}
        # new_group is collective over the whole world: every rank creates every group, in the
        # same (sorted) order, even the groups it is not a member of.
        for name in sorted(groups):
            ranks = sorted(set(groups[name]))
            g = dist.new_group(ranks) if len(ranks) < self.world_size else dist.group.WORLD
            if self.rank in ranks:
                self.groups[name] = (g, ranks)
                self.members[name] = list(groups[name]).count(self.rank)
        # gloo matches point-to-point messages FIFO per (peer, tag). Within a pipeline the
        # schedule makes both sides post in the same order; a tag per pipeline (every rank
        # builds its pipelines in the same order) keeps two pipelines' messages apart.
        DistComm._instances += 1
        self.tag = DistComm._instances
        try:
            self.store = dist.distributed_c10d._get_default_store()
        except (AttributeError, RuntimeError, ValueError):
            self.store = None

    # One message per send or receive, whatever the number of tensors: several are packed into
    # one byte buffer (a boundary's tensors, a gradient and its reached flags). Each message posted
    # costs the sender a post and the receiver one; on gloo a receive posted once its peer's send
    # is waiting can cost milliseconds (benchmarks/README.md, "A receive posted after its send").

    def isend(self, tensors, peer, label=""):
        if not tensors:
            return Handle()
        message = _pack(tensors)
        self.last_posted = label
        work = self._post(lambda: dist.isend(message, peer, tag=self.tag), label, f"to rank {peer}")
        return _DistHandle([work], (message,), comm=self, label=label, peer=f"to rank {peer}")

    def irecv(self, tensors, peer, label=""):
        if not tensors:
            return Handle()
        if any(not t.is_contiguous() for t in tensors):
            raise RuntimeError("internal: fxpipe receives only into contiguous tensors")
        if len(tensors) == 1:
            message, unpack = tensors[0], None
        else:
            message = torch.empty(sum(t.nbytes for t in tensors), dtype=torch.uint8, device=tensors[0].device)
            unpack = (message, tensors)
        self.last_posted = label
        work = self._post(lambda: dist.irecv(message, peer, tag=self.tag), label, f"from rank {peer}")
        return _DistHandle([work], comm=self, label=label, peer=f"from rank {peer}", unpack=unpack)

    def all_reduce(self, tensor, group, label="", member=None):
        g, ranks = self.groups[group]
        if self.members[group] > 1:
            return self._gather(tensor, group, label, member)
        if len(ranks) == 1:
            return Handle()
        return self._all_reduce(tensor, group, label)

    def _all_reduce(self, tensor, group, label):
        g, ranks = self.groups[group]
        self.last_posted = label
        peer = f"in an all-reduce over ranks {ranks}"
        work = self._post(lambda: dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=g, async_op=True), label, peer)
        return _DistHandle([work], comm=self, label=label, peer=peer)

    def _gather(self, tensor, group, label, member) -> Handle:
        """One member's part of a collective of a group this rank holds several members of: the
        rank posts the sum of its members' parts (in member order) once the last one is here."""
        parts = self._parts.setdefault(group, {})
        part = _Part(label)
        parts.setdefault(member, deque()).append((tensor, part))
        if len(parts) > self.members[group]:
            raise RuntimeError(f"internal: rank {self.rank} holds {self.members[group]} members of group {group!r}, "
                               f"but parts came from {sorted(map(str, parts))}")
        if len(parts) == self.members[group] and all(parts.values()):
            heads = [parts[m].popleft() for m in sorted(parts, key=str)]
            total = heads[0][0].clone()
            for t, _ in heads[1:]:
                total += t
            inner = self._all_reduce(total, group, label) if len(self.groups[group][1]) > 1 else Handle()
            joined = _Joined(inner, total, [t for t, _ in heads])
            for _, p in heads:
                p.joined = joined
        return part

    def _post(self, post, label: str, peer: str):
        """``post()``'s work; a post that fails on the connection (gloo: the peer's connection
        closed, it died) raises the :class:`~fxpipe.errors.PeerError` a failed wait would. Other
        errors (this rank out of memory, say) stay what they are."""
        try:
            return post()
        except RuntimeError as e:
            if peer_failed(e):
                raise self.failure(label, peer, None, e) from e
            raise

    def _report_key(self, rank: int) -> str:
        return f"fxpipe/{self.tag}/failed/{rank}"  # per pipeline: the same tag on every rank

    def report(self, error: str) -> None:
        if self.store is None:
            return
        try:
            self.store.set(self._report_key(self.rank), error[:_REPORT_CHARS])
        except Exception:  # noqa: BLE001 - the store gone too: the peers' errors say less, nothing worse
            pass

    def withdraw(self) -> None:
        if self.store is None:
            return
        try:
            self.store.delete_key(self._report_key(self.rank))
        except Exception:  # noqa: BLE001 - as in report
            pass

    def reports(self) -> dict[int, str]:
        found: dict[int, str] = {}
        if self.store is None:
            return found
        try:
            for r in range(self.world_size):
                key = self._report_key(r)
                if r != self.rank and self.store.check([key]):
                    found[r] = self.store.get(key).decode(errors="replace")
        except Exception:  # noqa: BLE001 - a store that does not answer: say what this rank knows
            pass
        return found

    def failure(self, label: str, peer: str, waited: float | None, error: Exception) -> PeerError:
        """The error a failed wait (``waited`` seconds) or post (``waited`` None) raises: who
        waited or posted, what, to or from whom, and what to check; where other ranks reported why
        they stopped (:meth:`report`), their reasons first."""
        text = str(error).strip().splitlines()[-1] if str(error).strip() else type(error).__name__
        if waited is None:
            why = f"posted {label} {peer}, and the connection failed ({text})"
        elif "timed out" in text.lower() or "timeout" in text.lower():
            why = f"waited {waited:.0f} s for {label} {peer}: no answer within compile(timeout=...)"
        else:
            why = f"waited for {label} {peer}, and the connection failed ({text})"
        first = self.failed_first()
        if first:
            return PeerError(
                f"rank {self.rank} {why}; {first}. Fix that error: its traceback is in that rank's log. This "
                f"rank cannot go on either; restart every rank (from a checkpoint) once it is fixed."
            )
        return PeerError(
            f"rank {self.rank} {why}. The peer died, hangs, is slower than the timeout, or runs another "
            f"call: check its log for an error or a stall (data loading, a checkpoint write, a debugger); "
            f"every rank must call step, flush, eval_step, save, load and state_dict alike (each is a "
            f"collective); raise timeout= if its steps are legitimately that slow."
        )


class _Joined:
    """A rank's one post of a collective it holds several members of (:meth:`DistComm._gather`):
    the summed parts' all-reduce, and the parts it writes the total back into."""

    def __init__(self, inner: Handle, total: torch.Tensor, parts: Sequence[torch.Tensor]):
        self.inner, self.total, self.parts = inner, total, parts
        self.done = False

    def wait(self) -> None:
        if not self.done:
            self.inner.wait()
            for t in self.parts:
                t.copy_(self.total)
            self.done = True


class _Part(Handle):
    """One member's part of a collective its rank joins once (:meth:`DistComm._gather`)."""

    def __init__(self, label: str):
        self.label = label
        self.joined: _Joined | None = None

    def ready(self) -> bool:
        return self.joined is not None and (self.joined.done or self.joined.inner.ready())

    def wait(self) -> None:
        if self.joined is None:
            raise RuntimeError(
                f"{self.label} waited on before the rank's other members of its group posted their parts: the rank "
                f"posts the collective only then, so this would block forever; this is a bug in fxpipe's schedule")
        self.joined.wait()


class _LocalHandle(Handle):
    def __init__(self, op: CommOp):
        self.op = op

    def ready(self) -> bool:
        return self.op.done

    def wait(self) -> None:
        if not self.op.done:
            raise RuntimeError(
                f"{self.op} waited on before it could complete: in one process this would block forever "
                f"(a schedule whose wait comes before its peer's post); this is a bug in fxpipe's schedule"
            )


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's bytes, as a flat uint8 view of its storage."""
    return t.detach().reshape(-1).view(torch.uint8)


def _pack(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """What one message carries: a lone tensor as it is (contiguous), several as their bytes
    one after the other (what :func:`_unpack` splits on the receiving rank)."""
    if len(tensors) == 1:
        return tensors[0].contiguous()
    return torch.cat([_bytes(t.contiguous()) for t in tensors])


def _unpack(message: torch.Tensor, tensors: Sequence[torch.Tensor]) -> None:
    """Fill the (contiguous) ``tensors`` from a received message of their bytes, in order."""
    offset = 0
    for t in tensors:
        _bytes(t).copy_(message[offset:offset + t.nbytes])
        offset += t.nbytes


def _signature(tensors: Sequence[torch.Tensor]) -> tuple:
    return tuple((tuple(t.shape), t.dtype) for t in tensors)


def _complete(ops: list[CommOp]) -> None:
    """Move the data of one completed operation (all participants, in rank order)."""
    if ops[0].kind == "collective":
        # Sum in rank order, whatever order the driver interleaved the ranks in; every member
        # gets the same bits.
        tensors = [o.payload[0] for o in ops]
        total = tensors[0].clone()
        for t in tensors[1:]:
            total += t
        for t in tensors:
            t.copy_(total)
        return
    send, recv = (ops[0], ops[1]) if ops[0].kind == "send" else (ops[1], ops[0])
    for dst, src in zip(recv.payload, send.payload):
        dst.copy_(src)


class LocalHub:
    """Every rank in one process, under NCCL's rules (:class:`fxpipe.deps.Rendezvous`): each
    rank's posts complete in post order, a p2p operation only against its counterpart at the
    same position of the pair's queue, a collective once every member posted it. A violation
    raises at once, naming both ranks and both operations."""

    def __init__(self, world_size: int, groups: dict[str, Sequence[int]]):
        self.world_size = world_size
        self.groups = {k: sorted(v) for k, v in groups.items()}
        self.engine = Rendezvous(self.groups, on_complete=_complete)

    def comm(self, rank: int) -> "LocalComm":
        return LocalComm(self, rank)


class LocalComm(Comm):
    def __init__(self, hub: LocalHub, rank: int):
        self.hub, self.rank, self.world_size = hub, rank, hub.world_size

    def _post(self, kind, tensors, label, peer=None, group=None, member=None) -> Handle:
        op = CommOp(self.rank, kind, label, _signature(tensors), peer=peer, group=group, payload=list(tensors),
                    member=member)
        return _LocalHandle(self.hub.engine.post(op))

    def isend(self, tensors, peer, label=""):
        return self._post("send", tensors, label, peer=peer)

    def irecv(self, tensors, peer, label=""):
        return self._post("recv", tensors, label, peer=peer)

    def all_reduce(self, tensor, group, label="", member=None):
        ranks = self.hub.groups[group]
        if self.rank not in ranks:
            raise RuntimeError(f"rank {self.rank} is not in group {group!r} {ranks}")
        if len(ranks) == 1:
            return Handle()
        return self._post("collective", [tensor], label, group=group, member=member)
