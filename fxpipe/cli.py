"""cli: the ``fxpipe`` command (``demo``, ``inspect``, ``plan``, ``run``)."""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from typing import Callable

from .schedule import SCHEDULES


def _load_factory(spec: str, cmd: str = "inspect"):
    if ":" not in spec:
        raise SystemExit(
            f"fxpipe {cmd}: expected MODULE:FACTORY (e.g. fxpipe.demo:demo_factory), found {spec!r}"
        )
    mod_name, fn_name = spec.split(":", 1)
    sys.path.insert(0, os.getcwd())  # let users point at a module in the current folder
    try:
        mod = importlib.import_module(mod_name)
    except ImportError as e:
        raise SystemExit(f"fxpipe {cmd}: cannot import module {mod_name!r}: {e}; expected an importable module "
                         f"(run from the folder holding it, or install it)") from e
    except SyntaxError as e:
        raise SystemExit(f"fxpipe {cmd}: module {mod_name!r} does not parse: {e.msg} ({e.filename}, line {e.lineno}); "
                         f"fix the module, then run again") from e
    fn = getattr(mod, fn_name, None)
    if not callable(fn):
        raise SystemExit(f"fxpipe {cmd}: expected a callable {fn_name!r} in module {mod_name!r}, found "
                         f"{type(fn).__name__ if fn is not None else 'nothing'}; name a function returning "
                         f"(model, example_inputs)")
    result = fn()
    if not (isinstance(result, tuple) and len(result) == 2):
        raise SystemExit(
            f"fxpipe {cmd}: {spec}() must return (model, example_inputs), found {type(result).__name__}"
        )
    return result


def _cmd_inspect(args: argparse.Namespace) -> int:
    from .errors import FxpipeError
    from .inspect import inspect

    model, example_inputs = _load_factory(args.factory)
    try:
        paths = inspect(model, example_inputs, args.out, stages=args.stages or None,
                        microbatches=args.microbatches, schedule=args.schedule)
    except FxpipeError as e:  # what the user can fix (--stages, the model): its message, no traceback
        raise SystemExit(f"fxpipe inspect: {e}") from None
    except OSError as e:  # --out not writable: one line, no traceback
        raise SystemExit(f"fxpipe inspect: cannot write to --out {args.out!r}: {e}") from None
    for p in paths:
        print(p)
    return 0


def _cmd_plan(args: argparse.Namespace) -> int:
    from .errors import FxpipeError, PlanError
    from .cluster import Cluster
    from .partition import plan

    if args.json:  # before the search, not after it
        parent = os.path.dirname(os.path.abspath(args.json))
        if not os.path.isdir(parent):
            raise SystemExit(f"fxpipe plan: --json {args.json!r}: folder {parent!r} does not exist")
    try:
        cluster = Cluster.resolve(args.cluster, args.nodes)
    except PlanError as e:
        raise SystemExit(f"fxpipe plan: --cluster {args.cluster!r}: {e}") from None
    model, example_inputs = _load_factory(args.factory, "plan")
    try:
        p = plan(model, example_inputs, cluster=cluster, global_batch=args.global_batch, schedule=args.schedule,
                 precision=args.precision, world_size=args.world_size, stages=args.stages, top=args.top,
                 device_memory=args.device_memory)
    except FxpipeError as e:  # a PlanError, or a TraceError: its message, no traceback
        raise SystemExit(f"fxpipe plan: {e}") from None
    print(p)
    if args.json:
        try:
            with open(args.json, "w") as f:
                f.write(p.to_json())
        except OSError as e:
            raise SystemExit(f"fxpipe plan: cannot write --json {args.json!r}: {e}") from None
        print(f"wrote {args.json} (fxpipe.Plan.from_json reads it; compile(..., plan=...) runs it)")
    return 0


def _int_at_least(low: int, what: str) -> Callable[[str], int]:
    """An argparse type: an integer >= ``low`` (``what`` names it in the error)."""
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, found {text!r}") from None
        if v < low:
            raise argparse.ArgumentTypeError(f"expected {what}, found {v}")
        return v

    return parse


_positive_int = _int_at_least(1, "a positive integer")
_non_negative_int = _int_at_least(0, "a non-negative integer")


def _positive_bytes(text: str) -> float:
    """An argparse type: a positive, finite number of bytes (``30e9`` or ``30000000000``)."""
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of bytes such as 30e9, found {text!r}") from None
    if not (0 < v < float("inf")):
        raise argparse.ArgumentTypeError(f"expected a positive number of bytes such as 30e9, found {text!r}")
    return v


def _microbatches(text: str) -> int:
    try:
        return _positive_int(text)
    except argparse.ArgumentTypeError as e:
        raise argparse.ArgumentTypeError(f"{e} (micro-batches per step): pass --microbatches N with N >= 1, or "
                                         f"leave it out for the default max(2 x stages, 4)") from None


def _cmd_run(args: argparse.Namespace) -> int:
    # torch's own launcher: same rendezvous, environment and failure handling as torchrun.
    from torch.distributed.run import main as torchrun_main

    argv = [f"--nproc-per-node={args.nproc}", *args.torchrun_args, args.script, *args.script_args]
    if args.nproc > 1 and not any(a.startswith("--rdzv") or a.startswith("--master") for a in args.torchrun_args):
        argv.insert(0, "--standalone")
    os.environ.setdefault(*RESTARTABLE)
    torchrun_main(argv)
    return 0


# torchrun shares its rendezvous store with the workers' process group; after a restart
# (--max-restarts) the new workers can read the dead workers' addresses from it and fail to
# connect (pytorch/pytorch#135712). A store of their own avoids it; fxpipe's launchers set this.
RESTARTABLE = ("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")


