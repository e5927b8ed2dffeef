"""runtime: one rank's interpreter of its schedule action list.

A :class:`StageWorker` runs one pipeline stage on one rank: the generated module, its module
buffers, and a :class:`~fxpipe.weights.WeightStore` (weight versions, gradient accumulators,
optimizer). It executes the actions of its segments in list order through a
:class:`~fxpipe.comm.Comm` and never decides *what* to do next: the list does. It only tells the
driver whether the one operation an action waits for has completed (:meth:`StageWorker.ready`),
so the same worker runs one-per-process under ``torchrun`` and all-in-one-process in the
debugging mode, where the driver interleaves the workers.

Gradients of micro-batch ``k`` accumulate (loss scaled by ``1/(m·w)``) into the store's buffer
of batch ``t(k)``. The reductions never touch the same memory at once: the data-parallel
all-reduce sums every gradient but those of tied weights, whose copies on all stages of all
replicas are summed by their own all-reduce; the norm is started after both were joined.
See docs/design.md ("The runtime").
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import warnings
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
from torch.func import functional_call

from .backward import SavedTensors, saving_nothing
from .comm import EVERY_RANK, Comm, Handle, dp_group
from .device import rng_devices, seed
from .precision import LossScaler, Precision, fp32_params
from .schedule import Action, Kind, batch_of, gradient_buffers, waits_for, zb_split
from .trace import alias_base, written_values
from .weights import WeightStore

__all__ = ["StageWorker", "WorkerConfig", "compute_loss", "drain_posted"]


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
    strict_kernels: bool = False  # kernels="triton": no fallback to torch.optim, raise instead
    tied_groups: dict[str, str] = field(default_factory=dict)  # param name -> comm group name
    tied_owner: dict[str, bool] = field(default_factory=dict)  # param name -> counted in the norm here
    nonfinite: str = "raise"  # a non-finite loss or gradient: "raise" or "skip" the update
    precision: Precision = field(default_factory=Precision)  # fp32, or 16-bit compute from fp32 masters
    scaler: LossScaler | None = None  # fp16: each worker keeps a copy, updated from the shared verdict
    accumulate: str = "gradients"  # or "optimizer": AdamA, no gradient buffer and no per-step NORM
    # This stage or a later one runs opaque leaf modules, so which weights (and boundary inputs)
    # a backward reaches may change from one micro-batch to the next (WeightStore's ``dynamic``)
    dynamic: bool = False


def _squared_norm(grads: Sequence[torch.Tensor], device) -> torch.Tensor:
    """The squared 2-norm of ``grads`` together, a float64 scalar: one fused pass per dtype
    (``torch._foreach_norm``, what ``clip_grad_norm_`` runs; 16-bit gradients are normed in
    float32, float32 and float64 in their own dtype), the per-tensor norms then squared and
    summed in float64. A NaN or infinity anywhere makes the result NaN or infinite."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for g in grads:
        by_dtype.setdefault(g.dtype, []).append(g.detach())
    sq = torch.zeros((), dtype=torch.float64, device=device)
    for dt, group in by_dtype.items():
        wide = None if dt in (torch.float32, torch.float64) else torch.float32
        norms = torch._foreach_norm(group, 2, dtype=wide)
        sq += torch.stack(norms).double().pow(2).sum()
    return sq


