"""trace: capture an ``nn.Module`` as a flat ``torch.fx.GraphModule`` annotated for the later phases.

The main path is ``torch.export.export(model, args, kwargs, strict=False).module()``: the only
tracer that takes today's Hugging Face models. ``torch.fx.symbolic_trace`` (with user leaf
modules) is the fallback for models export rejects. Either way the result is normalised to one
shape, so no later phase needs to know which tracer ran:

* placeholders are the *flattened* example inputs, in pytree order, and the output node returns
  a flat tuple; ``gm(*args, **kwargs)`` still takes and returns the model's own structures
  through pytree specs (``TraceInfo.in_spec`` / ``out_spec``);
* parameters and buffers are the SAME objects as the model's (no copies), each under ONE name:
  the first name ``model.named_parameters()`` gives it. Tied weights (GPT-2's ``lm_head`` and
  ``wte``) become one parameter read by every node that uses it;
* export's ``_guards_fn`` node, its write-back of a buffer updated in place (a copy of the
  buffer onto itself, :func:`_self_write_back`) and dead ``get_attr`` reads are removed. Nothing
  else is removed:
  a dead dropout still draws random numbers in eager mode, and in-place buffer updates
  (``num_batches_tracked.add_``) have no users by nature;
* ``node.meta["fxpipe"]`` is a :class:`NodeInfo` (output shapes, dtypes, bytes, parameters and
  buffers read, owning module path) and ``gm.meta["fxpipe"]`` a :class:`TraceInfo`.

Example::

    >>> gm = fxpipe.trace(nn.Sequential(nn.Linear(4, 8), nn.ReLU()), (torch.randn(2, 4),))
    >>> gm.meta["fxpipe"].path
    'export'
    >>> [(n.name, n.meta["fxpipe"].shapes) for n in gm.graph.nodes if n.op == "call_function"]
    [('linear', ((2, 8),)), ('relu', ((2, 8),))]
"""

from __future__ import annotations

import contextlib
import copy
import functools
import inspect
import io
import logging
import operator
import os
import re
import traceback
import warnings
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Sequence

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch import nn

from .errors import TraceError

__all__ = ["trace", "NodeInfo", "TraceInfo", "TensorSpec", "normalize_inputs", "module_path", "get_attr",
           "leaf_module_calls", "as_leaf_modules"]


@dataclass(frozen=True)
class TensorSpec:
    """Shape and dtype of one tensor value (``dtype`` as its short name, e.g. ``"float32"``)."""

    shape: tuple[int, ...]
    dtype: str

    @property
    def nbytes(self) -> int:
        numel = 1
        for s in self.shape:
            numel *= int(s)
        return numel * _dtype(self.dtype).itemsize

    @property
    def torch_dtype(self) -> torch.dtype:
        return _dtype(self.dtype)

    @classmethod
    def of(cls, t: torch.Tensor) -> "TensorSpec":
        return cls(tuple(int(s) for s in t.shape), str(t.dtype).removeprefix("torch."))


def _dtype(name: str) -> torch.dtype:
    d = getattr(torch, name, None)
    if not isinstance(d, torch.dtype):
        raise ValueError(f"unknown dtype name {name!r}: expected a torch dtype such as 'float32'")
    return d


@dataclass(frozen=True)
class NodeInfo:
    """What the later phases need to know of one node (``node.meta["fxpipe"]``).

    ``outputs`` lists every tensor the node produces (a tuple-returning op has several);
    ``params``/``buffers`` are the canonical names of the parameters/buffers it reads directly
    (through ``get_attr`` inputs, or owned by a ``call_module`` leaf); ``module_path`` is the
    innermost module the op came from (``"transformer.h.3.attn"``; ``""`` at top level).
    """

    outputs: tuple[TensorSpec, ...]
    params: tuple[str, ...] = ()
    buffers: tuple[str, ...] = ()
    module_path: str = ""
    param_bytes: int = 0

    @property
    def out_bytes(self) -> int:
        return sum(s.nbytes for s in self.outputs)

    @property
    def shapes(self) -> tuple[tuple[int, ...], ...]:
        return tuple(s.shape for s in self.outputs)


@dataclass
class TraceInfo:
    """Facts about the whole capture (``gm.meta["fxpipe"]``)."""

    path: str  # "export" or "symbolic_trace"
    model_class: str
    input_names: tuple[str, ...]  # placeholder names, in flat (pytree) order
    in_spec: Any  # pytree spec of (args, kwargs)
    out_spec: Any  # pytree spec of the model's output
    training: bool
    batch_size: int | None  # size of dim 0 of the first tensor input
    export_error: str | None = None  # why export failed, when the fallback ran
    tied: dict[str, tuple[str, ...]] = field(default_factory=dict)  # canonical -> aliases
    # A meta model (or meta example inputs) is traced as if on this device (fake tensors): the
    # device its graph's baked device arguments name. None: the parameters' device.
    device: torch.device | None = None
    leaf_modules: tuple = ()  # what the capture kept opaque: a trace of the model at another size keeps them too

    def flatten_inputs(self, args: Sequence, kwargs: Mapping) -> list:
        """The flat list of input values for the placeholders, from model-style args/kwargs."""
        leaves, spec = pytree.tree_flatten((tuple(args), dict(kwargs)))
        if spec != self.in_spec:
            raise TraceError(
                f"inputs do not have the structure the model was traced with: expected "
                f"{self.in_spec}, found {spec}. Pass the same positional/keyword inputs "
                f"(same names, same nesting) as the example inputs."
            )
        return leaves

    def unflatten_output(self, flat: Sequence) -> Any:
        return pytree.tree_unflatten(list(flat), self.out_spec)


def normalize_inputs(example_inputs) -> tuple[tuple, dict]:
    """``example_inputs`` as ``(args, kwargs)``: a tuple/list is positional, a dict keyword,
    a single tensor one positional argument."""
    if isinstance(example_inputs, torch.Tensor):
        return (example_inputs,), {}
    if isinstance(example_inputs, Mapping):
        return (), dict(example_inputs)
    if isinstance(example_inputs, (tuple, list)):
        return tuple(example_inputs), {}
    raise TypeError(
        f"example_inputs must be a tuple (positional arguments) or a dict (keyword arguments) of "
        f"ONE micro-batch; found {type(example_inputs).__name__}. Wrap a single tensor as (x,)."
    )


