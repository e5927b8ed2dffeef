"""device: where a rank computes — the one seam between fxpipe's CPU and CUDA paths.

The device-specific mechanics of the runtime live here, so the rest of fxpipe reads the same on
both: which device a rank uses, which process-group backend goes with it, how a batch gets
there, which RNGs a forked random stream must cover and a checkpoint keeps, where collective
tensors live, how the device arguments a trace on one device baked into a graph follow a stage
to another, and how a CPU rank's heap is settled (:func:`settle_heap`) and trimmed after a burst
(:func:`release_heap`). A few policies that differ by device stay with the phase they belong to:
the pipeline runs the Triton kernels only on CUDA, sets no host-side wait timeout there (a wait
only queues), and counts a CPU host's ranks for the planner; calibration synchronises CUDA
before reading a clock.

On CUDA the stream scheduling of :func:`fxpipe.schedule.lower_to_streams` is carried out by
``torch.distributed``'s NCCL process group itself, which needs no code here: every point-to-point
operation between two ranks runs on the one NCCL stream of that pair (both directions, in the
order posted — the schedule's channel order, so each send meets its receive one-for-one and no
pair can deadlock); posting an operation makes that stream wait for the compute stream as it is
at that moment (``SEND_ACT k`` waits for ``F k``); and ``Handle.wait()`` makes the compute stream
wait for the operation's completion event without blocking the host (``F k`` waits for
``RECV_ACT k``). A send's tensor is kept alive by the runtime until its handle has been waited.

Sends and receives are deliberately not grouped with ``batch_isend_irecv``: that is what keeps
unordered send/receive pairs from deadlocking, but fxpipe's channels are ordered already, and
NCCL returns ONE work for a group, so waiting for a send would also wait for a receive grouped
with it — one the schedule posts early, for a later micro-batch — and could stall compute on
it (tried on gloo with one completion shared by a group's handles, as NCCL has it: reaping a
finished send then waited for a receive whose message the peer sends only later — a deadlock).
"""

from __future__ import annotations

import copy
import os
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn
import torch.utils._pytree as pytree

from .errors import ConfigError
from .trace import graph_modules

__all__ = ["choose", "settle_heap", "release_heap", "backend_for", "to_device", "moved_copy", "follow_device", "follow_call",
           "rng_state", "set_rng_state", "rng_devices", "seed", "check_backend"]


def choose(requested: str | torch.device | None, *, distributed: bool) -> torch.device:
    """The device this process computes on.

    ``None`` or ``"auto"``: CUDA when available — ``cuda:LOCAL_RANK`` under torchrun, the current
    CUDA device otherwise — else the CPU. ``"cuda"`` without an index means the same local-rank
    device. The chosen CUDA device becomes the current one (NCCL and ``broadcast_object_list``
    use it).
    """
    if requested is None or requested == "auto":
        requested = "cuda" if torch.cuda.is_available() else "cpu"
    dev = torch.device(requested)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(
                f"device={requested!r} asks for CUDA, but torch.cuda.is_available() is False here "
                f"(torch {torch.__version__}). Pass device='cpu', or install a CUDA build of torch."
            )
        if dev.index is None:
            local = int(os.environ.get("LOCAL_RANK", "0")) if distributed else torch.cuda.current_device()
            dev = torch.device("cuda", local % torch.cuda.device_count())
        torch.cuda.set_device(dev)
    elif dev.type != "cpu":
        raise ConfigError(f"device must be 'auto', 'cpu' or 'cuda[:i]'; found {requested!r}")
    else:
        settle_heap()
    return dev


#: The size of the buffer :func:`settle_heap` allocates and frees: under glibc's 32 MiB ceiling
#: for its adaptive threshold on 64-bit systems, with room for the allocator's own header.
HEAP_SETTLING_BYTES = 30 << 20
_heap_settled = False


def _glibc() -> bool:
    """Whether this process allocates with glibc's ``malloc``."""
    try:
        return (os.confstr("CS_GNU_LIBC_VERSION") or "").startswith("glibc")
    except (ValueError, OSError, AttributeError):  # not a glibc system
        return False


def settle_heap() -> None:
    """Let glibc keep a CPU rank's freed memory for reuse: allocate and free one 30 MiB buffer,
    once per process. glibc's ``malloc`` adapts two thresholds as a process frees large buffers:
    the size from which a request gets freshly mapped pages rather than heap memory, and the
    free space at the heap's top past which ``free`` returns memory to the system. They start at
    128 and 256 KiB and rise, when a mapped buffer is freed, to its size and twice that (up to
    32 and 64 MiB). A pipeline stage on the CPU allocates and frees tens of MiB per micro-batch,
    so with the thresholds low glibc hands that memory back after each pass and the next one
    faults it in again, page by page (2,000-2,700 minor faults a step on the last stage of
    ``benchmarks/limit.py``'s GPT, under zb's split backward most of all); with them raised the
    heap is reused. This only sets off glibc's own adaptation, as any process that once freed a
    buffer this size would (no ``mallopt`` setting is changed, and settings from
    ``MALLOC_MMAP_THRESHOLD_`` and the like, which turn the adaptation off, stay as they are);
    a rank may then keep up to 60 MiB more of freed memory. Elsewhere (another C library, a
    preloaded jemalloc or tcmalloc) it only allocates and frees one buffer."""
    global _heap_settled
    if _heap_settled:
        return
    if _glibc():
        torch.empty(HEAP_SETTLING_BYTES, dtype=torch.uint8)  # allocated and freed at once
    _heap_settled = True


