"""inputs: the traced example's input signature, and the check of every batch against it.

The traced graph is specialised to the example micro-batch: its structure, every tensor's dtype
and every dim but the batch dim 0; and the micro-batch size b itself is fixed at trace time, so
a step needs exactly ``b * m * w`` samples (m micro-batches per replica, w data-parallel
replicas). :class:`InputSignature` records the example at set-up; :meth:`InputSignature.check`
compares a global batch given to ``Pipeline.step``/``eval_step`` with it BEFORE anything is
split or communicated, so a bad batch raises :class:`~fxpipe.errors.InputError` on every rank
alike and leaves no half-run step behind. The rules:

* **structure**: as many positional inputs and the same keyword names as the example (keyword
  order is free: the batch is reordered to the traced order), the same nesting;
* **shapes**: every tensor has the traced number of dims and the traced size in every dim but 0
  (a feature size, a sequence length: the graph is specialised to it); a 0-dim tensor is given
  whole to every micro-batch and must stay 0-dim;
* **batch size**: every tensor with a dim 0 has ``b * m * w`` samples there (b: its size in the
  example), which is what splits into the ``m * w`` micro-batches; the target's tensors too. So
  the example's tensors must agree on b (checked at set-up: a tensor every sample shares belongs
  in the model, as a buffer);
* **dtypes**: as traced (no silent casts);
* **devices**: the CPU or the pipeline's own device, whatever device the example was on. The
  pipeline copies each micro-batch to its device itself (:func:`fxpipe.device.to_device`), so a
  CPU batch is the usual case, and a batch already there is used in place. Any other device (a
  second GPU, ``meta``) is refused: a copy across GPUs behind the user's back would hide a
  mistake (under torchrun each rank's batch belongs on the CPU or on its ``cuda:LOCAL_RANK``);
* **non-tensor inputs** (ints, flags, enums) are constants baked into the graph: they
  must equal the example's (same type, and ``==`` where the type defines it; an object compared
  by identity cannot be checked);
* **target**: given exactly when ``compile`` got a ``loss_fn`` (``loss_fn(output, target)``);
  with ``loss_fn=None`` the model's output is the loss and a target would go unread. ``compile``
  takes no example target: the first batch's (:class:`TargetSignature`) fixes the nesting, the
  dtypes and the sizes beyond dim 0 of every later one.

With ``loss_fn=None`` the traced output itself must be a loss: :func:`check_model_loss` reads
the trace's output structure at set-up (a scalar tensor, or an output whose ``.loss``/``["loss"]``
is one: a Hugging Face model traced with ``labels``) and raises
:class:`~fxpipe.errors.ConfigError` before anything is planned or communicated.

The example's dtypes must also suit the model: :func:`check_operand_dtypes` finds a matrix
product whose operands eager PyTorch would refuse to multiply (a float64 example of a float32
model; under mixed precision, what autocast leaves alone), which the trace's fake kernels let
through, and raises :class:`~fxpipe.errors.ConfigError` at set-up too.

The lazy path (``fxpipe.compile(model)`` without example inputs) has no signature before its
first step: :func:`check_first_batch` checks only what that step needs to cut its first
micro-batch (equal batch sizes that split into the micro-batches, devices); the first
micro-batch then defines the signature, which checks the following batches.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils._pytree as pytree

from .errors import ConfigError, InputError
from .trace import module_path, normalize_inputs

__all__ = ["InputSpec", "InputSignature", "TargetSignature", "batch_inputs", "check_first_batch", "check_model_loss",
           "check_operand_dtypes"]

_CASTS = {
    torch.float32: ".float()", torch.float64: ".double()", torch.float16: ".half()",
    torch.bfloat16: ".bfloat16()", torch.int64: ".long()", torch.int32: ".int()", torch.int16: ".short()",
    torch.int8: ".char()", torch.uint8: ".byte()", torch.bool: ".bool()",
}


@dataclass(frozen=True)
class InputSpec:
    """One flat input of the traced example (a placeholder of the graph)."""

    name: str  #: placeholder name (``TraceInfo.input_names``; "" if they do not match the leaves)
    where: str  #: how the user passes it: ``input 'x' (positional 0)``, ``input 'mask'``
    shape: tuple[int, ...] | None  #: one micro-batch's shape; None for a non-tensor input
    dtype: torch.dtype | None
    device: torch.device | None  #: the example's device (recorded; the rule is in the module docstring)
    value: Any = None  #: a non-tensor input's traced value

    @property
    def batched(self) -> bool:
        return self.shape is not None and len(self.shape) > 0


@dataclass(frozen=True)
class InputSignature:
    """The traced example's inputs: (args, kwargs) structure and one :class:`InputSpec` per flat input."""

    positional: int  #: number of positional inputs
    keywords: tuple[str, ...]  #: keyword names, in the traced order
    spec: Any  #: pytree spec of ``(args, kwargs)``
    inputs: tuple[InputSpec, ...]
    batch_size: int | None  #: b, the traced micro-batch size (``TraceInfo.batch_size``)

    @classmethod
    def record(cls, trace_info, args: tuple, kwargs: dict) -> "InputSignature":
        """The signature of the example ``(args, kwargs)`` that ``trace_info`` was traced from."""
        leaves, spec = pytree.tree_flatten((tuple(args), dict(kwargs)))
        names = list(trace_info.input_names)  # one placeholder per leaf, in the same (pytree) order
        if len(names) != len(leaves):
            names = None
        inputs = []
        for i, (x, where) in enumerate(zip(leaves, _wheres(args, kwargs, names))):
            name = names[i] if names else ""
            if isinstance(x, torch.Tensor):
                inputs.append(InputSpec(name, where, tuple(int(s) for s in x.shape), x.dtype, x.device))
            else:
                inputs.append(InputSpec(name, where, None, None, None, x))
        sizes = [(i.where, i.shape[0]) for i in inputs if i.shape]
        if len({n for _, n in sizes}) > 1:
            (first, b), (other, n) = sizes[0], next(x for x in sizes if x[1] != sizes[0][1])
            raise ConfigError(
                f"fxpipe.compile: the example is one micro-batch, and every tensor input is cut along dim 0 into "
                f"the micro-batches, so all of them need the micro-batch size there; found {b} in {first} and {n} "
                f"in {other}. A tensor every sample shares (a mask, a table) belongs in the model: register it as a "
                f"buffer (module.register_buffer) or build it in forward; or give it a batch dim, expanded to the "
                f"micro-batch size.")
        return cls(len(args), tuple(kwargs), spec, tuple(inputs), trace_info.batch_size)

    def check(self, args: tuple, kwargs: dict, target, *, microbatches: int, width: int, device: torch.device,
              needs_target: bool, what: str = "step()", targets: "TargetSignature | None" = None) -> tuple[tuple, dict]:
        """Check one global batch (module docstring); return ``(args, kwargs)`` with the keyword
        inputs in the traced order. ``needs_target``: a ``loss_fn`` was given (it takes the
        target), else the model's output is the loss (and a target would go unused);
        ``targets``: the first batch's target, which this one's must be like. Raises
        :class:`InputError` naming every problem found."""
        if not needs_target and target is not None and len(args) + 1 == self.positional:
            raise InputError(  # step(x, y) for a model that takes (x, y): y was read as the target
                f"{what}: got {len(args)} positional input{'s' if len(args) != 1 else ''} and a target, but the model "
                f"was traced with {self._traced()} and, with loss_fn=None, takes no target (its output, or its "
                f".loss, is the loss). Pass all of the model's inputs as one tuple, step((x, y)), or compile "
                f"with loss_fn=... to compute the loss from the output and the target."
            )
        args, kwargs = self._structure(args, kwargs, what)
        m, w = microbatches, width
        problems: list[str] = _target_problem(target, needs_target)
        if targets is not None and target is not None:
            problems += targets.problems(target)
        leaves = pytree.tree_leaves((args, kwargs))
        sizes: list[tuple[InputSpec, int]] = []  # (spec, dim 0) of every batched input
        for s, x in zip(self.inputs, leaves):
            if s.shape is None:
                same = _same_constant(x, s.value)
                if isinstance(x, torch.Tensor) or not same and x is not s.value:
                    # an object that cannot tell equal values (no __eq__, or one that holds tensors)
                    # must be the very object traced
                    which = " (the same object: its class compares by identity)" if same is None else ""
                    problems.append(
                        f"{s.where}: expected the constant {s.value!r}{which} the model was traced with "
                        f"(non-tensor inputs are baked into the graph), got {_show(x)}; pass {s.value!r}, or "
                        f"compile with an example that has the new value"
                    )
                continue
            if not isinstance(x, torch.Tensor):
                problems.append(f"{s.where}: expected a tensor as traced ({_spec(s)}), got {_show(x)}")
                continue
            problems += _device_problem(s.where, x, device)
            if x.dtype != s.dtype:
                cast = _CASTS.get(s.dtype, f".to({s.dtype})")
                problems.append(f"{s.where}: expected {s.dtype} as traced, got {x.dtype}; convert with {cast}")
            if x.dim() != len(s.shape):
                problems.append(
                    f"{s.where}: expected {len(s.shape)} dims (traced shape {list(s.shape)} per micro-batch), "
                    f"got {x.dim()} dims (shape {list(x.shape)})"
                )
                continue
            for dim in range(1, x.dim()):
                if x.shape[dim] != s.shape[dim]:
                    problems.append(
                        f"{s.where}: expected size {s.shape[dim]} in dim {dim} (traced shape {list(s.shape)} per "
                        f"micro-batch), got {x.shape[dim]} (shape {list(x.shape)}). Every dim but the batch dim 0 "
                        f"(a feature size, a sequence length) is fixed at trace time: pass size {s.shape[dim]} "
                        f"there (pad or truncate), or compile with an example of the new shape"
                    )
            if s.batched:
                sizes.append((s, int(x.shape[0])))
        if problems:
            _raise(what, problems)

        if self.batch_size is None:
            raise InputError(
                f"{what}: the model was traced with no tensor input that has a batch dim, so there is nothing "
                f"to split into {m * w} micro-batches. Pass example inputs whose tensors have the micro-batch "
                f"size in dim 0."
            )
        wrong = [(s, n) for s, n in sizes if n != s.shape[0] * m * w]
        if wrong:
            problems.append(_batch_problem(wrong, len(sizes), m, w, what))
        # The target follows the inputs as given (one wrong batch size is reported once).
        b, given = self.batch_size, {n for _, n in sizes}
        n_in = given.pop() if len(given) == 1 else self.batch_size * m * w
        for where, x in _target_leaves(target):
            problems += _device_problem(where, x, device)
            if x.dim() > 0 and x.shape[0] != n_in:
                like = f" ({_recipe(b, m, w)})" if n_in == b * m * w else ""
                problems.append(
                    f"{where}: expected {n_in} samples in dim 0 like the inputs{like}, got {x.shape[0]}: the "
                    f"target is split along dim 0 into the same micro-batches as the inputs"
                )
        if problems:
            _raise(what, problems)
        return args, kwargs

    def _traced(self) -> str:
        """``1 positional input and keyword inputs ['mask']``, as the example had them."""
        pos = f"{self.positional} positional input{'s' if self.positional != 1 else ''}"
        kw = f"keyword inputs {_names(self.keywords)}" if self.keywords else "no keyword inputs"
        return kw if not self.positional else f"{pos} and {kw}"

    def _structure(self, args: tuple, kwargs: dict, what: str) -> tuple[tuple, dict]:
        traced = list(self.keywords)
        missing = [k for k in traced if k not in kwargs]
        unexpected = [k for k in kwargs if k not in self.keywords]
        if missing or unexpected:
            parts = []
            if missing:
                parts.append(f"missing keyword input{'s' if len(missing) > 1 else ''} {_names(missing)}")
            if unexpected:
                parts.append(f"unexpected keyword input{'s' if len(unexpected) > 1 else ''} {_names(unexpected)}")
            raise InputError(
                f"{what}: {' and '.join(parts)}; the model was traced with {self._traced()}. Pass the same "
                f"inputs as the example, by the same names."
            )
        if len(args) != self.positional:
            raise InputError(
                f"{what}: expected {self.positional} positional input{'s' if self.positional != 1 else ''} as "
                f"traced, got {len(args)}; the model was traced with {self._traced()}. Pass the same inputs as "
                f"the example, in the same order."
            )
        kwargs = {k: kwargs[k] for k in traced}  # the traced order: the pytree spec depends on it
        _, spec = pytree.tree_flatten((tuple(args), kwargs))
        if spec != self.spec:
            raise InputError(
                f"{what}: the inputs are nested differently from the example: expected {self.spec}, found "
                f"{spec}. Pass the same (tuple/list/dict) structure as the example inputs."
            )
        return tuple(args), kwargs


