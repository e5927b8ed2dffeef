"""cost: per-node FLOPs, bytes and forward/backward times of a traced graph, plus the device model.

:func:`annotate` adds a :class:`NodeCost` to every node of a GraphModule made by
:func:`fxpipe.trace` (``node.meta["fxpipe_cost"]``) and returns a :class:`GraphCosts`. Two modes:

* ``"analytic"`` — FLOPs from torch's own formulas (``torch.utils.flop_counter``) evaluated on
  shapes alone, bytes from the traced shapes, and a roofline time
  ``op_latency + max(flops / peak_flops, bytes_moved / mem_bandwidth)`` on a :class:`DeviceModel`.
  Backward is twice the forward (two matmuls per forward matmul: input and weight gradients).
  Deterministic and fast: no tensor is ever allocated with real data.
* ``"measured"`` — every node runs with real tensors on the target device, forward and backward
  timed separately (warm-up, then the median of repeats). Costs are taken once, on rank 0.

Costs depend on the micro-batch size ``b``. Each cost is a :class:`Linear` ``a*b + c`` (its
``.expr`` is the sympy expression in :data:`b`), fitted from the one traced batch size ``B``: a node
that depends on the model inputs scales with the number of samples it processes (``a = (cost(B) -
c) / B``, with ``c`` the fixed per-op overhead for times and 0 for FLOPs and bytes); a node that
only reads parameters and constants is ``b``-independent (``a = 0``). The batch dimension is
independent in every standard layer, so this is exact for FLOPs and activation bytes (a scalar loss
output is kept constant). For measured times one size assumes a fixed part of ``op_latency`` and
throughput-bound kernels; when the planner searches ``b`` (``fxpipe.plan(model, ...,
global_batch=N, cost_mode="measured")``) it measures the model traced at a second size too and
:func:`fit_two_sizes` puts each time on the line through both measurements.
"""

from __future__ import annotations

import dataclasses
import math
import operator
import os
from dataclasses import dataclass
from typing import Any, Mapping

import sympy
import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from .errors import PlanError
from .trace import NodeInfo

__all__ = ["DeviceModel", "Linear", "NodeCost", "GraphCosts", "annotate", "fit_two_sizes", "is_view", "b"]

#: The micro-batch size, the one free symbol of every cost expression.
b = sympy.Symbol("b", positive=True, integer=True)



