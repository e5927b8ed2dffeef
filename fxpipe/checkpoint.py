"""checkpoint: the full training state, saved and loaded with torch.distributed.checkpoint (DCP).

A checkpoint is one DCP directory (``ROOT/step-00000120``) that every rank writes in parallel:
each rank contributes its own stage's tensors, DCP's planner keeps one copy of what replicas of a
stage hold alike, and loading reads each tensor by key, so a checkpoint of one layout loads into
another (d = 2 into d = 3, d = 1 or w = 2). Every key is the ORIGINAL model's (what
``model.state_dict()`` calls it), in these sections::

    model.<key>                 W(t): the newest weights (the fp32 master under mixed precision), and the module buffers
    model_previous.<key>        W(t-1): the older 2bw weight version (2bw only; the 16-bit compute copy under mixed precision)
    optim.state.<key>.<name>    the optimizer state as torch.optim keys it (step, exp_avg, ...)
    optim.param_groups.<key>    the hyper-parameters of the parameter's group (lr as scheduled) and the
                                optimizer's class name (another is refused on load); only parameters
                                in a group (a factory may leave some out: not stepped)
    optimizer_steps             the updates applied (a skipped non-finite step applies none); SGD's
                                state has no ``step`` to count them, and the fused update needs it
    lr_scheduler                the scheduler's state, less its per-group lists (nested ones too)
    rng.rank<r>                 each rank's torch RNG state (the only per-rank entry)
    fxpipe                      steps, plan, schedule, seed, version, the traced example
    extra                       the caller's dict (e.g. a data loader position)

Objects (everything but tensors) are pickled by DCP, one value per key: an entry that differs
between ranks would silently keep one rank's value, so :func:`save` checks that ``fxpipe`` and
``extra`` agree on every rank and ``optimizer_steps`` and ``lr_scheduler`` on every rank that has
them (a stage with nothing to train has no optimizer), and keys the RNG state by rank.

``ROOT/latest`` names the newest complete checkpoint. DCP writes its ``.metadata`` last, after
every rank's data, and only then does rank 0 replace ``latest`` (write a temporary file, rename:
atomic on POSIX), so ``latest`` never names a partial checkpoint. A checkpoint of a step that
already has one (a run this one rolled back from saved it) is written into a hidden
``ROOT/.step-00000120.partial`` that rank 0 renames to the step's name once complete (the old
one renamed aside first, deleted after), so a save cut short never damages the old one.
With ``keep=k``, rank 0 then deletes this run's checkpoints beyond the k newest: those the
pipeline saved into ROOT, and, when it resumed from ROOT, those up to the step it resumed from.
Others (a previous run's, or the later steps of a run it rolled back from) are not its to judge,
but for one at a step this run saves, which it replaces with a warning. Multi-node runs need ROOT
on a filesystem every node sees.
"""

from __future__ import annotations

import io
import os
import pickle
import re
import shutil
import warnings
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, Callable, Collection, Iterable, Mapping, Sequence

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
import torch.utils._pytree as pytree

from .device import rng_state, set_rng_state
from .errors import CheckpointError

if TYPE_CHECKING:
    from .pipeline import Pipeline

__all__ = ["save", "load", "resolve", "read_meta", "fit_problems"]

# DCP warns on every single-process save and load that it assumes a single process: fxpipe
# passes no_dist=True exactly then, so the warning says nothing.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")

FORMAT = 1  # bumped when the layout above changes
LATEST = "latest"
_SHARED = ("fxpipe", "extra")  # objects that must be equal on every rank
_OPTIMIZER = ("optimizer_steps", "lr_scheduler")  # equal on every rank whose stage has an optimizer
# A scheduler's lists with one entry per param group: the factory rebuilds them on load, and
# stages may hold different numbers of groups (the lr itself is saved per parameter). CyclicLR
# keeps max_lrs and its momenta, ReduceLROnPlateau min_lrs.
_PER_GROUP = ("base_lrs", "_last_lr", "lr_lambdas", "max_lrs", "min_lrs", "base_momentums", "max_momentums")


_STEP_DIR = re.compile(r"step-(\d{8,})")