@dataclass(frozen=True)
class TargetSignature:
    """The first batch's target (``compile`` takes no example target): its nesting (dict keys in
    any order), and each tensor leaf's dtype and sizes beyond dim 0 (a non-tensor leaf only as
    not a tensor). Every later batch's target
    must be alike, as the inputs must be like the traced example: a target of another dtype,
    nesting or length would otherwise fail only inside ``loss_fn`` on the last stage, mid-step,
    leaving the pipeline unusable."""

    spec: Any  #: of the target with its dicts' keys sorted (their order is free, as the inputs')
    leaves: tuple[tuple[str, Any], ...]  #: (where, (dtype, sizes beyond dim 0), or None for a non-tensor)
    shown: str  #: the structure, as messages name it

    @classmethod
    def record(cls, target) -> "TargetSignature":
        target = _keys_sorted(target)
        leaves, spec = pytree.tree_flatten(target)
        return cls(spec, tuple(zip(_wheres_of(target), map(_leaf_kind, leaves))), _structure_text(target))

    def problems(self, target) -> list[str]:
        target = _keys_sorted(target)
        leaves, spec = pytree.tree_flatten(target)
        if spec != self.spec:
            return [f"target: expected {self.shown} as the first batch's target was, got {_structure_text(target)}; "
                    f"pass the target in the same structure every step"]
        out = []
        for (where, kind), x in zip(self.leaves, leaves):
            got = _leaf_kind(x)
            if got == kind:
                continue
            if not isinstance(kind, tuple) or not isinstance(got, tuple):
                out.append(f"{where}: expected {_kind_text(kind)} as in the first batch's target, got {_show(x)}")
            elif got[0] != kind[0]:
                cast = _CASTS.get(kind[0], f".to({kind[0]})")
                out.append(f"{where}: expected {kind[0]} as in the first batch's target, got {got[0]}; convert with {cast}")
            else:
                out.append(f"{where}: expected {_kind_text(kind)} as in the first batch's target, got shape "
                           f"{list(x.shape)}. A target's dims beyond the batch dim 0 stay as in the first batch, "
                           f"like the inputs': pad or truncate to that size")
        return out