def module_path(node: fx.Node) -> str:
    """The innermost owning module of a node, from ``nn_module_stack`` (``""`` if none)."""
    if node.op == "call_module":
        return str(node.target)
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return ""
    path = list(stack.values())[-1][0]
    # export records paths like "L['self'].transformer.h[0]" in some versions; normalise.
    return _clean_path(path)


def _clean_path(path: str) -> str:
    path = path.replace("L['self']", "").replace("L__self__", "")
    out = path.replace("[", ".").replace("]", "").replace("'", "")
    return out.strip(".")


# --------------------------------------------------------------------------------------------
# main entry point


def as_leaf_modules(leaf_modules) -> tuple:
    """``leaf_modules`` as ``trace``, ``plan`` and ``compile`` take it (a module class, a
    qualified name, or an iterable of them) as a tuple."""
    return (leaf_modules,) if isinstance(leaf_modules, (type, str)) else tuple(leaf_modules)


def trace(
    model: nn.Module,
    example_inputs,
    *,
    leaf_modules: Iterable[type | str] = (),
    prefer: str = "export",
) -> fx.GraphModule:
    """Capture ``model`` as a GraphModule that computes what ``model`` computes.

    ``example_inputs`` is one micro-batch: a tuple (positional) or a dict (keyword). The
    graph is specialised to those shapes (trace at the micro-batch size). ``leaf_modules``
    (a class or qualified name, or several) are kept as opaque calls by the ``symbolic_trace`` fallback.
    ``prefer="symbolic_trace"`` skips export. The path taken is ``gm.meta["fxpipe"].path``.
    A Hugging Face model is traced without its KV cache and without its activation checkpointing
    (:func:`_no_kv_cache`, :func:`_no_gradient_checkpointing`; the second says so in a warning),
    and left as it was; a reentrant ``torch.utils.checkpoint`` runs its function inline
    (:func:`_inline_checkpoints`, also said in a warning).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"fxpipe.trace expects an nn.Module, found {type(model).__name__}")
    if prefer not in ("export", "symbolic_trace"):
        raise ValueError(f"prefer must be 'export' or 'symbolic_trace', found {prefer!r}")
    args, kwargs = normalize_inputs(example_inputs)
    _check_binds(model, args, kwargs)
    _refuse_layerdrop(model)
    leaf_modules = as_leaf_modules(leaf_modules)

    checkpointed = [m for m in model.modules() if getattr(m, "gradient_checkpointing", False) is True]
    if checkpointed:
        warnings.warn(f"fxpipe: {type(model).__name__} has Hugging Face activation checkpointing on (the "
                      f"gradient_checkpointing flag of {len(checkpointed)} module(s)); it is traced without it, since "
                      f"a pipeline stage runs the traced operators, not the checkpoint. {_RECOMPUTES}",
                      RuntimeWarning, stacklevel=2)
    export_exc: BaseException | None = None
    gm = None
    inlined: list[str] = []  # the functions of the reentrant checkpoints the trace ran inline
    on_meta = _on_meta(model, args, kwargs)
    if prefer == "export" and not leaf_modules:
        try:
            with _as_trained(model, checkpointed, inlined), _quiet_torch(), \
                    _constants_as_strings(model, args, kwargs) as (e_args, e_kwargs, real):
                gm = _export_meta(model, e_args, e_kwargs) if on_meta else _export(model, e_args, e_kwargs)
            for node in gm.graph.nodes:  # the graph's input check compares with the real value
                if node.op == "placeholder" and isinstance(node.meta.get("val"), str) and node.meta["val"] in real:
                    node.meta["val"] = real[node.meta["val"]]
            path = "export"
        except Exception as e:  # noqa: BLE001 - any failure sends us to the fallback
            export_exc = e
    if gm is None:
        try:
            inlined.clear()
            with _as_trained(model, checkpointed, inlined):
                gm = _symbolic_trace(model, args, kwargs, leaf_modules)
            path = "symbolic_trace"
        except Exception as e:  # noqa: BLE001
            raise _trace_error(model, export_exc, e) from (export_exc or e)

    if inlined:
        names = sorted(set(inlined))
        warnings.warn(f"fxpipe: {type(model).__name__} calls torch.utils.checkpoint.checkpoint with use_reentrant=True "
                      f"({len(inlined)} call(s) in one forward, of {', '.join(names[:3])}"
                      f"{', ...' if len(names) > 3 else ''}); it is traced without the checkpoint, whose reentrant "
                      f"form runs its function under torch.no_grad(), where the trace would record no gradient. A "
                      f"pipeline stage runs the traced operators, not the checkpoint. {_RECOMPUTES}",
                      RuntimeWarning, stacklevel=2)
    tied = _dedup_parameters(model, gm)
    _clean(gm)
    leaves = pytree.tree_leaves((args, kwargs))
    # a model that fails on the example raises here, warning of nothing else
    _annotate(gm, args, kwargs, path, _traced_device(model, leaves))
    if export_exc is not None:  # said, not silent: the two paths capture at different levels
        why = (str(export_exc).strip().splitlines() or [""])[0]
        why = f"{type(export_exc).__name__}: {why[:200]}{'...' if len(why) > 200 else ''}"
        warnings.warn(f"fxpipe: torch.export could not capture {type(model).__name__} ({why}); it was captured "
                      f"with torch.fx.symbolic_trace instead, as torch-level calls rather than aten operators. "
                      f"The whole error: gm.meta['fxpipe'].export_error of fxpipe.trace(model, example); pass "
                      f"leaf_modules= to choose this path on purpose", RuntimeWarning, stacklevel=2)
    first = next((x for x in leaves if isinstance(x, torch.Tensor) and x.dim() > 0), None)
    gm.meta["fxpipe"] = TraceInfo(
        path=path,
        model_class=type(model).__qualname__,
        input_names=tuple(n.name for n in gm.graph.nodes if n.op == "placeholder"),
        in_spec=gm._in_spec,
        out_spec=gm._out_spec,
        training=model.training,
        batch_size=int(first.shape[0]) if first is not None else None,
        export_error=None if export_exc is None else f"{type(export_exc).__name__}: {export_exc}",
        tied=tied,
        device=_traced_device(model, leaves) if on_meta else None,
        leaf_modules=leaf_modules,
    )
    return gm


#: the end of both warnings that the trace leaves a model's own activation checkpointing out
_RECOMPUTES = ("fxpipe recomputes activations where its planner says (compile(recompute=True) to recompute on "
               "every stage); the numbers are the same")


@contextlib.contextmanager
def _as_trained(model: nn.Module, checkpointed: Sequence[nn.Module], inlined: list[str]):
    """Within: ``model`` as a pipeline trains it, for either tracer: without a KV cache, without
    Hugging Face's checkpointing on ``checkpointed``, reentrant checkpoints run inline (their
    functions' names into ``inlined``)."""
    with _no_kv_cache(model), _no_layerdrop_draw(model), _no_gradient_checkpointing(checkpointed), \
            _inline_checkpoints(inlined):
        yield


