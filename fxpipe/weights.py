"""weights: the one owner of a stage's weights, their versions, gradients and update.

A :class:`WeightStore` holds, for one stage on one rank:

* the **compute versions**: one flat buffer per dtype per live version (two under 2bw: version
  ``v`` lives in slot ``v % 2``; one for 1f1b/gpipe), each with its own leaf views that the
  stage module reads through ``torch.func.functional_call``, so a micro-batch's forward and
  backward see the very tensors autograd saved, and an UPDATE never writes a version in use;
* the **master** copy the optimizer steps. In fp32 training it is the newest compute version
  itself (``UPDATE t`` copies ``W(t-1)`` into the slot of the dead ``W(t-2)`` and steps it
  there). Under ``precision="bf16"``/``"fp16"`` (:mod:`fxpipe.precision`) it is ONE fp32 copy of
  its own, stepped in place, and every compute version is a 16-bit copy the update writes from
  it (the fused kernel writes both in one pass);
* the **gradient accumulators**: one flat buffer per dtype per batch in flight (two when a
  reduction of batch t overlaps batch t+1's backwards), in the master's dtype: 16-bit gradients
  of a mixed-precision stage accumulate in fp32;
* the **update strategy**: ``torch.optim`` (any optimizer, parameter groups by name), the
  fused flat kernels of :mod:`fxpipe.kernels` (one launch per dtype reads ``W(t-1)`` and the
  gradient and writes ``W(t)``), or AdamA (compile's ``accumulate="optimizer"``: each micro-batch's
  gradient is folded into Adam's moments at once, and no gradient accumulator exists).

:func:`weight_bytes` is the memory model of all of it, per tensor: the planner calls it before
any store exists, and a store's :meth:`WeightStore.nbytes` is tested equal to it.
"""

from __future__ import annotations

import functools
import inspect
import warnings
from typing import Callable, Collection, Sequence

import torch
from torch.autograd.graph import get_gradient_edge

from .errors import CheckpointError, ConfigError
from .backward import PendingWeights, SplitCache, backward_input, grads_into
from .precision import Precision, compute_dtype
from .schedule import versions_of

__all__ = ["WeightStore", "weight_bytes"]

_STRUCTURE = ("params", "param_names")  # what a param group holds beside its hyper-parameters