def _structure_text(x) -> str:
    """``a tensor``, ``a dict with keys ['y', 'w']``, ``a tuple of 2``, ``a list of 8``, ``an int``."""
    if isinstance(x, torch.Tensor):
        return "a tensor"
    if isinstance(x, dict):
        return f"a dict with keys {_names(list(x))}"
    if isinstance(x, (tuple, list)):
        return f"a {type(x).__name__} of {len(x)}"
    name = type(x).__name__
    return f"{'an' if name[:1] in 'aeiou' else 'a'} {name}"


def _keys_sorted(x):
    """``x`` with every dict's keys in sorted order (a target's nesting, whatever order it was built in)."""
    if isinstance(x, dict):
        return {k: _keys_sorted(x[k]) for k in sorted(x, key=repr)}
    if isinstance(x, (tuple, list)) and not hasattr(x, "_fields"):
        return type(x)(_keys_sorted(v) for v in x)
    return x


def _leaf_kind(x):
    """A tensor leaf's dtype and sizes beyond dim 0 (None for a 0-dim one); None for any other
    leaf (a number reaches every micro-batch as it is, whatever its type)."""
    return (x.dtype, tuple(x.shape[1:]) if x.dim() else None) if isinstance(x, torch.Tensor) else None


def _kind_text(kind) -> str:
    """A :func:`_leaf_kind` in words: ``a torch.int64 tensor of shape [N, 5]``."""
    if kind is None:
        return "a non-tensor value"
    dtype, rest = kind
    if rest is None:
        return f"a 0-dim {dtype} tensor"
    return f"a {dtype} tensor of shape [{', '.join(['N', *map(str, rest)])}]"