@dataclass(frozen=True)
class DeviceModel:
    """What the planner assumes about one device and the links between devices.

    Every field can be overridden in the constructor; :meth:`measure_p2p` replaces the link
    figures with a ping-pong between two real ranks. The CPU defaults (:meth:`cpu`) are
    conservative figures for one socket of a recent x86 server with gloo over loopback TCP.
    """

    name: str = "cpu"
    memory_bytes: float = 16e9  #: capacity the partitioner may fill on each device
    peak_flops: float = 100e9  #: sustained dense FLOP/s of one device (fp32)
    mem_bandwidth: float = 20e9  #: main-memory bytes/s (the roofline's memory roof)
    p2p_bandwidth: float = 2e9  #: bytes/s of one point-to-point send between adjacent stages
    p2p_latency: float = 50e-6  #: seconds of fixed cost per message
    allreduce_bandwidth: float = 1e9  #: bus bytes/s of a ring all-reduce among replicas
    op_latency: float = 5e-6  #: seconds of fixed dispatch cost per operator
    backward_ratio: float = 2.0  #: a node's backward time over its forward's (two matmuls per matmul)
    #: the same for a node bound by bytes rather than FLOPs (:meth:`bound_by_flops`): an
    #: elementwise pass's backward is about one more such pass; None: ``backward_ratio``.
    #: :meth:`calibrate` measures both.
    backward_ratio_bytes: float | None = None
    #: seconds of one optimizer step and the zeroing of the gradient accumulator after it, per
    #: byte of parameters; None: 8 bytes moved per byte over ``mem_bandwidth`` (an Adam-like step
    #: reads weights, gradients and two moments and writes three of them back; the zeroing writes
    #: the gradients)
    update_time_per_byte: float | None = None
    #: seconds per byte of parameters to copy one weight version into another's buffer (2bw's
    #: ``W(t-1)`` before it is stepped into ``W(t)``'s slot, or mixed precision's rounded copy of
    #: the master); None: 2 bytes moved per byte over ``mem_bandwidth``
    copy_time_per_byte: float | None = None
    #: CPU ranks on one host share its cores: how many of them compute at full speed at once
    #: (:meth:`calibrate` measures it; the simulator then slows each of k computing ranks to
    #: ``min(1, host_cores / k)`` of its speed alone). None: every rank has a device of its own.
    host_cores: float | None = None
    #: seconds per random number an operator draws (dropout's mask, ``bernoulli``, ``rand``):
    #: a generator's throughput, far below the memory roof on a CPU (about 10 ns per number
    #: with one thread); :meth:`calibrate` measures it. 0: priced by the roofline alone.
    random_time_per_element: float = 0.0
    #: zb's input-gradient pass (``I``) and weight-gradient pass (``W``), each over a whole
    #: backward of the same layers. They sum to more than 1 where the split costs extra (on a CPU
    #: the output gradients I keeps for W push later allocations onto fresh pages);
    #: :meth:`calibrate` measures them with ``split=True``.
    backward_input_share: float = 0.5
    backward_weight_share: float = 0.5

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.name == "name" or (f.name in ("update_time_per_byte", "copy_time_per_byte", "host_cores",
                                                "backward_ratio_bytes") and v is None):
                continue
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0 or (
                    v == 0 and f.name not in ("p2p_latency", "op_latency", "update_time_per_byte", "copy_time_per_byte",
                                              "random_time_per_element", "backward_input_share",
                                              "backward_weight_share")):
                # inf too: every field is a finite figure of a real device (a link or a memory
                # without limit has no meaning to price, and a Cluster made of it would refuse it)
                raise PlanError(
                    f"DeviceModel.{f.name} must be a positive, finite number, found {v!r}; "
                    f"pass e.g. DeviceModel({f.name}={getattr(DeviceModel, f.name)!r})"
                )

    @classmethod
    def cpu(cls, **overrides: Any) -> "DeviceModel":
        """CPU defaults; ``memory_bytes`` is this machine's physical memory."""
        mem = 16e9
        try:
            mem = float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
        except (ValueError, OSError, AttributeError):
            pass
        return cls(**{"name": "cpu", "memory_bytes": mem, "random_time_per_element": 10e-9, **overrides})

    @classmethod
    def gpu(cls, **overrides: Any) -> "DeviceModel":
        """Defaults for an H100-class GPU (dense TF32 about 400 TFLOP/s, of which ~50% is
        sustained; HBM3 3 TB/s; NVLink ~150 GB/s each way); ``memory_bytes`` from CUDA."""
        mem = 80e9
        if torch.cuda.is_available():
            mem = float(torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory)
        base = dict(
            name="cuda", memory_bytes=mem, peak_flops=200e12, mem_bandwidth=2.5e12,
            p2p_bandwidth=150e9, p2p_latency=10e-6, allreduce_bandwidth=100e9, op_latency=5e-6,
        )
        return cls(**{**base, **overrides})

    @classmethod
    def for_device(cls, device: str | torch.device | None = None, **overrides: Any) -> "DeviceModel":
        """:meth:`gpu` for a CUDA device, :meth:`cpu` otherwise."""
        kind = torch.device(device).type if device is not None else ("cuda" if torch.cuda.is_available() else "cpu")
        return cls.gpu(**overrides) if kind == "cuda" else cls.cpu(**overrides)

    def bound_by_flops(self, flops: float, moved: float) -> bool:
        """Whether a node of ``flops`` FLOPs moving ``moved`` bytes takes its roofline time from
        the FLOP roof (a matrix product) rather than the memory roof (an elementwise pass)."""
        return flops / self.peak_flops >= moved / self.mem_bandwidth

    def backward_time(self, forward: float, flops: float, moved: float) -> float:
        """Seconds of the backward of a node whose analytic forward takes ``forward`` seconds."""
        ratio = self.backward_ratio
        if self.backward_ratio_bytes is not None and not self.bound_by_flops(flops, moved):
            ratio = self.backward_ratio_bytes
        return self.op_latency + ratio * (forward - self.op_latency)

    def _own_roofs(self) -> tuple[float, float]:
        """This model's own answer to :func:`fxpipe.calibrate._roofs`: the FLOP roof's speed relative to its own
        (1), and the byte-bound backward ratio over the FLOP-bound one."""
        return 1.0, (self.backward_ratio_bytes or self.backward_ratio) / self.backward_ratio

    def update_time(self, param_bytes: float, *, copies: int = 0) -> float:
        """Seconds of one ``UPDATE`` over ``param_bytes`` bytes of parameters: the optimizer step,
        the zeroing of the gradient accumulator and ``copies`` copies of the weights (one where
        the runtime keeps two versions or a master)."""
        per_byte = self.update_time_per_byte if self.update_time_per_byte is not None else 8 / self.mem_bandwidth
        per_copy = self.copy_time_per_byte if self.copy_time_per_byte is not None else 2 / self.mem_bandwidth
        return param_bytes * (per_byte + copies * per_copy)

    def calibrate(self, gm: fx.GraphModule, example_inputs=None, *, optimizer=None,
                  torch_device: str | torch.device | None = None, repeats: int = 10,
                  barrier=None, host_ranks: int = 1, alone: bool = False, split: bool = False) -> "DeviceModel":
        """This model fitted to what this machine does with ``gm`` now: :func:`fxpipe.calibrate.calibrate`."""
        from .calibrate import calibrate

        return calibrate(self, gm, example_inputs, optimizer=optimizer, torch_device=torch_device, repeats=repeats,
                         barrier=barrier, host_ranks=host_ranks, alone=alone, split=split)

    def measure_p2p(self, group=None, *, sizes: tuple[int, int] = (4, 8 << 20), repeats: int = 10) -> "DeviceModel":
        """This model with ``p2p_latency``/``p2p_bandwidth`` measured between ranks 0 and 1 of
        ``group``: :func:`fxpipe.calibrate.measure_p2p`."""
        from .calibrate import measure_p2p

        return measure_p2p(self, group, sizes=sizes, repeats=repeats)


