"""partition: cut a traced, costed graph into pipeline stages, and choose d, w, b and recomputation.

The graph is seen as a *chain*: its ``n`` compute nodes in topological (graph) order. Stage ``s``
takes the contiguous run ``[l, r]`` of them. Cutting between positions ``c`` and ``c + 1`` sends
every value produced at or before ``c`` and used after it (skip connections are forwarded
through the stages in between, so they cross every cut they span); a cut is allowed only where
each crossing value is one tensor. For a fixed depth ``d`` the partitioner returns the exact
optimum of::

    minimise   max_s  T_s(l_s, r_s)
    T_s(l, r) = sum_{k=l..r} (fwd_k * (2 if recompute_s else 1) + bwd_k)      # compute
              + comm(l - 1) + comm(r)                                         # input/output cut
    comm(c)   = p2p_latency + (act bytes crossing c) / p2p_bandwidth          # activations, forward
              + p2p_latency + (grad bytes crossing c) / p2p_bandwidth         # gradients, backward
    subject to M_s(l, r) <= memory limit for every stage

    M_s(l, r) = sum of the distinct parameters/buffers the stage reads, each costing
                versions*bytes + grad accumulator(s) + optimizer state (parameters) or bytes (buffers)
              + max over the stage's moments h of                             # what its rank holds
                    h.whole * A(l, r) + h.deferred * W(l, r) + h.outputs * O(r)         # activations
                  + h.inputs * I(l) + h.sent * S(l) + h.grads * G(r) + h.model_inputs * X(l, r)

with ``A(l, r)`` the bytes of every output of the stage's nodes that has storage of its own (what
autograd may save; a view, such as ``transpose`` or a ``split``'s pieces, shares its base's and
adds none, :func:`fxpipe.cost.is_view`; it includes the values the stage sends, which the runtime
keeps until the micro-batch's backward: it does not free a sent output's storage as Megatron-LM's
``deallocate_output_tensor`` does, so the gradient received for it is a buffer of its own),
``W(l, r)`` the activation inputs and output gradients of its nodes that read a trainable
parameter (what a micro-batch keeps between zb's ``I`` and ``W``, :func:`_weight_reads`), ``I(l)``/``S(l)`` the
bytes (and gradient bytes) crossing its input cut, ``G(r)``/``O(r)`` the gradient bytes (and
bytes) crossing its output cut, and ``X(l, r)`` a micro-batch of the model inputs its nodes read.
The moments (:class:`Held`, :func:`_moments`) count what the runtime's action lists hold at once
(PipeDream-2BW §3; docs/design.md, "The memory model"): with ``n_s = min(d - s, m)``
micro-batches in flight under 1f1b and zb (``d - s`` under 2bw, ``m`` under gpipe; 1f1b and 2bw
add a ``lookahead`` on all but the last stage, :func:`fxpipe.schedule.warmup`), ``n_s``
micro-batches' activations (under recomputation one, and the others' forward outputs), each
with its received input, and the receive posted early for the next; the gradient receives
posted (all ``n_s`` at once in 1f1b's drain, all ``m`` under gpipe, at most two ahead under
2bw); the input gradient being sent; the step's ``m`` micro-batches of model inputs, handed over
when it starts; under zb the ``min(d, m) - n_s`` micro-batches ZB-H1 defers past their ``I``
(:func:`fxpipe.schedule.zb_bounds`) at ``W(l, r)`` each, none on a stage that recomputes, and
their whole activations where the stage's input carries no gradient (the first stage: its ``I``
is empty). tests/unit/test_partition.py replays the lists against the moments and measures a
real run's workers against the plan.

Algorithm: binary search on the bottleneck ``T`` with an exact O(n log n · d) feasibility test.
Both constraints split into a part in ``l`` and a part in ``r``: ``T_s = X_s(l) + Y_s(r)`` and,
per moment, ``M_s = U_s(l) + V_s(r) + H_s(r)`` (plus tied-parameter terms), with ``V_s``
non-decreasing in ``r`` and ``H_s`` the output cut's buffers. The ends a stage may have are
grouped by their output cut's sizes (a model of repeated blocks has a handful; where there are
more than 16 pairs, each is priced at the next of fewer levels, :func:`_cut_terms`), so for each
group memory allows exactly a window ``r <= rho_s(g, l)``, and the test "some feasible end r,
from which the later stages can finish, has ``Y_s(r) <= T - X_s(l)``" is a range-minimum query
(sparse table) over the window all groups share and each group's short band past it,
vectorised over ``l``. Stages are checked from the last to the first, where ``n_s`` is
known. After each feasible probe the upper bound drops to the bottleneck actually achieved, so
the search ends on a partition whose bottleneck is within 1e-9 (relative) of the optimum; of the
partitions meeting it, the one with the earliest cuts is returned (deterministic).

That optimum balances compute. Where the data-parallel gradient all-reduce is part of the step
(under 2bw where it outlasts the pipeline, under the flushing schedules wherever there is one),
:func:`_cut_for_reduction` then searches the all-reduce time: each stage's all-reduced parameter
bytes capped to what its ring moves in that time (another window in ``r``), the same solver
under the caps, the step priced exactly; the shortest step wins.

:func:`plan` is the entry point: trace (if given a module), cost, then — as PipeDream-2BW's
Algorithm 1 — enumerate depth ``d`` (with width ``w = world_size / d``), recomputation on/off, and
the micro-batch size ``b`` when a global batch is given, partition each, and keep the highest
predicted throughput that fits memory; the runner-up is kept in the plan to explain the choice.
With a :class:`fxpipe.Cluster` it also chooses how many whole nodes to use, prices each cut and
each gradient all-reduce on the runtime's placement (:func:`stage_links`, :func:`reduction_time`)
and searches branch and bound (:func:`_search`); ``plan.configurations`` keeps the best of each
depth and why it lost. :class:`BlockCosting` builds the chain of a model of repeated blocks at any
depth from a trace of three, and :func:`capacity` finds the deepest such model that fits.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import numbers
import operator
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np
import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch import nn

from .cluster import Cluster, crossing_stages, placement, stage_links
from .cost import DeviceModel, GraphCosts, annotate, fit_two_sizes, is_view
from .errors import PlanError, ScheduleError
from .precision import PRECISIONS, compute_dtype
from .weights import weight_bytes
from .plan import Configuration, Plan, RunnerUp, StagePlan, graph_fingerprint, megabytes
from .trace import alias_base, as_leaf_modules, written_values
from .schedule import (SCHEDULES, check_chunks, check_lookahead, gradient_buffers, interleaved_holds, min_microbatches,
                       rank_of, warmup, zb_bounds)

__all__ = ["Chain", "StageModel", "Partition", "chain_from_graph", "partition_chain", "min_memory", "stage_time", "stage_memory", "plan",
           "reduction_time", "BlockCosting", "Capacity", "capacity"]

_COMPUTE = ("call_function", "call_method", "call_module")
_REL_TOL = 1e-9
_REDUCTION_PROBES = 16  # at most this many solver calls in _cut_for_reduction's bisection; its grids take
_REDUCTION_TOL = 1e-3  # half that plus one each; the bisection ends within this of the all-reduce time


@dataclass(eq=False)
class Chain:
    """The costs the partitioner sees, for one micro-batch size (arrays over compute nodes).

    ``cross[c]``/``cross_grad[c]`` are the activation/gradient bytes crossing cut ``c`` (between
    positions ``c`` and ``c + 1``; ``n - 1`` cuts); ``valid[c]`` whether the cut is allowed.
    ``tensor_cost[p]`` is the memory a stage pays for holding parameter/buffer ``p``;
    ``tensor_readers[p]`` the sorted positions of the nodes that read it. ``weight_reads[i]`` is
    what zb's weight pass keeps of a micro-batch between its ``I`` and its ``W``, charged at
    position ``i`` (:func:`_weight_reads`; zeros when not given).
    """

    fwd: np.ndarray
    bwd: np.ndarray
    act: np.ndarray
    cross: np.ndarray
    cross_grad: np.ndarray
    valid: np.ndarray
    tensor_cost: np.ndarray = field(default_factory=lambda: np.zeros(0))
    tensor_readers: tuple[np.ndarray, ...] = ()
    names: tuple[str, ...] = ()
    # for reporting, per tensor: parameter bytes (0 for buffers), and the parts of its cost
    # that are the gradient accumulator and the optimizer state (the rest is weight copies)
    tensor_param_bytes: np.ndarray = field(default_factory=lambda: np.zeros(0))
    tensor_grad_bytes: np.ndarray = field(default_factory=lambda: np.zeros(0))
    tensor_optim_bytes: np.ndarray = field(default_factory=lambda: np.zeros(0))
    tensor_names: tuple[str, ...] = ()
    weight_reads: np.ndarray = field(default_factory=lambda: np.zeros(0))
    #: per tensor, the bytes of one micro-batch of it when it is a model input (a placeholder of
    #: the graph, which the runtime hands every stage that reads it; no weight cost), else 0
    tensor_input_bytes: np.ndarray = field(default_factory=lambda: np.zeros(0))

    def __post_init__(self) -> None:
        f = lambda a: np.asarray(a, dtype=np.float64)  # noqa: E731
        self.fwd, self.bwd, self.act = f(self.fwd), f(self.bwd), f(self.act)
        self.weight_reads = f(self.weight_reads) if len(self.weight_reads) else np.zeros(len(self.fwd))
        self.cross, self.cross_grad = f(self.cross), f(self.cross_grad)
        self.valid = np.asarray(self.valid, dtype=bool)
        self.tensor_cost = f(self.tensor_cost)
        self.tensor_readers = tuple(np.asarray(r, dtype=np.int64) for r in self.tensor_readers)
        for name in ("tensor_param_bytes", "tensor_grad_bytes", "tensor_optim_bytes", "tensor_input_bytes"):
            arr = f(getattr(self, name))
            setattr(self, name, arr if len(arr) == len(self.tensor_cost) else np.zeros(len(self.tensor_cost)))
        n = len(self.fwd)
        if n == 0:
            raise PlanError("the graph has no compute nodes; expected at least one operator to place on a stage")
        for name, arr, size in (("bwd", self.bwd, n), ("act", self.act, n), ("weight_reads", self.weight_reads, n),
                                ("cross", self.cross, n - 1),
                                ("cross_grad", self.cross_grad, n - 1), ("valid", self.valid, n - 1)):
            if len(arr) != size:
                raise PlanError(f"Chain.{name} has {len(arr)} entries, expected {size} for {n} nodes")
        if len(self.tensor_readers) != len(self.tensor_cost):
            raise PlanError(
                f"Chain: {len(self.tensor_cost)} tensor costs but {len(self.tensor_readers)} reader lists"
            )

    @property
    def n(self) -> int:
        return len(self.fwd)


@dataclass(frozen=True)
class Held:
    """What a stage's rank holds at once at one point of its action list (a *moment*), in
    units of one micro-batch's share of each kind (the module docstring's memory formula):
    ``whole`` micro-batches' activations ``A(l, r)``; ``deferred`` zb weight passes ``W(l, r)``;
    ``outputs`` forward outputs a recomputing stage keeps until ``R`` replaces them ``O(r)``;
    ``inputs`` received boundary inputs ``I(l)`` (those of micro-batches in flight and the
    receives already posted); ``sent`` input gradients still being sent ``S(l)``; ``grads``
    posted gradient receives ``G(r)``; ``model_inputs`` micro-batches of model inputs ``X(l, r)``
    (handed over at the step's start, kept until the micro-batch's backward)."""

    whole: int = 0
    deferred: int = 0
    outputs: int = 0
    inputs: int = 0
    sent: int = 0
    grads: int = 0
    model_inputs: int = 0


def _moments(schedule: str, stages: int, microbatches: int, s: int, recompute: bool,
             split: bool = True, lookahead: int = 0, chunks: int = 1,
             recomputes: Sequence[bool] = ()) -> tuple[Held, ...]:
    """The moments of stage ``s`` whose maximum bounds what its rank holds over a step (of the
    runtime's lists, :func:`fxpipe.schedule.generate`). Each moment is the largest of each
    cut-sized count (inputs, sent, grads, model inputs) over the points of the list that hold
    its numbers of whole, deferred and kept-output micro-batches, so a stage's price is at most
    a few cuts' tensors above the exact peak of its list; tests/unit/test_partition.py replays
    the lists of every schedule (d <= 6, m <= 12, recomputation on and off) against it.

    ``split``: zb only, whether the stage's input carries a gradient; where none does (the first
    stage) its ``I`` is empty and ``W`` runs the whole backward, so deferred micro-batches keep
    their whole activations. With ``n = min(d - s, m)`` micro-batches in flight (1f1b, zb):
    ``n`` whole (``1`` recomputed, the others' ``n`` inputs and outputs kept), the receive of
    the next micro-batch posted early while more follow, ``n`` gradient receives posted at once
    in the drain, the step's ``m`` model inputs. 2bw (``n = d - s``) posts at most two gradient
    receives ahead while ``n`` are whole and carries the previous batch's ``n - 1`` model
    inputs over; gpipe holds all ``m``. A ``lookahead`` (2bw, 1f1b) adds its forwards to ``d - s``
    on every stage but the last (:func:`fxpipe.schedule.warmup`). Interleaved 1F1B (``chunks`` >
    1): the stage's micro-batches in flight, boundary inputs and posted gradient receives as its
    lane's list holds them at most (:func:`fxpipe.schedule.interleaved_holds`), with every
    stage's recomputation (``recomputes``, which moves the receives; none given: this stage's
    alone)."""
    d, m = stages, microbatches
    if chunks > 1:
        rc = tuple(recomputes) or tuple(recompute and i == s for i in range(d))
        n, inputs, grads = interleaved_holds(s, d, chunks, m, rc)
        return (Held(1, 0, n, inputs, 1, grads, m),) if recompute else (Held(n, 0, 0, inputs, 1, grads, m),)
    if schedule == "gpipe":
        return (Held(1, 0, m, m, 1, m, m),) if recompute else (Held(m, 0, 0, m, 0, m, m),)
    n = min(warmup(s, d, lookahead), m)
    # inputs received or posted: as many as the previous stage runs ahead of this one's backward
    inputs = d - s + 1 + lookahead
    if schedule == "2bw":
        n = warmup(s, d, lookahead)
        x = m + n - 1
        if recompute:
            return (Held(1, 0, n, inputs, 1, min(n, max(2 + lookahead, n - 1)), x),)
        steady = Held(n, 0, 0, inputs, 1, min(n, 2 + lookahead), x)
        return (steady, Held(n - 1, 0, 0, inputs - 1, 1, n - 1, x)) if n >= 4 else (steady,)
    if schedule == "zb" and s > 0:
        top = min(d, m)  # ZB-H1: at most min(d, m) micro-batches between F and W
        # the inputs held and the next one's receive, posted early while more follow
        if recompute:  # R k with B k, or I k and W k: one recomputed, between I and W none whole
            if not split:
                return (Held(1, 0, n, n + min(1, m - n), 1, n, m),)
            return (Held(1, 0, n, n + min(1, m - n), 1, n, m), Held(0, 1, n, n + min(1, m - n), 1, n, m))
        if not split:
            return (Held(top, 0, 0, top + min(1, m - top), 1, n, m),)
        e = top - n
        return (Held(n, e, 0, top + min(1, m - top), 1, n, m),
                Held(n - 1, e + 1, 0, top + min(1, m - top), 1, n - 1, m))
    # 1f1b, and zb's first stage (its I is empty: 1f1b's numbers)
    inputs = min(inputs, m)
    if recompute:
        return (Held(1, 0, n, inputs, 1, n, m),)
    return (Held(n, 0, 0, inputs, 1, n, m),)


@dataclass(frozen=True)
class StageModel:
    """How a schedule turns a run of nodes into a stage's time and memory."""

    stages: int
    recompute: tuple[bool, ...]
    #: per stage, the moments whose largest is what its rank holds (:func:`_moments`)
    moments: tuple[tuple[Held, ...], ...]
    p2p_latency: float = 0.0
    p2p_bandwidth: float = math.inf
    memory_limit: float = math.inf
    #: ``(latency, bandwidth)`` of the link between stage s and s + 1, per s (a cluster's
    #: placement puts some pairs on one node, others across nodes); empty: ``p2p_*`` for all
    links: tuple[tuple[float, float], ...] = ()
    #: sends overlap compute (a cluster's ``overlap_p2p``): a stage takes the larger of its compute
    #: and each of its cuts' link time per micro-batch; otherwise their sum
    overlap: bool = False
    #: zb: the moments of a stage whose input carries no gradient (its ``W`` keeps the whole
    #: activations); empty: ``moments``
    unsplit: tuple[tuple[Held, ...], ...] = ()
    #: 2bw, 1f1b: forwards every stage but the last runs ahead of 1F1B's order
    #: (:func:`fxpipe.schedule.warmup`), counted in ``moments``
    lookahead: int = 0
    #: 1f1b: stages per rank (interleaved 1F1B), whose lists ``moments`` counts
    chunks: int = 1

    def forms(self, s: int, grad_in: bool = True) -> tuple[Held, ...]:
        """The moments of stage ``s`` (``grad_in``: whether its input cut carries a gradient)."""
        if not grad_in and s < len(self.unsplit):
            return self.unsplit[s]
        return self.moments[s]

    def link(self, boundary: int) -> tuple[float, float]:
        """``(latency, bandwidth)`` between stage ``boundary`` and ``boundary + 1``."""
        if 0 <= boundary < len(self.links):
            return self.links[boundary]
        return (self.p2p_latency, self.p2p_bandwidth)

    @classmethod
    def for_schedule(cls, schedule: str, stages: int, microbatches: int, recompute: bool | Sequence[bool],
                     device: DeviceModel, memory_limit: float | None = None,
                     links: Sequence[tuple[float, float]] = (), overlap: bool = False,
                     lookahead: int = 0, chunks: int = 1) -> "StageModel":
        d, m, zb = stages, microbatches, schedule == "zb"
        # ZB-H1 holds min(d, m) micro-batches between F and W on every stage, min(d - s, m) of
        # them before their I (1f1b's count, whole activations), the rest deferred past it
        alive = [zb_bounds(s, d, m)[0] if zb else m if schedule == "gpipe" else
                 interleaved_holds(s, d, chunks, m)[0] if chunks > 1 else warmup(s, d, lookahead) for s in range(d)]
        if isinstance(recompute, bool):
            # With one micro-batch alive (the last stage under 1f1b/2bw) recomputation saves
            # nothing and costs a forward: it stays off there.
            recompute = tuple(recompute and alive[s] > 1 for s in range(d))
        recompute = tuple(bool(x) for x in recompute)
        moments = tuple(_moments(schedule, d, m, s, recompute[s], lookahead=lookahead, chunks=chunks,
                                 recomputes=recompute) for s in range(d))
        unsplit = tuple(_moments(schedule, d, m, s, recompute[s], split=False) for s in range(d)) if zb else ()
        return cls(d, recompute, moments, device.p2p_latency, device.p2p_bandwidth,
                   device.memory_bytes if memory_limit is None else float(memory_limit),
                   tuple((float(a), float(b)) for a, b in links), bool(overlap), unsplit, lookahead, chunks)


