"""cli: the ``fxpipe`` command (``demo``, ``inspect``, ``plan``, ``run``)."""

from __future__ import annotations

import argparse
import importlib
import inspect
import math
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
    try:
        inspect.signature(fn).bind()
    except TypeError:
        raise SystemExit(f"fxpipe {cmd}: {spec} must be callable with no arguments, found {fn_name}"
                         f"{inspect.signature(fn)}; give its parameters defaults, or name a function that "
                         f"takes none") from None
    except ValueError:  # a builtin without a signature: let the call say
        pass
    result = fn()
    if not (isinstance(result, tuple) and len(result) == 2):
        raise SystemExit(
            f"fxpipe {cmd}: {spec}() must return (model, example_inputs), found {type(result).__name__}"
        )
    from collections.abc import Mapping

    import torch
    from torch import nn

    model, example = result
    if not isinstance(model, nn.Module) or not isinstance(example, (tuple, list, Mapping, torch.Tensor)):
        found = f"({type(model).__name__}, {type(example).__name__})"
        raise SystemExit(f"fxpipe {cmd}: {spec}() must return (model, example_inputs): an nn.Module and one "
                         f"micro-batch as a tuple or list (positional inputs), a dict (keyword inputs) or a "
                         f"tensor, found {found}")
    return result


def _cmd_inspect(args: argparse.Namespace) -> int:
    from .errors import FxpipeError
    from .inspect import inspect

    shaping = ("schedule", "microbatches", "lookahead", "chunks")
    if args.stages == 0 and any(getattr(args, n) is not None for n in shaping):
        given = " and ".join(f"--{n}" for n in shaping if getattr(args, n) is not None)
        raise SystemExit(f"fxpipe inspect: {given} shape the schedule, which --stages 0 does not make (it writes "
                         f"the trace's dumps alone); leave {given} out, or pass --stages N")
    model, example_inputs = _load_factory(args.factory)
    try:
        paths = inspect(model, example_inputs, args.out, stages=args.stages or None,
                        microbatches=args.microbatches, schedule=args.schedule or "2bw", lookahead=args.lookahead,
                        chunks=args.chunks or 1)
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
                 device_memory=args.device_memory, lookahead=args.lookahead)
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


def _positive_float(text: str) -> float:
    """An argparse type: a positive, finite number."""
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number such as 3e-3, found {text!r}") from None
    if not (0 < v < math.inf):
        raise argparse.ArgumentTypeError(f"expected a positive, finite number such as 3e-3, found {text!r}")
    return v


def _microbatches(text: str) -> int:
    try:
        return _positive_int(text)
    except argparse.ArgumentTypeError as e:
        raise argparse.ArgumentTypeError(f"{e} (micro-batches per step): pass --microbatches N with N >= 1, or "
                                         f"leave it out for the default max(2 x stages, 4)") from None


def _torchrun_option(argv: list[str], *names: str) -> str | None:
    """The value ``argv`` (torchrun's arguments) gives the first of ``names`` (``--nnodes=2`` or
    ``--nnodes 2``; torchrun takes ``_`` for ``-``), else the ``PET_`` environment variable
    torchrun reads for it, else None."""
    for i, a in enumerate(argv):
        key, eq, value = a.partition("=")
        if key.replace("_", "-") in names:
            return value if eq else (argv[i + 1] if i + 1 < len(argv) else "")
    return next((os.environ[v] for n in names if (v := "PET_" + n[2:].replace("-", "_").upper()) in os.environ), None)