@dataclass(frozen=True)
class Linear:
    """A cost ``a*b + c`` in the micro-batch size ``b``."""

    a: float
    c: float = 0.0

    def __call__(self, batch: float) -> float:
        return self.a * batch + self.c

    @property
    def expr(self) -> sympy.Expr:
        """The cost as a sympy expression in :data:`b`."""
        return sympy.Float(self.a) * b + sympy.Float(self.c)

    @staticmethod
    def fit(value: float, batch: int, *, scales: bool, fixed: float = 0.0) -> "Linear":
        """``value`` observed at micro-batch size ``batch``: proportional to the batch above a
        fixed part ``min(fixed, value)`` if ``scales``, else constant."""
        if not scales or batch <= 0:
            return Linear(0.0, float(value))
        c = min(fixed, value)
        return Linear((value - c) / batch, c)


@dataclass(frozen=True)
class NodeCost:
    """Costs of one node (``node.meta["fxpipe_cost"]``), each a :class:`Linear` in ``b``.

    ``flops`` are forward FLOPs; ``out_bytes`` the bytes of its outputs (what it adds to the
    activations and what a cut after it sends); ``fwd_time``/``bwd_time`` seconds;
    ``requires_grad`` whether a gradient flows back through it (a backward exists).
    """

    flops: Linear
    out_bytes: Linear
    bytes_moved: Linear
    fwd_time: Linear
    bwd_time: Linear
    batch_dependent: bool
    requires_grad: bool


@dataclass(frozen=True)
class GraphCosts:
    """The costs of a whole graph: the mode, the batch size they were taken at, the device."""

    mode: str
    batch_size: int
    device: DeviceModel
    nodes: Mapping[str, NodeCost]

    def total(self, field: str, batch: float) -> float:
        return sum(getattr(c, field)(batch) for c in self.nodes.values())