@contextlib.contextmanager
def _no_kv_cache(model: nn.Module):
    """Hugging Face decoders return a KV cache unless ``config.use_cache`` is False; a cache
    object cannot cross pipeline stages and training never reads it, so trace without one. Every
    config the model's modules hold is switched off: T5 gives its decoder stack a copy of its own."""
    configs = {id(c): (c, c.use_cache) for m in model.modules() if (c := getattr(m, "config", None)) is not None
               and getattr(c, "use_cache", None)}
    for c, _ in configs.values():
        c.use_cache = False
    try:
        yield
    finally:
        for c, old in configs.values():
            c.use_cache = old


#: Where Hugging Face keeps LayerDrop's rate: a layer stack's own ``layerdrop`` (Bart, OPT,
#: Whisper: copied from its config) or its config's (wav2vec2 reads ``config.layerdrop``).
_LAYERDROP = ("layerdrop", "encoder_layerdrop", "decoder_layerdrop")


class _NeverDrops(float):
    """A LayerDrop rate of 0 that a random draw is never below, in Python. Before transformers 5.23
    a layer stack in training draws ``p = torch.rand([])`` per layer and drops the layer
    ``if p < self.layerdrop``, even at a rate of 0: a branch on a random value, which neither
    tracer can record. ``p`` lies in [0, 1), so at 0 the test is False on every draw; this
    float answers it so (``Tensor.lt(p, rate)``) without looking at ``p``, and the trace records
    no branch. Every other use is a plain 0.0."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func in (torch.Tensor.lt, torch.Tensor.__lt__, torch.lt) and len(args) == 2 and isinstance(args[1], cls):
            return False
        return func(*(float(a) if isinstance(a, cls) else a for a in args), **(kwargs or {}))


def _layerdrop_rates(model: nn.Module) -> dict[tuple[int, str], tuple[object, str, float]]:
    """Every LayerDrop rate ``model`` holds, by (owner, attribute): its modules' and their
    configs' (:data:`_LAYERDROP`), each owner once."""
    rates = {}
    for m in model.modules():
        for owner in (m, getattr(m, "config", None)):
            for attr in _LAYERDROP:
                value = getattr(owner, attr, None) if owner is not None else None
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    rates[(id(owner), attr)] = (owner, attr, float(value))
    return rates


@contextlib.contextmanager
def _no_layerdrop_draw(model: nn.Module):
    """Each LayerDrop rate of 0 in ``model`` (:func:`_layerdrop_rates`) as a :class:`_NeverDrops`
    while tracing, so that transformers before 5.23 trace in training mode as transformers 5.23
    does, where a rate of 0 skips the draw. The draws themselves stay in the graph unread, and
    :func:`_clean` deletes them. A rate above 0 stays: a pipeline runs one graph, not a layer
    stack that changes per forward, and :func:`_refuse_layerdrop` says to set it to 0."""
    zero = [(owner, attr, value) for owner, attr, value in _layerdrop_rates(model).values() if value == 0.0]
    for owner, attr, _ in zero:
        setattr(owner, attr, _NeverDrops(0.0))
    try:
        yield
    finally:
        for owner, attr, value in zero:
            setattr(owner, attr, value)


@contextlib.contextmanager
def _no_gradient_checkpointing(flagged: Sequence[nn.Module]):
    """Hugging Face's activation checkpointing (``model.activation_checkpointing_enable()``, or
    ``gradient_checkpointing_enable()`` before transformers 5: a ``gradient_checkpointing`` flag
    on its layers, and on the base model, which older transformers read;
    ``flagged``: the modules that have it on) switched off while tracing. A trace inlines a
    checkpointed layer's operators, so the flag would save nothing in a pipeline anyway, and
    export can record the checkpoint's bookkeeping as ``torch.no_grad()`` blocks around the
    layers (Bloom's, with transformers 5): the loss then takes no gradient. fxpipe recomputes
    activations itself where the planner says, and :func:`trace` says so in a warning. The
    numbers are the same: checkpointing replays the forward with its random numbers."""
    for m in flagged:
        m.gradient_checkpointing = False
    try:
        yield
    finally:
        for m in flagged:
            m.gradient_checkpointing = True


@contextlib.contextmanager
def _inline_checkpoints(inlined: list[str]):
    """``torch.utils.checkpoint.checkpoint(f, *args, use_reentrant=True)`` (also what
    ``checkpoint_sequential`` and older code that names no mode run) calls ``f(*args)`` while
    tracing, and appends ``f``'s name to ``inlined``. The reentrant checkpoint runs ``f`` under
    ``torch.no_grad()`` inside an autograd function, which the trace would record as a block
    without gradient: the loss would take none from ``f``'s weights, and the first backward
    fail ("element 0 of tensors does not require grad"). The non-reentrant form traces as
    ``f``'s operators already."""
    from torch.utils.checkpoint import CheckpointFunction

    def inline(function, preserve_rng_state, *args):
        inlined.append(getattr(function, "__qualname__", None) or type(function).__qualname__)
        return function(*args)

    CheckpointFunction.apply = staticmethod(inline)  # the class inherits torch.autograd.Function's
    try:
        yield
    finally:
        del CheckpointFunction.apply


@contextlib.contextmanager
def _quiet_torch():
    """Without torch's fake-tensor log: an operator that fails on the example's shapes logs a
    40-line traceback there before export raises, and fxpipe says what failed in one line (the
    fallback's TraceError) or keeps export's error (``TraceInfo.export_error``). And without the
    FutureWarning torch's own pytree code raises (``isinstance(treespec, LeafSpec)`` is
    deprecated) when a fake pass or a copy of a GraphModule touches its specs: torch's code, not
    the caller's, so nothing a user could change."""
    logger = logging.getLogger("torch._subclasses.fake_tensor")
    was = logger.disabled
    logger.disabled = True
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=r".*LeafSpec.* is deprecated", category=FutureWarning)
            yield
    finally:
        logger.disabled = was