@dataclass(frozen=True)
class Partition:
    """Stage ``s`` holds chain positions ``bounds[s][0] ..= bounds[s][1]``."""

    bounds: tuple[tuple[int, int], ...]
    bottleneck: float


# --------------------------------------------------------------------------------------------
# reference evaluation (direct sums: reporting and brute-force tests)


def _comm(chain: Chain, model: StageModel, c: int, boundary: int) -> float:
    """Seconds to send cut ``c``'s activations (and their gradients back) between stage
    ``boundary`` and ``boundary + 1``."""
    if c < 0 or c >= chain.n - 1:
        return 0.0
    lat, bw = model.link(boundary)
    t = lat + chain.cross[c] / bw
    if chain.cross_grad[c] > 0:
        t += lat + chain.cross_grad[c] / bw
    return float(t)


def _cut_times(chain: Chain, latency: float, bandwidth: float) -> np.ndarray:
    """``ct[c + 1] = comm(c)`` over one link for every cut c in -1 .. n-1 (0 at both ends)."""
    n = chain.n
    ct = np.zeros(n + 1)
    if n > 1:
        ct[1:n] = latency + chain.cross / bandwidth
        ct[1:n] += np.where(chain.cross_grad > 0, latency + chain.cross_grad / bandwidth, 0.0)
    return ct


def stage_compute(chain: Chain, model: StageModel, s: int, l: int, r: int) -> float:
    """Seconds of compute per micro-batch of stage ``s`` holding positions ``l..r`` (forward,
    again under recomputation, and backward)."""
    f = float(chain.fwd[l : r + 1].sum())
    return (2 * f if model.recompute[s] else f) + float(chain.bwd[l : r + 1].sum())


def stage_time(chain: Chain, model: StageModel, s: int, l: int, r: int) -> float:
    """Seconds per micro-batch of stage ``s`` holding positions ``l..r``."""
    compute = stage_compute(chain, model, s, l, r)
    comm_in, comm_out = _comm(chain, model, l - 1, s - 1), _comm(chain, model, r, s)
    if model.overlap:
        return max(compute, comm_in, comm_out)
    return compute + comm_in + comm_out


def _held(chain: Chain, l: int, r: int) -> list[int]:
    """The tensors (indices, ascending) that a stage holding positions ``l..r`` reads."""
    flat = chain.__dict__.get("_flat_readers")
    if flat is None:  # every (reader position, tensor) pair, once per chain
        rd = chain.tensor_readers
        pos = np.concatenate(rd) if rd else np.zeros(0, dtype=np.int64)
        owner = np.repeat(np.arange(len(rd)), [len(x) for x in rd])
        flat = chain.__dict__["_flat_readers"] = (pos, owner)
    pos, owner = flat
    return np.unique(owner[(pos >= l) & (pos <= r)]).tolist()


def stage_memory(chain: Chain, model: StageModel, s: int, l: int, r: int) -> float:
    """Bytes stage ``s`` needs holding positions ``l..r`` (the formula in the module docstring)."""
    weights, acts, bufs = _stage_bytes(chain, model, s, l, r)
    return weights + acts + bufs


def _stage_bytes(chain: Chain, model: StageModel, s: int, l: int, r: int) -> tuple[float, float, float]:
    """``(weights, activations, buffers)`` of stage ``s`` on ``l..r`` at its fullest moment:
    activations are the whole, deferred and kept-output shares, buffers the received inputs
    and gradients, the gradients being sent and the model inputs."""
    cut = _cut_terms(chain)
    held = _held(chain, l, r)
    weights = float(sum(chain.tensor_cost[p] for p in held))
    model_in = float(sum(chain.tensor_input_bytes[p] for p in held))
    A, E = float(chain.act[l : r + 1].sum()), float(chain.weight_reads[l : r + 1].sum())
    best = (-1.0, 0.0, 0.0)
    for f in model.forms(s, bool(cut.grad_in[l])):
        acts = f.whole * A + f.deferred * E + f.outputs * float(cut.out_val[r])
        bufs = (f.inputs * float(cut.inp[l]) + f.sent * float(cut.sent[l]) + f.grads * float(cut.out_grad[r])
                + f.model_inputs * model_in)
        if acts + bufs > best[0]:
            best = (acts + bufs, acts, bufs)
    return weights, best[1], best[2]


@dataclass(eq=False)
class _Cuts:
    """Per position, the cut-sized terms of the memory formula: ``inp[l]``/``sent[l]`` what
    crosses (and what gradient crosses back over) the input cut of a stage starting at ``l``,
    ``grad_in[l]`` whether any gradient does; ``out_grad[r]``/``out_val[r]`` the same of the
    output cut of a stage ending at ``r`` (0 at the last position), as priced: exact where the
    ends a stage may have show at most ``_GROUPS`` distinct pairs of them (a model of repeated
    blocks has a handful), else each rounded up to one of fewer levels until they do.
    ``group[r]`` numbers the distinct priced pairs over the ends (-1 elsewhere); ``order``
    lists the ends group by group, ``start[g]`` where group g begins in it."""

    inp: np.ndarray
    sent: np.ndarray
    grad_in: np.ndarray
    out_grad: np.ndarray
    out_val: np.ndarray
    group: np.ndarray
    levels: np.ndarray  # (K, 2): each group's (out_grad, out_val)
    order: np.ndarray
    start: np.ndarray


_GROUPS = 16


def _cut_terms(chain: Chain) -> _Cuts:
    got = chain.__dict__.get("_cuts")
    if got is not None:
        return got
    inp = np.concatenate([[0.0], chain.cross])
    sent = np.concatenate([[0.0], chain.cross_grad])
    grad = np.concatenate([chain.cross_grad, [0.0]])
    val = np.concatenate([chain.cross, [0.0]])
    ends = np.concatenate([chain.valid, [True]])
    for k in (12, 8, 6, 4):  # 4 x 4 levels: at most 16 pairs
        g_lv, v_lv = _levels(grad[ends], k), _levels(val[ends], k)
        pg, pv = g_lv[np.searchsorted(g_lv, grad[ends])], v_lv[np.searchsorted(v_lv, val[ends])]
        pairs, inverse = np.unique(np.stack([pg, pv], axis=1), axis=0, return_inverse=True)
        if len(pairs) <= _GROUPS:
            break
    grad, val = grad.copy(), val.copy()
    grad[ends], val[ends] = pg, pv
    group = np.full(chain.n, -1, dtype=np.int64)
    group[ends] = np.asarray(inverse).reshape(-1)
    order = np.argsort(group, kind="stable")
    order = order[group[order] >= 0]
    start = np.searchsorted(group[order], np.arange(len(pairs) + 1))
    got = chain.__dict__["_cuts"] = _Cuts(inp, sent, sent > 0, grad, val, group, pairs, order, start)
    return got


def _levels(values: np.ndarray, k: int) -> np.ndarray:
    """At most ``k`` of the distinct ``values``, the largest among them: what each rounds up to."""
    u = np.unique(values)
    if len(u) <= k:
        return u
    return u[np.ceil(np.arange(1, k + 1) * len(u) / k).astype(np.int64) - 1]


# --------------------------------------------------------------------------------------------
# the exact min-max partition