def step_dir(root: str, steps: int) -> str:
    return os.path.join(root, f"step-{steps:08d}")


def resolve(path: str) -> str:
    """The checkpoint directory ``path`` names: itself when it holds DCP's ``.metadata``,
    else the one its ``latest`` file names (or, where a crash between :func:`_replace`'s two
    renames left that name on no checkpoint, the complete replacement in its hidden folder)."""
    if os.path.exists(os.path.join(path, ".metadata")):
        return path
    latest = os.path.join(path, LATEST)
    if os.path.exists(latest):
        with open(latest) as f:
            name = f.read().strip()
        partial = _partial_dir(os.path.join(path, name))
        if not os.path.exists(os.path.join(path, name, ".metadata")) and os.path.exists(os.path.join(partial, ".metadata")):
            return partial  # a replacement cut short between its two renames (_replace): the new one, complete
        return os.path.join(path, name)
    raise CheckpointError(
        f"no checkpoint at {path!r}: expected a checkpoint directory (with a .metadata file) or a "
        f"folder written by Pipeline.save (with a {LATEST!r} file). Check the path, or start from scratch."
    )


#: The optimizer's class name, kept beside each parameter's hyper-parameters.
_OPTIMIZER_CLASS = "fxpipe.optimizer"


def _check_optimizer(optimizer, hyper: dict[str, dict], path: str) -> None:
    """Refuse a checkpoint another optimizer class wrote (its state and hyper-parameters would be
    read as this one's: AdamW's decoupled weight decay into Adam, or Adam's moments into Adamax,
    which then fails at its first update). Takes the class name out of ``hyper``; a checkpoint
    that has none (written before it was kept) is compared by its hyper-parameters alone."""
    saved = {hp.pop(_OPTIMIZER_CLASS, None) for hp in hyper.values()} - {None}
    mine = type(optimizer).__name__
    if saved and saved != {mine}:
        raise CheckpointError(
            f"load: {path} was trained with {', '.join(sorted(saved))}, and this pipeline's optimizer factory builds "
            f"{mine}: the saved optimizer state and hyper-parameters are {', '.join(sorted(saved))}'s. Resume with "
            f"the optimizer the checkpoint was trained with (pipe.load_state_dict takes its weights alone).")