class StageWorker:
    """Executes one rank's actions for one stage (see module docstring)."""

    def __init__(self, stage, cfg: WorkerConfig, comm: Comm, *, rank: int, replica: int, trace_info,
                 neighbours: tuple[int | None, int | None], device=None):
        self.stage = stage
        self.cfg = cfg
        self.comm = comm
        self.rank = rank
        self.replica = replica
        self.index = stage.index
        self.trace_info = trace_info
        self.device = device or torch.device("cpu")
        d = cfg.stages
        self.prev, self.next = neighbours  # this replica's previous and next stage's ranks (the plan's layout)
        self.is_last = self.index == d - 1

        self.layout = stage.flat.layout
        # Every step reduces (at least the norm all-reduce that clips and checks for non-finite
        # values), so a 2bw stage keeps two gradient buffers: batch t's is reduced while batch t+1
        # accumulates into the other; a flush schedule's one is free again before batch t+1
        # (schedule.gradient_buffers). In one process the replicas of a stage share its generated
        # module: each worker owns its weights and module buffers (BatchNorm statistics), as a
        # rank of its own would.
        # AdamA keeps none (its moments take each micro-batch's gradient); a stage with nothing
        # to train has no optimizer to fold into and keeps its empty one or two
        adama = cfg.accumulate == "optimizer" and any(s.requires_grad for s in stage.flat.layout.slots)
        buffers = 0 if adama else gradient_buffers(cfg.schedule, reduces=True)
        self.store = WeightStore(stage.flat, schedule=cfg.schedule, grad_buffers=buffers,
                                 accumulate=cfg.accumulate,
                                 optimizer=cfg.optimizer, lr_scheduler=cfg.lr_scheduler, kernels=cfg.kernels,
                                 strict_kernels=cfg.strict_kernels, precision=cfg.precision,
                                 device=self.device, share_initial=replica == 0, shared=cfg.tied_groups,
                                 keep_fp32=fp32_params(stage.module) if cfg.precision.mixed else (),
                                 dynamic=cfg.dynamic)
        self.autocast = cfg.precision.autocast  # the forward's and the loss's context, per device type
        self.scaler = copy.deepcopy(cfg.scaler) if cfg.scaler is not None else None
        self.batch_scale: dict[int, float] = {}  # fp16: batch -> the loss scale its backwards used
        # AdamA: the non-finite flags (0 or NaN) of the batches updated since this rank's last LOSS,
        # which adds them to its part of the loss sum: every rank then sees a NaN in the same total
        self.updated_flags: list[torch.Tensor] = []
        self.buffers = {n: b.detach().clone() for n, b in stage.module.named_buffers()}
        self.dp_ranges = self._dp_ranges() if cfg.width > 1 else []

        # per micro-batch state
        self.inputs: dict[int, dict[str, torch.Tensor]] = {}  # model inputs of micro-batch k
        self.targets: dict[int, Any] = {}
        self.recv_act: dict[int, tuple[list[torch.Tensor], Handle]] = {}
        self.recv_grad: dict[int, tuple[list[torch.Tensor], Handle]] = {}
        self.ctx: dict[int, dict] = {}
        self.sends: deque[tuple[int, Handle]] = deque()  # (segment, posted send), oldest first
        self.segments = 0  # END_STEPs run so far
        self.loss_posts: deque[tuple[int, Handle]] = deque()  # LOSS all-reduces not yet waited for
        self.reductions: dict[tuple[Kind, int], Handle] = {}
        self.norm_sq: dict[int, torch.Tensor] = {}
        # (batch, its global gradient norm as a 0-dim device tensor) of the latest NORM_WAIT: what
        # Pipeline.grad_norm reads, so that only a user who reads it syncs with the device
        self.grad_norm: tuple[int, torch.Tensor] | None = None
        self.reached_counts: dict[int, torch.Tensor] = {}  # leaf modules, w > 1: batch -> replicas' reached sums
        self.clip_coef: dict[int, torch.Tensor] = {}  # batch -> 0-dim factor on the device
        self.loss_check: dict[int, torch.Tensor] = {}  # last stage: batch -> 0, or NaN if a loss was not
        self.nonfinite: dict[int, list[int]] = {}  # batch -> stages where a non-finite value appeared
        self.dropped: set[int] = set()  # batches whose UPDATE is skipped
        self.halted = False  # nonfinite="raise" and one was found: no UPDATE runs any more
        self.losses: dict[int, torch.Tensor] = {}
        self.batch_loss: dict[int, tuple[torch.Tensor, torch.Tensor, Handle]] = {}  # see _do_loss
        # eval_step: the eval-mode stage, the weights it reads and the loss summed on the last stage
        self.eval_stage = None
        self.eval_weights: dict[str, torch.Tensor] = {}
        self.eval_loss = torch.zeros((), dtype=torch.float64, device=self.device)
        self.input_specs = list(stage.input_specs)
        self._written_args = _written_args(stage.module)
        self._written_buffers: set[str] | None = None  # the buffers a forward updates (first forward)
        self.output_specs = list(stage.output_specs)
        # Gradients flow through floating-point boundary values only; both ends agree from specs.
        self.float_out = [s is not None and s.torch_dtype.is_floating_point for s in self.output_specs]
        self.float_in = [s.torch_dtype.is_floating_point for s in self.input_specs]
        # Which float outputs the next stage's backward reached (its SEND_GRAD's flags): found on
        # the first backward, or read at every one where it may change (``cfg.dynamic``)
        self._reached_out: list[bool] | None = None
        self._reached_in: torch.Tensor | None = None  # the flags this stage sends with its input gradients
        self._warned_unsplit = False  # zb: the stage's unsplit backward is reported once

    # ------------------------------------------------------------------ helpers

    def _batch(self, k: int) -> int:
        return batch_of(k, self.cfg.microbatches)

    @contextlib.contextmanager
    def _rng(self, k: int):
        """Dropout and other randomness: one stream per (seed, micro-batch, stage), so the same
        numbers come out in one process, in many, and when a forward is recomputed. Micro-batches
        are counted over the whole global batch, as it is split among the replicas (replica r's
        j-th of batch t is the ((t-1)·m·w + r·m + j)-th): replicas draw different numbers, and
        with one replica the count is k."""
        m, w = self.cfg.microbatches, self.cfg.width
        t = self._batch(k)
        index = (t - 1) * m * w + self.replica * m + (k - (t - 1) * m)
        digest = hashlib.sha256(f"{self.cfg.seed}:{index}:{self.index}".encode()).digest()
        with torch.random.fork_rng(devices=rng_devices(self.device)):
            seed(int.from_bytes(digest[:8], "little") & ((1 << 63) - 1), self.device)
            yield

    def _run_module(self, k: int, version: int, args: Sequence[torch.Tensor], buffers=None):
        """The stage's forward on weight ``version`` and this worker's buffers, or ``buffers``
        (name -> tensor; a recomputation reads private copies of what its forward saw)."""
        fresh = None
        if buffers is None:
            # A forward writes fresh copies of the buffers it updates (BatchNorm statistics, a
            # running average), which then become this worker's: an earlier micro-batch's output
            # that is such a buffer, still to be sent, or a buffer autograd saved for its
            # backward, keeps the values that micro-batch saw. Which buffers the stage writes is
            # found on its first forward, which runs on copies of them all: those whose version
            # counter moved or whose values changed (batch norm writes its running statistics
            # without moving the counter).
            first = self._written_buffers is None
            fresh = {n: b.clone() if first or n in self._written_buffers else b for n, b in self.buffers.items()}
            versions = {n: b._version for n, b in fresh.items()}
            buffers = fresh
        tensors = {**self.store.compute(version), **buffers}
        # An argument the stage writes in place (``x += residual`` right after a cut, or through
        # a view of it) is passed as a copy: the boundary leaf autograd differentiates to, and
        # the inputs a recomputation reads again, must stay as they arrived.
        args = [x.clone() if i in self._written_args else x for i, x in enumerate(args)]
        with self._rng(k), self.autocast(self.device):
            out = functional_call(self.stage.module, tensors, tuple(args))
        if fresh is not None:
            if self._written_buffers is None:
                self._written_buffers = {n for n, b in fresh.items()
                                         if b._version != versions[n] or not torch.equal(b, self.buffers[n])}
            self.buffers.update({n: fresh[n] for n in self._written_buffers})
        return tuple(out)

    def _loss(self, k: int, outputs: Sequence[torch.Tensor], *, last_use: bool) -> torch.Tensor:
        target = (self.targets.pop if last_use else self.targets.get)(k, None)
        with self.autocast(self.device):  # as a training script computes its loss under autocast
            return compute_loss(self.trace_info, self.cfg.loss_fn, outputs, target)

    # ------------------------------------------------------------------ readiness

    def ready(self, a: Action) -> bool:
        """Whether ``a`` can run now without waiting: the one action it consumes
        (:func:`fxpipe.schedule.waits_for`) has completed. The single-process driver interleaves
        the stages by it; across processes each rank runs its list in order and waits."""
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
        """The step's segment ends here; the driver returns to the caller. Sends posted before
        the previous END_STEP are released: their receives belong to the peers' previous
        segments, which need nothing from this rank that it has not posted, so this wait ends
        (gloo marks a send complete only once it is waited for)."""
        while self.sends and self.sends[0][0] < self.segments:
            self.sends.popleft()[1].wait()
        # The previous step's loss all-reduce: every rank has passed that step's END_STEP by now
        # (this segment received what their later segments sent), so this wait is free.
        while self.loss_posts and self.loss_posts[0][0] < a.index:
            self.loss_posts.popleft()[1].wait()
        self.segments += 1

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
        bufs.append(torch.empty(len(bufs), dtype=torch.uint8, device=self.device))  # the reached flags
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
        # a zb micro-batch whose backward runs split (zb_split; not recomputing, an input chain
        # to split off, the graph splittable): what autograd saves is kept where I k can free
        # what only the input chain reads (fxpipe.backward), instead of holding all of it until W k
        split = (self.cfg.schedule == "zb" and not recompute and any(self.float_in) and self.store.unsplit is None
                 and zb_split(self.index, self.cfg.stages, self.cfg.microbatches, k))
        saved = SavedTensors() if split else None
        # a forward R will recompute records no saved tensor (saving_nothing: not no_grad, which
        # can pick other kernels than R's and training's)
        with (saving_nothing() if recompute else contextlib.nullcontext(),
              saved.hooks() if saved is not None else contextlib.nullcontext()):
            outputs = self._run_module(k, a.version, args)
            loss = self._loss(k, outputs, last_use=not recompute) if self.is_last else None
        if recompute:
            # Keep only the inputs; R recomputes the rest right before B (arXiv 2006.09503 §3.3),
            # from the buffer values this forward saw (saved before it ran: it may update them).
            # The outputs wait for SEND_ACT, detached, so that the graph this forward recorded
            # goes at once; the last stage sends none and has its loss already, so it keeps none
            # (the model's output, logits say, is often its largest tensor).
            ctx = {"args": [x.detach() for x in args],
                   "outputs": () if self.is_last else tuple(o.detach() for o in outputs), "buffers": buffers}
        else:
            ctx = {"boundary": boundary, "outputs": outputs, "loss": loss, "saved": saved}
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
        ctx = self.ctx.pop(a.index)
        t, roots, seeds, boundary = self._backward_roots(a, ctx)
        self.store.backward(t, a.version, roots, seeds, boundary)
        self._take_input_grads(boundary)

    def _do_i(self, a: Action) -> None:
        """zb: the input-gradient half of micro-batch k's backward (what SEND_GRAD k sends). The
        weight half waits in ``ctx`` for ``W k`` (:mod:`fxpipe.backward`); nothing else of the
        micro-batch is kept: its outputs and loss are dropped here, so the graph lives only
        through the nodes the weight pass starts from. On a stage whose graph cannot be split
        (``store.unsplit`` says why) this is the whole backward and ``W k`` does nothing."""
        ctx = self.ctx[a.index]
        t, roots, seeds, boundary = self._backward_roots(a, ctx)
        saved = ctx.get("saved")
        ctx.clear()
        ctx["pending"] = self.store.backward_input(t, a.version, roots, seeds, boundary, saved)
        if self.store.unsplit is not None and not self._warned_unsplit:
            self._warned_unsplit = True
            if self.replica == 0:
                warnings.warn(f"fxpipe: zb on stage {self.index}: its backward runs unsplit in I (W is empty) because "
                              f"{self.store.unsplit}", RuntimeWarning, stacklevel=2)
        self._take_input_grads(boundary)

    def _do_w(self, a: Action) -> None:
        """zb: micro-batch k's weight gradients into batch t's accumulator, from what ``I k``
        recorded (no input-gradient op runs again); frees the rest of its graph."""
        ctx = self.ctx.pop(a.index)
        self.store.backward_weight(self._batch(a.index), ctx.pop("pending"))

    def _take_input_grads(self, boundary) -> None:
        """Keep the boundary inputs' gradients for SEND_GRAD (and clear their ``.grad``), and one
        flag per input: whether the backward reached it. An input it did not reach (read only
        through ``.detach()``, a comparison or under ``no_grad``) is sent a zero gradient, so both
        sides always exchange the same tensors, flagged 0: the previous stage then leaves that
        output out of its backward's roots, so the weights only it reaches get no gradient (as
        in eager, where their ``.grad`` stays None and the optimizer skips them)."""
        if self._reached_in is None or self.cfg.dynamic:  # one tensor for good where it cannot change:
            # built from a host list, it would wait for the device at every backward on a GPU
            self._reached_in = torch.tensor([x.grad is not None for x in boundary], dtype=torch.uint8,
                                            device=self.device)
        self._input_grads = [x.grad if x.grad is not None else torch.zeros_like(x) for x in boundary]
        self._input_grads.append(self._reached_in)
        for x in boundary:
            x.grad = None

    def _backward_roots(self, a: Action, ctx: dict):
        """(batch, roots, seeds, float boundary leaves) of micro-batch k's backward: the scaled
        loss on the last stage, else the outputs with the gradients received for them."""
        k = a.index
        t = self._batch(k)
        if self.scaler is not None:  # the scale in force after the update that wrote this version
            self.batch_scale[t] = self.scaler.scale_for(a.version)
        if self.is_last:
            loss = ctx["loss"]
            if self.cfg.precision.mixed:  # the seed in fp32, scaled (fp16) before any 16-bit op sees it
                loss = loss.float() * self.batch_scale.get(t, 1.0)
            roots = [loss / (self.cfg.microbatches * self.cfg.width)]
            seeds = [None]
        else:
            bufs, h = self.recv_grad.pop(k)
            h.wait()
            *grads, flags = bufs
            if self._reached_out is None or self.cfg.dynamic:  # a host read: on a GPU, once
                self._reached_out = [bool(f) for f in flags.tolist()]
            outs = [o for o, f in zip(ctx["outputs"], self.float_out) if f]
            pairs = [(o, g) for o, g, r in zip(outs, grads, self._reached_out) if o.requires_grad and r]
            roots, seeds = [o for o, _ in pairs], [g for _, g in pairs]
        boundary = [x for x, f in zip(ctx["boundary"], self.float_in) if f]
        if self.is_last and self.cfg.accumulate != "optimizer":  # x*0 is 0 or NaN: the NORM carries it
            self.loss_check[t] = self.loss_check.get(t, 0.0) + ctx["loss"].detach().double() * 0
        return t, roots, seeds, boundary

    def _do_send_act(self, a: Action) -> None:
        ctx = self.ctx[a.index] if self.eval_stage is None else self.ctx.pop(a.index)
        self._post_send([o.detach() for o in ctx["outputs"]], self.next, a)

    def _do_loss(self, a: Action) -> None:
        """Post the all-reduce (over every rank) of this rank's part of batch t's loss sum: the
        last stage's losses of its micro-batches (of ``eval_step``'s pass while evaluating), 0
        elsewhere. Kept as ``(local sum, reduced sum, handle)`` for the driver."""
        t = a.index
        if self.eval_stage is not None:
            local = self.eval_loss.clone()
        elif self.is_last:
            m = self.cfg.microbatches
            local = torch.zeros((), dtype=torch.float64, device=self.device)
            for k in range((t - 1) * m + 1, t * m + 1):  # in micro-batch order
                local += self.losses.pop(k).double()
        else:
            local = torch.zeros((), dtype=torch.float64, device=self.device)
        if self.updated_flags and self.eval_stage is None:
            local = local + torch.stack(self.updated_flags).sum().to(self.device)
            self.updated_flags.clear()
        total = local.reshape(1).clone()
        handle = self.comm.all_reduce(total, EVERY_RANK, str(a), member=self.index)
        self.batch_loss[t] = (local, total, handle)
        self.loss_posts.append((t, handle))

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
        with torch.no_grad(), self.autocast(self.device):
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
        while self.sends and self.sends[0][1].ready():
            self.sends.popleft()
        self.sends.append((self.segments, self.comm.isend(tensors, peer, str(a))))

    def drain(self) -> None:
        """Wait for every send, receive and loss all-reduce still in flight (a flush, eval_step,
        the end of a script that did not flush), so that the group is never torn down with an
        operation of this rank still posted. A receive posted in a step's segment is sent in the
        peer's segment of that step or earlier (tests/unit/test_runtime_core.py checks it on every
        schedule), so the peer, running the same steps, sends it and the wait ends."""
        drain_posted(self.in_flight())

    def in_flight(self) -> tuple:
        """The containers of what this worker has posted and not yet waited for (its sends, loss
        all-reduces and receives, with their tensors), for :func:`drain_posted`: held at exit apart
        from the worker, so that a pipeline collected before the exit still finishes them."""
        return self.sends, self.loss_posts, self.recv_act, self.recv_grad

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
        grads = self.store.grads(a.index)
        handles = [self.comm.all_reduce(grads[dt][lo:hi], dp_group(self.index), str(a)) for dt, lo, hi in self.dp_ranges]
        if self.store.dynamic:  # leaf modules: the weights some replica's backwards reached
            counts = self.store.reached_counts(a.index)
            handles.append(self.comm.all_reduce(counts, dp_group(self.index), str(a)))
            self.reached_counts[a.index] = counts
        self.reductions[(Kind.DP_START, a.index)] = _Multi(handles)

    def _do_dp_wait(self, a: Action) -> None:
        self.reductions.pop((Kind.DP_START, a.index)).wait()
        if self.store.dynamic:
            self.store.adopt_reached(a.index, self.reached_counts.pop(a.index))

    def _do_tied_start(self, a: Action) -> None:
        views = self.store.grad_views_of(a.index)
        handles = [self.comm.all_reduce(views[n], g, str(a), member=self.index)
                   for n, g in sorted(self.cfg.tied_groups.items()) if n in views]
        self.reductions[(Kind.TIED_START, a.index)] = _Multi(handles)

    def _do_tied_wait(self, a: Action) -> None:
        self.reductions.pop((Kind.TIED_START, a.index)).wait()

    def _do_norm_start(self, a: Action) -> None:
        """Post the all-reduce (over every rank) of a vector holding, at this rank's index, the
        squared norm of its reduced gradient of batch t (plus 0, or NaN on the last stage when a
        loss was not finite). One small collective serves clipping and the non-finite check; the
        list waits for batch t's other reductions before this action (the validator checks it)."""
        t = a.index
        sq = _squared_norm([g for name, g in self.store.grad_views_of(t).items()
                            if self.cfg.tied_owner.get(name, True)],  # a tied weight counts once, on its owner
                           self.device)
        if self.is_last:
            sq += self.loss_check.pop(t)
        # one entry per (replica, stage), replica-major whatever the ranks' layout: a replica's
        # stages are then neighbours, summed in stage order below
        parts = torch.zeros(self.cfg.stages * self.cfg.width, dtype=torch.float64, device=self.device)
        parts[self.replica * self.cfg.stages + self.index] = sq
        self.norm_sq[t] = parts
        self.reductions[Kind.NORM_START, t] = self.comm.all_reduce(parts, EVERY_RANK, str(a), member=self.index)

    def _do_norm_wait(self, a: Action) -> None:
        t = a.index
        self.reductions.pop((Kind.NORM_START, t)).wait()
        parts = self.norm_sq.pop(t)
        d = self.cfg.stages
        # Every rank sees every rank's part, so all decide alike. Reading the flag is a host
        # sync; on the CPU it costs nothing.
        finite = bool(torch.isfinite(parts).all())
        scale = self.batch_scale.pop(t, 1.0)
        # this replica's stages, summed in stage order: the same bits in one process and in many
        total = parts[self.replica * d:(self.replica + 1) * d].sum().sqrt() / scale
        self.grad_norm = (t, total)
        if self.scaler is not None:  # fp16: an overflow backs the scale off, as GradScaler.update
            self.scaler.update(t, found_inf=not finite)
        if not finite:
            self.nonfinite[t] = sorted({r % d for r in range(len(parts)) if not torch.isfinite(parts[r])})
            self.dropped.add(t)
            self.halted = self.halted or self.cfg.nonfinite == "raise"
            return
        if self.cfg.max_grad_norm is None:
            if self.scaler is not None:
                self.clip_coef[t] = torch.tensor(1.0 / scale, device=self.device)  # unscale
            return
        # torch.nn.utils.clip_grad_norm_'s rule: scale by max_norm / (norm + 1e-6), never up. Kept
        # a device tensor (no host sync on CUDA); multiplying by exactly 1.0 changes no gradient.
        self.clip_coef[t] = torch.clamp(self.cfg.max_grad_norm / (total + 1e-6), max=1.0)
        if self.scaler is not None:
            self.clip_coef[t] = self.clip_coef[t] / scale

    def _do_update(self, a: Action) -> None:
        t = a.index
        skip = t in self.dropped or self.halted
        self.dropped.discard(t)
        self.store.update(t, self.clip_coef.pop(t, None), skip=skip)
        if self.cfg.accumulate == "optimizer" and self.store.optimizer is not None:
            self.updated_flags.append(self.store.strategy.nonfinite(t))

    # ------------------------------------------------------------------ checkpoints

    def layout_names(self) -> list[str]:
        """Canonical names of everything this stage checkpoints: parameters, then buffers."""
        return [s.name for s in self.layout.slots] + list(self.buffers)

    def newest_weights(self) -> dict[str, torch.Tensor]:
        """Views of the newest weight version (after the last UPDATE), detached."""
        return self.store.newest()

    def local_state(self) -> dict[str, torch.Tensor]:
        """This stage's newest weights and its buffers under canonical names (CPU copies)."""
        sd = {n: v.to("cpu", copy=True) for n, v in self.newest_weights().items()}
        for n, b in self.buffers.items():
            sd[n] = b.to("cpu", copy=True)
        return sd

    def scaler_state(self) -> dict | None:
        """fp16: the loss scaler's state (the same on every rank), else None."""
        return None if self.scaler is None else self.scaler.state_dict()

    def load_scaler_state(self, state: dict | None) -> None:
        """Resume the loss scale (fp16); a checkpoint without one (another precision) leaves the
        scaler at its initial scale, in force from the resumed weight version on (call it after
        the weights are loaded)."""
        if self.scaler is None:
            return
        if state is not None:
            self.scaler.load_state_dict(state)
        else:
            self.scaler.start_at(self.store.updates)

    def load_local_state(self, sd: dict[str, torch.Tensor]) -> None:
        """Load weights into every slot (all versions equal) and the buffers."""
        self.store.load(sd)
        with torch.no_grad():
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