class _Solver:
    """Per (chain, model): the l/r decompositions of time and memory, and the memory windows."""

    def __init__(self, chain: Chain, model: StageModel):
        n, d = chain.n, model.stages
        self.chain, self.model, self.n, self.d = chain, model, n, d
        self.cuts = _cut_terms(chain)
        cts: dict[tuple[float, float], np.ndarray] = {}  # per link: ct[c + 1] = comm(c)

        def ct(boundary: int) -> np.ndarray:
            key = model.link(boundary)
            if key not in cts:
                cts[key] = _cut_times(chain, *key)
            return cts[key]

        Pf = np.concatenate([[0.0], np.cumsum(chain.fwd)])
        Pb = np.concatenate([[0.0], np.cumsum(chain.bwd)])
        self.X, self.Y = [], []
        # overlap: a stage's time is max(compute, its cuts' link times); the cut times then only
        # bound T (feasible), and X/Y hold the compute alone
        self.cut_in, self.cut_out = [], []
        for s in range(d):
            P = (2 * Pf if model.recompute[s] else Pf) + Pb
            cin, cout = ct(s - 1)[:n], ct(s)[1:]  # the input cut of a stage starting at l is cut l-1
            self.cut_in.append(cin)
            self.cut_out.append(cout)
            self.X.append(-P[:n] if model.overlap else cin - P[:n])
            self.Y.append(P[1:] if model.overlap else P[1:] + cout)
        self.start_ok = np.concatenate([[True], chain.valid])
        self.rho = [self._window(s, model.memory_limit) for s in range(d)]
        self.spans: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # per stage: _queries(rho[s])

    def capped(self, param_caps: Sequence[float]) -> "_Solver":
        """This solver with stage s also holding at most ``param_caps[s]`` bytes of the
        parameters it all-reduces over its replicas (those it alone reads, :func:`reduction_time`)."""
        n, out = self.n, copy.copy(self)
        out.rho = [np.minimum(rho, _window(self.chain, cap, np.zeros(n), self.chain.tensor_param_bytes, np.zeros(n),
                                           whole=True)[None, :]) for rho, cap in zip(self.rho, param_caps)]
        out.spans = {}
        return out

    def solve(self, tol: float = _REL_TOL) -> Partition | None:
        """The min-max partition (bottleneck within ``tol`` of the optimum, relative; the earliest
        cuts among those meeting it), None where no partition fits."""
        R = self.feasible(math.inf)
        if R is None:
            return None
        best = self.reconstruct(math.inf, R)
        # A lower bound: the average compute over d stages at the cheapest (no-recompute) rate.
        lo = float(self.chain.fwd.sum() + self.chain.bwd.sum()) / self.d * (1 - 1e-12)
        hi = best.bottleneck
        while hi - lo > tol * hi:
            mid = 0.5 * (lo + hi)
            R = self.feasible(mid)
            if R is None:
                lo = mid
            else:
                best = self.reconstruct(mid, R)
                hi = best.bottleneck
        R = self.feasible(hi)
        assert R is not None
        return self.reconstruct(hi, R)

    def _window(self, s: int, limit: float) -> np.ndarray:
        """rho[g, l]: the last r whose output cut is of group g (:class:`_Cuts`) such that stage s
        fits memory on [l, r] (l - 1 if none): the least over its moments."""
        chain, cuts = self.chain, self.cuts
        K = len(cuts.levels)
        if math.isinf(limit):
            return np.full((K, self.n), self.n - 1)
        rho = None
        variants = [True] if not self.model.unsplit else [True, False]
        for split in variants:
            got = np.full((K, self.n), self.n - 1)
            for f in self.model.forms(s, split):
                extra = f.grads * cuts.levels[:, 0] + f.outputs * cuts.levels[:, 1]  # (K,): the output cut's share
                got = np.minimum(got, _window(chain, limit - extra[:, None], f.whole * chain.act + f.deferred * chain.weight_reads,
                                              chain.tensor_cost + f.model_inputs * chain.tensor_input_bytes,
                                              f.inputs * cuts.inp + f.sent * cuts.sent))
            rho = got if rho is None else np.where(cuts.grad_in[None, :], rho, got)
        return rho

    def _queries(self, rho: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """The range queries of one stage's feasibility test: every end in ``[l, common[l]]``
        fits (``common``: the least window over the groups), and past it, up to ``rho[g, l]``,
        the ends of group g do; those bands, as spans of ``cuts.order`` (each group's ends in a
        row), only where they hold an end: ``(common, band l, band lo, band hi)``. Windows of
        different groups differ by a cut's bytes, so bands are short and mostly empty."""
        cuts = self.cuts
        K, n = rho.shape
        idx = np.arange(n)
        common = rho.min(axis=0)
        ls, los, his = [], [], []
        for g in range(K):
            a, b = cuts.start[g], cuts.start[g + 1]
            mine = cuts.order[a:b]
            lo = a + np.searchsorted(mine, np.maximum(common, idx - 1), side="right")
            hi = a + np.searchsorted(mine, rho[g], side="right") - 1
            some = hi >= lo
            ls.append(idx[some])
            los.append(lo[some])
            his.append(hi[some])
        return (common, np.concatenate(ls), np.concatenate(los), np.concatenate(his))

    def feasible(self, T: float) -> list[np.ndarray] | None:
        """Reachability per stage at bottleneck T: R[s][l] says positions l..n-1 can form stages
        s..d-1. Returns the list (R[d] = end only) or None if stage 0 cannot start at 0."""
        n = self.n
        idx = np.arange(n)
        R: list[np.ndarray] = [None] * (self.d + 1)  # type: ignore[list-item]
        R[self.d] = np.zeros(n + 1, dtype=bool)
        R[self.d][n] = True
        overlap = self.model.overlap
        order = self.cuts.order
        for s in range(self.d - 1, -1, -1):
            if s not in self.spans:
                self.spans[s] = self._queries(self.rho[s])
            common, band_l, band_lo, band_hi = self.spans[s]
            reach_next = R[s + 1][1:] & (self.cut_out[s] <= T) if overlap else R[s + 1][1:]
            ok = self.start_ok & (common >= idx)
            if math.isinf(T):  # any reachable end that fits will do: count them
                sums = np.concatenate([[0], np.cumsum(reach_next)])
                found = ok & (sums[np.maximum(common, idx) + 1] > sums[idx])
                if len(band_l):
                    sums = np.concatenate([[0], np.cumsum(reach_next[order])])
                    found[band_l[sums[band_hi + 1] > sums[band_lo]]] = True
                best = np.where(found, 0.0, math.inf)
            else:  # one table over the ends in position order, then group by group (the bands)
                Ys = np.where(reach_next, self.Y[s], math.inf)
                got = _range_min(_sparse(np.concatenate([Ys, Ys[order]])), np.concatenate([idx, n + band_lo]),
                                 np.concatenate([np.maximum(common, idx), n + band_hi]))
                best = np.where(ok, got[:n], math.inf)
                if len(band_l):  # past the common window, the ends of each group that still fit
                    np.minimum.at(best, band_l, got[n:])
            ok = self.start_ok.copy()
            if overlap:
                ok &= self.cut_in[s] <= T
            reach = np.zeros(n + 1, dtype=bool)
            reach[:n] = ok & np.isfinite(best) & (best + self.X[s] <= T)
            R[s] = reach
        return R if R[0][0] else None

    def reconstruct(self, T: float, R: list[np.ndarray]) -> Partition:
        """The partition with the earliest cuts among those meeting T."""
        bounds = []
        l, worst = 0, 0.0
        group = self.cuts.group
        for s in range(self.d):
            rho = self.rho[s][:, l]
            hi = int(rho.max())
            span = np.arange(l, hi + 1)
            fits = (group[l : hi + 1] >= 0) & (rho[np.maximum(group[l : hi + 1], 0)] >= span)
            r_ok = R[s + 1][l + 1 : hi + 2] & (self.Y[s][l : hi + 1] + self.X[s][l] <= T) & fits
            if self.model.overlap:
                r_ok &= self.cut_out[s][l : hi + 1] <= T
            r = l + int(np.argmax(r_ok))
            time = float(self.Y[s][r] + self.X[s][l])
            if self.model.overlap:
                time = max(time, float(self.cut_in[s][l]), float(self.cut_out[s][r]))
            worst = max(worst, time)
            bounds.append((l, r))
            l = r + 1
        return Partition(tuple(bounds), worst)


def _window(chain: Chain, limit, per_position: np.ndarray, tensor_cost: np.ndarray,
            at_input: np.ndarray, whole: bool = False) -> np.ndarray:
    """rho[l]: the last r with ``at_input[l] + sum(per_position[l..r]) + the cost of the tensors
    a stage on [l, r] counts <= limit`` (l - 1 if none). A stage counts a tensor once if it reads
    it (memory, :meth:`_Solver._window`) or, with ``whole``, if it holds every reader (the
    parameters of its data-parallel all-reduce: a tensor read on several stages has a ring of
    its own, :func:`reduction_time`). ``limit``: a number, or an array of limits of shape (K, 1)
    giving rho of shape (K, n)."""
    n = chain.n
    idx = np.arange(n)
    one_pos, one, multi, first, order = _tensor_steps(chain, whole)
    single = np.bincount(one_pos, weights=tensor_cost[one], minlength=n).astype(np.float64)
    Pa = np.concatenate([[0.0], np.cumsum(per_position)])
    Pw = np.concatenate([[0.0], np.cumsum(single)])
    U = -Pa[:n] - Pw[:n] + at_input[:n]
    V = Pa[1:] + Pw[1:]
    # A tensor read at several positions costs once if any reader is in [l, r]: a step at its
    # first reader >= l (``whole``: at its last reader, if its first is >= l). Sort those steps
    # per l and search V between them.
    steps = np.cumsum(tensor_cost[multi][order], axis=0) if len(multi) else np.zeros((0, n))
    rho = np.full(n, -1)
    lo = idx.copy()
    corr = np.zeros(n)
    for t in range(len(first) + 1):
        hi = first[t] - 1 if t < len(first) else np.full(n, n - 1)
        cand = np.searchsorted(V, limit - U - corr, side="right") - 1
        cand = np.minimum(cand, hi)
        rho = np.where(cand >= lo, np.maximum(rho, cand), rho)
        if t < len(first):
            lo = np.maximum(lo, first[t])
            corr = steps[t]
    return np.where(rho >= idx, rho, idx - 1)


def _tensor_steps(chain: Chain, whole: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """What :func:`_window` needs of the tensors, once per chain: the reader position and index
    of each tensor read at one position, the indices of those read at several, and for each l
    where each of these starts to count (:func:`_window`), sorted per l, with the order."""
    key = ("_tensor_steps", whole)
    got = chain.__dict__.get(key)
    if got is None:
        n, idx = chain.n, np.arange(chain.n)
        sizes = np.array([len(rd) for rd in chain.tensor_readers], dtype=np.int64)
        one = np.flatnonzero(sizes == 1)
        one_pos = np.array([chain.tensor_readers[p][0] for p in one], dtype=np.int64)
        multi = np.flatnonzero(sizes > 1)
        if len(multi):
            rds = [chain.tensor_readers[p] for p in multi]
            first = np.stack([np.where(idx <= rd[0], rd[-1], n) for rd in rds] if whole
                             else [_next_reader(rd, n) for rd in rds])  # (K, n): where it starts to count
            order = np.argsort(first, axis=0, kind="stable")
            first = np.take_along_axis(first, order, axis=0)
        else:
            first, order = np.zeros((0, n), dtype=np.int64), np.zeros((0, n), dtype=np.int64)
        got = chain.__dict__[key] = (one_pos, one, multi, first, order)
    return got


def _next_reader(readers: np.ndarray, n: int) -> np.ndarray:
    """For every l, the first reader position >= l (n if none)."""
    i = np.searchsorted(readers, np.arange(n), side="left")
    ext = np.concatenate([readers, [n]])
    return ext[i]


def _sparse(a: np.ndarray) -> np.ndarray:
    """The sparse table of ``a`` for :func:`_range_min` (O(n log n))."""
    n = len(a)
    levels = [a]
    k = 1
    while 2 * k <= n:
        prev = levels[-1]
        levels.append(np.minimum(prev[:-k], prev[k:]))
        k *= 2
    table = np.full((len(levels), n), math.inf)
    for j, lev in enumerate(levels):
        table[j, : len(lev)] = lev
    return table


def _range_min(table: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """min(a[lo[i] ..= hi[i]]) for every i, from ``a``'s sparse table (:func:`_sparse`)."""
    length = hi - lo + 1
    j = np.floor(np.log2(np.maximum(length, 1))).astype(np.int64)
    return np.minimum(table[j, lo], table[j, hi - (1 << j) + 1])


def _check_depth(chain: Chain, d: int) -> None:
    if d <= 0:
        raise PlanError(f"stages must be a positive integer, found {d}")
    if d > chain.n:
        raise PlanError(
            f"cannot cut {chain.n} compute nodes into {d} stages (each stage needs at least one node): "
            f"use stages <= {chain.n}"
        )
    allowed = int(chain.valid.sum())
    if d - 1 > allowed:
        raise PlanError(
            f"{d} stages need {d - 1} cuts but the graph allows only {allowed} (a cut must cross single "
            f"tensors only): use stages <= {allowed + 1}"
        )


def partition_chain(chain: Chain, model: StageModel) -> Partition:
    """The exact min-max partition of ``chain`` into ``model.stages`` stages that fit memory.

    Raises :class:`PlanError` with the smallest memory limit that would fit when none does.
    """
    _check_depth(chain, model.stages)
    part = _Solver(chain, model).solve()
    if part is None:
        need = min_memory(chain, model)
        raise PlanError(
            f"no way to cut the model into {model.stages} stages fits in {megabytes(model.memory_limit)} per "
            f"device; the smallest memory that fits is {megabytes(need)}. Give more memory "
            f"(device_memory={math.ceil(need)}), more stages, recomputation or a smaller micro-batch."
        )
    return part


def min_memory(chain: Chain, model: StageModel) -> float:
    """The smallest per-device memory limit under which some partition exists (within 1e-6)."""
    _check_depth(chain, model.stages)
    d = model.stages
    lo = 0.0
    hi = max(stage_memory(chain, model, s, 0, chain.n - 1) for s in range(d))
    hi += max(sum(f.inputs + f.sent + f.grads + f.outputs for split in (True, False) for f in model.forms(s, split))
              for s in range(d)) * float(chain.cross.max(initial=0.0))
    hi = max(hi, 1.0)

    def ok(limit: float) -> bool:
        return _Solver(chain, dataclasses.replace(model, memory_limit=limit)).feasible(math.inf) is not None

    while not ok(hi):
        hi *= 2
    while hi - lo > 1e-6 * hi:
        mid = 0.5 * (lo + hi)
        if ok(mid):
            hi = mid
        else:
            lo = mid
    return hi


# --------------------------------------------------------------------------------------------
# from a traced graph to a chain


def chain_from_graph(gm: fx.GraphModule, costs: GraphCosts, batch: float, *, schedule: str = "2bw",
                     optimizer_bytes_per_param: float = 8.0, grad_buffers: int = 1,
                     accumulation: str = "autograd", precision: str = "fp32") -> Chain:
    """The chain of ``gm``'s compute nodes with costs at micro-batch size ``batch``.

    A parameter costs :func:`fxpipe.weights.weight_bytes` on each stage reading it: its weight
    versions (2 under 2bw), ``grad_buffers`` gradient accumulators (the runtime keeps two when a
    reduction of batch t's gradients overlaps batch t+1's backwards, which only 2bw's do:
    :func:`fxpipe.schedule.gradient_buffers`), the optimizer state
    (``optimizer_bytes_per_param`` per element, AdamW: two fp32 moments = 8) and, with
    ``accumulation="fused"`` (the kernel path), a scratch gradient; ``"optimizer"`` (AdamA) the
    scratch and no accumulator. A buffer costs its bytes.
    ``precision="bf16"``/``"fp16"``: weights as :func:`~fxpipe.weights.weight_bytes` counts them
    (2-byte compute versions beside the master), and a floating activation costs its bytes in the
    compute dtype (what autocast's low-precision ops produce; the few ops its policy keeps in
    float32 are not told apart here).
    """
    return _assemble(_chain_parts(gm, costs, batch, schedule=schedule, optimizer_bytes_per_param=optimizer_bytes_per_param,
                                  grad_buffers=grad_buffers, accumulation=accumulation, precision=precision))


@dataclass(eq=False)
class _Parts:
    """What a chain is made of, before the cuts are summed: per node, its costs; per value that a
    later node reads, the span of cuts it crosses (``lo[v] .. hi[v] - 1``), its bytes, whether a
    gradient flows back through it and whether it is a single tensor; per parameter or buffer,
    its cost and reader positions. :class:`BlockCosting` rearranges these for other depths."""

    names: list[str]
    fwd: np.ndarray
    bwd: np.ndarray
    act: np.ndarray
    weight_reads: np.ndarray
    lo: np.ndarray
    hi: np.ndarray
    size: np.ndarray
    grad: np.ndarray
    bad: np.ndarray
    tensors: list[tuple[str, float, float, float, float, list[int], float]]  # name, cost, param, grad, optim, readers, input


def _chain_parts(gm: fx.GraphModule, costs: GraphCosts, batch: float, *, schedule: str, optimizer_bytes_per_param: float,
                 grad_buffers: int, accumulation: str, precision: str) -> _Parts:
    if accumulation == "optimizer":
        grad_buffers = 0  # AdamA folds each micro-batch into the moments: no accumulator at all
    compute = [nd for nd in gm.graph.nodes if nd.op in _COMPUTE]
    n = len(compute)
    pos = {nd.name: i for i, nd in enumerate(compute)}
    nc = [costs.nodes[nd.name] for nd in compute]
    fwd = np.array([c.fwd_time(batch) for c in nc])
    bwd = np.array([c.bwd_time(batch) for c in nc])
    act = np.array([c.out_bytes(batch) for c in nc])
    low = compute_dtype(precision)
    if low is not None:
        shrink = torch.finfo(low).bits / 32
        act = act * np.array([shrink if _float32_output(nd) else 1.0 for nd in compute])
    held = np.array([0.0 if is_view(nd) else a for nd, a in zip(compute, act)])  # a view is sent whole
    lo, hi, size, grad, bad = [], [], [], [], []
    for i, nd in enumerate(compute):
        last = max((pos.get(u.name, n) for u in nd.users), default=i)  # the output node is after all
        h = min(last, n - 1)
        if h <= i:
            continue
        lo.append(i)
        hi.append(h)
        size.append(act[i])
        grad.append(nc[i].requires_grad)
        bad.append(not isinstance(nd.meta.get("val"), torch.Tensor))
    # A write in place through a view (``h[:, :8].mul_(s)``) changes its base too; sent across a
    # cut, a view and its base arrive as two tensors, and the write no longer reaches the base.
    # So no cut falls between the first view of such a chain and the write.
    for w, nd in enumerate(compute):
        for value in written_values(nd):
            first, v = None, value
            while (base := alias_base(v)) is not None:
                first, v = v, base
            if first is not None and first.name in pos and pos[first.name] < w:
                lo.append(pos[first.name])
                hi.append(w)
                size.append(0.0)
                grad.append(False)
                bad.append(True)

    params = dict(gm.named_parameters())
    buffers = dict(gm.named_buffers())
    readers: dict[str, list[int]] = {}
    for i, nd in enumerate(compute):
        info = nd.meta["fxpipe"]
        for t in (*info.params, *info.buffers):
            readers.setdefault(t, []).append(i)
    tensors = []
    for t, rd in readers.items():
        if t in params:
            p = params[t]
            nbytes = p.numel() * p.element_size()
            # the memory model of fxpipe.weights: what a WeightStore of this stage will hold
            cost = weight_bytes(p.numel(), p.element_size(), requires_grad=p.requires_grad, schedule=schedule,
                                grad_buffers=grad_buffers, optimizer_bytes_per_param=optimizer_bytes_per_param,
                                accumulation=accumulation, precision=precision)
            o = optimizer_bytes_per_param * p.numel() if p.requires_grad else 0.0
            # the gradient part: what weight_bytes counts beyond the versions, master and state
            g = cost - o - weight_bytes(p.numel(), p.element_size(), requires_grad=False, schedule=schedule,
                                        grad_buffers=0, optimizer_bytes_per_param=0.0, precision=precision)
            tensors.append((t, cost, float(nbytes), g, o, sorted(set(rd)), 0.0))
        elif t in buffers:
            tensors.append((t, float(buffers[t].numel() * buffers[t].element_size()), 0.0, 0.0, 0.0, sorted(set(rd)), 0.0))
    # the model's inputs: the runtime hands each stage reading one its own micro-batches of it
    # (no weight cost: what they take depends on how many the schedule holds, _moments)
    inputs = set(gm.meta["fxpipe"].input_names) if "fxpipe" in gm.meta else set()
    traced = costs.batch_size or 1
    for nd in gm.graph.nodes:
        if nd.op != "placeholder" or nd.name not in inputs:
            continue
        rd = sorted({pos[u.name] for u in nd.users if u.name in pos})
        if not rd:
            continue
        nbytes = float(nd.meta["fxpipe"].out_bytes)
        nc_in = costs.nodes.get(nd.name)
        if nc_in is not None and nc_in.batch_dependent:
            nbytes *= batch / traced
        tensors.append((nd.name, 0.0, 0.0, 0.0, 0.0, rd, nbytes))
    tensors = [t for _, t in sorted(enumerate(tensors), key=lambda e: (e[1][5][0], e[0]))]  # by first reader
    i64 = lambda a: np.asarray(a, dtype=np.int64)  # noqa: E731
    return _Parts([nd.name for nd in compute], fwd, bwd, held, _weight_reads(compute, pos, act, params), i64(lo),
                  i64(hi), np.asarray(size, dtype=np.float64), np.asarray(grad, dtype=bool), np.asarray(bad, dtype=bool), tensors)


def _assemble(parts: _Parts) -> Chain:
    """The chain of ``parts``: each value's bytes summed over the cuts it crosses."""
    n = len(parts.fwd)
    diff = np.zeros(n + 1)
    gdiff = np.zeros(n + 1)
    bad = np.zeros(n + 1, dtype=np.int64)
    np.add.at(diff, parts.lo, parts.size)
    np.add.at(diff, parts.hi, -parts.size)
    g = (parts.size + 1.0) * parts.grad  # with its byte in SEND_GRAD's reached flags (fxpipe.runtime)
    np.add.at(gdiff, parts.lo, g)
    np.add.at(gdiff, parts.hi, -g)
    np.add.at(bad, parts.lo, parts.bad.astype(np.int64))
    np.add.at(bad, parts.hi, -parts.bad.astype(np.int64))
    cross = np.cumsum(diff)[: n - 1]
    cross_grad = np.cumsum(gdiff)[: n - 1]
    valid = np.cumsum(bad)[: n - 1] == 0
    t = parts.tensors
    col = lambda k: np.array([x[k] for x in t], dtype=np.float64)  # noqa: E731
    return Chain(parts.fwd, parts.bwd, parts.act, cross, cross_grad, valid, col(1), tuple(x[5] for x in t),
                 tuple(parts.names), col(2), col(3), col(4), tuple(x[0] for x in t), parts.weight_reads, col(6))


def _weight_reads(compute: list[fx.Node], pos: dict[str, int], act: np.ndarray,
                  params: dict[str, torch.Tensor]) -> np.ndarray:
    """Per compute node, the bytes zb's weight pass keeps of a micro-batch from its ``I`` to its
    ``W`` (:mod:`fxpipe.backward`): ``I`` frees what only the input-gradient chain saved, so what
    stays is what the nodes reading a trainable parameter saved, their activation inputs (``x`` of
    ``x @ W.T``, a norm's input), and the gradient ``I`` recorded flowing into each such node (an
    *anchor*), the size of its output. Each input counts once, at its first such reader; a view
    counts as the value it views. A node's other saved tensors (a norm's mean and rstd) are small
    beside these and not counted; inputs of the graph are the stage's input buffer, counted apart.
    ``pos``: each compute node's position; ``params``: the graph's parameters by name."""
    out = np.zeros(len(compute))
    seen: set[str] = set()
    for i, nd in enumerate(compute):
        if not any(t in params and params[t].requires_grad for t in nd.meta["fxpipe"].params):
            continue
        out[i] += act[i]  # the gradient recorded at the anchor
        for u in nd.all_input_nodes:
            while u.target is not operator.getitem and is_view(u) and u.args and isinstance(u.args[0], fx.Node):
                u = u.args[0]
            if u.name in pos and u.name not in seen:
                seen.add(u.name)
                out[i] += act[pos[u.name]]
    return out


def _float32_output(nd: fx.Node) -> bool:
    val = nd.meta.get("val")
    vals = val if isinstance(val, (tuple, list)) else (val,)
    return any(isinstance(v, torch.Tensor) and v.dtype == torch.float32 for v in vals)


def _assignment(gm: fx.GraphModule, bounds: Sequence[tuple[int, int]]) -> tuple[tuple[str, int], ...]:
    compute = [nd for nd in gm.graph.nodes if nd.op in _COMPUTE]
    stage_of: dict[str, int] = {}
    for s, (l, r) in enumerate(bounds):
        for nd in compute[l : r + 1]:
            stage_of[nd.name] = s
    last = len(bounds) - 1
    pairs = []
    for nd in gm.graph.nodes:
        if nd.op == "output":
            continue
        if nd.op not in _COMPUTE:
            # inputs and parameters live with their first reader; one read only by the output
            # (or by nobody) goes to the last/first stage
            users = [stage_of[u.name] for u in nd.users if u.name in stage_of]
            stage_of[nd.name] = min(users) if users else (last if nd.users else 0)
        pairs.append((nd.name, stage_of[nd.name]))
    return tuple(pairs)


# --------------------------------------------------------------------------------------------
# the planner


@dataclass(frozen=True)
class _Candidate:
    throughput: float
    step_time: float
    allreduce: float
    d: int
    w: int
    b: int
    m: int
    recompute: bool
    model: StageModel
    part: Partition | None
    chain: Chain
    grad_buffers: int  # gradient buffers the chain counts on every stage
    accelerators: int = 1
    fits: bool = True
    memory: float = 0.0  # bytes on the fullest stage
    pipe: float = 0.0  # seconds the pipeline computes per step
    compute: float = 0.0  # the slowest stage's compute per micro-batch (recomputation included)
    comm: float = 0.0  # the slowest stage's sends and receives per micro-batch
    inter: bool = False  # the slowest stage sends or receives across nodes
    layout: str = "replica"  # where the (stage, replica) pairs go among the ranks (fxpipe.schedule.rank_of)

    def key(self):
        # best first; ties: shallower, narrower, larger b, no recomputation
        return (-self.throughput, self.d, self.w, -self.b, self.recompute)

    @property
    def samples(self) -> int:
        return self.b * self.m * self.w


def pipeline_time(schedule: str, stages: int, microbatches: int, bottleneck: float,
                  forward: float | None = None, recompute: bool = False) -> float:
    """Steady-state time of one step when every stage takes ``bottleneck`` per micro-batch
    (forward + backward) and communication is free: 2bw never drains, so a step is m stage
    times; 1f1b and gpipe fill and drain the pipeline every step, m + d - 1. zb (ZB-H1, Qi et
    al. 2024, section 3) fills the drain with deferred weight passes, leaving
    ``m * bottleneck + (d - 1) * (F + I - W)``; with I = W (the simulator's default split of a
    backward) that is ``(d - 1) * forward``, ``forward`` defaulting to a third of the bottleneck
    (a backward of two forwards). With m < d fewer weight passes are left to fill the drain:
    ``max(d - m, 0) * W`` more. A recomputing zb stage defers no W, so zb with
    ``recompute`` is priced as 1f1b. Equal to what :func:`fxpipe.simulate.simulate` measures on
    the generated lists for gpipe, 1f1b and 2bw, and for zb where F = I = W (the default); with
    other zb passes (a weight pass longer than a forward) it is a lower bound the simulator can
    exceed by some percent, which is why a plan with a calibrated split of zb's backward takes
    its step time from the simulator (tests/unit/test_simulate.py, test_zero_bubble.py)."""
    if schedule == "zb" and not recompute:
        f = bottleneck / 3 if forward is None else forward
        w = (bottleneck - f) / 2  # I = W
        return microbatches * bottleneck + (stages - 1) * f + max(stages - microbatches, 0) * w
    return (microbatches if schedule == "2bw" else microbatches + stages - 1) * bottleneck


def _divisors(x: int) -> list[int]:
    return [k for k in range(1, x + 1) if x % k == 0]


def _positive(name: str, v, allow_none: bool = True, integer: bool = True):
    """``v`` checked: a positive int (``integer``: a count; a float such as 8.0 is refused, as
    ``range`` would) or a positive finite number of bytes; returned as int or float."""
    if v is None and allow_none:
        return None
    if integer:
        if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v <= 0:
            hint = f"{name}={int(v)}" if isinstance(v, float) and v.is_integer() and v > 0 else f"e.g. {name}=4"
            raise PlanError(f"{name} must be a positive integer, found {v!r} ({type(v).__name__}); pass {hint}")
        return int(v)
    if isinstance(v, bool) or not isinstance(v, numbers.Real) or not math.isfinite(v) or v <= 0:
        raise PlanError(f"{name} must be a positive, finite number of bytes, found {v!r}; pass e.g. {name}=16e9, "
                        f"or leave it None for the device's own memory")
    return float(v)


def reduction_time(cluster: Cluster, chain: Chain, bounds: Sequence[tuple[int, int]], width: int,
                   layout: str = "replica") -> float:
    """Seconds of the slowest gradient all-reduce of a step: each stage's data-parallel ring
    over its w replicas (its gradients in the master dtype, tied ones left out) and each tied
    weight's ring over its stages in every replica (as ``fxpipe.pipeline.Topology`` groups
    them), all running at once and sharing the node interfaces they cross
    (:meth:`fxpipe.cluster.Cluster.allreduce_time`)."""
    groups = _reductions(chain, bounds, width, layout)
    concurrent = [g for g, _ in groups]
    return max((cluster.allreduce_time(nbytes, g, concurrent) for g, nbytes in groups), default=0.0)


def _reductions(chain: Chain, bounds: Sequence[tuple[int, int]], width: int,
                layout: str) -> list[tuple[list[int], float]]:
    """The all-reduces of a step that move bytes, as (ranks, bytes): each stage's data-parallel
    ring first, in stage order (:func:`reduction_time`)."""
    d = len(bounds)
    stage_of = np.empty(chain.n, dtype=np.int64)
    for s, (l, r) in enumerate(bounds):
        stage_of[l : r + 1] = s
    dp = [0.0] * d
    tied: dict[tuple[int, ...], float] = {}
    for p, readers in enumerate(chain.tensor_readers):
        nbytes = float(chain.tensor_param_bytes[p])
        if nbytes <= 0:
            continue
        stages = tuple(sorted(set(stage_of[np.asarray(readers)].tolist())))
        if len(stages) == 1:
            dp[stages[0]] += nbytes
        else:
            tied[stages] = tied.get(stages, 0.0) + nbytes
    rank = lambda s, r: rank_of(s, r, d, width, layout)  # noqa: E731
    groups = [([rank(s, r) for r in range(width)], dp[s]) for s in range(d)]
    groups += [([rank(s, r) for r in range(width) for s in st], nbytes) for st, nbytes in tied.items()]
    return [(g, nbytes) for g, nbytes in groups if len(g) > 1 and nbytes > 0]


def _step(chain: Chain, model: StageModel, part: Partition, cluster: Cluster, schedule: str, m: int, width: int,
          layout: str) -> tuple[float, float, float, int]:
    """(step, pipeline time, all-reduce time, slowest stage) of a partition."""
    d = model.stages
    slow = max(range(d), key=lambda s: stage_time(chain, model, s, *part.bounds[s]))
    l, r = part.bounds[slow]
    pipe = pipeline_time(schedule, d, m, part.bottleneck, recompute=any(model.recompute),
                         forward=float(chain.fwd[l : r + 1].sum()))
    ar = reduction_time(cluster, chain, part.bounds, width, layout)
    return step_time(schedule, pipe, ar), pipe, ar, slow


def step_time(schedule: str, pipe: float, allreduce: float) -> float:
    """A step of ``pipe`` seconds of pipelining and an ``allreduce`` of the gradients: 2bw applies
    batch t's gradients one step later, so the all-reduce overlaps the next batch (PipeDream-2BW
    §3.1); the flushing schedules wait for it."""
    return max(pipe, allreduce) if schedule == "2bw" else pipe + allreduce


def _cut_for_reduction(chain: Chain, model: StageModel, part: Partition, cluster: Cluster, schedule: str, m: int,
                       width: int, layout: str) -> tuple[Partition, tuple[float, float, float, int]]:
    """``part`` (the min-max compute partition), or cuts that shorten the step by all-reducing
    fewer bytes on the stage whose ring is slowest, when the all-reduce is part of the step:
    under 2bw where it outlasts the pipeline, under the flushing schedules wherever there is
    one. The exact solver balances compute; a layer's parameters need not follow its compute
    (an embedding, a tied head), and at large width the all-reduce can be the step (GPT-1.3B
    on 64 V100s at d = 4, w = 16, ``benchmarks/planning.py``).

    A search over the all-reduce time ``A``: each stage's parameter bytes are capped at what
    its ring moves in ``A`` (the ring all-reduce is affine in its bytes), the solver finds the
    min-max compute partition under those caps (:meth:`_Solver.capped`), and the step is
    priced exactly (:func:`_step`, tied weights' rings included). Under 2bw, ``max(pipeline,
    all-reduce)``: the pipeline time only falls as ``A`` grows, so bisection finds where the two
    meet; the flushing schedules' sum is scanned on a grid, then around its best point. Each
    search step solves to within ``_REDUCTION_TOL``, as the bisection ends. Returns the
    partition with the shortest step priced (``part`` on ties) and its :func:`_step`."""
    priced = _step(chain, model, part, cluster, schedule, m, width, layout)
    _, pipe0, ar0, _ = priced
    if width <= 1 or ar0 <= 0 or (schedule == "2bw" and ar0 <= pipe0):
        return part, priced
    groups = _reductions(chain, part.bounds, width, layout)
    concurrent = [g for g, _ in groups]
    ring = lambda s: [rank_of(s, r, model.stages, width, layout) for r in range(width)]  # noqa: E731
    x0 = 1e9  # per stage, seconds = a * bytes + c
    affine = []
    for s in range(model.stages):
        t1, t2 = cluster.allreduce_time(x0, ring(s), concurrent), cluster.allreduce_time(2 * x0, ring(s), concurrent)
        affine.append(((t2 - t1) / x0, 2 * t1 - t2))
    if any(a <= 0 for a, _ in affine):
        return part, priced
    base = _Solver(chain, model)
    best = (priced[0], 0, part, priced)  # (step, order found, partition, its _step)
    tried: dict[float, tuple[float, float, float, int] | None] = {}  # A -> _step under its caps, None: no cut fits

    def price(A: float) -> tuple[float, float, float, int] | None:
        nonlocal best
        if A not in tried:
            got = base.capped([max(0.0, (A - c) / a) for a, c in affine]).solve(_REDUCTION_TOL)
            tried[A] = None if got is None else _step(chain, model, got, cluster, schedule, m, width, layout)
            if got is not None:
                best = min(best, (tried[A][0], len(tried), got, tried[A]), key=lambda x: x[:2])
        return tried[A]

    # no cut does better: the stages' caps at A must hold every parameter that has one ring
    lo = min(c for _, c in affine) + _untied_param_bytes(chain) / sum(1 / a for a, _ in affine)
    hi = ar0
    if schedule == "2bw":
        for _ in range(_REDUCTION_PROBES):
            if hi - lo <= _REDUCTION_TOL * hi:
                break
            A = 0.5 * (lo + hi)
            got = price(A)
            if got is None or got[1] > A:  # the caps leave no partition, or the pipeline is the step
                lo = A
            else:
                hi = A
    else:
        for _ in range(2):  # a grid, then a finer one around its best point
            grid = np.linspace(lo, hi, _REDUCTION_PROBES // 2 + 1).tolist()
            steps = [(price(A) or (math.inf,))[0] for A in grid]
            i = int(np.argmin(steps))
            lo, hi = grid[max(i - 1, 0)], grid[min(i + 1, len(grid) - 1)]
    return best[2], best[3]


class _GraphSource:
    """Chains of a traced, costed graph, one per (micro-batch size, gradient buffers)."""

    def __init__(self, gm: fx.GraphModule, costs: GraphCosts, **chain_kw):
        self.gm, self.costs, self.chain_kw = gm, costs, chain_kw
        self.n = sum(1 for nd in gm.graph.nodes if nd.op in _COMPUTE)
        self.batch_size = costs.batch_size
        self._chains: dict[tuple[int, int], Chain] = {}

    def chain(self, batch: int, grad_buffers: int) -> Chain:
        if (batch, grad_buffers) not in self._chains:
            self._chains[batch, grad_buffers] = chain_from_graph(self.gm, self.costs, batch, grad_buffers=grad_buffers,
                                                                 **self.chain_kw)
        return self._chains[batch, grad_buffers]

    def per_sample(self, batch: int) -> float:
        """Forward + backward seconds of one sample on one device at micro-batch size ``batch``."""
        return (self.costs.total("fwd_time", batch) + self.costs.total("bwd_time", batch)) / batch

    def untied_param_bytes(self) -> float:
        """Bytes of the parameters one node reads (the gradients data parallelism reduces)."""
        return _untied_param_bytes(self.chain(self.batch_size, 1))


def _untied_param_bytes(chain: Chain) -> float:
    return float(sum(chain.tensor_param_bytes[p] for p, rd in enumerate(chain.tensor_readers) if len(rd) == 1))


@dataclass
class _Search:
    candidates: list[_Candidate]  # every configuration priced, best first (those that fit before)
    depths: list[int]
    #: the configurations no partition fits, as (N, d, w, b, m, recompute): what plan's error prices
    missed: list[tuple[int, int, int, int, int, bool]] = field(default_factory=list)


class _NoFit(Exception):
    """No partition of a configuration fits the memory limit (the search goes on without it)."""


def _configs(world: int, depths: Sequence[int], global_batch: int | None, microbatches: int | None, traced_b: int,
             schedule: str = "gpipe", nodes: int | None = None, cuts: int | None = None,
             lookahead: int = 0) -> tuple[list[tuple[int, int, int, int]], dict[int, str]]:
    """(d, w, b, m) for every depth of ``depths`` on ``world`` devices, and for each depth that
    gives none, why: its width does not divide the global batch (or w·m does not), it has more
    stages than the graph has compute nodes or allowed cuts, or (not gpipe) fewer micro-batches
    than stages (2bw with a ``lookahead``: than d + lookahead)."""
    out, why = [], {}
    for d in depths:
        w = world // d
        if nodes is not None and d > nodes:
            why[d] = f"d={d} has more stages than the graph's {nodes} compute nodes"
            continue
        if cuts is not None and d - 1 > cuts:
            why[d] = f"d={d} needs {d - 1} cuts but the graph allows only {cuts} (a cut must cross single tensors only)"
            continue
        if global_batch is None:
            got = [(d, w, traced_b, microbatches)]
        elif global_batch % w:
            why[d] = (f"global_batch {global_batch} is not divisible by the data-parallel width w={w} (world_size "
                      f"{world} / {d} stages); use a multiple of {w}")
            continue
        elif microbatches is not None:
            per = global_batch // w
            if per % microbatches:
                why[d] = (f"d={d}: global_batch {global_batch} is not divisible by w*m = {w * microbatches} (w={w}); "
                          f"pick global_batch as a multiple of {w * microbatches}")
                continue
            got = [(d, w, per // microbatches, microbatches)]
        else:
            per = global_batch // w
            got = [(d, w, bb, per // bb) for bb in _divisors(per)]
        if (least := min_microbatches(schedule, d, lookahead)) > 1:
            most = max(c[3] for c in got)
            got = [c for c in got if c[3] >= least]
            if not got:
                need = "d" if not lookahead else f"d + lookahead = {least}"
                why[d] = (f"d={d}: {schedule!r} needs at least {need} micro-batches, found at most m={most}; use "
                          f"microbatches >= {least}" + ("" if global_batch is None else f" (global_batch >= {least * w})"))
                continue
        out += got
    return out, why


def _price(source, cluster: Cluster, schedule: str, limit: float, clip: bool, world: int,
           d: int, w: int, b: int, m: int, rc: bool, device: DeviceModel, fit: bool = True,
           layout: str = "replica", lookahead: int = 0, chunks: int = 1) -> _Candidate:
    """One configuration, partitioned under the memory limit (``fit``) or without one (to report
    what a configuration that does not fit would need and give). Raises :class:`_NoFit` when
    ``fit`` and nothing fits."""
    grad_buffers = gradient_buffers(schedule, reduces=w > 1 or clip)
    chain = source.chain(b, grad_buffers)
    links = stage_links(cluster, d, w, layout)
    sm = StageModel.for_schedule(schedule, d, m, rc, device, limit if fit else math.inf, links, cluster.overlap_p2p,
                                 lookahead, chunks)
    _check_depth(chain, d)
    part = _Solver(chain, sm).solve()
    if part is None:
        raise _NoFit()
    if fit and _over_with_tied_buffers(chain, sm, part, limit, schedule, grad_buffers):
        # A 2bw stage holding a copy of a tied weight keeps a second gradient buffer (its tied
        # all-reduce overlaps the next batch); where that breaks the limit, plan every stage
        # with two, a safe bound the chain formulation can express.
        grad_buffers = 2
        chain = source.chain(b, grad_buffers)
        part = _Solver(chain, sm).solve()
        if part is None:
            raise _NoFit()
    part, (step, pipe, ar, slow) = _cut_for_reduction(chain, sm, part, cluster, schedule, m, w, layout)
    tied = _second_buffer_stages(chain, part.bounds, schedule, grad_buffers)
    mems = []
    for s, (l, r) in enumerate(part.bounds):
        extra = float(sum(chain.tensor_grad_bytes[p] for p in _held(chain, l, r))) if s in tied else 0.0
        mems.append(stage_memory(chain, sm, s, l, r) + extra)
    l, r = part.bounds[slow]
    comm = _comm(chain, sm, l - 1, slow - 1) + _comm(chain, sm, r, slow)
    across = crossing_stages(cluster, d, w, layout)
    inter = any(k in across for k in (slow - 1, slow))
    memory = max(mems)
    return _Candidate(b * m * w / step, step, ar, d, w, b, m, rc, sm, part, chain, grad_buffers, world,
                      memory <= limit * (1 + 1e-9), memory, pipe, stage_compute(chain, sm, slow, l, r), comm, inter,
                      layout)


def _search(source, cluster: Cluster, device: DeviceModel, *, schedule: str, limit: float, worlds: Sequence[int],
            stages: int | None, microbatches: int | None, global_batch: int | None, recompute: bool | None,
            clip: bool, lookahead: int = 0, chunks: int = 1) -> _Search:
    """The paper's Algorithm 1 over every world size N of ``worlds``: every depth d dividing N
    (width w = N / d), every micro-batch size b filling the global batch, with and without
    recomputation; what fits ``limit`` competes on predicted throughput.

    Branch and bound: each (N, d, b) has an upper bound on its throughput (perfect balance, no
    recomputation, no communication, and the data-parallel all-reduce of its parameters spread
    evenly over the stages, :func:`_bound`); configurations are priced best bound first, and
    the search stops once no bound beats the best found. A configuration that does not fit
    costs one feasibility test: memory need not grow with b (gpipe holds all m = G / (w·b)
    micro-batches, and a part of a micro-batch's activations may not depend on b), so every b
    is tried. For each (N, d, recomputation) where none fits, the first such configuration is
    priced once more without the limit (reported, never chosen). Raises PlanError naming why
    each depth is out when no configuration is left to search."""
    n = source.n
    cuts = int(source.chain(source.batch_size, 1).valid.sum())
    configs, why = [], {}
    for world in sorted(set(worlds), reverse=True):
        depths = [stages] if stages is not None else _divisors(world)
        got, out = _configs(world, depths, global_batch, microbatches, source.batch_size, schedule, n, cuts, lookahead)
        configs += [(world, *c) for c in got]
        why.update({(world, d): reason for d, reason in out.items()})
    if not configs:
        searched = (f"stages={stages}" if stages is not None else
                    f"every depth d dividing world_size {worlds[0]}" if len(worlds) == 1 else
                    f"every depth of {sorted(set(worlds))} devices")
        raise PlanError(f"no configuration is left to search ({searched}): " + "; ".join(why.values()))
    bounds = {c: _bound(source, cluster, schedule, *c) for c in configs}
    configs.sort(key=lambda c: (-bounds[c], c[1], c[2], -c[3]))
    found: list[_Candidate] = []
    missed: list[tuple[int, int, int, int, int, bool]] = []
    best = 0.0
    for world, d, w, bb, m in configs:
        if bounds[world, d, w, bb, m] < best * (1 - 1e-9):
            break
        for rc in ([False, True] if recompute is None else [bool(recompute)]):
            if rc and recompute is None and not any(StageModel.for_schedule(schedule, d, m, True, device,
                                                                           chunks=chunks).recompute):
                continue  # d == 1 under 1f1b/2bw: recomputation is off everywhere, same as rc=False
            try:
                c = max((_price(source, cluster, schedule, limit, clip, world, d, w, bb, m, rc, device, layout=lay,
                                lookahead=lookahead, chunks=chunks) for lay in _layouts(cluster, d, w)),
                        key=lambda x: x.throughput)
            except _NoFit:
                missed.append((world, d, w, bb, m, rc))
                continue
            found.append(c)
            best = max(best, c.throughput)
    found.sort(key=_Candidate.key)
    # what the rows report of a depth where nothing fits: its first configuration (best bound)
    # that did not, priced without the limit on its best layout, as a fitting one is
    fitting = {(c.accelerators, c.d, c.recompute) for c in found}
    shown: dict[tuple[int, int, bool], _Candidate] = {}
    for world, d, w, bb, m, rc in missed:
        if (world, d, rc) not in fitting and (world, d, rc) not in shown:
            c = max((_price(source, cluster, schedule, limit, clip, world, d, w, bb, m, rc, device, fit=False,
                            layout=lay, lookahead=lookahead, chunks=chunks) for lay in _layouts(cluster, d, w)),
                    key=lambda x: x.throughput)
            shown[world, d, rc] = dataclasses.replace(c, fits=False)
    return _Search(found + sorted(shown.values(), key=_Candidate.key), sorted({c[1] for c in configs}), missed)


def _no_fit_message(source, cluster: Cluster, device: DeviceModel, found: _Search, *, schedule: str, clip: bool,
                    limit: float, where: str, recompute: bool | None, global_batch: int | None,
                    lookahead: int = 0, chunks: int = 1) -> str:
    """plan's error when nothing fits: the least memory that does (a number the search accepts
    when given as device_memory), with its configuration, and what else would help."""
    need, cfg = _smallest_fit(source, cluster, device, schedule, clip, found.missed, lookahead, chunks)
    head = (f"no configuration fits in {megabytes(limit)} per device{where} (searched d in {found.depths}, "
            f"recompute {'on/off' if recompute is None else recompute})")
    if cfg is None:
        return head + "; give more memory or more devices"
    world, d, w, b, m, rc = cfg
    advice = [f"Give device_memory >= {need} bytes (fxpipe.plan(device_memory=...), fxpipe plan --device-memory, "
              f"fxpipe.compile(device_model=fxpipe.cost.DeviceModel.for_device(device, memory_bytes=...)); "
              f"it fits d={d}, w={w}, b={b}, m={m} {'with' if rc else 'without'} recomputation)", "more devices"]
    if recompute is False:
        advice.append("recompute=None (recomputation holds one micro-batch's activations, not all in flight)")
    if lookahead:
        advice.append("lookahead=0 (each forward of lookahead holds one more micro-batch's activations)")
    if global_batch is None:
        advice.append("a smaller micro-batch (an example of fewer samples)")
    elif schedule == "gpipe":  # every b was searched; gpipe holds all m = global_batch / (w·b) micro-batches
        advice.append("a smaller global_batch (gpipe holds all of a step's micro-batches at once)")
    return f"{head}; the smallest memory that fits is {megabytes(need)}. " + ", ".join(advice[:-1]) + f" or {advice[-1]}."


def _smallest_fit(source, cluster: Cluster, device: DeviceModel, schedule: str, clip: bool,
                  missed: Sequence[tuple[int, int, int, int, int, bool]], lookahead: int = 0,
                  chunks: int = 1) -> tuple[int, tuple | None]:
    """The least whole number of bytes per device under which the search fits one of the
    ``missed`` configurations, and that configuration. Each has a lower bound, the least limit
    under which a partition of its chain fits (:func:`min_memory`); from the lowest up, the
    bound is checked with the search's own pricing (:func:`_price`: a 2bw stage that shares a tied
    weight keeps a second gradient buffer, which the chain counts on every stage once it
    matters), and where that fails, the least limit it accepts is bisected between the bound
    and one it accepts (the chain with two gradient buffers everywhere, whose bound it always
    accepts)."""

    def model(world, d, w, m, rc, limit):
        return StageModel.for_schedule(schedule, d, m, rc, device, limit, stage_links(cluster, d, w), cluster.overlap_p2p,
                                       lookahead, chunks)

    def fits(cfg, limit: int) -> bool:
        world, d, w, b, m, rc = cfg
        for lay in _layouts(cluster, d, w):
            try:
                if _price(source, cluster, schedule, float(limit), clip, world, d, w, b, m, rc, device, layout=lay,
                          lookahead=lookahead, chunks=chunks).fits:
                    return True
            except _NoFit:
                pass
        return False

    lows = []
    for cfg in missed:
        world, d, w, b, m, rc = cfg
        chain = source.chain(b, gradient_buffers(schedule, reduces=w > 1 or clip))
        lows.append((math.ceil(min_memory(chain, model(world, d, w, m, rc, math.inf))), cfg))
    best: tuple[int, tuple | None] = (math.inf, None)  # type: ignore[assignment]
    for low, cfg in sorted(lows):
        if low >= best[0]:
            break
        if fits(cfg, low):
            best = (low, cfg)
            continue
        world, d, w, b, m, rc = cfg
        hi = max(low + 1, math.ceil(min_memory(source.chain(b, 2), model(world, d, w, m, rc, math.inf))))
        while not fits(cfg, hi):
            hi *= 2
        lo = low
        while hi - lo > max(1, 1e-6 * hi):
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if fits(cfg, mid) else (mid, hi)
        best = min(best, (hi, cfg))
    return best


def _layouts(cluster: Cluster, d: int, w: int) -> tuple[str, ...]:
    """The rank layouts worth pricing: stage-major differs from replica-major only when both d
    and w exceed 1 and the ranks span more than one node."""
    return ("replica", "stage") if d > 1 and w > 1 and d * w > cluster.per_node else ("replica",)


def _bound(source, cluster: Cluster, schedule: str, world: int, d: int, w: int, b: int, m: int) -> float:
    """An upper bound on the throughput of (N, d, w, b, m): compute perfectly balanced over the
    stages without recomputation or communication, and the data-parallel all-reduce no shorter
    than that of an even share of the parameters read by one node only (tied ones left out)."""
    per_micro = source.per_sample(b) * b / d
    # zb: m stage times at least (its drain's share depends on the forward, unknown here)
    pipe = m * per_micro if schedule == "zb" else pipeline_time(schedule, d, m, per_micro)
    ar = 0.0
    if w > 1:
        share = source.untied_param_bytes() / d
        ar = math.inf
        for layout in _layouts(cluster, d, w):  # a bound for every layout the search prices
            groups = [[rank_of(s, r, d, w, layout) for r in range(w)] for s in range(d)]
            ar = min(ar, min(cluster.allreduce_time(share, g, groups) for g in groups))
    return b * m * w / step_time(schedule, pipe, ar)


def _reason(c: _Candidate, win: _Candidate, schedule: str, limit: float) -> str:
    """Why ``c`` lost to ``win``: the part of its time per sample that grew the most."""
    if c is win:
        return "chosen"
    if not c.fits:
        return f"does not fit: needs {c.memory / 1e9:.2f} GB > {limit / 1e9:.2f} GB"

    def parts(x: _Candidate) -> dict[str, float]:
        # a step is m stage times (each the slowest stage's compute and the sends it does not
        # hide: with overlap_p2p only what outlasts the compute) plus the fill and drain the
        # schedule adds to them: none under 2bw, (d - 1) stage times under 1f1b and gpipe, zb's
        # (d - 1) forwards; plus the all-reduce the step waits for
        stage = x.part.bottleneck
        out = {"compute": x.m * x.compute, "comm": x.m * max(0.0, stage - x.compute),
               "allreduce": max(0.0, x.allreduce - x.pipe) if schedule == "2bw" else x.allreduce}
        if schedule != "2bw":
            out["bubble"] = max(0.0, x.pipe - x.m * stage)
        return {k: v / x.samples for k, v in out.items()}

    if c.throughput >= win.throughput * (1 - 1e-9):
        return "a tie: the tie-break prefers shallower, narrower, larger b, no recomputation"
    pc, pw = parts(c), parts(win)
    k = max(pc, key=lambda k: pc[k] - pw[k])
    lag = 1 - c.throughput / win.throughput
    slower = f"{lag:.2%} slower" if lag < 0.01 else f"{lag:.1%} slower"
    if k == "compute":
        why = [f"slowest stage computes {c.compute * 1e3:.3g} ms per micro-batch of {c.b}"]
        if c.recompute and not win.recompute:
            why.append("recomputation")
        if c.accelerators < win.accelerators:
            why.append(f"{c.accelerators} accelerators, not {win.accelerators}")
        elif c.b < win.b:
            why.append("a smaller micro-batch pays more per-operator overhead")
        return f"{slower}: " + "; ".join(why)
    if k == "comm":
        where = "across nodes" if c.inter else "inside a node"
        exposed = c.part.bottleneck - c.compute
        if exposed < c.comm * (1 - 1e-9):  # overlap_p2p: the sends hide behind the compute but for this
            return (f"{slower}: slowest stage sends {c.comm * 1e3:.3g} ms per micro-batch {where}; its busiest "
                    f"link outlasts its compute by {exposed * 1e3:.3g} ms")
        return f"{slower}: slowest stage sends {c.comm * 1e3:.3g} ms per micro-batch {where}"
    if k == "bubble":
        return f"{slower}: pipeline fill and drain idle {(c.pipe - c.m * c.part.bottleneck) / c.pipe:.0%} of the step"
    over = f", {c.allreduce - c.pipe:.3g} s more than the pipeline's {c.pipe:.3g} s" if schedule == "2bw" else ""
    return f"{slower}: gradient all-reduce {c.allreduce:.3g} s over {c.w} replicas{over}"


def _configuration_rows(cands: Sequence[_Candidate], win: _Candidate, schedule: str, limit: float,
                        top: int) -> tuple[Configuration, ...]:
    """The best configuration of each (N, d) (those that fit first), best first, at most
    ``top`` of them, the chosen one always among them."""
    best: dict[tuple[int, int], _Candidate] = {}
    for c in cands:  # fitting ones first, each best first
        best.setdefault((c.accelerators, c.d), c)
    best[win.accelerators, win.d] = win
    rows = sorted(best.values(), key=lambda c: (-c.throughput, c.d, c.w))
    keep = [c for c in rows if c is not win][: max(top - 1, 0)] + [win]
    keep.sort(key=lambda c: (-c.throughput, c.d, c.w))
    return tuple(Configuration(c.accelerators, c.d, c.w, c.b, c.m, c.recompute, c.throughput, c.step_time, c.pipe,
                               c.allreduce, c.memory, c.fits, _reason(c, win, schedule, limit)) for c in keep)


def plan(
    model_or_gm: nn.Module | fx.GraphModule,
    example_inputs=None,
    *,
    stages: int | None = None,
    microbatches: int | None = None,
    schedule: str = "2bw",
    world_size: int | None = None,
    global_batch: int | None = None,
    device_memory: float | None = None,
    cost_mode: str = "analytic",
    device: DeviceModel | None = None,
    recompute: bool | None = None,
    costs: GraphCosts | None = None,
    optimizer_bytes_per_param: float = 8.0,
    torch_device: str | torch.device | None = None,
    clip: bool | None = None,
    accumulation: str | None = None,
    precision: str = "fp32",
    cluster: Cluster | str | None = None,
    top: int = 8,
    leaf_modules=(),
    lookahead: int | None = None,
    chunks: int = 1,
    _chunks: int = 1,
) -> Plan:
    """Trace (if needed), cost and partition a model; return the best :class:`Plan`.

    ``stages`` fixes the depth d (width ``w = world_size / d``, or 1); ``stages=None`` searches
    every d dividing ``world_size`` (default: the process group's size, else 1). ``recompute``
    None lets the planner decide. ``global_batch`` (samples per optimizer step over all replicas)
    makes the planner also choose the micro-batch size b, with ``m = global_batch / (b * w)``;
    otherwise b is the traced batch size and m is ``microbatches``. ``device_memory`` (bytes)
    overrides ``device.memory_bytes``. ``costs`` reuses an earlier :func:`fxpipe.cost.annotate`.
    ``clip``: a global-norm all-reduce runs every step (``fxpipe.compile`` always runs one: it
    clips and checks for non-finite values); like data parallelism (w > 1) this makes every 2bw
    stage keep a second gradient buffer, which the memory model then counts (a flush schedule
    keeps one: :func:`fxpipe.schedule.gradient_buffers`). None: True with a
    ``cluster`` (a plan for a real run counts what ``compile`` will hold), else False.
    ``accumulation``: ``"autograd"`` (torch.optim), ``"fused"`` (the kernels' path, one more
    scratch gradient per stage) or ``"optimizer"`` (AdamA); see :func:`fxpipe.weights.weight_bytes`.
    None: ``"fused"`` with a ``cluster`` (``compile`` runs the fused kernels on its GPUs), else
    ``"autograd"``.
    ``precision``: ``"fp32"``, ``"bf16"`` or ``"fp16"`` (``fxpipe.compile``'s); the memory model
    counts the master weights, the 2-byte compute versions and compute-dtype activations.

    ``cluster`` (a :class:`fxpipe.Cluster`, a preset name or a .json/.toml path) plans for
    machines other than this one: operators cost at its accelerators' achievable FLOP/s in
    ``precision``'s dtype, stages fill its memory, and communication is priced on the runtime's
    placement over its links (:mod:`fxpipe.cluster`). Without ``world_size`` the search also
    chooses how many of its accelerators to use (N = d·w up to its size). The model may be
    built on the meta device (with meta example inputs): nothing is allocated.
    ``top``: how many configurations ``plan.configurations`` keeps (the best of each (N, d)).
    ``leaf_modules``: as ``fxpipe.compile``'s (:func:`fxpipe.trace`'s), for a model traced here;
    a GraphModule from :func:`fxpipe.trace` was captured with its own.
    ``lookahead`` (2bw, 1f1b): forwards every stage but the last runs ahead of 1F1B's order, each
    holding one more micro-batch's activations there (:func:`fxpipe.schedule.warmup`); None: 1
    under 2bw where the chosen configuration still fits with it at the same cuts and m >= d + 1
    (:func:`_with_lookahead`), else 0.
    ``chunks`` (1f1b only): stages per rank, interleaved 1F1B (:func:`fxpipe.schedule.lane_of`);
    ``stages`` (required then) counts them all, so a replica runs on ``stages / chunks`` ranks
    (:func:`_interleaved_plan`).
    """
    if schedule not in SCHEDULES:
        raise PlanError(f"schedule must be one of {SCHEDULES}, found {schedule!r}")
    if chunks != 1:
        return _interleaved_plan(
            model_or_gm, example_inputs, stages=stages, microbatches=microbatches, schedule=schedule,
            world_size=world_size, global_batch=global_batch, device_memory=device_memory, cost_mode=cost_mode,
            device=device, recompute=recompute, costs=costs, optimizer_bytes_per_param=optimizer_bytes_per_param,
            torch_device=torch_device, clip=clip, accumulation=accumulation, precision=precision, cluster=cluster,
            top=top, leaf_modules=leaf_modules, lookahead=lookahead, chunks=chunks)
    if lookahead is not None:
        try:
            check_lookahead(schedule, lookahead)
        except ScheduleError as e:
            raise PlanError(str(e)) from None
    if accumulation is None:
        accumulation = "autograd" if cluster is None else "fused"
    if accumulation not in ("autograd", "fused", "optimizer"):
        raise PlanError(f"accumulation must be 'autograd', 'fused' or 'optimizer' (AdamA), found {accumulation!r}")
    if precision not in PRECISIONS:
        raise PlanError(f"precision must be one of {sorted(PRECISIONS)}, found {precision!r}")
    if cost_mode not in ("analytic", "measured"):
        raise PlanError(f"cost_mode must be 'analytic' or 'measured', found {cost_mode!r}")
    if recompute not in (None, True, False):
        raise PlanError(f"recompute must be True, False or None (the planner decides), found {recompute!r}")
    stages, microbatches, world_size, global_batch = (_positive(name, v) for name, v in (
        ("stages", stages), ("microbatches", microbatches), ("world_size", world_size), ("global_batch", global_batch)))
    top = _positive("top", top, allow_none=False)
    device_memory = _positive("device_memory", device_memory, integer=False)
    if microbatches is None and global_batch is None:
        raise PlanError("fxpipe.plan: give microbatches=m (micro-batches per step) or global_batch=N (samples per "
                        "step), found neither; pass e.g. microbatches=8 (fxpipe.compile's default)")
    cluster = Cluster.resolve(cluster)
    if cluster is not None and device is not None:
        raise PlanError(
            f"give cluster= or device=, not both: found cluster {cluster.name!r} and device {device.name!r}; a "
            f"cluster describes its own accelerators (Cluster.from_device_model(device) makes one of a DeviceModel)"
        )
    gm = _graph_of(model_or_gm, example_inputs, leaf_modules)
    if cost_mode == "measured" and costs is None and cluster is not None:
        raise PlanError(
            f"cost_mode='measured' times every operator on this machine, not on {cluster.name}'s accelerators, "
            f"found both; plan for a cluster with cost_mode='analytic' (its accelerators' FLOP/s), after "
            f"measuring its efficiency on one of them with Cluster.calibrate if you have one"
        )
    if cost_mode == "measured" and costs is None and _on_meta(gm):
        raise PlanError(
            "cost_mode='measured' runs every operator on real tensors, but the model is on the meta device (found "
            "meta parameters); plan a meta model with cost_mode='analytic', or calibrate the cluster on a real "
            "accelerator (Cluster.calibrate) and plan analytically"
        )
    given_cluster = cluster is not None
    cluster, worlds, device = _worlds(cluster, world_size, stages, device, torch_device, precision)
    if clip is None:
        clip = given_cluster
    if given_cluster:
        cluster.check_memory(device_memory)
    # an interleaved plan's stages (:func:`_interleaved_plan`): each in its share of a rank's memory
    limit = (float(device_memory) if device_memory is not None else device.memory_bytes) / _chunks
    if costs is None:
        costs = annotate(gm, example_inputs, mode=cost_mode, device=device, torch_device=torch_device)
        if cost_mode == "measured" and global_batch is not None and gm is not model_or_gm:  # traced here
            costs = _measure_second_size(model_or_gm, gm, example_inputs, costs, device, torch_device)

    source = _GraphSource(gm, costs, schedule=schedule, optimizer_bytes_per_param=optimizer_bytes_per_param,
                          accumulation=accumulation, precision=precision)
    if stages is not None:
        _check_depth(source.chain(source.batch_size, 1), stages)
        if microbatches is not None and microbatches < (least := min_microbatches(schedule, stages, lookahead or 0)):
            if least > stages:  # a lookahead asks for more
                fewer = f" or lookahead={microbatches - stages}" if microbatches >= stages else ""
                raise PlanError(
                    f"schedule {schedule!r} with lookahead={lookahead} needs at least stages + lookahead micro-batches: "
                    f"found microbatches={microbatches} < {least}; use microbatches >= {least}{fewer}"
                )
            raise PlanError(
                f"schedule {schedule!r} needs at least as many micro-batches as stages: found microbatches="
                f"{microbatches} < stages={stages}; use microbatches >= {stages}"
            )
    found = _search(source, cluster, device, schedule=schedule, limit=limit, worlds=worlds, stages=stages,
                    microbatches=microbatches, global_batch=global_batch, recompute=recompute, clip=clip,
                    lookahead=lookahead or 0, chunks=_chunks)
    fits = [c for c in found.candidates if c.fits]
    if not fits:
        raise PlanError(_no_fit_message(source, cluster, device, found, schedule=schedule, clip=clip, limit=limit,
                                        where=f" of {cluster.name}" if given_cluster else "", recompute=recompute,
                                        global_batch=global_batch, lookahead=lookahead or 0, chunks=_chunks))
    shared = device.host_cores is not None and device.host_cores < fits[0].d * fits[0].w
    split = schedule == "zb" and (device.backward_input_share, device.backward_weight_share) != (0.5, 0.5)
    def ahead(c: _Candidate) -> _Candidate:  # the planner's lookahead, where the caller gave none
        return c if lookahead is not None else _with_lookahead(c, source, cluster, device, schedule=schedule,
                                                                 limit=limit, clip=clip)

    if shared or split or _chunks > 1:  # the closed form does not hold: choose by the simulator
        found = _simulated(found, gm, device, cluster if given_cluster else None, schedule=schedule, chunks=_chunks,
                           precision=precision, ahead=ahead)
        fits = [c for c in found.candidates if c.fits]
    best = ahead(fits[0])
    plan = _plan_of(best, fits, found, gm, model_or_gm, example_inputs, costs, device, cluster, given_cluster,
                    schedule=schedule, precision=precision, limit=limit, top=top)
    if shared or split or _chunks > 1:
        # an interleaved rank runs its stages in turn: its cuts move to balance the ranks' sums
        plan = _simulated_cuts(plan, gm, best, cluster, limit, move=split or _chunks > 1, chunks=_chunks)
    return plan


def _interleaved_plan(model_or_gm, example_inputs, *, stages, microbatches, world_size, chunks, cluster, lookahead,
                      schedule, global_batch, **options) -> Plan:
    """:func:`plan` for interleaved 1F1B (``chunks`` stages per rank): the ``stages`` stages of a
    pipeline of that depth over a world ``chunks`` times the real one, each given ``1 / chunks``
    of a rank's memory (a rank holds ``chunks`` of them; a stage that needs more does not fit,
    even where its rank's other stages would leave room). The solver's cuts then move to the
    shortest step of the interleaved lists simulated on the real ranks, each running its stages
    in turn (:func:`_simulated_cuts`), which is the plan's step time and throughput."""
    import dataclasses

    if stages is None:
        raise PlanError(f"chunks={chunks} needs stages= (every stage, {chunks} per rank): the planner does not search "
                        f"interleaved depths; pass e.g. stages={2 * chunks} for {2} ranks per replica")
    if cluster is not None:
        raise PlanError(f"chunks={chunks} (interleaved 1F1B) is planned for this machine only, not for a cluster: "
                        f"plan without cluster=, or with chunks=1")
    try:
        check_chunks(schedule, stages, microbatches or stages, chunks, lookahead or 0)
        if global_batch is not None:
            raise ScheduleError(f"chunks={chunks} takes microbatches=, not global_batch= (m must be a multiple of the "
                                f"{stages // chunks} ranks per replica)")
    except ScheduleError as e:
        raise PlanError(str(e)) from None
    if world_size is None:
        import torch.distributed as dist

        world_size = dist.get_world_size() if dist.is_available() and dist.is_initialized() else stages // chunks
    inner = plan(model_or_gm, example_inputs, stages=stages, microbatches=microbatches, schedule=schedule,
                 world_size=world_size * chunks, lookahead=lookahead, _chunks=chunks, **options)
    return dataclasses.replace(inner, chunks=chunks, runner_up=None, configurations=())


#: The lookahead the planner gives where it is free (:func:`_with_lookahead`), by schedule. 2bw
#: never drains, so its ranks run in lock-step all run long and every hiccup of one idles the
#: other; one forward ahead absorbs them (benchmarks/README.md, "Lookahead": on the pinned
#: configuration the ranks' waiting on each other fell to about a third). Under 1f1b the drain's
#: bubble dominates the waiting and the same measurement showed no gain, so it stays at 1F1B's
#: order unless asked.
AUTO_LOOKAHEAD = {"2bw": 1}


def _with_lookahead(best: _Candidate, source, cluster: Cluster, device: DeviceModel, *, schedule: str, limit: float,
                    clip: bool) -> _Candidate:
    """``best`` with :data:`AUTO_LOOKAHEAD`'s lookahead where it is free: the schedule takes
    one, m >= d + lookahead, and the configuration priced with it still fits ``limit``, with the
    solver (given the lookahead's memory) returning the same cuts and gradient buffers (its extra
    activations change nothing else; a lookahead that would move a cut to fit is not taken). Its
    cuts and closed-form time stay ``best``'s; its stage model and memory are the lookahead's
    (where the planner simulates, it simulates the lists with the lookahead,
    :func:`_simulated`)."""
    ahead = AUTO_LOOKAHEAD.get(schedule, 0)
    if not ahead or best.d == 1 or best.model.lookahead == ahead or best.m < min_microbatches(schedule, best.d, ahead):
        return best
    try:
        c = _price(source, cluster, schedule, limit, clip, best.accelerators, best.d, best.w, best.b, best.m,
                   best.recompute, device, layout=best.layout, lookahead=ahead)
    except _NoFit:
        return best
    if not c.fits or c.part.bounds != best.part.bounds or c.grad_buffers != best.grad_buffers:
        return best
    return dataclasses.replace(best, model=c.model, memory=c.memory)


#: How many of the fitting configurations (the best by the closed form, within a factor
#: :data:`_SIMULATED_WITHIN` of the best's throughput) the simulator re-prices where the closed
#: form does not hold (:func:`_simulated`), and over how many steps (the median step of a few is
#: the steady state's).
_SIMULATED, _SIMULATED_WITHIN, _SIMULATED_STEPS = 4, 1.5, 4


def _simulated(found, gm: fx.GraphModule, device: DeviceModel, cluster: Cluster | None, *, schedule: str,
               precision: str, ahead: Callable[[_Candidate], _Candidate] = lambda c: c, chunks: int = 1):
    """``found`` with the step of its best fitting candidates (at most :data:`_SIMULATED`, within
    a factor :data:`_SIMULATED_WITHIN` of the best's throughput by the closed form) simulated at
    the solver's cuts (:class:`fxpipe.simulate.Costs` of their stage plans, as
    :func:`_simulated_cuts` prices them), best first: where ranks share a host's cores or zb's
    split costs more than a backward, the plan, its runner-up and its configuration rows are
    then ranked by one measure. The other fitting candidates are left out (their closed-form
    figures would not compare); those that do not fit keep the closed form's. ``ahead`` gives a
    candidate the lookahead it would run with (the planner's choice, :func:`_with_lookahead`),
    whose lists are simulated."""
    from .schedule import generate
    from .simulate import Costs, simulate

    fitting = [c for c in found.candidates if c.fits]
    chosen = [c for c in fitting[:_SIMULATED] if c.throughput * _SIMULATED_WITHIN >= fitting[0].throughput]
    schedules: dict[tuple, list] = {}
    simulated = []
    for c in map(ahead, chosen):
        sps = _stage_plans(gm, c, schedule)
        links = stage_links(cluster, c.d, c.w, c.layout) if cluster is not None else None
        key = (c.d, c.m, c.w, tuple(c.model.recompute), c.model.lookahead)
        if key not in schedules:
            schedules[key] = generate(schedule, c.d, c.m, _SIMULATED_STEPS, width=c.w, recompute=list(key[3]),
                                      lookahead=key[4], chunks=chunks)
        pipe = simulate(schedules[key], Costs.of_stages(sps, device, schedule=schedule, precision=precision,
                                                        width=c.w, links=links), chunks=chunks).step_time
        step = step_time(schedule, pipe, c.allreduce)
        simulated.append(dataclasses.replace(c, throughput=c.b * c.m * c.w / step, step_time=step, pipe=pipe))
    simulated.sort(key=_Candidate.key)
    return dataclasses.replace(found, candidates=simulated + [c for c in found.candidates if not c.fits])


def _graph_of(model_or_gm, example_inputs, leaf_modules=()) -> fx.GraphModule:
    """The traced graph to plan: ``model_or_gm`` itself when fxpipe traced it, else its trace."""
    if isinstance(model_or_gm, fx.GraphModule) and "fxpipe" in model_or_gm.meta:
        if as_leaf_modules(leaf_modules):
            raise PlanError("fxpipe.plan: leaf_modules= applies to a model traced here, but a GraphModule from "
                            "fxpipe.trace was given, captured with its own; pass the model itself, or trace it "
                            "with fxpipe.trace(model, example, leaf_modules=...)")
        return model_or_gm
    if isinstance(model_or_gm, nn.Module):
        if example_inputs is None:
            raise PlanError("plan(model, example_inputs): example_inputs (one micro-batch) are needed to trace a module")
        from .trace import trace

        return trace(model_or_gm, example_inputs, leaf_modules=leaf_modules)
    raise PlanError(f"plan expects an nn.Module or a GraphModule from fxpipe.trace, found {type(model_or_gm).__name__}")


def _worlds(cluster: Cluster | None, world_size: int | None, stages: int | None, device: DeviceModel | None,
            torch_device, precision: str) -> tuple[Cluster, list[int], DeviceModel]:
    """The cluster planned on (this machine's, of ``world_size`` ranks, when none is given), the
    world sizes N = d·w the search tries, and the device model it prices with."""
    if world_size is None and cluster is None:
        import torch.distributed as dist

        world_size = dist.get_world_size() if dist.is_available() and dist.is_initialized() else None
    if stages is not None and world_size is not None and world_size % stages:
        raise PlanError(
            f"world_size {world_size} is not divisible by stages {stages}: every replica needs all {stages} "
            f"stages; use stages in {_divisors(world_size)} or a world size that is a multiple of {stages}"
        )
    if cluster is not None:
        if world_size is not None:
            cluster.check_fits(world_size)
            worlds = [world_size]
        else:
            if stages is not None:
                cluster.check_fits(stages)
            # whole nodes (or part of the only one): N = k * per_node for k = 1 .. nodes
            counts = range(1, cluster.per_node + 1) if cluster.nodes == 1 else \
                (k * cluster.per_node for k in range(1, cluster.nodes + 1))
            worlds = [n for n in counts if stages is None or n % stages == 0]
            if not worlds:
                raise PlanError(
                    f"stages={stages} does not divide any whole number of {cluster.name} nodes' accelerators "
                    f"({cluster.per_node} per node, up to {cluster.size}); use stages dividing one of "
                    f"{[k * cluster.per_node for k in range(1, cluster.nodes + 1)]}, or give world_size (fxpipe plan "
                    f"--world-size)"
                )
        device = cluster.device_model(precision)
    else:
        world = world_size or stages or 1
        worlds = [world]
        device = device or DeviceModel.for_device(torch_device)
        cluster = Cluster.from_device_model(device, world)
    return cluster, worlds, device


def _plan_of(best: _Candidate, fits: list, found, gm: fx.GraphModule, model_or_gm, example_inputs, costs: GraphCosts,
             device: DeviceModel, cluster: Cluster, given_cluster: bool, *, schedule: str, precision: str,
             limit: float, top: int) -> Plan:
    """The :class:`Plan` of the search's best candidate on ``cluster`` (``given_cluster``: the
    caller's, which the plan records, rather than this machine's)."""
    runner = next((c for c in fits[1:] if (c.d, c.w, c.b, c.recompute) != (best.d, best.w, best.b, best.recompute)), None)
    sps = _stage_plans(gm, best, schedule)
    plan = Plan(
        schedule=schedule,
        stages=best.d,
        width=best.w,
        microbatch_size=best.b,
        microbatches=best.m,
        recompute=best.model.recompute,
        lookahead=best.model.lookahead,
        assignment_pairs=_assignment(gm, best.part.bounds),
        stage_plans=sps,
        step_time=best.step_time,
        throughput=best.throughput,
        bottleneck=max(sp.time for sp in sps),
        allreduce_time=best.allreduce,
        runner_up=None if runner is None else RunnerUp(runner.d, runner.w, runner.b, runner.m, runner.recompute,
                                                       runner.step_time, runner.throughput),
        cost_mode=costs.mode,
        device=device,
        memory_limit=limit,
        graph_hash=_fingerprint_at(model_or_gm, gm, example_inputs, costs.batch_size, best.b),
        precision=precision,
        cluster=cluster if given_cluster else None,
        placement=placement(cluster, best.d, best.w, best.layout),
        layout=best.layout,
        configurations=_configuration_rows(found.candidates, best, schedule, limit, top),
    )
    return plan


# how far _simulated_cuts moves a cut: by at most this share of the compute of the smaller of
# its two stages; and the least share of the step a move must save
_REACH, _GAIN = 0.25, 1e-3


def _simulated_cuts(plan: Plan, gm: fx.GraphModule, best: _Candidate, cluster: Cluster, limit: float, *,
                    move: bool, chunks: int = 1) -> Plan:
    """``plan`` with its step time simulated where the closed form (:func:`pipeline_time`: a
    device per rank, zb's I and W halves of a backward) does not hold: ranks that share fewer
    cores than there are ranks (CPU processes on one host, :attr:`DeviceModel.host_cores`)
    compute faster while others wait, and a calibrated zb split can cost more than a backward.
    With ``move`` (such a split), its cuts first move to lower that time: the exact solver's
    balanced stages may then not be the shortest step, since zb's first stage runs its whole
    backward as ``W`` and pays no split, so it may take more of the graph than the others (the
    more backwards the later stages split, :func:`fxpipe.schedule.zb_split`, the more it gains),
    or for interleaved 1F1B (``chunks`` > 1, the lists simulated on ``d / chunks`` ranks): a rank
    runs its stages in turn, so what balances the ranks is the sum of each one's stages, which
    the solver's balanced stages leave to chance (the last stage's loss and head land on one).
    (Cores shared among the ranks slow every stage alike; on ``benchmarks/limit.py`` moving 2bw's
    cut for them made its step slower, so there the cuts stay.)

    Coordinate descent from the solver's cuts: each cut in turn goes to the allowed position,
    among those moving at most ``_REACH`` of the compute of the smaller of its two stages, with
    the lowest simulated step (all-reduce included, as :func:`_price` adds it) and every stage
    within ``limit``, if that saves at least ``_GAIN`` of the step; rounds go on until no cut
    moves (at most 8). Deterministic: every rank that plans gets the same cuts."""
    from .schedule import generate
    from .simulate import Costs, simulate

    chain, model, d = best.chain, best.model, plan.stages
    lists = generate(plan.schedule, d, plan.microbatches, 8, width=plan.width, recompute=list(plan.recompute),
                     lookahead=plan.lookahead, chunks=chunks)
    stage_plans: dict[tuple, StagePlan] = {}

    def bounds_of(cuts: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
        return tuple(zip((0,) + tuple(c + 1 for c in cuts), cuts + (chain.n - 1,)))

    def priced(cuts: tuple[int, ...]) -> tuple[float, float, tuple, float] | None:
        """(simulated step, all-reduce, stage plans, simulated pipeline) of the cuts; None where a
        stage breaks the limit."""
        bounds = bounds_of(cuts)
        tied = _second_buffer_stages(chain, bounds, plan.schedule, best.grad_buffers)
        sps = []
        for s, (l, r) in enumerate(bounds):
            key = (s, l, r, s in tied)
            if key not in stage_plans:
                stage_plans[key] = _stage_plan(gm, chain, model, s, l, r, extra_grads=s in tied)
            sps.append(stage_plans[key])
        if any(sp.memory > limit * (1 + 1e-9) for sp in sps):
            return None
        ar = reduction_time(cluster, chain, bounds, plan.width, plan.layout)
        pipe = simulate(lists, Costs.of_plan(dataclasses.replace(plan, stage_plans=tuple(sps))), chunks=chunks).step_time
        return step_time(plan.schedule, pipe, ar), ar, tuple(sps), pipe

    allowed = np.flatnonzero(chain.valid)
    done = np.cumsum(chain.fwd + chain.bwd)  # compute of positions 0..c
    cuts = tuple(r for _, r in best.part.bounds[:-1])
    priced_cuts = priced(cuts)  # the solver's cuts fit the limit
    for _ in range(8 if move else 0):
        start = cuts
        for i in range(d - 1):
            lo = cuts[i - 1] if i > 0 else -1
            hi = cuts[i + 1] if i + 1 < d - 1 else chain.n - 1
            before = done[cuts[i]] - (done[lo] if lo >= 0 else 0.0)
            reach = _REACH * min(before, done[hi] - done[cuts[i]])
            near = allowed[(allowed > lo) & (allowed < hi) & (np.abs(done[allowed] - done[cuts[i]]) <= reach)]
            best_trial = None  # (step, cuts, priced) of the best position for cut i
            for c in near.tolist():
                trial = cuts[:i] + (c,) + cuts[i + 1:]
                got = priced(trial) if c != cuts[i] else None
                if got is not None and (best_trial is None or (got[0], trial) < best_trial[:2]):
                    best_trial = (got[0], trial, got)
            if best_trial is not None and best_trial[0] < priced_cuts[0] * (1 - _GAIN):
                cuts, priced_cuts = best_trial[1], best_trial[2]
        if cuts == start:
            break
    step, ar, sps, pipe = priced_cuts
    memory = max(sp.memory for sp in sps)
    rows = tuple(dataclasses.replace(r, throughput=plan.global_batch / step, step_time=step, allreduce_time=ar,
                                     pipeline_time=pipe, memory=memory)
                 if r.reason == "chosen" else r for r in plan.configurations)
    return dataclasses.replace(plan, stage_plans=sps, allreduce_time=ar,
                               assignment_pairs=_assignment(gm, bounds_of(cuts)), bottleneck=max(sp.time for sp in sps),
                               step_time=step, throughput=plan.global_batch / step, configurations=rows)


def _stage_plans(gm: fx.GraphModule, c: _Candidate, schedule: str) -> tuple[StagePlan, ...]:
    """The stage plans of candidate ``c`` at its solver cuts, with the second gradient buffer of
    a 2bw stage holding a tied weight (:func:`_second_buffer_stages`)."""
    tied = _second_buffer_stages(c.chain, c.part.bounds, schedule, c.grad_buffers)
    return tuple(_stage_plan(gm, c.chain, c.model, s, l, r, extra_grads=s in tied)
                 for s, (l, r) in enumerate(c.part.bounds))


def _on_meta(gm: fx.GraphModule) -> bool:
    return any(t.is_meta for t in (*gm.parameters(), *gm.buffers()))


def _resized(example_inputs, traced: int, b: int):
    """The example with every tensor whose dim 0 is the traced batch size cut or repeated to ``b``
    (a tensor passed twice, as a Hugging Face model's ``input_ids`` and ``labels``, stays one:
    the trace tells them apart)."""
    done: dict[int, torch.Tensor] = {}

    def resize(x):
        if isinstance(x, torch.Tensor) and x.dim() > 0 and x.shape[0] == traced:
            if id(x) not in done:
                done[id(x)] = x[:b] if b <= traced else torch.cat([x] * -(-b // traced))[:b]
            return done[id(x)]
        return x

    return pytree.tree_map(resize, example_inputs)


def _fingerprint_at(model_or_gm, gm: fx.GraphModule, example_inputs, traced: int | None, b: int) -> str:
    """The fingerprint of the graph a rank traces from an example micro-batch of the plan's
    ``b`` samples (what ``compile(plan=)`` checks): ``gm``'s where it was traced at ``b`` (or
    from a GraphModule, which cannot be traced again), else the model's traced at ``b``."""
    if traced is None or b == traced or isinstance(model_or_gm, fx.GraphModule) or example_inputs is None:
        return graph_fingerprint(gm)
    from .trace import trace

    return graph_fingerprint(trace(model_or_gm, _resized(example_inputs, traced, b),
                                   leaf_modules=gm.meta["fxpipe"].leaf_modules))


def _measure_second_size(model: nn.Module, gm: fx.GraphModule, example_inputs, costs: GraphCosts,
                         device: DeviceModel, torch_device) -> GraphCosts:
    """The planner is about to search b: trace and measure the model at a second micro-batch
    size and fit every measured time to both. Half the traced one, or twice it where half would
    be a single sample: torch.export specialises a dimension of size 1 (a view that needs no copy
    there needs one at other sizes, Mixtral's, DeepSeek-V3's and Mamba's graphs), so a trace at
    1 differs from one at 2 or more, and times cannot be fitted node by node."""
    from .trace import trace

    big = costs.batch_size
    second = _resized(example_inputs, big, big // 2 if big >= 4 else 2 * big)
    gm2 = trace(model, second, leaf_modules=gm.meta["fxpipe"].leaf_modules)
    other = annotate(gm2, second, mode="measured", device=device, torch_device=torch_device)
    return fit_two_sizes(gm, costs, other)


def _stages_with_shared_tensors(chain: Chain, bounds: Sequence[tuple[int, int]]) -> set[int]:
    """Stages holding a copy of a tensor that other stages read too (a tied weight): the runtime
    all-reduces its gradient between them."""
    stage_of = np.empty(chain.n, dtype=np.int64)
    for s, (l, r) in enumerate(bounds):
        stage_of[l : r + 1] = s
    out: set[int] = set()
    for p, readers in enumerate(chain.tensor_readers):
        if chain.tensor_grad_bytes[p] > 0:
            stages = set(stage_of[np.asarray(readers)].tolist())
            if len(stages) > 1:
                out |= stages
    return out


def _second_buffer_stages(chain: Chain, bounds: Sequence[tuple[int, int]], schedule: str, grad_buffers: int) -> set[int]:
    """Stages that keep one gradient buffer more than the chain's ``grad_buffers`` counts: with
    one counted under 2bw, those holding a tied weight's copy (its all-reduce is a reduction,
    :func:`fxpipe.schedule.gradient_buffers`); none under a flush schedule, which keeps one."""
    if grad_buffers >= gradient_buffers(schedule, reduces=True):
        return set()
    return _stages_with_shared_tensors(chain, bounds)


def _over_with_tied_buffers(chain: Chain, model: StageModel, part: "Partition", limit: float, schedule: str,
                            grad_buffers: int) -> bool:
    """Whether a stage of ``part`` breaks ``limit`` once the second gradient buffer of
    :func:`_second_buffer_stages` is counted."""
    for s in _second_buffer_stages(chain, part.bounds, schedule, grad_buffers):
        l, r = part.bounds[s]
        extra = float(sum(chain.tensor_grad_bytes[p] for p in _held(chain, l, r)))
        if stage_memory(chain, model, s, l, r) + extra > limit:
            return True
    return False


def _stage_plan(gm: fx.GraphModule, chain: Chain, model: StageModel, s: int, l: int, r: int, *,
                extra_grads: bool = False) -> StagePlan:
    from .trace import module_path

    nodes = {nd.name: nd for nd in gm.graph.nodes}
    first, last = chain.names[l], chain.names[r]
    rc = model.recompute[s]
    f = float(chain.fwd[l : r + 1].sum())
    bw = float(chain.bwd[l : r + 1].sum()) + (f if rc else 0.0)
    held = _held(chain, l, r)
    pbytes = float(sum(chain.tensor_param_bytes[p] for p in held))
    weights = float(sum(chain.tensor_cost[p] for p in held))
    grads = float(sum(chain.tensor_grad_bytes[p] for p in held))
    opt = float(sum(chain.tensor_optim_bytes[p] for p in held))
    copies = weights - grads - opt
    if extra_grads:  # a tied weight's 2bw stage: a second gradient buffer (see _second_buffer_stages)
        weights += grads
        grads *= 2
    _, acts, bufs = _stage_bytes(chain, model, s, l, r)
    return StagePlan(
        index=s, nodes=r - l + 1, first_node=first, last_node=last,
        first_module=module_path(nodes[first]) if first in nodes else "",
        last_module=module_path(nodes[last]) if last in nodes else "",
        forward_time=f, backward_time=bw,
        comm_time=_comm(chain, model, l - 1, s - 1) + _comm(chain, model, r, s), comm_out_time=_comm(chain, model, r, s),
        overlap=model.overlap,
        memory=weights + acts + bufs, memory_weights=copies, memory_activations=acts,
        memory_optimizer=opt, memory_grads=grads, memory_buffers=bufs,
        param_bytes=pbytes, send_bytes=float(chain.cross[r]) if r < chain.n - 1 else 0.0, recompute=rc,
    )


# --------------------------------------------------------------------------------------------
# models of repeated blocks, costed one block at a time


class BlockCosting:
    """Chains of a model made of ``L`` identical blocks (an ``nn.ModuleList``), for any ``L``,
    from one trace of three of them: the first, a middle one and the last are costed once each
    (as PipeDream-2BW's planner profiles one layer), and the chain of ``L`` blocks repeats the
    middle one ``L - 2`` times. :meth:`chain` equals :func:`chain_from_graph` of the whole
    model's trace (tests/unit/test_planning.py checks up to 48 layers), without tracing a graph
    of ``L`` blocks: a GPT of 2,400 layers has over 100k nodes.

    Made with :meth:`from_model`, which traces the model with its block list cut to 3 (and, to
    check that the blocks do repeat, to 4: the chain of 4 built from the 3-block trace must
    equal the 4-block trace's). Values that skip blocks (a mask every block reads, a skip from
    the embeddings to the head) keep their span; anything else that does not repeat raises.
    """

    SAMPLE = 3

    def __init__(self, gm: fx.GraphModule, costs: GraphCosts, path: str, layers: int):
        from .trace import module_path

        self.gm, self.costs, self.path, self.layers = gm, costs, path, layers
        self.batch_size = costs.batch_size
        compute = [nd for nd in gm.graph.nodes if nd.op in _COMPUTE]
        which = []
        prefix = path + "."
        for nd in compute:
            mp = module_path(nd)
            which.append(int(mp[len(prefix):].split(".")[0]) if mp.startswith(prefix) and mp[len(prefix):].split(".")[0].isdigit() else None)
        k = self.SAMPLE
        starts = [which.index(j) if j in which else -1 for j in range(k)]
        ends = [len(which) - 1 - which[::-1].index(j) if j in which else -1 for j in range(k)]
        lens = [e - s + 1 for s, e in zip(starts, ends)]
        ok = min(starts) >= 0 and len(set(lens)) == 1 and all(starts[j + 1] == ends[j] + 1 for j in range(k - 1)) \
            and all(which[i] == j for j in range(k) for i in range(starts[j], ends[j] + 1)) \
            and not any(w is not None for w in which[: starts[0]] + which[ends[-1] + 1:])
        if not ok:
            raise PlanError(
                f"the blocks of {path!r} are not contiguous runs of equal length in the traced graph (found "
                f"runs at {list(zip(starts, ends))}); block costing needs a model that calls its blocks one after "
                f"another; plan the whole graph instead (fxpipe.plan)"
            )
        self.start, self.blen, self.n0 = starts[0], lens[0], len(compute)
        self.end = self.start + k * self.blen
        per_block = {}
        seen = set()
        for name, p in gm.named_parameters(remove_duplicate=False):
            if id(p) in seen:
                continue
            seen.add(id(p))
            inside = name.startswith(prefix)
            per_block[inside] = per_block.get(inside, 0) + p.numel()
        self._params = (per_block.get(False, 0), per_block.get(True, 0) // k)

    @classmethod
    def from_model(cls, model: nn.Module, example_inputs, *, blocks: str | None = None, device: DeviceModel | None = None,
                   layers: int | None = None, check: bool = True) -> "BlockCosting":
        """Trace ``model`` with its block list ``blocks`` (a dotted path to an ``nn.ModuleList``;
        None: the longest list of identical modules) cut to 3 blocks, and cost it on ``device``.
        ``layers``: the depth to cost by default (the model's own list length if None). The
        model may be on the meta device; it is left as it was."""
        from .cost import annotate
        from .trace import trace

        path = blocks or _repeated_blocks(model)
        if path is None:
            raise PlanError(
                f"{type(model).__name__} has no nn.ModuleList of 3 or more identical blocks; expected a model "
                f"made of repeated blocks (e.g. GPT's transformer layers); plan the whole graph instead (fxpipe.plan)"
            )
        lst = model.get_submodule(path)
        if not isinstance(lst, nn.ModuleList) or len(lst) < cls.SAMPLE + (1 if check else 0):
            raise PlanError(
                f"blocks={path!r}: expected an nn.ModuleList of at least {cls.SAMPLE + (1 if check else 0)} blocks, "
                f"found {type(lst).__name__} of {len(lst) if isinstance(lst, nn.ModuleList) else 0}; build the model "
                f"with at least {cls.SAMPLE + 1} blocks (on the meta device they cost nothing)"
            )
        device = device or DeviceModel.for_device(None)

        def traced(k: int):
            with _shortened(model, path, k):
                gm = trace(model, example_inputs)
            return gm, annotate(gm, device=device)

        bc = cls(*traced(cls.SAMPLE), path, layers if layers is not None else len(lst))
        if check:
            gm4, costs4 = traced(cls.SAMPLE + 1)
            kw = dict(schedule="2bw", optimizer_bytes_per_param=8.0, grad_buffers=2, accumulation="autograd",
                      precision="fp32")
            want = chain_from_graph(gm4, costs4, bc.batch_size, **kw)
            got = bc.chain(bc.batch_size, layers=cls.SAMPLE + 1, **kw)
            if not _same_chain(got, want):
                raise PlanError(
                    f"the blocks of {path!r} do not repeat: the chain of {cls.SAMPLE + 1} blocks built from a trace of "
                    f"{cls.SAMPLE} differs from the trace of {cls.SAMPLE + 1} (a value read by some blocks but not "
                    f"others, or blocks that differ); plan the whole graph instead (fxpipe.plan)"
                )
        return bc

    def params(self, layers: int | None = None) -> int:
        """Parameters of the model with ``layers`` blocks (tied ones once)."""
        fixed, block = self._params
        return fixed + block * (self.layers if layers is None else layers)

    def chain(self, batch: float, *, layers: int | None = None, schedule: str = "2bw", optimizer_bytes_per_param: float = 8.0,
              grad_buffers: int = 1, accumulation: str = "autograd", precision: str = "fp32") -> Chain:
        """The chain of the model with ``layers`` blocks (default: :attr:`layers`), as
        :func:`chain_from_graph` would give for its whole trace."""
        L = self.layers if layers is None else layers
        if isinstance(L, bool) or not isinstance(L, int) or L < 2:
            raise PlanError(f"layers must be an integer >= 2 for block costing, found {L!r}; trace a smaller model whole")
        p = _chain_parts(self.gm, self.costs, batch, schedule=schedule, optimizer_bytes_per_param=optimizer_bytes_per_param,
                         grad_buffers=grad_buffers, accumulation=accumulation, precision=precision)
        k, s0, blen, end, n0 = self.SAMPLE, self.start, self.blen, self.end, self.n0
        shift = (L - k) * blen
        copies = [np.array([0]), np.arange(1, L - 1), np.array([L - 1])]  # template block -> its copies

        def seg(i: np.ndarray) -> np.ndarray:  # -1 prefix, 0..k-1 block, k suffix
            return np.where(i < s0, -1, np.where(i >= end, k, (i - s0) // blen))

        def fixed(i: np.ndarray) -> np.ndarray:  # prefix and suffix positions
            return np.where(i < s0, i, i + shift)

        role = np.concatenate([[0], np.ones(L - 2, dtype=np.int64), [k - 1]])
        idx = np.concatenate([np.arange(s0), (s0 + role[:, None] * blen + np.arange(blen)[None, :]).ravel(),
                              np.arange(end, n0)])
        names = list(p.names[:s0]) + [f"{self.path}.{x}:{p.names[s0 + role[x] * blen + o]}" for x in range(L)
                                      for o in range(blen)] + list(p.names[end:])
        # values: each span (lo, hi) mapped to every copy of its block
        lo_out, hi_out, sel = [], [], []
        slo, shi = seg(p.lo), seg(p.hi)
        for v in range(len(p.lo)):
            a, z = slo[v], shi[v]
            if a < 0 or a >= k:  # produced in the prefix or suffix
                if 0 <= z < k and z not in (0, k - 1):
                    raise PlanError(f"block costing: value {p.names[p.lo[v]]!r} is last read in a middle block only; "
                                    f"the blocks of {self.path!r} do not repeat; plan the whole graph instead")
                hi = fixed(p.hi[v]) if not 0 <= z < k else s0 + copies[z][-1] * blen + (p.hi[v] - s0) % blen
                lo_out.append(np.array([fixed(p.lo[v])]))
                hi_out.append(np.array([hi]))
                sel.append(np.array([v]))
                continue
            xs = copies[a]
            starts = s0 + xs * blen + (p.lo[v] - s0) % blen
            if z >= k:
                ends = np.full(len(xs), fixed(p.hi[v]))
            else:
                target = xs + (z - a)
                if len(xs) and target.max() > L - 1:
                    raise PlanError(f"block costing: a value of block {a} is read {z - a} blocks later, past the last "
                                    f"block; the blocks of {self.path!r} do not repeat; plan the whole graph instead")
                ends = s0 + target * blen + (p.hi[v] - s0) % blen
            lo_out.append(starts)
            hi_out.append(ends)
            sel.append(np.full(len(xs), v))
        sel_a = np.concatenate(sel) if sel else np.zeros(0, dtype=np.int64)
        # tensors: one read inside a single block is that block's own, copied with its name;
        # any other (tied, shared by every block) keeps its name and gains every copy's readers
        tensors = []
        prefix = self.path + "."
        for order, (name, cost, pb, g, o, readers, xb) in enumerate(p.tensors):
            rd = np.asarray(readers)
            sr = seg(rd)
            inner = sr[(sr >= 0) & (sr < k)]
            if len(inner) == len(rd) and len(set(inner.tolist())) == 1:
                j = int(inner[0])
                for x in copies[j].tolist():
                    own = name.replace(f"{prefix}{j}.", f"{prefix}{x}.", 1) if name.startswith(f"{prefix}{j}.") else f"{name}@{x}"
                    tensors.append((order, (own, cost, pb, g, o, (s0 + x * blen + (rd - s0) % blen).tolist(), xb)))
                continue
            pos = [fixed(rd[(sr < 0) | (sr >= k)])]
            for j in sorted(set(inner.tolist())):
                r = rd[sr == j]
                pos.append((s0 + copies[j][:, None] * blen + ((r - s0) % blen)[None, :]).ravel())
            tensors.append((order, (name, cost, pb, g, o, sorted(set(np.concatenate(pos).tolist())), xb)))
        # the whole trace's order: by first reader, then as that node lists them
        tensors = [t for _, t in sorted(tensors, key=lambda e: (e[1][5][0], e[0]))]
        parts = _Parts(names, p.fwd[idx], p.bwd[idx], p.act[idx], p.weight_reads[idx],
                       np.concatenate(lo_out).astype(np.int64) if lo_out else np.zeros(0, dtype=np.int64),
                       np.concatenate(hi_out).astype(np.int64) if hi_out else np.zeros(0, dtype=np.int64),
                       p.size[sel_a], p.grad[sel_a], p.bad[sel_a], tensors)
        return _assemble(parts)

    def source(self, layers: int | None = None, **chain_kw) -> "_BlockSource":
        """What :func:`_search` plans from, for ``layers`` blocks."""
        return _BlockSource(self, self.layers if layers is None else layers, chain_kw)


class _BlockSource:
    """The planner's view of a :class:`BlockCosting` at one depth (like :class:`_GraphSource`)."""

    def __init__(self, blocks: BlockCosting, layers: int, chain_kw: dict):
        self.blocks, self.layers, self.chain_kw = blocks, layers, chain_kw
        self.batch_size = blocks.batch_size
        self.n = blocks.n0 + (layers - BlockCosting.SAMPLE) * blocks.blen
        self._chains: dict[tuple[int, int], Chain] = {}
        s0, blen = blocks.start, blocks.blen
        compute = [nd.name for nd in blocks.gm.graph.nodes if nd.op in _COMPUTE]
        self._middle = compute[s0 + blen : s0 + 2 * blen]  # the template every inner block copies
        self._costs = blocks.costs

    def chain(self, batch: int, grad_buffers: int) -> Chain:
        if (batch, grad_buffers) not in self._chains:
            self._chains.clear()  # chains of 100k nodes: keep one
            self._chains[batch, grad_buffers] = self.blocks.chain(batch, layers=self.layers, grad_buffers=grad_buffers,
                                                                  **self.chain_kw)
        return self._chains[batch, grad_buffers]

    def per_sample(self, batch: int) -> float:
        c = self._costs
        whole = c.total("fwd_time", batch) + c.total("bwd_time", batch)
        middle = sum(c.nodes[n].fwd_time(batch) + c.nodes[n].bwd_time(batch) for n in self._middle)
        return (whole + (self.layers - BlockCosting.SAMPLE) * middle) / batch

    def untied_param_bytes(self) -> float:
        return _untied_param_bytes(self.chain(self.batch_size, 1))


def _same_chain(a: Chain, b: Chain) -> bool:
    close = lambda x, y: x.shape == y.shape and np.allclose(x, y, rtol=1e-12, atol=0)  # noqa: E731
    if not all(close(getattr(a, f), getattr(b, f)) for f in ("fwd", "bwd", "act", "cross", "cross_grad", "tensor_cost",
                                                             "tensor_param_bytes", "tensor_grad_bytes", "tensor_optim_bytes",
                                                             "tensor_input_bytes")):
        return False
    if not np.array_equal(a.valid, b.valid):
        return False
    key = lambda c: sorted((n, tuple(r.tolist())) for n, r in zip(c.tensor_names, c.tensor_readers))  # noqa: E731
    return key(a) == key(b)


def _repeated_blocks(model: nn.Module) -> str | None:
    """The dotted path of the ModuleList of 3+ structurally identical modules holding the most
    parameters (None if there is none)."""
    best, most = None, 0
    for name, mod in model.named_modules():
        if not isinstance(mod, nn.ModuleList) or len(mod) < 3:
            continue
        sig = [(type(m), tuple((n, tuple(p.shape), p.dtype) for n, p in m.named_parameters())) for m in mod]
        if any(s != sig[0] for s in sig):
            continue
        count = sum(p.numel() for p in mod.parameters())
        if count > most:
            best, most = name, count
    return best


class _shortened:
    """Context: ``model``'s ModuleList at ``path`` holds only its first ``k`` blocks."""

    def __init__(self, model: nn.Module, path: str, k: int):
        self.model, self.path, self.k = model, path, k

    def __enter__(self):
        parent_path, _, name = self.path.rpartition(".")
        self.parent = self.model.get_submodule(parent_path) if parent_path else self.model
        self.name = name
        self.orig = getattr(self.parent, name)
        setattr(self.parent, name, nn.ModuleList(list(self.orig)[: self.k]))
        return self

    def __exit__(self, *exc):
        setattr(self.parent, self.name, self.orig)
        return False


@dataclass(frozen=True)
class Capacity:
    """The deepest model of repeated blocks that fits (:func:`capacity`)."""

    layers: int
    params: int
    stages: int
    width: int
    microbatch_size: int
    microbatches: int
    memory: float  #: bytes on the fullest accelerator, of the best-balanced cut that fits
    memory_limit: float
    checks: int  #: depths tried

    def describe(self) -> str:
        return (f"{self.layers} layers, {self.params / 1e9:.2f}B parameters: d={self.stages} w={self.width} "
                f"b={self.microbatch_size} m={self.microbatches} with recomputation, fullest accelerator "
                f"{self.memory / 1e9:.2f} of {self.memory_limit / 1e9:.2f} GB ({self.checks} depths tried)")


def capacity(blocks: BlockCosting, *, cluster: Cluster | str, global_batch: int, schedule: str = "2bw",
             precision: str = "fp32", world_size: int | None = None, clip: bool = True,
             optimizer_bytes_per_param: float = 8.0, accumulation: str = "fused",
             device_memory: float | None = None) -> Capacity:
    """The largest number of blocks whose model fits ``cluster`` (all its accelerators, or
    ``world_size``) under ``schedule``'s memory formula, at the least memory any configuration
    needs: micro-batches of the smallest size, recomputation on, and every depth d (deepest
    first) of the world size. Depths double until one does not fit, then bisect; each try costs
    the model one block at a time (:class:`BlockCosting`) and asks the partitioner whether any
    cut fits. Returns the depth, its parameter count and the fitting configuration. ``clip``: the
    training clips by the global norm (under 2bw two gradient buffers per stage, as with data
    parallelism; without either, or under a flush schedule, one). ``accumulation``: as :func:`plan`'s; ``"fused"`` by default, what
    ``fxpipe.compile`` runs on a cluster's accelerators (the fused kernels' scratch gradient)."""
    cluster = Cluster.resolve(cluster)
    if cluster is None:
        raise PlanError("capacity needs a cluster (a fxpipe.Cluster, a preset name or a .json/.toml path), found None")
    if schedule not in SCHEDULES:
        raise PlanError(f"schedule must be one of {SCHEDULES}, found {schedule!r}")
    global_batch = _positive("global_batch", global_batch, allow_none=False)
    world_size = _positive("world_size", world_size)
    device_memory = _positive("device_memory", device_memory, integer=False)
    world = world_size or cluster.size
    cluster.check_fits(world)
    device = cluster.device_model(precision)
    cluster.check_memory(device_memory)
    limit = float(device_memory) if device_memory is not None else device.memory_bytes
    kw = dict(schedule=schedule, optimizer_bytes_per_param=optimizer_bytes_per_param, accumulation=accumulation,
              precision=precision)
    checks = 0

    def fitting(layers: int):
        nonlocal checks
        checks += 1
        source = blocks.source(layers, **kw)
        for d in sorted(_divisors(world), reverse=True):
            w = world // d
            if global_batch % w or d > source.n:
                continue
            per = global_batch // w
            b = next((bb for bb in _divisors(per) if schedule == "gpipe" or per // bb >= d), None)
            if b is None:
                continue
            m = per // b
            # gradient buffers as _price counts them: two under 2bw with clipping or data
            # parallelism; else one, or (2bw) two on every stage where a stage holding a tied
            # weight's copy (which keeps a second) breaks the limit with one
            buffers = gradient_buffers(schedule, reduces=w > 1 or clip)
            chain = source.chain(b, buffers)
            sm = StageModel.for_schedule(schedule, d, m, True, device, limit, stage_links(cluster, d, w),
                                         cluster.overlap_p2p)
            if sum(chain.valid) < d - 1 or _Solver(chain, sm).feasible(math.inf) is None:
                continue
            if buffers == 1:
                part = _Solver(chain, sm).solve()
                if part is None:  # two buffers cannot fit where one does not
                    continue
                if _over_with_tied_buffers(chain, sm, part, limit, schedule, buffers):  # (2bw only)
                    chain = source.chain(b, 2)
                    if _Solver(chain, sm).feasible(math.inf) is None:
                        continue
            return d, w, b, m, chain, sm
        return None

    lo, hi = 1, 2  # lo fits (or is the floor), hi is the next to try
    found = fitting(hi)
    if found is None:
        raise PlanError(
            f"not even 2 blocks of {blocks.path!r} fit {world} x {limit / 1e9:.2f} GB of {cluster.name} with "
            f"{schedule}; expected a model whose smallest form fits; use more accelerators or a smaller block"
        )
    best = (hi, found)
    while True:
        nxt = hi * 2
        f = fitting(nxt)
        if f is None:
            lo, hi = hi, nxt
            break
        best, hi = (nxt, f), nxt
    while hi - lo > 1:  # lo fits, hi does not
        mid = (lo + hi) // 2
        f = fitting(mid)
        if f is None:
            hi = mid
        else:
            lo, best = mid, (mid, f)
    layers, (d, w, b, m, chain, sm) = best
    part = partition_chain(chain, sm)
    memory = max(stage_memory(chain, sm, s, l, r) for s, (l, r) in enumerate(part.bounds))
    return Capacity(layers, blocks.params(layers), d, w, b, m, memory, limit, checks)
