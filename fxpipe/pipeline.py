"""pipeline: ``fxpipe.compile`` and the :class:`Pipeline` it returns (the product's front door).

``compile`` wires the phases together on every rank: trace the model at the micro-batch size,
plan on rank 0 and broadcast the plan (every rank checks its own trace against the plan's
fingerprint), generate this rank's stage, build the schedule's action lists, and hand them to
:class:`~fxpipe.runtime.StageWorker` objects. ``Pipeline.step`` then feeds one global batch:

* under ``torchrun`` (WORLD_SIZE > 1) each process is one rank and runs one worker;
* otherwise every rank lives in this process and a driver interleaves the workers, running each
  until its next action must wait for another; numerics are identical to the multi-process run.

2bw never flushes between steps, so ``step(t)`` runs each rank's list up to its first forward of
a micro-batch of batch ``t+1`` (whose data arrives with the next call); the rest of batch ``t``
finishes inside the next ``step`` or in :meth:`Pipeline.flush`.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import functools
import gc
import hashlib
import math
import os
import socket
import sys
import time
import types
import warnings
import weakref
from dataclasses import dataclass, replace
from typing import Any, Callable, Iterator, Mapping

import torch
import torch.distributed as dist
import torch.fx as fx
import torch.utils._pytree as pytree
from torch import nn

from .comm import EVERY_RANK, Comm, DistComm, LocalHub, dp_group, peer_failed, tied_group
from .cost import DeviceModel
from .deps import interleave
from .device import backend_for, check_backend, to_device
from .device import choose as choose_device
from . import errors as errors_module
from .errors import (CheckpointError, ConfigError, FxpipeError, InputError, NonFiniteError, PeerError, PlanError,
                     RuntimeMismatchError, ScheduleError)
from .inputs import InputSignature, TargetSignature, batch_inputs, check_first_batch, check_model_loss, check_operand_dtypes
from .plan import Plan, graph_fingerprint
from .precision import LossScaler, Precision, prepare
from .runtime import StageWorker, WorkerConfig, drain_posted
from .schedule import (SCHEDULES, Action, Program, check_chunks, check_lookahead, format_actions, lane_of,
                       min_microbatches, norm_every_step, rank_of, stage_and_replica)
from .trace import as_leaf_modules, leaf_module_calls, module_path, normalize_inputs, trace, without_weights

__all__ = ["compile", "Pipeline", "PipelineConfig", "Topology", "Loss", "DEFAULT_MICROBATCHES"]

DEFAULT_MICROBATCHES = 8  # m when not given: enough to keep up to 8 stages busy (m >= d)
DEFAULT_TIMEOUT = 300.0  # seconds a rank waits for another before it raises (compile(timeout=...))


def default_optimizer(named_params):
    """AdamW with torch's defaults (lr=1e-3, betas=(0.9, 0.999), weight_decay=1e-2)."""
    return torch.optim.AdamW(named_params)


