"""materialize: the values of the parameters and buffers a rank builds, for models on the meta device.

A model built under ``torch.device("meta")`` holds no numbers. :func:`fxpipe.compile` traces it
(as if on the CPU: :func:`fxpipe.trace`), plans, and :func:`fxpipe.codegen.split` allocates only
this rank's stage(s) on its device, empty; a :class:`Materializer` then fills them (canonical
name -> destination tensor), nothing else. Each tensor's value comes from, in this order:

1. ``weights``: a state dict keyed by the ORIGINAL model's names (``model.state_dict()``'s), a
   ``torch.save`` file of one (read memory-mapped, so only the keys the stage needs are read; a
   file of ``{"model": state_dict, ...}`` too), or a checkpoint directory written by
   ``Pipeline.save`` (its ``model.*`` tensors, read by key straight into the stage's buffers).
   :meth:`Materializer.check` compares every key and shape with the model before anything is
   communicated, so a wrong file fails alike on every rank. Values are copied (cast to the
   model's dtype) exactly as ``model.load_state_dict`` would: training is bitwise that of the
   model built and loaded in full.
2. the model's own tensor, where it is not on the meta device (a partly materialised model);
3. the modules' own initialisers, for what is left (everything, without ``weights``; the
   non-persistent buffers, such as rotary ``inv_freq``, with them). Every module that owns such a
   tensor, and every module above it, runs in post-order (children first, as Hugging Face's
   ``initialize_weights`` does): ``module.reset_parameters()`` (or ``_reset_parameters()``) if
   it has one, as its constructor did, then ``owner._init_weights(module)`` where ``owner`` is
   the nearest enclosing module with ``_init_weights`` (a Hugging Face ``PreTrainedModel``).
   Each module runs under its own random stream, seeded from ``(seed, module path)``, with its
   own tensors real (this stage's, or temporary copies of the ones another stage holds), so a
   module's tensors get the same values in every layout (d, w, which stage holds them).

What the initialisers cannot reproduce (docs/design.md, "Models on the meta device"): values set
in a module's ``__init__`` other than through ``reset_parameters`` (``torch.ones`` in a custom
RMSNorm: such a module is rejected unless ``weights`` covers it); an initialiser that writes
into several CHILD modules' tensors held on different stages (only the ones on this rank are
real, so a draw for a tensor held elsewhere is not made here and later draws shift; Hugging
Face's GPT-2 rescales one child tensor per module, which is reproduced); and the numbers of a
model built eagerly (its constructors share one random stream: the per-module streams give other,
equally distributed values). A floating tensor that no initialiser wrote is found (filled with
NaN first) and reported.
"""

from __future__ import annotations

import hashlib
import os
import warnings
from collections.abc import Mapping
from typing import Any, Iterator

import torch
import torch.fx as fx
from torch import nn

from .device import rng_devices, seed as seed_device
from .errors import ConfigError
from .trace import get_attr

__all__ = ["Materializer", "has_meta", "init_seed"]


def has_meta(model: nn.Module) -> bool:
    """Whether any parameter or buffer of ``model`` is on the meta device."""
    return any(t.is_meta for t in (*model.parameters(), *model.buffers()))


