"""codegen: cut a traced graph into one ``torch.fx.GraphModule`` per pipeline stage.

Given the graph from :func:`fxpipe.trace` and a stage for every node (a plan's
``assignment``), :func:`split` builds a :class:`StagedModel`: one :class:`Stage` per pipeline
stage, each with its own module, explicit ordered boundary inputs/outputs, and its parameters
laid out as views into one flat buffer per dtype (gradients likewise).

Example (``tests/models.py``'s 4-layer MLP, cut after its second ReLU)::

    >>> gm = fxpipe.trace(mlp, (torch.randn(4, 16),))
    >>> names = [n.name for n in gm.graph.nodes if n.op.startswith("call")]
    >>> names
    ['linear', 'relu', 'dropout', 'linear_1', 'relu_1', 'linear_2', 'relu_2', 'linear_3']
    >>> staged = fxpipe.codegen.split(gm, {n: int(i > 4) for i, n in enumerate(names)})
    >>> s = staged.stages[1]
    >>> s.model_inputs, s.inputs, s.outputs, s.param_names
    ((), ('relu_1',), ('linear_3',), ('5.weight', '5.bias', '7.weight', '7.bias'))
    >>> print(s.code)
    # fxpipe stage 1 of 2 (0-based): 3 nodes, linear_2 .. linear_3
    # forward(*model_inputs, *inputs) -> outputs, always a tuple
    # model inputs: (none)
    # inputs, from stage 0, in order:
    #   relu_1: float32[4, 32]  (made on stage 0)
    # outputs, the model's flat outputs:
    #   linear_3: float32[4, 8]
    # parameters: 4 tensors in flat buffers float32[1,320]
    #   5.weight: float32[32, 32] @ 0
    #   5.bias: float32[32] @ 1024
    #   7.weight: float32[8, 32] @ 1056
    #   7.bias: float32[8] @ 1312
    def forward(self, relu_1):
        _5_weight = getattr(self, "5").weight
        ...
        linear_2 = torch.ops.aten.linear.default(relu_1, _5_weight, _5_bias);  ...
        relu_2 = torch.ops.aten.relu.default(linear_2);  linear_2 = None
        linear_3 = torch.ops.aten.linear.default(relu_2, _7_weight, _7_bias);  ...
        return (linear_3,)
    >>> out = staged.stages[1].module(*staged.stages[0].module(x))   # boundary values handed on

Rules, in the order the code applies them:

* **Cut points.** Only compute nodes (``call_*``) are cut: they must be contiguous in graph
  order, stages ``0..d-1``, none empty. Placeholders (model inputs) and ``get_attr`` reads are
  not cut points: every stage that reads a model input takes it directly (every rank has the
  global batch; model inputs are never sent between stages), and every stage that reads a
  parameter or buffer owns a copy of it. Their entries in the assignment are ignored.
* **Tuples stay home.** A multi-output op (``aten.split``, ``max.dim``) makes a tuple that only
  its ``operator.getitem`` users read; each such getitem is moved to its producer's stage so no
  tuple crosses a boundary (``StagedModel.assignment`` is the assignment after that move). Any
  other non-tensor value crossing a cut is a :class:`~fxpipe.errors.PlanError`.
* **Boundaries.** The boundary between stage ``i`` and ``i+1`` is every value made by a compute
  node on a stage ``<= i`` and read on a stage ``> i`` (the model's outputs count as read on the
  last stage), in graph order of the producers. A value that skips stages is *forwarded*: each
  stage in between takes it in ``inputs`` and returns it, unchanged, in ``outputs``. Only
  adjacent stages communicate, and a cut costs the bytes of every value live across it (the
  partitioner's cost model). ``stage.inputs == previous_stage.outputs``, name for name.
* **Stage modules.** ``stage.module(*model_inputs, *inputs)`` returns a tuple in ``outputs``
  order; the last stage returns the model's flat outputs (``TraceInfo.unflatten_output`` makes
  the model's structure of them).
* **Parameters.** A stage's parameters keep the original model's canonical names and are
  ``nn.Parameter`` views into one flat buffer per dtype (``stage.flat.buffers``), in order of
  first use (``stage.flat.layout``, which the runtime's weight store and the fused kernels use).
  The original model is not modified: values are copied in. Buffers (BatchNorm statistics) are
  copied too and stay module attributes; ``torch.func.functional_call`` can pass others.
* **Tied parameters.** A parameter read on several stages (GPT-2's ``wte``/``lm_head``) has a
  copy on each, listed in ``StagedModel.tied``; the copies stay equal when their gradients are
  summed before each update (the runtime's tied all-reduce), and
  :meth:`StagedModel.state_dict` checks that they agree.
"""