def _wheres_of(target) -> list[str]:
    """How each leaf of ``target`` is named in messages: ``target``, ``target[0]``, ``target['y']``."""
    return ["target" + "".join(str(k) for k in path) for path, _ in pytree.tree_flatten_with_path(target)[0]]


def batch_inputs(inputs, what: str = "step()") -> tuple[tuple, dict]:
    """A global batch's inputs as ``(args, kwargs)``, read as :func:`fxpipe.trace.normalize_inputs`
    reads example inputs: a tensor is one positional input, a tuple/list positional inputs, a
    dict keyword inputs."""
    try:
        return normalize_inputs(inputs)
    except TypeError:
        raise InputError(
            f"{what}: inputs must be a tensor, a tuple/list (positional inputs) or a dict (keyword inputs) of the "
            f"global batch; got {type(inputs).__name__}"
        ) from None


def check_first_batch(args: tuple, kwargs: dict, target, *, microbatches: int, width: int,
                      device: torch.device, needs_target: bool, what: str = "step()") -> None:
    """The lazy path's first batch (no signature yet): a target exactly when a ``loss_fn`` was
    given (``needs_target``), every tensor on the CPU or ``device``, and every tensor with a
    dim 0 has the same number of samples there, a multiple of ``microbatches * width``: the
    first micro-batch, that fraction of it, is what gets traced."""
    m, w = microbatches, width
    found = [(where, x) for where, x in zip(_wheres(args, kwargs, None), pytree.tree_leaves((args, kwargs)))
             if isinstance(x, torch.Tensor)]
    targets = list(_target_leaves(target))
    problems = _target_problem(target, needs_target)
    problems += [p for where, x in found + targets for p in _device_problem(where, x, device)]
    if problems:
        _raise(what, problems)
    batched = [(where, int(x.shape[0])) for where, x in found + targets if x.dim() > 0]
    if not any(x.dim() > 0 for _, x in found):
        raise InputError(
            f"{what}: the first batch has no input tensor with a batch dim (dim 0) to split into {m * w} "
            f"micro-batches; pass the inputs with the global batch in dim 0."
        )
    if len({n for _, n in batched}) > 1:
        raise InputError(
            f"{what}: every tensor of the first batch needs the same number of samples in dim 0, got "
            + ", ".join(f"{n} in {where}" for where, n in batched)
            + ". Pass the inputs and target of one global batch."
        )
    n = batched[0][1]
    if n == 0:
        raise InputError(f"{what}: the batch is empty (0 samples in dim 0); pass a global batch of a multiple of "
                         f"{m * w} samples{_split_clause(m, w)}.")
    if n % (m * w):
        raise InputError(
            f"{what}: the batch has {n} samples, which does not split into {m * w} equal micro-batches"
            f"{_split_clause(m, w)}; the first step traces the model on one micro-batch of it. Pass a multiple "
            f"of {m * w} samples, e.g. {max(1, round(n / (m * w))) * m * w}."
        )


