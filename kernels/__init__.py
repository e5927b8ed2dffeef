"""Triton kernels over flat parameter/gradient buffers (imported as ``fxpipe.kernels``).

A stage keeps its parameters as views into one flat buffer per dtype, so one launch covers the
whole stage. Three operations, each a Triton kernel with a plain-torch reference:

* ``accumulate(acc, grad, scale, overwrite=)`` — gradient accumulation across micro-batches
  (``accumulate.py``; the docstring there says how the runtime must route gradients to it);
* ``update(spec, step, grad, weights, out, state, clip=, lr=)`` — the fused 2BW update: optimizer
  math (torch.optim's SGD / Adam / AdamW) writing the next weight version into the other buffer;
* ``adama_accumulate`` / ``adama_update`` — AdamA optimizer accumulation (opt-in, no gradient buffer).

The runtime goes through one seam, ``ops(device, force=None)``: Triton on CUDA, the torch
references elsewhere (what the CPU runtime runs); ``force="triton"`` runs the kernels on CPU
under Triton's interpreter, which must be enabled with ``TRITON_INTERPRET=1`` *before* anything
imports the kernel modules. Importing this package imports no Triton: the kernel modules
(``fxpipe.kernels.accumulate``, ``.update``, ``.adama``) load on first use of the Triton backend.
"""
from .dispatch import BACKENDS, KernelOps, backend, ops
from .errors import KernelBackendError, KernelError
from .optim import OptimizerSpec, init_state
from .reference import (accumulate_reference, adama_accumulate_reference, adama_update_reference,
                        update_reference)

__all__ = [
    "BACKENDS", "KernelOps", "backend", "ops",
    "KernelError", "KernelBackendError",
    "OptimizerSpec", "init_state",
    "accumulate_reference", "update_reference", "adama_accumulate_reference", "adama_update_reference",
]