# --------------------------------------------------------------------------------------------


def annotate(
    gm: fx.GraphModule,
    example_inputs=None,
    *,
    mode: str = "analytic",
    device: DeviceModel | None = None,
    torch_device: str | torch.device | None = None,
    repeats: int = 5,
) -> GraphCosts:
    """Attach a :class:`NodeCost` to every node of ``gm`` and return them all.

    ``example_inputs`` (one micro-batch, as given to :func:`fxpipe.trace`) is needed only by
    ``mode="measured"``; without it, inputs are synthesised from the traced shapes (zeros for
    integer tensors, so they are valid indices). ``torch_device`` is where measured nodes run.
    """
    if mode not in ("analytic", "measured"):
        raise PlanError(f"cost_mode must be 'analytic' or 'measured', found {mode!r}")
    info = gm.meta.get("fxpipe")
    if info is None:
        raise PlanError(
            "the GraphModule has no fxpipe metadata (gm.meta['fxpipe']); expected a graph made by "
            "fxpipe.trace(model, example_inputs). Trace the model with fxpipe.trace first."
        )
    device = device or DeviceModel.for_device(torch_device)
    batch = int(info.batch_size or 1)
    dep, grad = _dependence(gm)
    measured: dict[str, tuple[float, float]] = {}
    if mode == "measured":
        from .calibrate import measure_nodes

        measured = measure_nodes(gm, example_inputs, torch_device, repeats, grad)
    flop_cache: dict[Any, float] = {}
    costs: dict[str, NodeCost] = {}
    for node in gm.graph.nodes:
        if node.op == "output":
            continue
        ni: NodeInfo = node.meta["fxpipe"]
        compute = node.op in ("call_function", "call_method", "call_module")
        flops = _node_flops(gm, node, flop_cache) if compute else 0.0
        out_b = float(ni.out_bytes) if compute else 0.0
        moved, moved_params = _bytes_moved(node, ni) if compute else (0.0, 0.0)
        scal = dep[node.name]
        out_scales = scal and any(len(s.shape) > 0 for s in ni.outputs)
        if not compute:
            fwd = bwd = 0.0
        elif mode == "measured":
            fwd, bwd = measured.get(node.name, (0.0, 0.0))
        else:
            fwd = device.op_latency + max(flops / device.peak_flops, (moved + moved_params) / device.mem_bandwidth)
            bwd = device.backward_time(fwd, flops, moved + moved_params) if grad[node.name] else 0.0
            fwd += _random_elements(node) * device.random_time_per_element  # a backward draws none
        costs[node.name] = NodeCost(
            flops=Linear.fit(flops, batch, scales=scal),
            out_bytes=Linear.fit(out_b, batch, scales=out_scales),
            bytes_moved=Linear(moved / batch, moved_params) if scal else Linear(0.0, moved + moved_params),
            fwd_time=Linear.fit(fwd, batch, scales=scal, fixed=device.op_latency),
            bwd_time=Linear.fit(bwd, batch, scales=scal, fixed=device.op_latency),
            batch_dependent=scal,
            requires_grad=grad[node.name],
        )
        node.meta["fxpipe_cost"] = costs[node.name]
    return GraphCosts(mode=mode, batch_size=batch, device=device, nodes=costs)


