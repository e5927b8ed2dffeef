"""Partitioner benchmark: planning time on 1k-50k-node graphs, and the balance of measured stages.

    python benchmarks/partition.py            # a few minutes on 2 CPU cores
    python benchmarks/partition.py --quick    # smaller deep model, fewer repeats

(1) Planning time: ``partition_chain`` alone on synthetic chains of 1k, 10k and 50k nodes (random
costs, skip-free chain edges, 10% invalid cuts, a binding memory limit), and ``fxpipe.partition.plan``
end to end (trace + analytic costs + partition) on a deep Hugging Face GPT-2 (tiny width, ~4k nodes).
(2) Balance: the demo GPT and HF GPT-2 (8 layers, 128 wide), measured costs, cut into 2 and 4
stages; each stage is then built by ``fxpipe.codegen.split`` and its forward+backward timed on
real tensors (median of repeats). The ratio is slowest stage / max(total / d, largest single
operator), where total is the sum of the measured stage times and the largest operator's
fwd+bwd comes from the profiler. Target: <= 1.15.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time

import numpy as np
import torch
from tabulate import tabulate

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _transformers():
    # transformers probes for an optional package named `kernels`; keep the repository's own
    # kernels/ folder off the path while it does (see tests/models.py).
    saved = sys.path[:]
    sys.path[:] = [p for p in saved if os.path.abspath(p or os.curdir) != ROOT]
    try:
        import transformers
        from transformers.utils import import_utils

        import_utils.is_kernels_available()
        transformers.logging.set_verbosity_error()
    finally:
        sys.path[:] = saved
    return transformers


import fxpipe  # noqa: E402
from fxpipe.codegen import split  # noqa: E402
from fxpipe.cost import DeviceModel, annotate  # noqa: E402
from fxpipe.trace import normalize_inputs  # noqa: E402
from fxpipe.partition import Chain, StageModel, partition_chain, plan  # noqa: E402


def machine() -> str:
    return (f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, "
            f"{torch.get_num_threads()} intra-op thread(s), python {platform.python_version()}")


def synthetic(n: int, seed: int = 0) -> Chain:
    rng = np.random.default_rng(seed)
    act = rng.uniform(1e3, 1e5, n)
    tensors = n // 4
    readers = tuple(np.array([r]) for r in rng.choice(n, tensors, replace=False))
    return Chain(rng.uniform(1e-5, 1e-3, n), rng.uniform(2e-5, 2e-3, n), act, act[:-1], act[:-1],
                 rng.random(n - 1) > 0.1, rng.uniform(1e4, 1e6, tensors), readers)


def bench_synthetic(sizes, depths) -> None:
    rows = []
    dev = DeviceModel.cpu()
    for n in sizes:
        chain = synthetic(n)
        for d in depths:
            free = StageModel.for_schedule("2bw", d, 2 * d, False, dev, float("inf"))
            part = partition_chain(chain, free)
            # bind memory: 90% of what the unconstrained optimum's largest stage needs
            from fxpipe.partition import stage_memory

            need = max(stage_memory(chain, free, s, l, r) for s, (l, r) in enumerate(part.bounds))
            model = StageModel.for_schedule("2bw", d, 2 * d, False, dev, 0.9 * need)
            times = []
            for _ in range(3):
                t0 = time.perf_counter()
                p = partition_chain(chain, model)
                times.append(time.perf_counter() - t0)
            rows.append([n, d, statistics.median(times), p.bottleneck / part.bottleneck])
    print(tabulate(rows, headers=["nodes", "stages", "partition s", "bottleneck / unconstrained"], floatfmt=".3f"))


def deep_gpt2(layers: int, batch: int = 2, seq: int = 16):
    tf = _transformers()
    torch.manual_seed(0)
    cfg = tf.GPT2Config(n_layer=layers, n_embd=32, n_head=4, vocab_size=100, n_positions=64, use_cache=False,
                        bos_token_id=0, eos_token_id=0)
    model = tf.GPT2LMHeadModel(cfg)
    ids = torch.randint(0, 100, (batch, seq))
    return model, {"input_ids": ids, "labels": ids}


def bench_end_to_end(layers: int) -> None:
    model, inputs = deep_gpt2(layers)
    t0 = time.perf_counter()
    gm = fxpipe.trace(model, inputs)
    t1 = time.perf_counter()
    costs = annotate(gm, mode="analytic")
    t2 = time.perf_counter()
    p = plan(gm, stages=8, microbatches=16, costs=costs)
    t3 = time.perf_counter()
    total = plan(model, inputs, stages=8, microbatches=16)  # the entry point, from the module
    t4 = time.perf_counter()
    assert total.assignment == p.assignment
    nodes = sum(1 for _ in gm.graph.nodes)
    print(tabulate([[f"HF GPT-2 {layers} layers", nodes, t1 - t0, t2 - t1, t3 - t2, t4 - t3]],
                   headers=["model", "nodes", "trace s", "cost s", "partition s", "plan() end to end s"],
                   floatfmt=".2f"))


def stage_times(staged, flat_inputs, repeats: int) -> list[float]:
    """Median forward+backward seconds of each codegen stage, on its real inputs. The stages are
    timed round-robin (one run of every stage per round), so a burst of background load on a
    shared machine slows all stages alike instead of one."""
    env = dict(zip(staged.input_names, flat_inputs))
    carry: tuple = ()
    runs = []
    for st in staged.stages:
        model_in = [env[n] for n in st.model_inputs]
        boundary = [x.detach().requires_grad_(x.is_floating_point()) if isinstance(x, torch.Tensor) else x
                    for x in carry]

        def step(st=st, model_in=model_in, boundary=boundary):
            res = st.module(*model_in, *boundary)
            outs = [t for t in res if isinstance(t, torch.Tensor) and t.requires_grad]
            torch.autograd.backward(outs, [torch.ones_like(t) for t in outs])
            return res

        res = step()  # warm-up, and the next stage's inputs
        runs.append(step)
        carry = tuple(t.detach() if isinstance(t, torch.Tensor) else t for t in res)
    samples: list[list[float]] = [[] for _ in runs]
    for _ in range(repeats):
        for i, step in enumerate(runs):
            t0 = time.perf_counter()
            step()
            samples[i].append(time.perf_counter() - t0)
    return [statistics.median(s) for s in samples]


def bench_balance(repeats: int) -> None:
    from fxpipe.demo import GPT, GPTConfig

    tf = _transformers()
    torch.manual_seed(0)
    demo = GPT(GPTConfig(n_layer=8, n_embd=128, n_head=4, vocab_size=256, block_size=64))
    demo_in = (torch.randint(0, 256, (8, 64)),)
    hf = tf.GPT2LMHeadModel(tf.GPT2Config(n_layer=8, n_embd=128, n_head=4, vocab_size=256, n_positions=64,
                                          use_cache=False, bos_token_id=0, eos_token_id=0))
    ids = torch.randint(0, 256, (8, 64))
    hf_in = {"input_ids": ids, "labels": ids}
    rows = []
    for name, model, inputs in (("demo GPT 8x128", demo, demo_in), ("HF GPT-2 8x128", hf, hf_in)):
        gm = fxpipe.trace(model, inputs)
        costs = annotate(gm, inputs, mode="measured", repeats=repeats)
        largest = max(c.fwd_time(costs.batch_size) + c.bwd_time(costs.batch_size) for c in costs.nodes.values())
        args, kwargs = normalize_inputs(inputs)
        flat = gm.meta["fxpipe"].flatten_inputs(args, kwargs)
        for d in (2, 4):
            p = plan(gm, inputs, stages=d, microbatches=2 * d, costs=costs, recompute=False)
            staged = split(gm, p.assignment)
            measured = stage_times(staged, flat, repeats)
            ideal = max(sum(measured) / d, largest)
            predicted = [sp.forward_time + sp.backward_time for sp in p.stage_plans]
            rows.append([name, d, len([n for n in gm.graph.nodes]),
                         " ".join(f"{t * 1e3:.1f}" for t in predicted),
                         " ".join(f"{t * 1e3:.1f}" for t in measured),
                         max(measured) * 1e3, ideal * 1e3, max(measured) / ideal])
    print(tabulate(rows, headers=["model", "d", "nodes", "predicted fwd+bwd ms", "measured fwd+bwd ms",
                                  "slowest ms", "ideal ms", "ratio"], floatfmt=".3f"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--threads", type=int, default=1,
                    help="intra-op threads (1: per-op timings on a busy 2-core machine are stable)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"machine: {machine()}\n")
    print("(1a) partitioner alone, synthetic chains, binding memory limit")
    bench_synthetic([1_000, 10_000] if args.quick else [1_000, 10_000, 50_000], [4, 8])
    print("\n(1b) fxpipe.partition.plan end to end (trace + analytic cost + partition, 8 stages)")
    bench_end_to_end(8 if args.quick else 74)
    print("\n(2) balance: measured costs, stages built by fxpipe.codegen.split, fwd+bwd timed per stage")
    bench_balance(3 if args.quick else 7)


if __name__ == "__main__":
    main()
