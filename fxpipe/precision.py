"""precision: mixed-precision training — fp32 master weights, low-precision compute, fp16 loss scaling.

``fxpipe.compile(..., precision="bf16" | "fp16")`` trains as a careful single-device script
does with ``torch.autocast``:

* the optimizer steps ONE fp32 **master** copy of the weights; every weight version a stage
  computes with (two under 2bw) is a 2-byte copy the update writes from it
  (:class:`~fxpipe.weights.WeightStore` owns all of them);
* each stage runs its forward (and the loss) under ``torch.autocast`` for the device it runs on,
  so which ops stay in fp32 is autocast's policy *for that device type* (CPU's lists differ from
  CUDA's: on the CPU, softmax and layer_norm follow their inputs into bf16);
* but two kinds of weights keep an fp32 compute copy (:func:`fp32_params`), as they are under
  eager autocast: batch norm's weight and bias (``batch_norm`` is on neither device's cast list,
  so eager autocast runs it on the fp32 parameters, and its kernels take the parameters in the
  dtype of the fp32 running statistics: a 16-bit weight beside them fails, "expected scalar type
  BFloat16 but found Float", whatever the input's dtype); and the weight and bias of a layer or
  group norm whose input is fp32 under the policy (a model that normalizes ``x.float()``, as
  CLIP's and Whisper's LayerNorm and Stable Diffusion's GroupNorm32 do: the CPU kernels refuse
  a 16-bit weight beside an fp32 input, "mixed dtype (CPU): expect parameter to have scalar type
  of Float", and CUDA's autocast runs both ops in fp32);
* gradients accumulate over micro-batches in fp32, the optimizer state is fp32, losses are
  reported in fp32;
* a boundary value travels in the dtype the policy gives it (:func:`prepare` finds it with fake
  tensors before codegen), so activations cross in the compute dtype and the numbers do not
  depend on where the planner cut, but through the order of additions: a weight tied across
  stages gets its stages' gradients summed in fp32, where one stage holding both sums them in
  the compute dtype first; a value read on both sides of a cut by three or more ops gets its
  gradients summed in another grouping (as in fp32).

fp16 adds dynamic loss scaling with ``torch.amp.GradScaler``'s rule (:class:`LossScaler`): the
last stage seeds its backward with ``loss * scale``; the per-step norm all-reduce over every rank
(the non-finite agreement of :mod:`fxpipe.runtime`) finds an overflow anywhere, and then every
rank skips that update and backs the scale off. Which scale a batch uses is fixed by the weight
version it reads: **batch t's backwards use the scale in force after the update that wrote its
weights**, UPDATE t-2 under 2bw (its forwards read W(t-2)), UPDATE t-1 under 1f1b and gpipe.
Under 2bw the next batch's backwards start before batch t's overflow is known, so an overflow the
scale caused is usually followed by a second one (two skipped steps, the scale quartered); an
overflow injected once skips exactly one step.
"""

from __future__ import annotations

import contextlib
import copy
import math
from dataclasses import dataclass

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch.nn.modules.batchnorm import _NormBase

from .device import follow_call, follow_device, rng_devices
from .errors import ConfigError
from .trace import TensorSpec, alias_base, graph_modules

__all__ = ["Precision", "LossScaler", "compute_dtype", "fp32_params", "prepare", "PRECISIONS", "AUTOCAST_META"]

#: ``node.meta`` key of a compute node's output spec under the precision policy (set by
#: :func:`annotate`, read by codegen for the specs of the values crossing a cut).
AUTOCAST_META = "fxpipe_autocast"

#: precision name -> compute dtype (None: the model's own)
PRECISIONS = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def compute_dtype(precision: str) -> torch.dtype | None:
    """The dtype stages compute in under ``precision`` (None for "fp32")."""
    return Precision(precision).dtype


