"""Planning for a cluster: the PipeDream-2BW paper's GPT models on its 64-V100 cluster, from meta.

    python benchmarks/planning.py            # about 3 minutes on 2 CPU cores (2-core Xeon host)
    python benchmarks/planning.py --quick    # the 1.3B model and the capacity search only (about 2.5)

(1) GPT-1.3B (24 layers x 2048 x 16 heads), GPT-2.2B (32 x 2304 x 32) and GPT-3.8B
(32 x 3072 x 32), GPT-2 vocabulary (50257), sequence length 512, built on the meta device
(fxpipe.demo.GPT, tied embedding), planned by ``fxpipe.plan`` for ``Cluster.preset("p3.16xlarge",
nodes=8)`` with global batch 512, 2bw, fp16. Each model is planned in a fresh process, which
reports the wall time (trace + search) and its peak resident memory. Printed: the choice, the
paper's depth (2.2B: d = 8, 3.8B: d = 16) and the best that depth gives in fxpipe's own
prediction. Targets: each plan < 60 s, RSS < 2 GB.
(2) Why fxpipe's depth differs from the paper's: the best throughput of every depth under
fxpipe's model, and with one assumption changed at a time (a Cluster subclass, nothing patched):
no sharing of a node's network interface among the all-reduce rings that leave it at once, and
gradients reduced in fp16 instead of the fp32 accumulators fxpipe's runtime reduces.
(3) Capacity: the deepest GPT of hidden size 1024 and 16 heads (sequence 512) that fits
64 x V100-16GB with 2bw and fp16, costed one block at a time (``BlockCosting``, ``capacity``).
The paper reports almost 30B parameters at d = 64 (about 2,400 layers). Target: < 5 minutes.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import time

import torch
from tabulate import tabulate

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if sys.path and os.path.abspath(sys.path[0] or os.curdir) == ROOT:
    sys.path.pop(0)  # keep the repository's kernels/ folder from shadowing a package of that name

import fxpipe  # noqa: E402
from fxpipe.cluster import Cluster  # noqa: E402
from fxpipe.cost import annotate  # noqa: E402
from fxpipe.demo import GPT, GPTConfig  # noqa: E402
from fxpipe.partition import BlockCosting, capacity  # noqa: E402

SIZES = {"1.3B": (24, 2048, 16), "2.2B": (32, 2304, 32), "3.8B": (32, 3072, 32)}
PAPER_DEPTH = {"2.2B": 8, "3.8B": 16}  # PipeDream-2BW, 64 V100-16GB, global batch 512
SEQ, VOCAB, BATCH = 512, 50257, 512


def machine() -> str:
    return (f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, "
            f"python {platform.python_version()}")


def cluster() -> Cluster:
    return Cluster.preset("p3.16xlarge", nodes=8)


def gpt(name: str, layers: int | None = None):
    n_layer, width, heads = SIZES[name] if name in SIZES else (layers, 1024, 16)
    with torch.device("meta"):
        model = GPT(GPTConfig(vocab_size=VOCAB, block_size=SEQ, n_layer=layers or n_layer, n_embd=width, n_head=heads))
    return model, (torch.zeros(1, SEQ, dtype=torch.long, device="meta"),)


class Unshared(Cluster):
    """What-if: every all-reduce ring has the node's interface to itself."""

    def ring_bandwidth(self, group, concurrent=()):
        return super().ring_bandwidth(group, ())


class HalfGradients(Cluster):
    """What-if: gradients reduced in a 2-byte dtype (half the bytes of fxpipe's fp32 accumulators)."""

    def allreduce_time(self, nbytes, group, concurrent=()):
        return super().allreduce_time(nbytes / 2, group, concurrent)


def plan_one(name: str) -> dict:
    """Plan one model (in this process) and report what the parent prints."""
    t0 = time.perf_counter()
    model, inputs = gpt(name)
    p = fxpipe.plan(model, inputs, cluster=cluster(), global_batch=BATCH, schedule="2bw", precision="fp16")
    seconds = time.perf_counter() - t0
    return {
        "name": name, "seconds": seconds, "rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "params": sum(t.numel() for t in model.parameters()),
        "choice": [p.stages * p.width, p.stages, p.width, p.microbatch_size, p.microbatches, any(p.recompute)],
        "throughput": p.throughput, "text": str(p),
    }


