"""Triton helpers shared by the kernel files: rounding on store, launch geometry, interpreter check.

Triton chooses between compiling and interpreting when a kernel is *decorated*, i.e. when its
module is imported, from ``TRITON_INTERPRET``. Nothing outside the kernel files imports this
module, so ``import fxpipe.kernels`` alone never fixes the mode.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .errors import KernelBackendError

#: Elements per program on a GPU: 1024 with 4 warps is 8 per thread, i.e. two 16-byte loads of fp32.
GPU_BLOCK = 1024
#: Elements per program in the interpreter, which pays per program, not per element.
INTERPRETER_BLOCK = 8192


@triton.jit
def store_rounded(ptr, x, mask):
    """Store float32 ``x`` at ``ptr`` (any of fp32/bf16/fp16), rounding to nearest-even.

    A GPU rounds fp32 -> bf16 to nearest-even, but the interpreter truncates; rounding the
    bits here first makes the conversion exact on both, so interpreter results are the GPU's
    and torch's ``.to(torch.bfloat16)`` bit for bit.
    """
    if ptr.dtype.element_ty == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        x = tl.where(x != x, x, bits.to(tl.float32, bitcast=True))  # keep NaN a NaN
    tl.store(ptr, x.to(ptr.dtype.element_ty), mask=mask)


def is_interpreted(kernel) -> bool:
    """Whether ``kernel`` was decorated under ``TRITON_INTERPRET=1`` (runs on CPU tensors)."""
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(kernel, InterpretedFunction)


def interpreter_error(kernel_name: str, device: torch.device | str) -> KernelBackendError:
    return KernelBackendError(
        f"fxpipe.kernels: the Triton kernel {kernel_name} cannot run on {device}: it was compiled for a GPU "
        f"(TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET')!r} when fxpipe.kernels' Triton modules were "
        f"imported) and no CUDA device holds the buffers. Set TRITON_INTERPRET=1 in the environment before "
        f"anything imports the kernels (e.g. first thing in conftest.py or the script) to run them on CPU, "
        f"or use backend 'torch'.")


def launch_config(kernel, kernel_name: str, device: torch.device, block: int | None) -> tuple[int, dict]:
    """``(BLOCK, launch options)`` for a launch on ``device``, after checking the kernel can run there.

    The options turn off the compiler's fusing of a multiply and an add into one FMA, so every
    launch rounds each operation on its own, as the torch reference does. With fusion on, the
    first GPU run (H100) found the same element of the same inputs rounded one ulp apart when
    the update ran over a stage's whole flat buffer and over the parameter's slice of it: GPT-2's
    tied embedding, whose copies on two stages sit in different flat buffers and must stay bit
    for bit equal, drifted apart from the second step. The kernels are memory-bound, so the
    extra instructions cost nothing measurable (benchmarks/kernels.py)."""
    interpreted = is_interpreted(kernel)
    if device.type != "cuda" and not interpreted:
        raise interpreter_error(kernel_name, device)
    if block is None:
        block = INTERPRETER_BLOCK if interpreted else GPU_BLOCK
    if block < 16 or block & (block - 1):
        from .errors import KernelError

        raise KernelError(f"{kernel_name}: expected block to be a power of two >= 16, found {block}")
    return block, dict(num_warps=4 if block <= 1024 else 8, enable_fp_fusion=False)