#: The non-tensor inputs torch.export takes as constants on every torch fxpipe supports.
_EXPORT_CONSTANTS = (type(None), bool, int, float, str)


@contextlib.contextmanager
def _constants_as_strings(model: nn.Module, args: tuple, kwargs: dict):
    """(args, kwargs, stand-ins) for export: each other non-tensor input (an enum member, say)
    replaced by a string that names it (``stand-ins`` maps each to its value), with
    ``model.forward`` meanwhile swapping the real value back in. Before
    torch 2.12 export refuses such an input; from 2.12 it takes enum members as constants. Either
    way the graph bakes the value in and keeps a placeholder that no node reads, as it does for a
    string, and every later batch must give the same value (``fxpipe.inputs.InputSignature``)."""
    leaves, spec = pytree.tree_flatten((args, kwargs))
    real = {}
    for i, x in enumerate(leaves):
        if not isinstance(x, (torch.Tensor, *_EXPORT_CONSTANTS)):
            leaves[i] = f"<fxpipe: example input {i}, {x!r}>"
            real[leaves[i]] = x
    if not real:
        yield args, kwargs, real
        return
    own = model.__dict__.get("forward")  # an instance's own forward, if it was given one
    forward = model.forward

    @functools.wraps(forward)  # export names the placeholders after forward's signature
    def with_real_values(*a, **k):
        a, k = pytree.tree_map(lambda v: real.get(v, v) if isinstance(v, str) else v, (a, k))
        return forward(*a, **k)

    model.forward = with_real_values
    try:
        yield (*pytree.tree_unflatten(leaves, spec), real)
    finally:
        if own is None:
            del model.forward
        else:
            model.forward = own


def _export(model: nn.Module, args: tuple, kwargs: dict) -> fx.GraphModule:
    ep = torch.export.export(model, args, kwargs, strict=False)
    return ep.module()


def _on_meta(model: nn.Module, args: tuple, kwargs: dict) -> bool:
    """Whether any parameter, buffer or example input is on the meta device."""
    tensors = [*model.parameters(), *model.buffers(), *pytree.tree_leaves((args, kwargs))]
    return any(isinstance(t, torch.Tensor) and t.is_meta for t in tensors)


def _traced_device(model: nn.Module, leaves: Sequence) -> torch.device:
    """The device a meta trace pretends to run on: that of the first real tensor, else the CPU
    (a model built under ``torch.device("meta")`` is traced as the same model built on the CPU)."""
    tensors = [*model.parameters(), *model.buffers(), *leaves]
    return next((t.device for t in tensors if isinstance(t, torch.Tensor) and not t.is_meta), torch.device("cpu"))


def without_weights(model: nn.Module) -> nn.Module:
    """A deep copy of ``model`` with every parameter on the meta device (same shape, strides,
    dtype and ``requires_grad``; tied parameters stay tied): what tracing it again needs, holding
    none of its weights. Buffers and other tensor attributes are the model's own (shared, not
    copied); ``model`` is left as it was. Raises whatever :func:`copy.deepcopy` raises for the
    model (for a lock it holds, say)."""
    memo: dict[int, Any] = {}
    for mod in model.modules():
        for value in (*vars(mod).values(), *mod._buffers.values()):
            if isinstance(value, torch.Tensor) and not isinstance(value, nn.Parameter):
                memo[id(value)] = value
        for p in mod._parameters.values():
            if p is not None and id(p) not in memo:
                memo[id(p)] = nn.Parameter(torch.empty_strided(p.shape, p.stride(), dtype=p.dtype, device="meta"),
                                           requires_grad=p.requires_grad)
    with _quiet_torch():  # a GraphModule's pytree specs warn when copied
        return copy.deepcopy(model, memo)