def check_model_loss(gm) -> None:
    """``loss_fn=None``: the traced output of ``gm`` (its ``TraceInfo.out_spec`` and the output
    nodes' recorded shapes) must be what the last stage reads as the loss, a scalar tensor or an
    output with a scalar ``.loss`` (or ``["loss"]``). A Hugging Face model has ``.loss`` only when
    traced with ``labels``. Raises :class:`ConfigError` saying what was found and what to pass."""
    info = gm.meta["fxpipe"]
    output = next(n for n in gm.graph.nodes if n.op == "output")
    leaves = [_meta_value(x) for x in pytree.tree_leaves(output.args[0])]
    if any(x is _UNKNOWN for x in leaves):
        return  # a value the trace recorded no shape for: the last stage's own check reports it
    out = info.unflatten_output(leaves)
    if isinstance(out, torch.Tensor):
        if out.dim() == 0:
            return
        found = f"a tensor of shape {list(out.shape)}"
    else:
        loss = getattr(out, "loss", None)
        if loss is None and isinstance(out, dict):
            loss = out.get("loss")
        if isinstance(loss, torch.Tensor) and loss.dim() == 0:
            return
        kind = type(out).__name__
        kind += f" with fields {list(out.keys())}" if isinstance(out, dict) else \
            f" of {len(out)} values" if isinstance(out, (tuple, list)) else ""
        found = f"a {kind}, without a .loss" if loss is None else f"a {kind}, whose .loss is {_show(loss)}"
    labels = (" Or, for a Hugging Face model, pass labels among the example inputs and in every batch: its output "
              "then has .loss." if hasattr(out, "logits") else "")
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor) and out[0].dim() == 0:
        labels = (" Its first value is a scalar: if that is the loss, return a dict with a 'loss' key "
                  "({'loss': loss, 'logits': logits}), which fxpipe reads, or the loss alone.")
    raise ConfigError(
        f"fxpipe.compile: loss_fn=None means the model's output is the loss: expected a scalar tensor or an output "
        f"with a scalar .loss, but {info.model_class} returns {found}. Pass loss_fn=lambda output, target: ... "
        f"(and the target to step()), or make the model return its loss.{labels}"
    )