def _pack(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _unpack(data: bytes):
    return torch.load(io.BytesIO(data), weights_only=False)


# ------------------------------------------------------------------------------------- saving


def state(pipe: "Pipeline", extra: dict | None) -> dict[str, Any]:
    """This rank's DCP state dict: its stages' tensors (replica 0's in one process) under the
    original keys, and the shared and per-rank objects."""
    key = _key_of(pipe)
    model, previous, opt_state, groups = {}, {}, {}, {}
    two_versions = pipe.plan.schedule == "2bw"
    seen = set()
    for wk in pipe.workers.values():
        if wk.index in seen:  # in one process the replicas of a stage hold the same values
            continue
        seen.add(wk.index)
        store = wk.store
        for n, v in store.newest().items():  # the fp32 master under mixed precision
            for k in pipe.staged.originals.get(n, [n]):
                model[k] = v.detach()
        if two_versions:  # in the compute dtype: a 16-bit W(t-1) is not the master of any step
            for n, v in store.previous().items():
                previous[key[n]] = v
        for n, b in wk.buffers.items():
            for k in pipe.staged.originals.get(n, []):  # non-persistent buffers stay out, as in PyTorch
                model[k] = b
        for n, st in store.optimizer_state().items():
            opt_state[key[n]] = st
        for n, hp in store.hyperparameters().items():
            groups[key[n]] = _pack({**hp, _OPTIMIZER_CLASS: type(store.optimizer).__name__})
    for n, t in pipe.staged.unused_state.items():
        for k in pipe.staged.originals.get(n, []):
            model[k] = t
    sd: dict[str, Any] = {"model": model, "optim": {"state": opt_state, "param_groups": groups}}
    if two_versions:
        sd["model_previous"] = previous
    # Of the stages that have an optimizer (a fully frozen one has none): every one applied the
    # same updates and steps a scheduler built alike, so one value each stands for all of them.
    trains = [wk for wk in pipe.workers.values() if wk.store.optimizer is not None]
    for name, values in (("optimizer_steps", [(wk.index, wk.store.optimizer_steps) for wk in trains]),
                         ("lr_scheduler", [(wk.index, _scheduler_state(wk.store.lr_scheduler.state_dict()))
                                           for wk in trains if wk.store.lr_scheduler is not None])):
        packed = [(i, _pack(v)) for i, v in values]
        differ = sorted({i for i, v in packed if v != packed[0][1]})
        if differ:
            _differs(name, f"stage {packed[0][0]}", f"stages {differ}")
        if packed:
            sd[name] = packed[0][1]
    from . import __version__

    meta = {
        "format": FORMAT, "fxpipe_version": __version__, "torch_version": torch.__version__,
        "steps": pipe.t, "seed": pipe.config.seed, "schedule": pipe.plan.schedule,
        "plan": pipe.plan.to_json(), "world_size": pipe.world_size, "precision": pipe.config.precision,
        "scaler": next(iter(pipe.workers.values())).scaler_state(),
        "skipped_steps": list(pipe.skipped_steps),  # nonfinite="skip": the run's history goes on
        "example": pytree.tree_map(lambda x: x.cpu() if isinstance(x, torch.Tensor) else x, pipe._example),
    }
    sd["fxpipe"] = _pack(meta)
    sd["extra"] = _pack(extra)
    sd["rng"] = {f"rank{pipe.rank}": rng_state(pipe.device)}
    return sd


def _unwritable(path: str) -> str | None:
    """Why this rank cannot write a checkpoint into ``path`` (created here), or None."""
    try:
        os.makedirs(path, exist_ok=True)
        probe = os.path.join(path, f".probe.{os.getpid()}")
        with open(probe, "w"):
            pass
        os.remove(probe)
        return None
    except OSError as e:
        return (f"save: cannot write a checkpoint into {path!r}: {e.strerror or e}. Pass a directory every rank can "
                f"create and write (on several nodes, one on a filesystem they share)")


def check_shared(pipe: "Pipeline", sd: dict[str, Any], root: str) -> None:
    """Raise on every rank if an object DCP keeps once differs between ranks (a collective):
    ``_SHARED`` on every rank, ``_OPTIMIZER`` among the ranks that hold one, and the directory
    ``root`` each rank saves into (one checkpoint: ranks that wrote apart could not load it)."""
    if not pipe.distributed:
        return
    names = _SHARED + _OPTIMIZER + ("directory",)
    mine = [sd.get(k) for k in names[:-1]] + [root]
    everyone: list = [None] * pipe.world_size
    dist.all_gather_object(everyone, mine)
    for i, name in enumerate(names):
        having = [r for r in range(pipe.world_size) if name not in _OPTIMIZER or everyone[r][i] is not None]
        differ = [r for r in having if everyone[r][i] != everyone[having[0]][i]]
        if differ:
            if name == "directory":
                _differs(name, f"{everyone[having[0]][i]!r} on rank {having[0]}",
                         ", ".join(f"{everyone[r][i]!r} on rank {r}" for r in differ))
            _differs(name, f"rank {having[0]}", f"ranks {differ}")


def _differs(name: str, one: str, others: str) -> None:
    """Raise for an object that a checkpoint keeps once but ``one`` and ``others`` hold apart."""
    if name == "directory":
        raise CheckpointError(
            f"save: the ranks save into different directories ({one} and {others}); each writes its part of ONE "
            f"checkpoint, which load reads from one directory. Pass the same path on every rank (on several nodes, "
            f"on a filesystem they share)."
        )
    if name == "extra":
        raise CheckpointError(
            f"save: the extra dict passed to save() differs between {one} and {others}; a checkpoint keeps ONE "
            f"value of it. Pass the same extra on every rank (keep per-rank values in files of your own)."
        )
    if name == "lr_scheduler":
        raise CheckpointError(
            f"save: the lr scheduler's state (less its per-group lists) differs between {one} and {others}; a "
            f"checkpoint keeps ONE scheduler state for every stage. Make the lr_scheduler factory build the same "
            f"scheduler (type and arguments) for every stage's optimizer, whatever parameters it holds."
        )
    raise CheckpointError(
        f"save: fxpipe's {name!r} entry differs between {one} and {others}, but every stage computes it alike; "
        f"a checkpoint keeps ONE value of it. This is a bug in fxpipe: please report it with the plan."
    )


def _scheduler_state(state: dict) -> dict:
    """A scheduler's ``state_dict()`` less its per-group lists (``_PER_GROUP``), also in the
    schedulers that SequentialLR and ChainedScheduler nest under ``_schedulers``."""
    out = {k: v for k, v in state.items() if k not in _PER_GROUP}
    if isinstance(out.get("_schedulers"), list):
        out["_schedulers"] = [_scheduler_state(s) if isinstance(s, dict) else s for s in out["_schedulers"]]
    return out


def _load_scheduler(scheduler, saved: dict, lrs: list[float], path: str) -> None:
    """Load ``saved`` (:func:`_scheduler_state`'s) into ``scheduler``: its own per-group lists
    (the factory's, at any depth) stay, and every ``_last_lr`` becomes ``lrs`` (the groups' lr
    as loaded)."""

    def merge(current: dict, saved: dict, where: str) -> dict:
        out = {**current, **_scheduler_state(saved)}  # an old checkpoint may hold per-group lists
        mine, theirs = current.get("_schedulers"), saved.get("_schedulers")
        if isinstance(mine, list) and isinstance(theirs, list):
            if len(mine) != len(theirs):
                raise CheckpointError(
                    f"load: {path} holds an lr scheduler of {len(theirs)} nested schedulers{where}, this pipeline's "
                    f"lr_scheduler factory builds {len(mine)}. Resume with the scheduler the checkpoint was "
                    f"trained with."
                )
            out["_schedulers"] = [merge(c, s, f" (in nested scheduler {i})")
                                  for i, (c, s) in enumerate(zip(mine, theirs))]
        return out

    scheduler.load_state_dict(merge(scheduler.state_dict(), saved, ""))
    todo = [scheduler]
    while todo:
        s = todo.pop()
        s._last_lr = list(lrs)
        todo.extend(getattr(s, "_schedulers", []))


def check_keep(keep) -> None:
    """``save``'s ``keep``: None (keep every checkpoint) or how many of the newest to keep."""
    if keep is not None and (isinstance(keep, bool) or not isinstance(keep, int) or keep < 1):
        raise CheckpointError(f"save: keep must be an int >= 1 (how many of the newest checkpoints to keep) or None "
                              f"(keep all), found {keep!r}; pass e.g. keep=3")


def save(pipe: "Pipeline", root: str, extra: dict | None, group, keep: int | None = None,
         prunable: Callable[[int], bool] = lambda t: False) -> tuple[str, Future]:
    """Start writing the checkpoint of step ``pipe.t`` under ``root``: returns (directory,
    future). Returns once the state is copied to host memory; the files are written by a
    background thread (``dcp.async_save`` over ``group``, a gloo group of its own, so the
    writer's collectives never interleave with training's). The future completes once the
    files are down and, on rank 0, ``latest`` names them and, with ``keep``, the checkpoints
    ``prunable`` accepts beyond the ``keep`` newest are deleted (:func:`_prune`); its result is
    the list of what could not be deleted."""
    if extra is not None and not isinstance(extra, dict):
        raise CheckpointError(f"save: extra must be a dict (or None), found {type(extra).__name__}")
    try:  # the same extra on every rank (checked below): every rank raises here alike
        pickle.dumps(extra)
    except Exception as e:  # noqa: BLE001 - pickle raises many kinds
        raise CheckpointError(f"save: extra must pickle (the checkpoint keeps it with torch.save's pickler), but "
                              f"{type(e).__name__}: {e}. Keep plain data in it (numbers, strings, lists, dicts, "
                              f"tensors); save other objects yourself") from e
    steps = pipe.t  # the writer finishes while training goes on
    path = step_dir(root, steps)
    # A step's first checkpoint is written in place (it has no .metadata, so nothing names it,
    # until it is complete); one that replaces a checkpoint of the step (a run this one rolled
    # back from saved it) goes through a hidden folder. Rank 0 looks; every rank writes where it says.
    box = [_replacing(path) if pipe.rank == 0 else None]
    if pipe.distributed:
        dist.broadcast_object_list(box, src=0)
    replacing = box[0]
    target = _partial_dir(path) if replacing else path
    # another run's checkpoint is replaced: said once the new one is in place (no rank-0-only
    # warning before the collectives below, which -W error would turn into a raise)
    news = [f"replaced {path}, a checkpoint of this step from another run (one this run rolled back from, or an "
            f"earlier run in this folder); save into another folder to keep both"] \
        if replacing and pipe.rank == 0 and not prunable(steps) else []
    # every rank creates and writes the directory before any rank enters the writer's collectives
    pipe._raise_agreed(_unwritable(target), CheckpointError,
                       "rank {rank} cannot write the checkpoint, so no rank saves: ")
    sd = state(pipe, extra)
    check_shared(pipe, sd, os.path.abspath(root))
    written: Future = Future()

    def finish(f: Future) -> None:  # in the writer thread, once DCP has written .metadata
        error, problems = None, []
        try:  # whatever happens, the future completes: every later save, load and exit waits on it
            error = f.exception()
            if error is None and pipe.rank == 0:
                if replacing:
                    _replace(root, target, path)
                _point_latest(root, path)
                problems = news + (_delete_replaced(root, path) if replacing else [])
                if keep is not None:
                    problems += _prune(root, steps, keep, prunable)
        except BaseException as e:  # noqa: BLE001 - handed to whoever waits
            error = e
        finally:
            written.set_exception(error) if error is not None else written.set_result(problems)

    dcp.async_save(sd, checkpoint_id=target, process_group=group, no_dist=not pipe.distributed).add_done_callback(finish)
    return path, written


def _partial_dir(path: str) -> str:
    """Where a checkpoint that replaces the one at ``path`` (a ``step-*`` folder) is written
    before it takes that name (hidden: no ``step-*`` name, so neither loading by step nor
    ``keep`` sees it; ``resolve`` does only where a crash left ``latest`` naming no folder)."""
    root, name = os.path.split(path)
    return os.path.join(root, f".{name}.partial")


def _replacing(path: str) -> bool:
    """Rank 0, before the ranks write: whether ``path`` holds a checkpoint already (which the
    new one must not be written over: cut short, that would pair the old ``.metadata`` with
    half-written data). Drops the ``.metadata`` a replacement cut short may have left in the
    hidden folder (its other files are overwritten, or not read: the new ``.metadata`` lists
    what the checkpoint holds)."""
    if not os.path.exists(os.path.join(path, ".metadata")):
        return False
    try:
        os.remove(os.path.join(_partial_dir(path), ".metadata"))
    except OSError:  # none there
        pass
    return True


def _aside(root: str, path: str) -> str:
    return os.path.join(root, f".replaced-{os.path.basename(path)}")


def _replace(root: str, partial: str, path: str) -> None:
    """Rank 0, once every rank's files and DCP's ``.metadata`` are in ``partial``: rename the
    old checkpoint ``path`` aside and ``partial`` to ``path`` (putting the old one back if that
    fails). ``path`` names a complete checkpoint, the old one or the new one, at every moment
    but between the two renames."""
    aside = _aside(root, path)
    shutil.rmtree(aside, ignore_errors=True)  # left by a replacement cut short
    os.rename(path, aside)
    try:
        os.rename(partial, path)
    except OSError:
        os.rename(aside, path)
        raise


def _delete_replaced(root: str, path: str) -> list[str]:
    """Delete the checkpoint :func:`_replace` renamed aside; returns what could not be deleted
    (the new checkpoint is complete either way)."""
    aside = _aside(root, path)
    try:
        shutil.rmtree(aside)
    except OSError as e:
        return [f"could not delete the checkpoint {path!r} replaced (renamed to {aside!r}: {e}); delete it yourself"]
    return []


def _point_latest(root: str, path: str) -> None:
    """Make ``root/latest`` name the complete checkpoint ``path`` (write aside, then rename).
    Saves run one at a time (each waits for the one before), so the last written is the newest."""
    tmp = os.path.join(root, f".{LATEST}.{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(os.path.basename(path) + "\n")
    os.replace(tmp, os.path.join(root, LATEST))


def _prune(root: str, steps: int, keep: int, prunable: Callable[[int], bool]) -> list[str]:
    """Delete the ``step-*`` checkpoints of ``root`` that ``prunable`` accepts, oldest first,
    beyond the ``keep`` newest of them up to step ``steps`` (the one just written, which
    ``latest`` names, is always kept). Each is renamed aside first, so a deletion cut short never
    leaves a half checkpoint under a checkpoint's name. Symbolic links are not touched. Returns
    what could not be deleted, for the caller to warn of: the new checkpoint is complete either
    way."""
    found = []
    for name in os.listdir(root):
        full = os.path.join(root, name)
        if (m := _STEP_DIR.fullmatch(name)) and os.path.isdir(full) and not os.path.islink(full):
            t = int(m.group(1))
            if t == steps or (t < steps and prunable(t)):
                found.append(t)
    problems = []
    for t in sorted(found)[:-keep]:
        old = step_dir(root, t)
        aside = os.path.join(root, f".deleting-{os.path.basename(old)}-{os.getpid()}")
        try:
            os.rename(old, aside)
            shutil.rmtree(aside)
        except OSError as e:
            problems.append(f"could not delete the old checkpoint {old!r} ({e}); delete it yourself")
    return problems


# ------------------------------------------------------------------------------------ loading


def read_meta(path: str) -> dict:
    """The ``fxpipe`` entry of the checkpoint at ``path`` (steps, plan, example, ...)."""
    box = {"fxpipe": None}
    try:
        dcp.load(box, checkpoint_id=path, no_dist=True)
        meta = _unpack(box["fxpipe"])
    except (Exception, CheckpointException) as e:  # noqa: BLE001 - DCP (a BaseException) and pickle, for a torn or foreign file
        raise _unreadable(path, e) from e
    if meta.get("format") != FORMAT:
        raise CheckpointError(
            f"{path} is in checkpoint format {meta.get('format')}, this fxpipe reads format {FORMAT}. "
            f"Load it with the fxpipe version that wrote it ({meta.get('fxpipe_version')})."
        )
    return meta


def _unreadable(path: str, e: BaseException) -> CheckpointError:
    lines = [ln for ln in str(e).strip().splitlines() if ln.strip()]
    return CheckpointError(
        f"{path} is not a checkpoint fxpipe can read ({type(e).__name__}: {lines[-1] if lines else ''}): a file of it "
        f"is missing, cut short or from another program. Load an earlier checkpoint (its step-* folders), or one "
        f"Pipeline.save wrote whole")


def _check_run(pipe: "Pipeline", path: str, meta: dict) -> None:
    """The run the checkpoint at ``path`` continues: the same dropout seed, and for 2bw a
    checkpoint that holds W(t-1) (one of 2bw, or of step 0)."""
    if meta["seed"] != pipe.config.seed:
        raise CheckpointError(
            f"load: {path} was trained with seed={meta['seed']}, this pipeline has seed={pipe.config.seed}; "
            f"dropout would draw other numbers from here on. Pass seed={meta['seed']} to fxpipe.compile."
        )
    if pipe.plan.schedule == "2bw" and meta["schedule"] != "2bw" and meta["steps"] > 0:
        raise CheckpointError(
            f"load: {path} comes from schedule {meta['schedule']!r}, which keeps one weight version; 2bw "
            f"needs W(t-1) too. Resume with a schedule of one weight version: '1f1b', "
            f"'gpipe' or 'zb'."
        )


def load(pipe: "Pipeline", path: str, meta: dict, group) -> dict | None:
    """Load the checkpoint at ``path`` (already resolved, its ``meta`` read) into ``pipe``'s
    workers, which are flushed; returns the caller's extra dict."""
    key = _key_of(pipe)
    stored = dcp.FileSystemReader(path).read_metadata().state_dict_metadata  # key -> shape, dtype
    try:  # each rank checks its own stages and settings: all raise if one does
        _check_keys(pipe, path, stored)
        _check_run(pipe, path, meta)
        problem = None
    except CheckpointError as e:
        problem = str(e)
    pipe._raise_agreed(problem, CheckpointError, "rank {rank} cannot load this checkpoint, so no rank does: ", group)
    steps = meta["steps"]
    want_previous = pipe.plan.schedule == "2bw" and meta["schedule"] == "2bw"
    sd: dict[str, Any] = {"model": {}, "optim": {"state": {}, "param_groups": {}}, "extra": None}
    if want_previous:
        sd["model_previous"] = {}
    for name in _OPTIMIZER:  # optimizer_steps is absent from checkpoints written before it was saved
        if name in stored:
            sd[name] = None
    rng = f"rng.rank{pipe.rank}."  # the RNG state of this rank, when the world is the same
    if meta["world_size"] == pipe.world_size:
        sd["rng"] = {f"rank{pipe.rank}": {x[len(rng):]: _empty(stored[x]) for x in stored if x.startswith(rng)}}
    for wk in pipe.workers.values():
        for s in wk.store.layout.slots:
            sd["model"][key[s.name]] = torch.empty(s.shape, dtype=s.dtype)
            if want_previous:  # as stored: a run of another precision casts it on load
                sd["model_previous"][key[s.name]] = _empty(stored[f"model_previous.{key[s.name]}"])
        for n, b in wk.buffers.items():
            if n in key:
                sd["model"][key[n]] = torch.empty_like(b, device="cpu")
        for n in wk.store.stepped():
            prefix = f"optim.state.{key[n]}."  # step, exp_avg, ...: whatever the optimizer kept
            sd["optim"]["state"][key[n]] = {x[len(prefix):]: _empty(stored[x]) for x in stored if x.startswith(prefix)}
            sd["optim"]["param_groups"][key[n]] = None
    unused = {n: t for n, t in pipe.staged.unused_state.items() if n in key}  # what no node reads
    for n, t in unused.items():
        sd["model"][key[n]] = torch.empty_like(t, device="cpu")
    try:  # DCP gathers every rank's failure: all raise
        dcp.load(sd, checkpoint_id=path, process_group=group, no_dist=not pipe.distributed)
    except CheckpointException as e:
        raise _unreadable(path, e) from e
    scheduler_state = _unpack(sd["lr_scheduler"]) if sd.get("lr_scheduler") is not None else None
    optimizer_steps = _unpack(sd["optimizer_steps"]) if sd.get("optimizer_steps") is not None else None
    with torch.no_grad():
        for n, t in unused.items():
            t.copy_(sd["model"][key[n]])
    for wk in pipe.workers.values():
        newest = {s.name: sd["model"][key[s.name]] for s in wk.store.layout.slots}
        previous = {n: sd["model_previous"][key[n]] for n in newest} if want_previous else None
        wk.store.load(newest, previous, newest=steps)
        with torch.no_grad():
            for n, b in wk.buffers.items():
                if n in key:
                    b.copy_(sd["model"][key[n]])
        names = wk.store.stepped()
        hyper = {n: _unpack(sd["optim"]["param_groups"][key[n]]) for n in names}
        _check_optimizer(wk.store.optimizer, hyper, path)
        wk.store.load_optimizer({n: sd["optim"]["state"][key[n]] for n in names if sd["optim"]["state"][key[n]]},
                                hyper, optimizer_steps)
        wk.load_scaler_state(meta.get("scaler"))
        scheduler = wk.store.lr_scheduler
        if scheduler is not None and scheduler_state is not None:
            _load_scheduler(scheduler, scheduler_state, [g["lr"] for g in wk.store.optimizer.param_groups], path)
    if sd.get("rng", {}).get(f"rank{pipe.rank}"):
        set_rng_state(sd["rng"][f"rank{pipe.rank}"], pipe.device)
    return _unpack(sd["extra"])


def _empty(md) -> torch.Tensor:
    """A tensor of the shape and dtype a checkpoint stores (``md``: its TensorStorageMetadata)."""
    return torch.empty(tuple(md.size), dtype=md.properties.dtype)


def _key_of(pipe: "Pipeline") -> dict[str, str]:
    """Canonical name -> the original key a checkpoint stores it under (the first alias)."""
    return {n: keys[0] for n, keys in pipe.staged.originals.items() if keys}


def fit_problems(groups: Iterable[Sequence[str]], known: Collection[str], want: Mapping[str, str],
                 have: Mapping[str, str], compared: str = "shape") -> list[str]:
    """Why a state ``have`` (original key -> its shape, and dtype where that is compared, as text)
    does not fit the model: ``load``, ``load_state_dict`` and ``compile(weights=)`` ask this one
    question. ``groups``: the keys of each tensor to fill here (a tied weight's aliases, the first
    named), of which ``have`` must hold one; ``known``: every key of the whole model (a key
    outside it is unexpected); ``want``: the text each key's tensor has here (``compared`` says
    what that text holds). Empty: it fits."""
    missing = sorted(keys[0] for keys in groups if keys and not any(k in have for k in keys))
    unexpected = sorted(set(have) - set(known))
    differ = [f"{k} is {have[k]} there, {want[k]} here" for k in sorted(have) if k in want and have[k] != want[k]]
    out = []
    if missing:
        out.append(f"missing {len(missing)} keys: {_few(missing)}")
    if unexpected:
        out.append(f"unexpected {len(unexpected)} keys: {_few(unexpected)}")
    if differ:
        out.append(f"{len(differ)} tensors of another {compared}: {_few(differ)}")
    return out


def _few(items: Sequence[str], n: int = 12) -> str:
    return repr(list(items[:n])) + (f" and {len(items) - n} more" if len(items) > n else "")


def _check_keys(pipe: "Pipeline", path: str, stored: dict) -> None:
    """Every key the model needs is in the checkpoint, with the shape and dtype this model has,
    and every model key there belongs to the model: DCP would stop at the first missing key, fail
    on a shape with a message about storage offsets, and ignore unexpected keys."""
    originals = pipe.staged.originals
    have = {k[len("model."):]: f"{list(md.size)} {md.properties.dtype}" for k, md in stored.items()
            if k.startswith("model.")}
    mine = {}
    for wk in pipe.workers.values():
        mine.update({s.name: (s.shape, s.dtype) for s in wk.store.layout.slots})
        mine.update({n: (tuple(b.shape), b.dtype) for n, b in wk.buffers.items()})
    mine.update({n: (tuple(t.shape), t.dtype) for n, t in pipe.staged.unused_state.items()})
    want = {k: f"{list(shape)} {dtype}" for n, (shape, dtype) in mine.items() for k in originals.get(n, ())}
    parts = fit_problems(originals.values(), {k for keys in originals.values() for k in keys}, want, have,
                         compared="shape or dtype")
    missing = {keys[0] for keys in originals.values() if keys and not any(k in have for k in keys)}
    stepped = {n for wk in pipe.workers.values() for n in wk.store.stepped()}
    no_optim = sorted(originals[n][0] for n in stepped
                      if f"optim.param_groups.{originals[n][0]}" not in stored and originals[n][0] not in missing)
    if parts:
        raise CheckpointError(
            f"load: {path} does not fit this model ({pipe.trace_info.model_class}): " + "; ".join(parts)
            + ". Load a checkpoint saved from the same model (for weights alone, load_state_dict takes a "
              "plain state dict)."
        )
    if no_optim:
        raise CheckpointError(
            f"load: this pipeline's optimizer steps {len(no_optim)} parameters that {path} holds no optimizer "
            f"hyper-parameters for: {no_optim}. The run that saved it did not step them (frozen, or left out of "
            f"every param group by its optimizer factory). Resume with the same requires_grad flags and optimizer "
            f"factory (for weights alone, load_state_dict takes a plain state dict)."
        )
