"""plan: the frozen :class:`Plan` the partitioner hands to codegen, its JSON form and its printout.

A Plan says where every node of the traced graph runs (``plan.assignment``), the chosen depth
``d``, data-parallel width ``w``, micro-batch size ``b``, micro-batch count ``m`` and
recomputation, and what the cost model predicts per stage. Rank 0 plans and broadcasts
``plan.to_json()``; every rank rebuilds it with :meth:`Plan.from_json` and checks
``plan.graph_hash`` against :func:`graph_fingerprint` of its own trace.

Example (``print(plan)`` of tests/models.py's tiny GPT-2, ``stages=2, microbatches=4``; columns
trimmed)::

    Plan: 2bw, d=2 stages x w=1 replicas, b=2, m=4 (analytic costs on cpu, memory limit 25276.1 MB, graph c037cfe3c0ef)
      stage    nodes  span                                                   fwd ms    bwd ms    comm ms  ...  recompute
          0       81  view .. mul_2 (transformer .. transformer.h.0.mlp.act)  0.425     0.224      0.137  ...  no
          1       52  tanh .. linear (transformer.h.0.mlp.act .. lm_head)     0.299     0.337      0.137  ...  no
    placement: rank = replica x 2 + stage (replica-major; the runtime places ranks so), node = rank // 2
      node 0: replica 0 stages 0-1
    predicted 3.147 ms per step, 2542.0 samples/s (all-reduce 0.113 ms); chosen over d=2 w=1 b=2 m=4 recompute=on (2161.1 samples/s)
    global batch: b·m·w = 2 x 4 x 1 = 8 samples per step
    configurations searched (the best of each number of accelerators and depth):
      N    d    w    b    m  recompute      samples/s    step ms  ...  fits    why not chosen
      2    2    1    2    4  off               2542.0        3.1  ...  yes     chosen
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import operator
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
from tabulate import tabulate

from .cluster import Cluster, Link
from .cost import DeviceModel
from .errors import PlanError, ScheduleError
from .schedule import LAYOUTS, SCHEDULES, check_chunks, check_lookahead, min_microbatches

__all__ = ["Plan", "StagePlan", "RunnerUp", "Configuration", "graph_fingerprint"]


@dataclass(frozen=True)
class StagePlan:
    """What the cost model predicts for one stage (times in seconds, memory in bytes)."""

    index: int
    nodes: int  #: compute nodes in the stage
    first_node: str
    last_node: str
    first_module: str  #: module path of the first compute node ("" at top level)
    last_module: str
    forward_time: float  #: one micro-batch, recomputation excluded
    backward_time: float  #: one micro-batch, recomputation's extra forward included
    comm_time: float  #: send/recv of activations and gradients across its input and output cuts
    memory: float  #: total = weights + activations + optimizer + grads + buffers, at the stage's fullest moment
    memory_weights: float  #: parameter and buffer copies (2 versions of parameters under 2bw)
    memory_activations: float  #: activations of the micro-batches held at once (zb: and what deferred W passes keep; recomputation: one micro-batch's, and the others' forward outputs)
    memory_optimizer: float  #: optimizer state (AdamW: 2 fp32 moments per parameter)
    memory_grads: float  #: gradient accumulators (two copies of the parameters under 2bw, whose reductions overlap the next batch; one under a flush schedule)
    memory_buffers: float  #: received inputs (in flight and posted early), posted gradient receives, an input gradient being sent, the step's model inputs
    param_bytes: float  #: bytes of the parameters the stage owns (tied ones counted here too)
    send_bytes: float  #: bytes crossing its output cut per micro-batch
    recompute: bool
    comm_out_time: float = 0.0  #: the part of ``comm_time`` spent on its output cut
    #: its sends run beside its compute (a cluster's ``overlap_p2p``): :attr:`time` is the larger
    #: of its compute and each cut's link time, not their sum
    overlap: bool = False

    @property
    def time(self) -> float:
        """The stage's time per micro-batch, as the planner priced it: compute plus
        communication, or under :attr:`overlap` the largest of compute and each cut's link time."""
        compute = self.forward_time + self.backward_time
        if self.overlap:
            return max(compute, self.comm_time - self.comm_out_time, self.comm_out_time)
        return compute + self.comm_time


@dataclass(frozen=True)
class RunnerUp:
    """The best configuration that lost, and what it would have given."""

    stages: int
    width: int
    microbatch_size: int
    microbatches: int
    recompute: bool
    step_time: float
    throughput: float

    def describe(self) -> str:
        return (
            f"d={self.stages} w={self.width} b={self.microbatch_size} m={self.microbatches} "
            f"recompute={'on' if self.recompute else 'off'}"
        )


