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
              + k_s * A(l, r) + j_s * I(l) + I(l)                             # stash, receive buffer

with ``A(l, r)`` the bytes of every output of the stage's nodes (what autograd may save; it
includes the values the stage sends, whose storage the gradient received for them takes over
once sent, as Megatron-LM's ``deallocate_output_tensor`` does), ``I(l)`` the bytes crossing its
input cut, and ``k_s, j_s`` from the schedule (docs/design.md; PipeDream-2BW §3): ``n_s = d - s``
micro-batches in flight under 1f1b/2bw, ``m`` under gpipe; ``k_s = n_s, j_s = 0`` without
recomputation, ``k_s = 1, j_s = n_s`` with it.

Algorithm: binary search on the bottleneck ``T`` with an exact O(n log n · d) feasibility test.
Both constraints split into a part in ``l`` and a part in ``r``: ``T_s = X_s(l) + Y_s(r)`` and
``M_s = U_s(l) + V_s(r)`` (plus tied-parameter terms), and ``V_s`` is non-decreasing in ``r``, so
memory allows exactly a window ``r <= rho_s(l)`` and the test "some feasible end r, from which
the later stages can finish, has ``Y_s(r) <= T - X_s(l)``" is a range-minimum query (sparse
table), vectorised over ``l``. Stages are checked from the last to the first, where ``n_s`` is
known. After each feasible probe the upper bound drops to the bottleneck actually achieved, so
the search ends on a partition whose bottleneck is within 1e-9 (relative) of the optimum; of the
partitions meeting it, the one with the earliest cuts is returned (deterministic).

:func:`plan` is the entry point: trace (if given a module), cost, then — as PipeDream-2BW's
Algorithm 1 — enumerate depth ``d`` (with width ``w = world_size / d``), recomputation on/off, and
the micro-batch size ``b`` when a global batch is given, partition each, and keep the highest
predicted throughput that fits memory; the runner-up is kept in the plan to explain the choice.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch import nn

from .cost import DeviceModel, GraphCosts, annotate, fit_two_sizes
from .errors import PlanError
from .precision import PRECISIONS, compute_dtype
from .weights import weight_bytes
from .plan import Plan, RunnerUp, StagePlan, graph_fingerprint

__all__ = ["Chain", "StageModel", "Partition", "chain_from_graph", "partition_chain", "min_memory", "stage_time", "stage_memory", "plan"]

_COMPUTE = ("call_function", "call_method", "call_module")
_SCHEDULES = ("2bw", "1f1b", "gpipe")
_REL_TOL = 1e-9


@dataclass(eq=False)
class Chain:
    """The costs the partitioner sees, for one micro-batch size (arrays over compute nodes).

    ``cross[c]``/``cross_grad[c]`` are the activation/gradient bytes crossing cut ``c`` (between
    positions ``c`` and ``c + 1``; ``n - 1`` cuts); ``valid[c]`` whether the cut is allowed.
    ``tensor_cost[p]`` is the memory a stage pays for holding parameter/buffer ``p``;
    ``tensor_readers[p]`` the sorted positions of the nodes that read it.
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

    def __post_init__(self) -> None:
        f = lambda a: np.asarray(a, dtype=np.float64)  # noqa: E731
        self.fwd, self.bwd, self.act = f(self.fwd), f(self.bwd), f(self.act)
        self.cross, self.cross_grad = f(self.cross), f(self.cross_grad)
        self.valid = np.asarray(self.valid, dtype=bool)
        self.tensor_cost = f(self.tensor_cost)
        self.tensor_readers = tuple(np.asarray(r, dtype=np.int64) for r in self.tensor_readers)
        for name in ("tensor_param_bytes", "tensor_grad_bytes", "tensor_optim_bytes"):
            arr = f(getattr(self, name))
            setattr(self, name, arr if len(arr) == len(self.tensor_cost) else np.zeros(len(self.tensor_cost)))
        n = len(self.fwd)
        if n == 0:
            raise PlanError("the graph has no compute nodes; expected at least one operator to place on a stage")
        for name, arr, size in (("bwd", self.bwd, n), ("act", self.act, n), ("cross", self.cross, n - 1),
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
class StageModel:
    """How a schedule turns a run of nodes into a stage's time and memory."""

    stages: int
    inflight: tuple[int, ...]  #: micro-batches stashed per stage (d - s under 1f1b/2bw, m under gpipe)
    recompute: tuple[bool, ...]
    p2p_latency: float = 0.0
    p2p_bandwidth: float = math.inf
    memory_limit: float = math.inf

    @classmethod
    def for_schedule(cls, schedule: str, stages: int, microbatches: int, recompute: bool | Sequence[bool],
                     device: DeviceModel, memory_limit: float | None = None) -> "StageModel":
        d = stages
        inflight = tuple(microbatches if schedule == "gpipe" else d - s for s in range(d))
        if isinstance(recompute, bool):
            # With one micro-batch in flight (the last stage under 1f1b/2bw) recomputation
            # saves nothing and costs a forward: it stays off there.
            recompute = tuple(recompute and inflight[s] > 1 for s in range(d))
        return cls(d, inflight, tuple(bool(x) for x in recompute), device.p2p_latency, device.p2p_bandwidth,
                   device.memory_bytes if memory_limit is None else float(memory_limit))