def release_heap() -> None:
    """Hand back to the system the memory this CPU process has freed (glibc's
    ``malloc_trim(0)``), after a one-off burst that training will not repeat: calibrating a model
    holds every node's output and backward at once (:func:`fxpipe.calibrate._roofs`), hundreds of MiB
    that, once freed, sit between live allocations where ``free`` cannot return them, so the
    rank's resident memory would stay that much higher for good (440 MiB on the pinned GPT of
    ``benchmarks/limit.py``). Training's own working set is then faulted in once, on its first
    steps; the thresholds :func:`settle_heap` raised stay raised. Elsewhere, nothing."""
    if _glibc():
        import ctypes

        trim = getattr(ctypes.CDLL(None), "malloc_trim", None)
        if trim is not None:
            trim(0)


def backend_for(device: torch.device) -> str:
    """The process-group backend that carries tensors of ``device``."""
    return "nccl" if device.type == "cuda" else "gloo"


def check_backend(backend: str, device: torch.device) -> None:
    """An existing process group must be able to move this device's tensors."""
    if backend == "nccl" and device.type != "cuda":
        raise ValueError(
            f"the default process group uses NCCL, which only moves CUDA tensors, but fxpipe was asked "
            f"to compute on {device}. Pass device='cuda', or initialise the process group with 'gloo'."
        )
    if backend == "gloo" and device.type == "cuda":
        raise ValueError(
            f"the default process group uses gloo, whose point-to-point operations move CPU tensors, but "
            f"fxpipe was asked to compute on {device}. Initialise the process group with 'nccl' "
            f"(or let fxpipe create it under torchrun), or pass device='cpu'."
        )


def to_device(tree: Any, device: torch.device) -> Any:
    """Every tensor of ``tree`` on ``device`` (``non_blocking``: asynchronous on CUDA when the
    caller's batch is in pinned memory, e.g. a ``DataLoader(pin_memory=True)``'s)."""
    return pytree.tree_map(
        lambda x: x.to(device, non_blocking=True) if isinstance(x, torch.Tensor) and x.device != device else x, tree
    )


def moved_copy(gm: fx.GraphModule, device: torch.device) -> fx.GraphModule:
    """``gm`` to run on ``device``: ``gm`` itself where its tensors are there already (or on the
    meta device: nothing to run), else a copy whose parameters, buffers and tensor attributes
    are on ``device`` and whose baked device arguments follow them (:func:`follow_device`). Each
    tensor is copied once, straight to ``device``, so the model is not duplicated where it lives;
    node names are kept. What a calibration times when the model was built on the CPU for a GPU."""
    device = torch.device(device)
    tensors = {id(t): t for m in gm.modules()
               for t in (*m._parameters.values(), *m._buffers.values(), *vars(m).values())
               if isinstance(t, torch.Tensor)}
    src = next((t.device for t in tensors.values() if t.device != device), None)
    if src is None or src.type == "meta":
        return gm
    memo = {}
    for key, t in tensors.items():
        moved = t.detach().to(device, copy=True)
        memo[key] = nn.Parameter(moved, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else moved
    out = copy.deepcopy(gm, memo)
    follow_device(out, src, device)
    return out


def follow_device(gm: fx.GraphModule, src: torch.device, dst: torch.device) -> None:
    """Point what tracing on ``src`` baked into ``gm`` at ``dst``, in place (:func:`follow_call`
    on every call), in ``gm``'s graph and in the graphs of the higher-order ops it calls (a
    ``torch.no_grad()`` or ``torch.autocast`` block of the model's code is such a subgraph:
    Llama's rotary embedding runs in one)."""
    for sub in graph_modules(gm):
        for n in sub.graph.nodes:
            n.args, n.kwargs = follow_call(n.target, n.args, n.kwargs, src, dst)
        sub.recompile()


def follow_call(target, args: tuple, kwargs: dict, src: torch.device, dst: torch.device) -> tuple[tuple, dict]:
    """A call's arguments with what tracing on ``src`` baked in pointed at ``dst``: device
    arguments (``arange(..., device=cpu)``, export's ``x.to(cpu)`` and its device assertions) and
    the device type of an ``autocast`` region. Where the model's code read the device of a value
    (``x.device``), this is what it computes on ``dst``."""
    swap = lambda x: dst if isinstance(x, torch.device) and x == src else x  # noqa: E731
    args, kwargs = fx.node.map_aggregate(args, swap), fx.node.map_aggregate(kwargs, swap)
    if target is torch.ops.higher_order.wrap_with_autocast and args and args[0] == src.type:
        args = (dst.type, *args[1:])
    return args, kwargs


def rng_state(device: torch.device) -> dict[str, torch.Tensor]:
    """The CPU generator's state and ``device``'s (a checkpoint keeps it per rank)."""
    out = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        out["cuda"] = torch.cuda.get_rng_state(device)
    return out


def set_rng_state(state: dict[str, torch.Tensor], device: torch.device) -> None:
    """Restore what :func:`rng_state` returned; a GPU's state only on a GPU (a CPU resume of a
    GPU run restores the CPU generator alone)."""
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and device.type == "cuda":
        torch.cuda.set_rng_state(state["cuda"], device)


def rng_devices(device: torch.device) -> list[torch.device]:
    """The devices whose RNG state ``torch.random.fork_rng`` must save and restore."""
    return [device] if device.type == "cuda" else []


def seed(value: int, device: torch.device) -> None:
    """Seed the CPU generator and ``device``'s. Unlike ``torch.manual_seed`` this does not queue a
    lazy seed for every accelerator backend, each with a captured stack trace: that cost ~0.7 ms
    per call on a CPU-only machine, paid per forward."""
    torch.default_generator.manual_seed(value)
    if device.type == "cuda":
        torch.cuda.default_generators[device.index if device.index is not None else torch.cuda.current_device()].manual_seed(value)
