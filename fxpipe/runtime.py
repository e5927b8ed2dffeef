"""runtime: one rank's interpreter of its schedule action list.

A :class:`StageWorker` owns one pipeline stage (the generated module, its weight versions,
its gradient accumulator, its optimizer) and executes the actions of :mod:`fxpipe.schedule`
one at a time through a :class:`~fxpipe.comm.Comm`. It never decides *what* to do next: the
list does. It only checks, for each action, whether the data it needs has arrived
(:meth:`StageWorker.ready`), so the same worker runs one-per-process under ``torchrun`` and
all-in-one-process in the debugging mode, where a driver interleaves the workers.

Weight versions (docs/design.md, "Weight-update semantics"): version ``v`` lives in slot ``v % 2``
of a pair of flat buffers per dtype (one slot for 1f1b/gpipe). Each slot has its own leaf
tensors (views of the flat buffer) that the stage module reads through
``torch.func.functional_call``, so a micro-batch's forward and backward see the very tensors
autograd saved, and an UPDATE never touches a version that is still in use: ``UPDATE t``
copies ``W(t-1)`` into the slot of the dead ``W(t-2)`` and steps the optimizer there.

Gradients of micro-batch ``k`` accumulate (loss scaled by ``1/(m·w)``) into the flat gradient
buffer of batch ``t(k)``. A stage with reductions (data parallel, tied weights, global norm)
rotates two such buffers, so a batch's gradients are reduced while the next batch's backwards
run; otherwise one suffices. The reductions never touch the same memory at once: the data-
parallel all-reduce sums every gradient but those of tied weights, whose copies on all stages of
all replicas are summed by their own all-reduce; the norm waits for both.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
from torch.func import functional_call

from .comm import Comm, Handle
from .device import rng_devices, seed
from .schedule import Action, Kind, waits_for

__all__ = ["StageWorker", "WorkerConfig", "compute_loss"]


@dataclass
class WorkerConfig:
    """What a worker needs beyond its stage: the schedule's numbers and the user's callables."""

    schedule: str
    stages: int  # d
    width: int  # w
    microbatches: int  # m
    recompute: bool
    loss_fn: Callable | None
    optimizer: Callable  # factory: list[(name, Parameter)] -> torch.optim.Optimizer
    lr_scheduler: Callable | None = None
    max_grad_norm: float | None = None
    seed: int = 0
    kernels: Any = None  # fxpipe.kernels backend seam, or None for plain torch.optim
    tied_groups: dict[str, str] = field(default_factory=dict)  # param name -> comm group name
    tied_owner: dict[str, bool] = field(default_factory=dict)  # param name -> counted in the norm here


class StageWorker:
    """Executes one rank's actions for one stage (see module docstring)."""

    def __init__(self, stage, cfg: WorkerConfig, comm: Comm, *, rank: int, replica: int, trace_info, device=None):
        self.stage = stage
        self.cfg = cfg
        self.comm = comm
        self.rank = rank
        self.replica = replica
        self.index = stage.index
        self.trace_info = trace_info
        self.device = device or torch.device("cpu")
        d = cfg.stages
        self.prev = rank - 1 if self.index > 0 else None
        self.next = rank + 1 if self.index < d - 1 else None
        self.is_last = self.index == d - 1

        layout = stage.flat.layout
        self.layout = layout
        slots = 2 if cfg.schedule == "2bw" else 1
        # In one process the replicas of a stage share its generated module: each worker owns
        # its weights and module buffers (BatchNorm statistics), as a rank of its own would.
        own = [stage.flat.buffers] if replica == 0 else []
        self.slots = own + [stage.flat.clone_buffers() for _ in range(slots - len(own))]
        self.buffers = {n: b.detach().clone() for n, b in stage.module.named_buffers()}
        # Leaves per slot: the tensors autograd sees. One set per slot, created once.
        self.leaves = [self._make_leaves(b) for b in self.slots]
        # A stage with reductions to overlap (data parallel, tied weights, clipping) keeps two
        # gradient buffers: batch t's is reduced while batch t+1 accumulates into the other.
        # Without, UPDATE t runs before batch t+1's first backward and one buffer suffices.
        reduces = cfg.width > 1 or bool(cfg.tied_groups) or cfg.max_grad_norm is not None
        self.grad_pool = [layout.zeros_like() for _ in range(2 if reduces else 1)]
        self._grad_views = [layout.views(g) for g in self.grad_pool]
        self.dp_ranges = self._dp_ranges() if cfg.width > 1 else []

        # The optimizer's own Parameters: aliases that are pointed at the slot being written
        # right before each step. They never enter a forward, so re-pointing them is safe.
        # Each alias gets its own version counter (never ``leaf.detach()``, which would share
        # the leaf's, so an optimizer step would look like an in-place change of a saved weight).
        self.opt_params = {}
        for s in layout.slots:
            if s.requires_grad:
                p = torch.nn.Parameter(torch.empty(0, dtype=s.dtype, device=self.device))
                p.data = self.leaves[0][s.name].detach()
                self.opt_params[s.name] = p
        self.optimizer = cfg.optimizer(list(self.opt_params.items())) if self.opt_params else None
        self.lr_scheduler = cfg.lr_scheduler(self.optimizer) if (cfg.lr_scheduler and self.optimizer) else None
        self.updates = 0
        # The fused path (fxpipe.kernels): gradients reach the flat accumulator through one
        # accumulate launch per micro-batch, and UPDATE is one fused launch per dtype writing
        # the new version into the other slot. The torch.optim object then only holds the
        # hyper-parameters (its lr follows the user's scheduler); the state is flat fp32.
        self.kops = None
        if cfg.kernels is not None and self.optimizer is not None:
            from .kernels import OptimizerSpec, init_state, ops

            self.kops = ops(self.device, force=cfg.kernels)
            self.kspec = OptimizerSpec.from_torch(self.optimizer)
            self.kstate = {dt: init_state(self.kspec, n, self.device) for dt, n in layout.sizes}
            self.scratch = layout.zeros_like()  # one micro-batch's gradient, flat
            self._scratch_views = layout.views(self.scratch)
            self._grad_leaves = [s.name for s in layout.slots if s.requires_grad]
            self._accumulated: dict[int, int] = {}  # batch -> micro-batches folded in so far

        # per micro-batch state
        self.inputs: dict[int, dict[str, torch.Tensor]] = {}  # model inputs of micro-batch k
        self.targets: dict[int, Any] = {}
        self.recv_act: dict[int, tuple[list[torch.Tensor], Handle]] = {}
        self.recv_grad: dict[int, tuple[list[torch.Tensor], Handle]] = {}
        self.ctx: dict[int, dict] = {}
        self.sends: deque[Handle] = deque()  # posted sends, oldest first
        self.reductions: dict[tuple[Kind, int], Handle] = {}
        self.norm_sq: dict[int, torch.Tensor] = {}
        self.clip_coef: dict[int, torch.Tensor] = {}  # batch -> 0-dim factor on the device
        self.losses: dict[int, torch.Tensor] = {}
        # eval_step: the eval-mode stage, the weights it reads and the loss summed on the last stage
        self.eval_stage = None
        self.eval_weights: dict[str, torch.Tensor] = {}
        self.eval_loss = torch.zeros((), dtype=torch.float64, device=self.device)
        self.input_specs = list(stage.input_specs)
        self._written_args = _written_args(stage.module)
        self.output_specs = list(stage.output_specs)
        # Gradients flow through floating-point boundary values only; both ends agree from specs.
        self.float_out = [s is not None and s.torch_dtype.is_floating_point for s in self.output_specs]
        self.float_in = [s.torch_dtype.is_floating_point for s in self.input_specs]

    # ------------------------------------------------------------------ helpers

    def _make_leaves(self, buffers) -> dict[str, torch.Tensor]:
        views = self.layout.views(buffers)
        for s in self.layout.slots:
            views[s.name].requires_grad_(s.requires_grad)  # frozen parameters stay frozen
        return views

    def _slot(self, version: int) -> int:
        return version % len(self.slots)

    def _grads_slot(self, t: int) -> int:
        """Which flat gradient buffer accumulates batch ``t`` (with two, batch t-1's may still be
        under reduction while batch t's backwards run)."""
        return t % len(self.grad_pool)

    def _batch(self, k: int) -> int:
        return (k - 1) // self.cfg.microbatches + 1

    @contextlib.contextmanager
    def _rng(self, k: int):
        """Dropout and other randomness: one stream per (seed, micro-batch, stage), so the same
        numbers come out in one process, in many, and when a forward is recomputed."""
        digest = hashlib.sha256(f"{self.cfg.seed}:{k}:{self.index}".encode()).digest()
        with torch.random.fork_rng(devices=rng_devices(self.device)):
            seed(int.from_bytes(digest[:8], "little") & ((1 << 63) - 1), self.device)
            yield

    def _run_module(self, k: int, version: int, args: Sequence[torch.Tensor], buffers=None):
        """The stage's forward on weight ``version`` and this worker's buffers, or ``buffers``
        (name -> tensor; a recomputation reads private copies of what its forward saw)."""
        tensors = {**self.leaves[self._slot(version)], **(self.buffers if buffers is None else buffers)}
        # An argument the stage writes in place (``x += residual`` right after a cut) is passed
        # as a copy: the boundary leaf autograd differentiates to, and the inputs a recomputation
        # reads again, must stay as they arrived.
        args = [x.clone() if i in self._written_args else x for i, x in enumerate(args)]
        with self._rng(k):
            out = functional_call(self.stage.module, tensors, tuple(args))
        return tuple(out)

    def _loss(self, k: int, outputs: Sequence[torch.Tensor], *, last_use: bool) -> torch.Tensor:
        target = (self.targets.pop if last_use else self.targets.get)(k, None)
        return compute_loss(self.trace_info, self.cfg.loss_fn, outputs, target)

    # ------------------------------------------------------------------ readiness

    def ready(self, a: Action) -> bool:
        """Whether ``a`` can run now without waiting: the one action it consumes
        (:func:`fxpipe.schedule.waits_for`) has completed. Always true across processes, where
        waiting is what the rank should do."""
        need = waits_for(a, self.cfg.stages)
        if need is None:
            return True
        if need.kind is Kind.RECV_ACT:
            return self.recv_act[need.index][1].ready()
        if need.kind is Kind.RECV_GRAD:
            return self.recv_grad[need.index][1].ready()
        return self.reductions[need.kind, need.index].ready()

    # ------------------------------------------------------------------ execution

    def run(self, a: Action) -> None:
        getattr(self, "_do_" + a.kind.value.lower())(a)

    def _do_end_step(self, a: Action) -> None:
        """The step's segment ends here; the driver returns to the caller."""

    def _do_recv_act(self, a: Action) -> None:
        specs = self.input_specs if self.eval_stage is None else self.eval_stage.input_specs
        bufs = [torch.empty(s.shape, dtype=s.torch_dtype, device=self.device) for s in specs]
        self.recv_act[a.index] = (bufs, self.comm.irecv(bufs, self.prev, str(a)))

    def _do_recv_grad(self, a: Action) -> None:
        bufs = [
            torch.empty(s.shape, dtype=s.torch_dtype, device=self.device)
            for s, f in zip(self.output_specs, self.float_out)
            if f
        ]
        self.recv_grad[a.index] = (bufs, self.comm.irecv(bufs, self.next, str(a)))

    def _forward_inputs(self, k: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """(module args, boundary leaves) for micro-batch ``k``."""
        model_in = [self.inputs[k][name] for name in self.stage.model_inputs]
        boundary: list[torch.Tensor] = []
        if k in self.recv_act:
            bufs, h = self.recv_act.pop(k)
            h.wait()
            for t, f in zip(bufs, self.float_in):
                boundary.append(t.requires_grad_(True) if f else t)
        return model_in + boundary, boundary

    def _do_f(self, a: Action) -> None:
        k = a.index
        args, boundary = self._forward_inputs(k)
        del self.inputs[k]
        recompute = self.cfg.recompute
        buffers = {n: b.clone() for n, b in self.buffers.items()} if recompute else None
        with torch.no_grad() if recompute else contextlib.nullcontext():
            outputs = self._run_module(k, a.version, args)
            loss = self._loss(k, outputs, last_use=not recompute) if self.is_last else None
        if recompute:
            # Keep only the inputs; R recomputes the rest right before B (arXiv 2006.09503 §3.3),
            # from the buffer values this forward saw (saved before it ran: it may update them).
            ctx = {"args": [x.detach() for x in args], "outputs": outputs, "buffers": buffers}
        else:
            ctx = {"boundary": boundary, "outputs": outputs, "loss": loss}
        if loss is not None:
            self.losses[k] = loss.detach()  # a tensor: reading it here would wait for the device
        self.ctx[k] = ctx

    def _do_r(self, a: Action) -> None:
        """Recompute micro-batch k's forward with autograd on, from its saved inputs, with the
        same random numbers and on private copies of the buffer values its forward saw: the
        module's buffers were updated once, by F k (BatchNorm statistics, in micro-batch order
        as in eager training), and no tensor autograd saved is written in place."""
        k = a.index
        ctx = self.ctx[k]
        n_model = len(self.stage.model_inputs)
        args = ctx.pop("args")
        boundary = [x.requires_grad_(True) if f else x for x, f in zip(args[n_model:], self.float_in)]
        outputs = self._run_module(k, a.version, args[:n_model] + boundary, buffers=ctx.pop("buffers"))
        ctx.update(boundary=boundary, outputs=outputs)
        if self.is_last:
            ctx["loss"] = self._loss(k, outputs, last_use=True)

    def _do_b(self, a: Action) -> None:
        k = a.index
        ctx = self.ctx.pop(k)
        if self.is_last:
            roots = [ctx["loss"] / (self.cfg.microbatches * self.cfg.width)]
            seeds = [None]
        else:
            bufs, h = self.recv_grad.pop(k)
            h.wait()
            outs = [o for o, f in zip(ctx["outputs"], self.float_out) if f]
            pairs = [(o, g) for o, g in zip(outs, bufs) if o.requires_grad]
            roots, seeds = [o for o, _ in pairs], [g for _, g in pairs]
        leaves = self.leaves[self._slot(a.version)]
        boundary = [x for x, f in zip(ctx["boundary"], self.float_in) if f]
        if self.kops is not None:
            self._backward_fused(self._batch(k), roots, seeds, leaves, boundary)
        elif roots:
            # Autograd accumulates in place into an existing .grad: point the leaves at this
            # batch's flat gradient buffer, so the m micro-batches sum there.
            views = self._grad_views[self._grads_slot(self._batch(k))]
            for name, leaf in leaves.items():
                if leaf.requires_grad:
                    leaf.grad = views[name]
            torch.autograd.backward(roots, seeds if seeds[0] is not None else None)
            for leaf in leaves.values():
                leaf.grad = None
        # A boundary input that did not influence the outputs still gets a (zero) gradient, so
        # both sides of the channel always exchange the same tensors.
        self._input_grads = [x.grad if x.grad is not None else torch.zeros_like(x) for x in boundary]

    def _backward_fused(self, t: int, roots, seeds, leaves, boundary) -> None:
        """Kernel path: this micro-batch's weight gradients into the flat scratch buffer, then
        one fused ``acc (+)= g`` per dtype (the first micro-batch of a batch overwrites)."""
        params = [leaves[n] for n in self._grad_leaves]
        inputs = params + [x for x in boundary if x.requires_grad]
        grads = (
            torch.autograd.grad(roots, inputs, seeds if seeds[0] is not None else None, allow_unused=True)
            if roots
            else [None] * len(inputs)
        )
        with torch.no_grad():
            for name, g in zip(self._grad_leaves, grads):
                if g is None:
                    self._scratch_views[name].zero_()
                else:
                    self._scratch_views[name].copy_(g)
            first = self._accumulated.get(t, 0) == 0
            acc = self.grad_pool[self._grads_slot(t)]
            for dt, buf in self.scratch.items():
                self.kops.accumulate(acc[dt], buf, 1.0, overwrite=first)
        self._accumulated[t] = self._accumulated.get(t, 0) + 1
        for x, g in zip([x for x in boundary if x.requires_grad], grads[len(params):]):
            x.grad = g

    def _do_send_act(self, a: Action) -> None:
        ctx = self.ctx[a.index] if self.eval_stage is None else self.ctx.pop(a.index)
        self._post_send([o.detach() for o in ctx["outputs"]], self.next, a)

    def _do_eval(self, a: Action) -> None:
        """Forward-only pass of micro-batch k through the eval-mode stage (``eval_step``)."""
        k = a.index
        stage = self.eval_stage
        args = [self.inputs[k][name] for name in stage.model_inputs]
        if k in self.recv_act:
            bufs, h = self.recv_act.pop(k)
            h.wait()
            args += bufs
        del self.inputs[k]
        with torch.no_grad():
            outputs = tuple(functional_call(stage.module, self.eval_weights, tuple(args)))
            if self.is_last:
                self.eval_loss += self._loss(k, outputs, last_use=True).double()
            else:
                self.ctx[k] = {"outputs": outputs}

    def _do_send_grad(self, a: Action) -> None:
        self._post_send(self._input_grads, self.prev, a)
        self._input_grads = None

    def _post_send(self, tensors, peer, a: Action) -> None:
        # Keep the tensors alive until their send completed; forget the finished ones without
        # waiting (a send never blocks the list: the schedule says when its peer receives).
        while self.sends and self.sends[0].ready():
            self.sends.popleft()
        self.sends.append(self.comm.isend(tensors, peer, str(a)))

    def drain_sends(self) -> None:
        for h in self.sends:
            h.wait()
        self.sends.clear()

    # reductions ------------------------------------------------------------

    def _dp_ranges(self) -> list[tuple[torch.dtype, int, int]]:
        """(dtype, start, end) runs of the flat gradient buffers that the data-parallel
        all-reduce sums: everything but tied weights, whose own all-reduce spans the replicas."""
        runs = []
        for dt, n in sorted(self.layout.sizes, key=lambda kv: str(kv[0])):
            start = 0
            tied = sorted((s.offset, s.offset + s.numel) for s in self.layout.slots
                          if s.dtype == dt and s.name in self.cfg.tied_groups)
            for lo, hi in tied:
                if lo > start:
                    runs.append((dt, start, lo))
                start = max(start, hi)
            if start < n:
                runs.append((dt, start, n))
        return runs

    def _do_dp_start(self, a: Action) -> None:
        grads = self.grad_pool[self._grads_slot(a.index)]
        handles = [self.comm.all_reduce(grads[dt][lo:hi], f"dp:{self.index}", str(a)) for dt, lo, hi in self.dp_ranges]
        self.reductions[(Kind.DP_START, a.index)] = _Multi(handles)

    def _do_dp_wait(self, a: Action) -> None:
        self.reductions.pop((Kind.DP_START, a.index)).wait()

    def _do_tied_start(self, a: Action) -> None:
        views = self._grad_views[self._grads_slot(a.index)]
        handles = [self.comm.all_reduce(views[n], g, str(a)) for n, g in sorted(self.cfg.tied_groups.items()) if n in views]
        self.reductions[(Kind.TIED_START, a.index)] = _Multi(handles)

    def _do_tied_wait(self, a: Action) -> None:
        self.reductions.pop((Kind.TIED_START, a.index)).wait()

    def _do_norm_start(self, a: Action) -> None:
        # The norm is that of the reduced gradient: the list waits for batch t's other
        # reductions before this action (the validator checks it).
        t = a.index
        views = self._grad_views[self._grads_slot(t)]
        sq = torch.zeros((), dtype=torch.float64, device=self.device)
        for name, g in views.items():
            if self.cfg.tied_owner.get(name, True):  # a tied weight counts once, on its owner
                sq += g.detach().double().pow(2).sum()
        self.norm_sq[t] = sq
        self.reductions[Kind.NORM_START, t] = self.comm.all_reduce(sq, f"pipe:{self.replica}", str(a))

    def _do_norm_wait(self, a: Action) -> None:
        t = a.index
        self.reductions.pop((Kind.NORM_START, t)).wait()
        total = self.norm_sq.pop(t).sqrt()
        # torch.nn.utils.clip_grad_norm_'s rule: scale by max_norm / (norm + 1e-6), never up. Kept
        # a device tensor (no host sync on CUDA); multiplying by exactly 1.0 changes no gradient.
        self.clip_coef[t] = torch.clamp(self.cfg.max_grad_norm / (total + 1e-6), max=1.0)

    def _do_update(self, a: Action) -> None:
        t = a.index
        slot_g = self._grads_slot(t)
        grads = self.grad_pool[slot_g]
        coef = self.clip_coef.pop(t, None)
        if coef is not None and self.kops is None:  # the fused update applies the clip factor itself
            for g in grads.values():
                g.mul_(coef)
        if self.kops is not None:
            self._update_fused(t, grads, coef)
        elif self.optimizer is not None:
            src = self.slots[self._slot(max(t - 1, 0))]
            dst = self.slots[self._slot(t)]
            if src is not dst:
                for dt in dst:
                    dst[dt].copy_(src[dt])
            dst_views = self.layout.views(dst)
            gviews = self._grad_views[slot_g]
            for name, p in self.opt_params.items():
                p.data = dst_views[name]
                p.grad = gviews[name]
            self.optimizer.step()
            for p in self.opt_params.values():
                p.grad = None
            if self.lr_scheduler is not None:
                self.lr_scheduler.step()
        for g in grads.values():
            g.zero_()
        self.updates = t

    def _update_fused(self, t: int, grads: dict, coef: torch.Tensor | None) -> None:
        """One fused launch per dtype: read W(t-1) and the gradient, write W(t) into its slot."""
        src = self.slots[self._slot(max(t - 1, 0))]
        dst = self.slots[self._slot(t)]
        lr = self.optimizer.param_groups[0]["lr"]
        with torch.no_grad():
            for dt in dst:
                self.kops.update(self.kspec, t, grads[dt], src[dt], dst[dt], self.kstate[dt],
                                 clip=coef, lr=lr)
        self._accumulated.pop(t, None)
        if self.lr_scheduler is not None:
            self.lr_scheduler.step()

    # ------------------------------------------------------------------ checkpoints

    def layout_names(self) -> list[str]:
        """Canonical names of everything this stage checkpoints: parameters, then buffers."""
        return [s.name for s in self.layout.slots] + list(self.buffers)

    def newest_weights(self) -> dict[str, torch.Tensor]:
        """Views of the newest weight version (after the last UPDATE), detached."""
        return {n: v.detach() for n, v in self.leaves[self._slot(self.updates)].items()}

    def local_state(self) -> dict[str, torch.Tensor]:
        """This stage's newest weights and its buffers under canonical names (CPU copies)."""
        sd = {n: v.to("cpu", copy=True) for n, v in self.newest_weights().items()}
        for n, b in self.buffers.items():
            sd[n] = b.to("cpu", copy=True)
        return sd

    def load_local_state(self, sd: dict[str, torch.Tensor]) -> None:
        """Load weights into every slot (all versions equal) and the buffers."""
        with torch.no_grad():
            for slot in self.slots:
                views = self.layout.views(slot)
                for n, v in views.items():
                    v.copy_(sd[n])
            for n, b in self.buffers.items():
                if n in sd:
                    b.copy_(sd[n])


class _Multi(Handle):
    def __init__(self, handles):
        self.handles = list(handles)

    def ready(self) -> bool:
        return all(h.ready() for h in self.handles)

    def wait(self) -> None:
        for h in self.handles:
            h.wait()


def _written_args(module: torch.fx.GraphModule) -> set[int]:
    """Positions of the module's arguments that some operation writes in place (per its schema)."""
    placeholders = {n: i for i, n in enumerate(n for n in module.graph.nodes if n.op == "placeholder")}
    written = set()
    for node in module.graph.nodes:
        schema = getattr(node.target, "_schema", None)
        if node.op != "call_function" or schema is None or not schema.is_mutable:
            continue
        for arg, value in zip(schema.arguments, node.args):
            if arg.alias_info is not None and arg.alias_info.is_write and value in placeholders:
                written.add(placeholders[value])
    return written


def compute_loss(trace_info, loss_fn: Callable | None, outputs: Sequence[torch.Tensor], target) -> torch.Tensor:
    """The last stage's loss: ``loss_fn(model_output, target)``, or the model's own loss when
    ``loss_fn`` is None; ``outputs`` are the flat outputs, restructured like the model's."""
    structured = trace_info.unflatten_output(list(outputs))
    loss = loss_fn(structured, target) if loss_fn is not None else _model_loss(structured)
    if not (isinstance(loss, torch.Tensor) and loss.dim() == 0):
        raise TypeError(
            f"the loss must be a scalar tensor; found {type(loss).__name__}"
            f"{tuple(loss.shape) if isinstance(loss, torch.Tensor) else ''}. Make loss_fn return a mean/sum."
        )
    return loss


def _model_loss(out) -> torch.Tensor:
    """``loss_fn=None``: the model's output is the loss (a scalar, or an output with ``.loss``)."""
    if isinstance(out, torch.Tensor):
        return out
    loss = getattr(out, "loss", None)
    if loss is None and isinstance(out, dict):
        loss = out.get("loss")
    if loss is None:
        raise TypeError(
            f"loss_fn=None means the model's output is the loss, but it returned {type(out).__name__} "
            f"without a .loss. Pass loss_fn=..., or (Hugging Face) include labels in the inputs."
        )
    return loss