@dataclass(frozen=True)
class Partition:
    """Stage ``s`` holds chain positions ``bounds[s][0] ..= bounds[s][1]``."""

    bounds: tuple[tuple[int, int], ...]
    bottleneck: float


# --------------------------------------------------------------------------------------------
# reference evaluation (direct sums: reporting and brute-force tests)


def _comm(chain: Chain, model: StageModel, c: int) -> float:
    if c < 0 or c >= chain.n - 1:
        return 0.0
    t = model.p2p_latency + chain.cross[c] / model.p2p_bandwidth
    if chain.cross_grad[c] > 0:
        t += model.p2p_latency + chain.cross_grad[c] / model.p2p_bandwidth
    return float(t)


def stage_time(chain: Chain, model: StageModel, s: int, l: int, r: int) -> float:
    """Seconds per micro-batch of stage ``s`` holding positions ``l..r``."""
    f = float(chain.fwd[l : r + 1].sum())
    return (2 * f if model.recompute[s] else f) + float(chain.bwd[l : r + 1].sum()) + _comm(chain, model, l - 1) + _comm(chain, model, r)


def _held(chain: Chain, l: int, r: int) -> list[int]:
    return [p for p, rd in enumerate(chain.tensor_readers) if np.any((rd >= l) & (rd <= r))]


def stage_memory(chain: Chain, model: StageModel, s: int, l: int, r: int) -> float:
    """Bytes stage ``s`` needs holding positions ``l..r`` (the formula in the module docstring)."""
    k, j = (1, model.inflight[s]) if model.recompute[s] else (model.inflight[s], 0)
    inp = float(chain.cross[l - 1]) if l > 0 else 0.0
    weights = float(sum(chain.tensor_cost[p] for p in _held(chain, l, r)))
    return weights + k * float(chain.act[l : r + 1].sum()) + (j + 1) * inp


# --------------------------------------------------------------------------------------------
# the exact min-max partition