from __future__ import annotations

import copy
import operator
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Collection, Mapping, Sequence

import torch
import torch.fx as fx
from torch import nn

from .device import follow_device
from .errors import FxpipeError, PlanError
from .precision import AUTOCAST_META
from .trace import TensorSpec, TraceInfo, get_attr

__all__ = [
    "split",
    "from_plan",
    "StagedModel",
    "Stage",
    "TiedParam",
    "FlatParams",
    "FlatLayout",
    "ParamSlot",
    "stage_code",
    "write_stage_code",
]

_COMPUTE = ("call_function", "call_method", "call_module")


# --------------------------------------------------------------------------------------------
# flat parameter buffers


@dataclass(frozen=True)
class ParamSlot:
    """Where one parameter lives in its dtype's flat buffer: ``flat[offset:offset+numel]``."""

    name: str
    dtype: torch.dtype
    offset: int
    numel: int
    shape: tuple[int, ...]
    requires_grad: bool = True


@dataclass(frozen=True)
class FlatLayout:
    """The placement of a stage's parameters in flat buffers, one per dtype; pure data.

    The runtime's other weight versions (2bw's second one, mixed precision's compute copy) are
    further flat buffers of the same layout (:class:`fxpipe.weights.WeightStore`), whose
    parameters are ``layout.views(buffers)``.
    """

    slots: tuple[ParamSlot, ...]
    sizes: tuple[tuple[torch.dtype, int], ...]  # (dtype, numel) in order of first appearance
    device: torch.device

    def numel(self, dtype: torch.dtype) -> int:
        return dict(self.sizes)[dtype]

    @property
    def nbytes(self) -> int:
        return sum(n * d.itemsize for d, n in self.sizes)

    def empty_like(self) -> dict[torch.dtype, torch.Tensor]:
        """New, uninitialised flat buffers of this layout (dtype -> 1-D tensor)."""
        return {d: torch.empty(n, dtype=d, device=self.device) for d, n in self.sizes}

    def zeros_like(self) -> dict[torch.dtype, torch.Tensor]:
        return {d: torch.zeros(n, dtype=d, device=self.device) for d, n in self.sizes}

    def views(self, buffers: Mapping[torch.dtype, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Name -> tensor view into ``buffers`` (flat buffers of this layout), shaped like the
        parameter: what ``torch.func.functional_call(stage.module, views, args)`` takes."""
        self._check(buffers)
        return {s.name: buffers[s.dtype][s.offset : s.offset + s.numel].view(s.shape) for s in self.slots}

    def pack(self, tensors: Mapping[str, torch.Tensor]) -> dict[torch.dtype, torch.Tensor]:
        """New flat buffers holding a copy of ``tensors`` (name -> tensor, every slot)."""
        missing = [s.name for s in self.slots if s.name not in tensors]
        if missing:
            raise KeyError(f"pack needs a tensor for every parameter of the layout; missing {missing[:5]}")
        out = self.empty_like()
        for s in self.slots:
            out[s.dtype][s.offset : s.offset + s.numel].view(s.shape).copy_(tensors[s.name])
        return out

    def cast(self, dtype: torch.dtype, keep: Collection[str] = ()) -> "FlatLayout":
        """The same parameters in ``dtype`` (floating ones but those named in ``keep``; others keep
        theirs): the layout of a mixed-precision stage's compute copies, whose master keeps this
        one (``keep``: :func:`fxpipe.precision.fp32_params`)."""
        offsets: dict[torch.dtype, int] = {}
        slots = []
        for sl in self.slots:
            dt = dtype if sl.dtype.is_floating_point and sl.name not in keep else sl.dtype
            off = offsets.setdefault(dt, 0)
            slots.append(ParamSlot(sl.name, dt, off, sl.numel, sl.shape, sl.requires_grad))
            offsets[dt] = off + sl.numel
        return FlatLayout(tuple(slots), tuple(offsets.items()), self.device)

    def _check(self, buffers: Mapping[torch.dtype, torch.Tensor]) -> None:
        for d, n in self.sizes:
            b = buffers.get(d)
            if b is None or b.dim() != 1 or b.numel() != n or b.dtype != d or not b.is_contiguous():
                found = "nothing" if b is None else f"{b.dtype} shape {tuple(b.shape)} contiguous={b.is_contiguous()}"
                raise ValueError(
                    f"flat buffer for {d} does not fit the layout: expected a contiguous 1-D {d} "
                    f"tensor of {n} elements, found {found}. Make it with layout.empty_like()."
                )


class FlatParams:
    """A stage's initial parameters, laid out in flat buffers (one per dtype).

    ``buffers`` (dtype -> flat weights) hold the values; ``params`` (name -> ``nn.Parameter``)
    are views into them, registered in the stage module. Codegen emits this as data: the
    runtime's :class:`~fxpipe.weights.WeightStore` owns the versions, gradients and updates.
    """

    def __init__(self, layout: FlatLayout, buffers: dict[torch.dtype, torch.Tensor]):
        layout._check(buffers)
        self.layout = layout
        self.buffers = buffers
        views = layout.views(buffers)
        self.params: dict[str, nn.Parameter] = {
            s.name: nn.Parameter(views[s.name], requires_grad=s.requires_grad) for s in layout.slots
        }

    @classmethod
    def build(cls, named: Sequence[tuple[str, torch.Tensor]], device: torch.device, *, copy: bool = True) -> "FlatParams":
        """Flat buffers holding copies of ``named`` (name, tensor) pairs, in that order
        (``copy=False``: uninitialised, for the caller to fill; the tensors may be on meta)."""
        offsets: dict[torch.dtype, int] = {}
        slots = []
        for name, t in named:
            off = offsets.setdefault(t.dtype, 0)
            slots.append(ParamSlot(name, t.dtype, off, t.numel(), tuple(t.shape), bool(t.requires_grad)))
            offsets[t.dtype] = off + t.numel()
        layout = FlatLayout(tuple(slots), tuple(offsets.items()), torch.device(device))
        if not copy:
            return cls(layout, layout.empty_like())
        with torch.no_grad():
            buffers = layout.pack({name: t.detach() for name, t in named})
        return cls(layout, buffers)

    def clone_buffers(self) -> dict[torch.dtype, torch.Tensor]:
        """A copy of the flat weights (a second weight version for 2BW)."""
        return {d: b.clone() for d, b in self.buffers.items()}

    @property
    def numel(self) -> int:
        return sum(n for _, n in self.layout.sizes)

    def __repr__(self) -> str:
        sizes = ", ".join(f"{str(d).removeprefix('torch.')}: {n}" for d, n in self.layout.sizes)
        return f"FlatParams({len(self.params)} params; {sizes})"


# --------------------------------------------------------------------------------------------
# stages


@dataclass(frozen=True)
class TiedParam:
    """A canonical parameter read on more than one stage: each of ``stages`` holds a copy."""

    name: str
    stages: tuple[int, ...]


@dataclass(eq=False)
class Stage:
    """One pipeline stage.

    ``module(*model_inputs, *inputs)`` -> tuple in ``outputs`` order. ``model_inputs`` are names
    of flat model inputs (in flat input order), ``inputs`` the boundary values from the previous
    stage (equal to its ``outputs``), both with specs at the traced micro-batch size.
    """

    index: int
    num_stages: int
    module: fx.GraphModule
    model_inputs: tuple[str, ...]
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    input_specs: tuple[TensorSpec, ...]
    output_specs: tuple[TensorSpec | None, ...]
    param_names: tuple[str, ...]
    buffer_names: tuple[str, ...]
    flat: FlatParams
    nodes: tuple[str, ...]  # the original graph's compute nodes that run here, in graph order
    produced_on: dict[str, int] = field(default_factory=dict)  # boundary value -> its stage
    tied: dict[str, tuple[int, ...]] = field(default_factory=dict)  # param -> other stages

    @property
    def code(self) -> str:
        return stage_code(self)

    def __repr__(self) -> str:
        return (
            f"Stage({self.index}/{self.num_stages}: {len(self.nodes)} nodes, model_inputs={self.model_inputs}, "
            f"inputs={self.inputs}, outputs={self.outputs}, {self.flat!r})"
        )


@dataclass(eq=False)
class StagedModel:
    """Every stage of a split model, plus what is needed to run and checkpoint them."""

    stages: list[Stage]
    input_names: tuple[str, ...]
    output_names: tuple[str, ...]
    trace_info: TraceInfo
    tied: list[TiedParam]
    assignment: dict[str, int]  # compute node -> stage, after moving getitems home
    unused_state: dict[str, torch.Tensor]  # copies of parameters/buffers no node reads
    originals: dict[str, list[str]]  # canonical name -> original state_dict keys

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    def state_dict(self, stage_dicts: Sequence[Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """The full state dict under the ORIGINAL model's keys, merged from each stage's (canonical
        names; the pipeline gathers them from its weight stores, the owners of the newest
        version): ``model.load_state_dict(sd)`` loads it strictly. Raises if copies of a tied
        tensor differ."""
        if len(stage_dicts) != len(self.stages):
            raise ValueError(f"expected {len(self.stages)} stage state dicts, found {len(stage_dicts)}")
        merged: dict[str, torch.Tensor] = {}
        first: dict[str, int] = {}
        for i, sd in enumerate(stage_dicts):
            for name, t in sd.items():
                if name not in merged:
                    merged[name], first[name] = t, i
                    continue
                other = merged[name]
                if other.shape != t.shape or not torch.equal(other.to(t.device), t):
                    diff = (other.to(t.device).float() - t.float()).abs().max().item() if other.shape == t.shape else "shape"
                    raise FxpipeError(
                        f"the copies of tied tensor {name!r} on stages {first[name]} and {i} differ "
                        f"(max abs difference {diff}). Their gradients must be summed before every "
                        f"update (the runtime's TIED_START/TIED_WAIT) and the same optimizer step "
                        f"applied to each copy."
                    )
        for name, t in self.unused_state.items():  # a copy, as the stages' are: the caller may write to it
            merged.setdefault(name, t.detach().clone())
        return self.to_original(merged)

    def to_original(self, canonical: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Canonical names to the original model's keys: a tensor under every key it had (tied
        or shared weights appear under each)."""
        return {key: t for name, t in canonical.items() for key in self.originals.get(name, [name])}

    def __repr__(self) -> str:
        body = "\n".join(f"  {st!r}" for st in self.stages)
        return f"StagedModel({self.num_stages} stages, tied={[t.name for t in self.tied]}\n{body}\n)"


# --------------------------------------------------------------------------------------------
# split


def from_plan(gm: fx.GraphModule, plan, **kwargs) -> StagedModel:
    """:func:`split` with ``plan.assignment`` (a :class:`fxpipe.plan.Plan`); checks the plan's
    stage count against it."""
    staged = split(gm, plan.assignment, **kwargs)
    if plan.stages != staged.num_stages:
        raise PlanError(
            f"the plan has {plan.stages} stages but its assignment uses {staged.num_stages} "
            f"(0..{staged.num_stages - 1}); the plan is inconsistent: re-plan."
        )
    return staged


def split(
    gm: fx.GraphModule,
    assignment: Mapping[str, int],
    *,
    device: torch.device | str | None = None,
    build: Collection[int] | None = None,
    source=None,
    weights: bool = True,
) -> StagedModel:
    """Cut ``gm`` (from :func:`fxpipe.trace`) into stages by ``assignment`` (node name -> stage).

    ``device``: where the stages' parameters and buffers go (default: the traced model's
    device); device arguments baked into the graph (``arange(..., device=cpu)``) are moved with
    them. ``build``: the stage indices to materialise there (default all); the others get
    their module and flat buffers on the ``meta`` device (no memory; code and specs intact), as
    a rank that runs only its own stages needs.

    ``source``: where the built stages' tensor values come from, an object with
    ``fill(dest, originals)`` writing each ``dest[name]`` (allocated on ``device``) for the
    model's tensor ``originals[name]`` (:class:`fxpipe.materialize.Materializer`: a state dict,
    the modules' initialisers; how a model on the meta device is built). Default: copies of the
    traced model's own tensors, which must then not be on the meta device.

    ``weights=False``: the built stages' parameters (and their flat buffers) stay on the ``meta``
    device; only buffers and constants are materialised. For stages that are always called with
    weights passed in (``eval_step``'s, run by ``functional_call`` on the training stages'
    newest weights), so they hold no second copy of them.
    """
    info = gm.meta.get("fxpipe")
    if not isinstance(info, TraceInfo):
        raise TypeError(
            "codegen.split expects a GraphModule made by fxpipe.trace (gm.meta['fxpipe'] is a "
            f"TraceInfo); found {type(info).__name__}. Trace the model with fxpipe.trace first."
        )
    stage_of, d = _stage_map(gm, assignment)
    nodes = list(gm.graph.nodes)
    output = next(n for n in nodes if n.op == "output")
    compute = [n for n in nodes if n.op in _COMPUTE]

    def use_stage(u: fx.Node) -> int:
        return d - 1 if u.op == "output" else stage_of[u]

    last_use = {n: max((use_stage(u) for u in n.users), default=stage_of[n]) for n in compute}
    boundaries = [[n for n in compute if stage_of[n] <= i < last_use[n]] for i in range(d - 1)]
    for i, values in enumerate(boundaries):
        for n in values:
            val = n.meta.get("val")
            if not isinstance(val, torch.Tensor):
                # the fallback tracer records no value for Python scalars (x.size(0))
                kind = "a Python value" if val is None else f"a {type(val).__name__}"
                users = sorted({u.name for u in n.users if use_stage(u) > stage_of[n]})
                raise PlanError(
                    f"value {n.name!r} crosses the cut between stages {i} and {i + 1}, but it is "
                    f"{kind}, not a tensor: only tensors travel between "
                    f"stages.\n  {n.format_node()}\nPut {n.name!r} and its users {users} on one stage."
                )

    # the device the trace ran on (a meta model traces as if on the CPU): baked device arguments name it
    src_device = info.device or next((p.device for p in gm.parameters()), torch.device("cpu"))
    device = torch.device(device) if device is not None else src_device
    build = set(range(d)) if build is None else set(build)
    bad = sorted(build - set(range(d)))
    if bad:
        raise ValueError(f"build names stages {bad}, but there are {d} stages (0..{d - 1})")

    alias_to_canon = {a: c for c, aliases in info.tied.items() for a in aliases}
    canon = lambda name: alias_to_canon.get(name, name)  # noqa: E731
    gm_params = dict(gm.named_parameters(remove_duplicate=False))

    # Which stages read each canonical parameter/buffer (for tied copies and the mutation check).
    readers: dict[str, set[int]] = {}
    per_stage: list[list[fx.Node]] = [[] for _ in range(d)]
    for n in compute:
        per_stage[stage_of[n]].append(n)
    for s in range(d):
        for r in per_stage[s] + ([output] if s == d - 1 else []):
            for name in _state_read(gm, r, canon):
                readers.setdefault(name, set()).add(s)
    _check_mutated_buffers(compute, stage_of, readers, canon, gm_params)

    produced_on = {n.name: stage_of[n] for n in compute}
    stages = []
    for s in range(d):
        inputs = boundaries[s - 1] if s > 0 else []
        if s < d - 1:
            outs: Any = tuple(boundaries[s])
        else:
            outs = output.args[0] if isinstance(output.args[0], (tuple, list)) else (output.args[0],)
        stage_device = device if s in build else torch.device("meta")
        stages.append(
            _build_stage(
                gm, s, d, per_stage[s], inputs, outs, output if s == d - 1 else None,
                canon, gm_params, readers, produced_on, src_device, stage_device, source, weights,
            )
        )

    param_names = {canon(n) for n in gm_params}
    tied = [TiedParam(name, tuple(sorted(ss))) for name, ss in readers.items() if len(ss) > 1 and name in param_names]
    originals, unused = _originals(gm, info, canon, readers)
    meta = {n: t for n, t in unused.items() if t.is_meta}
    if meta:  # a meta model's state no stage reads: the source's values, on the CPU, for state_dict()
        dest = {n: torch.empty_like(t, device="cpu") for n, t in meta.items()}
        _fill(source, dest, meta, "state no stage reads")
        unused.update(dest)
    out_names = stages[-1].outputs
    return StagedModel(
        stages=stages,
        input_names=tuple(info.input_names),
        output_names=out_names,
        trace_info=info,
        tied=tied,
        assignment={n.name: stage_of[n] for n in compute},
        unused_state=unused,
        originals=originals,
    )


def _stage_map(gm: fx.GraphModule, assignment: Mapping[str, int]) -> tuple[dict[fx.Node, int], int]:
    """Validate ``assignment`` and return (compute node -> stage, number of stages), with each
    getitem of a tuple moved to its producer's stage."""
    if not isinstance(assignment, Mapping):
        raise TypeError(f"assignment must map node names to stage indices, found {type(assignment).__name__}")
    nodes = list(gm.graph.nodes)
    by_name = {n.name: n for n in nodes}
    unknown = [k for k in assignment if k not in by_name]
    if unknown:
        raise PlanError(
            f"the assignment names {len(unknown)} node(s) that are not in the graph, e.g. "
            f"{unknown[:5]}. A plan only fits the trace it was made from (same model, same input "
            f"shapes): re-plan after re-tracing."
        )
    compute = [n for n in nodes if n.op in _COMPUTE]
    if not compute:
        raise PlanError("the graph has no compute node (call_*): there is nothing to cut into stages")
    missing = [n for n in compute if n.name not in assignment]
    if missing:
        raise PlanError(
            f"the assignment gives no stage to {len(missing)} compute node(s), the first:\n"
            f"  {missing[0].format_node()}\nMap every node except `output` to a stage index."
        )
    stage_of: dict[fx.Node, int] = {}
    for n in compute:
        s = assignment[n.name]
        try:
            s = operator.index(s)
        except TypeError as e:
            raise PlanError(f"the stage of {n.name!r} must be an int, found {s!r}") from e
        if s < 0:
            raise PlanError(f"the stage of {n.name!r} is {s}; stages are numbered from 0")
        stage_of[n] = s
    prev = compute[0]
    for n in compute[1:]:
        if stage_of[n] < stage_of[prev]:
            raise PlanError(
                f"compute nodes must be contiguous in graph order (stage numbers never decrease), "
                f"but {n.name!r} (stage {stage_of[n]}) comes after {prev.name!r} (stage "
                f"{stage_of[prev]}):\n  {prev.format_node()}\n  {n.format_node()}\n"
                f"Give each stage one contiguous run of nodes in graph order."
            )
        prev = n
    # Graph order visits a tuple's producer before its getitems, and a nested tuple's getitem
    # before the getitems of its result, so one pass moves whole chains home.
    for n in compute:
        if isinstance(n.meta.get("val"), (tuple, list)):
            for u in n.users:
                if u.op == "call_function" and u.target is operator.getitem:
                    stage_of[u] = stage_of[n]
    d = max(stage_of.values()) + 1
    counts = Counter(stage_of.values())
    empty = [i for i in range(d) if counts[i] == 0]
    if empty:
        raise PlanError(
            f"stages must be numbered 0..{d - 1} with at least one compute node each; stage(s) "
            f"{empty} have none (the graph has {len(compute)} compute nodes; getitems of a tuple "
            f"run on the tuple's stage, so a stage of getitems alone is empty). Renumber the "
            f"stages or use fewer of them."
        )
    return stage_of, d


def _state_read(gm: fx.GraphModule, node: fx.Node, canon) -> list[str]:
    """Canonical names of the parameters and buffers ``node`` reads."""
    out = []
    for a in node.all_input_nodes:
        if a.op == "get_attr" and isinstance(get_attr(gm, a.target), torch.Tensor):
            out.append(canon(a.target))
    if node.op == "call_module":
        sub = gm.get_submodule(node.target)
        out += [canon(f"{node.target}.{n}") for n, _ in sub.named_parameters(remove_duplicate=False)]
        out += [canon(f"{node.target}.{n}") for n, _ in sub.named_buffers(remove_duplicate=False)]
    return out


def _writes_state(node: fx.Node) -> list[fx.Node]:
    """The get_attr inputs an op updates in place. BatchNorm's schema does not mark its running
    statistics as written, so norm ops with running stats count as writing every buffer input."""
    target = node.target
    if not isinstance(target, torch._ops.OpOverload):
        return []
    if "batch_norm" in target.name() or "instance_norm" in target.name():
        return [a for a in node.all_input_nodes if a.op == "get_attr"]
    out = []
    for i, arg in enumerate(target._schema.arguments):
        if arg.alias_info is not None and arg.alias_info.is_write:
            v = node.args[i] if i < len(node.args) else node.kwargs.get(arg.name)
            if isinstance(v, fx.Node) and v.op == "get_attr":
                out.append(v)
    return out


def _check_mutated_buffers(compute, stage_of, readers, canon, gm_params) -> None:
    for n in compute:
        for a in _writes_state(n):
            name = canon(a.target)
            if name in gm_params or len(readers.get(name, ())) < 2:
                continue
            others = sorted(readers[name] - {stage_of[n]})
            raise PlanError(
                f"buffer {name!r} is updated in place on stage {stage_of[n]} and also read on "
                f"stage(s) {others}; each stage owns a copy, so the copies would diverge.\n"
                f"  {n.format_node()}\nPut every reader of {name!r} on one stage."
            )


def _spec(node: Any) -> TensorSpec | None:
    """The spec of a value crossing a cut: under a mixed-precision policy the dtype the value has
    there (``fxpipe.precision.prepare``), else the traced one."""
    if not isinstance(node, fx.Node):
        return None
    if AUTOCAST_META in node.meta:
        return node.meta[AUTOCAST_META]
    info = node.meta.get("fxpipe")
    if info is not None and len(info.outputs) == 1:
        return info.outputs[0]
    val = node.meta.get("val")
    return TensorSpec.of(val) if isinstance(val, torch.Tensor) else None


def _placeholder(g: fx.Graph, node: fx.Node) -> fx.Node:
    new = g.placeholder(node.name)
    new.meta = copy.copy(node.meta)
    return new


def _fill(source, dest: dict[str, torch.Tensor], originals: dict[str, torch.Tensor], what: str) -> None:
    """Write ``dest`` (new tensors) from ``source``, or copies of ``originals`` without one."""
    if source is not None:
        source.fill(dest, originals)
        return
    meta = [n for n, t in originals.items() if t.is_meta]
    if meta:
        raise FxpipeError(
            f"{what} needs values for {len(meta)} tensors that are on the meta device, e.g. {meta[:3]}, and "
            f"split was given no source of values: pass source=fxpipe.materialize.Materializer(model, gm, ...) "
            f"(fxpipe.compile does), or build the model on a real device")
    with torch.no_grad():
        for n, t in dest.items():
            t.copy_(originals[n])


def _build_stage(
    gm, s, d, nodes, inputs, outs, output, canon, gm_params, readers, produced_on, src_device, device, source=None,
    weights=True,
) -> Stage:
    runs_here = nodes + ([output] if output is not None else [])
    read = {a for r in runs_here for a in r.all_input_nodes}
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    # get_attrs in order of first use: the flat buffer then follows the order of computation.
    attrs = list(dict.fromkeys(a for r in runs_here for a in r.all_input_nodes if a.op == "get_attr"))
    model_inputs = sorted((a for a in read if a.op == "placeholder"), key=order.__getitem__)

    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for n in list(model_inputs) + list(inputs):
        env[n] = _placeholder(g, n)

    # State this stage reads: canonical param name -> original tensor, in order of first use.
    params: dict[str, torch.Tensor] = {}
    for r in runs_here:
        for a in r.all_input_nodes:
            if a.op == "get_attr" and a.target in gm_params:
                params.setdefault(canon(a.target), gm_params[a.target])
        if r.op == "call_module":
            for local, p in gm.get_submodule(r.target).named_parameters(remove_duplicate=False):
                params.setdefault(canon(f"{r.target}.{local}"), p)
    built = device.type != "meta"
    with torch.no_grad():  # weights=False: parameters on meta, as on a stage that is not built
        flat = FlatParams.build(list(params.items()), device if weights else torch.device("meta"),
                                copy=not (built and weights))
    # what a built stage's tensors get their values from: name -> (new tensor, the model's tensor)
    dest: dict[str, torch.Tensor] = {}
    origin: dict[str, torch.Tensor] = {}
    if built and weights:
        dest.update(flat.layout.views(flat.buffers))
        origin.update(params)

    root: dict[str, Any] = {}
    buffer_names: list[str] = []
    for a in attrs:
        obj = get_attr(gm, a.target)
        if isinstance(obj, torch.Tensor):
            target = canon(a.target)
            if target in flat.params:
                root[target] = flat.params[target]
            elif built:
                root[target] = dest[target] = torch.empty_like(obj, device=device)
                origin[target] = obj
                buffer_names.append(target)
            else:
                root[target] = obj.detach().to(device, copy=True)
                buffer_names.append(target)
        elif isinstance(obj, nn.Module):  # e.g. a higher-order op's subgraph
            target = a.target
            root[target] = copy.deepcopy(obj).to(device)
        else:
            target = a.target
            root[target] = obj
        new = g.create_node("get_attr", target, name=a.name)
        new.meta = copy.copy(a.meta)
        env[a] = new
    for r in nodes:
        if r.op == "call_module" and r.target not in root:
            original = gm.get_submodule(r.target)
            sub = copy.deepcopy(original)
            sub = sub.to_empty(device=device) if built else sub.to(device)
            if built:
                for b, t in original.named_buffers():
                    dest[f"{r.target}.{b}"], origin[f"{r.target}.{b}"] = sub.get_buffer(b), t
            for local, _ in list(sub.named_parameters(remove_duplicate=False)):
                owner, _, leaf = local.rpartition(".")
                sub.get_submodule(owner)._parameters[leaf] = flat.params[canon(f"{r.target}.{local}")]
            buffer_names += [f"{r.target}.{b}" for b, _ in sub.named_buffers()]
            root[r.target] = sub

    if built:
        _fill(source, dest, origin, f"stage {s}")
    for r in nodes:
        env[r] = g.node_copy(r, env.__getitem__)
    outs = tuple(outs)
    g.output(tuple(env[o] if isinstance(o, fx.Node) else o for o in outs))
    try:
        g.lint()
        module = fx.GraphModule(root, g, class_name=f"Stage{s}")
    except Exception as e:
        raise FxpipeError(f"codegen could not build stage {s} of {d}: {e}") from e
    if device.type != "meta" and device != src_device:  # device constants baked in at trace time follow the stage
        follow_device(module, src_device, device)

    names = tuple(o.name if isinstance(o, fx.Node) else repr(o) for o in outs)
    return Stage(
        index=s,
        num_stages=d,
        module=module,
        model_inputs=tuple(n.name for n in model_inputs),
        inputs=tuple(n.name for n in inputs),
        outputs=names,
        input_specs=tuple(_spec(n) for n in inputs),
        output_specs=tuple(_spec(o) for o in outs),
        param_names=tuple(flat.params),
        buffer_names=tuple(buffer_names),
        flat=flat,
        nodes=tuple(n.name for n in nodes),
        produced_on={n.name: produced_on[n.name] for n in list(inputs) + [o for o in outs if isinstance(o, fx.Node) and o.name in produced_on]},
        tied={name: tuple(sorted(readers[name] - {s})) for name in flat.params if len(readers.get(name, ())) > 1},
    )


def _originals(gm: fx.GraphModule, info: TraceInfo, canon, readers) -> tuple[dict[str, list[str]], dict[str, torch.Tensor]]:
    """Canonical name -> original state_dict keys, and copies of the persistent state no
    stage reads (so the merged state dict still loads strictly). A tensor constant the trace
    lifted out of the model's code (export's ``lifted_tensor_0``: a ``torch.tensor(2)`` in a
    forward) is no state of the model, and has no key, as a non-persistent buffer."""
    sd_keys = set(gm.state_dict(keep_vars=True))
    originals: dict[str, list[str]] = {}
    unused: dict[str, torch.Tensor] = {}
    for name, t in list(gm.named_parameters(remove_duplicate=False)) + list(gm.named_buffers(remove_duplicate=False)):
        c = canon(name)
        if c in originals:
            continue
        keys = [c, *info.tied.get(c, ())]
        persistent = any(k in sd_keys for k in keys)
        originals[c] = keys if persistent else []
        if persistent and c not in readers:
            unused[c] = t if t.is_meta else t.detach().clone()  # a meta one is filled by split
    for n in gm.graph.nodes:
        if n.op == "get_attr" and canon(n.target) not in originals:
            originals[canon(n.target)] = []  # a tensor constant (or a higher-order op's subgraph)
    return originals, unused


# --------------------------------------------------------------------------------------------
# readable code


def _fmt(spec: TensorSpec | None) -> str:
    return "(not a tensor)" if spec is None else f"{spec.dtype}{list(spec.shape)}"


def stage_code(stage: Stage) -> str:
    """The stage's generated Python, after a header naming its inputs, outputs and state."""
    i, d = stage.index, stage.num_stages
    span = f"{stage.nodes[0]} .. {stage.nodes[-1]}" if stage.nodes else "(none)"
    lines = [
        f"# fxpipe stage {i} of {d} (0-based): {len(stage.nodes)} nodes, {span}",
        "# forward(*model_inputs, *inputs) -> outputs, always a tuple",
        f"# model inputs: {', '.join(stage.model_inputs) or '(none)'}",
    ]
    if stage.inputs:
        lines.append(f"# inputs, from stage {i - 1}, in order:")
        for name, spec in zip(stage.inputs, stage.input_specs):
            src = stage.produced_on.get(name)
            note = f"made on stage {src}, forwarded" if src is not None and src < i - 1 else f"made on stage {src}"
            lines.append(f"#   {name}: {_fmt(spec)}  ({note})")
    else:
        lines.append("# inputs: (none)")
    last = i == d - 1
    lines.append("# outputs, the model's flat outputs:" if last else f"# outputs, to stage {i + 1}, in order:")
    for name, spec in zip(stage.outputs, stage.output_specs):
        note = ""
        if name in stage.inputs:
            note = "  (forwarded)"
        lines.append(f"#   {name}: {_fmt(spec)}{note}")
    sizes = stage.flat.layout.sizes
    flat_desc = ", ".join(f"{str(dt).removeprefix('torch.')}[{n:,}]" for dt, n in sizes) or "none"
    lines.append(f"# parameters: {len(stage.param_names)} tensors in flat buffers {flat_desc}")
    for slot in stage.flat.layout.slots:
        tied = stage.tied.get(slot.name)
        note = f"  (tied: also on stage {', '.join(map(str, tied))})" if tied else ""
        frozen = "" if slot.requires_grad else "  (frozen)"
        lines.append(f"#   {slot.name}: {str(slot.dtype).removeprefix('torch.')}{list(slot.shape)} @ {slot.offset}{note}{frozen}")
    if stage.buffer_names:
        lines.append(f"# buffers: {len(stage.buffer_names)}")
        for name in stage.buffer_names:
            b = stage.module.get_buffer(name)
            lines.append(f"#   {name}: {str(b.dtype).removeprefix('torch.')}{list(b.shape)}")
    return "\n".join(lines) + "\n" + stage.module.code.lstrip("\n")


def write_stage_code(staged: StagedModel, out_dir: str | Path) -> list[Path]:
    """Write each stage's code to ``out_dir/stage_{i}.py``; returns the paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for st in staged.stages:
        path = out / f"stage_{st.index}.py"
        path.write_text(stage_code(st))
        paths.append(path)
    return paths