def _export_meta(model: nn.Module, args: tuple, kwargs: dict) -> fx.GraphModule:
    """Export a model whose parameters, buffers or inputs are on the meta device, exactly as the
    same model on a real device exports: every tensor becomes a fake tensor on that device (no
    memory). Meta kernels alone would differ from a real device's in output strides (e.g.
    scaled_dot_product_attention's), which adds ``contiguous`` nodes, so the graph and its
    fingerprint would not match a real rank's trace. The graph keeps the model's own tensors."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    device = _traced_device(model, pytree.tree_leaves((args, kwargs)))
    mode = FakeTensorMode()
    fakes: dict[int, torch.Tensor] = {}  # id(original) -> its fake

    def fake(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in fakes:
            with mode:
                fakes[id(t)] = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=device)
        return fakes[id(t)]

    swapped = _stand_in(model, fake, meta_only=False, attributes=False)
    original = {id(table[key]): t for table, key, t in swapped}  # fake (a Parameter's: a Parameter) -> original
    try:
        fargs, fkwargs = pytree.tree_map(lambda x: fake(x) if isinstance(x, torch.Tensor) else x, (args, kwargs))
        gm = _export(model, fargs, fkwargs)
    finally:
        _put_back(swapped)
    for mod in gm.modules():
        for table in (mod._parameters, mod._buffers):
            for key, t in list(table.items()):
                if t is not None and id(t) in original:
                    table[key] = original[id(t)]
        for key, value in list(vars(mod).items()):  # tensor constants export lifted: meta, no values
            if isinstance(value, torch.Tensor) and type(value).__name__ == "FakeTensor":
                setattr(mod, key, torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device="meta"))
    return gm


class _LeafTracer(fx.Tracer):
    def __init__(self, leaves: tuple):
        super().__init__()
        self.leaf_types = tuple(x for x in leaves if isinstance(x, type))
        self.leaf_names = {x for x in leaves if isinstance(x, str)}

    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        if qualname in self.leaf_names or (self.leaf_types and isinstance(m, self.leaf_types)):
            return True
        return super().is_leaf_module(m, qualname)


def _symbolic_trace(model: nn.Module, args: tuple, kwargs: dict, leaves: tuple) -> fx.GraphModule:
    """fx.symbolic_trace, then rewritten to export's shape: flat placeholders and a flat output
    tuple behind pytree specs."""
    sig = inspect.signature(model.forward)
    bound = sig.bind(*args, **kwargs)
    given = set(bound.arguments)
    concrete = {
        name: p.default
        for name, p in sig.parameters.items()
        if name not in given and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
    }
    for name, value in bound.arguments.items():
        if not isinstance(value, torch.Tensor):
            raise TraceError(
                f"symbolic_trace fallback: input {name!r} of {type(model).__name__} is a "
                f"{type(value).__name__}, expected a tensor. Pass only tensors as example inputs."
            )
    tracer = _LeafTracer(leaves)
    graph = tracer.trace(model, concrete_args=concrete or None)
    gm = fx.GraphModule(tracer.root, graph, type(model).__name__)

    # fx makes one placeholder per forward parameter, in signature order; a specialised
    # (concrete) one keeps a placeholder with a default plus asserts: fold those away.
    params = [p.name for p in sig.parameters.values() if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    placeholders = dict(zip(params, [n for n in gm.graph.nodes if n.op == "placeholder"]))
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target in (fx._symbolic_trace._assert_is_none, torch._assert):
            gm.graph.erase_node(node)
    for name, value in concrete.items():
        ph = placeholders.pop(name)
        for user in list(ph.users):
            if not user.users and user.op == "call_function" and user.target is operator.eq:
                gm.graph.erase_node(user)
        for user in list(ph.users):
            swap = lambda a: value if a is ph else a  # noqa: E731
            user.args = fx.node.map_arg(user.args, swap)
            user.kwargs = fx.node.map_arg(user.kwargs, swap)
        gm.graph.erase_node(ph)
    # Order placeholders like the flattened (args, kwargs), so pytree flattening feeds them.
    names = pytree.tree_leaves((tuple(params[: len(args)]), {k: k for k in kwargs}))
    _, in_spec = pytree.tree_flatten((tuple(args), dict(kwargs)))
    ordered = [placeholders[name] for name in names]
    anchor = next(n for n in gm.graph.nodes if n not in ordered)  # not one of them: prepending
    for node in ordered:  # a node to itself would leave it where it is, out of order
        anchor.prepend(node)
    output = next(n for n in gm.graph.nodes if n.op == "output")
    leaves_out, out_spec = pytree.tree_flatten(output.args[0])
    output.args = (tuple(leaves_out),)
    names = [placeholders[n].name for n in names]
    gm.graph._codegen = fx.graph._PyTreeCodeGen(fx.graph._PyTreeInfo(names, in_spec, out_spec))
    gm.recompile()
    return gm


# --------------------------------------------------------------------------------------------
# clean-up passes


def _dedup_parameters(model: nn.Module, gm: fx.GraphModule) -> dict[str, tuple[str, ...]]:
    """Give every parameter/buffer object ONE name, the model's first name for it.

    Export registers a tied tensor under its last alias (GPT-2: ``lm_head.weight``) and may
    read it under several; rewriting every ``get_attr`` to the canonical name makes the tie
    visible to the partitioner (one tensor, several readers). Returns canonical -> aliases.
    """
    canonical: dict[int, str] = {}
    aliases: dict[str, list[str]] = {}
    for name, t in list(model.named_parameters(remove_duplicate=False)) + list(
        model.named_buffers(remove_duplicate=False)
    ):
        if id(t) in canonical:
            aliases[canonical[id(t)]].append(name)
        else:
            canonical[id(t)] = name
            aliases[name] = []
    for node in gm.graph.nodes:
        if node.op != "get_attr":
            continue
        obj = get_attr(gm, node.target)
        if isinstance(obj, torch.Tensor) and id(obj) in canonical:
            name = canonical[id(obj)]
            if name != node.target:
                _set_attr(gm, name, obj)
                node.target = name
    # Drop attributes that are now unreferenced aliases (keep everything still read).
    used = {n.target for n in gm.graph.nodes if n.op == "get_attr"}
    for name, obj in list(gm.named_parameters(remove_duplicate=False)) + list(
        gm.named_buffers(remove_duplicate=False)
    ):
        if name not in used and id(obj) in canonical and canonical[id(obj)] != name:
            _del_attr(gm, name)
    return {k: tuple(v) for k, v in aliases.items() if v}


def leaf_module_calls(gm: fx.GraphModule) -> list[fx.Node]:
    """``gm``'s calls of opaque leaf modules (``leaf_modules``): Python that runs as it is, so
    which weights its backward reaches may change from one call to the next."""
    return [n for n in gm.graph.nodes if n.op == "call_module"]


def graph_modules(gm: fx.GraphModule) -> list[fx.GraphModule]:
    """``gm`` and the subgraphs of the higher-order ops it calls, however deep (export records a
    ``torch.no_grad()`` or ``torch.autocast`` block of the model's code as one)."""
    return [m for m in gm.modules() if isinstance(m, fx.GraphModule)]


def _grad_mode_region(enable: bool, body: fx.GraphModule, *args):
    """What export's ``torch.ops.higher_order.wrap_with_set_grad_enabled`` does (a ``torch.no_grad()``
    block of the model's code, as a subgraph), but grad mode is restored when the body raises:
    torch's op leaves it switched off, so one failed call (a fake-tensor pass that gives up, a
    stage that raises) would silently disable autograd for everything after it."""
    with torch.set_grad_enabled(enable):
        return body(*args)


def _clean(gm: fx.GraphModule) -> None:
    g = gm.graph
    for node in list(g.nodes):
        if node.op == "call_module" and str(node.target) == "_guards_fn":
            g.erase_node(node)
    for sub in graph_modules(gm):
        for node in sub.graph.nodes:
            if node.target is torch.ops.higher_order.wrap_with_set_grad_enabled:
                node.target = _grad_mode_region
        if sub is not gm:
            sub.recompile()
    if hasattr(gm, "_guards_fn"):
        delattr(gm, "_guards_fn")
    for node in list(g.nodes):
        if _self_write_back(node):
            g.erase_node(node)
    for node in reversed(list(g.nodes)):  # after its users: a draw whose value only a dead draw reads
        if node.op == "get_attr" and not node.users or _unread_draw(node):
            g.erase_node(node)
    g.lint()
    gm.recompile()


def _unread_draw(node: fx.Node) -> bool:
    """Whether ``node`` draws random numbers (an operator tagged ``nondeterministic_seeded`` that
    writes to none of its inputs: ``rand``, ``randn``, ``dropout``...) that no node reads: the
    LayerDrop draws of :func:`_no_layerdrop_draw`. Left in, a stage would draw them every
    forward for nothing."""
    target = node.target
    return (node.op == "call_function" and not node.users and isinstance(target, torch._ops.OpOverload)
            and torch.Tag.nondeterministic_seeded in target.tags and not target._schema.is_mutable)


def _self_write_back(node: fx.Node) -> bool:
    """Whether ``node`` is export's write-back of a buffer the model updated in place
    (``self.count += 1`` traces as ``add_(count, 1)`` then ``copy_(count, add_)``): a copy of the
    buffer onto itself, which does nothing but read the buffer once more, at the graph's end. Left
    in, it ties the buffer to whichever stage the end of the graph lands on."""
    if node.target is not torch.ops.aten.copy_.default or node.users or len(node.args) < 2:
        return False
    dst, src = node.args[0], node.args[1]
    return (isinstance(dst, fx.Node) and dst.op == "get_attr" and isinstance(src, fx.Node)
            and alias_base(src) is dst and dst in written_values(src))


def get_attr(gm: nn.Module, target: str):
    """What a ``get_attr`` node's dotted ``target`` names on ``gm``."""
    obj = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def _set_attr(gm: nn.Module, target: str, value: torch.Tensor) -> None:
    *prefix, last = target.split(".")
    mod = gm
    for part in prefix:
        if not hasattr(mod, part):
            mod.add_module(part, nn.Module())
        mod = getattr(mod, part)
    if isinstance(value, nn.Parameter):
        mod.register_parameter(last, value)
    else:
        mod.register_buffer(last, value)


def _del_attr(gm: nn.Module, target: str) -> None:
    *prefix, last = target.split(".")
    mod = gm
    for part in prefix:
        mod = getattr(mod, part)
    delattr(mod, last)


# --------------------------------------------------------------------------------------------
# metadata


def _static_spec(node: fx.Node, t: torch.Tensor) -> TensorSpec:
    """``t``'s spec; a size that depends on the values (a boolean-mask index, ``nonzero``) is refused:
    the planner prices, and the runtime sizes its messages, by the traced shapes."""
    if any(isinstance(s, torch.SymInt) and not s.node.has_hint() for s in t.shape):
        owner = module_path(node)
        where = f"module {owner!r}" if owner else "the model's own forward"
        raise TraceError(
            f"node {node.name!r} ({node.target}, in {where}) has a size that depends on the input's values: "
            f"shape {tuple(t.shape)}. fxpipe needs every size fixed by the input's shape. Compute it with "
            f"static shapes (e.g. torch.where(mask, x, 0) instead of x[mask]), or pass the module that "
            f"computes it in compile(leaf_modules=[...]) if its outputs have fixed sizes: it then runs "
            f"whole inside one stage")
    return TensorSpec.of(t)


def _annotate(gm: fx.GraphModule, args: tuple, kwargs: dict, path: str, device: torch.device) -> None:
    params = dict(gm.named_parameters())
    buffers = dict(gm.named_buffers())
    if path != "export" or any("val" not in n.meta for n in gm.graph.nodes if n.op not in ("output", "get_attr")):
        _fake_shape_prop(gm, args, kwargs, device)
    for node in gm.graph.nodes:
        if node.op == "output":
            continue
        val = node.meta.get("val", node.meta.get("tensor_meta"))
        outs = tuple(_static_spec(node, t) for t in pytree.tree_leaves(val) if isinstance(t, torch.Tensor))
        if node.op == "get_attr":
            obj = get_attr(gm, node.target)
            outs = (TensorSpec.of(obj),) if isinstance(obj, torch.Tensor) else ()
        p_names: list[str] = []
        b_names: list[str] = []
        if node.op == "call_module":
            sub = gm.get_submodule(node.target)
            p_names = [f"{node.target}.{n}" for n, _ in sub.named_parameters()]
            b_names = [f"{node.target}.{n}" for n, _ in sub.named_buffers()]
        for inp in node.all_input_nodes:
            if inp.op == "get_attr":
                if inp.target in params:
                    p_names.append(inp.target)
                elif inp.target in buffers:
                    b_names.append(inp.target)
        p_bytes = sum(get_attr(gm, p).nbytes for p in p_names)
        node.meta["fxpipe"] = NodeInfo(
            outputs=outs,
            params=tuple(dict.fromkeys(p_names)),
            buffers=tuple(dict.fromkeys(b_names)),
            module_path=module_path(node),
            param_bytes=p_bytes,
        )


def _fake_shape_prop(gm: fx.GraphModule, args: tuple, kwargs: dict, device: torch.device) -> None:
    """Shapes for the fallback path, computed on fake tensors: running the real model would
    advance the RNG and update BatchNorm statistics. A leaf module with data-dependent control
    flow cannot run on fake tensors; then a copy of the graph runs on the real inputs with the
    RNG state restored afterwards. Meta tensors (a model built on the meta device, or one whose
    weights a pipeline no longer holds) stand in as on ``device``, the device the trace pretends
    to run on: fake tensors in the first pass, zeros in the copy (shapes, not values, are read)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.passes.shape_prop import ShapeProp

    flat = pytree.tree_leaves((args, kwargs))
    mode = FakeTensorMode(allow_non_fake_inputs=True)

    def fake(t: torch.Tensor) -> torch.Tensor:
        with mode:
            return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=device)

    def zeros(t: torch.Tensor) -> torch.Tensor:
        return torch.zeros(t.shape, dtype=t.dtype, device=device)

    swapped = _stand_in(gm, fake, meta_only=True, attributes=True)
    try:
        # ShapeProp prints a traceback before re-raising, and torch's fake-tensor log another; the
        # fallback below handles it.
        with mode, contextlib.redirect_stderr(io.StringIO()), _quiet_torch():
            ShapeProp(gm).run(*[(fake(x) if x.is_meta else mode.from_tensor(x)) if isinstance(x, torch.Tensor) else x
                                for x in flat])
        source = gm
    except Exception:  # noqa: BLE001 - data-dependent leaf: measure on a real copy
        _put_back(swapped)
        swapped = []
        with _quiet_torch():
            source = copy.deepcopy(gm)
        _stand_in(source, zeros, meta_only=True, attributes=True)
        try:
            with torch.random.fork_rng(devices=[]), torch.no_grad(), contextlib.redirect_stderr(io.StringIO()):
                ShapeProp(source).run(*[zeros(x) if isinstance(x, torch.Tensor) and x.is_meta else x for x in flat])
        except Exception as e:  # noqa: BLE001 - the model cannot run on the example
            raise _example_error(e) from e
    finally:
        _put_back(swapped)
    metas = {n.name: n.meta.get("tensor_meta") for n in source.graph.nodes}
    for node in gm.graph.nodes:
        tm = metas.get(node.name)
        if tm is not None and "val" not in node.meta:
            node.meta["val"] = pytree.tree_map(
                lambda m: torch.empty(m.shape, dtype=m.dtype, device="meta"),
                tm,
                is_leaf=lambda m: hasattr(m, "shape") and hasattr(m, "dtype"),
            )


def _stand_in(module: nn.Module, make, *, meta_only: bool, attributes: bool) -> list[tuple[dict, str, torch.Tensor]]:
    """Put ``make(t)`` in place of each tensor ``t`` that ``module``'s modules hold as a parameter
    or buffer (with ``attributes``, as any other attribute too; with ``meta_only``, only those on
    the meta device). A tensor held in several places gets one stand-in, a parameter's wrapped as
    a parameter; a module reached twice is visited once. Returns (table, key, tensor) for each
    place, for :func:`_put_back`."""
    made: dict[int, torch.Tensor] = {}
    swapped = []
    for mod in module.modules():
        for table in (mod._parameters, mod._buffers, *((vars(mod),) if attributes else ())):
            for key, t in list(table.items()):
                if isinstance(t, torch.Tensor) and (t.is_meta or not meta_only):
                    if id(t) not in made:
                        new = make(t)
                        made[id(t)] = nn.Parameter(new, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) \
                            else new
                    swapped.append((table, key, t))
                    table[key] = made[id(t)]
    return swapped


def _put_back(swapped: list[tuple[dict, str, torch.Tensor]]) -> None:
    """Undo :func:`_stand_in`."""
    for table, key, t in swapped:
        table[key] = t


# --------------------------------------------------------------------------------------------
# errors


def _example_error(e: BaseException) -> TraceError:
    """The model failed on the example inputs (ShapeProp's error, the model's own as its cause)."""
    root = e
    while root.__cause__ is not None:
        root = root.__cause__
    node = re.search(r"node=%(\S+)", str(e).splitlines()[0] if str(e) else "")
    where = f" at node {node.group(1)!r}" if node else ""
    return TraceError(
        f"the model fails on the example inputs{where}: {type(root).__name__}: {str(root).strip().splitlines()[0]}. "
        f"The example is one micro-batch of what the model takes: check its shapes and dtypes "
        f"(model(*example) must run)")


def _check_binds(model: nn.Module, args: tuple, kwargs: dict) -> None:
    """The example must fit ``forward``'s signature, as a call ``model(*args, **kwargs)`` needs:
    otherwise both tracers fail inside ``inspect`` with a bare "too many positional arguments",
    and the leaf-module advice of a failed trace does not apply."""
    try:
        signature = inspect.signature(model.forward)
    except (TypeError, ValueError):  # a forward inspect cannot read (a C extension): the trace will tell
        return
    try:
        signature.bind(*args, **kwargs)
    except TypeError as e:
        given = (f"{len(args)} positional input{'s' if len(args) != 1 else ''}"
                 + (f" and keyword inputs {sorted(kwargs)}" if kwargs else ""))
        keyword_only = [n for n, p in signature.parameters.items() if p.kind is p.KEYWORD_ONLY]
        fix = (f"; its keyword-only parameters {keyword_only} take a dict example, e.g. "
               f"{{{', '.join(repr(n) + ': ...' for n in keyword_only[:3])}}}" if keyword_only and args else "")
        raise TraceError(
            f"fxpipe could not trace {type(model).__name__}: the example inputs do not fit "
            f"{type(model).__name__}.forward{signature} ({e}; the example gives {given}). The example is one "
            f"micro-batch of what forward takes: a tuple of its positional inputs, or a dict of its inputs by "
            f"name{fix}") from e


def _user_frame(exc: BaseException) -> traceback.FrameSummary | None:
    """The innermost traceback frame in user/model code (not torch/fxpipe internals)."""
    torch_dir = os.path.dirname(torch.__file__)
    here = os.path.dirname(__file__)
    frames = []
    e: BaseException | None = exc
    while e is not None:
        frames.extend(traceback.extract_tb(e.__traceback__))
        e = e.__cause__ or e.__context__
    user = [f for f in frames if not f.filename.startswith((torch_dir, here)) and "site-packages/torch" not in f.filename]
    return user[-1] if user else None


def _trace_error(model: nn.Module, export_exc: BaseException | None, fx_exc: BaseException) -> TraceError:
    cls = type(model).__name__
    where = ""
    mod_path = ""
    for exc in (export_exc, fx_exc):
        if exc is None:
            continue
        frame = _user_frame(exc)
        if frame is not None:
            where = f"{frame.filename}:{frame.lineno} in {frame.name}: {frame.line}"
            mod_path = _module_of_frame(model, frame)
            break
    lines = [f"fxpipe could not trace {cls}."]
    if where:
        lines.append(f"  failed at {where}" + (f" (module {mod_path!r})" if mod_path else ""))
    if export_exc is not None:
        lines.append(f"  torch.export: {type(export_exc).__name__}: {str(export_exc).splitlines()[0][:300] if str(export_exc) else ''}")
    lines.append(f"  torch.fx.symbolic_trace: {type(fx_exc).__name__}: {str(fx_exc).splitlines()[0][:300] if str(fx_exc) else ''}")
    lines.append(
        "  What to try: make the failing module a leaf (fxpipe.compile or fxpipe.trace(..., "
        "leaf_modules=[ThatModule]): it then runs as an opaque call inside one stage); "
        "replace data-dependent Python control flow (if/for on tensor values) with torch ops "
        "(torch.where, masking); for Hugging Face decoders build the config with use_cache=False."
    )
    return TraceError("\n".join(lines))


def _refuse_layerdrop(model: nn.Module) -> None:
    """A TraceError where ``model`` trains with a LayerDrop rate above 0 (:func:`_layerdrop_rates`):
    it skips layers at random in every forward, where a pipeline runs one graph. Before either
    tracer runs: export fails on the branch, but ``symbolic_trace`` runs ``torch.rand`` at trace
    time and would bake one draw's choice of layers into the graph."""
    dropping = sorted({f"{type(owner).__name__}.{attr} = {value:g}" for owner, attr, value
                       in _layerdrop_rates(model).values() if value > 0.0})
    if dropping and model.training:
        raise TraceError(
            f"fxpipe cannot trace {type(model).__name__} with LayerDrop on ({', '.join(dropping)}): LayerDrop skips "
            f"layers at random in every training forward, and a pipeline runs one fixed graph. Build the model "
            f"with a LayerDrop rate of 0 (a Hugging Face model: from_pretrained(..., layerdrop=0.0), or "
            f"encoder_layerdrop=0.0 and decoder_layerdrop=0.0, as named here).")


def _module_of_frame(model: nn.Module, frame: traceback.FrameSummary) -> str:
    """Best guess at the module whose forward holds the failing line."""
    for name, mod in model.named_modules():
        fwd = type(mod).forward
        code = getattr(fwd, "__code__", None)
        if code is None:
            continue
        if code.co_filename == frame.filename and frame.name == code.co_name:
            try:
                lines, start = inspect.getsourcelines(fwd)
            except (OSError, TypeError):
                continue
            if start <= (frame.lineno or 0) < start + len(lines):
                return name or "<root>"
    return ""


# The symbolic_trace path records torch-level calls, which have no schema: in-place writes and
# views are known by name there (``x.mul_(2)``, ``torch.relu_(x)``, ``x += y``, ``F.relu(x,
# inplace=True)``, ``nn.ReLU(inplace=True)``; ``x.view(...)``, ``x[:, :8]``, ``x.transpose(0, 1)``).
# Erring towards "written" costs a copy of a stage's argument; erring the other way, wrong numbers.
_INPLACE_OPERATORS = frozenset({operator.iadd, operator.isub, operator.imul, operator.itruediv, operator.ifloordiv,
                                operator.imod, operator.ipow, operator.imatmul, operator.iand, operator.ior,
                                operator.ixor, operator.ilshift, operator.irshift})
_NOT_WRITES = frozenset({"requires_grad_", "retain_grad", "share_memory_"})
_VIEWS = frozenset({"view", "view_as", "reshape", "reshape_as", "transpose", "permute", "narrow", "select",
                    "squeeze", "unsqueeze", "expand", "expand_as", "t", "flatten", "unflatten", "split", "chunk",
                    "unbind", "diagonal", "as_strided", "detach", "movedim", "moveaxis", "swapaxes", "swapdims",
                    "unfold", "contiguous", "tensor_split", "split_with_sizes", "view_as_real", "view_as_complex"})


def _torch_level_name(nd: fx.Node) -> str | None:
    """The name of a torch-level call (a Tensor method, or a function of ``torch`` or
    ``torch.nn.functional``), None for an aten operator (it has a schema) or anything else."""
    if nd.op == "call_method":
        return nd.target
    if nd.op == "call_function" and getattr(nd.target, "_schema", None) is None:
        name = getattr(nd.target, "__name__", None)
        if name and nd.target in (getattr(torch, name, None), getattr(torch.nn.functional, name, None)):
            return name
    return None


def _writes_first_argument(nd: fx.Node) -> bool:
    """Whether a torch-level call (or leaf module) writes its first argument in place."""
    if nd.op == "call_module":
        owner = nd.graph.owning_module
        try:
            return owner is not None and getattr(owner.get_submodule(nd.target), "inplace", False) is True
        except AttributeError:
            return False
    if nd.op == "call_function" and nd.target in _INPLACE_OPERATORS:
        return True
    name = _torch_level_name(nd)
    if name is None:
        return False
    if name.endswith("_") and not name.startswith("_") and name not in _NOT_WRITES:
        return True
    if nd.kwargs.get("inplace") is True:
        return True
    if nd.op == "call_function" and nd.target is getattr(torch.nn.functional, name, None):
        try:  # F.relu(x, True): inplace given by position
            bound = inspect.signature(nd.target).bind(*nd.args, **nd.kwargs)
        except (TypeError, ValueError):
            return False
        return bound.arguments.get("inplace") is True
    return False


def written_values(nd: fx.Node) -> list[fx.Node]:
    """The values call ``nd`` writes in place: its schema's ``Tensor(a!)`` arguments, or on the
    symbolic_trace path the first argument of an in-place call known by name (above)."""
    if _writes_first_argument(nd):
        return [nd.args[0]] if nd.args and isinstance(nd.args[0], fx.Node) else []
    schema = getattr(nd.target, "_schema", None) if nd.op == "call_function" else None
    if schema is None or not schema.is_mutable:
        return []
    out = []
    for i, arg in enumerate(schema.arguments):
        value = nd.args[i] if i < len(nd.args) else nd.kwargs.get(arg.name)
        if arg.alias_info is not None and arg.alias_info.is_write and isinstance(value, fx.Node):
            out.append(value)
    return out


def alias_base(nd: fx.Node) -> fx.Node | None:
    """The node whose storage ``nd``'s output shares, per its schema (a view, or the ``self`` an
    in-place op returns; ``getitem`` of a tuple of views), or on the symbolic_trace path by name
    (a view method or function, an in-place call), else None. This is what *may* share storage,
    the safe side for tracking in-place writes (``reshape`` of a contiguous input is a view);
    :func:`fxpipe.cost.is_view` asks whether it does, for memory and time, and so differs for
    ``reshape``, ``flatten`` and ``contiguous`` of a strided input."""
    if nd.op not in ("call_function", "call_method", "call_module") or not nd.args or not isinstance(nd.args[0], fx.Node):
        return None
    if nd.target is operator.getitem or _writes_first_argument(nd) or _torch_level_name(nd) in _VIEWS:
        return nd.args[0]
    if nd.op != "call_function":
        return None
    schema = getattr(nd.target, "_schema", None)
    if schema is None or not schema.returns or schema.returns[0].alias_info is None:
        return None
    return nd.args[0] if schema.arguments and schema.arguments[0].alias_info is not None else None