class _Solver:
    """Per (chain, model): the l/r decompositions of time and memory, and the memory windows."""

    def __init__(self, chain: Chain, model: StageModel):
        n, d = chain.n, model.stages
        self.chain, self.model, self.n, self.d = chain, model, n, d
        ct = np.zeros(n + 1)  # ct[c + 1] = comm(c) for c in -1 .. n-1 (0 at both ends)
        if n > 1:
            ct[1:n] = model.p2p_latency + chain.cross / model.p2p_bandwidth
            ct[1:n] += np.where(chain.cross_grad > 0, model.p2p_latency + chain.cross_grad / model.p2p_bandwidth, 0.0)
        self.ct = ct
        Pf = np.concatenate([[0.0], np.cumsum(chain.fwd)])
        Pb = np.concatenate([[0.0], np.cumsum(chain.bwd)])
        self.X, self.Y = [], []
        for s in range(d):
            P = (2 * Pf if model.recompute[s] else Pf) + Pb
            self.X.append(ct[:n] - P[:n])  # input cut of a stage starting at l is cut l-1
            self.Y.append(P[1:] + ct[1:])  # output cut of a stage ending at r is cut r
        self.start_ok = np.concatenate([[True], chain.valid])
        self.rho = [self._window(s, model.memory_limit) for s in range(d)]

    def _window(self, s: int, limit: float) -> np.ndarray:
        """rho[l]: the last r such that stage s fits memory on [l, r] (l - 1 if none)."""
        chain, n, model = self.chain, self.n, self.model
        idx = np.arange(n)
        if math.isinf(limit):
            return np.full(n, n - 1)
        k, j = (1, model.inflight[s]) if model.recompute[s] else (model.inflight[s], 0)
        single = np.zeros(n)
        multi = []
        for p, rd in enumerate(chain.tensor_readers):
            if len(rd) == 1:
                single[rd[0]] += chain.tensor_cost[p]
            elif len(rd) > 1:
                multi.append(p)
        Pa = np.concatenate([[0.0], np.cumsum(chain.act)])
        Pw = np.concatenate([[0.0], np.cumsum(single)])
        inp = np.concatenate([[0.0], chain.cross])
        U = -k * Pa[:n] - Pw[:n] + (j + 1) * inp
        V = k * Pa[1:] + Pw[1:]
        # A tensor read at several positions costs once if any reader is in [l, r]: a step at
        # its first reader >= l. Sort those steps per l and search V between them.
        if multi:
            first = np.stack([_next_reader(chain.tensor_readers[p], n) for p in multi])  # (K, n)
            cost = np.array([chain.tensor_cost[p] for p in multi])
            order = np.argsort(first, axis=0, kind="stable")
            first = np.take_along_axis(first, order, axis=0)
            steps = np.cumsum(cost[order], axis=0)
        else:
            first, steps = np.zeros((0, n), dtype=np.int64), np.zeros((0, n))
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

    def feasible(self, T: float) -> list[np.ndarray] | None:
        """Reachability per stage at bottleneck T: R[s][l] says positions l..n-1 can form stages
        s..d-1. Returns the list (R[d] = end only) or None if stage 0 cannot start at 0."""
        n = self.n
        idx = np.arange(n)
        R: list[np.ndarray] = [None] * (self.d + 1)  # type: ignore[list-item]
        R[self.d] = np.zeros(n + 1, dtype=bool)
        R[self.d][n] = True
        for s in range(self.d - 1, -1, -1):
            Ys = np.where(R[s + 1][1:], self.Y[s], math.inf)
            rho = self.rho[s]
            ok = self.start_ok & (rho >= idx)
            best = _range_min(Ys, idx, np.maximum(rho, idx))
            reach = np.zeros(n + 1, dtype=bool)
            reach[:n] = ok & np.isfinite(best) & (best + self.X[s] <= T)
            R[s] = reach
        return R if R[0][0] else None

    def reconstruct(self, T: float, R: list[np.ndarray]) -> Partition:
        """The partition with the earliest cuts among those meeting T."""
        bounds = []
        l, worst = 0, 0.0
        for s in range(self.d):
            hi = self.rho[s][l]
            r_ok = R[s + 1][l + 1 : hi + 2] & (self.Y[s][l : hi + 1] + self.X[s][l] <= T)
            r = l + int(np.argmax(r_ok))
            worst = max(worst, float(self.Y[s][r] + self.X[s][l]))
            bounds.append((l, r))
            l = r + 1
        return Partition(tuple(bounds), worst)


def _next_reader(readers: np.ndarray, n: int) -> np.ndarray:
    """For every l, the first reader position >= l (n if none)."""
    i = np.searchsorted(readers, np.arange(n), side="left")
    ext = np.concatenate([readers, [n]])
    return ext[i]