def _launch(cmd: str, argv: list[str]) -> int:
    """torch's own launcher with ``argv``: a rank's failure ends in one summary, not a traceback."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun_main

    os.environ.setdefault(*RESTARTABLE)
    try:
        torchrun_main(argv)
    except ChildFailedError as e:  # each rank printed its own error above
        raise SystemExit(f"fxpipe {cmd}: {e}") from None
    return 0


def _cmd_run(args: argparse.Namespace) -> int:
    # torch's own launcher: same rendezvous, environment and failure handling as torchrun.
    extra = args.torchrun_args
    if not any(a in ("-m", "--module", "--no-python", "--no_python") for a in extra) and not os.path.isfile(args.script):
        raise SystemExit(f"fxpipe run: script {args.script!r} not found (from {os.getcwd()}); expected a Python file")
    nodes = _torchrun_option(extra, "--nnodes")
    nodes = None if nodes in ("1", "1:1") else nodes
    rendezvous = _torchrun_option(extra, "--rdzv-endpoint", "--master-addr", "--master-port")
    if nodes is not None and not rendezvous:
        raise SystemExit(f"fxpipe run: --nnodes={nodes} needs a rendezvous point every node reaches: add "
                         f"--torchrun-arg=--rdzv-backend=c10d --torchrun-arg=--rdzv-endpoint=HOST:PORT (HOST: one of "
                         f"the nodes) and the same --torchrun-arg=--rdzv-id=NAME on every node")
    argv = [f"--nproc-per-node={args.nproc}", *extra, args.script, *args.script_args]
    # one node, no rendezvous given: torchrun's --standalone (a free port on this machine)
    if args.nproc > 1 and nodes is None and not rendezvous and _torchrun_option(extra, "--node-rank") is None:
        argv.insert(0, "--standalone")
    return _launch("run", argv)


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
    p.add_argument("--lr", type=_positive_float, default=3e-3, help="AdamW learning rate")
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
    from .schedule import min_microbatches

    stages = max(int(os.environ.get("WORLD_SIZE", args.nproc)), 2)  # the demo's d (fxpipe.demo.train)
    if args.microbatches < (least := min_microbatches(args.schedule, stages)):
        p.error(f"--microbatches {args.microbatches} is too few for --schedule {args.schedule} on {stages} stages: "
                f"pass --microbatches {least} or more, or --schedule 1f1b")
    for flag, folder in (("--out", args.out), ("--checkpoint-dir", args.checkpoint_dir)):
        try:  # made now: a folder that cannot be made fails here, not after training
            if folder:
                os.makedirs(folder, exist_ok=True)
        except OSError as e:
            p.error(f"{flag} {folder!r}: cannot make the folder: {e.strerror or e}")


def _cmd_demo(args: argparse.Namespace) -> int:
    """``fxpipe demo``: train in this process, or relaunch ``fxpipe.demo`` on ``--nproc`` ranks
    through torchrun."""
    from .demo import train_or_exit

    if args.nproc <= 1:
        return train_or_exit(args)
    argv = ["--standalone", f"--nproc-per-node={args.nproc}", "-m", "fxpipe.demo"]
    for name in ("steps", "schedule", "microbatches", "microbatch_size", "lr", "out", "checkpoint_dir", "save_every", "keep"):
        if getattr(args, name) is not None:
            argv += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    return _launch("demo", argv)


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
    i.add_argument("--schedule", default=None, choices=SCHEDULES, help="schedule to draw (default: 2bw)")
    i.add_argument("--microbatches", type=_microbatches, default=None,
                   help="micro-batches per step (default: max(2 x stages, 4))")
    i.add_argument("--lookahead", type=_non_negative_int, default=None,
                   help="2bw, 1f1b: forwards each stage but the last runs ahead (default: the planner's)")
    i.add_argument("--chunks", type=_positive_int, default=None,
                   help="1f1b: stages per rank, interleaved 1F1B (--stages counts them all; default 1)")
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
                    help="accelerators to use (default: the planner chooses, up to the whole cluster)")
    pl.add_argument("--stages", type=_positive_int, default=None, help="pipeline depth (default: searched)")
    pl.add_argument("--top", type=_positive_int, default=8, help="configurations to list (the best of each number of accelerators and depth)")
    pl.add_argument("--device-memory", type=_positive_bytes, default=None, metavar="BYTES",
                    help="bytes each accelerator may fill, e.g. 30e9 (default: the cluster's memory less its reserve)")
    pl.add_argument("--lookahead", type=_non_negative_int, default=None,
                    help="2bw, 1f1b: forwards each stage but the last runs ahead (default: the planner's)")
    pl.add_argument("--json", default=None, metavar="PATH", help="write the plan as JSON (Plan.to_json) to PATH")
    pl.set_defaults(fn=_cmd_plan)

    r = sub.add_parser("run", help="launch SCRIPT on N local ranks through torch.distributed.run (torchrun)")
    r.add_argument("--nproc", type=_positive_int, default=2, help="ranks on this machine")
    r.add_argument("--torchrun-arg", dest="torchrun_args", action="append", default=[],
                   help="extra argument for torchrun (repeatable), e.g. --torchrun-arg=--max-restarts=3; on several "
                        "nodes --torchrun-arg=--nnodes=2 --torchrun-arg=--rdzv-backend=c10d "
                        "--torchrun-arg=--rdzv-endpoint=HOST:PORT --torchrun-arg=--rdzv-id=NAME")
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
