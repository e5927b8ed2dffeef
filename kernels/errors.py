"""Errors the kernel layer raises, with the checks that raise them.

Every message says what was expected, what was found and what to do, so a wrong buffer
handed over by the runtime is caught at the launch wrapper and not as garbage weights.
"""
from __future__ import annotations

import torch

from ..errors import FxpipeError

#: Dtypes a flat weight or gradient buffer may have; the math always runs in fp32.
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
REFERENCE_DTYPES = FLOAT_DTYPES + (torch.float64,)  # the torch references also take float64


class KernelError(FxpipeError, ValueError):
    """A buffer or argument handed to a kernel has the wrong shape, dtype, device or layout."""


class KernelBackendError(FxpipeError, RuntimeError):
    """The requested kernel backend cannot run here (no GPU and no Triton interpreter)."""


def check_flat(op: str, name: str, t: object, *, numel: int | None = None,
               device: torch.device | None = None, dtypes=FLOAT_DTYPES) -> torch.Tensor:
    """Check that ``t`` is a 1-D contiguous float tensor of ``numel`` elements on ``device``."""
    if not isinstance(t, torch.Tensor):
        raise KernelError(f"{op}: expected {name} to be a torch.Tensor, found {type(t).__name__}; "
                          f"pass the stage's flat buffer")
    if t.dim() != 1:
        raise KernelError(f"{op}: expected {name} to be a 1-D flat buffer, found shape {tuple(t.shape)}; "
                          f"pass the flat buffer (or .view(-1) of a contiguous tensor)")
    if not t.is_contiguous():
        raise KernelError(f"{op}: expected {name} to be contiguous, found stride {t.stride()}; "
                          f"pass a contiguous slice of the flat buffer (or .contiguous())")
    if t.dtype not in dtypes:
        want = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise KernelError(f"{op}: expected {name} dtype in ({want}), found {str(t.dtype).replace('torch.', '')}; "
                          f"keep one flat buffer per dtype and keep optimizer state in float32")
    if numel is not None and t.numel() != numel:
        raise KernelError(f"{op}: expected {name} to have {numel} elements (like the gradient), "
                          f"found {t.numel()}; pass buffers of the same stage and dtype group")
    if device is not None and t.device != device:
        raise KernelError(f"{op}: expected {name} on {device} (like the gradient), found {t.device}; "
                          f"move all buffers of one call to the same device")
    return t


def check_no_partial_overlap(op: str, a_name: str, a: torch.Tensor, b_name: str, b: torch.Tensor) -> None:
    """Allow ``a`` and ``b`` to be the very same buffer (in place) or disjoint, nothing in between.

    Each element is read and written by the same program, so exact aliasing is safe; a shifted
    overlap would let one program read what another already overwrote.
    """
    if a.numel() == 0 or b.numel() == 0:
        return
    a0, b0 = a.data_ptr(), b.data_ptr()
    a1, b1 = a0 + a.numel() * a.element_size(), b0 + b.numel() * b.element_size()
    same = a0 == b0 and a1 == b1 and a.dtype == b.dtype
    if not same and a0 < b1 and b0 < a1:
        raise KernelError(f"{op}: {a_name} and {b_name} partially overlap in memory "
                          f"([{a0:#x}, {a1:#x}) vs [{b0:#x}, {b1:#x})); pass the same buffer to update "
                          f"in place, or the other version's buffer to update out of place")


def check_disjoint(op: str, a_name: str, a: torch.Tensor, b_name: str, b: torch.Tensor) -> None:
    """``a`` and ``b`` share no memory: a buffer the update reads (the gradient) against one it
    writes (the new weights, their 16-bit copy), where even exact aliasing changes the result
    (the reference writes the weights into ``out`` before it reads the gradient)."""
    if a.numel() == 0 or b.numel() == 0:
        return
    a0, b0 = a.data_ptr(), b.data_ptr()
    a1, b1 = a0 + a.numel() * a.element_size(), b0 + b.numel() * b.element_size()
    if a0 < b1 and b0 < a1:
        raise KernelError(f"{op}: {a_name} and {b_name} overlap in memory ([{a0:#x}, {a1:#x}) vs [{b0:#x}, {b1:#x})); "
                          f"the update reads {a_name} while it writes {b_name}: pass separate buffers")


def check_scalar(op: str, name: str, value: object, device: torch.device) -> float | torch.Tensor:
    """A multiplier given as a python number or a 0-d/1-element float tensor on the buffers' device.

    A tensor lets the GPU path take a clip factor computed on the device without a host sync.
    """
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or value.dim() > 1:
            raise KernelError(f"{op}: expected {name} to be a 0-d tensor or a python float, "
                              f"found a tensor of shape {tuple(value.shape)}; pass e.g. "
                              f"torch.clamp(max_norm / (norm + 1e-6), max=1.0)")
        if value.device != device:
            raise KernelError(f"{op}: expected {name} on {device} (like the buffers), found {value.device}; "
                              f"compute it on the buffers' device or pass a python float")
        if not value.dtype.is_floating_point:
            raise KernelError(f"{op}: expected {name} to be a floating-point tensor, found {value.dtype}")
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise KernelError(f"{op}: expected {name} to be a python float or a 0-d tensor, "
                          f"found {type(value).__name__}")
    return float(value)