def fit_two_sizes(gm: fx.GraphModule, costs: GraphCosts, other: GraphCosts) -> GraphCosts:
    """``costs`` with every measured time of a batch-dependent node replaced by the line through
    its measurement at ``costs.batch_size`` and ``other``'s at ``other.batch_size`` (the same
    model traced and measured at a second micro-batch size; nodes match by name). The line is
    kept non-negative: a negative slope (noise) becomes flat, a negative intercept proportional.
    Updates ``node.meta["fxpipe_cost"]`` of ``gm`` and returns the new costs."""
    if costs.mode != "measured" or other.mode != "measured":
        raise PlanError("fit_two_sizes needs two sets of measured costs (annotate(..., mode='measured'))")
    b1, b2 = costs.batch_size, other.batch_size
    if b1 == b2:
        raise PlanError(f"fit_two_sizes needs two different micro-batch sizes; both are {b1}")
    mismatched = sorted(set(costs.nodes) ^ set(other.nodes))
    if mismatched:
        raise PlanError(
            f"the traces at micro-batch sizes {b1} and {b2} differ in nodes {mismatched[:5]}: the model's graph "
            f"depends on the batch size, so costs cannot be fitted across sizes; plan with microbatches= instead"
            + (" (torch.export specialises a micro-batch of one sample: an example of 2 or more may fit)"
               if 1 in (b1, b2) else "")
        )

    def line(t1: float, t2: float) -> Linear:
        a = max((t2 - t1) / (b2 - b1), 0.0)
        c = t1 - a * b1
        return Linear(a, c) if c >= 0 else Linear(t1 / b1, 0.0)

    nodes = dict(costs.nodes)
    for name, c in costs.nodes.items():
        if not c.batch_dependent:
            continue
        o = other.nodes[name]
        nodes[name] = dataclasses.replace(
            c,
            fwd_time=line(c.fwd_time(b1), o.fwd_time(b2)),
            bwd_time=line(c.bwd_time(b1), o.bwd_time(b2)),
        )
    for node in gm.graph.nodes:
        if node.name in nodes:
            node.meta["fxpipe_cost"] = nodes[node.name]
    return dataclasses.replace(costs, nodes=nodes)


def _dependence(gm: fx.GraphModule) -> tuple[dict[str, bool], dict[str, bool]]:
    """Per node: does it depend on the model inputs (so scale with ``b``), and does a
    gradient flow through it (it reads a trainable parameter, directly or upstream)?"""
    params = {n for n, p in gm.named_parameters() if p.requires_grad}
    dep: dict[str, bool] = {}
    grad: dict[str, bool] = {}
    for node in gm.graph.nodes:
        if node.op == "output":
            continue
        ins = node.all_input_nodes
        if node.op == "placeholder":
            dep[node.name], grad[node.name] = True, False
            continue
        if node.op == "get_attr":
            dep[node.name], grad[node.name] = False, node.target in params
            continue
        ni: NodeInfo = node.meta["fxpipe"]
        floating = any(s.torch_dtype.is_floating_point or s.torch_dtype.is_complex for s in ni.outputs)
        dep[node.name] = any(dep[i.name] for i in ins)
        grad[node.name] = floating and (any(grad[i.name] for i in ins) or bool(set(ni.params) & params))
    return dep, grad


# --------------------------------------------------------------------------------------------
# analytic FLOPs and bytes

#: Operators whose output is always a view of their first input: no storage of their own.
_VIEWS = frozenset({
    "view", "_unsafe_view", "_reshape_alias", "view_as", "transpose", "t", "permute", "expand", "expand_as", "slice",
    "select", "split", "split_with_sizes", "unbind", "chunk", "tensor_split", "narrow", "squeeze", "unsqueeze",
    "as_strided", "diagonal", "unflatten", "movedim", "moveaxis", "swapaxes", "swapdims", "alias", "detach",
    "lift_fresh", "positive", "conj", "unfold", "real", "imag", "view_as_real", "view_as_complex", "mT", "mH",
    "_nested_view_from_buffer",
})
#: Operators that return a view of a contiguous input and copy a strided one.
_VIEWS_IF_CONTIGUOUS = frozenset({"reshape", "reshape_as", "flatten", "contiguous"})
#: Operators that return their input itself where nothing changes (dtype, device, layout) and a
#: copy otherwise.
_VIEWS_IF_UNCHANGED = frozenset({"to", "type_as"})


