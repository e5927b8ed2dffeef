"""cli: the ``fxpipe`` command (``demo``, ``inspect``, ``run``)."""

from __future__ import annotations

import argparse
import importlib
import os
import sys


def _load_factory(spec: str):
    if ":" not in spec:
        raise SystemExit(
            f"fxpipe inspect: expected MODULE:FACTORY (e.g. fxpipe.demo:demo_factory), found {spec!r}"
        )
    mod_name, fn_name = spec.split(":", 1)
    sys.path.insert(0, os.getcwd())  # let users point at a module in the current folder
    try:
        mod = importlib.import_module(mod_name)
    except ImportError as e:
        raise SystemExit(f"fxpipe inspect: cannot import module {mod_name!r}: {e}") from e
    fn = getattr(mod, fn_name, None)
    if not callable(fn):
        raise SystemExit(f"fxpipe inspect: {mod_name!r} has no callable {fn_name!r}")
    result = fn()
    if not (isinstance(result, tuple) and len(result) == 2):
        raise SystemExit(
            f"fxpipe inspect: {spec}() must return (model, example_inputs), found {type(result).__name__}"
        )
    return result


def _cmd_inspect(args: argparse.Namespace) -> int:
    from .inspect import inspect

    model, example_inputs = _load_factory(args.factory)
    paths = inspect(model, example_inputs, args.out, stages=args.stages or None,
                    microbatches=args.microbatches, schedule=args.schedule)
    for p in paths:
        print(p)
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    from .demo import main

    return main(args)


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


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="fxpipe", description="Pipeline-parallel training for PyTorch models.")
    sub = p.add_subparsers(dest="cmd", required=True)

    d = sub.add_parser("demo", help="train the built-in GPT-style model pipeline-parallel on local CPU ranks")
    from .demo import add_demo_arguments

    add_demo_arguments(d)
    d.set_defaults(fn=_cmd_demo)

    i = sub.add_parser("inspect", help="write node table, graph, plan, stage code and schedule dumps")
    i.add_argument("factory", help="MODULE:FACTORY, a function returning (model, example_inputs)")
    i.add_argument("--out", default="fxpipe-out", help="output folder (default: fxpipe-out)")
    i.add_argument("--stages", type=int, default=2, help="pipeline depth to plan for (0: trace dumps only)")
    i.add_argument("--schedule", default="2bw", choices=("2bw", "1f1b", "gpipe"), help="schedule to draw")
    i.add_argument("--microbatches", type=int, default=None, help="micro-batches per step (default 2 x stages)")
    i.set_defaults(fn=_cmd_inspect)

    r = sub.add_parser("run", help="launch SCRIPT on N local ranks through torch.distributed.run (torchrun)")
    r.add_argument("--nproc", type=int, default=2, help="ranks on this machine")
    r.add_argument("--torchrun-arg", dest="torchrun_args", action="append", default=[],
                   help="extra argument for torchrun (repeatable), e.g. --torchrun-arg=--nnodes=2")
    r.add_argument("script")
    r.add_argument("script_args", nargs=argparse.REMAINDER)
    r.set_defaults(fn=_cmd_run)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.fn(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
