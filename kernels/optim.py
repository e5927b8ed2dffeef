"""Optimizer hyper-parameters and flat optimizer state for the fused update (no Triton here).

The fused 2BW update and its torch reference implement ``torch.optim.SGD``, ``Adam`` and
``AdamW`` with their exact formulas (see ``update.py``). ``OptimizerSpec`` holds the
hyper-parameters of one stage's optimizer; ``init_state`` makes its state as flat float32
buffers (float64 for float64 weights) named by ``torch.optim``'s own state keys, so a per-parameter slice
``state["exp_avg"][offset:offset + numel]`` is exactly what ``optimizer.state[p]["exp_avg"]``
holds (a checkpoint converts by slicing at the flat-buffer offsets).

    >>> spec = OptimizerSpec.from_torch(functools.partial(torch.optim.AdamW, lr=1e-3))
    >>> spec
    OptimizerSpec(kind='adamw', lr=0.001, betas=(0.9, 0.999), eps=1e-08, weight_decay=0.01, ...)
"""
from __future__ import annotations

import dataclasses
import functools
import inspect
import math

import torch

from .errors import KernelError

_KINDS = ("sgd", "adam", "adamw")


@dataclasses.dataclass(frozen=True)
class OptimizerSpec:
    """Hyper-parameters of one stage's optimizer, as ``torch.optim`` names them."""

    kind: str
    """``"sgd"``, ``"adam"`` (L2 penalty added to the gradient) or ``"adamw"`` (decoupled decay)."""
    lr: float = 1e-3
    """Learning rate; a per-call ``lr=`` override to ``update`` lets a scheduler change it."""
    momentum: float = 0.0
    """SGD only: momentum factor (0 keeps no state)."""
    dampening: float = 0.0
    """SGD only: dampening of the momentum; torch skips it on the first step (buffer = grad)."""
    nesterov: bool = False
    """SGD only: Nesterov momentum (needs momentum > 0 and dampening == 0, as torch requires)."""
    betas: tuple[float, float] = (0.9, 0.999)
    """Adam/AdamW: decay of the first and second moments."""
    eps: float = 1e-8
    """Adam/AdamW: added after ``sqrt(v) / sqrt(bias_correction2)``, as torch does."""
    weight_decay: float = 0.0
    """L2 coupled to the gradient for SGD and Adam; decoupled ``w *= 1 - lr*wd`` for AdamW."""

    def __post_init__(self):
        # python floats: the Triton kernels take scalars as arguments, where a tensor is a pointer
        if not (isinstance(self.betas, (tuple, list)) and len(self.betas) == 2):
            raise KernelError(f"OptimizerSpec: expected betas to be a pair (beta1, beta2), found {self.betas!r}")
        object.__setattr__(self, "betas", tuple(float(b) for b in self.betas))
        if self.kind not in _KINDS:
            raise KernelError(f"OptimizerSpec: expected kind in {_KINDS}, found {self.kind!r}; "
                              f"the fused update implements torch.optim.SGD, Adam and AdamW")
        for name in ("lr", "momentum", "dampening", "eps", "weight_decay"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise KernelError(f"OptimizerSpec: expected {name} to be a finite float >= 0, found {value!r}")
        b1, b2 = self.betas
        if not (0.0 <= b1 < 1.0 and 0.0 <= b2 < 1.0):
            raise KernelError(f"OptimizerSpec: expected 0 <= beta < 1, found betas={self.betas}")
        if self.nesterov and (self.momentum <= 0 or self.dampening != 0):
            raise KernelError(f"OptimizerSpec: nesterov needs momentum > 0 and dampening == 0, found "
                              f"momentum={self.momentum}, dampening={self.dampening} (torch.optim.SGD rejects it too)")

    @property
    def state_names(self) -> tuple[str, ...]:
        """The flat float32 state buffers this optimizer keeps (torch.optim's state keys)."""
        if self.kind == "sgd":
            return ("momentum_buffer",) if self.momentum != 0 else ()
        return ("exp_avg", "exp_avg_sq")

    @classmethod
    def from_torch(cls, optimizer) -> "OptimizerSpec":
        """Read a spec from a ``torch.optim`` class, a ``functools.partial`` of one, or an instance.

        Options the fused update does not implement (``amsgrad``, ``maximize``) raise; options that
        only choose torch's implementation (``foreach``, ``fused``, ``capturable``) are ignored.
        """
        if isinstance(optimizer, torch.optim.Optimizer):
            groups = optimizer.param_groups
            first = {k: v for k, v in groups[0].items() if k not in ("params", "param_names")}
            for i, g in enumerate(groups[1:], 1):
                other = {k: v for k, v in g.items() if k not in ("params", "param_names")}
                if other != first:
                    raise KernelError(f"OptimizerSpec.from_torch: expected one set of hyper-parameters for the "
                                      f"whole flat buffer, found param group {i} differing from group 0 "
                                      f"({other} vs {first}); use one flat buffer per group")
            return cls._from_class(type(optimizer), first)
        if isinstance(optimizer, functools.partial):
            if optimizer.args:
                raise KernelError("OptimizerSpec.from_torch: expected hyper-parameters as keywords in the partial, "
                                  f"found positional {optimizer.args}; write partial(torch.optim.AdamW, lr=...)")
            return cls._from_class(optimizer.func, dict(optimizer.keywords))
        if isinstance(optimizer, type):
            return cls._from_class(optimizer, {})
        raise KernelError(f"OptimizerSpec.from_torch: expected a torch.optim class, partial or instance, "
                          f"found {type(optimizer).__name__}")

    @classmethod
    def from_group(cls, optimizer, group: dict) -> "OptimizerSpec":
        """The spec of one param group of a ``torch.optim`` instance (its hyper-parameters as the
        scheduler left them): one per group, each updating its own segments of the flat buffers."""
        return cls._from_class(type(optimizer), {k: v for k, v in group.items() if k not in ("params", "param_names")})

    @classmethod
    def _from_class(cls, klass, given: dict) -> "OptimizerSpec":
        kinds = {torch.optim.SGD: "sgd", torch.optim.Adam: "adam", torch.optim.AdamW: "adamw"}
        if klass not in kinds:
            raise KernelError(f"OptimizerSpec.from_torch: expected torch.optim.SGD, Adam or AdamW, found "
                              f"{getattr(klass, '__name__', klass)}; use the torch reference path "
                              f"(no fused update) for other optimizers")
        hyper = {name: p.default for name, p in inspect.signature(klass.__init__).parameters.items()
                 if p.default is not inspect.Parameter.empty}
        hyper.update(given)
        kind = kinds[klass]
        for flag in ("amsgrad", "maximize", "differentiable"):
            if hyper.get(flag):
                raise KernelError(f"OptimizerSpec.from_torch: {klass.__name__}({flag}=True) is not implemented by "
                                  f"the fused update; drop {flag}=True or use the torch path without fused kernels")
        if kind == "adam" and hyper.get("decoupled_weight_decay"):
            kind = "adamw"  # torch's Adam(decoupled_weight_decay=True) is AdamW
        lr = hyper["lr"]
        lr = float(lr.item() if isinstance(lr, torch.Tensor) else lr)
        if kind == "sgd":
            return cls(kind, lr=lr, momentum=float(hyper["momentum"]), dampening=float(hyper["dampening"]),
                       nesterov=bool(hyper["nesterov"]), weight_decay=float(hyper["weight_decay"]))
        betas = tuple(float(b.item() if isinstance(b, torch.Tensor) else b) for b in hyper["betas"])
        return cls(kind, lr=lr, betas=betas, eps=float(hyper["eps"]), weight_decay=float(hyper["weight_decay"]))


def state_dtype(weights: torch.dtype) -> torch.dtype:
    """The optimizer state's dtype for weights of ``weights``: float32 for float32, bfloat16 and
    float16 (low-precision moments lose the small updates Adam's second moment is made of), and
    float64 for float64 weights (the torch references only), as torch.optim keeps it."""
    return torch.float64 if weights == torch.float64 else torch.float32


def init_state(spec: OptimizerSpec, numel: int, device: torch.device | str = "cpu",
               weights: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """Zeroed flat optimizer state (:func:`state_dtype`) for a buffer of ``numel`` weights."""
    return {name: torch.zeros(numel, dtype=state_dtype(weights), device=device) for name in spec.state_names}


def adam_scalars(spec: OptimizerSpec, step: int, lr: float) -> tuple[float, float]:
    """Host-side ``(step_size, sqrt(bias_correction2))`` of torch's Adam for 1-based ``step``."""
    check_step("update", step)
    b1, b2 = spec.betas
    bias_correction1 = 1 - b1 ** step
    bias_correction2 = 1 - b2 ** step
    return lr / bias_correction1, bias_correction2 ** 0.5


def check_step(op: str, step: object) -> int:
    if isinstance(step, bool) or not isinstance(step, int) or step < 1:
        raise KernelError(f"{op}: expected step to be a python int >= 1 (the optimizer step being taken, "
                          f"1 for the first), found {step!r}")
    return step


def check_state(op: str, spec: OptimizerSpec, state: dict, numel: int, device: torch.device,
                dtype: torch.dtype = torch.float32) -> None:
    from .errors import check_flat

    if not isinstance(state, dict):
        raise KernelError(f"{op}: expected state to be a dict of flat float32 buffers "
                          f"(from init_state), found {type(state).__name__}")
    missing = [k for k in spec.state_names if k not in state]
    if missing:
        raise KernelError(f"{op}: expected state keys {list(spec.state_names)} for {spec.kind}, missing {missing}; "
                          f"create the state with fxpipe.kernels.init_state(spec, numel, device)")
    for k in spec.state_names:
        check_flat(op, f"state[{k!r}]", state[k], numel=numel, device=device, dtypes=(dtype,))