def is_view(node: fx.Node) -> bool:
    """Whether ``node``'s output shares another node's storage: ``getitem`` (a piece of a tuple
    its producer already holds), a view operator, a reshape-like one on a contiguous input, or a
    ``to`` that changes nothing. Such a node adds no activation memory, moves no bytes and does
    no arithmetic. Torch's own flag (``OpOverload.is_view``) marks every operator that *may*
    alias, ``to`` and ``contiguous`` among them, which copy in practice as often as not; this
    looks at the node's input and output to tell. (Where in-place writes may reach, the question
    is what *may* alias: :func:`fxpipe.trace.alias_base`.)"""
    if node.op == "call_function" and node.target is operator.getitem:
        return True
    if node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload):
        name = node.target._overloadpacket.__name__
    elif node.op == "call_method" and isinstance(node.target, str):
        name = node.target
    else:
        return False
    if name in _VIEWS:
        return True
    if not (name in _VIEWS_IF_CONTIGUOUS or name in _VIEWS_IF_UNCHANGED) or not node.args \
            or not isinstance(node.args[0], fx.Node):
        return False
    base, out = node.args[0].meta.get("val"), node.meta.get("val")
    if not (isinstance(base, torch.Tensor) and isinstance(out, torch.Tensor)) or base.dtype != out.dtype:
        return False
    if name in _VIEWS_IF_CONTIGUOUS:
        return base.is_contiguous()
    return (base.device == out.device and base.layout == out.layout and base.stride() == out.stride()
            and not node.kwargs.get("copy", False))


def _node_flops(gm: fx.GraphModule, node: fx.Node, cache: dict) -> float:
    """Forward FLOPs of one node, from torch's formulas on shapes; composite ops (``linear``,
    ``call_module`` leaves) are run on fake tensors under ``FlopCounterMode`` once per distinct
    signature."""
    from torch.utils.flop_counter import flop_registry

    target = node.target
    if is_view(node):  # getitem among them
        return 0.0
    if isinstance(target, torch._ops.OpOverload):
        if target._overloadpacket is torch.ops.aten.scaled_dot_product_attention:
            return _sdpa_flops(node)
        if target._overloadpacket.__name__ in _GROUPED_MATMULS:
            return _grouped_mm_flops(node)
        fn = flop_registry.get(target._overloadpacket)
        if fn is not None:
            args, kwargs = _meta_args(node)
            try:
                return float(fn(*args, out_val=node.meta.get("val"), **kwargs))
            except Exception:  # noqa: BLE001 - formula signature mismatch: fall through to fake run
                pass
    key = _signature(node)
    if key in cache:
        return cache[key]
    cache[key] = flops = _fake_flops(gm, node)
    return flops


#: Operators that draw one random number per output element (when they draw at all).
_RANDOM_OPS = frozenset({"dropout", "native_dropout", "feature_dropout", "alpha_dropout", "bernoulli", "bernoulli_",
                         "rand", "rand_like", "randn", "randn_like", "randint", "randint_like", "normal", "normal_",
                         "uniform_", "exponential_"})


def _random_elements(node: fx.Node) -> float:
    """How many random numbers ``node`` draws: one per element of its (first) output for a
    random operator, none for dropout with p = 0 or in eval mode; scaled dot-product attention
    with ``dropout_p`` > 0 draws one per attention weight."""
    target = node.target
    if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
        return 0.0
    name = target._overloadpacket.__name__
    if name != "scaled_dot_product_attention" and name not in _RANDOM_OPS:
        return 0.0
    args, kwargs = _meta_args(node)
    if name == "scaled_dot_product_attention":  # (query, key, value, attn_mask, dropout_p, ...)
        p = kwargs.get("dropout_p", args[4] if len(args) > 4 else 0.0)
        if not isinstance(p, (int, float)) or p <= 0:
            return 0.0
        q, k = args[0], args[1]
        return float(math.prod(q.shape[:-1]) * k.shape[-2])
    if "dropout" in name and (len(args) > 1 and args[1] == 0 or len(args) > 2 and args[2] is False):
        return 0.0
    out = node.meta.get("val")
    out = out[0] if isinstance(out, (tuple, list)) else out
    return float(out.numel()) if isinstance(out, torch.Tensor) else 0.0


def _sdpa_flops(node: fx.Node) -> float:
    # QK^T and (softmax)V: two batched matmuls of 2*L*S*E FLOPs per (batch, head); torch's
    # counter sees none of it on CPU, where SDPA runs a fused kernel.
    q, k, v = (a.meta["val"] for a in node.args[:3])
    batch = math.prod(q.shape[:-2])
    L, E = q.shape[-2], q.shape[-1]
    S, Ev = k.shape[-2], v.shape[-1]
    return float(2 * batch * L * S * E + 2 * batch * L * S * Ev)