@dataclass(frozen=True)
class Configuration:
    """One configuration the planner priced (a row of ``Plan.configurations``): N = d·w
    accelerators, micro-batch size b, m micro-batches per replica and step, recomputation."""

    accelerators: int
    stages: int
    width: int
    microbatch_size: int
    microbatches: int
    recompute: bool
    throughput: float  #: predicted samples/s (for one that does not fit: what it would give)
    step_time: float  #: predicted seconds per optimizer step
    pipeline_time: float  #: seconds the pipeline computes per step (m stage times, plus fill/drain)
    allreduce_time: float  #: slowest gradient all-reduce of the step (data-parallel or tied)
    memory: float  #: bytes on the fullest accelerator
    fits: bool
    reason: str  #: why it lost to the chosen one ("chosen" for the winner)

    def describe(self) -> str:
        return (f"N={self.accelerators} d={self.stages} w={self.width} b={self.microbatch_size} "
                f"m={self.microbatches} recompute={'on' if self.recompute else 'off'}")


@dataclass(frozen=True)
class Plan:
    """A pipeline plan: the chosen configuration, the node-to-stage map and the predictions.

    ``assignment_pairs`` is the immutable form of the assignment: ``(node name, stage)`` for
    every node of the traced graph except ``output``, in graph order. :attr:`assignment` gives
    it as a fresh dict. Compute nodes are contiguous per stage in graph order; a placeholder or
    ``get_attr`` node has the stage of its first user (inputs are read where needed, never sent;
    a parameter read on two stages is duplicated).
    """

    schedule: str
    stages: int  #: d, pipeline depth
    width: int  #: w, data-parallel replicas of the pipeline
    microbatch_size: int  #: b
    microbatches: int  #: m per optimizer step (per replica)
    recompute: tuple[bool, ...]  #: per stage
    assignment_pairs: tuple[tuple[str, int], ...]
    stage_plans: tuple[StagePlan, ...]
    step_time: float  #: predicted seconds per optimizer step
    throughput: float  #: predicted samples per second (b * m * w / step_time)
    bottleneck: float  #: predicted seconds per micro-batch of the slowest stage
    allreduce_time: float  #: data-parallel gradient all-reduce per step (0 when w == 1)
    runner_up: RunnerUp | None
    cost_mode: str
    device: DeviceModel
    memory_limit: float  #: bytes each stage had to fit in
    graph_hash: str
    precision: str = "fp32"  #: the precision the memory and time model assumed
    cluster: Cluster | None = None  #: the cluster planned for (None: this machine, one node)
    #: ``(rank, stage, replica, node)`` for every rank, in rank order, on node ``rank // per_node``
    placement: tuple[tuple[int, int, int, int], ...] = ()
    #: the best configuration of each depth the search priced, best first (the chosen one among them)
    configurations: tuple[Configuration, ...] = ()
    #: which rank runs which (stage, replica), as the runtime places them (fxpipe.schedule.rank_of):
    #: "replica" (rank = replica * d + stage) or "stage" (rank = stage * w + replica)
    layout: str = "replica"
    #: forwards every stage but the last runs ahead of 1F1B's order (2bw, 1f1b;
    #: :func:`fxpipe.schedule.warmup`): one more micro-batch's activations held there per unit
    lookahead: int = 0
    #: stages per rank (interleaved 1F1B, 1f1b only: :func:`fxpipe.schedule.lane_of`): ``stages``
    #: counts them all, and a replica runs on ``stages / chunks`` ranks
    chunks: int = 1

    def __post_init__(self):
        # a plan read from JSON someone edited: the sizes and names every phase reads must be sound
        for name in ("stages", "width", "microbatch_size", "microbatches"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise PlanError(f"the plan's {name} must be an int >= 1, found {v!r}; re-plan")
        if len(self.recompute) != self.stages or len(self.stage_plans) != self.stages:
            raise PlanError(f"the plan has {self.stages} stages but {len(self.recompute)} recompute flags and "
                            f"{len(self.stage_plans)} stage plans; re-plan")
        if self.schedule not in SCHEDULES:
            raise PlanError(f"the plan's schedule must be one of {SCHEDULES}, found {self.schedule!r}; re-plan")
        try:
            check_lookahead(self.schedule, self.lookahead)
            check_chunks(self.schedule, self.stages, self.microbatches, self.chunks, self.lookahead)
            if self.microbatches < (least := min_microbatches(self.schedule, self.stages, self.lookahead)):
                raise PlanError(f"the plan's schedule {self.schedule!r} with lookahead={self.lookahead} needs "
                                f"microbatches >= {least}, found {self.microbatches}; re-plan")
        except ScheduleError as e:
            raise PlanError(f"{e}; re-plan") from None
        if self.layout not in LAYOUTS:
            raise PlanError(f"the plan's layout must be one of {LAYOUTS} (replica-major: rank = replica x d + stage; "
                            f"stage-major: rank = stage x w + replica), found {self.layout!r}; re-plan")

    @property
    def assignment(self) -> dict[str, int]:
        """Node name -> stage index, for every node except ``output``."""
        return dict(self.assignment_pairs)

    @property
    def world_size(self) -> int:
        """Ranks the plan runs on: ``stages / chunks`` per replica, ``width`` replicas."""
        return self.stages // self.chunks * self.width

    @property
    def global_batch(self) -> int:
        """Samples per optimizer step, b * m * w: exactly what ``Pipeline.step`` needs."""
        return self.microbatch_size * self.microbatches * self.width

    # ---------------------------------------------------------------------------------- JSON

    def to_json(self) -> str:
        """A JSON string that :meth:`from_json` turns back into an equal Plan."""
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, s: str) -> "Plan":
        try:
            d = json.loads(s)
            return cls._from_dict(d)
        except PlanError:
            raise
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise PlanError(f"not a plan's JSON (Plan.to_json()): {type(e).__name__}: {e}; make the plan again with "
                            f"fxpipe.plan(...), or pass the file Plan.to_json() wrote, unedited") from e

    @classmethod
    def _from_dict(cls, d: dict) -> "Plan":
        d["recompute"] = tuple(bool(x) for x in d["recompute"])
        d["assignment_pairs"] = tuple((str(n), int(i)) for n, i in d["assignment_pairs"])
        d["stage_plans"] = tuple(StagePlan(**sp) for sp in d["stage_plans"])
        d["runner_up"] = None if d["runner_up"] is None else RunnerUp(**d["runner_up"])
        d["device"] = DeviceModel(**d["device"])
        if d.get("cluster") is not None:
            c = d["cluster"]
            d["cluster"] = Cluster(**{**c, "intra": Link(**c["intra"]), "inter": Link(**c["inter"])})
        d["placement"] = tuple(tuple(int(x) for x in row) for row in d.get("placement", ()))
        d["configurations"] = tuple(Configuration(**c) for c in d.get("configurations", ()))
        return cls(**d)

    # ------------------------------------------------------------------------------ printing

    def table(self) -> str:
        rows = []
        for sp in self.stage_plans:
            span = f"{sp.first_node} .. {sp.last_node}"
            if sp.first_module or sp.last_module:
                span += f" ({sp.first_module or '<top>'} .. {sp.last_module or '<top>'})"
            rows.append([
                sp.index, sp.nodes, span, sp.forward_time * 1e3, sp.backward_time * 1e3,
                sp.comm_time * 1e3, sp.memory / 1e6, sp.param_bytes / 1e6, "yes" if sp.recompute else "no",
            ])
        headers = ["stage", "nodes", "span", "fwd ms", "bwd ms", "comm ms", "memory MB", "params MB", "recompute"]
        return tabulate(rows, headers=headers, floatfmt=".3f")

    def placement_text(self, limit: int = 8) -> str:
        """Which node holds which replica's stages, and which neighbouring stages cross nodes."""
        if not self.placement:
            return ""
        nodes: dict[int, dict[int, list[int]]] = {}
        for _, stage, replica, node in self.placement:
            nodes.setdefault(node, {}).setdefault(replica, []).append(stage)
        per_node = self.cluster.per_node if self.cluster is not None else len(self.placement)
        rule = (f"replica x {self.stages} + stage" if self.layout == "replica" else f"stage x {self.width} + replica")
        lines = [f"placement: rank = {rule} ({self.layout}-major; the runtime places ranks so), node = rank // {per_node}"]
        shown = sorted(nodes)
        for node in shown[:limit]:
            groups: dict[str, list[int]] = {}
            for replica, stages in sorted(nodes[node].items()):
                groups.setdefault(_span(stages), []).append(replica)
            parts = [f"replica{'s' if len(r) > 1 else ''} {_span(r)} stage{'s' if '-' in st else ''} {st}"
                     for st, r in groups.items()]
            lines.append(f"  node {node}: " + "; ".join(parts))
        if len(shown) > limit:
            lines.append(f"  ... {len(shown) - limit} more nodes")
        node_of = {(stage, replica): node for _, stage, replica, node in self.placement}
        crossing = [s for s in range(self.stages - 1)
                    if any(node_of[s, r] != node_of[s + 1, r] for r in range(self.width))]
        if crossing:
            lines.append("  stages sending across nodes (inter-node link): "
                         + ", ".join(f"{s}->{s + 1}" for s in crossing))
        return "\n".join(lines)

    def configurations_table(self) -> str:
        """The search's best configuration per depth: throughput, memory and why each lost."""
        if not self.configurations:
            return ""
        rows = []
        for c in self.configurations:
            rows.append([
                c.accelerators, c.stages, c.width, c.microbatch_size, c.microbatches, "on" if c.recompute else "off",
                c.throughput, c.step_time * 1e3, c.allreduce_time * 1e3, c.memory / 1e9,
                "yes" if c.fits else "NO", c.reason,
            ])
        headers = ["N", "d", "w", "b", "m", "recompute", "samples/s", "step ms", "all-reduce ms", "memory GB", "fits",
                   "why not chosen"]
        return tabulate(rows, headers=headers, floatfmt=".1f")

    def why(self) -> str:
        head = f"predicted {self.step_time * 1e3:.3f} ms per step, {self.throughput:.1f} samples/s"
        if self.allreduce_time:
            head += f" (all-reduce {self.allreduce_time * 1e3:.3f} ms)"
        if self.runner_up is None:
            return head + "; the only configuration that fits"
        r = self.runner_up
        return f"{head}; chosen over {r.describe()} ({r.throughput:.1f} samples/s)"

    def __str__(self) -> str:
        head = (
            f"Plan: {self.schedule}" + (f" (lookahead {self.lookahead})" if self.lookahead else "")
            + (f" interleaved, {self.chunks} stages per rank on {self.stages // self.chunks} ranks per replica"
               if self.chunks > 1 else "")
            + f", d={self.stages} stages x w={self.width} replicas, b={self.microbatch_size}, m={self.microbatches} "
            f"({self.cost_mode} costs on {self.device.name}, memory limit {megabytes(self.memory_limit)}, "
            f"graph {self.graph_hash[:12]})"
        )
        batch = (f"global batch: b·m·w = {self.microbatch_size} x {self.microbatches} x {self.width} = "
                 f"{self.global_batch} samples per step")
        parts = [head]
        if self.cluster is not None:
            parts.append(f"cluster {self.cluster.describe()}; precision {self.precision}")
        parts += [self.table(), self.placement_text(), self.why(), batch]
        if self.configurations:
            parts += ["configurations searched (the best of each number of accelerators and depth):", self.configurations_table()]
        return "\n".join(p for p in parts if p)