#: aten ops whose kernels take their tensor operands in ONE dtype (eager refuses "mat1 and mat2
#: must have the same dtype"), while the fake kernels a trace runs promote instead: a graph traced
#: on a float64 example of a float32 model records them as fine. (bmm, baddbmm, addmv, dot and
#: the forward convolutions check dtypes on fake tensors too: a trace fails on them already.)
_SAME_DTYPE_OPS = {"linear", "mm", "addmm", "addbmm", "matmul", "mv",
                   "conv_transpose1d", "conv_transpose2d", "conv_transpose3d"}


def check_operand_dtypes(gm, autocast: torch.dtype | None = None) -> None:
    """The operands of a matrix product or a convolution must share one dtype, as eager PyTorch
    requires; the trace's fake kernels do not check it, so a float64 example of a float32 model
    would trace, plan and build, then fail at the first step on one stage (its peers left
    waiting). ``autocast``: the compute dtype of mixed precision, under which these ops see
    every floating operand but float64 in that dtype (autocast's rule: it never casts float64).
    Reads the top-level graph of ``gm`` (an ``autocast`` block of the model's own code is a
    subgraph, with casts of its own) and raises :class:`ConfigError` at set-up, alike on every
    rank, naming the op, its operands and the example input the odd dtype came from."""
    import torch.fx as fx

    def seen(d: torch.dtype) -> torch.dtype:  # the dtype the op's kernel sees
        return autocast if autocast is not None and d.is_floating_point and d != torch.float64 else d

    for n in gm.graph.nodes:
        op = n.target._schema.name.removeprefix("aten::") if isinstance(n.target, torch._ops.OpOverload) else None
        if n.op != "call_function" or op not in _SAME_DTYPE_OPS:
            continue
        operands = [a for a in pytree.tree_leaves((n.args, n.kwargs))
                    if isinstance(a, fx.Node) and isinstance(a.meta.get("val"), torch.Tensor)]
        if len({seen(a.meta["val"].dtype) for a in operands}) < 2:
            continue
        params = {seen(a.meta["val"].dtype) for a in operands if a.op == "get_attr"}
        want = next(iter(params)) if len(params) == 1 else seen(operands[-1].meta["val"].dtype)
        odd = next(a for a in operands if seen(a.meta["val"].dtype) != want)
        have = odd.meta["val"].dtype
        inputs = _inputs_of(odd)

        def show(a) -> str:
            d = a.meta["val"].dtype
            return f"{a.target if a.op == 'get_attr' else a.name} {_short(d)}" + (
                f" (as {_short(seen(d))} under autocast)" if seen(d) != d else "")

        origin = f", from the example input(s) {inputs}" if inputs else ""
        to = _CASTS.get(torch.float32 if autocast is not None else want, f".to(torch.{_short(want)})")
        fixes = [f"give the inputs the model's dtype (x{to} in the example and in every batch)"]
        if autocast is None:
            fixes.append(f"convert the model to {_short(have)} (model.to(torch.{_short(have)}))")
            if have != torch.float64 and have.is_floating_point and want.is_floating_point:
                fixes.append("train with precision='bf16' or 'fp16', whose autocast casts both operands")
        where = module_path(n) or "the model itself"
        raise ConfigError(
            f"fxpipe.compile: {op} at node {n.name!r} (module {where!r}) needs one dtype for all its operands, as in "
            f"eager PyTorch, but found {', '.join(show(a) for a in operands)}: {odd.name!r} is {_short(have)}{origin}. "
            f"Training would fail at its first step. To fix it, {'; or '.join(fixes)}."
        )