#: grouped matrix products (a mixture of experts' expert layers), which torch's counter has no
#: formula for: aten's, and transformers' fallback, a custom op whose fake kernel computes nothing
_GROUPED_MATMULS = frozenset({"_grouped_mm", "grouped_mm", "grouped_mm_fallback"})


def _grouped_mm_flops(node: fx.Node) -> float:
    # Each row of the (tokens, K) input is multiplied by the one (K, N) matrix of its group:
    # 2*K FLOPs per output element, however the rows fall into groups. (Two 2-D operands with
    # offsets split the contraction instead: 2*M*N*K over all groups.)
    a, b = node.args[0].meta["val"], node.args[1].meta["val"]
    out = node.meta["val"]
    if a.dim() == 2 and b.dim() == 2:
        return float(2 * a.shape[0] * b.shape[-1] * a.shape[-1])
    return float(2 * out.numel() * a.shape[-1])


def _meta_args(node: fx.Node):
    val = lambda a: a.meta.get("val") if isinstance(a, fx.Node) else a  # noqa: E731
    return pytree.tree_map(val, node.args), pytree.tree_map(val, node.kwargs)


def _signature(node: fx.Node):
    def key(a):
        if isinstance(a, fx.Node):
            v = a.meta.get("val")
            if isinstance(v, torch.Tensor):
                return ("T", tuple(v.shape), v.dtype)
            return ("V", repr(v))
        return repr(a)

    return (node.op, str(node.target), tuple(pytree.tree_map(key, list(node.args))),
            tuple(sorted((k, str(pytree.tree_map(key, v))) for k, v in node.kwargs.items())))


def _fake_flops(gm: fx.GraphModule, node: fx.Node) -> float:
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils.flop_counter import FlopCounterMode

    mode = FakeTensorMode(allow_non_fake_inputs=True)

    def fake(a):
        if not isinstance(a, fx.Node):
            return a
        v = a.meta.get("val")
        if isinstance(v, torch.Tensor):
            with mode:
                return torch.empty(tuple(v.shape), dtype=v.dtype, device=v.device)
        if a.op == "get_attr":  # a fake copy: an in-place op must not write the model's tensor
            got = getattr(gm, a.target, None)
            return mode.from_tensor(got) if isinstance(got, torch.Tensor) else got
        return v

    try:
        args = pytree.tree_map(fake, node.args)
        kwargs = pytree.tree_map(fake, node.kwargs)
        with mode, FlopCounterMode(display=False) as counter:
            if node.op == "call_module":  # on fake copies of its state: a leaf module's forward
                # may update it in place (BatchNorm's num_batches_tracked), even on fake inputs
                sub = gm.get_submodule(node.target)
                state = {n: mode.from_tensor(t) for n, t in (*sub.named_parameters(), *sub.named_buffers())}
                torch.func.functional_call(sub, state, tuple(args), kwargs)
            elif node.op == "call_method":
                getattr(args[0], node.target)(*args[1:], **kwargs)
            else:
                node.target(*args, **kwargs)
        return float(counter.get_total_flops())
    except Exception:  # noqa: BLE001 - an op fake tensors cannot run (data-dependent): no FLOPs known
        return 0.0


def _bytes_moved(node: fx.Node, ni: NodeInfo) -> tuple[float, float]:
    """Bytes a node reads and writes: (activations, parameters/constants). Views and getitem
    move nothing (:func:`is_view`)."""
    if is_view(node):
        return 0.0, 0.0
    acts, consts = float(ni.out_bytes), float(ni.param_bytes) if node.op == "call_module" else 0.0
    for inp in node.all_input_nodes:
        info = inp.meta.get("fxpipe")
        if info is None:
            continue
        if inp.op == "get_attr":
            consts += info.out_bytes
        else:
            acts += info.out_bytes
    return acts, consts


# --------------------------------------------------------------------------------------------
# measured times