def weight_bytes(numel: int, itemsize: int, *, requires_grad: bool, schedule: str, grad_buffers: int,
                 optimizer_bytes_per_param: float, accumulation: str = "autograd",
                 precision: str = "fp32") -> float:
    """Bytes one parameter tensor costs on each stage holding it.

    Its compute versions (:func:`versions_of`) and ``grad_buffers`` gradient accumulators (the
    gradient buffers share the weights' flat layout, so a frozen tensor has its unused place in
    them too); a trainable tensor also the optimizer state (``optimizer_bytes_per_param`` per
    element: AdamW's two fp32 moments are 8, SGD momentum 4) and, with ``accumulation="fused"``
    or ``"optimizer"`` (AdamA, which passes ``grad_buffers=0``), its place in the kernels'
    per-micro-batch scratch gradient.

    ``precision="bf16"``/``"fp16"``: the versions and the scratch gradient are 2-byte compute
    copies, and one master copy in the tensor's own dtype (``itemsize``) is held beside them;
    the gradient accumulators keep the master's dtype. (Norm weights that keep fp32
    versions and scratch gradient, :func:`fxpipe.precision.fp32_params`, are counted at 2 bytes
    here: two numbers per channel, a rounding error beside any layer's weights.)
    """
    nbytes = numel * itemsize
    low = compute_dtype(precision)
    compute = nbytes if low is None else numel * (torch.finfo(low).bits // 8)
    total = versions_of(schedule) * compute + grad_buffers * nbytes + (0 if low is None else nbytes)
    if requires_grad:
        total += optimizer_bytes_per_param * numel + (compute if accumulation in ("fused", "optimizer") else 0)
    return float(total)


def _made_optimizer(factory: Callable, params: dict[str, torch.nn.Parameter]) -> torch.optim.Optimizer:
    """``factory`` called with one stage's ``(name, parameter)`` pairs, and checked: a factory
    without ``return``, or an optimizer holding tensors it was not given (one built over the
    model's own parameters, which fxpipe does not train), would leave the stage untrained
    without a word. One that steps only some of the pairs, or none (a factory choosing
    parameters by name, none of which this stage holds), leaves the others as they are, as
    ``torch.optim`` does with parameters in no group."""
    names = list(params)
    few = names[:4] + (["..."] if len(names) > 4 else [])
    try:
        made = factory(list(params.items()))
    except Exception as e:
        raise ConfigError(
            f"fxpipe.compile: the optimizer factory raised {type(e).__name__}: {e}, on a stage holding {len(names)} "
            f"trainable parameters {few}. It is called once per stage with that stage's (name, parameter) pairs "
            f"only: take parameters, and group them by name, from the pairs it is given") from e
    if not isinstance(made, torch.optim.Optimizer):
        raise ConfigError(f"fxpipe.compile: the optimizer factory returned {type(made).__name__}, expected a torch.optim."
                          f"Optimizer (a factory without return gives None); pass e.g. "
                          f"functools.partial(torch.optim.AdamW, lr=1e-3)")
    closure = inspect.signature(made.step).parameters.get("closure")
    if closure is not None and closure.default is inspect.Parameter.empty:
        raise ConfigError(
            f"fxpipe.compile: {type(made).__name__}.step needs a closure that re-evaluates the loss, but a pipeline "
            f"steps each stage's optimizer once per batch with the gradients its micro-batches accumulated, and has "
            f"no closure to give it. Use an optimizer that steps on gradients alone (SGD, Adam, AdamW, ...)")
    if isinstance(made, torch.optim.SparseAdam):
        raise ConfigError(
            "fxpipe.compile: SparseAdam takes sparse gradients only, but fxpipe accumulates every weight's gradient "
            "densely (in flat buffers). Use torch.optim.Adam or AdamW")
    given = {id(p) for p in params.values()}
    foreign = sum(1 for g in made.param_groups for p in g["params"] if id(p) not in given)
    if foreign:
        raise ConfigError(
            f"fxpipe.compile: the optimizer the factory returned holds {foreign} tensor(s) that are not among the "
            f"{len(names)} parameters it was given ({few}), which the stage would never update: build it over the "
            f"(name, parameter) pairs the factory receives, not over model.parameters() (fxpipe trains its own "
            f"copies of the weights)")
    return made


class WeightStore:
    """One stage's weights on one rank (module docstring)."""

    def __init__(self, flat, *, schedule: str, grad_buffers: int, optimizer: Callable,
                 lr_scheduler: Callable | None, kernels, device: torch.device, share_initial: bool = True,
                 strict_kernels: bool = False, precision: Precision = Precision(), accumulate: str = "gradients",
                 keep_fp32: Collection[str] = (), shared: Collection[str] = (), dynamic: bool = False):
        self.layout = layout = flat.layout  # the master's (the model's dtypes)
        self.device = device
        self.precision = precision
        precision.check_master(layout)
        n = versions_of(schedule)
        # ``share_initial``: codegen's buffer itself is the first slot (the master under mixed
        # precision): one copy fewer; a second replica of the stage in one process takes its own.
        own = flat.buffers if share_initial else flat.clone_buffers()
        if precision.mixed:
            self.master = own
            # ``keep_fp32`` (norm weights eager autocast leaves fp32, fxpipe.precision.fp32_params): fp32 copies
            self.compute_layout = layout.cast(precision.dtype, keep=keep_fp32)
            self.slots = [self.compute_layout.pack(layout.views(own)) for _ in range(n)]
            self._rounding = _runs(layout, self.compute_layout)
        else:
            self.master = None
            self.compute_layout = layout
            self.slots = [own] + [flat.clone_buffers() for _ in range(n - 1)]
        self.leaves = [self._make_leaves(b) for b in self.slots]
        self.grad_pool = [layout.zeros_like() for _ in range(grad_buffers)]
        self.grad_views = [layout.views(g) for g in self.grad_pool]
        self.updates = 0  # the newest version
        self.unsplit: str | None = None  # zb: why this stage's I runs the whole backward (None: it splits)
        # Trainable parameters the stage's backward never reaches (read only by a comparison, under
        # no_grad, or through .detach()): eager leaves their .grad None, so the optimizer skips
        # them (no weight decay, no momentum). A traced graph reaches the same weights every time:
        # found on the first backward. A ``dynamic`` stage runs opaque leaf modules (compile's
        # leaf_modules), whose Python may take another branch each micro-batch: there a weight is
        # skipped when no micro-batch of the batch reached it (:meth:`unreached_of`), as in eager.
        # A weight whose gradient is summed with another stage's (``shared``: tied) always counts
        # as reached.
        self.unreached: frozenset[str] | None = None
        self.dynamic = dynamic
        self._reached: dict[int, set[str]] = {}  # dynamic: batch -> the weights its backwards reached
        self._trainable = [s.name for s in layout.slots if s.requires_grad]
        self._shared = frozenset(shared)
        self.split_cache = SplitCache()  # zb: the analysis of the stage's autograd graph, done once
        self.optimizer_steps = 0  # updates applied (a skipped non-finite batch applies none)
        # The optimizer's own Parameters: aliases pointed at the slot being written right before
        # each step. They never enter a forward, so re-pointing them is safe. Each alias has its
        # own version counter (never ``leaf.detach()``, which shares the leaf's, so a step would
        # look like an in-place change of a weight autograd saved).
        # Under mixed precision they are the master's views for good.
        self.opt_params: dict[str, torch.nn.Parameter] = {}
        steps_on = layout.views(self.master) if self.master is not None else self.leaves[0]
        for s in layout.slots:
            if s.requires_grad:
                p = torch.nn.Parameter(torch.empty(0, dtype=s.dtype, device=device))
                p.data = steps_on[s.name].detach()
                self.opt_params[s.name] = p
        self.optimizer = _made_optimizer(optimizer, self.opt_params) if self.opt_params else None
        try:
            self.lr_scheduler = lr_scheduler(self.optimizer) if (lr_scheduler and self.optimizer) else None
        except Exception as e:
            raise ConfigError(
                f"fxpipe.compile: the lr_scheduler factory raised {type(e).__name__}: {e}. It is called once per "
                f"stage with that stage's optimizer and must return its scheduler; pass e.g. "
                f"functools.partial(torch.optim.lr_scheduler.StepLR, step_size=100)") from e
        if lr_scheduler and self.optimizer and not callable(getattr(self.lr_scheduler, "step", None)):
            # found here, at set-up, not at the first UPDATE mid-step
            raise ConfigError(f"fxpipe.compile: the lr_scheduler factory returned {type(self.lr_scheduler).__name__}, "
                              f"expected a scheduler with a .step() method (a torch.optim.lr_scheduler.LRScheduler), "
                              f"stepped once per step; pass e.g. lambda optimizer: "
                              f"torch.optim.lr_scheduler.StepLR(optimizer, step_size=100)")
        # The fused kernels where they implement the optimizer; torch.optim otherwise, with the
        # reason in ``fallback`` (``strict_kernels``, i.e. kernels="triton": raise it instead).
        self.fallback: str | None = None
        self.strategy = _TorchOptim(self)
        if accumulate == "optimizer" and self.optimizer is not None:
            from .kernels import KernelError

            if not isinstance(self.optimizer, (torch.optim.Adam, torch.optim.AdamW)):
                raise ConfigError(
                    f"fxpipe.compile: accumulate='optimizer' (AdamA) folds each micro-batch's gradient into Adam's "
                    f"moments, so it needs torch.optim.AdamW, or Adam without weight decay, but the optimizer factory made "
                    f"{type(self.optimizer).__name__}. Train it with accumulate='gradients' (the default)")
            try:
                self.strategy = _AdamA(self, kernels)
            except KernelError as e:
                raise ConfigError(f"fxpipe.compile: accumulate='optimizer' (AdamA) cannot update this stage: {e}. AdamA "
                                  f"runs torch.optim.Adam or AdamW (without amsgrad, maximize or differentiable); "
                                  f"train this optimizer with accumulate='gradients' (the default)") from e
        elif kernels is not None and self.optimizer is not None:
            from .kernels import KernelBackendError, KernelError

            try:
                self.strategy = _Fused(self, kernels)
            except (KernelError, KernelBackendError) as e:  # e.g. no usable Triton on this GPU
                if strict_kernels:
                    raise
                self.fallback = str(e)

    @property
    def path(self) -> str:
        """Which update runs: ``"fused (triton)"``, ``"fused (torch)"``, ``"AdamA (triton)"``,
        ``"AdamA (torch)"`` or ``"torch.optim"``."""
        if isinstance(self.strategy, _AdamA):
            return f"AdamA ({self.strategy.ops.name})"
        return f"fused ({self.strategy.ops.name})" if isinstance(self.strategy, _Fused) else "torch.optim"

    def _make_leaves(self, buffers) -> dict[str, torch.Tensor]:
        views = self.compute_layout.views(buffers)
        for s in self.compute_layout.slots:
            views[s.name].requires_grad_(s.requires_grad)  # frozen parameters stay frozen
        return views

    def slot(self, version: int) -> int:
        return version % len(self.slots)

    def compute(self, version: int) -> dict[str, torch.Tensor]:
        """Name -> leaf of weight ``version`` (what the stage module reads)."""
        return self.leaves[self.slot(version)]

    def grads(self, t: int) -> dict[torch.dtype, torch.Tensor]:
        """The flat gradient buffers accumulating batch ``t`` (with two, batch t-1's may still be
        under reduction while batch t's backwards run)."""
        return self.grad_pool[t % len(self.grad_pool)]

    def grad_views_of(self, t: int) -> dict[str, torch.Tensor]:
        return self.grad_views[t % len(self.grad_pool)]

    def backward(self, t: int, version: int, roots, seeds, boundary: Sequence[torch.Tensor]) -> None:
        """Backpropagate one micro-batch of batch ``t``: weight gradients are added into batch
        t's accumulator, boundary inputs get their ``.grad``."""
        leaves = self.compute(version)
        self._find_unreached(t, leaves, roots)
        self.strategy.backward(t, leaves, roots, seeds, boundary)

    def unreached_of(self, t: int) -> frozenset[str]:
        """The trainable weights no backward of batch ``t`` reached: ``UPDATE t`` skips them."""
        if not self.dynamic:
            return self.unreached or frozenset()
        return frozenset(set(self._trainable) - self._reached.get(t, set()) - self._shared)

    def reached_counts(self, t: int) -> torch.Tensor:
        """A dynamic stage's reached set of batch ``t`` as one float32 per trainable weight (1:
        reached), for the data-parallel all-reduce that makes every replica skip the same weights:
        the set of the whole global batch, as one replica of all its micro-batches would find."""
        got = self._reached.get(t, set())
        return torch.tensor([float(n in got) for n in self._trainable], dtype=torch.float32, device=self.device)

    def adopt_reached(self, t: int, counts: torch.Tensor) -> None:
        """Batch ``t``'s reached set from the replicas' summed :meth:`reached_counts`."""
        self._reached[t] = {n for n, c in zip(self._trainable, counts.tolist()) if c > 0}

    def _find_unreached(self, t: int, leaves: dict[str, torch.Tensor], roots) -> None:
        """The weights the autograd graph below ``roots`` reaches (one walk): :attr:`unreached`
        once, or on a dynamic stage added to batch ``t``'s reached set at every backward."""
        if self.unreached is not None and not self.dynamic:
            return
        names = {id(leaf): n for n, leaf in leaves.items() if leaf.requires_grad}
        reached, seen = set(), set()
        # from each root's gradient edge: a root that is a weight itself (a stage output such as
        # ``w.to(torch.float32)`` of a float32 w, which returns w) has no grad_fn, only its accumulator
        stack = [get_gradient_edge(r).node for r in roots if isinstance(r, torch.Tensor) and r.requires_grad]
        while stack:
            fn = stack.pop()
            if fn is None or fn in seen:
                continue
            seen.add(fn)
            variable = getattr(fn, "variable", None)  # an AccumulateGrad: the leaf it adds into
            if variable is not None and id(variable) in names:
                reached.add(names[id(variable)])
            stack.extend(next_fn for next_fn, _ in fn.next_functions)
        if self.dynamic:
            self._reached.setdefault(t, set()).update(reached)
        else:
            self.unreached = frozenset(set(names.values()) - reached - self._shared)

    def backward_input(self, t: int, version: int, roots, seeds, boundary: Sequence[torch.Tensor], saved=None):
        """zb's ``I``: the boundary inputs get their ``.grad``; returns what :meth:`backward_weight`
        needs for the weight gradients (:mod:`fxpipe.backward`). Where the graph cannot be split
        (:func:`fxpipe.backward.backward_input` says why, kept in :attr:`unsplit`) this runs the
        whole backward, as :meth:`backward`, and returns None. ``saved``: the forward's
        :class:`fxpipe.backward.SavedTensors`, if it ran under their hooks. Where no boundary
        input takes a gradient (the first stage sends none upstream) there is nothing for ``I``
        to compute: the whole backward waits for ``W``, which runs it as :meth:`backward` does,
        into the accumulator in place (no graph walk here, no separate gradients to add there)."""
        leaves = self.compute(version)
        self._find_unreached(t, leaves, roots)
        if roots and not any(x.requires_grad for x in boundary):
            # the roots' graph waits, not the roots: their outputs go now, as after a split I
            held = roots if seeds[0] is None else [get_gradient_edge(r) for r in roots]
            return functools.partial(self.strategy.backward, t, leaves, held, seeds, boundary)
        trainable = {n: leaf for n, leaf in leaves.items() if leaf.requires_grad}
        got = backward_input(roots, seeds, boundary, trainable, saved, self.split_cache) if roots else ([None] * len(boundary), None)
        if isinstance(got, str):
            self.unsplit = got
            self.strategy.backward(t, leaves, roots, seeds, boundary)
            return None
        for x, g in zip(boundary, got[0]):
            x.grad = g
        return got[1]

    def backward_weight(self, t: int, pending) -> None:
        """zb's ``W``: add the weight gradients ``pending`` yields into batch t's accumulator, or
        run the whole backward ``I`` left to it (nothing when ``I`` ran the whole backward)."""
        if isinstance(pending, PendingWeights):
            self.strategy.backward_weight(t, pending)
        elif pending is not None:
            pending()

    def update(self, t: int, coef: torch.Tensor | None, *, skip: bool = False) -> None:
        """``UPDATE t``: write ``W(t)`` from ``W(t-1)`` and batch t's (clipped) gradient into its
        slot, then zero that gradient buffer and step the learning-rate scheduler. ``skip`` (a
        non-finite batch): ``W(t)`` is a copy of ``W(t-1)``; optimizer state, its step count and
        the scheduler stay as they were."""
        grads = self.grads(t) if self.grad_pool else {}  # AdamA keeps none
        src = self.slots[self.slot(max(t - 1, 0))]
        dst = self.slots[self.slot(t)]
        if skip:
            if src is not dst:
                with torch.no_grad():
                    for dt in dst:
                        dst[dt].copy_(src[dt])
            self.strategy.drop(t)
        elif self.optimizer is not None:
            self.optimizer_steps += 1
            self.strategy.update(t, self.optimizer_steps, grads, src, dst, coef)
            if self.lr_scheduler is not None:
                with warnings.catch_warnings():
                    # the fused kernels step the weights without optimizer.step(), which torch's
                    # schedulers take for a scheduler stepped first; the order here is right
                    warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler\.step\(\)` before")
                    self.lr_scheduler.step()
        for g in grads.values():
            g.zero_()
        self._reached.pop(t, None)
        self.updates = t

    def round_into(self, dst: dict[torch.dtype, torch.Tensor]) -> None:
        """Write the master, rounded to the compute dtype, into compute slot ``dst`` (mixed
        precision: the master is one fp32 buffer, :meth:`Precision.check_master`; one copy per
        run of neighbouring parameters of one compute dtype, one in all without fp32 copies)."""
        (master,) = self.master.values()
        for dt, lo, hi, at in self._rounding:
            dst[dt][at:at + hi - lo].copy_(master[lo:hi])

    def newest(self) -> dict[str, torch.Tensor]:
        """Views of the newest weights (after the last UPDATE), detached: the fp32 master under
        mixed precision, what ``state_dict()`` and checkpoints hold."""
        if self.master is not None:
            return self.layout.views(self.master)
        return {n: v.detach() for n, v in self.compute(self.updates).items()}

    def previous(self) -> dict[str, torch.Tensor]:
        """Views of the compute version before the newest (2bw's W(t-1), in the compute dtype:
        a 16-bit copy of a master value that no longer exists), detached."""
        return {n: v.detach() for n, v in self.compute(self.updates - 1).items()}

    def load(self, tensors: dict[str, torch.Tensor], previous: dict[str, torch.Tensor] | None = None,
             newest: int | None = None) -> None:
        """Set the newest weights to ``tensors`` (name -> tensor; the master and its compute
        copy) and, under 2bw, the compute version before it to ``previous`` (default: the same
        values). ``newest``: the version number the newest becomes (a resumed run's step count;
        default: unchanged)."""
        if newest is not None:
            self.updates = newest
        with torch.no_grad():
            if self.master is not None:
                for n, v in self.layout.views(self.master).items():
                    v.copy_(tensors[n])
            for i, slot in enumerate(self.slots):
                src = tensors if i == self.slot(self.updates) or previous is None else previous
                for n, v in self.compute_layout.views(slot).items():
                    v.copy_(src[n])

    # checkpoints: the optimizer's part in torch.optim's own per-parameter format, whichever
    # strategy keeps it, so a checkpoint of one strategy loads into the other.

    def optimizer_state(self) -> dict[str, dict[str, torch.Tensor]]:
        """Trainable parameter -> its optimizer state as ``torch.optim`` keys it (``step``,
        ``exp_avg``, ...); empty before the first update."""
        return self.strategy.per_param_state() if self.optimizer is not None else {}

    def stepped(self) -> list[str]:
        """The trainable parameters in one of the optimizer's param groups, in layout order: the
        ones it steps. A factory may leave a trainable parameter out of every group; it is then
        not stepped, as under ``torch.optim``, and has no optimizer state or hyper-parameters."""
        if self.optimizer is None:
            return []
        grouped = {id(p) for g in self.optimizer.param_groups for p in g["params"]}
        return [n for n, p in self.opt_params.items() if id(p) in grouped]

    def hyperparameters(self) -> dict[str, dict]:
        """Parameter of :meth:`stepped` -> the hyper-parameters of its param group (``lr`` as the
        scheduler left it, ``betas``, ``weight_decay``, ...)."""
        if self.optimizer is None:
            return {}
        names = {id(p): n for n, p in self.opt_params.items()}
        return {names[id(p)]: {k: v for k, v in g.items() if k not in _STRUCTURE}
                for g in self.optimizer.param_groups for p in g["params"]}

    def load_optimizer(self, state: dict[str, dict[str, torch.Tensor]], hyper: dict[str, dict],
                       steps: int | None = None) -> None:
        """Restore :meth:`optimizer_state` and :meth:`hyperparameters` (per parameter of
        :meth:`stepped`; the param groups are the factory's, each must find one set of values
        among its members) and the count of updates applied, ``steps`` (None, from a checkpoint
        that did not save it: the largest ``step`` in ``state``, which SGD does not keep).

        Of the hyper-parameters, those both sides hold are applied. The checkpoint must hold
        every one this optimizer has by default (``optimizer.defaults``): one it lacks means
        another optimizer. Others may be on one side only: a scheduler adds its own to the
        groups (``initial_lr``; ``max_lr``, ``min_lr``, ``base_momentum``, ``max_momentum`` for
        OneCycleLR and CyclicLR), so a run may resume with a scheduler added or removed."""
        if self.optimizer is None:
            return
        names = {id(p): n for n, p in self.opt_params.items()}
        own = set(self.optimizer.defaults)
        for i, g in enumerate(self.optimizer.param_groups):
            members = [names[id(p)] for p in g["params"]]
            if not members:
                continue
            saved = hyper[members[0]]
            lacking = sorted(own - set(saved))
            if lacking:
                raise CheckpointError(
                    f"load: this pipeline's {type(self.optimizer).__name__} has hyper-parameters {lacking} that the "
                    f"checkpoint's param groups lack (they hold {sorted(saved)}): it was trained with another "
                    f"optimizer. Resume with the optimizer the checkpoint was trained with."
                )
            shared = [k for k in g if k not in _STRUCTURE and k in saved]
            values = {n: {k: hyper[n][k] for k in shared} for n in members}
            differ = [n for n in members if values[n] != values[members[0]]]
            if differ:
                raise CheckpointError(
                    f"load: the optimizer's param group {i} holds {members[0]!r} and {differ[0]!r}, whose "
                    f"saved hyper-parameters differ ({values[members[0]]} vs {values[differ[0]]}). Build the "
                    f"param groups the checkpoint was trained with (the same optimizer factory)."
                )
            g.update(values[members[0]])
        self.strategy.load_per_param_state(state)
        if not state:  # nothing stepped these parameters yet: the next update is their first
            self.optimizer_steps = 0
        elif steps is not None:
            self.optimizer_steps = steps
        else:
            self.optimizer_steps = max((int(st["step"]) for st in state.values() if "step" in st), default=0)

    def nbytes(self) -> int:
        """Bytes this store holds: versions, gradient buffers, optimizer state, scratch."""
        total = sum(b.nbytes for slot in self.slots for b in slot.values())
        total += sum(b.nbytes for b in self.master.values()) if self.master is not None else 0
        total += sum(b.nbytes for g in self.grad_pool for b in g.values())
        return total + self.strategy.nbytes()


def _runs(master, compute) -> list[tuple[torch.dtype, int, int, int]]:
    """``(compute dtype, master start, master end, compute start)`` of each run of neighbouring
    parameters that lie next to each other in both layouts (``master`` one buffer)."""
    runs: list[tuple[torch.dtype, int, int, int]] = []
    for m, c in zip(master.slots, compute.slots):
        last = runs[-1] if runs else None
        if last and last[0] == c.dtype and last[2] == m.offset and last[3] + last[2] - last[1] == c.offset:
            runs[-1] = (c.dtype, last[1], m.offset + m.numel, last[3])
        else:
            runs.append((c.dtype, m.offset, m.offset + m.numel, c.offset))
    return runs


class _TorchOptim:
    """``torch.optim``: autograd accumulates into the flat gradient buffer directly (each leaf's
    ``.grad`` is pointed at its view), and UPDATE steps the optimizer on the destination slot."""

    def __init__(self, store: WeightStore):
        self.store = store

    def backward(self, t, leaves, roots, seeds, boundary) -> None:
        if not roots:
            return
        if self.store.master is not None:  # 16-bit gradients, added into the fp32 accumulator
            names = [n for n, leaf in leaves.items() if leaf.requires_grad]
            inputs = [leaves[n] for n in names] + boundary
            grads = torch.autograd.grad(roots, inputs, seeds if seeds[0] is not None else None, allow_unused=True)
            self.accumulate(t, {n: g for n, g in zip(names, grads) if g is not None})
            for x, g in zip(boundary, grads[len(names):]):
                x.grad = g
            return
        views = self.store.grad_views_of(t)
        names = [n for n, leaf in leaves.items() if leaf.requires_grad]
        with grads_into([leaves[n] for n in names], [views[n] for n in names]):
            torch.autograd.backward(roots, seeds if seeds[0] is not None else None)

    def backward_weight(self, t, pending: PendingWeights) -> None:
        """zb's ``W``: autograd adds into the flat gradient buffer directly, as in
        :meth:`backward` (16-bit gradients are added into the fp32 accumulator)."""
        if self.store.master is None:
            pending.run(into=self.store.grad_views_of(t))
        else:
            self.accumulate(t, pending.run())

    def accumulate(self, t, grads: dict[str, torch.Tensor]) -> None:
        """Add one micro-batch's weight gradients (name -> tensor, 16-bit under mixed precision)
        into batch t's fp32 accumulator."""
        views = self.store.grad_views_of(t)
        with torch.no_grad():
            for n, g in grads.items():
                views[n].add_(g)

    def update(self, t, step, grads, src, dst, coef) -> None:
        store = self.store
        if coef is not None:
            for g in grads.values():
                g.mul_(coef)
        if store.master is None and src is not dst:
            for dt in dst:
                dst[dt].copy_(src[dt])
        dst_views = store.layout.views(dst) if store.master is None else None
        gviews = store.grad_views_of(t)
        unreached = store.unreached_of(t)
        for name, p in store.opt_params.items():
            if dst_views is not None:
                p.data = dst_views[name]
            p.grad = None if name in unreached else gviews[name]  # None: skipped, as in eager
        store.optimizer.step()
        for p in store.opt_params.values():
            p.grad = None
        if store.master is not None:  # the new compute version: the stepped master, rounded
            store.round_into(dst)

    def drop(self, t) -> None:
        """Batch t's update is skipped: nothing of it is kept here."""

    def nbytes(self) -> int:
        opt = self.store.optimizer
        if opt is None:
            return 0
        return sum(v.nbytes for state in opt.state.values() for v in state.values() if isinstance(v, torch.Tensor))

    def per_param_state(self) -> dict[str, dict[str, torch.Tensor]]:
        opt = self.store.optimizer
        return {n: dict(opt.state[p]) for n, p in self.store.opt_params.items() if p in opt.state}

    def load_per_param_state(self, state: dict[str, dict[str, torch.Tensor]]) -> None:
        opt = self.store.optimizer
        opt.state.clear()
        on_device = {id(p) for g in opt.param_groups if g.get("fused") or g.get("capturable") for p in g["params"]}
        for n, p in self.store.opt_params.items():
            if n in state:  # torch.optim keeps ``step`` on the CPU (a float32 beside the weight where
                # the group is fused or capturable, as Optimizer.load_state_dict casts it), the rest beside the weight
                opt.state[p] = {k: (v.to(p.device, torch.float32, copy=True) if id(p) in on_device else v.clone())
                                if k == "step" else v.to(p.device, copy=True) for k, v in state[n].items()}


class _Fused:
    """:mod:`fxpipe.kernels`: each micro-batch's weight gradient lands in a flat scratch buffer and
    one accumulate launch per dtype folds it in (the first of a batch overwrites); UPDATE is one
    fused launch per *segment*: a run of neighbouring parameters of one dtype and one param group
    (one segment per dtype without groups), with that group's hyper-parameters. Frozen parameters
    lie in no segment, so nothing (not even weight decay) touches them. The torch.optim object
    only holds the hyper-parameters (its groups' lr follow the user's scheduler); the state is
    flat fp32. Raises ``KernelError`` for what the kernels do not implement."""

    def __init__(self, store: WeightStore, kernels):
        from .kernels import KernelError, init_state, ops
        from .kernels.errors import FLOAT_DTYPES, REFERENCE_DTYPES

        self.store = store
        layout = store.layout
        self.ops = ops(store.device, force=kernels)
        opt = store.optimizer
        specs = self.specs()
        kept = {spec.state_names for spec in specs}
        if len(kept) > 1:
            raise KernelError(f"the param groups keep different optimizer state ({' / '.join(map(str, sorted(kept)))}: "
                              f"SGD with momentum in some groups only); the fused update keeps one set of flat "
                              f"state buffers for a stage")
        self.state_names = specs[0].state_names
        self._group_of = {id(p): i for i, g in enumerate(opt.param_groups) for p in g["params"]}
        self._segments_skip: frozenset[str] | None = None
        self._segments: list[tuple[torch.dtype, int, int, int]] = []
        # the Triton kernels take float32, bfloat16 and float16; their torch math float64 too
        allowed = REFERENCE_DTYPES if self.ops.name == "torch" else FLOAT_DTYPES
        unsupported = [dt for dt, _ in layout.sizes if dt not in allowed]
        if unsupported:
            raise KernelError(f"the {self.ops.name} kernels update {', '.join(str(d) for d in allowed)} weights, "
                              f"this stage holds {', '.join(map(str, unsupported))}")
        self.state = {dt: init_state(specs[0], n, store.device, weights=dt) for dt, n in layout.sizes}
        self.scratch = store.compute_layout.zeros_like()  # one micro-batch's gradient, flat, compute dtypes
        self.scratch_views = store.compute_layout.views(self.scratch)
        # mixed precision: where each run of the master (one fp32 buffer) lies in the scratch (one
        # run, unless norms' fp32 copies lie among the 16-bit ones: fxpipe.precision.fp32_params)
        self.runs = store._rounding if store.master is not None else None
        # the new weights' compute copy in the update's own pass where it is one 16-bit buffer laid
        # out as the master; else the update rounds the master into it after (WeightStore.round_into)
        self.one_pass = self.runs is not None and len(self.runs) == 1
        self.names = [s.name for s in layout.slots if s.requires_grad]
        self.accumulated: dict[int, int] = {}  # batch -> micro-batches folded in so far

    def segments(self, t: int) -> list[tuple[torch.dtype, int, int, int]]:
        """``(dtype, start, end, group)`` runs of neighbouring parameters of one dtype and param
        group: what one launch updates for batch ``t``. Left out: a trainable parameter the
        factory put in no group, and one no backward of the batch reached
        (:meth:`WeightStore.unreached_of`), which torch.optim skips too."""
        skip = self.store.unreached_of(t)
        if skip != self._segments_skip:
            self._segments_skip, self._segments = skip, []
            for s in self.store.layout.slots:
                p = self.store.opt_params.get(s.name)
                g = self._group_of.get(id(p)) if p is not None and s.name not in skip else None
                if g is None:
                    continue
                last = self._segments[-1] if self._segments else None
                if last and (last[0], last[2], last[3]) == (s.dtype, s.offset, g):
                    self._segments[-1] = (s.dtype, last[1], s.offset + s.numel, g)
                else:
                    self._segments.append((s.dtype, s.offset, s.offset + s.numel, g))
        return self._segments

    def specs(self) -> list:
        """Each param group's hyper-parameters as they are now, read at every use: a scheduler
        may change any of them, not only the lr (OneCycleLR and CyclicLR cycle Adam's beta1 and
        SGD's momentum)."""
        from .kernels import OptimizerSpec

        opt = self.store.optimizer
        return [OptimizerSpec.from_group(opt, g) for g in opt.param_groups]

    def _state(self, spec, dt: torch.dtype, lo: int, hi: int) -> dict[str, torch.Tensor]:
        """The slice ``[lo, hi)`` of the flat state of dtype ``dt`` that ``spec`` updates."""
        from .kernels import KernelError

        missing = [k for k in spec.state_names if k not in self.state[dt]]
        if missing:
            raise KernelError(f"the fused update needs optimizer state {missing} that this stage does not keep (a "
                              f"scheduler turned SGD's momentum on from 0); compile with kernels='off' to step "
                              f"with torch.optim")
        return {k: self.state[dt][k][lo:hi] for k in spec.state_names}

    def backward(self, t, leaves, roots, seeds, boundary) -> None:
        params = [leaves[n] for n in self.names]
        inputs = params + [x for x in boundary if x.requires_grad]
        grads = (torch.autograd.grad(roots, inputs, seeds if seeds[0] is not None else None, allow_unused=True)
                 if roots else [None] * len(inputs))
        self.accumulate(t, dict(zip(self.names, grads)))
        for x, g in zip([x for x in boundary if x.requires_grad], grads[len(params):]):
            x.grad = g

    def backward_weight(self, t, pending: PendingWeights) -> None:
        """zb's ``W``: its gradients go through the scratch buffer, as :meth:`backward`'s do."""
        self.accumulate(t, pending.run())

    def accumulate(self, t, grads: dict[str, torch.Tensor | None]) -> None:
        """Fold one micro-batch's weight gradients (name -> tensor; absent or None: zero) into
        batch t's accumulator (AdamA: into the moments), through the flat scratch buffer."""
        with torch.no_grad():
            for name in self.names:
                g = grads.get(name)
                if g is None:
                    self.scratch_views[name].zero_()
                else:
                    self.scratch_views[name].copy_(g)
            self._fold(t, first=self.accumulated.get(t, 0) == 0)
        self.accumulated[t] = self.accumulated.get(t, 0) + 1

    def _fold(self, t: int, first: bool) -> None:
        """Add the micro-batch's scratch gradient into batch t's accumulator (the first one
        overwrites it)."""
        acc = self.store.grads(t)  # the master's dtypes, in the same order as the compute ones
        if self.runs is None:
            for a, buf in zip(acc.values(), self.scratch.values()):
                self.ops.accumulate(a, buf, 1.0, overwrite=first)
            return
        (a,) = acc.values()
        for dt, lo, hi, at in self.runs:
            self.ops.accumulate(a[lo:hi], self.scratch[dt][at:at + hi - lo], 1.0, overwrite=first)

    def _grad_pieces(self, dt: torch.dtype, lo: int, hi: int):
        """The scratch gradient of the master's ``[lo, hi)`` of dtype ``dt``, as ``(start, end,
        slice)`` pieces: one per run of compute dtype it crosses (one where the layouts agree)."""
        if self.runs is None:
            yield lo, hi, self.scratch[dt][lo:hi]
            return
        for cdt, a, b, at in self.runs:
            start, end = max(a, lo), min(b, hi)
            if start < end:
                yield start, end, self.scratch[cdt][at + start - a:at + end - a]

    def update(self, t, step, grads, src, dst, coef) -> None:
        store = self.store
        specs = self.specs()
        low = store.precision.dtype
        with torch.no_grad():
            for dt, lo, hi, g in self.segments(t):
                state = self._state(specs[g], dt, lo, hi)
                if store.master is None:  # W(t-1) in src -> W(t) in dst
                    self.ops.update(specs[g], step, grads[dt][lo:hi], src[dt][lo:hi], dst[dt][lo:hi], state,
                                    clip=coef)
                else:  # the master in place, and its rounded copy into dst, in one pass
                    w = store.master[dt][lo:hi]
                    self.ops.update(specs[g], step, grads[dt][lo:hi], w, w, state, clip=coef,
                                    copy=dst[low][lo:hi] if self.one_pass else None)
            if store.master is not None and not self.one_pass:
                store.round_into(dst)
        self.drop(t)

    def drop(self, t) -> None:
        self.accumulated.pop(t, None)

    def nbytes(self) -> int:
        return (sum(v.nbytes for st in self.state.values() for v in st.values())
                + sum(b.nbytes for b in self.scratch.values()))

    def _views(self) -> dict[str, dict[str, torch.Tensor]]:
        """Stepped parameter -> state name -> its slice of the flat state, shaped like it."""
        stepped = set(self.store.stepped())  # a parameter in no group has no state, as under torch.optim
        return {s.name: {k: self.state[s.dtype][k][s.offset:s.offset + s.numel].view(s.shape)
                         for k in self.state_names}
                for s in self.store.layout.slots if s.name in stepped}

    def per_param_state(self) -> dict[str, dict[str, torch.Tensor]]:
        steps = self.store.optimizer_steps
        if steps == 0:
            return {}
        step = torch.tensor(float(steps))  # torch.optim's format: a float32 CPU scalar
        return {n: {"step": step, **views} for n, views in self._views().items()}

    def load_per_param_state(self, state: dict[str, dict[str, torch.Tensor]]) -> None:
        with torch.no_grad():
            for n, views in self._views().items():
                for k, v in views.items():
                    if n in state:
                        v.copy_(state[n][k])
                    else:
                        v.zero_()


class _AdamA(_Fused):
    """AdamA (Zhang et al., :mod:`fxpipe.kernels.adama`): each micro-batch's gradient lands in the
    flat scratch buffer and is folded into Adam's moments at once (the first micro-batch of a
    batch decays them), so the store keeps no gradient accumulator; UPDATE steps the weights from
    the moments. Exact only where each micro-batch's gradient is complete on this stage: the
    pipeline allows it with one replica, no tied weight across stages and no clipping (the whole
    batch gradient never exists). A non-finite gradient is flagged per batch
    (:meth:`nonfinite`); it is in the moments already, so it cannot be skipped."""

    def __init__(self, store: WeightStore, kernels):
        super().__init__(store, kernels)
        from .kernels import KernelError
        from .kernels.errors import FLOAT_DTYPES
        from .kernels.reference import check_adama_spec

        for spec in self.specs():
            check_adama_spec("AdamA", spec)
        other = [str(dt) for dt, _ in store.layout.sizes if dt not in FLOAT_DTYPES]
        if other:  # the fused update's torch math takes float64; AdamA's kernels and references do not
            raise KernelError(f"AdamA folds float32, bfloat16 and float16 weights' gradients into the moments; this "
                              f"stage holds {', '.join(other)} weights. Build the model in float32")
        self.finite: dict[int, torch.Tensor] = {}  # batch -> all its gradients finite so far (device bool)

    def _fold(self, t: int, first: bool) -> None:
        """Fold the micro-batch's scratch gradient into Adam's moments (the first micro-batch of
        batch t decays them first), and note whether it was finite."""
        scratch = list(self.scratch.values())
        specs = self.specs()
        for dt, lo, hi, group in self.segments(t):
            for start, end, g in self._grad_pieces(dt, lo, hi):
                self.ops.adama_accumulate(specs[group], g, self._state(specs[group], dt, start, end), scale=1.0,
                                          first=first)
        ok = torch.stack([torch.isfinite(b).all() for b in scratch]).all() if scratch else torch.tensor(True)
        self.finite[t] = ok if first else self.finite[t] & ok

    def update(self, t, step, grads, src, dst, coef) -> None:
        store = self.store
        specs = self.specs()
        with torch.no_grad():
            for dt, lo, hi, g in self.segments(t):
                state = self._state(specs[g], dt, lo, hi)
                if store.master is None:
                    self.ops.adama_update(specs[g], step, src[dt][lo:hi], dst[dt][lo:hi], state)
                else:
                    w = store.master[dt][lo:hi]
                    self.ops.adama_update(specs[g], step, w, w, state)
            if store.master is not None:
                store.round_into(dst)
        self.drop(t)

    def nonfinite(self, t: int) -> torch.Tensor:
        """0.0, or NaN if a gradient of batch t was not finite (float64, on the device; no sync)."""
        ok = self.finite.pop(t, torch.tensor(True))
        return torch.where(ok, 0.0, float("nan")).to(torch.float64)