@dataclass(frozen=True)
class Precision:
    """One of ``"fp32"`` (the model's own dtype, no autocast), ``"bf16"`` or ``"fp16"``."""

    name: str = "fp32"

    def __post_init__(self) -> None:
        if self.name not in PRECISIONS:
            raise ConfigError(
                f"precision must be 'fp32', 'bf16' or 'fp16', found {self.name!r}; 'bf16' and 'fp16' compute "
                f"in 16 bits from fp32 master weights (README, \"Precision\")"
            )

    @property
    def dtype(self) -> torch.dtype | None:
        """The compute dtype, or None for fp32 (the model's own dtypes, untouched)."""
        return PRECISIONS[self.name]

    @property
    def mixed(self) -> bool:
        return self.dtype is not None

    @property
    def scaled(self) -> bool:
        """fp16 scales the loss (bf16 has fp32's exponent range and needs no scaling)."""
        return self.name == "fp16"

    def autocast(self, device: torch.device):
        """The context a stage's forward and loss run in on ``device``."""
        if not self.mixed:
            return contextlib.nullcontext()
        return torch.autocast(device.type, dtype=self.dtype)

    def check_master(self, layout) -> None:
        """Master weights are fp32: a stage holding parameters of another dtype cannot keep
        16-bit compute copies of them (raised before any rank communicates)."""
        if not self.mixed:
            return
        other = [(s.name, s.dtype) for s in layout.slots if s.dtype != torch.float32]
        if other:
            name, dt = other[0]
            raise ConfigError(
                f"fxpipe.compile: precision={self.name!r} keeps fp32 master weights and {self.name} compute "
                f"copies, but parameter {name!r} is {dt} ({len(other)} such). Build the model in float32 "
                f"(precision= leaves the model itself untouched), or train with precision='fp32'."
            )


def prepare(gm: fx.GraphModule, precision: Precision, device: torch.device) -> None:
    """Make the traced graph ``gm`` run under ``precision``'s policy, as the model's own code would
    (a no-op for fp32). Tracing ran in fp32 and baked fp32 into two kinds of nodes:

    * export's dtype assertions (``x.to(...)`` records one): they no longer check the dtype,
      since under autocast values have other dtypes by design;
    * moves to a device (``x.to(device)``, ``x.cpu()``, with or without ``non_blocking`` or
      ``copy``), which export records as ``to.dtype_layout`` or ``_to_copy`` with the traced
      dtype: they keep their input's dtype now, so a 16-bit value stays 16-bit where the model
      only moved it. Casts that name a dtype (``x.to(torch.float32)``, ``x.to(device,
      torch.float32)``) are kept as traced: an explicit upcast (Llama's RMSNorm computes its
      variance in fp32, which fp16 needs) stays one, and a cast back to a dtype read at trace
      time (``x.to(input_dtype)``) stays fp32, which autocast's next matmul rounds to the
      compute dtype again. ``x.to(other)`` records as ``to.device`` with ``other``'s traced
      dtype, exactly as ``x.to(device, dtype)`` does, so it is kept as traced too: a cast to
      float32 where ``other`` would be 16-bit under autocast (the safe side of the two).
      One such cast is rewritten (:func:`_follow_weight_casts`): one to a weight's traced dtype
      that feeds a custom op together with that weight (``op(x.to(w.dtype), w)``), which
      autocast never casts for, so the op sees equal dtypes, as in the model's own code.
    * fp32's extremes, which the trace read as ``torch.finfo(x.dtype).min`` (an attention mask's
      fill): where the op computes in 16 bits under the policy, they become the 16-bit dtype's
      (:func:`_follow_dtype_extremes`).

    Then every compute node is annotated (``node.meta[AUTOCAST_META]``) with the spec its output
    has under ``torch.autocast`` on ``device``, parameters as compute copies (16-bit but for
    :func:`fp32_params`), found on fake
    tensors (nothing is computed or allocated); codegen gives each value crossing a cut that
    dtype. The plan is made before: node names, and so the plan's assignment, are unchanged."""
    if not precision.mixed:
        return
    for sub in graph_modules(gm):
        for n in list(sub.graph.nodes):
            if n.op == "call_function" and n.target is torch.ops.aten._assert_tensor_metadata.default:
                n.kwargs = {**n.kwargs, "dtype": None}  # still checks device and layout
            elif _device_move(n):
                _follow_input_dtype(n)
        sub.recompile()
    # which weights stay fp32 depends on the dtypes the policy gives (a layer norm of an fp32
    # input), and those on which weights stay fp32: annotate until the two agree. An fp32 weight
    # only ever makes values fp32 (type promotion), so the set only grows and this ends.
    keep = None
    while keep != (keep := fp32_params(gm)):
        _follow_weight_casts(gm, precision, device, keep)
        _annotate(gm, precision, device, keep)
    _follow_dtype_extremes(gm)


