"""Benchmark the fused flat-buffer kernels against torch's multi-tensor and per-parameter paths.

    python benchmarks/kernels.py            # sizes chosen for the device found
    python benchmarks/kernels.py --sizes 1000000 4000000 --repeat 7

Three operations of a pipeline stage, over a flat fp32 buffer split into parameter-sized views:

* accumulate: ``acc += g / m`` — fused one-launch kernel vs ``torch._foreach_add_`` vs a
  per-parameter ``add_`` loop;
* AdamW update: fused 2BW update (new version into the other buffer) vs ``torch.optim.AdamW``
  with ``foreach=True``, ``fused=True`` and the per-parameter loop (``foreach=False``);
* mixed AdamW update (``precision="bf16"``): the fp32 master stepped in place and its bf16 copy
  written in the same pass vs ``torch.optim.AdamW`` followed by a cast into the copy.

Each row reports the median time, the bytes the operation must move at the least (the floor:
every input read once, every output written once) and the bandwidth that floor implies, and the
speed-up over the per-parameter loop measured in the same run. On a GPU, times come from
``triton.testing.do_bench``. Without one, the Triton kernels can only run in Triton's
interpreter, whose speed says nothing about the kernels: the script then times the torch paths
only (plus the flat torch reference the CPU runtime uses) and runs the kernels once under the
interpreter as a correctness check, and says so.
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time

import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    # Triton decides on interpretation when the kernels are decorated: before importing them.
    os.environ["TRITON_INTERPRET"] = "1"

import triton  # noqa: E402
from tabulate import tabulate  # noqa: E402

from fxpipe.kernels import OptimizerSpec, init_state, ops  # noqa: E402

#: Parameter sizes a flat buffer is cut into, cycled: weight matrices with small biases/norms between.
PARAM_PATTERN = (262144, 1024, 65536, 256)
FP32 = 4


def _split(numel: int) -> list[int]:
    sizes, total, i = [], 0, 0
    while total < numel:
        size = min(PARAM_PATTERN[i % len(PARAM_PATTERN)], numel - total)
        sizes.append(size)
        total += size
        i += 1
    return sizes


def _views(flat: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
    return list(torch.split(flat, sizes))


def _time_ms(fn, repeat: int) -> float:
    if HAS_CUDA:
        return triton.testing.do_bench(fn, return_mode="median")
    for _ in range(2):  # warm-up: first-touch page faults, torch's lazy init
        fn()
    samples = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1e3)
    return statistics.median(samples)


def _accumulate_rows(numel: int, device: torch.device, repeat: int, kernels) -> list[list]:
    sizes = _split(numel)
    acc, grad = torch.randn(numel, device=device), torch.randn(numel, device=device)
    accs, grads = _views(acc, sizes), _views(grad, sizes)
    scale = 1 / 8
    floor = 3 * numel * FP32  # read acc, read grad, write acc

    def loop():
        for a, g in zip(accs, grads):
            a.add_(g, alpha=scale)

    variants = [("per-parameter loop", loop, len(sizes)),
                ("torch._foreach_add_", lambda: torch._foreach_add_(accs, grads, alpha=scale), None)]
    if kernels.name == "triton":
        variants.append(("fused Triton kernel", lambda: kernels.accumulate(acc, grad, scale), 1))
    else:
        variants.append(("flat torch reference (CPU path)", lambda: kernels.accumulate(acc, grad, scale), None))
    return _rows("accumulate", numel, len(sizes), floor, variants, repeat)


def _torch_adamw(numel, device, sizes, hyper, flags, label):
    """(torch.optim.AdamW over parameter views of one flat buffer, stepped once, the buffer), or
    None where the variant is not built for the device (fused=True)."""
    flat = torch.randn(numel, device=device)
    params = [torch.nn.Parameter(v) for v in _views(flat, sizes)]
    for p, g in zip(params, _views(torch.randn(numel, device=device), sizes)):
        p.grad = g
    try:
        opt = torch.optim.AdamW(params, **hyper, **flags)
        opt.step()
    except (RuntimeError, ValueError) as e:
        print(f"note: skipped {label}: {e}", file=sys.stderr)
        return None
    return opt, flat


def _adamw_rows(numel: int, device: torch.device, repeat: int, kernels) -> list[list]:
    sizes = _split(numel)
    hyper = dict(lr=1e-3, weight_decay=0.01)
    floor = 7 * numel * FP32  # read grad, weights, exp_avg, exp_avg_sq; write new weights, exp_avg, exp_avg_sq
    variants = []
    for label, flags in (("per-parameter loop (foreach=False)", dict(foreach=False)),
                         ("torch.optim foreach=True", dict(foreach=True)),
                         ("torch.optim fused=True", dict(fused=True))):
        made = _torch_adamw(numel, device, sizes, hyper, flags, label)
        if made is not None:
            variants.append((label, made[0].step, None))
    spec = OptimizerSpec("adamw", **hyper)
    state = init_state(spec, numel, device)
    grad = torch.randn(numel, device=device)
    buffers = [torch.randn(numel, device=device), torch.empty(numel, device=device)]
    step = [0]

    def fused():
        step[0] += 1  # 2BW: version t in one buffer, t+1 into the other
        kernels.update(spec, step[0], grad, buffers[step[0] % 2], buffers[(step[0] + 1) % 2], state)

    label = "fused Triton 2BW update" if kernels.name == "triton" else "flat torch reference (CPU path)"
    variants.append((label, fused, 1 if kernels.name == "triton" else None))
    return _rows("AdamW update", numel, len(sizes), floor, variants, repeat)


MIXED_FLOOR = 7 * FP32 + 2  # B/element: the fused mixed update (see _mixed_rows)
UNFUSED_FLOOR = 7 * FP32 + FP32 + 2  # optimizer.step() on the master, then a cast pass into the copy


def _mixed_rows(numel: int, device: torch.device, repeat: int, kernels) -> list[list]:
    """Mixed precision's AdamW update: step the fp32 master and write its bf16 compute copy. Fused,
    one pass reads grad, master, exp_avg, exp_avg_sq and writes master, exp_avg, exp_avg_sq and the
    copy (7 x 4 + 2 = 30 B/element, the floor); torch.optim steps the master, then a second pass
    reads it again to write the copy (at least 34 B/element)."""
    sizes = _split(numel)
    hyper = dict(lr=1e-3, weight_decay=0.01)
    variants = []
    for label, flags in (("torch.optim foreach=True + copy_", dict(foreach=True)),
                         ("torch.optim fused=True + copy_", dict(fused=True))):
        made = _torch_adamw(numel, device, sizes, hyper, flags, label)
        if made is not None:
            opt, flat = made
            copy = torch.empty(numel, device=device, dtype=torch.bfloat16)
            variants.append((label, lambda opt=opt, flat=flat, copy=copy: (opt.step(), copy.copy_(flat)), None))
    spec = OptimizerSpec("adamw", **hyper)
    state = init_state(spec, numel, device)
    grad, master = torch.randn(numel, device=device), torch.randn(numel, device=device)
    copy = torch.empty(numel, device=device, dtype=torch.bfloat16)
    step = [0]

    def fused():
        step[0] += 1
        kernels.update(spec, step[0], grad, master, master, state, copy=copy)

    label = "fused Triton update + copy" if kernels.name == "triton" else "flat torch reference + copy (CPU path)"
    variants.append((label, fused, 1 if kernels.name == "triton" else None))
    return _rows("mixed AdamW update", numel, len(sizes), MIXED_FLOOR * numel, variants, repeat)


def _rows(op, numel, n_params, floor, variants, repeat):
    timed = [(label, _time_ms(fn, repeat)) for label, fn, _ in variants]
    baseline = timed[0][1]
    return [[op, f"{numel:,}", n_params, label, f"{ms:.3f}", f"{floor / 2**20:.1f}",
             f"{floor / ms / 1e6:.1f}", f"{baseline / ms:.2f}x"] for label, ms in timed]


def _interpreter_check() -> list[list]:
    """Run each Triton kernel once under the interpreter and compare with its torch reference."""
    from fxpipe.kernels.accumulate import accumulate, accumulate_reference
    from fxpipe.kernels.adama import adama_accumulate, adama_accumulate_reference
    from fxpipe.kernels.update import update, update_reference

    n = 33333
    gen = torch.Generator().manual_seed(0)
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        g = torch.randn(n, generator=gen).to(dtype)
        a = torch.randn(n, generator=gen).to(dtype)
        got, want = a.clone(), a.clone()
        accumulate(got, g, 0.125)
        accumulate_reference(want, g, 0.125)
        rows.append(("accumulate", dtype, (got.float() - want.float()).abs().max().item()))
        spec = OptimizerSpec("adamw", lr=1e-3, weight_decay=0.01)
        s1, s2 = init_state(spec, n), init_state(spec, n)
        got, want = torch.full_like(a, float("nan")), torch.empty_like(a)
        update(spec, 1, g, a, got, s1, clip=0.5)
        update_reference(spec, 1, g, a, want, s2, clip=0.5)
        rows.append(("AdamW update", dtype, (got.float() - want.float()).abs().max().item()))
        if dtype == torch.bfloat16:  # mixed precision: fp32 master in place, its bf16 copy beside it
            master, s1, s2 = torch.randn(n, generator=gen), init_state(spec, n), init_state(spec, n)
            got_w, want_w = master.clone(), master.clone()
            got, want = torch.full_like(a, float("nan")), torch.empty_like(a)
            update(spec, 1, g.float(), got_w, got_w, s1, copy=got)
            update_reference(spec, 1, g.float(), want_w, want_w, s2, copy=want)
            rows.append(("mixed AdamW update (copy)", dtype, (got.float() - want.float()).abs().max().item()))
        s1, s2 = init_state(spec, n), init_state(spec, n)
        adama_accumulate(spec, g, s1, scale=0.25, first=True)
        adama_accumulate_reference(spec, g, s2, scale=0.25, first=True)
        rows.append(("AdamA accumulate", dtype, (s1["exp_avg_sq"] - s2["exp_avg_sq"]).abs().max().item()))
    limit = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
    return [[op, str(dt).replace("torch.", ""), f"{n:,}", f"{err:.2e}", "PASS" if err <= limit[dt] else "FAIL"]
            for op, dt, err in rows]


def _machine() -> str:
    if HAS_CUDA:
        device = torch.cuda.get_device_name()
    else:
        device = platform.processor() or platform.machine()
        try:
            with open("/proc/cpuinfo") as f:
                device = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
        except (OSError, StopIteration):
            pass
        device = f"CPU {device}, {os.cpu_count()} cores, {torch.get_num_threads()} torch threads"
    return (f"machine: {device} | torch {torch.__version__} | triton {triton.__version__} | "
            f"python {platform.python_version()}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+",
                        default=[1 << 20, 16 << 20, 64 << 20] if HAS_CUDA else [1 << 18, 1 << 20, 4 << 20],
                        help="flat buffer sizes in elements (fp32)")
    parser.add_argument("--repeat", type=int, default=11, help="timed runs per variant on CPU (median)")
    args = parser.parse_args(argv)
    device = torch.device("cuda" if HAS_CUDA else "cpu")
    kernels = ops(device)
    print(_machine())
    if not HAS_CUDA:
        print("No CUDA device: the Triton kernels are NOT timed (the interpreter's speed is not a kernel "
              "figure). Timed below: the torch paths, including the flat torch reference the CPU runtime uses.")
    rows = []
    for numel in args.sizes:
        rows += _accumulate_rows(numel, device, args.repeat, kernels)
        rows += _adamw_rows(numel, device, args.repeat, kernels)
        rows += _mixed_rows(numel, device, args.repeat, kernels)
    print(tabulate(rows, headers=["op", "elements", "params", "variant", "ms (median)", "floor MB",
                                  "GB/s at floor", "vs per-param loop"], stralign="right"))
    print("floor: accumulate reads acc and grad and writes acc (3 x 4 B/element); the AdamW update reads "
          "grad, weights, exp_avg, exp_avg_sq and writes weights, exp_avg, exp_avg_sq (7 x 4 B/element).")
    print(f"mixed precision (fp32 master, bf16 copy): the fused update moves {MIXED_FLOOR} B/element in one pass, "
          f"its floor; optimizer.step() and then a cast of the master into the copy move at least "
          f"{UNFUSED_FLOOR} B/element in two passes ({UNFUSED_FLOOR / MIXED_FLOOR:.2f}x the bytes).")
    if not HAS_CUDA:
        print("\nInterpreter correctness check (TRITON_INTERPRET=1; Triton kernels vs torch references, "
              "max abs difference):")
        check = _interpreter_check()
        print(tabulate(check, headers=["kernel", "dtype", "elements", "max |kernel - reference|", "result"]))
        if any(r[-1] == "FAIL" for r in check):
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