# --------------------------------------------------------------------------------------------


def megabytes(nbytes: float) -> str:
    """A memory size for a message: ``25276.1 MB``, or for sizes under 0.1 MB the bytes
    (``2,368 bytes``), which one decimal of MB would print as 0.0."""
    return f"{nbytes / 1e6:.1f} MB" if nbytes >= 1e5 else f"{nbytes:,.0f} bytes"


def graph_fingerprint(gm: fx.GraphModule) -> str:
    """A hex digest of the traced graph: every node's name, op, target, inputs and output
    shapes/dtypes. Two ranks that traced the same model on the same inputs get the same one."""
    h = hashlib.sha256()
    for node in gm.graph.nodes:
        ins = ",".join(a.name for a in node.all_input_nodes)
        info = node.meta.get("fxpipe")
        if info is not None:
            outs = ";".join(f"{s.dtype}{list(s.shape)}" for s in info.outputs)
        else:
            val = node.meta.get("val")
            outs = f"{val.dtype}{list(val.shape)}" if isinstance(val, torch.Tensor) else ""
        h.update(f"{node.name}|{node.op}|{_target_name(node.target)}|{ins}|{outs}\n".encode())
    return h.hexdigest()


def _target_name(target: Any) -> str:
    if isinstance(target, str):
        return target
    if target is operator.getitem:
        return "getitem"
    name = getattr(target, "__qualname__", None) or getattr(target, "__name__", None)
    mod = getattr(target, "__module__", None)
    if isinstance(target, torch._ops.OpOverload):
        return str(target)
    return f"{mod}.{name}" if name else str(target)


def _span(xs: list[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2,5"``."""
    xs = sorted(xs)
    out, i = [], 0
    while i < len(xs):
        j = i
        while j + 1 < len(xs) and xs[j + 1] == xs[j] + 1:
            j += 1
        out.append(str(xs[i]) if i == j else f"{xs[i]}-{xs[j]}")
        i = j + 1
    return ",".join(out)