def _run_real(module: torch.nn.Module, state: dict, args, kwargs, device: torch.device, fake):
    """``module`` (a leaf whose forward branches on values) run once for its output specs on real
    zeros of ``args``' and ``state``'s specs: a copy, so no state of the model moves, with the RNG
    restored. Its outputs come back as fake tensors (``fake``)."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    def real(t):
        return torch.zeros(t.shape, dtype=t.dtype, device=device) if isinstance(t, torch.Tensor) else t

    with unset_fake_temporarily(), torch.random.fork_rng(devices=rng_devices(device)), torch.no_grad():
        out = torch.func.functional_call(copy.deepcopy(module).to(device), pytree.tree_map(real, state),
                                         tuple(pytree.tree_map(real, list(args))), pytree.tree_map(real, kwargs))
    return pytree.tree_map(lambda t: fake(t, t.dtype) if isinstance(t, torch.Tensor) else t, out)


def fp32_params(gm: fx.GraphModule) -> frozenset[str]:
    """The parameters of ``gm`` (names as ``gm.named_parameters()`` gives them) whose compute
    copy stays fp32 under mixed precision (module docstring):

    * the weight and bias of every op that takes running statistics (``batch_norm`` and its
      lowerings, ``instance_norm``; a ``BatchNorm``/``InstanceNorm`` leaf module of a
      ``symbolic_trace`` graph): eager autocast runs these ops on the fp32 parameters, and their
      kernels want the parameters in the statistics' dtype;
    * the weight and bias of a ``layer_norm`` or ``group_norm`` (op, functional call or leaf
      module) whose input is fp32 under the policy: known once :func:`prepare` has annotated the
      graph (a stage module keeps its nodes' annotations), so ``gm`` unprepared gives only the
      first kind;
    * inside an opaque module (a ``leaf_modules`` call), whose inner values the graph does not
      show, the weight and bias of every norm of either kind: fp32, as eager autocast leaves
      them (the CPU kernels take an fp32 weight beside a 16-bit input too).

    A parameter read elsewhere too stays fp32 as well: autocast's cast lists round it where eager
    autocast would."""
    import inspect

    params = {n for n, _ in gm.named_parameters(remove_duplicate=False)}
    keep: set[str] = set()
    for n in gm.graph.nodes:
        if n.op == "call_module":
            module = gm.get_submodule(n.target)
            if isinstance(module, _STATISTICS_MODULES) or (
                    isinstance(module, _INPUT_DTYPE_MODULES) and n.args and _fp32_input(n.args[0])):
                keep.update(f"{n.target}.{name}" for name, _ in module.named_parameters())
            elif not isinstance(module, _INPUT_DTYPE_MODULES):  # an opaque module: its norms' inputs are unknown
                keep.update(f"{n.target}.{path}.{name}" for path, sub in module.named_modules() if path
                            and isinstance(sub, _STATISTICS_MODULES + _INPUT_DTYPE_MODULES)
                            for name, _ in sub.named_parameters(recurse=False))
        elif n.op == "call_function":
            if isinstance(n.target, torch._ops.OpOverload):
                bound = _bound(n)
            else:  # a symbolic_trace graph's torch.nn.functional.batch_norm / layer_norm / group_norm
                try:
                    bound = inspect.signature(n.target).bind(*n.args, **n.kwargs).arguments
                except (TypeError, ValueError):
                    continue
            if "running_mean" in bound or (_name_of(n.target) in _INPUT_DTYPE_OPS
                                           and _fp32_input(bound.get("input"))):
                keep.update(a.target for a in (bound.get("weight"), bound.get("bias"))
                            if isinstance(a, fx.Node) and a.op == "get_attr" and a.target in params)
    return frozenset(keep & params)


#: leaf modules that take running statistics: BatchNorm*, InstanceNorm*, SyncBatchNorm
_STATISTICS_MODULES = (_NormBase,)
#: leaf modules and ops whose CPU kernels need the weight in the input's dtype when it is fp32
_INPUT_DTYPE_MODULES = (torch.nn.LayerNorm, torch.nn.GroupNorm)
_INPUT_DTYPE_OPS = {"layer_norm", "native_layer_norm", "group_norm", "native_group_norm"}


def _name_of(target) -> str:
    """An op's or function's bare name: ``aten.layer_norm.default`` and ``F.layer_norm`` both
    give "layer_norm"."""
    if isinstance(target, torch._ops.OpOverload):
        return target._schema.name.split("::")[-1]
    return getattr(target, "__name__", "")


def _fp32_input(a) -> bool:
    """Whether graph value ``a`` is fp32 under the precision policy :func:`prepare` annotated
    (a compute node's annotation; a model input keeps its traced dtype). Unannotated compute
    nodes (no policy applied yet) are not known to be fp32."""
    if not isinstance(a, fx.Node):
        return False
    spec = a.meta.get(AUTOCAST_META)
    if spec is not None:
        return spec.dtype == "float32"
    val = a.meta.get("val")
    return a.op == "placeholder" and isinstance(val, torch.Tensor) and val.dtype == torch.float32


# not aten.to.device: export records x.to(device, dtype) with it, an explicit cast (prepare's docstring)
_MOVES = {torch.ops.aten.to.dtype_layout, torch.ops.aten._to_copy.default}


def _bound(n: fx.Node) -> dict:
    """The arguments of call ``n`` by name, defaults filled in."""
    schema = n.target._schema
    bound = {a.name: a.default_value for a in schema.arguments if a.has_default_value()}
    bound.update({a.name: v for a, v in zip(schema.arguments, n.args)})
    bound.update(n.kwargs)
    return bound


def _device_move(n: fx.Node) -> bool:
    """A cast that names a device and did not change the (floating) dtype when traced."""
    if n.op != "call_function" or n.target not in _MOVES or not n.args or not isinstance(n.args[0], fx.Node):
        return False
    src, out = n.args[0].meta.get("val"), n.meta.get("val")
    return (_bound(n).get("device") is not None and isinstance(src, torch.Tensor)
            and isinstance(out, torch.Tensor) and src.dtype == out.dtype and src.is_floating_point())


def _follow_input_dtype(n: fx.Node) -> None:
    """Rewrite cast ``n`` as ``aten.to.dtype_layout`` without a dtype (device, copy and memory
    format kept): it then moves the value without converting it."""
    bound = _bound(n)
    keep = {k: bound[k] for k in ("layout", "device", "pin_memory", "non_blocking", "copy", "memory_format")
            if bound.get(k) is not None}
    if n.target is torch.ops.aten._to_copy.default:
        keep["copy"] = True  # _to_copy always copies
    n.target = torch.ops.aten.to.dtype_layout
    n.args = (bound["self"],)
    n.kwargs = keep


def _follow_weight_casts(gm: fx.GraphModule, precision: Precision, device: torch.device,
                         keep: frozenset[str]) -> None:
    """Make each cast to a weight's dtype that feeds a custom op beside that weight cast to the
    weight's compute dtype (16-bit, or fp32 for a weight in ``keep``).

    A model that calls its own kernel, a ``torch.library`` custom op that autocast does not cover
    on ``device`` (it casts only for the aten ops on its lists, and custom ops that register a
    kernel for it), writes ``op(x.to(w.dtype), w)``, since the kernel needs equal dtypes (the
    grouped expert matmul of transformers' mixture-of-experts models, its default). The trace
    read ``w.dtype`` as fp32 and baked it into the cast, and :func:`prepare` keeps casts as
    traced; beside the 16-bit compute copy of ``w`` the kernel would then fail at the first
    forward ("expected m1 and m2 to have the same dtype"). Found by shape: a floating cast
    (``aten.to.dtype`` or ``aten._to_copy``) that is an argument of the op, whose traced output
    dtype is that of a parameter the op reads directly or through views (``w.t()``,
    ``w.transpose(...)``). The rule reads only traced dtypes, so it gives the same graph
    however often it runs."""
    params = dict(gm.named_parameters(remove_duplicate=False))
    key = f"Autocast{device.type.upper()}"
    for n in gm.graph.nodes:
        op = n.target
        if (n.op != "call_function" or not isinstance(op, torch._ops.OpOverload)
                or op.namespace in ("aten", "prims") or _has_kernel(op, key)):
            continue
        inputs = [a for a in (*n.args, *n.kwargs.values()) if isinstance(a, fx.Node)]
        weights = {}  # traced dtype -> the compute dtype of a weight of that dtype the op reads
        for a in inputs:
            name = _viewed_param(a)
            if name in params and params[name].is_floating_point():
                weights[params[name].dtype] = params[name].dtype if name in keep else precision.dtype
        for a in inputs:
            traced = a.meta.get("val")
            if (a.op == "call_function" and a.target in _CASTS and isinstance(traced, torch.Tensor)
                    and traced.dtype in weights):
                _set_cast_dtype(a, weights[traced.dtype])
    gm.recompile()


#: casts that name a dtype: ``x.to(dtype)`` and what export records for ``x.to(w.dtype)``
_CASTS = {torch.ops.aten.to.dtype, torch.ops.aten._to_copy.default}


def _follow_dtype_extremes(gm: fx.GraphModule) -> None:
    """Make fp32's largest and lowest finite values, as scalar arguments of an op whose output is
    16-bit under the policy (annotated), the 16-bit dtype's.

    Models fill masked attention scores with ``torch.finfo(scores.dtype).min`` (DeBERTa's
    ``masked_fill``; a clamp to the dtype's range). The trace read fp32's, -3.4e38, which a 16-bit
    tensor cannot hold: the op fails at the first forward ("value cannot be converted to type
    c10::BFloat16 without overflow"), where the model's own code under autocast reads the 16-bit
    dtype's. Only these two values are taken for dtype reads: they overflow every 16-bit dtype, so
    the op could never run with them."""
    big = torch.finfo(torch.float32).max
    for n in gm.graph.nodes:
        spec = n.meta.get(AUTOCAST_META)
        if n.op != "call_function" or spec is None or spec.dtype not in ("bfloat16", "float16"):
            continue
        low = torch.finfo(spec.torch_dtype).max

        def swap(a):
            return math.copysign(low, a) if isinstance(a, float) and abs(a) == big else a

        n.args = tuple(swap(a) for a in n.args)
        n.kwargs = {k: swap(v) for k, v in n.kwargs.items()}
    gm.recompile()


def _has_kernel(op: torch._ops.OpOverload, dispatch_key: str) -> bool:
    """Whether ``op`` has its own kernel for ``dispatch_key`` (False for a key torch lacks)."""
    try:
        return torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), dispatch_key)
    except RuntimeError:
        return False


def _viewed_param(a: fx.Node) -> str | None:
    """The parameter (its ``get_attr`` target) that ``a`` reads, itself or through a chain of views."""
    while (base := alias_base(a)) is not None:
        a = base
    return a.target if a.op == "get_attr" else None


def _set_cast_dtype(n: fx.Node, dtype: torch.dtype) -> None:
    """Cast ``n`` (one of :data:`_CASTS`) now casts to ``dtype``."""
    if n.target is torch.ops.aten.to.dtype and len(n.args) > 1:
        n.args = (n.args[0], dtype, *n.args[2:])
    else:
        n.kwargs = {**n.kwargs, "dtype": dtype}


def _annotate(gm: fx.GraphModule, precision: Precision, device: torch.device, keep: frozenset[str]) -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    params = {n for n, _ in gm.named_parameters(remove_duplicate=False)} - keep  # the 16-bit copies
    info = gm.meta.get("fxpipe")  # a meta model traces as if on its device (TraceInfo.device)
    src = getattr(info, "device", None) or next((p.device for p in gm.parameters()), torch.device("cpu"))
    mode = FakeTensorMode(allow_non_fake_inputs=True)

    def fake(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty_strided(t.shape, t.stride(), dtype=dtype, device=device)

    class _Policy(fx.Interpreter):
        def fetch_attr(self, target: str):
            obj = super().fetch_attr(target)
            if isinstance(obj, torch.Tensor):
                low = obj.is_floating_point() and target in params
                return fake(obj, precision.dtype if low else obj.dtype)
            return obj

        def call_function(self, target, args, kwargs):
            # device constants baked in at trace time follow the stage, as codegen moves them
            def followed(x):  # a higher-order op's subgraph: a copy that follows the stage too
                if isinstance(x, fx.GraphModule):
                    x = copy.deepcopy(x)
                    follow_device(x, src, device)
                return x

            args, kwargs = follow_call(target, fx.node.map_aggregate(args, followed),
                                       fx.node.map_aggregate(kwargs, followed), src, device)
            return super().call_function(target, args, kwargs)

        def call_module(self, target, args, kwargs):
            # with its parameters as the stage will hold them (16-bit copies but for ``keep``)
            # and fake copies of its buffers, which its forward may update (BatchNorm's count)
            sub = self.fetch_attr(target)
            state = {name: mode.from_tensor(t).to(precision.dtype if f"{target}.{name}" in params and
                                                  t.is_floating_point() else t.dtype)
                     for name, t in (*sub.named_parameters(remove_duplicate=False), *sub.named_buffers())}
            try:
                return torch.func.functional_call(sub, state, tuple(args), kwargs)
            except Exception:  # noqa: BLE001 - control flow on values fake tensors lack: run it
                return _run_real(sub, state, args, kwargs, device, fake)

        def run_node(self, n: fx.Node):
            out = super().run_node(n)
            if n.op in ("call_function", "call_method", "call_module") and isinstance(out, torch.Tensor):
                n.meta[AUTOCAST_META] = TensorSpec.of(out)
            return out

    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    with mode, precision.autocast(device):
        args = [fake(n.meta["val"], n.meta["val"].dtype) if isinstance(n.meta.get("val"), torch.Tensor)
                else n.meta.get("val") for n in placeholders]
        _Policy(gm).run(*args)


class LossScaler:
    """fp16's dynamic loss scale, with ``torch.amp.GradScaler``'s rule and defaults: start at
    ``init_scale``; an overflow multiplies it by ``backoff_factor`` (and the step is skipped);
    ``growth_interval`` finite steps in a row multiply it by ``growth_factor``.

    Every rank holds one and updates it from the same all-reduced verdict, so all agree. The scale
    is kept per update count (:meth:`scale_for`): a batch's backwards use the scale in force
    after the update that wrote the weight version they read (module docstring)."""

    def __init__(self, init_scale: float = 2.0 ** 16, growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 2000):
        self.growth_factor = float(growth_factor)
        self.backoff_factor = float(backoff_factor)
        self.growth_interval = int(growth_interval)
        self.scale = float(init_scale)
        self.growth_tracker = 0
        self.history: dict[int, float] = {0: self.scale}  # updates applied -> the scale after them

    @classmethod
    def like(cls, scaler) -> "LossScaler":
        """From a ``torch.amp.GradScaler`` (its public getters), or None for GradScaler's defaults."""
        if scaler is None:
            return cls()
        if not isinstance(scaler, torch.amp.GradScaler):
            raise ConfigError(
                f"fxpipe.compile: scaler must be a torch.amp.GradScaler (its init_scale, growth_factor, "
                f"backoff_factor and growth_interval are used), found {type(scaler).__name__}; pass e.g. "
                f"torch.amp.GradScaler('cuda', init_scale=2.**12) ('cpu' on the CPU), or None for its defaults"
            )
        if not scaler.is_enabled():  # it keeps none of its settings (e.g. GradScaler("cuda") without CUDA)
            raise ConfigError(
                "fxpipe.compile: scaler is a disabled torch.amp.GradScaler (enabled=False, or built for a device this "
                "machine does not have), which keeps none of the settings fxpipe reads; pass an enabled one, e.g. "
                "torch.amp.GradScaler('cpu', init_scale=2.**12) on the CPU, or None for its defaults"
            )
        return cls(scaler.get_scale(), scaler.get_growth_factor(), scaler.get_backoff_factor(),
                   scaler.get_growth_interval())

    def scale_for(self, version: int) -> float:
        """The scale in force after update ``version`` (what a backward on that version uses)."""
        return self.history[version]

    def update(self, t: int, found_inf: bool) -> None:
        """Batch t's verdict (UPDATE t, in order): back off on an overflow, else count towards growth."""
        if found_inf:
            self.scale *= self.backoff_factor
            self.growth_tracker = 0
        else:
            self.growth_tracker += 1
            if self.growth_tracker == self.growth_interval:
                self.scale *= self.growth_factor
                self.growth_tracker = 0
        self.history[t] = self.scale
        for old in [v for v in self.history if v < t - 2]:
            del self.history[old]

    def state_dict(self) -> dict:
        return {"scale": self.scale, "growth_tracker": self.growth_tracker,
                "history": sorted(self.history.items())}

    def start_at(self, version: int) -> None:
        """Put the current scale in force for the weight versions a run resumed at ``version``
        reads (it and the two before it, the window :meth:`update` keeps): the resume of a
        checkpoint that kept no scale (another precision's)."""
        self.history = {v: self.scale for v in range(max(version - 2, 0), version + 1)}

    def load_state_dict(self, state: dict) -> None:
        self.scale = float(state["scale"])
        self.growth_tracker = int(state["growth_tracker"])
        self.history = {int(v): float(s) for v, s in state["history"]}