def drain_posted(in_flight: tuple) -> None:
    """Wait for everything in a worker's :meth:`StageWorker.in_flight` containers."""
    sends, loss_posts, recv_act, recv_grad = in_flight
    for _, h in [*sends, *loss_posts, *recv_act.values(), *recv_grad.values()]:
        h.wait()
    sends.clear()
    loss_posts.clear()


def _written_args(module: torch.fx.GraphModule) -> set[int]:
    """Positions of the module's arguments that some operation writes in place, directly or
    through a view (``h[:, :8] += 1`` is a ``slice`` then a ``copy_``): each written value is
    followed up its alias chain (:func:`fxpipe.trace.alias_base`) to what it shares storage with."""
    placeholders = {n: i for i, n in enumerate(n for n in module.graph.nodes if n.op == "placeholder")}
    written: set[int] = set()
    for node in module.graph.nodes:
        for value in written_values(node):
            while (base := alias_base(value)) is not None:
                value = base
            if value in placeholders:
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
    if torch.is_grad_enabled() and not loss.requires_grad:  # backward would say only "element 0 ... does not require grad"
        raise TypeError(
            f"the loss ({loss.dtype}) does not depend on the model's output through autograd, so there is nothing to "
            f"backpropagate: {'loss_fn' if loss_fn is not None else 'the model'} detached it (.item(), .detach(), "
            f"torch.tensor(...), an integer or comparison op, numpy). Compute it from the output with torch ops")
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