def init_seed(seed: int, module_path: str) -> int:
    """The seed of module ``module_path``'s initialiser under ``compile(seed=seed)``."""
    digest = hashlib.sha256(f"{seed}:init:{module_path}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


class Materializer:
    """Fills a built stage's tensors for ``model`` (see the module docstring).

    ``gm`` is ``fxpipe.trace(model, ...)``: its parameters and buffers are the model's own
    objects, which is how a canonical name finds its modules and its state-dict keys."""

    def __init__(self, model: nn.Module, gm: fx.GraphModule, *, weights: Any = None, seed: int = 0,
                 device: torch.device | str = "cpu"):
        self.model = model
        self.gm = gm
        self.seed = seed
        self.device = torch.device(device)
        self.weights = _open(weights) if weights is not None else None
        # id(tensor) -> its keys in model.state_dict() (tied aliases: several; non-persistent: none)
        self.keys: dict[int, list[str]] = {}
        for key, t in model.state_dict(keep_vars=True).items():
            self.keys.setdefault(id(t), []).append(key)
        # id(tensor) -> [(module path, module, attribute)] of every module holding it directly
        self.owners: dict[int, list[tuple[str, nn.Module, str]]] = {}
        for path, mod in model.named_modules(remove_duplicate=False):
            for table in (mod._parameters, mod._buffers):
                for attr, t in table.items():
                    if t is not None:
                        self.owners.setdefault(id(t), []).append((path, mod, attr))

    # ------------------------------------------------------------------ before any communication

    def check(self) -> None:
        """Raise :class:`ConfigError` now if some tensor the graph reads can get no value:
        ``weights`` lacking keys of the model, holding unexpected ones or other shapes, or a meta
        tensor no initialiser covers. Every rank checks the same things, so all raise alike."""
        problems = []
        if self.weights is not None:
            problems += self._check_weights()
        for name, t in _graph_tensors(self.gm):
            if not t.is_meta or self._weights_key(t) is not None:
                continue
            owners = self.owners.get(id(t))
            if not owners:
                problems.append(
                    f"{name!r} is a tensor the traced graph made itself (a constant computed in forward), on the meta "
                    f"device it has no value: register it as a buffer, or build the model on a real device")
            elif not any(self._initialisable(path) for path, _, _ in owners):
                path, mod, attr = owners[0]
                problems.append(
                    f"{name!r} ({type(mod).__name__} at {path or '<root>'!r}, attribute {attr!r}) is on the meta "
                    f"device, not in weights, and neither its module nor an enclosing one has an initialiser "
                    f"(reset_parameters(), or _init_weights(module) as Hugging Face models have)")
        if not problems and self.weights is None:
            self._warn_if_partly_meta()
        if problems:
            more = f" (and {len(problems) - 8} more)" if len(problems) > 8 else ""
            raise ConfigError(
                "fxpipe.compile: cannot materialise the model's tensors: " + "; ".join(problems[:8]) + more
                + ". Pass weights= a state dict (or a torch.save file, or a Pipeline.save checkpoint) of the same "
                  "model with every key of model.state_dict(), or give those modules a reset_parameters().")

    def _warn_if_partly_meta(self) -> None:
        """A model with real parameters beside meta ones (a module left on the meta device by
        mistake, or by a loader that found no values for it): the meta ones get their modules'
        initialisers' random values while the others keep theirs, which may not be what was
        meant. Said once, on every rank alike."""
        # parameters only: a model built under accelerate's init_empty_weights() keeps its
        # buffers (a rotary table, say) real, and that is no mistake
        tensors = list(self.model.parameters())
        meta = [t for t in tensors if t.is_meta]
        if not meta or len(meta) == len(tensors):
            return
        modules = sorted({path or "<root>" for t in meta for path, _, _ in self.owners.get(id(t), [])})
        shown = ", ".join(modules[:6]) + (f" and {len(modules) - 6} more" if len(modules) > 6 else "")
        warnings.warn(
            f"fxpipe.compile: {len(meta)} of the model's {len(tensors)} parameters are on the meta device (in {shown}) and "
            f"the rest are not: the meta ones are filled by their modules' initialisers (random values), the others "
            f"keep theirs. If the meta ones should hold trained values, pass weights= (a state dict, a torch.save "
            f"file or a checkpoint); to initialise every module alike, build the whole model on the meta device",
            RuntimeWarning, stacklevel=4)

    def _check_weights(self) -> list[str]:
        from .checkpoint import fit_problems

        want = {key: str(list(t.shape)) for key, t in self.model.state_dict(keep_vars=True).items()}
        have = {key: str(list(shape)) for key, shape in self.weights.shapes().items()}
        return [f"weights ({self.weights.what}): {p}"
                for p in fit_problems(self.keys.values(), want, want, have)]

    def _initialisable(self, path: str) -> bool:
        parts = path.split(".") if path else []
        chain = [self.model] + [self.model.get_submodule(".".join(parts[: i + 1])) for i in range(len(parts))]
        return any(_init_fn(m) is not None or callable(getattr(m, "_init_weights", None)) for m in chain)

    def _weights_key(self, t: torch.Tensor) -> str | None:
        if self.weights is None:
            return None
        have = self.weights.shapes()
        return next((k for k in self.keys.get(id(t), ()) if k in have), None)

    # ------------------------------------------------------------------ filling

    def fill(self, dest: Mapping[str, torch.Tensor], originals: Mapping[str, torch.Tensor]) -> None:
        """Write the value of every ``dest[name]`` (allocated, uninitialised), whose tensor in the
        model is ``originals[name]``: from the initialisers, the model's real tensors, then the
        weights, each overriding the one before (module docstring)."""
        loaded = {n: k for n in dest if (k := self._weights_key(originals[n])) is not None}
        init = {n for n in dest if n not in loaded and originals[n].is_meta}
        with torch.no_grad():
            if init:
                self._initialise({n: dest[n] for n in init}, originals)
            for n, t in dest.items():
                if n not in loaded and n not in init:
                    t.copy_(originals[n])
            if loaded:
                self.weights.read({loaded[n]: dest[n] for n in loaded})

    def _initialise(self, dest: Mapping[str, torch.Tensor], originals: Mapping[str, torch.Tensor]) -> None:
        wanted: dict[int, torch.Tensor] = {}  # id(original) -> what the modules hold while they initialise
        for n, t in dest.items():
            if t.is_floating_point() or t.is_complex():
                t.fill_(float("nan"))
            elif t.dtype != torch.bool:
                t.fill_(torch.iinfo(t.dtype).max)
            orig = originals[n]
            wanted[id(orig)] = nn.Parameter(t, requires_grad=orig.requires_grad) if isinstance(orig, nn.Parameter) else t
        if any(id(originals[n]) not in self.owners for n in dest):
            name = next(n for n in dest if id(originals[n]) not in self.owners)
            raise ConfigError(f"fxpipe.compile: {name!r} belongs to no module of the model, so no initialiser can "
                              f"give it a value; pass weights= holding it, or build the model on a real device")
        paths = {p for n in dest for p, _, _ in self.owners[id(originals[n])]}
        for p in list(paths):  # every enclosing module too: an initialiser may write its children's tensors
            parts = p.split(".") if p else []
            paths.update(".".join(parts[:i]) for i in range(len(parts)))
        swapped = []
        try:
            for table, attr, t in self._tables():
                if id(t) in wanted:
                    swapped.append((table, attr, t))
                    table[attr] = wanted[id(t)]
            for path, mod, owner in _post_order(self.model, paths):
                self._run(path, mod, owner, wanted)
        finally:
            for table, attr, t in swapped:
                table[attr] = t
        bad = [n for n, t in dest.items() if _unwritten(t)]
        if bad:
            owners = [f"{n} ({type(self.owners[id(originals[n])][0][1]).__name__})" for n in bad[:5]]
            raise ConfigError(
                f"fxpipe.compile: the modules' initialisers left {len(bad)} tensors without a value: {owners}. "
                f"Their modules' reset_parameters()/_init_weights do not set them (set in __init__ only?). Pass "
                f"weights= a state dict holding them, or give those modules a reset_parameters().")

    def _tables(self) -> Iterator[tuple[dict, str, torch.Tensor]]:
        for mod in self.model.modules():
            for table in (mod._parameters, mod._buffers):
                for attr, t in list(table.items()):
                    if t is not None:
                        yield table, attr, t

    def _run(self, path: str, mod: nn.Module, owner: nn.Module | None, wanted: dict[int, torch.Tensor]) -> None:
        """Module ``path``'s initialisers under its own stream, its other direct tensors as temporaries."""
        reset = _init_fn(mod)
        if reset is None and owner is None:
            return
        temporary = []
        real = {id(w) for w in wanted.values()}
        for table in (mod._parameters, mod._buffers):
            for attr, t in list(table.items()):
                if t is not None and id(t) not in real:
                    tmp = torch.empty_like(t, device=self.device)
                    temporary.append((table, attr, t))
                    table[attr] = nn.Parameter(tmp, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else tmp
        try:
            with torch.random.fork_rng(devices=rng_devices(self.device)):
                seed_device(init_seed(self.seed, path), self.device)
                if reset is not None:
                    reset()
                if owner is not None:
                    owner._init_weights(mod)
        finally:
            for table, attr, t in temporary:
                table[attr] = t


def _init_fn(mod: nn.Module):
    """The module's own initialiser: ``reset_parameters`` (torch's convention) or ``_reset_parameters``."""
    for name in ("reset_parameters", "_reset_parameters"):
        fn = getattr(mod, name, None)
        if callable(fn):
            return fn
    return None


def _post_order(model: nn.Module, paths: set[str]) -> Iterator[tuple[str, nn.Module, nn.Module | None]]:
    """(path, module, nearest enclosing module with ``_init_weights`` or None) of the modules in
    ``paths``, children before their parent, children in registration order."""

    def visit(path: str, mod: nn.Module, owner):
        if callable(getattr(mod, "_init_weights", None)):
            owner = mod
        for name, child in mod.named_children():
            sub = f"{path}.{name}" if path else name
            if sub in paths:
                yield from visit(sub, child, owner)
        yield path, mod, owner

    if "" in paths:
        yield from visit("", model, None)


def _unwritten(t: torch.Tensor) -> bool:
    if t.is_floating_point() or t.is_complex():
        return bool(torch.isnan(t).any())
    if t.dtype == torch.bool or t.numel() == 0:
        return False
    return bool((t == torch.iinfo(t.dtype).max).all())


def _graph_tensors(gm: fx.GraphModule) -> list[tuple[str, torch.Tensor]]:
    """Every tensor the graph reads through get_attr (parameters, buffers, constants), by name."""
    out = {}
    for n in gm.graph.nodes:
        if n.op == "get_attr":
            obj = get_attr(gm, n.target)
            if isinstance(obj, torch.Tensor):
                out[n.target] = obj
    for name, t in [*gm.named_parameters(), *gm.named_buffers()]:
        out.setdefault(name, t)
    return list(out.items())


# ---------------------------------------------------------------------------------------------
# weights


class _Dict:
    """A state dict in memory (or a memory-mapped torch.save file)."""

    def __init__(self, sd: Mapping, what: str):
        bad = [k for k, v in sd.items() if not isinstance(k, str) or not isinstance(v, torch.Tensor)]
        if bad:
            raise ConfigError(
                f"fxpipe.compile: weights must map the model's state_dict keys to tensors; {what} has "
                f"{len(bad)} other entries, e.g. {bad[:3]!r}. Pass model.state_dict() (or a torch.save file of it)")
        self.sd, self.what = sd, what

    def shapes(self) -> dict[str, tuple[int, ...]]:
        if not hasattr(self, "_shapes"):
            self._shapes = {k: tuple(v.shape) for k, v in self.sd.items()}
        return self._shapes

    def read(self, dest: Mapping[str, torch.Tensor]) -> None:
        for key, t in dest.items():
            t.copy_(self.sd[key])


class _Checkpoint:
    """The ``model.*`` tensors of a checkpoint directory written by ``Pipeline.save``."""

    def __init__(self, path: str):
        from torch.distributed.checkpoint import FileSystemReader

        from .checkpoint import resolve

        self.path = resolve(path)
        self.what = f"checkpoint {self.path}"
        stored = FileSystemReader(self.path).read_metadata().state_dict_metadata
        self._shapes = {k[len("model."):]: tuple(md.size) for k, md in stored.items()
                        if k.startswith("model.") and hasattr(md, "size")}

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return self._shapes

    def read(self, dest: Mapping[str, torch.Tensor]) -> None:
        import torch.distributed.checkpoint as dcp

        # each rank reads its own keys: no collective (no_dist), straight into the stage's tensors
        box = {"model": {k: t for k, t in dest.items()}}
        dcp.load(box, checkpoint_id=self.path, no_dist=True)


def _open(weights: Any):
    if isinstance(weights, Mapping):
        return _Dict(weights, "the state dict given")
    path = os.fspath(weights)
    if os.path.isdir(path):
        return _Checkpoint(path)
    if not os.path.isfile(path):
        raise ConfigError(f"fxpipe.compile: weights {path!r} does not exist: expected a state dict, a torch.save "
                          f"file of one, or a checkpoint directory written by Pipeline.save")
    try:
        obj = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    except Exception as e:  # noqa: BLE001 - a torn file, another format, or objects weights_only refuses
        lines = [ln for ln in str(e).strip().splitlines() if ln.strip()]
        raise ConfigError(f"fxpipe.compile: weights file {path!r} is not a file torch.save wrote whole "
                          f"({type(e).__name__}: {lines[0] if lines else ''}); pass torch.save(model.state_dict(), "
                          f"path)'s file, a state dict, or a Pipeline.save checkpoint directory") from e
    if isinstance(obj, Mapping) and not all(isinstance(v, torch.Tensor) for v in obj.values()) \
            and isinstance(obj.get("model"), Mapping):
        obj = obj["model"]  # dcp_to_torch_save's file of a Pipeline.save checkpoint
    if not isinstance(obj, Mapping):
        raise ConfigError(f"fxpipe.compile: weights file {path!r} holds a {type(obj).__name__}, expected a state "
                          f"dict (torch.save(model.state_dict(), path))")
    return _Dict(obj, f"file {path}")