def _short(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _inputs_of(node) -> list[str]:
    """The placeholders (example inputs) whose dtype reaches ``node`` through values of that dtype."""
    import torch.fx as fx

    dtype, seen, todo, found = node.meta["val"].dtype, set(), [node], []
    while todo:
        x = todo.pop()
        if x in seen:
            continue
        seen.add(x)
        if x.op == "placeholder":
            found.append(x.name)
        todo += [a for a in x.all_input_nodes
                 if isinstance(a.meta.get("val"), torch.Tensor) and a.meta["val"].dtype == dtype]
    return sorted(found)


_UNKNOWN = object()


def _meta_value(x):
    """A traced output leaf as a meta tensor of its recorded shape and dtype (constants as they are)."""
    import torch.fx as fx

    if not isinstance(x, fx.Node):
        return x
    info, val = x.meta.get("fxpipe"), x.meta.get("val")
    if info is not None and len(info.outputs) == 1:
        spec = info.outputs[0]
        return torch.empty(spec.shape, dtype=spec.torch_dtype, device="meta")
    if isinstance(val, torch.Tensor):
        return torch.empty(val.shape, dtype=val.dtype, device="meta")
    return _UNKNOWN


# ---------------------------------------------------------------------------------------------
# helpers


def _same_constant(given, traced) -> bool | None:
    """Whether a non-tensor input equals the constant the graph was traced with: values of
    another type differ; values of one type are compared with ``==`` where the type defines
    value equality (numbers, strings, enums, dataclasses); None where it cannot
    tell (an object compared by identity, or an ``==`` that gives no bool): the caller then
    accepts only the traced object itself."""
    if type(given) is not type(traced):
        return False
    if type(given).__eq__ is object.__eq__ and not isinstance(given, enum.Enum):
        return None
    try:
        same = given == traced
    except Exception:  # noqa: BLE001 - an __eq__ that refuses: cannot tell
        return None
    return same if isinstance(same, bool) else None


def _wheres(args: tuple, kwargs: dict, names) -> list[str]:
    """User-facing names of the flat inputs: ``input 'mask'`` (a keyword; ``'mask'[0]`` nested),
    ``input 'x' (positional 0)`` (with the placeholder name when known)."""
    out = []
    for i, (path, _) in enumerate(pytree.tree_flatten_with_path((tuple(args), dict(kwargs)))[0]):
        rest = "".join(str(k) for k in path[2:])
        if path[0].idx == 1:
            out.append(f"input {path[1].key!r}{rest}")
        else:
            label = f"input {names[i]!r} (positional {path[1].idx}{rest})" if names else \
                f"positional input {path[1].idx}{rest}"
            out.append(label)
    return out


def _target_leaves(target):
    """(name, tensor) of every tensor in ``target``: ``target``, ``target[0]``, ``target['y']``."""
    for where, x in zip(_wheres_of(target), pytree.tree_leaves(target)):
        if isinstance(x, torch.Tensor):
            yield where, x


def _target_problem(target, needs_target: bool) -> list[str]:
    """A target missing although ``loss_fn`` takes one, or given although there is no ``loss_fn``
    to take it (either would otherwise surface only in the last stage's forward, mid-step, or not
    at all)."""
    if needs_target and target is None:
        return ["target: expected a target, since loss_fn(output, target) computes the loss, got None; pass the "
                "target of the same samples as the second argument (it is split along dim 0 like the inputs), "
                "or compile with loss_fn=None if the model's output is the loss"]
    if not needs_target and target is not None:
        return [f"target: expected None, since with loss_fn=None the model's output (or its .loss) is the loss "
                f"and nothing reads a target, got a {type(target).__name__}; pass loss_fn=... to compute the loss "
                f"from the output and the target, or leave the target out (a Hugging Face model takes labels "
                f"among its inputs)"]
    return []


def _device_problem(where: str, x: torch.Tensor, device: torch.device) -> list[str]:
    if x.device.type == "cpu" or x.device == device:
        return []
    if device.type == "cpu":
        fix = "pass CPU tensors (.cpu())"
    else:
        fix = f"pass tensors on the CPU or on {device} (fxpipe moves each micro-batch to {device} itself)"
    return [f"{where} is on {x.device}, but the pipeline computes on {device}; {fix}"]


def _recipe(b: int, m: int, w: int) -> str:
    per = f"{b} per micro-batch x {m} micro-batch{'es' if m != 1 else ''}"
    return per + (f" x {w} replicas" if w > 1 else "")


def _split_clause(m: int, w: int) -> str:
    return f" ({m} micro-batches x {w} replicas)" if w > 1 else ""


def _batch_problem(wrong: list, batched: int, m: int, w: int, what: str = "step()") -> str:
    """The batch-size message: what a step needs (b*m*w), what was given, what to do."""
    first, n0 = wrong[0]
    b = first.shape[0]
    whole = len({n for _, n in wrong}) == 1 and len(wrong) == batched  # every input has the same wrong size
    got = f"got {n0}" if whole else "got " + ", ".join(f"{n} in {s.where}" for s, n in wrong)
    head = f"the plan has w = {w} data-parallel replicas: " if w > 1 else ""
    if whole and n0 % (m * w):
        head = (f"the batch has {n0} samples, which does not split into {m * w} equal micro-batches"
                f"{_split_clause(m, w)}; ") + head
    fix = f"The micro-batch size b = {b} is fixed by the traced example"
    if what.startswith("eval_step"):  # evaluation runs in the training step's micro-batches
        return (f"{head}pass {b * m * w} samples ({_recipe(b, m, w)}), {got}. {fix}, and eval_step runs the training "
                f"step's {m * w} micro-batches: evaluate a set of another size in batches of {b * m * w} (the last one "
                f"dropped, or padded with samples the loss ignores).")
    if whole and n0 and n0 % (m * w) == 0:
        k = n0 // (m * w)
        fix += (f"; to train on {n0} samples per step, compile with an example micro-batch of {k} "
                f"sample{'s' if k != 1 else ''}")
    short = (" If it is the shorter last batch of an epoch, build the DataLoader with drop_last=True: every "
             "step trains on the same number of samples." if whole and 0 < n0 < b * m * w else "")
    return f"{head}pass {b * m * w} samples ({_recipe(b, m, w)}), {got}. {fix}.{short}"


def _spec(s: InputSpec) -> str:
    return f"{s.dtype} of shape {list(s.shape)} per micro-batch"


def _show(x) -> str:
    if isinstance(x, torch.Tensor):
        return f"a tensor ({x.dtype}, shape {list(x.shape)})"
    return f"{type(x).__name__} {x!r}"[:120]


def _names(names) -> str:
    return "[" + ", ".join(repr(n) for n in names) + "]"


def _raise(what: str, problems: list[str]):
    if len(problems) == 1:
        raise InputError(f"{what}: {problems[0]}")
    raise InputError(f"{what}: {len(problems)} problems with the batch:\n" + "\n".join(f"  - {p}" for p in problems))