def add_demo_arguments(p) -> None:
    """``fxpipe demo``'s arguments (also parsed by ``python -m fxpipe.demo`` on each rank)."""
    p.add_argument("--nproc", type=_positive_int, default=2, help="local CPU ranks (1 = all stages in this process)")
    p.add_argument("--steps", type=_positive_int, default=300, help="optimizer steps")
    p.add_argument("--schedule", default="2bw", choices=SCHEDULES)
    p.add_argument("--microbatches", type=_positive_int, default=4, help="micro-batches per step")
    p.add_argument("--microbatch-size", type=_positive_int, default=8, help="sequences per micro-batch")
    p.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate")
    p.add_argument("--out", default="fxpipe-out/demo", help="folder for the plan, stage code and timeline")
    p.add_argument("--checkpoint-dir", default=None,
                   help="save checkpoints here, and resume from the latest one when it exists")
    p.add_argument("--save-every", type=_non_negative_int, default=0,
                   help="steps between checkpoints (0: only after the last step); needs --checkpoint-dir")
    p.add_argument("--keep", type=_positive_int, default=None,
                   help="keep only the N newest checkpoints, deleting older ones (default: keep all); "
                        "needs --checkpoint-dir")


def check_demo_args(p, args) -> None:
    """What one argument cannot check alone: a usage error (exit code 2) before anything is launched."""
    if args.save_every and not args.checkpoint_dir:
        p.error(f"--save-every {args.save_every} needs --checkpoint-dir DIR to save into")
    if args.keep and not args.checkpoint_dir:
        p.error(f"--keep {args.keep} needs --checkpoint-dir DIR to save into")


def _cmd_demo(args: argparse.Namespace) -> int:
    """``fxpipe demo``: train in this process, or relaunch ``fxpipe.demo`` on ``--nproc`` ranks
    through torchrun."""
    from .demo import train

    if args.nproc <= 1:
        return train(args)
    from torch.distributed.run import main as torchrun_main

    argv = ["--standalone", f"--nproc-per-node={args.nproc}", "-m", "fxpipe.demo"]
    for name in ("steps", "schedule", "microbatches", "microbatch_size", "lr", "out", "checkpoint_dir", "save_every", "keep"):
        if getattr(args, name) is not None:
            argv += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault(*RESTARTABLE)
    torchrun_main(argv)
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="fxpipe", description="Pipeline-parallel training for PyTorch models.")
    sub = p.add_subparsers(dest="cmd", required=True)

    d = sub.add_parser("demo", help="train the built-in GPT-style model pipeline-parallel on local CPU ranks")
    add_demo_arguments(d)
    d.set_defaults(fn=_cmd_demo, check=lambda a: check_demo_args(d, a))

    i = sub.add_parser("inspect", help="write node table, graph, plan, stage code and schedule dumps")
    i.add_argument("factory", help="MODULE:FACTORY, a function returning (model, example_inputs)")
    i.add_argument("--out", default="fxpipe-out", help="output folder (default: fxpipe-out)")
    i.add_argument("--stages", type=_non_negative_int, default=2, help="pipeline depth to plan for (0: trace dumps only)")
    i.add_argument("--schedule", default="2bw", choices=SCHEDULES, help="schedule to draw")
    i.add_argument("--microbatches", type=_microbatches, default=None,
                   help="micro-batches per step (default: max(2 x stages, 4))")
    i.set_defaults(fn=_cmd_inspect)

    from .cluster import PRESETS

    pl = sub.add_parser("plan", help="plan a model for a cluster: the chosen stages, placement and the configurations searched")
    pl.add_argument("factory", help="MODULE:FACTORY, a function returning (model, example_inputs); the model may be "
                                    "built on the meta device")
    pl.add_argument("--cluster", required=True,
                    help=f"a preset ({', '.join(sorted(PRESETS))}) or a .json/.toml file (see fxpipe/cluster.py)")
    pl.add_argument("--nodes", type=_positive_int, default=None, help="nodes of the cluster (presets: default 1)")
    pl.add_argument("--global-batch", type=_positive_int, required=True, help="samples per optimizer step")
    pl.add_argument("--schedule", default="2bw", choices=SCHEDULES)
    pl.add_argument("--precision", default="fp32", choices=("fp32", "bf16", "fp16"))
    pl.add_argument("--world-size", type=_positive_int, default=None,
                    help="accelerators to use (default: the planner chooses whole nodes up to the cluster)")
    pl.add_argument("--stages", type=_positive_int, default=None, help="pipeline depth (default: searched)")
    pl.add_argument("--top", type=_positive_int, default=8, help="configurations to list (the best of each depth)")
    pl.add_argument("--device-memory", type=_positive_bytes, default=None, metavar="BYTES",
                    help="bytes each accelerator may fill, e.g. 30e9 (default: the cluster's memory less its reserve)")
    pl.add_argument("--json", default=None, metavar="PATH", help="write the plan as JSON (Plan.to_json) to PATH")
    pl.set_defaults(fn=_cmd_plan)

    r = sub.add_parser("run", help="launch SCRIPT on N local ranks through torch.distributed.run (torchrun)")
    r.add_argument("--nproc", type=_positive_int, default=2, help="ranks on this machine")
    r.add_argument("--torchrun-arg", dest="torchrun_args", action="append", default=[],
                   help="extra argument for torchrun (repeatable), e.g. --torchrun-arg=--nnodes=2")
    r.add_argument("script")
    r.add_argument("script_args", nargs=argparse.REMAINDER)
    r.set_defaults(fn=_cmd_run)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if getattr(args, "check", None) is not None:
        args.check(args)
    return int(args.fn(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