def _describe(value, depth: int = 0) -> str:
    """``value`` as text that is the same on every rank given the same argument: numbers and
    strings by repr, containers by their items (a set's and a dict's in sorted order: each
    process orders strings by its own hash seed), classes by qualified name, a Python function
    (a lambda or closure too) by qualified name with a digest of its code and the values of its
    defaults and of what it captures (:func:`_describe_function`), a ``functools.partial`` with
    its arguments, a module by its class and its number and string attributes (a loss module's
    settings), any other object by its class (never an address)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return repr(value)
    if depth > 4:  # a closure that captures itself, or nesting too deep to be a setting
        return f"a {type(value).__module__}.{type(value).__qualname__}"
    deeper = functools.partial(_describe, depth=depth + 1)
    if isinstance(value, (tuple, list)):
        return "(" + ", ".join(deeper(v) for v in value) + ")"
    if isinstance(value, (set, frozenset)):
        return "{" + ", ".join(sorted(deeper(v) for v in value)) + "}"
    if isinstance(value, Mapping):
        return "{" + ", ".join(sorted(f"{deeper(k)}: {deeper(v)}" for k, v in value.items())) + "}"
    if isinstance(value, functools.partial):
        bound = [deeper(a) for a in value.args] + [f"{k}={deeper(v)}" for k, v in sorted(value.keywords.items())]
        return f"partial({deeper(value.func)}, {', '.join(bound)})"
    if isinstance(value, types.FunctionType):
        return _describe_function(value, deeper)
    if isinstance(value, types.ModuleType):
        return f"module {value.__name__}"
    if isinstance(value, type) or callable(value) and hasattr(value, "__qualname__"):
        return f"{getattr(value, '__module__', '?')}.{value.__qualname__}"
    kind = f"{type(value).__module__}.{type(value).__qualname__}"
    if isinstance(value, nn.Module):  # a loss module: its settings (CrossEntropyLoss's label_smoothing, ...)
        settings = {k: v for k, v in vars(value).items() if not k.startswith("_") and k != "training"
                    and (v is None or isinstance(v, (bool, int, float, str)))}
        return f"a {kind}" + (f"({', '.join(f'{k}={v!r}' for k, v in sorted(settings.items()))})" if settings else "")
    return f"a {kind}"


def _describe_function(fn: types.FunctionType, describe: Callable) -> str:
    """A function as :func:`_describe` gives it: ``module.qualname``, then in brackets a digest of
    its code (bytecode, constants and the names it reads: ``lambda ps: SGD(ps, lr=0.1)`` and
    ``lr=0.2`` differ), its defaults and what it captures, by name. Globals it reads are not
    compared."""
    def code_text(code: types.CodeType) -> str:
        consts = (code_text(c) if isinstance(c, types.CodeType) else describe(c) for c in code.co_consts)
        return f"{code.co_code.hex()}|{'|'.join(consts)}|{','.join(code.co_names)}"

    parts = [f"code {hashlib.sha1(code_text(fn.__code__).encode()).hexdigest()[:8]}"]
    if fn.__defaults__ or fn.__kwdefaults__:
        parts.append(f"defaults {describe(fn.__defaults__ or ())} {describe(fn.__kwdefaults__ or {})}")
    cells = zip(fn.__code__.co_freevars, fn.__closure__ or ())
    captured = []
    for name, cell in cells:
        try:
            content = cell.cell_contents
        except ValueError:  # a cell not yet filled
            captured.append(f"{name}=(empty)")
            continue
        captured.append(f"{name}={'(itself)' if content is fn else describe(content)}")
    if captured:
        parts.append("captures " + ", ".join(captured))
    return f"{fn.__module__}.{fn.__qualname__}[{'; '.join(parts)}]"


def compile(
    model: nn.Module,
    example_inputs=None,
    *,
    loss_fn: Callable | None = None,
    optimizer: Callable | None = None,
    microbatches: int | None = None,
    schedule: str = "2bw",
    stages: int | None = None,
    plan=None,
    lr_scheduler: Callable | None = None,
    max_grad_norm: float | None = None,
    recompute: bool | None = None,
    seed: int = 0,
    check_batch: bool = True,
    cost_mode: str = "analytic",
    device_model=None,
    kernels: str = "auto",
    device: str | torch.device | None = None,
    verbose: bool = True,
    timeout: float | None = None,
    nonfinite: str | None = None,
    precision: str = "fp32",
    scaler=None,
    accumulate: str = "gradients",
    weights=None,
    leaf_modules=(),
    lookahead: int | None = None,
    chunks: int | None = None,
) -> "Pipeline":
    """Make ``model`` a pipeline-parallel trainer. See README.md for every argument.

    ``example_inputs``: one micro-batch, tuple (positional) or dict (keyword); None traces and
    plans on the first :meth:`Pipeline.step`, from that batch's first micro-batch.
    ``optimizer``: a callable taking ``[(original_name, parameter), ...]`` and returning a
    ``torch.optim.Optimizer`` (default: AdamW with torch's defaults). ``microbatches`` default
    8. ``stages``: pipeline depth d (None: the planner picks d and the data-parallel width w
    for the world size; in one process that is d=1). ``device``: ``"auto"``/None (CUDA when
    available, ``cuda:LOCAL_RANK`` under torchrun; else CPU), ``"cpu"`` or ``"cuda[:i]"``.
    ``precision``: ``"fp32"`` (default), ``"bf16"`` or ``"fp16"`` (:mod:`fxpipe.precision`:
    16-bit compute under autocast from fp32 master weights; fp16 scales the loss with
    ``scaler``'s settings, a ``torch.amp.GradScaler``, default GradScaler's). ``accumulate``:
    ``"gradients"`` (default) or ``"optimizer"``: AdamA, each micro-batch's gradient folded into
    Adam's moments at once and no gradient buffer (Adam/AdamW, one replica, no clipping).
    ``weights``: the initial weights, a state dict under the original model's keys, a
    ``torch.save`` file of one or a ``Pipeline.save`` checkpoint directory; each rank reads only
    its stage's keys. With a model built on the meta device, each rank materialises only its own
    stage, from ``weights`` or else the modules' initialisers seeded per module (fxpipe/materialize.py).
    ``leaf_modules``: module classes or qualified names captured as opaque calls
    (:func:`fxpipe.trace`), each run whole inside one stage: a module whose Python control flow
    depends on tensor values.
    ``lookahead`` (2bw, 1f1b): forwards every stage but the last runs ahead of 1F1B's order, each
    holding one more micro-batch's activations there, so that a rank goes on through its peer's
    hiccups (:func:`fxpipe.schedule.warmup`); None: the planner's choice (1 under 2bw where it
    fits, else 0).
    ``chunks`` (1f1b): stages per rank, interleaved 1F1B (Megatron-LM's: each rank runs its
    ``chunks`` stages in rounds of ``stages / chunks`` micro-batches, which cuts the flush's
    bubble ``chunks``-fold for ``chunks`` times the messages); ``stages`` counts every stage, so
    a replica runs on ``stages / chunks`` ranks and ``microbatches`` must be a multiple of that.
    None: the plan's, else 1.
    """
    config = PipelineConfig(
        loss_fn=loss_fn, optimizer=optimizer or default_optimizer, microbatches=microbatches, schedule=schedule,
        stages=stages, plan=plan, lr_scheduler=lr_scheduler, max_grad_norm=max_grad_norm, recompute=recompute,
        seed=seed, check_batch=check_batch, cost_mode=cost_mode, device_model=device_model, kernels=kernels,
        device=device, verbose=verbose, timeout=timeout, nonfinite=nonfinite, precision=precision, scaler=scaler,
        accumulate=accumulate, weights=weights,
        leaf_modules=as_leaf_modules(leaf_modules), lookahead=lookahead, chunks=chunks,
    )
    return Pipeline(model, example_inputs, config)


@dataclass(frozen=True)
class PipelineConfig:
    """Everything ``fxpipe.compile`` was asked for, checked once (README.md, "Keyword arguments")."""

    loss_fn: Callable | None = None  # loss_fn(output, target) -> scalar; None: the model's output/.loss
    optimizer: Callable = default_optimizer  # [(original_name, param), ...] -> torch.optim.Optimizer
    microbatches: int | None = None  # m per step and replica; None: DEFAULT_MICROBATCHES
    schedule: str = "2bw"  # "2bw" | "1f1b" | "gpipe" | "zb"
    stages: int | None = None  # d; None: the planner's choice for the world size
    plan: Any = None  # a fxpipe.Plan (or its JSON) to use instead of planning
    lr_scheduler: Callable | None = None  # optimizer -> scheduler, stepped once per step
    max_grad_norm: float | None = None  # clip by the global norm over all stages
    recompute: bool | None = None  # activation recomputation; None: the planner decides
    seed: int = 0  # dropout streams per (seed, micro-batch, stage)
    check_batch: bool = True  # first step: every rank passed the same batch
    cost_mode: str = "analytic"  # "analytic" | "measured" | "calibrated"
    device_model: Any = None  # fxpipe.cost.DeviceModel for the planner
    kernels: str = "auto"  # "auto" | "triton" | "torch" | "off"
    device: Any = None  # "auto"/None | "cpu" | "cuda[:i]" | torch.device
    verbose: bool = True  # rank 0 prints the plan
    # Seconds any wait for another rank may take (None: DEFAULT_TIMEOUT when fxpipe creates the
    # process group, else the group's own). On NCCL the group's watchdog enforces it.
    timeout: float | None = None
    # A NaN/inf loss or gradient, found by the per-step norm all-reduce before any update:
    # "raise" NonFiniteError on every rank, or "skip" that step's update everywhere and warn.
    # None: "raise", but "skip" under fp16, whose loss scaling skips overflowing steps by design.
    nonfinite: str | None = None
    precision: str = "fp32"  # "fp32" | "bf16" | "fp16": fxpipe.precision
    scaler: Any = None  # fp16: a torch.amp.GradScaler whose settings the loss scale follows
    # "gradients": sum micro-batch gradients, then step; "optimizer": AdamA (fold each into the
    # moments at once; no gradient buffer). Exact only for one replica without clipping.
    accumulate: str = "gradients"
    # initial weights (a state dict under the original keys, a torch.save file, a Pipeline.save
    # checkpoint); a model on the meta device without them: its modules' initialisers
    weights: Any = None
    # module classes (or qualified names) kept as opaque calls when the model is captured with
    # torch.fx.symbolic_trace (fxpipe.trace's leaf_modules): a module with data-dependent control flow
    leaf_modules: tuple = ()
    # forwards every stage but the last runs ahead of 1F1B's order (2bw, 1f1b); None: the planner's
    lookahead: int | None = None
    # stages per rank (interleaved 1F1B, 1f1b only); None: the plan's, else 1
    chunks: int | None = None

    @property
    def per_rank(self) -> int:
        """Stages per rank: ``chunks``, 1 when None."""
        return self.chunks or 1

    @property
    def policy(self) -> Precision:
        """``precision`` as the policy object (:class:`fxpipe.precision.Precision`)."""
        return Precision(self.precision)

    @property
    def on_nonfinite(self) -> str:
        """What a non-finite step does: ``nonfinite``, or its default for the precision."""
        return self.nonfinite or ("skip" if self.policy.scaled else "raise")

    def __post_init__(self) -> None:
        def bad(name, expected, found, fix=""):
            fix = f"; {fix}" if fix else ""
            raise ConfigError(f"fxpipe.compile: {name} must be {expected}, found {found!r}{fix}")

        if self.schedule not in SCHEDULES:
            bad("schedule", ", ".join(map(repr, SCHEDULES[:-1])) + f" or {SCHEDULES[-1]!r}", self.schedule,
                "'2bw' is PipeDream-2BW (the default), '1f1b' PipeDream-Flush, 'gpipe' GPipe, "
                "'zb' zero-bubble ZB-H1 (1f1b's numbers, the drain's backwards split into I and a deferred W)")
        for name in ("microbatches", "stages"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                bad(name, "an int >= 1 (or None)", v, {
                    "microbatches": f"pass e.g. microbatches=4, or None for the default ({DEFAULT_MICROBATCHES})",
                    "stages": "pass e.g. stages=2, or None for the planner's choice"}[name])
        if self.lookahead is not None:
            try:
                check_lookahead(self.schedule, self.lookahead)
            except ScheduleError as e:
                raise ConfigError(f"fxpipe.compile: {e}") from None
        if self.chunks is not None:
            if isinstance(self.chunks, bool) or not isinstance(self.chunks, int) or self.chunks < 1:
                bad("chunks", "an int >= 1 (or None)", self.chunks,
                    "pass e.g. chunks=2 (two stages per rank, interleaved 1F1B), or None for one")
            if self.chunks > 1 and self.plan is None:
                try:
                    # the stages and micro-batches are checked once known (planned, or the lazy path's)
                    check_chunks(self.schedule, self.stages or 2 * self.chunks,
                                 self.microbatches or DEFAULT_MICROBATCHES if self.stages else 2 * self.chunks,
                                 self.chunks, self.lookahead or 0)
                except ScheduleError as e:
                    raise ConfigError(f"fxpipe.compile: {e}") from None
        if self.plan is None and self.stages is not None and self.microbatches is not None and \
                self.microbatches < (least := min_microbatches(self.schedule, self.stages, self.lookahead or 0)):
            if least > self.stages:  # a lookahead asks for more
                fewer = f" or lookahead={self.microbatches - self.stages}" if self.microbatches >= self.stages else ""
                bad("microbatches", f">= stages + lookahead = {least} for schedule={self.schedule!r} with "
                    f"lookahead={self.lookahead}", self.microbatches,
                    f"each forward of lookahead moves 2bw's warm-up one micro-batch further: pass microbatches >= "
                    f"{least}{fewer}")
            bad("microbatches", f">= stages = {self.stages} for schedule={self.schedule!r}", self.microbatches,
                f"2bw's weight-version rule needs a step of at least one micro-batch per stage: pass "
                f"microbatches >= {self.stages}, fewer stages, or schedule='1f1b' or 'zb', which take fewer")
        if self.max_grad_norm is not None and not (isinstance(self.max_grad_norm, (int, float)) and self.max_grad_norm > 0):
            bad("max_grad_norm", "a number > 0 (or None for no clipping)", self.max_grad_norm,
                "pass e.g. max_grad_norm=1.0, or None to train without clipping")
        if self.cost_mode not in ("analytic", "measured", "calibrated"):
            bad("cost_mode", "'analytic', 'measured' or 'calibrated'", self.cost_mode,
                "'analytic' prices operators by FLOPs and bytes (the default), 'measured' profiles each node on "
                "rank 0, 'calibrated' fits the FLOP/byte model to this machine by timing the model")
        if self.kernels not in ("auto", "triton", "torch", "off"):
            bad("kernels", "'auto', 'triton', 'torch' or 'off'", self.kernels,
                "'auto' runs the fused Triton update on a GPU and torch.optim on the CPU, 'triton' insists on "
                "Triton, 'torch' runs the fused update's torch math, 'off' plain torch.optim")
        if not callable(self.optimizer):
            bad("optimizer", "a callable taking [(name, parameter), ...] and returning a torch.optim.Optimizer",
                self.optimizer, "pass e.g. functools.partial(torch.optim.AdamW, lr=1e-3)")
        if self.loss_fn is not None and not callable(self.loss_fn):
            bad("loss_fn", "a callable loss_fn(output, target) -> scalar tensor (or None)", self.loss_fn,
                "pass e.g. torch.nn.functional.cross_entropy, or None when the model's output is its loss")
        if self.lr_scheduler is not None and not callable(self.lr_scheduler):
            bad("lr_scheduler", "a callable taking the optimizer and returning a scheduler (or None)",
                self.lr_scheduler, "each stage has its own optimizer, so fxpipe builds one scheduler per stage: pass "
                "e.g. functools.partial(torch.optim.lr_scheduler.StepLR, step_size=10), or lambda opt: ...")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            bad("seed", "an int", self.seed, "pass e.g. seed=0: it seeds dropout's streams per micro-batch and stage")
        for name in ("check_batch", "verbose"):
            if not isinstance(getattr(self, name), bool):
                bad(name, "True or False", getattr(self, name))
        if self.timeout is not None and (isinstance(self.timeout, bool) or not isinstance(self.timeout, (int, float))
                                         or not self.timeout > 0):
            bad("timeout", "a number of seconds > 0 (or None)", self.timeout,
                f"pass e.g. timeout=600, or None for {DEFAULT_TIMEOUT:.0f} s (or the process group's own)")
        if self.nonfinite not in ("raise", "skip", None):
            bad("nonfinite", "'raise' or 'skip' (or None)", self.nonfinite,
                "'raise' stops at a NaN/inf loss or gradient, 'skip' drops that step's update and trains on")
        precision = self.policy  # raises ConfigError for an unknown one
        if precision.scaled and self.nonfinite == "raise":
            bad("nonfinite", "'skip' (or None) with precision='fp16'", self.nonfinite,
                "fp16 loss scaling skips every step whose scaled gradients overflow and lowers the scale; "
                "that is how it finds the scale. Leave nonfinite unset, or train with precision='bf16'")
        if self.scaler is not None and not precision.scaled:
            bad("scaler", "None unless precision='fp16'", self.scaler,
                f"precision={self.precision!r} does not scale the loss (only fp16's narrow exponent range needs it)")
        if self.scaler is not None:
            LossScaler.like(self.scaler)  # a GradScaler, or a clear error now
        if self.accumulate not in ("gradients", "optimizer"):
            bad("accumulate", "'gradients' or 'optimizer'", self.accumulate,
                "'optimizer' is AdamA: micro-batch gradients folded into Adam's moments, no gradient buffer")
        if self.accumulate == "optimizer":
            why = {"max_grad_norm": (self.max_grad_norm is not None, "clipping needs the whole batch's gradient, "
                                     "which AdamA never holds; pass max_grad_norm=None"),
                   "precision": (precision.scaled, "fp16's loss scale is only known to be safe after the step, "
                                 "but AdamA folds each scaled gradient into the moments at once; use 'bf16'"),
                   "nonfinite": (self.nonfinite == "skip", "a non-finite gradient is in the moments as soon as "
                                 "it exists, so its step cannot be skipped; leave nonfinite unset ('raise')")}
            for name, (conflict, reason) in why.items():
                if conflict:
                    bad(name, "compatible with accumulate='optimizer' (AdamA)", getattr(self, name), reason)
        if self.weights is not None and not isinstance(self.weights, (Mapping, str, os.PathLike)):
            bad("weights", "a state dict, a torch.save file's path or a Pipeline.save checkpoint directory (or None)",
                type(self.weights).__name__, "pass model.state_dict() of the same model, or its file's path")
        if isinstance(self.weights, (str, os.PathLike)) and not os.path.exists(self.weights):
            bad("weights", "an existing file or checkpoint directory", os.fspath(self.weights),
                "check the path (every rank reads it: on several nodes it must be on a filesystem they all see)")
        if not _known_device(self.device):
            bad("device", "'auto', 'cpu' or 'cuda[:i]' (or None, or a torch.device of those)", self.device,
                "fxpipe computes on the CPU or on CUDA GPUs")
        if self.recompute is not None and not isinstance(self.recompute, bool):
            bad("recompute", "True, False or None", self.recompute,
                "True recomputes activations in the backward where that saves memory, False never, None lets the "
                "planner decide")
        if self.device_model is not None and not isinstance(self.device_model, DeviceModel):
            bad("device_model", "a fxpipe.cost.DeviceModel (or None)", self.device_model,
                "pass e.g. fxpipe.cost.DeviceModel.for_device(torch.device('cpu')) with your figures replaced, or "
                "None for the device's defaults; the device to compute on is device=")
        if not all(isinstance(x, (type, str)) for x in self.leaf_modules):
            bad("leaf_modules", "module classes or qualified names (strings)", self.leaf_modules,
                "pass e.g. leaf_modules=[MyBlock] or leaf_modules=['encoder.branchy']")
        if self.plan is not None:
            object.__setattr__(self, "plan", _read_plan(self.plan))  # frozen: a Plan from here on

    # What every rank must be given alike: each runs its own stage(s) of one plan, so a setting one
    # rank reads differently either trains its stages differently (clipping, the learning rate
    # schedule, the seed) or posts messages of another size or at another time (the precision,
    # the schedule, the batch check, calibration), which fails mid-step or hangs. Not here: the
    # device (cuda:LOCAL_RANK), verbose and timeout, which may differ, and weights' path, which
    # may be mounted elsewhere on another node (its kind must agree).
    AGREED = ("schedule", "stages", "microbatches", "plan", "optimizer", "lr_scheduler", "loss_fn", "max_grad_norm",
              "recompute", "seed", "check_batch", "cost_mode", "device_model", "kernels", "nonfinite", "precision",
              "scaler", "accumulate", "weights", "leaf_modules", "lookahead", "chunks")

    def agreed_settings(self) -> dict[str, str]:
        """:attr:`AGREED`'s settings as comparable text (:func:`_describe`: a function by name, code,
        defaults and captured values, a partial's with its bound arguments; a plan by its JSON, a
        GradScaler by its settings):
        what :class:`Pipeline` compares across ranks."""
        out = {name: _describe(getattr(self, name)) for name in self.AGREED}
        out["leaf_modules"] = _describe(set(self.leaf_modules))  # compile's tuple of a set: any order
        if self.plan is not None:
            out["plan"] = self.plan.to_json()
        if self.weights is not None:
            out["weights"] = "a state dict" if isinstance(self.weights, Mapping) else "a path"
        if self.scaler is not None:
            sc = LossScaler.like(self.scaler)
            out["scaler"] = (f"GradScaler(init_scale={sc.scale}, growth_factor={sc.growth_factor}, "
                             f"backoff_factor={sc.backoff_factor}, growth_interval={sc.growth_interval})")
        return out

    def check_plan(self) -> None:
        """The arguments a given ``plan`` fixes must not say otherwise (each would be silently
        overridden): ``stages``, ``recompute``, ``microbatches`` and ``lookahead`` (the plan's would run),
        ``schedule`` and ``precision`` (compile's would run, on a plan whose cuts, memory and time
        were priced for another)."""
        p = self.plan
        if p is None:
            return
        if self.schedule != p.schedule:
            raise ConfigError(
                f"fxpipe.compile: schedule={self.schedule!r} contradicts the plan, made for schedule={p.schedule!r}: "
                f"its cuts, memory and time were priced for that schedule. Pass schedule={p.schedule!r}, or make a "
                f"plan for it (fxpipe.plan(..., schedule={self.schedule!r}))."
            )
        if self.microbatches is not None and self.microbatches != p.microbatches:
            raise ConfigError(
                f"fxpipe.compile: microbatches={self.microbatches} contradicts the plan, which runs m={p.microbatches} "
                f"(a global batch of b*m*w = {p.microbatch_size}*{p.microbatches}*{p.width}); the plan's would run. "
                f"Pass microbatches=None (or {p.microbatches}) to run the plan, or make a plan for "
                f"{self.microbatches} (fxpipe.plan(..., microbatches={self.microbatches}))."
            )
        if self.stages is not None and self.stages != p.stages:
            raise ConfigError(
                f"fxpipe.compile: stages={self.stages} contradicts the plan, which has {p.stages} stages (width "
                f"{p.width}); the plan's would run. Pass stages=None (or {p.stages}) to run the plan, or make a plan "
                f"for {self.stages} stages (fxpipe.plan(..., stages={self.stages}))."
            )
        if self.recompute is not None and self.recompute != any(p.recompute):
            where = [s for s, r in enumerate(p.recompute) if r]
            has = f"recomputes on stage(s) {where}" if where else "recomputes on no stage"
            raise ConfigError(
                f"fxpipe.compile: recompute={self.recompute} contradicts the plan, which {has}; the plan's "
                f"recomputation would run. Pass recompute=None to run the plan as it is, or make a plan with "
                f"fxpipe.plan(..., recompute={self.recompute})."
            )
        if self.lookahead is not None and self.lookahead != p.lookahead:
            raise ConfigError(
                f"fxpipe.compile: lookahead={self.lookahead} contradicts the plan, which runs lookahead={p.lookahead}; "
                f"the plan's would run. Pass lookahead=None to run the plan as it is, or make a plan with "
                f"fxpipe.plan(..., lookahead={self.lookahead})."
            )
        if self.chunks is not None and self.chunks != p.chunks:
            raise ConfigError(
                f"fxpipe.compile: chunks={self.chunks} contradicts the plan, which runs {p.chunks} stage(s) per rank; "
                f"the plan's would run. Pass chunks=None to run the plan as it is, or make a plan with "
                f"fxpipe.plan(..., chunks={self.chunks}).")
        if self.precision != p.precision:
            raise ConfigError(
                f"fxpipe.compile: precision={self.precision!r} contradicts the plan, made for precision="
                f"{p.precision!r}: compile's precision would run on stages whose memory and time were priced for "
                f"another. Pass precision={p.precision!r}, or make a plan for it (fxpipe.plan(..., "
                f"precision={self.precision!r}))."
            )


def _read_plan(plan):
    """compile's ``plan=``: a :class:`fxpipe.Plan`, or its JSON (``Plan.to_json()``)."""
    if isinstance(plan, Plan):
        return plan
    if not isinstance(plan, str):
        raise ConfigError(
            f"fxpipe.compile: plan must be a fxpipe.Plan or its JSON (Plan.to_json()), or None, found a "
            f"{type(plan).__name__}; pass fxpipe.plan(model, example_inputs, ...)'s result or the text of "
            f"`fxpipe plan --json PATH` (to ask for a depth alone, pass stages= instead)"
        )
    try:
        return Plan.from_json(plan)
    except Exception as e:  # noqa: BLE001 - whatever the text is, it is not a plan
        e = e.__cause__ or e  # from_json's PlanError wraps what the parse found
        path = os.path.isfile(plan) if len(plan) < 4096 else False
        hint = ("; this is a file's path: pass fxpipe.Plan.from_json(open(path).read())" if path else
                "; pass the text Plan.to_json() or `fxpipe plan --json PATH` wrote")
        raise ConfigError(
            f"fxpipe.compile: plan must be a fxpipe.Plan or its JSON (Plan.to_json()), found a string that is no "
            f"plan's JSON ({type(e).__name__}: {str(e)[:200]}){hint}"
        ) from None


@dataclass(frozen=True)
class Topology:
    """Who is where — the plan's ``layout`` (:func:`fxpipe.schedule.rank_of`: replica-major,
    rank ``replica * d + stage``, or stage-major, rank ``stage * w + replica``) — and the
    collective groups the runtime creates (the same, in the same order, on every rank).

    ``tied``: for each parameter read on several stages, the stages holding a copy. A tied
    weight's copies on every stage of every replica are summed in ONE all-reduce that the
    data-parallel all-reduce leaves out: two in-place reductions of the same gradient running at
    once would race.
    """

    stages: int
    width: int
    tied: tuple[tuple[str, tuple[int, ...]], ...] = ()
    layout: str = "replica"
    chunks: int = 1  #: stages per rank (interleaved 1F1B): stage j runs on its replica's lane j mod (stages / chunks)

    @property
    def lanes(self) -> int:
        """Ranks per replica."""
        return self.stages // self.chunks

    @property
    def world_size(self) -> int:
        return self.lanes * self.width

    def rank(self, stage: int, replica: int) -> int:
        """The rank that runs ``stage`` of ``replica``."""
        return rank_of(lane_of(stage, self.stages, self.chunks), replica, self.lanes, self.width, self.layout)

    def slot(self, stage: int, replica: int) -> int:
        """The key of ``(stage, replica)``'s worker: its rank were every stage on a rank of its own
        (with one chunk, its rank)."""
        return rank_of(stage, replica, self.stages, self.width, self.layout)

    def locate(self, slot: int) -> tuple[int, int]:
        """``(stage, replica)`` of the worker ``slot`` (:meth:`slot`)."""
        return stage_and_replica(slot, self.stages, self.width, self.layout)

    def lane_of_rank(self, rank: int) -> int:
        """Which rank of its replica ``rank`` is: the lane whose list it runs."""
        return stage_and_replica(rank, self.lanes, self.width, self.layout)[0]

    def slots_of(self, rank: int) -> list[int]:
        """The workers ``rank`` runs, its stages in order."""
        lane, replica = stage_and_replica(rank, self.lanes, self.width, self.layout)
        return [self.slot(lane + c * self.lanes, replica) for c in range(self.chunks)]

    def neighbours(self, slot: int) -> tuple[int | None, int | None]:
        """The ranks of the previous and the next stage of worker ``slot``'s (None at the ends)."""
        s, r = self.locate(slot)
        return (self.rank(s - 1, r) if s > 0 else None, self.rank(s + 1, r) if s < self.stages - 1 else None)

    @property
    def tied_stages(self) -> list[int]:
        return sorted({s for _, stages in self.tied for s in stages})

    def groups(self) -> dict[str, list[int]]:
        """Group name -> its member ranks, a rank once per stage of it that takes part (a rank of
        an interleaved pipeline joins once for its stages: :meth:`fxpipe.comm.Comm.all_reduce`)."""
        d, w = self.stages, self.width
        groups = {}
        for _, stages in self.tied:
            groups[tied_group(stages)] = sorted(self.rank(s, r) for r in range(w) for s in stages)
        for s in range(d):
            groups[dp_group(s)] = [self.rank(s, r) for r in range(w)]
        groups[EVERY_RANK] = sorted(self.rank(s, r) for r in range(w) for s in range(d))
        return groups

    def tied_groups_of(self, stage: int) -> dict[str, str]:
        """Tied parameter -> its group name, for the copies on ``stage``."""
        return {name: tied_group(stages) for name, stages in self.tied if stage in stages}

    def tied_owner_of(self, stage: int) -> dict[str, bool]:
        """Tied parameter -> whether ``stage`` counts it in the gradient norm (its first stage)."""
        return {name: stage == stages[0] for name, stages in self.tied if stage in stages}


def _add_note(e: BaseException, note: str) -> None:
    """PEP 678's ``e.add_note(note)``; on Python 3.10, which lacks it, the note is kept in
    ``e.__notes__`` all the same (3.10's tracebacks do not print it)."""
    if hasattr(e, "add_note"):
        e.add_note(note)
    else:
        e.__notes__ = [*getattr(e, "__notes__", []), note]


def _every_rank(call: str) -> Callable:
    """A :class:`Pipeline` method every rank calls at the same point of its script (``call``,
    e.g. ``"save()"``), run under :func:`_together`: a rank that does not come leaves the
    others a :class:`PeerError` that says so, not gloo's bare timeout."""
    def wrap(method: Callable) -> Callable:
        @functools.wraps(method)
        def run(self, *args, **kwargs):
            if not self.distributed:
                return method(self, *args, **kwargs)
            with _together(call, call, self._comm()):
                return method(self, *args, **kwargs)
        return run
    return wrap


@contextlib.contextmanager
def _together(what: str, call: str, comm: Comm | None) -> Iterator[None]:
    """The collectives of ``what``, part of ``call`` (``"save()"``), which every rank makes at the
    same point of its script. A rank that did not come (it stopped before it, skipped the call
    or made it at another step) leaves the others a bare gloo or NCCL error, a timeout or a
    closed connection: raised as a :class:`PeerError` saying so, with the reason a stopped rank
    left (:meth:`fxpipe.comm.Comm.failed_first`)."""
    try:
        yield
    except RuntimeError as e:
        if isinstance(e, FxpipeError) or not peer_failed(e, timeouts=True):
            raise
        first = comm.failed_first() if comm is not None else None
        raise PeerError(
            f"rank {dist.get_rank()}: {what} failed: {str(e).strip().splitlines()[-1]}"
            + (f"; {first}. Fix that error: its traceback is in that rank's log." if first else
               f". Every rank calls {call} at the same point of its script: another rank stopped before it (its "
               f"log says why: an InputError, a failed compile, ...), skipped it or made it at another step")) from e


class Pipeline:
    """A compiled pipeline. ``step`` trains, ``flush`` drains, ``state_dict`` gathers weights."""

    def __init__(self, model: nn.Module, example_inputs=None, config: PipelineConfig | None = None):
        if not isinstance(model, nn.Module):
            raise TypeError(f"fxpipe.compile expects an nn.Module, found {type(model).__name__}")
        self.model = model
        self.config = config = config or PipelineConfig()
        config.check_plan()
        self._setup_done = False
        self._heap_frozen = False  # _freeze_heap has run (at the first step)
        self.distributed, self.device, self.timeout = _init_distributed(config.device, config.timeout)
        self.rank = dist.get_rank() if self.distributed else 0
        self.world_size = dist.get_world_size() if self.distributed else 1
        self.plan = None
        self.t = 0  # batches given to step() so far
        self.epoch_start = 0  # the pipeline was last empty after this batch (a flush)
        self.skipped_steps: list[int] = []  # nonfinite="skip": batches whose update was dropped
        self._loss_sums: dict = {}  # AdamA: batch -> (all-reduced loss sum, handle), read a step later
        self._stopped: Exception | None = None  # nonfinite="raise" stopped the pipeline
        self._broken = False  # an action raised: what this rank has in flight may never be matched
        self._copies_unchecked = False  # the first step compares the ranks' copies of shared weights
        self._failure = ""  # what raised then, for the error every later call gets
        self._failed_at = ""  # the rank and action that raised it, where an action did
        # (directory, future, what unclaims its step if writing fails) of the checkpoint being
        # written, if any
        self._saving = None
        self._checkpoint_group = None  # the gloo group checkpoint writers coordinate over
        self._saving_registered = False
        # save(keep=)'s lineage: the steps this pipeline saved per root (absolute), and the root and
        # step it resumed from (a checkpoint at or before that step is this run's history)
        self._saved_steps: dict[str, set[int]] = {}
        self._resumed_from: tuple[str, int] | None = None
        # (rank, action, start s, end s) of every executed action while ``record`` is True;
        # fxpipe.simulate draws it like a simulated schedule (``Pipeline.dump``).
        self.record = False
        self.timeline: list[tuple[int, str, float, float]] = []
        self._t0 = time.perf_counter()
        self.profile = None  # a fxpipe.profile.Profile: where each later step's time goes
        self.workers: dict[int, StageWorker] = {}  # this process's ranks (set up with the plan)
        if self.distributed:
            _PIPELINES.add(self)
        if example_inputs is not None:
            self._setup(lambda: normalize_inputs(example_inputs))

    # ------------------------------------------------------------------ set-up

    def _setup(self, example: Callable[[], tuple[tuple, dict]]) -> None:
        """Trace ``example()`` (the ``(args, kwargs)`` of one micro-batch), plan and build this
        rank's stages. What a rank finds wrong on its own while tracing (its example, its model)
        every rank raises, before the plan is broadcast: a rank never fails alone while its peers
        wait for it in a collective."""
        o = self.config
        if self.distributed:
            self._check_settings_agree()
        try:
            gm = self._trace_and_check(example)
            problem = None
        except Exception as e:  # noqa: BLE001 - raised as it is here, and named on the other ranks
            problem = e
        self._raise_agreed(problem, PeerError, "rank {rank} could not set up its pipeline, so no rank does: ")
        m = o.microbatches or DEFAULT_MICROBATCHES
        kernels = _kernel_backend(o.kernels, self.device)
        plan = o.plan if o.plan is not None else self._agreed_plan(gm, m, kernels)
        self._check_plan_fits(plan, gm)
        self.plan = plan
        self._build_workers(plan, gm, kernels)
        # weights= and a meta model fill alike everywhere; else the first step compares the copies
        # (after a load or load_state_dict, which may replace what an unseeded model drew)
        self._copies_unchecked = self.distributed and self._source is None
        self._hold_no_weights(gm)
        self._setup_done = True
        if self.config.verbose and self.rank == 0:
            print(self.describe())

    def _check_copies_agree(self) -> None:
        """Every rank's copy of a parameter several ranks hold (a data-parallel replica's stage, a
        tied weight's copy on each stage that reads it) holds the same values, else every rank
        raises a ConfigError: each rank builds its stages from its own model, and a script that
        built it without a seed would train its replicas, or a tied weight's copies, apart. Run
        at the first step (a collective of a few numbers per parameter), so that weights loaded
        after compile count. Compared by checksums of a sample of each parameter (its first and
        last 4096 values and about 16384 spread over the rest), equal up to float rounding."""
        self._copies_unchecked = False
        mine: dict[str, tuple[float, float]] = {}
        for wk in self.workers.values():
            for name, t in wk.newest_weights().items():
                flat = t.detach().reshape(-1)
                sample = torch.cat([flat[:4096], flat[4096::max(1, flat.numel() // 16384)], flat[-4096:]])
                sample = sample.to("cpu", torch.float64)
                mine[name] = (float(sample.sum()), float((sample * torch.arange(1, sample.numel() + 1)).sum()))
        gathered: list = [None] * self.world_size
        with _together("the first step's check that the ranks' copies of shared parameters are equal", "step()",
                       self._comm()):
            dist.all_gather_object(gathered, mine)

        def alike(a: tuple, b: tuple) -> bool:
            return all(x == y or abs(x - y) <= 1e-9 * (abs(x) + abs(y)) or (math.isnan(x) and math.isnan(y))
                       for x, y in zip(a, b))

        differ = []
        for name in sorted({n for g in gathered for n in g}):
            holders = [r for r, g in enumerate(gathered) if name in g]
            first = gathered[holders[0]][name]
            apart = [r for r in holders if not alike(gathered[r][name], first)]
            if apart:
                alike_first = [r for r in holders if r not in apart]
                differ.append(f"{(self.staged.originals.get(name) or [name])[0]} (rank(s) {alike_first} against "
                              f"{apart})")
        if differ:
            more = f" and {len(differ) - 3} more" if len(differ) > 3 else ""
            raise ConfigError(
                f"fxpipe: at the first step, the ranks' copies of parameters that several ranks hold (a stage's "
                f"data-parallel replicas, or a tied weight's copy on each stage reading it) differ: "
                f"{', '.join(differ[:3])}{more}. Those copies must start equal, or they train apart. Build the "
                f"model alike on every rank: call torch.manual_seed(...) before constructing it, load the same "
                f"weights on every rank (from_pretrained, load_state_dict, pipe.load), or pass weights= to "
                f"fxpipe.compile")

    def _trace_and_check(self, example: Callable[[], tuple[tuple, dict]]) -> fx.GraphModule:
        """This rank's own part of the set-up: the example, its trace and what the trace shows
        eager PyTorch would refuse; sets what later steps check batches against."""
        from .materialize import Materializer, has_meta

        o = self.config
        args, kwargs = example()
        # meta example inputs: CPU zeros of their shapes (batches are checked against them, checkpoints keep them)
        args, kwargs = pytree.tree_map(lambda x: torch.zeros_like(x, device="cpu") if isinstance(x, torch.Tensor)
                                       and x.is_meta else x, (args, kwargs))
        self._example = kwargs if kwargs else args
        self._eval = None
        if not self.model.training:  # traced and trained as it is, as eager would train it
            warnings.warn(
                f"fxpipe.compile: {type(self.model).__name__} is in eval mode (model.eval(), the mode a Hugging Face "
                f"from_pretrained returns it in), so the pipeline trains it in eval mode: dropout off, BatchNorm on "
                f"its running statistics. Call model.train() before compile to train in training mode "
                f"(eval_step evaluates in eval mode either way)", RuntimeWarning, stacklevel=2)
        # a meta model traces as the same model on the CPU
        gm = trace(self.model, self._example, leaf_modules=o.leaf_modules)
        self._source = None
        if o.weights is not None or has_meta(self.model):
            # Each rank fills only the stage(s) it builds. Checked before the plan is broadcast:
            # a wrong key or a module without an initialiser fails alike on every rank.
            self._source = Materializer(self.model, gm, weights=o.weights, seed=o.seed, device=self.device)
            self._source.check()
        self.trace_info = gm.meta["fxpipe"]
        if o.loss_fn is None:  # the output must be the loss: found now, alike on every rank
            check_model_loss(gm)
        check_operand_dtypes(gm, o.policy.dtype)  # what eager would refuse, found now on every rank
        if not any(p.requires_grad for p in gm.parameters()):  # eager backward() would raise
            raise ConfigError(
                f"fxpipe.compile: nothing to train: every parameter of {type(self.model).__name__} has "
                f"requires_grad=False. Unfreeze the parameters to train (p.requires_grad_(True)); a pipeline "
                f"trains, and evaluates what it trained (eval_step)")
        self.inputs = InputSignature.record(self.trace_info, args, kwargs)  # checks every later batch
        self._targets: TargetSignature | None = None  # the first batch's target, which checks the later ones
        return gm

    def _hold_no_weights(self, gm: fx.GraphModule) -> None:
        """Let go of the model's weights once the stages hold their own copy, so that ``del model``
        frees them. What the pipeline keeps of the model and of its training trace (whose
        parameters, and on the symbolic_trace path whose modules, are the model's own) is what
        ``eval_step``'s second trace and the dumps read: copies of both with their parameters on
        the meta device (buffers and other tensors shared, not copied). A meta model, or one whose
        values come from ``weights=``, is kept as it is: its
        :class:`~fxpipe.materialize.Materializer` fills the eval stages' buffers from it. So is a
        model that cannot be deep-copied (one holding a lock, say)."""
        if self._source is not None:
            return
        try:
            model, graph = without_weights(self.model), without_weights(gm)
        except Exception:  # noqa: BLE001 - whatever deepcopy raises: keep both, as before
            return
        self.model, self.staged_graph = model, graph

    def _check_settings_agree(self) -> None:
        """Every rank was given the same settings (:attr:`PipelineConfig.AGREED`), else every rank
        raises the same ConfigError: the set-up's first communication, before any rank traces or plans.
        The ranks exchange a digest of each setting's text (a plan's JSON, or a closure's captured
        values, can be long, and every rank receives every rank's); only where some differ, which
        every rank then sees alike, do they exchange those settings' texts, for the message."""
        mine = self.config.agreed_settings()
        digests: list = [None] * self.world_size
        dist.all_gather_object(digests, {name: hashlib.sha256(text.encode()).hexdigest() for name, text in mine.items()})
        differing = [name for name in PipelineConfig.AGREED if len({d[name] for d in digests}) > 1]
        if not differing:
            return
        gathered: list = [None] * self.world_size
        dist.all_gather_object(gathered, {name: mine[name] for name in differing})
        differ = []
        for name in differing:
            by_value: dict[str, list[int]] = {}
            for r, settings in enumerate(gathered):
                by_value.setdefault(settings[name], []).append(r)
            differ.append(f"{name} is " + " but ".join(f"{v if len(v) <= 300 else v[:297] + '...'} on rank(s) {rs}"
                                                        for v, rs in by_value.items()))
        raise ConfigError(
            f"fxpipe.compile: every rank must be given the same settings (each runs its stage(s) of one plan), "
            f"found {'; '.join(differ)}. Pass the same arguments on every rank (under torchrun, the same "
            f"script and command line)")

    def _agreed_plan(self, gm: fx.GraphModule, m: int, kernels) -> Plan:
        """The plan every rank runs: calibrated (``cost_mode``), made on rank 0 alone and broadcast,
        or rank 0's planning error raised on every rank."""
        o = self.config
        plan_json = None
        device_model = o.device_model
        cost_mode = o.cost_mode
        if cost_mode == "calibrated":
            # Every rank at once, so the speed measured is a rank's while the others compute
            # too (on a CPU host they share cores, caches and memory bandwidth); then rank 0
            # alone, which tells how many ranks its host runs at full speed at once. Rank
            # 0's figures go into the plan. Then the roofline, from those figures.
            device_model = (device_model or DeviceModel.for_device(self.device)).calibrate(
                gm, self._example, optimizer=o.optimizer, torch_device=self.device,
                barrier=dist.barrier if self.distributed else None, host_ranks=self._ranks_sharing_cores(),
                alone=self.rank == 0, split=o.schedule == "zb")
            cost_mode = "analytic"
        if o.device_model is None and self.distributed and o.cost_mode != "analytic":
            # A ping-pong between ranks 0 and 1 (every rank takes part; rank 0's figures are
            # broadcast), so the planner prices a cut with this machine's links.
            device_model = (device_model or DeviceModel.for_device(self.device)).measure_p2p()
        failed: tuple[str, str] | None = None  # rank 0's planning error, for every rank to raise
        if self.rank == 0:
            try:
                from .partition import plan as make_plan

                world = self.world_size if self.distributed else (o.stages or 1) // o.per_rank
                made = make_plan(
                    gm,
                    self._example,
                    stages=o.stages if o.stages is not None else (None if self.distributed else 1),
                    microbatches=m,
                    schedule=o.schedule,
                    world_size=world,
                    cost_mode=cost_mode,
                    device=device_model,
                    recompute=o.recompute,
                    lookahead=o.lookahead,
                    chunks=o.per_rank,
                    torch_device=self.device,
                    # the per-step norm all-reduce (clipping, non-finite check): 2bw's 2 grad buffers
                    clip=norm_every_step(o.accumulate),
                    # how the priced stage holds its gradients: AdamA none, torch.optim .grad tensors,
                    # the fused kernels a flat accumulator and a scratch gradient (weights.weight_bytes)
                    accumulation=("optimizer" if o.accumulate == "optimizer" else
                                  "autograd" if kernels is None else "fused"),
                    precision=o.precision,
                )
                plan_json = made.to_json()
            except Exception as e:
                if not self.distributed:
                    raise
                failed, error = (type(e).__name__, str(e)), e
        if self.distributed:
            # rank 0 plans alone; the others wait here for its plan, or for its error
            box = [plan_json, failed]
            dist.broadcast_object_list(box, src=0)
            plan_json, failed = box
            if failed is not None:
                if self.rank == 0:
                    raise error
                name, message = failed
                kind = getattr(errors_module, name, None)
                kind = kind if isinstance(kind, type) and issubclass(kind, FxpipeError) else PlanError
                raise kind(f"rank 0 could not plan the pipeline ({name}): {message}")
        return Plan.from_json(plan_json)

    def _check_plan_fits(self, plan: Plan, gm: fx.GraphModule) -> None:
        """The plan fits this run: the example's micro-batch size, this rank's trace, the world size
        and AdamA's one replica. Each rank checks its own example and trace, and every rank
        raises if one found a problem (:meth:`_raise_agreed`), none waiting for another."""
        try:
            self._check_plan_fits_here(plan, gm)
            problem = None
        except FxpipeError as e:
            problem = e
        self._raise_agreed(problem, RuntimeMismatchError, "rank {rank} cannot run the plan, so no rank does: ")

    def _check_plan_fits_here(self, plan: Plan, gm: fx.GraphModule) -> None:
        o = self.config
        traced = self.trace_info.batch_size
        if traced is not None and plan.microbatch_size != traced:  # every rank has this plan: all raise
            raise ConfigError(
                f"fxpipe.compile: the plan runs micro-batches of {plan.microbatch_size} samples (b), but the example "
                f"micro-batch has {traced}; pass an example of {plan.microbatch_size} samples (the plan's global batch "
                f"is b*m*w = {plan.microbatch_size}*{plan.microbatches}*{plan.width})"
            )
        mine = graph_fingerprint(gm)
        if plan.graph_hash != mine:
            inputs = ", ".join(f"{tuple(x.shape)} {str(x.dtype).removeprefix('torch.')}"
                               for x in pytree.tree_leaves(self._example) if isinstance(x, torch.Tensor))
            raise RuntimeMismatchError(
                f"rank {self.rank}: this rank's trace of {self.trace_info.model_class} (fingerprint "
                f"{mine[:12]}, of an example micro-batch of {inputs or 'no tensors'}) differs from the plan's "
                f"(fingerprint {plan.graph_hash[:12]}). Every rank must build the same model and pass the same "
                f"example, or first batch (the same input shapes and dtypes); a saved plan only fits the model "
                f"and micro-batch size it was made for."
            )
        d, w = plan.stages, plan.width
        if self.distributed and plan.world_size != self.world_size:
            per = "" if plan.chunks == 1 else " / chunks"
            by = "" if plan.chunks == 1 else f" / {plan.chunks}"
            raise RuntimeMismatchError(
                f"the plan needs stages{per}*width = {d}{by}*{w} = {plan.world_size} ranks; the world has "
                f"{self.world_size}. Launch with --nproc-per-node={plan.world_size} or plan for {self.world_size} ranks."
            )
        if o.accumulate == "optimizer" and w > 1:  # every rank has this plan: all raise, none waits
            raise ConfigError(
                f"fxpipe.compile: accumulate='optimizer' (AdamA) needs one replica (width 1), the plan has width {w}: "
                f"replicas would each fold their own part of a micro-batch's gradient into the moments. "
                f"Pass stages={d * w} (a pure pipeline), or accumulate='gradients'."
            )

    def _build_workers(self, plan: Plan, gm: fx.GraphModule, kernels) -> None:
        """This rank's stages of ``gm`` cut by ``plan``, its workers, their communicators and the
        Program they run."""
        from .codegen import split

        o = self.config
        d, w = plan.stages, plan.width
        placed = Topology(d, w, layout=plan.layout, chunks=plan.chunks)  # the tied weights come with the stages
        slots = [sl for r in ([self.rank] if self.distributed else range(placed.world_size)) for sl in placed.slots_of(r)]
        build = sorted({placed.locate(sl)[0] for sl in slots})
        precision = o.policy
        prepare(gm, precision, self.device)  # the graph under autocast; the dtypes crossing cuts
        self.staged = self._split_agreed(split, gm, plan.assignment, build)
        self.staged_graph = gm
        self.topology = topo = replace(placed, tied=tuple((tp.name, tuple(tp.stages)) for tp in self.staged.tied
                                                          if len(tp.stages) > 1))
        # the stages that run opaque leaf modules: there and on every stage before them, which
        # weights a backward reaches may change from one micro-batch to the next
        leafy = [plan.assignment[n.name] for n in leaf_module_calls(gm)]
        if o.accumulate == "optimizer" and leafy:
            raise ConfigError(
                "fxpipe.compile: accumulate='optimizer' (AdamA) folds each micro-batch's gradient into the moments "
                "as it comes, so every micro-batch must reach the same weights; the model runs leaf_modules, whose "
                "Python may take another branch, and so reach other weights, each micro-batch. Use "
                "accumulate='gradients', which skips only the weights no micro-batch of a batch reached, as eager "
                "PyTorch does.")
        if o.accumulate == "optimizer" and topo.tied:
            raise ConfigError(
                f"fxpipe.compile: accumulate='optimizer' (AdamA) needs each weight on one stage; "
                f"{topo.tied[0][0]!r} is read on stages {list(topo.tied[0][1])}, whose parts of a micro-batch's "
                f"gradient would be folded into the moments apart. Untie it, plan these uses onto one stage, "
                f"or use accumulate='gradients'."
            )
        groups = topo.groups()
        hub = None if self.distributed else LocalHub(topo.world_size, groups)
        # A host-side wait with a timeout would block the thread that feeds the GPU: on NCCL
        # the process group's watchdog enforces the timeout instead (docs/design.md).
        wait_limit = self.timeout if self.device.type == "cpu" else None
        # one communicator per rank, which its stages share (their posts are the rank's, in one order)
        comms = {self.rank: DistComm(groups, timeout=wait_limit)} if self.distributed else {
            r: hub.comm(r) for r in range(topo.world_size)}
        for r in slots:
            s, rep = topo.locate(r)
            stage = self.staged.stages[s]
            cfg = WorkerConfig(
                schedule=plan.schedule,
                stages=d,
                width=w,
                microbatches=plan.microbatches,
                recompute=bool(plan.recompute[s]),
                loss_fn=o.loss_fn,
                optimizer=o.optimizer,
                lr_scheduler=o.lr_scheduler,
                max_grad_norm=o.max_grad_norm,
                seed=o.seed,
                kernels=kernels,
                strict_kernels=o.kernels == "triton",
                tied_groups=topo.tied_groups_of(s),
                tied_owner=topo.tied_owner_of(s),
                nonfinite=o.on_nonfinite,
                precision=precision,
                scaler=LossScaler.like(o.scaler) if precision.scaled else None,
                accumulate=o.accumulate,
                dynamic=any(at >= s for at in leafy),
            )
            try:  # the user's optimizer and scheduler factories run here, on this rank's stage alone
                self.workers[r] = StageWorker(stage, cfg, comms[topo.rank(s, rep)], rank=topo.rank(s, rep), replica=rep,
                                              trace_info=self.trace_info, device=self.device, neighbours=topo.neighbours(r))
                failed = None
            except Exception as e:  # noqa: BLE001 - raised below, on every rank
                failed = e
            if self.distributed or failed is not None:
                self._raise_agreed(failed, FxpipeError, "rank {rank} could not set up its stage, so no rank goes on: ")
        self.hub = hub
        if self.distributed:  # runs before the group's teardown that _init_distributed registered
            atexit.register(_drain_at_exit, weakref.ref(self), [wk.in_flight() for wk in self.workers.values()])
        for r, wk in self.workers.items():
            if wk.store.fallback and wk.replica == 0:
                warnings.warn(f"fxpipe: stage {wk.index} updates with torch.optim instead of the fused kernels: "
                              f"{wk.store.fallback}", RuntimeWarning, stacklevel=3)
        # NORM every step, but for AdamA (schedule.norm_every_step); pipe.dump() draws this Program
        self.program = Program.of_plan(plan, topo.tied_stages, o.accumulate)

    def _split_agreed(self, split, gm, assignment, build):
        """``split`` this rank's stage(s); where each rank fills its own from a source (a meta
        model, ``weights``), every rank then learns whether all could: one that could not raises
        its error, the others say so, and none waits for it in the collectives that follow."""
        failed = None
        try:
            staged = split(gm, assignment, build=build, device=self.device, source=self._source)
        except Exception as e:  # noqa: BLE001 - re-raised below, after the ranks agree
            failed = e
        if self._source is not None:
            self._raise_agreed(failed, FxpipeError, "rank {rank} could not build its stage, so no rank goes on: ")
        elif failed is not None:
            raise failed
        return staged

    def __repr__(self) -> str:
        where = f"rank {self.rank} of {self.world_size}" if self.distributed else "one process"
        head = f"<fxpipe.Pipeline of {type(self.model).__name__}"
        if not self._setup_done:
            return f"{head}: schedule={self.config.schedule}, {where}, planned at its first step>"
        p = self.plan
        return (f"{head}: schedule={p.schedule} d={p.stages} w={p.width} b={p.microbatch_size} m={p.microbatches} "
                f"precision={_precision_label(p.precision, self.model)}, {where} on {self.device}, {self.steps} step(s)>")

    def describe(self) -> str:
        self._require_setup("describe")
        o = self.config
        opt = getattr(o.optimizer, "func", o.optimizer)
        opt_name = getattr(opt, "__name__", type(opt).__name__)
        return (
            f"{self.plan}\n"
            f"fxpipe: schedule={self.plan.schedule} stages={self.plan.stages} width={self.plan.width} "
            f"microbatches={self.plan.microbatches} optimizer={opt_name} "
            f"max_grad_norm={o.max_grad_norm} precision={o.precision} device={self.device} "
            f"mode={'torchrun' if self.distributed else 'single-process'}\n"
            f"update{' on this rank' if self.distributed else ''}: "
            + ", ".join(f"stage {s} {path}" for s, path in sorted({wk.index: wk.store.path for wk in self.workers.values()}.items()))
        )

    # ------------------------------------------------------------------ training

    def step(self, inputs, target=None, *, sync: bool = True):
        """One optimizer step over one global batch (``microbatches * width`` micro-batches, split
        along dim 0). Every rank passes the same batch. Returns the batch's mean loss on every
        rank: a float on the rank(s) holding the last stage (``sync=False``: a 0-dim float64
        tensor on the device, read later with ``float(loss)``, no host sync), elsewhere a
        :class:`Loss` that resolves on ``float()``/``.item()`` (under 2bw the last stage computes
        batch t's loss after the first stage's ``step(t)`` returned). A batch that does not fit the
        traced example (:mod:`fxpipe.inputs`: b*m*w samples, names, dtypes, shapes, devices) raises
        :class:`~fxpipe.errors.InputError` before anything is split or communicated."""
        if self._stopped is not None:
            raise self._stopped
        self._check_not_broken("step")
        if self.profile is None:
            return self._step(inputs, target, sync)
        start, waited = time.perf_counter(), self._waited()
        try:
            return self._step(inputs, target, sync)
        finally:
            self.profile.step(time.perf_counter() - start, self._waited() - waited)

    def _checked(self, args, kwargs, target, what: str):
        """``self.inputs.check`` of a batch for ``what`` (step or eval_step), before anything is
        split or communicated. A batch refused on this rank alone leaves its peers waiting on it,
        so the rank leaves them the reason first (:meth:`fxpipe.comm.DistComm.report`)."""
        plan = self.plan
        try:
            checked = self.inputs.check(args, kwargs, target, microbatches=plan.microbatches, width=plan.width,
                                        device=self.device, needs_target=self.config.loss_fn is not None, what=what,
                                        targets=self._targets)
            if self._targets is None and target is not None:
                self._targets = TargetSignature.record(target)
            return checked
        except InputError as e:
            for wk in self.workers.values():
                wk.comm.report(f"InputError: {str(e).splitlines()[0]}")
            _REFUSED_HERE.add(id(self))  # its peers may be waiting for it: at exit it waits for them briefly
            raise

    def _freeze_heap(self) -> None:
        """Every rank waits for the slowest: a full (generation 2) garbage collection on one rank
        stalls them all. Tracing and planning leave a large heap (graphs, nodes, cost
        expressions) that such a collection walks every time: ~240 ms, 7x a step of
        benchmarks/soak.py. Frozen, it is left out of later collections (refcounting still frees
        it; cyclic garbage among it waits for ``gc.unfreeze()``, called at exit). Done at the first
        step, not at compile, so that a model the script deleted after ``compile`` (a Hugging Face
        model is cyclic garbage then) is collected first rather than frozen."""
        self._heap_frozen = True
        gc.collect()
        gc.freeze()
        atexit.register(gc.unfreeze)  # at exit everything is collected as usual

    def _comm(self) -> Comm | None:
        """This process's communicator (the one of its first rank): what reports and failures go
        through; None before the pipeline is set up."""
        return next((wk.comm for wk in self.workers.values()), None)

    def _waited(self) -> float:
        return sum(c.waited for c in {id(wk.comm): wk.comm for wk in self.workers.values()}.values())

    def _step(self, inputs, target, sync: bool):
        args, kwargs = batch_inputs(inputs, "step()")
        if not self._setup_done:  # the lazy path: the first micro-batch defines the signature
            m, w = self.config.microbatches or DEFAULT_MICROBATCHES, self._width_hint()
            def first_microbatch():
                check_first_batch(args, kwargs, target, microbatches=m, width=w, device=self.device,
                                  needs_target=self.config.loss_fn is not None, what="step()")
                return _split_batch((args, kwargs), m * w)[0]

            self._setup(first_microbatch)
        if not self._heap_frozen:
            self._freeze_heap()
        plan = self.plan
        m, w = plan.microbatches, plan.width
        # Before anything is split or communicated: a bad batch fails alike on every rank.
        args, kwargs = self._checked(args, kwargs, target, "step()")
        chunks = _split_batch((args, kwargs, target), m * w)
        if self.t == 0 and self.config.check_batch and self.distributed:
            _check_same_batch((args, kwargs, target), self.world_size, self.device, self._comm())
        if self._copies_unchecked:
            self._check_copies_agree()
        self.t += 1
        t = self.t
        for r, wk in self.workers.items():
            self._give(wk, wk.stage, chunks, first=(t - 1) * m + 1)
        self._execute(lambda stage: self.program.segment(stage, t, self.epoch_start), f"step {t}")
        self._stepped_on()
        self._report_nonfinite(t)
        self._check_loss_sums(t)
        return self._batch_loss(t, sync)

    def _give(self, wk: StageWorker, stage, chunks: list, first: int) -> None:
        """Hand worker ``wk`` its replica's micro-batches of ``chunks`` (``_split_batch``'s) as
        micro-batches ``first, first+1, ...``: the model inputs ``stage`` reads, and the targets
        on the last stage."""
        m = self.plan.microbatches
        last = wk.index == self.plan.stages - 1 and self.config.loss_fn is not None
        for j in range(m):
            named, target = self._microbatch(chunks[wk.replica * m + j])
            wk.inputs[first + j] = {n: named[n] for n in stage.model_inputs}
            if last:
                wk.targets[first + j] = target

    def _microbatch(self, chunk) -> tuple[dict[str, torch.Tensor], Any]:
        """(model input name -> tensor, target) of one micro-batch chunk of ``_split_batch``.
        Under 2bw batch t's last backwards run in step t+1, after ``step`` returned: they must
        not read the caller's tensors, which a loop may refill, so a chunk already on the device
        (a view of the caller's batch) is copied; elsewhere the batch is done with by then."""
        moved = to_device(chunk, self.device)
        if self.plan.schedule == "2bw":
            moved = pytree.tree_map(lambda x, given: x.clone() if isinstance(x, torch.Tensor) and x is given else x,
                                    moved, chunk)
        args, kwargs, target = moved
        return dict(zip(self.trace_info.input_names, self.trace_info.flatten_inputs(args, kwargs))), target

    def _width_hint(self) -> int:
        """Data-parallel width before planning, to cut the first micro-batch at the right size:
        world / stages when stages is given; with stages=None the lazy path plans a pure
        pipeline (d = world size, w = 1), since the micro-batch size must be known to trace. A
        given plan has its own width."""
        if self.config.plan is not None:
            return self.config.plan.width
        v = self.config.per_rank
        if self.config.stages is None:
            d, m = (self.world_size if self.distributed else 1) * v, self.config.microbatches
            ahead = self.config.lookahead or 0
            if m is not None and m < (least := min_microbatches(self.config.schedule, d, ahead)):
                more = f" plus lookahead={ahead}" if least > d else ""
                raise ConfigError(
                    f"fxpipe.compile: microbatches={m} is fewer than the {d} stages{more} a lazily compiled pipeline "
                    f"runs on {d} ranks (stages=None: one stage per rank), and schedule={self.config.schedule!r} "
                    f"needs at least one micro-batch per stage{more and ' and one per forward of lookahead'}. Pass "
                    f"microbatches >= {least}, or stages= with a data-parallel width (world = stages x width), or "
                    f"schedule='1f1b' or 'zb', which take fewer")
            self.config = replace(self.config, stages=d)
        return max(1, self.world_size // (self.config.stages // v)) if self.distributed else 1

    def _execute(self, segment: Callable[[int], list[Action]], what: str) -> None:
        """Run every local rank's segment (``segment(lane)``, the rank's lane in its replica) to its
        end, in list order: the runtime never skips, reorders or adds an action. Under torchrun
        the one local rank runs it straight through (a wait blocks); in one process the ranks are
        interleaved, each run until its next action waits for an operation that has not completed."""
        topo = self.topology
        ranks = [self.rank] if self.distributed else range(topo.world_size)
        lists = {r: segment(topo.lane_of_rank(r)) for r in ranks}
        try:
            self._run_lists(lists, what)
        except BaseException as e:
            where = f"{self._failed_at}: " if self._failed_at else ""
            self._broken, self._failure = True, f"{what} ({where}{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
            _BROKEN_HERE[0] = True  # for the exit meeting, however long this pipeline lives
            raise

    def _stepped_on(self) -> None:
        """A step (or eval_step) ran to its end, with every rank: a batch this rank refused
        before (caught) stands no more, nor its report to the peers."""
        if id(self) in _REFUSED_HERE:
            _REFUSED_HERE.discard(id(self))
            for wk in self.workers.values():
                wk.comm.withdraw()

    def _run_lists(self, lists: dict[int, list[Action]], what: str) -> None:
        """Run each rank's list (``{rank: actions}``), each action by the worker of its stage."""
        topo = self.topology
        replica = {r: topo.locate(topo.slots_of(r)[0])[1] for r in lists}

        def worker(r: int, a: Action) -> StageWorker:
            return self.workers[topo.slot(a.stage, replica[r])]

        if self.distributed:
            (r, lst), = lists.items()
            for i in range(len(lst)):
                self._run(r, worker(r, lst[i]), lst, i)
            return
        stopped = interleave(lists, lambda r, a: worker(r, a).ready(a),
                             lambda r, i: self._run(r, worker(r, lists[r][i]), lists[r], i))
        stuck = {r: lists[r][i] for r, i in stopped.items()}
        if stuck:
            raise RuntimeError(
                f"fxpipe: {what} cannot finish in one process; next actions: "
                + ", ".join(f"rank {r}: {a}" for r, a in stuck.items())
                + "; incomplete posts: " + " | ".join(self.hub.engine.blocked())
                + ". This is a bug in fxpipe's schedule; please report it with the plan."
            )

    def _ranks_sharing_cores(self) -> int:
        """The world size where every rank is a CPU process on one host, sharing its cores (what
        the simulator models, :attr:`fxpipe.cost.DeviceModel.host_cores`); otherwise 1: on a GPU
        each rank has a device of its own, and ranks across hosts are not modelled as sharing."""
        if not self.distributed or self.device.type != "cpu":
            return 1
        hosts: list = [None] * self.world_size
        dist.all_gather_object(hosts, socket.gethostname())
        return self.world_size if len(set(hosts)) == 1 else 1

    def _run(self, r: int, wk: StageWorker, lst: list[Action], i: int) -> None:
        a = lst[i]
        start, waited = time.perf_counter(), wk.comm.waited
        try:
            wk.run(a)
        except FxpipeError:
            raise
        except Exception as e:
            grid = format_actions({r: lst}, mark=(r, i), rows=range(max(0, i - 4), min(len(lst), i + 3)))
            posted = getattr(wk.comm, "last_posted", "")  # NCCL's watchdog errors name no action
            posted = f" (its last posted communication: {posted})" if posted else ""
            why = str(e).strip().splitlines()[0] if str(e).strip() else ""
            if not isinstance(e, dist.DistError):  # this rank's own failure, not a peer's: tell them
                wk.comm.report(f"{type(e).__name__} in action {a}: {why}")
                first = ""
            elif first := wk.comm.failed_first():  # a communication failed: say what stopped the peers
                first = f"; {first}"
            # The error itself goes on (a loss_fn's ValueError stays one, an out-of-memory error
            # stays catchable as such), with where it happened as a note, as torch's own pipeline
            # schedules re-raise theirs.
            self._failed_at = f"rank {r}, action {a}"
            _add_note(e, f"fxpipe: rank {r} failed running action {a}{posted}{first}\n{grid}")
            raise
        blocked = wk.comm.waited - waited  # an action waits before it works (its receive, a reduction)
        if self.profile is not None:
            self.profile.action(a.kind, time.perf_counter() - start, blocked, a.stage)
        if self.record:  # drawn from the end of its wait: the wait is the rank's idle time
            self.timeline.append((r, str(a), start + blocked - self._t0, time.perf_counter() - self._t0))

    def _batch_loss(self, t: int, sync: bool):
        """Batch t's mean loss from the LOSS action's all-reduce: a float (a device tensor with
        ``sync=False``) on ranks holding the last stage, a :class:`Loss` elsewhere."""
        plan = self.plan
        count = plan.microbatches * plan.width
        parts = {r: wk.batch_loss.pop(t) for r, wk in self.workers.items()}
        if self.config.accumulate == "optimizer":  # its non-finite flags travel in the loss sums
            self._loss_sums[t] = next(iter(parts.values()))[1:]
        last = [r for r in parts if self.topology.locate(r)[0] == plan.stages - 1]
        if not last:
            _, total, handle = next(iter(parts.values()))
            return Loss(total, handle, count)
        _, total, handle = parts[last[0]]
        handle.wait()  # the other ranks posted theirs earlier (they run ahead): a short wait
        mean = total[0] / count
        return float(mean) if sync else mean

    def flush(self) -> None:
        """Finish every micro-batch given so far and apply its update (2bw drains its pipeline;
        the next step fills it again, with the same weight-version rule), and wait for every send
        and loss all-reduce this rank has in flight: after it, this rank's part is done, so a
        group the script created may be destroyed."""
        self._check_not_broken("flush")
        if not self._setup_done or self.epoch_start == self.t:
            return
        t = self.t
        self._execute(lambda stage: self.program.drain(stage, t, self.epoch_start), f"flush after step {t}")
        for wk in self.workers.values():
            wk.drain()
        # drained: what follows may raise (a non-finite batch found in the drain), and a second
        # flush (the load that error asks for) must not run the drain again
        self.epoch_start = t
        self._report_nonfinite(None)
        self._check_loss_sums(None)
        if self.config.accumulate == "optimizer":
            self._check_drained_updates(t)

    def _report_nonfinite(self, through: int | None) -> None:
        """Report non-finite batches once EVERY rank has seen them: by the end of the segment of
        step ``through`` every stage ran their NORM_WAIT (``None``: a flush, which runs them
        all). Each rank decides from the same all-reduced parts, so all raise, or all warn, in
        the same call. The workers already left those updates out (and, for "raise", every
        later one), so weights and optimizer state are those before the batch."""
        found: dict[int, set[int]] = {}
        for wk in self.workers.values():
            for t, stages in wk.nonfinite.items():
                found.setdefault(t, set()).update(stages)
        ready = sorted(t for t in found if through is None or self.program.norm_done(t, through, self.epoch_start))
        for wk in self.workers.values():
            for t in ready:
                wk.nonfinite.pop(t, None)
        if not ready or self._stopped is not None:  # after a stop (flush, state_dict): reported already
            return
        where = "; ".join(f"step {t}: stage(s) {sorted(found[t])}" for t in ready)
        if self.config.on_nonfinite == "skip":
            self.skipped_steps.extend(ready)
            if self.config.policy.scaled:
                return  # fp16's loss scaling: an overflow is how the scale is found, not news
            warnings.warn(f"fxpipe: a non-finite loss or gradient in {where}; that update was skipped on every "
                          f"rank (nonfinite='skip'), {len(self.skipped_steps)} skipped so far", RuntimeWarning,
                          stacklevel=3)
            return
        self._stopped = NonFiniteError(
            f"a non-finite (NaN or infinite) loss or gradient in {where}. No weight or optimizer state took it in: "
            f"every rank holds the state from before step {ready[0]}, and this pipeline is stopped. Load the last "
            f"checkpoint and lower the learning rate or clip (max_grad_norm=), check the data of that step, or "
            f"pass nonfinite='skip' to drop such updates and train on."
        )
        raise self._stopped

    def _check_drained_updates(self, t: int) -> None:
        """AdamA at a flush: an ``UPDATE`` the drain ran after its batch's ``LOSS`` (under 2bw
        every stage but the last updates batch t in the drain) has no later loss sum to carry its
        flag. One more all-reduce over every rank (each calls ``flush``) carries them, so a
        non-finite gradient folded in by step t stops the pipeline here, before a ``save``."""
        posted = []
        for wk in self.workers.values():
            local = torch.zeros(1, dtype=torch.float64, device=wk.device)
            if wk.updated_flags:
                local += torch.stack(wk.updated_flags).sum().to(wk.device)
                wk.updated_flags.clear()
            posted.append((local, wk.comm.all_reduce(local, EVERY_RANK, f"the non-finite flags at the flush after step {t}",
                                                     member=wk.index)))
        for _, handle in posted:
            handle.wait()
        if self._stopped is None and not all(bool(torch.isfinite(total).all()) for total, _ in posted):
            self._stopped = _adama_stopped(f"gradient by step {t}", "the last steps")
            raise self._stopped

    def _check_loss_sums(self, through: int | None) -> None:
        """AdamA (``accumulate="optimizer"``) has no per-step norm all-reduce: each rank adds a NaN
        to its part of a loss sum once it updated with a non-finite gradient, so every rank finds
        it in the same sum. Batch t's sum is complete on every rank by the end of step t+1's
        segment (``None``: a flush, after which all are). Every rank raises in the same call."""
        ready = sorted(t for t in self._loss_sums if through is None or t < through)
        for t in ready:
            total, handle = self._loss_sums.pop(t)
            handle.wait()
            if self._stopped is None and not bool(torch.isfinite(total).all()):
                self._stopped = _adama_stopped(f"loss or gradient by step {t}", "that step")
        if self._stopped is not None and ready:
            raise self._stopped

    # ------------------------------------------------------------------ evaluation

    @_every_rank("eval_step()")
    def eval_step(self, inputs, target=None):
        """Forward-only pipelined loss of one global batch with the newest weights and dropout
        off (stages generated from a second, eval-mode trace that reads the training weights and
        buffers), run as a forward-only schedule (:meth:`fxpipe.schedule.Program.eval`) by the
        same executor. Flushes first. Returns the mean loss over every micro-batch, on every rank."""
        self._require_setup("eval_step")
        plan = self.plan
        m, w = plan.microbatches, plan.width
        args, kwargs = self._checked(*batch_inputs(inputs, "eval_step()"), target, "eval_step()")
        self.flush()
        if self._eval is None:
            self._eval = self._checked_eval(self._build_eval())
        chunks = _split_batch((args, kwargs, target), m * w)
        borrowed = self._borrowed_buffers()
        for r, wk in self.workers.items():
            s = wk.index
            stage = self._eval.stages[s]
            newest = wk.store.compute(wk.store.updates)  # what a training forward would read next
            # this worker's own buffers (BatchNorm statistics), passed in as its weights are: in one
            # process the replicas of a stage share one eval module
            eval_buffers = set(stage.buffer_names)
            wk.eval_stage = stage
            wk.eval_weights = {**{n: newest[n].detach() for n in stage.param_names},
                               **{n: b for n, b in wk.buffers.items() if n in eval_buffers}, **borrowed.get(r, {})}
            wk.eval_loss.zero_()
            self._give(wk, stage, chunks, first=1)
        try:
            self._execute(self.program.eval, "eval_step")
            self._stepped_on()
            for wk in self.workers.values():
                wk.drain()
        finally:
            for wk in self.workers.values():
                wk.eval_stage, wk.eval_weights = None, {}
        _, total, handle = next(iter(self.workers.values())).batch_loss.pop(1)
        for wk in self.workers.values():
            wk.batch_loss.clear()
        handle.wait()
        return float(total[0] / (m * w))

    def _borrowed_buffers(self) -> dict[int, dict[str, torch.Tensor]]:
        """Local rank -> the buffers its eval stage reads that its training stage does not hold,
        with their newest values, from the training stage that does (the first such, in the same
        replica). A buffer training updates in place on one stage and reads again on a later one
        reaches the later stage as a value that crosses the cut; eval mode, which updates
        nothing, reads the buffer itself there. Every rank finds the same borrowings (from the
        plan), so under torchrun they all-gather the values, or all skip it, alike."""
        holders: dict[str, int] = {}
        for st in self.staged.stages:
            for n in st.buffer_names:
                holders.setdefault(n, st.index)
        needs = {s: {n: holders[n] for n in st.buffer_names if n in holders and n not in self.staged.stages[s].buffer_names}
                 for s, st in enumerate(self._eval.stages)}
        if not any(needs.values()):
            return {}
        lent = {j for need in needs.values() for j in need.values()}
        mine = {r: {n: wk.buffers[n] for need in needs.values() for n, j in need.items() if j == wk.index}
                for r, wk in self.workers.items() if wk.index in lent}
        if self.distributed:  # small state (counts, statistics): gathered as objects, on the CPU
            found: list = [None] * self.world_size
            dist.all_gather_object(found, {r: {n: b.cpu() for n, b in part.items()} for r, part in mine.items()})
            mine = {r: part for got in found for r, part in got.items()}
        out: dict[int, dict[str, torch.Tensor]] = {}
        for r, wk in self.workers.items():
            need = needs[wk.index]
            out[r] = {n: mine[self.topology.slot(j, wk.replica)][n].to(self.device) for n, j in need.items()}
        return out

    def _checked_eval(self, staged):
        """``staged`` (the eval-mode stages), once every rank found that each of its eval stages
        reads only parameters its training stage holds; else every rank raises (a rank that
        raised alone would leave the others in the eval pass). After a flush: the group is idle."""
        problem = None
        for wk in self.workers.values():
            missing = [n for n in staged.stages[wk.index].param_names if n not in wk.layout_names()]
            if missing and problem is None:
                problem = (f"eval stage {wk.index} reads parameters {missing[:3]} that training stage {wk.index} does "
                           f"not hold: the eval-mode trace differs from the training one beyond dropout. Evaluate "
                           f"with the state_dict() loaded into the plain model instead, and report the model to fxpipe.")
        self._raise_agreed(problem, FxpipeError, "rank {rank}: ")
        return staged

    def _raise_agreed(self, problem: str | Exception | None, kind: type[Exception], elsewhere: str,
                      group=None) -> None:
        """Raise on every rank if any rank found a problem: ``problem`` is this rank's message or
        exception (None: none found), each rank checking only its own stages. Under torchrun the
        messages are all-gathered on ``group``, so a rank does not raise alone while the others
        wait for it. A rank raises its own problem (an exception as it is, a message as
        ``kind``), or else the first rank's message after ``elsewhere`` (formatted with ``rank``),
        as that rank's class where it raised an fxpipe error (``except InputError`` then catches it
        on every rank), else as ``kind``."""
        text = None if problem is None else (f"{type(problem).__name__}: {problem}"
                                             if isinstance(problem, Exception) else problem)
        if self.distributed:
            found: list = [None] * self.world_size
            name = type(problem).__name__ if isinstance(problem, Exception) else None
            dist.all_gather_object(found, None if text is None else (name, text), group=group)
            first = next(((r, p) for r, p in enumerate(found) if p is not None), None)
            if problem is None and first is not None:  # the first rank's error, as that rank's kind
                r, (name, message) = first
                same = getattr(errors_module, name, None) if name else None
                kind = same if isinstance(same, type) and issubclass(same, FxpipeError) else kind
                text = elsewhere.format(rank=r) + message
        if isinstance(problem, Exception):
            raise problem
        if text is not None:
            raise kind(text)

    def _build_eval(self):
        """Stages of an eval-mode trace by the training trace's tracer, cut where the training
        stages are: each eval node takes the training stage of its counterpart, the training node
        of the same operator that is as many calls into the same module (:func:`_node_keys`;
        dropout nodes, absent in eval, simply vanish, and an operator only training runs shifts
        no other's counterpart), carried forward in graph order so stages stay contiguous."""
        from .codegen import split

        was = self.model.training
        self.model.eval()
        try:  # in eval mode until split has copied the leaf modules (a copy keeps its mode)
            # the training trace's tracer, so both graphs record operators at the same level;
            # what it would warn of (activation checkpointing traced without it) compile said already
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", r"fxpipe: .* (activation checkpointing|checkpoint)", RuntimeWarning)
                gm = trace(self.model, self._example, leaf_modules=self.config.leaf_modules,
                           prefer=self.trace_info.path)
            train = {key: self.staged.assignment[name] for name, key in _node_keys(self.staged_graph).items()
                     if name in self.staged.assignment}
            mapping, stage = {}, 0
            for name, key in _node_keys(gm).items():
                stage = max(stage, train.get(key, stage))
                mapping[name] = stage
            _fill_empty_eval_stages(gm, mapping, self.plan.stages)
            build = sorted({wk.index for wk in self.workers.values()})
            prepare(gm, self.config.policy, self.device)
            # a meta model's eval stages: the workers' newest weights and buffers, else the training source's
            source = None if self._source is None else _Newest(self.workers.values(), self._source)
            # eval_step passes every parameter in (the workers' newest weights): the eval stages
            # hold only buffers and constants, no copy of the weights
            return split(gm, mapping, build=build, device=self.device, source=source, weights=False)
        finally:
            self.model.train(was)

    # ------------------------------------------------------------------ checkpoints

    @_every_rank("state_dict()")
    def state_dict(self, *, local: bool = False) -> dict[str, torch.Tensor]:
        """The newest weights and buffers under the ORIGINAL model's keys (CPU tensors), on
        every rank; ``local=True`` gives only this rank's stage(s) (a data-parallel replica's
        too: its weights equal replica 0's). Flushes first."""
        self._require_setup("state_dict")
        self.flush()
        if local:  # each stage this process holds, from its lowest replica here
            held: dict[int, StageWorker] = {}
            for wk in sorted(self.workers.values(), key=lambda w: -w.replica):
                held[wk.index] = wk
            merged: dict[str, torch.Tensor] = {}
            for wk in held.values():
                merged.update(wk.local_state())
            return self.staged.to_original(merged)
        parts = {wk.index: wk.local_state() for wk in self.workers.values() if wk.replica == 0}
        if self.distributed:
            gathered: list = [None] * self.world_size
            dist.all_gather_object(gathered, parts)
            parts = {}
            for g in gathered:
                parts.update(g)
        return self.staged.state_dict([parts[s] for s in range(self.plan.stages)])

    @_every_rank("load_state_dict()")
    def load_state_dict(self, sd: Mapping[str, torch.Tensor]) -> None:
        """Load weights saved under the original model's keys (by fxpipe or plain PyTorch): every
        key :meth:`state_dict` has, the parameters no node reads included; a non-persistent
        buffer is in no state dict and keeps its value, as in PyTorch."""
        from .checkpoint import fit_problems

        self._require_setup("load_state_dict")
        self.flush()
        originals = self.staged.originals
        shapes = {n: t.shape for n, t in self.staged.unused_state.items()}  # what this rank fills
        for wk in self.workers.values():
            shapes.update({sl.name: sl.shape for sl in wk.store.layout.slots})
            shapes.update({n: b.shape for n, b in wk.buffers.items()})
        not_tensors = sorted(k for k, t in sd.items() if not isinstance(t, torch.Tensor))
        if not_tensors:
            raise ValueError(f"load_state_dict: expected a state dict of tensors (model.state_dict()), found "
                             f"{len(not_tensors)} keys holding something else, e.g. {not_tensors[:3]}. Nothing was loaded.")
        # nn.Module.load_state_dict's rules (strict): every key, no other, each of its shape (a
        # copy would broadcast a smaller one), all checked before anything is written
        problems = fit_problems([originals.get(n, [n]) for n in shapes], {k for keys in originals.values() for k in keys},
                                {k: str(list(s)) for n, s in shapes.items() for k in originals.get(n, [n])},
                                {k: str(list(t.shape)) for k, t in sd.items()})
        if problems:
            raise ValueError(f"load_state_dict: the state dict does not fit this model ({self.trace_info.model_class}): "
                             + "; ".join(problems) + ". Nothing was loaded. Pass a state dict of the same model, "
                             "built with the same configuration (model.state_dict()).")

        def pick(names) -> dict[str, torch.Tensor]:
            return {n: sd[next(k for k in originals.get(n, [n]) if k in sd)] for n in names if originals.get(n, [n])}

        unused = pick(self.staged.unused_state)
        stages = [(wk, pick([*(sl.name for sl in wk.store.layout.slots), *wk.buffers])) for wk in self.workers.values()]
        with torch.no_grad():
            for name, t in unused.items():
                self.staged.unused_state[name].copy_(t)
        for wk, local in stages:
            wk.load_local_state(local)

    @property
    def loss_scale(self) -> float | None:
        """fp16: the loss scale in force after the newest update (None for fp32/bf16)."""
        self._require_setup("loss_scale")
        scaler = next(iter(self.workers.values())).scaler
        return None if scaler is None else scaler.scale

    @property
    def optimizers(self) -> dict[int, torch.optim.Optimizer]:
        """Stage -> the optimizer its factory made, for the stages this process holds (a stage
        with nothing to train has none; in one process, each stage's first replica's): what a
        script logs its learning rate from, ``pipe.optimizers[s].param_groups[0]["lr"]``, as an
        ``lr_scheduler`` set it at the updates this rank has applied (a step's update runs once
        its gradient norm is known, so they lag the returned step as :attr:`grad_norm` does;
        none after :meth:`flush`). For reading: to change hyper-parameters during training use
        ``lr_scheduler=``, which every stage and replica steps alike (one process holds a
        stage's other replicas' optimizers too, which this does not return)."""
        self._require_setup("optimizers")
        out: dict[int, torch.optim.Optimizer] = {}
        for wk in sorted(self.workers.values(), key=lambda w: w.replica, reverse=True):
            if wk.store.optimizer is not None:
                out[wk.index] = wk.store.optimizer
        return dict(sorted(out.items()))

    @property
    def steps(self) -> int:
        """The number of ``step`` calls so far (restored by :meth:`load`)."""
        return self.t

    @property
    def grad_norm(self) -> tuple[int, float] | None:
        """``(step, norm)``: the global L2 norm of the latest step's gradient this rank has reduced,
        as ``torch.nn.utils.clip_grad_norm_`` returns it (the whole batch's gradient over every
        stage, a tied weight counted once, before clipping; under fp16 unscaled; NaN or inf for a
        non-finite step). Every rank reduces the same value for a step, but a step's norm is
        reduced after the step returns: in the next step on every stage under gpipe, 1f1b and zb
        (they return after the last backward), in the next on the last stage and the one after
        on the others under 2bw, and by :meth:`flush`, after which it is the last step
        given. ``None`` before any, after :meth:`load`, and under ``accumulate="optimizer"``
        (AdamA holds no whole gradient). Reading it waits for the device (a host sync on CUDA)."""
        latest = max((wk.grad_norm for wk in self.workers.values() if wk.grad_norm is not None),
                     key=lambda got: got[0], default=None)  # no workers before set-up
        return None if latest is None else (latest[0], float(latest[1]))

    @_every_rank("save()")
    def save(self, path: str, extra: dict | None = None, *, keep: int | None = None) -> str:
        """Checkpoint the full training state into ``path/step-<steps>`` and, once every rank's
        files are complete, point ``path/latest`` at it; returns that directory. A collective:
        every rank calls it (with the same ``extra``, e.g. a data loader position). ``keep=k``:
        then delete this run's checkpoints of earlier steps beyond the ``k`` newest (None keeps
        all; ``keep`` never deletes checkpoints another run left in ``path``, but a save at a
        step that has one replaces it, with a warning, once the new one is complete).

        The state: both 2bw weight versions, the optimizer state (one format for torch.optim and
        the fused kernels), the lr scheduler, :attr:`steps`, each rank's RNG state, the plan and
        the traced example, keyed by the original model's parameter names (fxpipe/checkpoint.py).
        Finishes in-flight micro-batches first (a flush: no numbers change) and returns once the
        state is copied to host memory; a background thread writes the files
        (``torch.distributed.checkpoint.async_save``). The next ``save``/``load`` waits for it, as
        does :meth:`wait_for_checkpoint` and the end of the process."""
        from . import checkpoint

        checkpoint.check_keep(keep)
        self._require_setup("save")
        self._check_not_broken("save")
        if self._stopped is not None:  # its step count would not match its weights
            raise self._stopped
        self.wait_for_checkpoint()
        self.flush()
        if not self._saving_registered:  # finish the last checkpoint before the process ends
            atexit.register(self.wait_for_checkpoint)
            self._saving_registered = True
        root = os.path.abspath(path)
        ours = self._saved_steps.setdefault(root, set())  # the step being saved is always kept
        base = self._resumed_from[1] if self._resumed_from and self._resumed_from[0] == root else 0
        directory, future = checkpoint.save(self, path, extra, self._checkpoint_pg(), keep,
                                            prunable=lambda t: t in ours or t <= base)
        self._saving = (directory, future, None if self.t in ours else functools.partial(ours.discard, self.t))
        ours.add(self.t)  # once save has not refused it (and until its writing fails)
        return directory

    def wait_for_checkpoint(self) -> str | None:
        """Wait until this rank's part of the checkpoint being written (if any) is written (on rank
        0: the whole of it, and ``latest`` names it); returns its directory. Raises what the
        writer raised."""
        if self._saving is None:
            return None
        path, future, unclaim = self._saving
        self._saving = None
        try:
            problems = future.result()
        except Exception as e:
            if unclaim is not None:  # the step's folder holds what it held before: not this run's to prune
                unclaim()
            raise FxpipeError(f"writing checkpoint {path} failed: {e}") from e
        for problem in problems:  # save(keep=) could not delete an old checkpoint: the new one is whole
            warnings.warn(f"fxpipe save: {problem}", RuntimeWarning, stacklevel=2)
        return path

    @_every_rank("load()")
    def load(self, path: str) -> dict | None:
        """Restore what :meth:`save` wrote and return its ``extra``. ``path``: a folder given to
        ``save`` (its ``latest`` checkpoint) or one checkpoint directory. A collective under
        torchrun. Right after a lazy ``compile(model)`` (no example inputs) the pipeline is
        built from the checkpoint's traced example and, unless ``stages``/``plan``/another
        ``microbatches`` were given, its plan; in another layout the example is re-cut so that a
        step takes the saving run's global batch. The layout may differ from the saving run's
        (other d, w, m): tensors are read by key. Reports every missing and unexpected key of a
        checkpoint of another model. A pipeline a non-finite step stopped trains on after it;
        one whose step failed part-way (an action raised) cannot, and raises."""
        from . import checkpoint

        self._check_not_broken("load")  # a half-run step cannot be drained, nor its messages matched
        self.wait_for_checkpoint()
        resolved = self._resolve_agreed(path)
        try:  # each rank reads it: all raise if one cannot
            meta, problem = checkpoint.read_meta(resolved), None
        except CheckpointError as e:
            meta, problem = None, e
        self._raise_agreed(problem, CheckpointError, "rank {rank} cannot read the checkpoint, so no rank loads it: ")
        if not self._setup_done:
            self._setup_from_checkpoint(meta, resolved)
        try:  # what is in flight finishes (a collective: every rank drains the same steps)
            self.flush()
        except NonFiniteError as e:  # found in the state about to be replaced
            if e is not self._stopped:
                raise
        extra = checkpoint.load(self, resolved, meta, self._checkpoint_pg())
        self._revive()
        self.t = self.epoch_start = meta["steps"]
        # what it saved past this step is another trajectory now; save(keep=) leaves it alone
        self._resumed_from = (os.path.dirname(os.path.abspath(resolved)), self.t)
        self._saved_steps = {root: {t for t in ts if t <= self.t} for root, ts in self._saved_steps.items()}
        # the saving run's skipped updates up to its step (an older checkpoint without them: this
        # pipeline's own, up to that step; the rest did not happen)
        self.skipped_steps = [t for t in meta.get("skipped_steps", self.skipped_steps) if t <= self.t]
        return extra

    def _resolve_agreed(self, path: str) -> str:
        """The checkpoint directory ``path`` names, as rank 0 reads it: rank 0 points ``latest``
        at a checkpoint once the whole of it is written, so right after a ``save`` another rank
        could still find the one before (or none); every rank loads rank 0's answer, or raises
        its error. The answer travels on the checkpoint writers' group, whose collectives each
        rank's writer finished before :meth:`wait_for_checkpoint` returned."""
        from .checkpoint import resolve

        if not self.distributed:
            return resolve(path)
        box: list = [None, None]  # (the directory, rank 0's error)
        if self.rank == 0:
            try:
                box[0] = resolve(path)
            except CheckpointError as e:
                box[1] = str(e)
        dist.broadcast_object_list(box, src=0, group=self._checkpoint_pg())
        if box[1] is not None:
            raise CheckpointError(box[1] if self.rank == 0 else f"rank 0 found no checkpoint to load: {box[1]}")
        return box[0]

    def _revive(self) -> None:
        """After a load, nothing of the steps before it is kept: a stop by a non-finite step
        (which tells the user to load a checkpoint) ends, and the per-step records the flush left
        go (a stopped step's loss, AdamA's non-finite flags). The flush finished every action of
        every step given so far on every rank, so no communication of those steps is pending."""
        self._stopped = None
        for _, handle in self._loss_sums.values():
            handle.wait()
        self._loss_sums.clear()
        for wk in self.workers.values():
            wk.halted = False
            wk.grad_norm = None
            wk.nonfinite.clear()
            wk.dropped.clear()
            wk.batch_loss.clear()
            wk.updated_flags.clear()

    def _setup_from_checkpoint(self, meta: dict, path: str) -> None:
        """Build a lazily compiled pipeline from the checkpoint's traced example: with its plan,
        unless this pipeline asks for another layout, schedule, precision or recomputation; then
        with the example re-cut so that a step takes the saving run's global batch
        (``microbatches=None`` takes the checkpoint's count; ``stages=None`` under torchrun a pure
        pipeline, as the lazy step does)."""
        o = self.config
        saved = Plan.from_json(meta["plan"])
        example = meta["example"]
        world = self.world_size if self.distributed else saved.world_size
        if (o.plan is None and o.stages is None and saved.schedule == o.schedule
                and o.microbatches in (None, saved.microbatches) and saved.world_size == world
                and o.chunks in (None, saved.chunks)
                and saved.precision == o.precision and o.recompute in (None, any(saved.recompute))
                and o.lookahead in (None, saved.lookahead)):
            self.config = replace(o, plan=saved)
        elif o.plan is not None:  # its micro-batch size, which its graph was traced with
            example = _resize_example(example, o.plan.microbatch_size)
        else:
            if o.microbatches is None:
                if o.stages is not None and saved.microbatches < (
                        least := min_microbatches(o.schedule, o.stages, o.lookahead or 0)):
                    more = f" with lookahead={o.lookahead}" if least > o.stages else ""
                    raise CheckpointError(
                        f"load: {path} was trained with {saved.microbatches} micro-batches per step, which this "
                        f"pipeline would take (microbatches=None), but its {o.stages} stages under "
                        f"schedule={o.schedule!r}{more} need at least {least}. Pass microbatches >= {least} to "
                        f"compile (the saved global batch is re-cut), fewer stages, or schedule='1f1b' or 'zb'")
                self.config = o = replace(o, microbatches=saved.microbatches)
            m, w = o.microbatches, self._width_hint()
            batch = saved.microbatch_size * saved.microbatches * saved.width
            if batch % (m * w):
                fits = [k for k in range(1, batch // w + 1) if batch % (k * w) == 0]
                raise CheckpointError(
                    f"load: {path} was trained on global batches of {batch} samples ({saved.microbatch_size} per "
                    f"micro-batch x {saved.microbatches} micro-batches x {saved.width} replicas); this pipeline "
                    f"splits a batch into {m} micro-batches x {w} replicas, which does not divide {batch}. Pass "
                    f"microbatches= one of {fits} to fxpipe.compile, or an example_inputs micro-batch for "
                    f"another global batch."
                )
            example = _resize_example(example, batch // (m * w))
        self._setup(lambda: normalize_inputs(example))

    def _checkpoint_pg(self):
        """A gloo group of all ranks for checkpoint writers (None in one process): the writer
        thread's collectives must not interleave with training's on the default group, and
        ``async_save`` needs a CPU backend even when training runs on NCCL."""
        if self.distributed and self._checkpoint_group is None:
            # every rank creates it with its first save: bounded like any wait for a peer
            self._checkpoint_group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=self.timeout))
        return self._checkpoint_group

    def _check_not_broken(self, what: str) -> None:
        """After an action raised, the ranks may be part-way through a step (some updated, some
        not, messages in flight): nothing can run on from there."""
        if self._broken:
            if self.distributed:  # its peers' posts of the broken step are still out, unmatched
                fix = ("Let the error end this process: every rank then stops within seconds, and under torchrun "
                       "--max-restarts=N they all restart and resume from the last checkpoint (pipe.load). To "
                       "recover in this process instead, every rank calls torch.distributed.destroy_process_group() "
                       "(the old group holds the broken step's unfinished messages), then compiles a new pipeline "
                       "(which creates a new group under torchrun) and loads the last checkpoint.")
            else:
                fix = "Compile a new pipeline and load the last checkpoint (pipe.load) to resume."
            raise FxpipeError(
                f"{what}() after {self._failure} failed: this pipeline's ranks stopped part-way through it, with "
                f"weights, optimizer state and messages of different steps, so it cannot go on. {fix}"
            )

    def _require_setup(self, what: str) -> None:
        if not self._setup_done:
            fix = ("load the weights into the model before fxpipe.compile(model, ...), or pass weights=state_dict to "
                   "compile (a first step would train on the weights the model has now)" if what == "load_state_dict"
                   else "pass example_inputs to fxpipe.compile or call step() first")
            raise FxpipeError(f"{what}() before the pipeline was built: {fix}")

    # ------------------------------------------------------------------ inspection

    def recorded_timeline(self) -> list[tuple[int, str, float, float]]:
        """Every rank's recorded actions (a collective under torchrun: call it on all ranks)."""
        if not self.distributed:
            return list(self.timeline)
        gathered: list = [None] * self.world_size
        dist.all_gather_object(gathered, self.timeline)
        return [e for part in gathered for e in part]

    def dump(self, out_dir: str) -> list[str]:
        """Write the plan, the node table and graph (with stages), the stage code, the schedule
        (simulated from the plan's costs) and, when recorded, the measured timeline into
        ``out_dir``, deleting the dumps an earlier run left there that this one does not write
        (``fxpipe.inspect._DUMP_FILES``: a deeper plan's ``stage_2.py``, an old ``timeline.svg``).
        Under torchrun call it on every rank; rank 0 writes."""
        from .inspect import write_pipeline_dumps

        self._require_setup("dump")
        # gathered whatever this rank recorded: a rank that set pipe.record while another did not
        # would otherwise gather alone
        events = self.recorded_timeline()
        if self.rank != 0:
            return []
        return write_pipeline_dumps(self, out_dir, events)


def _node_keys(gm: fx.GraphModule) -> dict[str, tuple[str, str, str, int]]:
    """Each computing node's name -> (owning module, op, target, how many such calls of that
    module came before it): what names a node in another trace of the same model (train against
    eval mode) where an operator one of them runs alone shifts the names of all after it."""
    seen: dict[tuple[str, str, str], int] = {}
    keys = {}
    for node in gm.graph.nodes:
        if node.op.startswith("call"):
            base = (module_path(node), node.op, str(node.target))
            keys[node.name] = (*base, seen.get(base, 0))
            seen[base] = seen.get(base, 0) + 1
    return keys


def _fill_empty_eval_stages(gm: fx.GraphModule, mapping: dict[str, int], stages: int) -> None:
    """Give each training stage none of whose nodes the eval trace has (nodes only training
    runs: BatchNorm's ``num_batches_tracked += 1``, dropout) a node of its own in ``gm`` and
    ``mapping``: a copy of the value the next stage's first node reads, which that node then
    reads instead. The eval pipeline keeps the training ranks' stages, each holding the same
    weights, and a stage passes what crosses it on."""
    nodes = [n for n in gm.graph.nodes if n.name in mapping]
    used = set(mapping.values())
    for s in range(stages):
        if s in used:
            continue
        first = next((n for n in nodes if mapping[n.name] > s), None)
        value = None if first is None else next(
            (a for a in first.all_input_nodes if a.op != "get_attr" and isinstance(a.meta.get("val"), torch.Tensor)
             and (a.op == "placeholder" or mapping.get(a.name, s) < s)), None)
        if value is None:
            raise PlanError(f"eval_step: stage {s} runs only nodes the eval-mode trace lacks, and no value crosses "
                            f"it to give it one; evaluate with another pipeline (fxpipe.compile(model.eval(), ...)) "
                            f"or plan fewer stages")
        with gm.graph.inserting_before(first):
            copied = gm.graph.call_function(torch.ops.aten.clone.default, (value,))
        copied.meta = {k: v for k, v in value.meta.items() if k in ("val", "tensor_meta", "fxpipe")}
        first.replace_input_with(value, copied)
        mapping[copied.name] = s
        nodes.insert(nodes.index(first), copied)
        used.add(s)
    gm.recompile()


class _Newest:
    """Values for eval stages built from a meta model: the training workers' newest weights and
    buffers (what an eval forward reads), else ``rest`` (a :class:`fxpipe.materialize.Materializer`)."""

    def __init__(self, workers, rest):
        self.workers, self.rest = list(workers), rest

    def fill(self, dest, originals) -> None:
        left = dict(dest)
        with torch.no_grad():
            for wk in self.workers:
                newest = wk.store.compute(wk.store.updates)
                for name in list(left):
                    value = newest.get(name, wk.buffers.get(name))
                    if value is not None:
                        left.pop(name).copy_(value)
        if left:
            self.rest.fill(left, {n: originals[n] for n in left})


class Loss:
    """A batch's mean loss on a rank that does not hold the last stage.

    Under 2bw the first stage's ``step(t)`` returns before the last stage has computed batch t's
    loss; waiting there would add a fill bubble to every step. The value arrives through the
    ``LOSS t`` all-reduce every rank posts where its step ends; ``float(loss)``, ``loss.item()``
    or ``loss.wait()`` (a 0-dim float64 tensor) wait for it, which never needs a later step.
    ``flush()`` waits for every one posted so far, as does the end of the process when fxpipe
    created the process group (``_drain_at_exit``).
    """

    def __init__(self, total: torch.Tensor, handle, count: int):
        self._total, self._handle, self._count = total, handle, count

    def wait(self) -> torch.Tensor:
        self._handle.wait()
        return self._total[0] / self._count

    def item(self) -> float:
        return float(self.wait())

    __float__ = item

    def __repr__(self) -> str:
        return f"Loss({self.item():.6g})"


# ---------------------------------------------------------------------------------------------
# helpers


_SHORT_DTYPES = {torch.float64: "fp64", torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def _precision_label(policy: str, model: nn.Module) -> str:
    """The precision ``repr`` prints: the policy, except that under ``"fp32"`` (no autocast: the
    model trains in its own dtypes) a model whose floating parameters are not float32 shows them,
    e.g. ``fp64 (no autocast)``."""
    dtypes = {q.dtype for q in model.parameters() if q.is_floating_point()}
    if policy != "fp32" or dtypes <= {torch.float32}:
        return policy
    return "+".join(sorted(_SHORT_DTYPES.get(t, str(t).removeprefix("torch.")) for t in dtypes)) + " (no autocast)"


def _init_distributed(requested_device, timeout: float | None) -> tuple[bool, torch.device, float | None]:
    """(multi-process?, this process's device, seconds a wait may take). Uses the default process
    group (and its timeout unless ``timeout`` is given), or creates it (gloo for CPU, NCCL for
    CUDA, with ``timeout`` or DEFAULT_TIMEOUT) when torchrun's environment says so."""
    if dist.is_available() and dist.is_initialized():
        backend = dist.get_backend()
        if requested_device in (None, "auto") and backend != "nccl":
            requested_device = "cpu"  # "auto" follows the existing group: gloo moves CPU tensors
        device = choose_device(requested_device, distributed=True)
        check_backend(backend, device)
        timeout = timeout if timeout is not None else _group_timeout(device)
        if not _FINISHES_ON_USERS_GROUP[0] and dist.get_world_size() > 1:
            _FINISHES_ON_USERS_GROUP[0] = True  # once a process, before any pipeline's _drain_at_exit (atexit: LIFO)
            atexit.register(_finish_at_exit, None, timeout, destroy=False)
        return dist.get_world_size() > 1, device, timeout
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        device = choose_device(requested_device, distributed=True)
        timeout = DEFAULT_TIMEOUT if timeout is None else float(timeout)
        span = datetime.timedelta(seconds=timeout)
        # init_process_group's own env:// rendezvous (torchrun's agent store or rank 0's), run
        # here to keep the store: the ranks meet in it at exit (_finish_at_exit)
        store, rank, world = next(dist.rendezvous("env://", timeout=span))
        store.set_timeout(span)
        dist.init_process_group(backend_for(device), store=store, rank=rank, world_size=world, timeout=span)
        # The group is fxpipe's, so fxpipe tears it down: a gloo group still alive when the
        # interpreter finalises aborts the process ("terminate called without an active exception").
        atexit.register(_finish_at_exit, store, timeout, destroy=True)
        return True, device, timeout
    return False, choose_device(requested_device, distributed=False), None


def _group_timeout(device: torch.device) -> float:
    """The default process group's own timeout in seconds (torch's default if it hides it)."""
    try:
        backend = dist.group.WORLD._get_backend(torch.device("cpu") if device.type == "cpu" else device)
        return backend.options._timeout.total_seconds()
    except (AttributeError, RuntimeError):
        from torch.distributed.constants import default_pg_timeout

        return default_pg_timeout.total_seconds()


def _known_device(device) -> bool:
    """Whether ``device`` names a device fxpipe computes on: None/"auto", the CPU or a CUDA device
    (whether CUDA is really there is :func:`fxpipe.device.choose`'s check, when the pipeline is built)."""
    if device is None or device == "auto":
        return True
    if isinstance(device, bool) or not isinstance(device, (str, int, torch.device)):
        return False
    try:
        return torch.device(device).type in ("cpu", "cuda")
    except (RuntimeError, ValueError, TypeError):
        return False


def _drain_at_exit(ref: "weakref.ref[Pipeline]", in_flight: list[tuple]) -> None:
    """At interpreter exit, wait for what this rank still has in flight: its last segment's sends
    and, off the last stage, its last LOSS all-reduce, which a peer may still be running towards
    (under 2bw the first stage's last ``step`` returns well before the last stage's). A rank that
    tore its group down first would leave that peer waiting forever. ``in_flight`` is its
    workers' :meth:`~fxpipe.runtime.StageWorker.in_flight` containers, held here and not through
    the pipeline: a pipeline that lived in a function which returned is collected before the
    exit, and what it posted (the receive buffers gloo still writes into) must outlive it.
    Skipped when the group is gone already (a user-created group destroyed by the script:
    ``flush()`` first, README) and after a failed action, whose peers may never post the other
    halves."""
    pipe = ref()
    broken = pipe._broken if pipe is not None else _BROKEN_HERE[0]
    if broken or _exiting_on_error() or not (dist.is_available() and dist.is_initialized()):
        return
    try:
        for posted in in_flight:
            drain_posted(posted)
    except Exception as e:  # a peer that died: say so, and go on to tear down
        _BROKEN_HERE[0] = True  # what it has in flight stays unmatched: the teardown waits for no one
        if pipe is not None:
            pipe._broken = True
        warnings.warn(f"fxpipe: at exit, rank {dist.get_rank()} could not finish its in-flight communication: {e}",
                      RuntimeWarning, stacklevel=1)


#: This process's multi-process pipelines (at exit: whether one failed, see _finish_at_exit)
_PIPELINES: "weakref.WeakSet[Pipeline]" = weakref.WeakSet()
#: Whether a pipeline of this process failed part-way, even one since collected
_BROKEN_HERE = [False]
#: The pipelines (by id, which outlives a pipeline collected as the script unwinds) whose latest
#: batch this rank refused (an InputError) and that have not stepped since: a script that caught
#: it and then ended (``sys.exit(1)``) may be ending on an error its peers are waiting on
_REFUSED_HERE: set[int] = set()
#: Seconds a rank with a refused batch (``_REFUSED_HERE``) waits at exit for its peers
REFUSED_GRACE = 20.0


def _exiting_on_error() -> bool:
    """Whether the interpreter is exiting on an uncaught exception: Python sets ``sys.last_exc``
    (3.12) or ``sys.last_value`` when it prints one, before the atexit handlers run."""
    return getattr(sys, "last_exc", None) is not None or getattr(sys, "last_value", None) is not None


def _finish_at_exit(store, timeout: float, *, destroy: bool) -> None:
    """At exit, after every pipeline drained (:func:`_drain_at_exit`): meet the other ranks, then
    (``destroy``: the group fxpipe created) destroy the group. A rank whose own operations are
    complete can still have a peer reading what it sent (gloo completes a send once its bytes
    are out), and a rank that tears its group down or exits then can abort that peer at exit
    ("terminate called without an active exception": about one run in eight of
    ``tests/dist/test_reliability.py``'s script that ends without ``flush()``, and one in twenty
    of its script on a group of its own, left alive, on a loaded host). So each rank says in the
    group's store (``store``; None: the default group's, a group the script created) that it is
    done and waits, up to ``timeout``, for the others to say the same: once all have drained,
    nothing is in flight. The store, not a collective: a peer whose pipeline failed may have left
    the device communicator with unmatched operations. A rank whose pipeline failed says it is
    done but waits for no one (its peers may never come), nor does a rank exiting on an uncaught
    exception (one rank's error, such as an ``InputError`` raised before it communicated: its
    peers, waiting for it, then fail at once with a ``PeerError`` instead of at the timeout). A
    rank that refused a batch and has not stepped since (the refusal caught, then the script
    ended) waits :data:`REFUSED_GRACE` seconds at most: long enough for peers that refused the
    same batch and end too, short of the timeout where only it refused and its peers wait for
    it. Python does not tell an exit handler the exit status, so a script that catches an error
    of its own and ends with ``sys.exit(1)`` looks like one that ended well: that rank waits up
    to the timeout. A group the script created stays the script's: it is not destroyed."""
    if not (dist.is_available() and dist.is_initialized()):
        return  # the script destroyed it
    store = store if store is not None else dist.distributed_c10d._get_default_store()
    rank = dist.get_rank()
    waits = not (_BROKEN_HERE[0] or _exiting_on_error() or any(p._broken for p in list(_PIPELINES)))
    timeout = min(timeout, REFUSED_GRACE) if _REFUSED_HERE else timeout
    missing = _meet_at_exit(store, rank, dist.get_world_size(), timeout, wait=waits)
    if missing:
        warnings.warn(f"fxpipe: at exit, rank {rank} waited {timeout:g} s for rank(s) {missing} to finish "
                      f"their communication and {'tears its group down' if destroy else 'exits'} without them; "
                      f"if they are still running, their pipeline will fail with a PeerError", RuntimeWarning,
                      stacklevel=1)
    if destroy:
        dist.destroy_process_group()


#: Whether this process registered :func:`_finish_at_exit` for a group the script created
_FINISHES_ON_USERS_GROUP = [False]


def _meet_at_exit(store, rank: int, world: int, timeout: float, *, wait: bool = True) -> list[int]:
    """Set this rank's exit key in ``store`` and (``wait``) wait up to ``timeout`` seconds for
    every rank's; returns the ranks whose key is still missing. The keys carry torchrun's restart
    count: its agent's store outlives a restarted attempt's workers."""
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    key = lambda r: f"fxpipe/exit/{attempt}/{r}"  # noqa: E731
    try:
        store.set(key(rank), "1")
        if wait:
            store.wait([key(r) for r in range(world)], datetime.timedelta(seconds=timeout))
        return []
    except Exception:  # noqa: BLE001 - a timeout, or the store's host gone: say who is missing
        try:
            return [r for r in range(world) if not store.check([key(r)])]
        except Exception:  # noqa: BLE001 - the store itself is unreachable
            return [r for r in range(world) if r != rank]


def _kernel_backend(choice: str, device: torch.device):
    """The seam between torch.optim and fxpipe.kernels' fused flat-buffer path.

    ``"auto"``: the fused Triton kernels on CUDA, plain ``torch.optim`` on the CPU. ``"triton"``
    forces the kernels (on CPU under ``TRITON_INTERPRET=1``); ``"torch"`` forces the fused path
    with the kernels' torch references; ``"off"`` forces ``torch.optim``.
    """
    if choice == "auto":
        return "triton" if device.type == "cuda" else None
    return None if choice == "off" else choice


def _resize_example(example, b: int):
    """The traced micro-batch ``example`` with ``b`` samples in dim 0 (every tensor with a dim 0
    has the same count): its first ``b``, or its samples repeated, so that tracing sees real
    values (token ids in range)."""

    def resize(x):
        if not isinstance(x, torch.Tensor) or x.dim() == 0 or x.shape[0] == b:
            return x
        return x.repeat(-(-b // x.shape[0]), *[1] * (x.dim() - 1))[:b]

    return pytree.tree_map(resize, example)


def _split_batch(batch, n: int) -> list:
    """Split every tensor leaf of ``batch`` with a dim 0 into ``n`` equal micro-batches along it
    (the sizes were checked by :mod:`fxpipe.inputs`); other leaves go to every micro-batch."""
    leaves, spec = pytree.tree_flatten(batch)
    split = [x.chunk(n) if isinstance(x, torch.Tensor) and x.dim() > 0 else [x] * n for x in leaves]
    return [pytree.tree_unflatten([s[i] for s in split], spec) for i in range(n)]


def _adama_stopped(what: str, data: str) -> NonFiniteError:
    """AdamA found a non-finite ``what``: nothing to skip, the moments already took it in."""
    return NonFiniteError(
        f"a non-finite (NaN or infinite) {what}: with accumulate='optimizer' (AdamA) each micro-batch's gradient "
        f"is folded into Adam's moments as soon as it exists, so the moments and weights took it in, and this "
        f"pipeline is stopped. Load the last checkpoint and lower the learning rate or check the data of {data}, "
        f"or train with accumulate='gradients', which checks every step before updating.")


def _check_same_batch(batch, world: int, device: torch.device, comm: Comm) -> None:
    """Every rank must pass the same global batch; compare cheap checksums across ranks."""
    sums = []
    for x in pytree.tree_leaves(batch):
        if isinstance(x, torch.Tensor):
            flat = x.detach().reshape(-1).double().cpu()
            weights = torch.arange(1, flat.numel() + 1, dtype=torch.float64)
            sums += [float(flat.numel()), float(flat.sum()), float((flat * weights).sum())]
    mine = torch.tensor(sums, dtype=torch.float64, device=device)
    everyone = [torch.zeros_like(mine) for _ in range(world)]
    with _together("the first step's check that every rank passed the same batch", "step()", comm):
        dist.all_gather(everyone, mine)
    bad = [r for r in range(world) if not torch.equal(everyone[r], everyone[0])]
    if bad:
        raise RuntimeMismatchError(
            f"ranks {bad} passed a different batch to step() than rank 0. fxpipe needs the SAME global "
            f"batch on every rank (it takes each stage's share itself): seed the data loader identically "
            f"on all ranks, or pass check_batch=False if the difference is intended."
        )