def depths(name: str, variants: dict[str, Cluster], ds=(4, 8, 16, 32, 64)) -> dict[str, dict[int, float | None]]:
    """The best predicted throughput of each depth on all 64 accelerators, per cluster variant."""
    model, inputs = gpt(name)
    gm = fxpipe.trace(model, inputs)
    costs = annotate(gm, device=cluster().device_model("fp16"))
    out: dict[str, dict[int, float | None]] = {}
    for label, c in variants.items():
        out[label] = {}
        for d in ds:
            try:
                out[label][d] = fxpipe.plan(gm, inputs, cluster=c, world_size=64, stages=d, global_batch=BATCH,
                                            precision="fp16", costs=costs, top=1).throughput
            except fxpipe.PlanError:
                out[label][d] = None  # no configuration of this depth fits
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--one", help=argparse.SUPPRESS)  # child process: plan one model, print JSON
    args = ap.parse_args()
    if args.one:
        print(json.dumps(plan_one(args.one)))
        return
    print(f"machine: {machine()}")
    print(f"cluster: {cluster().describe()}")

    names = ["1.3B"] if args.quick else list(SIZES)
    rows, texts, results = [], [], {}
    for name in names:
        out = subprocess.run([sys.executable, os.path.abspath(__file__), "--one", name], capture_output=True, text=True,
                             check=True, cwd=os.path.dirname(os.path.abspath(__file__)))
        r = json.loads(out.stdout.strip().splitlines()[-1])
        results[name] = r
        texts.append(f"--- GPT-{name} ---\n{r['text']}")
        N, d, w, b, m, rc = r["choice"]
        rows.append([f"GPT-{name}", f"{r['params'] / 1e9:.2f}B", f"{r['seconds']:.1f}", f"{r['rss_mib']:.0f}",
                     f"N={N} d={d} w={w} b={b} m={m} rc={'on' if rc else 'off'}", f"{r['throughput']:.1f}"])
    print("\n(1) fxpipe.plan on meta for 8 x p3.16xlarge, global batch 512, 2bw, fp16 (fresh process each)")
    print(tabulate(rows, headers=["model", "params", "plan s", "peak RSS MiB", "chosen", "samples/s"]))
    for t in texts:
        print("\n" + t)

    if not args.quick:
        print("\n(2) best predicted samples/s of each depth d on 64 V100s (w = 64 / d); the paper's depth marked *")
        base = cluster()
        fields = {f: getattr(base, f) for f in base.__dataclass_fields__}
        variants = {"fxpipe (as the runtime runs)": base, "rings do not share a node's interface": Unshared(**fields),
                    "gradients reduced in fp16": HalfGradients(**fields)}
        for name, paper in PAPER_DEPTH.items():
            table = depths(name, variants)
            rows = []
            for label, by_d in table.items():
                best = max(v for v in by_d.values() if v is not None)
                win = min(d for d, v in by_d.items() if v == best)
                cells = ["no fit" if v is None else f"{v:.1f}" + ("*" if d == paper else "") for d, v in by_d.items()]
                gap = by_d[paper]
                rows.append([label, *cells, win, "-" if gap is None else f"{1 - gap / best:.1%}"])
            print(f"\nGPT-{name} (paper: d = {paper})")
            print(tabulate(rows, headers=["model", *[f"d={d}" for d in table[next(iter(table))]], "winner",
                                          "paper's d behind by"]))

    print("\n(3) capacity: deepest GPT (hidden 1024, 16 heads, seq 512) fitting 64 x V100-16GB, 2bw, fp16")
    t0 = time.perf_counter()
    blocks = BlockCosting.from_model(*gpt("capacity", layers=4), device=cluster().device_model("fp16"))
    cap = capacity(blocks, cluster=cluster(), global_batch=BATCH, schedule="2bw", precision="fp16")
    seconds = time.perf_counter() - t0
    print(tabulate([["fxpipe", cap.layers, f"{cap.params / 1e9:.2f}B", cap.stages,
                     f"{cap.memory / 1e9:.2f} / {cap.memory_limit / 1e9:.2f} GB", f"{seconds:.0f}"],
                    ["PipeDream-2BW paper", "~2,400", "almost 30B", 64, "16 GB", "-"]],
                   headers=["", "layers", "params", "d", "fullest accelerator", "search s"]))
    print(cap.describe())


if __name__ == "__main__":
    main()