def _range_min(a: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """min(a[lo[i] ..= hi[i]]) for every i, with a sparse table (O(n log n))."""
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
    solver = _Solver(chain, model)
    R = solver.feasible(math.inf)
    if R is None:
        need = min_memory(chain, model)
        raise PlanError(
            f"no way to cut the model into {model.stages} stages fits in {model.memory_limit / 1e6:.1f} MB per "
            f"device; the smallest memory that fits is {need / 1e6:.1f} MB. Give more memory "
            f"(device_memory={math.ceil(need)}), more stages, recomputation or a smaller micro-batch."
        )
    best = solver.reconstruct(math.inf, R)
    # A lower bound: the average compute over d stages at the cheapest (no-recompute) rate.
    lo = float(chain.fwd.sum() + chain.bwd.sum()) / model.stages * (1 - 1e-12)
    hi = best.bottleneck
    while hi - lo > _REL_TOL * hi:
        mid = 0.5 * (lo + hi)
        R = solver.feasible(mid)
        if R is None:
            lo = mid
        else:
            best = solver.reconstruct(mid, R)
            hi = best.bottleneck
    R = solver.feasible(hi)
    assert R is not None
    return solver.reconstruct(hi, R)


def min_memory(chain: Chain, model: StageModel) -> float:
    """The smallest per-device memory limit under which some partition exists (within 1e-6)."""
    _check_depth(chain, model.stages)
    d = model.stages
    lo = 0.0
    hi = max(stage_memory(chain, model, s, 0, chain.n - 1) for s in range(d))
    hi += max((model.inflight[s] + 1) for s in range(d)) * float(chain.cross.max(initial=0.0))
    hi = max(hi, 1.0)
    import dataclasses

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
    reduction of batch t's gradients overlaps batch t+1's backwards), the optimizer state
    (``optimizer_bytes_per_param`` per element, AdamW: two fp32 moments = 8) and, with
    ``accumulation="fused"`` (the kernel path), a scratch gradient. A buffer costs its bytes.
    ``precision="bf16"``/``"fp16"``: weights as :func:`~fxpipe.weights.weight_bytes` counts them
    (2-byte compute versions beside the master), and a floating activation costs its bytes in the
    compute dtype (what autocast's low-precision ops produce; the few ops its policy keeps in
    float32 are not told apart here).
    """
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
    diff = np.zeros(n + 1)
    gdiff = np.zeros(n + 1)
    bad = np.zeros(n + 1, dtype=np.int64)
    for i, nd in enumerate(compute):
        last = max((pos.get(u.name, n) for u in nd.users), default=i)  # the output node is after all
        hi = min(last, n - 1)
        if hi <= i:
            continue
        diff[i] += act[i]
        diff[hi] -= act[i]
        if nc[i].requires_grad:
            gdiff[i] += act[i]
            gdiff[hi] -= act[i]
        if not isinstance(nd.meta.get("val"), torch.Tensor):
            bad[i] += 1
            bad[hi] -= 1
    cross = np.cumsum(diff)[: n - 1]
    cross_grad = np.cumsum(gdiff)[: n - 1]
    valid = np.cumsum(bad)[: n - 1] == 0

    params = dict(gm.named_parameters())
    buffers = dict(gm.named_buffers())
    readers: dict[str, list[int]] = {}
    for i, nd in enumerate(compute):
        info = nd.meta["fxpipe"]
        for t in (*info.params, *info.buffers):
            readers.setdefault(t, []).append(i)
    names, tcost, tparam, tgrad, topt, treaders = [], [], [], [], [], []
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
            tparam.append(nbytes)
        elif t in buffers:
            cost, g, o = buffers[t].numel() * buffers[t].element_size(), 0.0, 0.0
            tparam.append(0.0)
        else:
            continue
        names.append(t)
        tcost.append(cost)
        tgrad.append(g)
        topt.append(o)
        treaders.append(sorted(set(rd)))
    return Chain(fwd, bwd, act, cross, cross_grad, valid, np.array(tcost), tuple(treaders),
                 tuple(nd.name for nd in compute), np.array(tparam), np.array(tgrad), np.array(topt), tuple(names))


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
    part: Partition
    chain: Chain
    grad_buffers: int  # gradient buffers the chain counts on every stage

    def key(self):
        # best first; ties: shallower, narrower, larger b, no recomputation
        return (-self.throughput, self.d, self.w, -self.b, self.recompute)


def pipeline_time(schedule: str, stages: int, microbatches: int, bottleneck: float) -> float:
    """Steady-state time of one step when every stage takes ``bottleneck`` per micro-batch
    (forward + backward) and communication is free: 2bw never drains, so a step is m stage
    times; 1f1b and gpipe fill and drain the pipeline every step, m + d - 1. Equal to what
    :func:`fxpipe.simulate.simulate` measures on the generated lists (tests/unit/test_simulate.py)."""
    return (microbatches if schedule == "2bw" else microbatches + stages - 1) * bottleneck


def _divisors(x: int) -> list[int]:
    return [k for k in range(1, x + 1) if x % k == 0]


def _positive(name: str, v, allow_none: bool = True) -> None:
    if v is None and allow_none:
        return
    if isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0 or (isinstance(v, float) and not v.is_integer() and name != "device_memory"):
        raise PlanError(f"{name} must be a positive integer, found {v!r}")


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
    clip: bool = False,
    accumulation: str = "autograd",
    precision: str = "fp32",
) -> Plan:
    """Trace (if needed), cost and partition a model; return the best :class:`Plan`.

    ``stages`` fixes the depth d (width ``w = world_size / d``, or 1); ``stages=None`` searches
    every d dividing ``world_size`` (default: the process group's size, else 1). ``recompute``
    None lets the planner decide. ``global_batch`` (samples per optimizer step over all replicas)
    makes the planner also choose the micro-batch size b, with ``m = global_batch / (b * w)``;
    otherwise b is the traced batch size and m is ``microbatches``. ``device_memory`` (bytes)
    overrides ``device.memory_bytes``. ``costs`` reuses an earlier :func:`fxpipe.cost.annotate`.
    ``clip``: a global-norm all-reduce runs every step (``fxpipe.compile`` always runs one: it
    clips and checks for non-finite values); like data parallelism (w > 1) this makes every stage
    keep a second gradient buffer, which the memory model then counts.
    ``accumulation``: ``"autograd"`` (torch.optim) or ``"fused"`` (the kernels' path, one more
    scratch gradient per stage); see :func:`fxpipe.weights.weight_bytes`.
    ``precision``: ``"fp32"``, ``"bf16"`` or ``"fp16"`` (``fxpipe.compile``'s); the memory model
    counts the master weights, the 2-byte compute versions and compute-dtype activations.
    """
    if schedule not in _SCHEDULES:
        raise PlanError(f"schedule must be one of {_SCHEDULES}, found {schedule!r}")
    if accumulation not in ("autograd", "fused"):
        raise PlanError(f"accumulation must be 'autograd' or 'fused', found {accumulation!r}")
    if precision not in PRECISIONS:
        raise PlanError(f"precision must be one of {sorted(PRECISIONS)}, found {precision!r}")
    for name, v in (("stages", stages), ("microbatches", microbatches), ("world_size", world_size),
                    ("global_batch", global_batch), ("device_memory", device_memory)):
        _positive(name, v)
    if microbatches is None and global_batch is None:
        raise PlanError("give microbatches=m (micro-batches per step) or global_batch=N (samples per step)")
    if isinstance(model_or_gm, fx.GraphModule) and "fxpipe" in model_or_gm.meta:
        gm = model_or_gm
    elif isinstance(model_or_gm, nn.Module):
        if example_inputs is None:
            raise PlanError("plan(model, example_inputs): example_inputs (one micro-batch) are needed to trace a module")
        from .trace import trace

        gm = trace(model_or_gm, example_inputs)
    else:
        raise PlanError(f"plan expects an nn.Module or a GraphModule from fxpipe.trace, found {type(model_or_gm).__name__}")
    if world_size is None:
        import torch.distributed as dist

        world_size = dist.get_world_size() if dist.is_available() and dist.is_initialized() else None
    if stages is not None:
        ws = world_size or stages
        if ws % stages:
            raise PlanError(
                f"world_size {ws} is not divisible by stages {stages}: every replica needs all {stages} "
                f"stages; use stages in {_divisors(ws)} or a world size that is a multiple of {stages}"
            )
        depths = [stages]
        world = ws
    else:
        world = world_size or 1
        depths = _divisors(world)
    device = device or DeviceModel.for_device(torch_device)
    limit = float(device_memory) if device_memory is not None else device.memory_bytes
    if costs is None:
        costs = annotate(gm, example_inputs, mode=cost_mode, device=device, torch_device=torch_device)
        if cost_mode == "measured" and global_batch is not None and gm is not model_or_gm:  # traced here
            costs = _measure_second_size(model_or_gm, gm, example_inputs, costs, device, torch_device)
    traced_b = costs.batch_size

    n_compute = sum(1 for nd in gm.graph.nodes if nd.op in _COMPUTE)
    configs = []  # (d, w, b, m)
    for d in depths:
        w = world // d
        if global_batch is not None:
            if global_batch % w:
                raise PlanError(
                    f"global_batch {global_batch} is not divisible by the data-parallel width w={w} "
                    f"(world_size {world} / {d} stages); use a multiple of {w}"
                )
            per = global_batch // w
            if microbatches is not None:
                if per % microbatches:
                    raise PlanError(
                        f"global_batch {global_batch} is not divisible by w*m = {w * microbatches}: "
                        f"pick global_batch as a multiple of {w * microbatches}"
                    )
                configs += [(d, w, per // microbatches, microbatches)]
            else:
                configs += [(d, w, bb, per // bb) for bb in _divisors(per)]
        else:
            configs.append((d, w, traced_b, microbatches))
    if stages is not None:
        if stages > n_compute:
            raise PlanError(
                f"cannot cut {n_compute} compute nodes into {stages} stages (each stage needs at least one "
                f"node): use stages <= {n_compute}"
            )
        if schedule != "gpipe" and all(m < stages for _, _, _, m in configs):
            raise PlanError(
                f"schedule {schedule!r} needs at least as many micro-batches as stages: found microbatches="
                f"{configs[0][3]} < stages={stages}; use microbatches >= {stages}"
            )
    configs = [c for c in configs if c[0] <= n_compute and (schedule == "gpipe" or c[3] >= c[0])]
    if not configs:
        raise PlanError(
            f"no depth d in {depths} has at least d micro-batches and d compute nodes ({n_compute}); "
            f"use more micro-batches (m >= d for {schedule!r}) or a smaller world size"
        )

    chains: dict[tuple[int, int], Chain] = {}

    def chain_for(bb: int, grad_buffers: int) -> Chain:
        if (bb, grad_buffers) not in chains:
            chains[bb, grad_buffers] = chain_from_graph(gm, costs, bb, schedule=schedule, grad_buffers=grad_buffers,
                                                        optimizer_bytes_per_param=optimizer_bytes_per_param,
                                                        accumulation=accumulation, precision=precision)
        return chains[bb, grad_buffers]

    candidates: list[_Candidate] = []
    smallest_fit = math.inf
    for d, w, bb, m in configs:
        for rc in ([False, True] if recompute is None else [bool(recompute)]):
            grad_buffers = 2 if (w > 1 or clip) else 1
            chain = chain_for(bb, grad_buffers)
            sm = StageModel.for_schedule(schedule, d, m, rc, device, limit)
            if rc and not any(sm.recompute) and recompute is None:
                continue  # d == 1 under 1f1b/2bw: recomputation is off everywhere, same as rc=False
            try:
                part = partition_chain(chain, sm)
                if grad_buffers == 1 and _over_with_tied_buffers(chain, sm, part, limit):
                    # A stage holding a copy of a tied weight keeps a second gradient buffer (its
                    # tied all-reduce overlaps the next batch); where that breaks the limit, plan
                    # every stage with two, a safe bound the chain formulation can express.
                    grad_buffers = 2
                    chain = chain_for(bb, grad_buffers)
                    part = partition_chain(chain, sm)
            except PlanError as e:
                if "smallest memory" not in str(e):
                    raise
                smallest_fit = min(smallest_fit, min_memory(chain, sm))
                continue
            pipe = pipeline_time(schedule, d, m, part.bottleneck)
            grad_bytes = max(float(sum(chain.tensor_param_bytes[p] for p in _held(chain, l, r))) for l, r in part.bounds)
            ar = device.allreduce_time(grad_bytes, w)
            # 2bw applies batch t's gradients one step later, so the all-reduce overlaps the
            # next batch (PipeDream-2BW §3.1); flushing schedules wait for it.
            step = max(pipe, ar) if schedule == "2bw" else pipe + ar
            candidates.append(_Candidate(bb * m * w / step, step, ar, d, w, bb, m, rc, sm, part, chain, grad_buffers))
    if not candidates:
        raise PlanError(
            f"no configuration fits in {limit / 1e6:.1f} MB per device (searched d in {sorted({c[0] for c in configs})}, "
            f"recompute {'on/off' if recompute is None else recompute}); the smallest memory that fits is "
            f"{smallest_fit / 1e6:.1f} MB. Give device_memory >= {math.ceil(smallest_fit)}, more devices, "
            f"or a smaller micro-batch."
        )
    candidates.sort(key=_Candidate.key)
    best = candidates[0]
    runner = next((c for c in candidates[1:] if (c.d, c.w, c.b, c.recompute) != (best.d, best.w, best.b, best.recompute)), None)
    chain = best.chain
    # with one buffer counted per stage, the stages of a tied weight still keep a second one
    tied = set() if best.grad_buffers == 2 else _stages_with_shared_tensors(chain, best.part.bounds)
    sps = tuple(_stage_plan(gm, chain, best.model, s, l, r, extra_grads=s in tied)
                for s, (l, r) in enumerate(best.part.bounds))
    return Plan(
        schedule=schedule,
        stages=best.d,
        width=best.w,
        microbatch_size=best.b,
        microbatches=best.m,
        recompute=best.model.recompute,
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
        graph_hash=graph_fingerprint(gm),
    )


def _measure_second_size(model: nn.Module, gm: fx.GraphModule, example_inputs, costs: GraphCosts,
                         device: DeviceModel, torch_device) -> GraphCosts:
    """The planner is about to search b: trace and measure the model at a second micro-batch
    size (half the traced one, or twice a batch of one) and fit every measured time to both."""
    from .trace import trace

    big = costs.batch_size

    def resize(x):
        if isinstance(x, torch.Tensor) and x.dim() > 0 and x.shape[0] == big:
            return x[: big // 2] if big > 1 else torch.cat([x, x])
        return x

    second = pytree.tree_map(resize, example_inputs)
    gm2 = trace(model, second)
    other = annotate(gm2, second, mode="measured", device=device, torch_device=torch_device)
    return fit_two_sizes(gm, costs, other)


def _stages_with_shared_tensors(chain: Chain, bounds: Sequence[tuple[int, int]]) -> set[int]:
    """Stages holding a copy of a tensor that other stages read too (a tied weight): the runtime
    all-reduces its gradient between them, and such a stage keeps two gradient buffers."""
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


def _over_with_tied_buffers(chain: Chain, model: StageModel, part: "Partition", limit: float) -> bool:
    """Whether a stage of ``part`` breaks ``limit`` once its second gradient buffer (held by
    stages with a tied weight) is counted."""
    for s in _stages_with_shared_tensors(chain, part.bounds):
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
    if extra_grads:  # a tied weight's stage: a second gradient buffer (see _stages_with_shared_tensors)
        weights += grads
        grads *= 2
    k, j = (1, model.inflight[s]) if rc else (model.inflight[s], 0)
    inp = float(chain.cross[l - 1]) if l > 0 else 0.0
    acts = k * float(chain.act[l : r + 1].sum()) + j * inp
    return StagePlan(
        index=s, nodes=r - l + 1, first_node=first, last_node=last,
        first_module=module_path(nodes[first]) if first in nodes else "",
        last_module=module_path(nodes[last]) if last in nodes else "",
        forward_time=f, backward_time=bw,
        comm_time=_comm(chain, model, l - 1) + _comm(chain, model, r),
        memory=weights + acts + inp, memory_weights=copies, memory_activations=acts,
        memory_optimizer=opt, memory_grads=grads, memory_buffers=inp,
        param_bytes=pbytes, send_bytes=float(chain.cross[r]) if r < chain.n - 1 else 0.0, recompute=rc,
    )
