"""The one seam between the runtime and the kernels: which backend runs, and a uniform interface.

    >>> from fxpipe.kernels import ops
    >>> k = ops(torch.device("cpu"))            # "torch": the references (no Triton import)
    >>> k = ops(torch.device("cuda", 0))        # "triton": the fused kernels
    >>> k = ops("cpu", force="triton")          # kernels on CPU: needs TRITON_INTERPRET=1 before import
    >>> k.accumulate(acc, grad, 1 / m, overwrite=first)
    >>> k.update(spec, t, acc, w_cur, w_next, state, clip=clip_factor)

Both backends take the same arguments and check them the same way, so the runtime is written
once and a test can force either path.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import torch

from .errors import KernelBackendError

BACKENDS = ("triton", "torch")


def backend(device: torch.device | str, force: str | None = None) -> str:
    """``"triton"`` on CUDA, ``"torch"`` elsewhere; ``force`` picks one and checks it can run.

    Forcing ``"triton"`` off CUDA needs Triton's interpreter, which Triton fixes when the kernels
    are imported: set ``TRITON_INTERPRET=1`` before that, or this raises ``KernelBackendError``.
    """
    device = torch.device(device)
    if force is not None and force not in BACKENDS:
        raise KernelBackendError(f"fxpipe.kernels.backend: expected force in {BACKENDS} or None, found {force!r}")
    choice = force or ("triton" if device.type == "cuda" else "torch")
    if choice == "triton":
        try:
            from . import accumulate as _accumulate_module
            from ._jit import interpreter_error, is_interpreted
        except ImportError as e:
            raise KernelBackendError(f"fxpipe.kernels: backend 'triton' needs the triton package, which failed "
                                     f"to import ({e}); install triton or use backend 'torch'") from e
        if device.type != "cuda" and not is_interpreted(_accumulate_module._accumulate_kernel):
            raise interpreter_error("accumulate", device)
    return choice


@dataclasses.dataclass(frozen=True)
class KernelOps:
    """The kernel entry points of one backend; every call has the signature documented in
    ``accumulate.py``, ``update.py`` and ``adama.py`` (the references take the same arguments)."""

    name: str
    """``"triton"`` or ``"torch"``."""
    accumulate: Callable
    """``accumulate(acc, grad, scale=1.0, *, overwrite=False)``: acc (+)= scale * grad."""
    update: Callable
    """``update(spec, step, grad, weights, out, state, *, clip=None, lr=None, copy=None)``: fused
    optimizer step (``copy``: a 16-bit copy of the new weights, written in the same pass)."""
    adama_accumulate: Callable
    """``adama_accumulate(spec, grad, state, *, scale=1.0, first)``: fold a micro-batch into the moments."""
    adama_update: Callable
    """``adama_update(spec, step, weights, out, state, *, lr=None)``: AdamA's step from the moments."""


def ops(device: torch.device | str, force: str | None = None) -> KernelOps:
    """The ``KernelOps`` of ``backend(device, force)``."""
    choice = backend(device, force)
    if choice == "triton":
        from .accumulate import accumulate
        from .adama import adama_accumulate, adama_update
        from .update import update

        return KernelOps("triton", accumulate, update, adama_accumulate, adama_update)
    from .reference import (accumulate_reference, adama_accumulate_reference, adama_update_reference,
                            update_reference)

    return KernelOps("torch", accumulate_reference, update_reference, adama_accumulate_reference,
                     adama_update_reference)
