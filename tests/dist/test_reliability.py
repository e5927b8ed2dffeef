"""Checkpoints and failures under real process groups (gloo ranks on loopback).

Exact resume: ranks save at step 3, and FRESH processes load and finish; losses and weights are
bitwise those of the uninterrupted run. Resharding: a d = 2 checkpoint continues as d = 1, w = 2.
Faults: a rank that hangs or raises mid-step makes its peer raise a PeerError naming the action
within the timeout, instead of waiting for the process group's 30 minutes.
"""

import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist

from tests import resume
from tests.dist.harness import run_function

pytestmark = [pytest.mark.dist, pytest.mark.timeout(400)]

SCHEDULES = ("2bw", "1f1b", "gpipe", "zb")
DIR = "FXPIPE_TEST_CHECKPOINTS"  # where the ranks write (the spawned ranks inherit the environment)


def _layouts(world: int) -> dict[str, tuple[str, int, int, dict]]:
    """(schedule, stages, microbatches, options) of the saving runs on ``world`` ranks, by name
    (w = 1): every schedule, and 1f1b interleaved, two stages per rank."""
    out = {s: (s, world, max(world, 2), {}) for s in SCHEDULES}
    out["1f1b chunks=2"] = ("1f1b", 2 * world, world, {"chunks": 2})
    return out


def first_half(rank: int, world: int) -> dict:
    """Per schedule: the uninterrupted 6 steps, and 3 steps that end in a checkpoint; and a
    float64 dropout-free d = world run saved at step 3 for the resharding test."""
    root = os.environ[DIR]
    out = {}
    for name, (schedule, d, m, options) in _layouts(world).items():
        out[name] = resume.run(resume.compile(schedule, d, m, world=world, **options), 0, 6)
        resume.run(resume.compile(schedule, d, m, world=world, **options), 0, 3, save=os.path.join(root, name))
    layout = dict(dropout=0.0, dtype=torch.float64, world=world)
    resume.run(resume.compile("2bw", world, 4, **layout), 0, 3, save=os.path.join(root, "reshard"))
    return out


def second_half(rank: int, world: int) -> dict:
    """Fresh processes: lazy compile, load, 3 more steps; and the resharded continuation
    (d = 1, w = world, m halved) next to the uninterrupted run of that layout."""
    root = os.environ[DIR]
    out = {}
    for name, (schedule, d, m, options) in _layouts(world).items():
        pipe = resume.compile(schedule, d, m, world=world, lazy=True, **options)
        out[name] = resume.run(pipe, 3, 3, load=os.path.join(root, name))
    layout = dict(dropout=0.0, dtype=torch.float64, world=world, width=world)
    out["reshard_full"] = resume.run(resume.compile("2bw", 1, 2, **layout), 0, 5)
    pipe = resume.compile("2bw", 1, 2, **layout)
    out["reshard"] = resume.run(pipe, 3, 2, load=os.path.join(root, "reshard"), save=os.path.join(root, "replicas"))
    return out


def _data_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path) if f.endswith(".distcp"))


def _check_resume(world: int, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv(DIR, str(tmp_path))
    before = run_function(world, "tests.dist.test_reliability:first_half", timeout=300)
    after = run_function(world, "tests.dist.test_reliability:second_half", timeout=300)
    for rank in range(world):
        assert before[rank]["error"] is None, before[rank]["error"]
        assert after[rank]["error"] is None, after[rank]["error"]
        for schedule in _layouts(world):
            full, resumed = before[rank]["value"][schedule], after[rank]["value"][schedule]
            assert resumed["steps"] == 6
            assert resumed["losses"] == full["losses"][3:], (rank, schedule)
            for k, v in full["state"].items():
                assert torch.equal(v, resumed["state"][k]), (rank, schedule, k)
        full, resumed = after[rank]["value"]["reshard_full"], after[rank]["value"]["reshard"]
        full = {"losses": full["losses"][3:], "state": full["state"]}
        assert resume.max_rel_diff(resumed, full) < 1e-5, rank
    # w = world replicas write the model once: no more bytes than the d = world checkpoint
    staged = _data_bytes(os.path.join(tmp_path, "reshard", "step-00000003"))
    replicated = _data_bytes(os.path.join(tmp_path, "replicas", "step-00000005"))
    assert replicated < 1.1 * staged, (replicated, staged)


def test_two_ranks_resume_bitwise_and_reshard(tmp_path, monkeypatch):
    _check_resume(2, tmp_path, monkeypatch)


@pytest.mark.slow
def test_four_ranks_resume_bitwise_and_reshard(tmp_path, monkeypatch):
    _check_resume(4, tmp_path, monkeypatch)


def frozen_first_stage(rank: int, world: int) -> dict:
    """Stage 0 trains nothing, so its rank has no optimizer and no lr scheduler: 5 steps straight,
    and 3 steps saved and resumed for 2 more; then schedulers that differ between the stages."""
    root = os.environ[DIR]
    options = dict(world=world, dropout=0.0, dtype=torch.float64, trainable=lambda n: n.startswith("ln_f"))
    out = {"full": resume.run(resume.compile("1f1b", 2, 2, **options), 0, 5)}
    resume.run(resume.compile("1f1b", 2, 2, **options), 0, 3, save=os.path.join(root, "frozen"))
    out["resumed"] = resume.run(resume.compile("1f1b", 2, 2, lazy=True, **options), 3, 2,
                                load=os.path.join(root, "frozen"))

    def by_size(opt):  # another step size on each stage
        return torch.optim.lr_scheduler.StepLR(opt, step_size=len(opt.param_groups[0]["params"]))

    pipe = resume.compile("1f1b", 2, 2, world=world, lr_scheduler=by_size)
    pipe.step(*resume.batch(1))
    try:
        pipe.save(os.path.join(root, "differ"))
    except Exception as e:
        out["differ"] = f"{type(e).__name__}: {e}"
    return out


def test_a_checkpoint_of_a_fully_frozen_first_stage_saves_and_resumes(tmp_path, monkeypatch):
    # the rank comparison of the scheduler state skips a rank without one, and names the scheduler
    monkeypatch.setenv(DIR, str(tmp_path))
    ranks = run_function(2, "tests.dist.test_reliability:frozen_first_stage", timeout=300)
    for rank, result in enumerate(ranks):
        assert result["error"] is None, result["error"]
        got = result["value"]
        assert got["resumed"]["losses"] == got["full"]["losses"][3:], rank
        assert all(torch.equal(v, got["resumed"]["state"][k]) for k, v in got["full"]["state"].items()), rank
        assert re.fullmatch(r"CheckpointError: save: the lr scheduler's state \(less its per-group lists\) differs "
                            r"between rank 0 and ranks \[1\].*the same scheduler .*", got["differ"]), got["differ"]


# ------------------------------------------------------------------------------------- faults

TIMEOUT = 1.0  # seconds: compile(timeout=...) of the fault tests


def _faulty_pipeline(rank: int, fault):
    """A 2-rank 1f1b pipeline whose rank 1 runs ``fault`` instead of its backward of micro-batch 3."""
    from fxpipe.runtime import StageWorker

    pipe = resume.compile("1f1b", 2, 2, world=2, timeout=TIMEOUT)
    if rank == 1:
        original = StageWorker._do_b

        def patched(self, a):
            if a.index == 3:
                fault()
            return original(self, a)

        StageWorker._do_b = patched
    return pipe


def _train_until_error(rank: int, fault) -> dict:
    pipe = _faulty_pipeline(rank, fault)
    start = time.monotonic()
    try:
        for t in range(1, 5):
            float(pipe.step(*resume.batch(t)))
    except Exception as e:  # what a rank's user would see
        seen = {"type": type(e).__name__, "message": str(e), "notes": getattr(e, "__notes__", []),
                "seconds": time.monotonic() - start}
    else:
        return {"type": None}
    try:  # a script that catches the error and tries to go on
        pipe.step(*resume.batch(5))
    except Exception as e:
        seen["next"] = f"{type(e).__name__}: {e}"
    return seen


def hang(rank: int, world: int) -> dict:
    return _train_until_error(rank, lambda: time.sleep(3 * TIMEOUT))


def crash(rank: int, world: int) -> dict:
    def fail():
        raise ValueError("a bug in the user's model")

    return _train_until_error(rank, fail)


def recover_in_process(rank: int, world: int) -> dict:
    """What the broken pipeline's error says to do in the same processes: tear the group down on
    every rank, make a new one, compile a new pipeline and load the last checkpoint."""
    from fxpipe.runtime import StageWorker

    tmp = os.environ["FXPIPE_TEST_TMP"]
    ck = os.path.join(tmp, "checkpoints")
    full = resume.run(resume.compile("1f1b", 2, 2, world=world, dropout=0.0), 0, 3)["losses"]
    pipe = resume.compile("1f1b", 2, 2, world=world, dropout=0.0, timeout=TIMEOUT)
    resume.run(pipe, 0, 1, save=ck)
    original = StageWorker._do_b
    if rank == 1:
        def fail(self, a):
            raise ValueError("a bug in the user's model")

        StageWorker._do_b = fail
    try:
        pipe.step(*resume.batch(2))
        failed = None
    except Exception as e:
        failed = type(e).__name__
    finally:
        StageWorker._do_b = original
    try:
        pipe.step(*resume.batch(2))
    except Exception as e:
        message = str(e)
    dist.destroy_process_group()
    dist.init_process_group("gloo", init_method=f"file://{os.path.join(tmp, 'store')}", rank=rank, world_size=world)
    again = resume.run(resume.compile("1f1b", 2, 2, world=world, dropout=0.0), 1, 2, load=ck)
    return {"failed": failed, "message": message, "full": full, "again": again["losses"], "steps": again["steps"]}


def test_a_broken_pipeline_recovers_in_process_as_its_error_says(tmp_path):
    os.environ["FXPIPE_TEST_TMP"] = str(tmp_path)
    results = run_function(2, "tests.dist.test_reliability:recover_in_process", timeout=120)
    assert not any(r["error"] for r in results), [r["error"] for r in results]
    for r, v in enumerate(r["value"] for r in results):
        assert v["failed"] == ("PeerError" if r == 0 else "ValueError"), (r, v["failed"])
        assert "torch.distributed.destroy_process_group()" in v["message"], (r, v["message"])
        assert v["steps"] == 3 and v["again"] == v["full"][1:], (r, v)


def one_rank_calls(rank: int, world: int) -> dict:
    """Rank 0 alone calls ``FXPIPE_TEST_CALL`` (the torch.save habit) while rank 1 steps on."""
    call = os.environ["FXPIPE_TEST_CALL"]
    root = os.environ["FXPIPE_TEST_TMP"]
    pipe = resume.compile("1f1b", 2, 2, world=world, timeout=TIMEOUT)
    pipe.step(*resume.batch(1))
    if call == "load":  # a checkpoint every rank wrote, for rank 0 alone to load
        pipe.save(root)
        pipe.wait_for_checkpoint()
    start = time.monotonic()
    try:
        if rank == 0:
            {"save": lambda: pipe.save(root), "state_dict": pipe.state_dict, "load": lambda: pipe.load(root),
             "eval_step": lambda: pipe.eval_step(*resume.batch(2))}[call]()
        pipe.step(*resume.batch(2))
    except Exception as e:
        return {"type": type(e).__name__, "message": str(e), "seconds": time.monotonic() - start}
    return {"type": None}


@pytest.mark.parametrize("call", ["save", "state_dict", "load", "eval_step"])
def test_a_call_only_one_rank_makes_ends_in_a_peer_error_on_both(tmp_path, call):
    # save() on rank 0 alone blocked in creating the checkpoint writers' group with no timeout (rank
    # 1 had long raised); state_dict() raised gloo's bare "Timed out waiting ... for send operation"
    os.environ["FXPIPE_TEST_TMP"], os.environ["FXPIPE_TEST_CALL"] = str(tmp_path), call
    rank0, rank1 = (r["value"] for r in run_function(2, "tests.dist.test_reliability:one_rank_calls", timeout=90))
    assert rank1["type"] == "PeerError" and "waited 1 s for 1RECV_ACT" in rank1["message"], rank1
    assert rank0["type"] == "PeerError", rank0
    assert rank0["message"].startswith(f"rank 0: {call}() failed: ") and rank0["message"].endswith(
        f". Every rank calls {call}() at the same point of its script: another rank stopped before it (its log says "
        f"why: an InputError, a failed compile, ...), skipped it or made it at another step"), rank0
    assert rank0["seconds"] < 10 * TIMEOUT + 10, rank0


@pytest.mark.slow  # time budget; the crash test below runs by default
def test_a_rank_that_hangs_makes_its_peer_raise_within_the_timeout():
    rank0, rank1 = run_function(2, "tests.dist.test_reliability:hang", timeout=120)
    seen = rank0["value"]
    assert seen["type"] == "PeerError", seen
    assert re.search(r"rank 0 waited \d+ s for 0RECV_GRAD3 from rank 1: no answer within compile\(timeout=...\)",
                     seen["message"]), seen["message"]
    assert "check its log" in seen["message"]
    waited = float(re.search(r"waited (\d+) s", seen["message"]).group(1))
    assert waited <= TIMEOUT + 1 and seen["seconds"] < 3 * TIMEOUT + 10, seen
    assert rank1["value"]["type"] is not None  # it woke to a dead peer and stopped too


def test_a_rank_that_raises_makes_its_peer_raise_not_hang():
    rank0, rank1 = run_function(2, "tests.dist.test_reliability:crash", timeout=120)
    raised = rank1["value"]
    # the user's own error, as it is, with where it happened in a note
    assert raised["type"] == "ValueError" and raised["message"] == "a bug in the user's model", raised
    assert raised["notes"][0].startswith("fxpipe: rank 1 failed running action 1B3v1 (its last posted "), raised
    seen = rank0["value"]
    assert seen["type"] == "PeerError", seen
    assert re.search(r"rank 0 (waited \d+ s for|waited for) 0RECV_GRAD3 from rank 1", seen["message"]), seen["message"]
    # and it says why rank 1 stopped, which only rank 1's log would have said
    assert "; rank(s) [1] failed first (rank 1: ValueError in action 1B3v1: a bug in the user's model). Fix that " \
           "error: its traceback is in that rank's log" in seen["message"], seen["message"]
    for r, v in enumerate((seen, raised)):  # the pipeline is broken on both; the way out is a restart
        assert re.match(r"FxpipeError: step\(\) after step [23] \(", v["next"]) and "cannot go on" in v["next"], (r, v["next"])
        assert "Let the error end this process" in v["next"] and "--max-restarts" in v["next"], (r, v)


def plan_error(rank: int, world: int) -> dict:
    """Rank 0 plans alone; a plan it cannot make (no cut fits 1 kB per device) must reach every rank."""
    import dataclasses

    from fxpipe.cost import DeviceModel

    tiny = dataclasses.replace(DeviceModel.cpu(), memory_bytes=1000)
    start = time.monotonic()
    try:
        resume.compile("2bw", 2, 2, world=2, timeout=30, device_model=tiny)
    except Exception as e:
        seen = {"type": type(e).__name__, "message": str(e), "seconds": time.monotonic() - start}
    else:
        seen = {"type": None}
    dist.barrier()  # as the README asks of a script whose group outlives the pipeline: meet, then tear down
    return seen


def test_a_plan_rank_0_cannot_make_fails_every_rank_at_once():
    rank0, rank1 = run_function(2, "tests.dist.test_reliability:plan_error", timeout=120)
    assert rank0["value"]["type"] == rank1["value"]["type"] == "PlanError", (rank0, rank1)
    assert rank1["value"]["message"].startswith("rank 0 could not plan the pipeline (PlanError): ")
    assert rank0["value"]["message"] in rank1["value"]["message"]
    assert rank1["value"]["seconds"] < 15, rank1  # not compile(timeout=30)


# --------------------------------------------------------------------------- the end of a script

# A torchrun-style script (fxpipe.compile creates the group, and destroys it at exit) that ends
# right after its last 2bw step, without flush(). The last stage's loss function sleeps in the
# last step, so rank 0 is at its exit long before rank 1 posts that step's LOSS all-reduce and
# receives the last step's activations: rank 0 must finish those before it tears the group down.
# FAIL=1: rank 1's loss function raises in step 2 instead; both ranks must still exit, neither
# waiting at exit for communication the other will never finish. FAIL=input: rank 1 passes a
# batch of another dtype to its first step, whose InputError it raises before communicating:
# it exits at once, and rank 0, waiting for it, fails then, long before the timeout.
# OWN_GROUP=1: the script creates the group itself and never destroys it, and its pipeline lives
# in a function that returns, so the pipeline is collected before the exit: what it left in
# flight must still be finished at exit (the group's teardown would otherwise strand rank 1).
_SCRIPT = """
import gc, os, sys, time, torch, torch.nn as nn, torch.nn.functional as F, fxpipe
torch.manual_seed(0)
torch.set_num_threads(1)
mode, one = os.environ["FAIL"], os.environ["RANK"] == "1"
last, fail, bad_input = [False], mode == "1", mode in ("input", "caught")
def loss_fn(out, y):
    if last[0] and fail:
        raise ValueError("a bug in the user's loss")
    if last[0] and mode == "killed" and one:
        os._exit(9)  # as if killed: no exit handler, no report
    if last[0]:
        time.sleep(2)
    return F.mse_loss(out, y)
model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 8))
x, y = torch.randn(16, 8), torch.randn(16, 8)
example = x[:8, :7] if mode == "setup" and one else x[:8]  # rank 1's example does not fit its model
# a failing run ends within its 5 s; a clean one has room for a loaded machine (its exit meeting
# waits for the slower rank up to the timeout); the runs that must not hang get 120 s, well over
# what their tests allow
def train():
    pipe = fxpipe.compile(model, example, loss_fn=loss_fn, schedule="2bw", stages=2, microbatches=2, verbose=False,
                          timeout=5 if fail else 30 if mode == "0" else 120)
    for t in range(1, 4):
        last[0] = t == (2 if fail or mode == "killed" else 3)
        bad = bad_input and one and (mode == "input" or t == 2)
        try:
            loss = pipe.step(x.double() if bad else x, y)
        except fxpipe.errors.InputError as e:
            if mode != "caught":
                raise
            print("rank 1 caught", type(e).__name__, flush=True)
            sys.exit(3)  # the common pattern: log the error, exit with a status
    return type(loss).__name__
if os.environ.get("OWN_GROUP") == "1":
    torch.distributed.init_process_group("gloo")
ends_with = train()
gc.collect()
print("rank", os.environ["RANK"], "ends with", ends_with, flush=True)
"""


def _ends_at_once(fail: str) -> list[subprocess.CompletedProcess]:
    """``_run_script(fail)``, whose failure must end both ranks well within its 120 s timeout."""
    start = time.monotonic()
    ranks = _run_script(fail=fail)
    assert time.monotonic() - start < 60
    return ranks


def _run_script(fail: bool | str, own_group: bool = False) -> list[subprocess.CompletedProcess]:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank in range(2):
        env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2", "OMP_NUM_THREADS": "1",
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
               "FAIL": fail if isinstance(fail, str) else "1" if fail else "0", "OWN_GROUP": "1" if own_group else "0"}
        procs.append(subprocess.Popen([sys.executable, "-c", _SCRIPT], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    try:
        outs = [p.communicate(timeout=90)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    return [subprocess.CompletedProcess(p.args, p.returncode, out) for p, out in zip(procs, outs)]


def test_a_script_that_ends_without_flush_exits_on_every_rank():
    ranks = _run_script(fail=False)
    assert [r.returncode for r in ranks] == [0, 0], "\n".join(r.stdout[-2000:] for r in ranks)
    assert "rank 0 ends with Loss" in ranks[0].stdout and "rank 1 ends with float" in ranks[1].stdout


def test_a_collected_pipeline_on_the_scripts_own_group_finishes_its_communication_at_exit():
    ranks = _run_script(fail=False, own_group=True)
    assert [r.returncode for r in ranks] == [0, 0], "\n".join(r.stdout[-2000:] for r in ranks)
    assert "rank 0 ends with Loss" in ranks[0].stdout and "rank 1 ends with float" in ranks[1].stdout


def test_ranks_meet_in_the_store_before_the_group_is_torn_down(monkeypatch):
    """The exit rendezvous of fxpipe.pipeline._finish_at_exit: a rank waits (up to the
    timeout) for every rank's key, a failed rank only sets its own, and a restarted torchrun
    attempt does not take the keys of the one before for its peers'."""
    import datetime

    import torch.distributed as dist

    from fxpipe.pipeline import _meet_at_exit

    store = dist.HashStore()
    store.set_timeout(datetime.timedelta(seconds=5))
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    start = time.monotonic()
    assert _meet_at_exit(store, 0, 3, 0.3) == [1, 2]  # nobody else came: the missing ranks
    assert 0.25 < time.monotonic() - start < 3
    assert _meet_at_exit(store, 1, 3, 0.3, wait=False) == []  # a failed rank: its key, no wait
    assert _meet_at_exit(store, 2, 3, 5.0) == []  # the last to come finds everyone
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert _meet_at_exit(store, 0, 3, 0.3) == [1, 2]


def test_a_rank_that_tears_down_without_its_peers_says_so(monkeypatch):
    import torch.distributed as dist

    from fxpipe import pipeline

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 0)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    destroyed = []
    monkeypatch.setattr(dist, "destroy_process_group", lambda group=None: destroyed.append(group))
    store = dist.HashStore()
    with pytest.warns(RuntimeWarning, match=r"rank 0 waited 0.2 s for rank\(s\) \[1\] to finish their communication "
                                            r"and tears its group down without them"):
        pipeline._finish_at_exit(store, 0.2, destroy=True)
    assert destroyed == [None]
    # a group the script created: the same meeting, and the group stays the script's
    monkeypatch.setattr(dist.distributed_c10d, "_get_default_store", lambda: dist.HashStore())
    with pytest.warns(RuntimeWarning, match=r"rank 0 waited 0.2 s for rank\(s\) \[1\] to finish their communication "
                                            r"and exits without them"):
        pipeline._finish_at_exit(None, 0.2, destroy=False)
    assert destroyed == [None]


def test_one_ranks_input_error_ends_every_rank_at_once():
    # rank 1 raises before it communicates; it used to wait at exit for rank 0, and rank 0 for
    # it, both for the whole timeout
    rank0, rank1 = _ends_at_once("input")
    assert rank1.returncode != 0 and "InputError: step(): input" in rank1.stdout, rank1.stdout[-2000:]
    assert rank0.returncode != 0 and "PeerError: rank 0: the first step's check that every rank passed the same " \
                                     "batch failed" in rank0.stdout, rank0.stdout[-2000:]
    assert "; rank(s) [1] failed first (rank 1: InputError: step(): input" in rank0.stdout, rank0.stdout[-2000:]


def test_a_rank_that_catches_its_input_error_and_exits_ends_every_rank_at_once():
    # rank 1 refuses its second batch, logs it and calls sys.exit(3): it used to wait at exit for
    # rank 0, which waited in step 2 for it, both for the whole timeout (120 s here)
    rank0, rank1 = _ends_at_once("caught")
    assert rank1.returncode == 3 and "rank 1 caught InputError" in rank1.stdout, rank1.stdout[-2000:]
    assert rank0.returncode != 0 and "PeerError" in rank0.stdout, rank0.stdout[-2000:]
    assert "failed first (rank 1: InputError: step(): input" in rank0.stdout, rank0.stdout[-2000:]


def test_a_killed_peer_makes_this_rank_raise_a_peer_error_at_once():
    # whether rank 0 then posts to the closed connection (tests/unit/test_pipeline.py has that
    # case) or waits on it, it raises a PeerError, not an error of its own action
    rank0, rank1 = _ends_at_once("killed")
    assert rank1.returncode == 9, rank1.stdout[-2000:]
    assert re.search(r"fxpipe\.errors\.PeerError: rank 0 (posted|waited for) 0\w+ .*the connection failed",
                     rank0.stdout), rank0.stdout[-2000:]
    assert "failed running action" not in rank0.stdout, rank0.stdout[-2000:]


def test_a_rank_whose_own_set_up_fails_makes_every_rank_raise_it():
    # rank 1's example has 7 features for a Linear(8, ...): its trace fails before the plan is
    # broadcast, where rank 0 used to get gloo's "Connection closed by peer"
    rank0, rank1 = _ends_at_once("setup")
    assert rank1.returncode != 0 and "fxpipe.errors.TraceError" in rank1.stdout, rank1.stdout[-2000:]
    assert rank0.returncode != 0 and "fxpipe.errors.TraceError: rank 1 could not set up its pipeline, so no rank " \
                                     "does: TraceError: " in rank0.stdout, rank0.stdout[-2000:]


@pytest.mark.slow
def test_a_script_whose_rank_raises_exits_on_every_rank():
    rank0, rank1 = _run_script(fail=True)
    assert rank1.returncode != 0 and "a bug in the user's loss" in rank1.stdout, rank1.stdout[-2000:]
    assert rank0.returncode != 0 and "PeerError" in rank0.stdout, rank0.stdout[-2000:]
    assert "(rank 1: ValueError in action 1F" in rank0.stdout and "a bug in the user's loss)" in rank0.stdout, \
        rank0.stdout[-2000:]
    assert "could not finish its in-flight communication" not in rank0.stdout + rank1.stdout


# ---------------------------------------------------------------------------- kill and restart


def _demo(tmp: str, name: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "--max-restarts=1",
            "-m", "fxpipe.demo", "--steps", "120", "--microbatches", "2", "--microbatch-size", "2",
            "--save-every", "20", "--keep", "2", "--checkpoint-dir", os.path.join(tmp, name),
            "--out", os.path.join(tmp, name + "-out")]


def _final(tmp: str, name: str) -> dict:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(os.path.join(tmp, name, "step-00000120"), os.path.join(tmp, name + ".pt"))
    return torch.load(os.path.join(tmp, name + ".pt"), weights_only=False)


@pytest.mark.slow
def test_torchrun_restarts_a_killed_rank_and_the_job_ends_as_if_uninterrupted(tmp_path):
    from fxpipe.cli import RESTARTABLE

    env = {**os.environ, "OMP_NUM_THREADS": "1", RESTARTABLE[0]: RESTARTABLE[1]}  # as `fxpipe run` sets it
    tmp = str(tmp_path)
    clean = subprocess.run(_demo(tmp, "clean"), env=env, capture_output=True, text=True, timeout=300)
    assert clean.returncode == 0, clean.stderr[-3000:]
    job = subprocess.Popen(_demo(tmp, "killed"), env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    latest = os.path.join(tmp, "killed", "latest")
    deadline = time.monotonic() + 120
    while not os.path.exists(latest) and time.monotonic() < deadline:
        time.sleep(0.02)
    workers = subprocess.run(["pgrep", "-P", str(job.pid)], capture_output=True, text=True).stdout.split()
    assert os.path.exists(latest) and len(workers) == 2, (workers, job.poll())
    os.kill(int(workers[1]), signal.SIGKILL)  # mid-training: the first checkpoint was just written
    out, _ = job.communicate(timeout=300)
    assert job.returncode == 0, out[-3000:]
    assert "resumed from" in out and "after step" in out, out[-3000:]
    assert "SIGKILL" in out or "Signals.SIGKILL" in out or "exitcode: -9" in out, out[-3000:]
    for name in ("clean", "killed"):  # rank 0 deleted all but the two newest (--keep 2)
        assert sorted(os.listdir(os.path.join(tmp, name))) == ["latest", "step-00000100", "step-00000120"], name
    a, b = _final(tmp, "clean"), _final(tmp, "killed")
    for k, v in a["model"].items():
        assert torch.equal(v, b["model"][k]), k
    last = [re.findall(r"loss [0-9.]+ -> ([0-9.]+)", text) for text in (clean.stdout, out)]
    assert last[0] and last[0] == last[1], last  # the final loss, printed by the last stage


# --------------------------------------------------------------------------- non-finite values


def nonfinite_on_the_middle_stage(rank: int, world: int) -> dict:
    """3 ranks, d = 3: rank 1 poisons one weight gradient of batch 3. Per policy, the step at
    which this rank raised or warned, and the skipped steps."""
    import warnings

    from fxpipe.errors import NonFiniteError
    from fxpipe.runtime import StageWorker

    StageWorker._do_b = resume.poisoning(StageWorker._do_b)
    StageWorker._do_w = resume.poisoning(StageWorker._do_w)  # zb's split backwards accumulate in W
    out = {}
    for schedule in ("2bw", "1f1b", "zb"):
        pipe = resume.compile(schedule, 3, 4, dropout=0.0, world=world)
        try:
            for t in range(1, 8):
                float(pipe.step(*resume.batch(t)))
            out[schedule] = None
        except NonFiniteError as e:
            out[schedule] = (t, str(e))
    pipe = resume.compile("2bw", 3, 4, dropout=0.0, world=world, nonfinite="skip")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warned_at = []
        for t in range(1, 8):
            n = len(caught)
            float(pipe.step(*resume.batch(t)))
            if len(caught) > n:
                warned_at.append(t)
    out["skip"] = (warned_at, pipe.skipped_steps, {k: v.double() for k, v in pipe.state_dict().items()})
    return out


@pytest.mark.slow  # 3 ranks; tests/unit/test_nonfinite.py checks the same in one process by default
def test_every_rank_raises_or_skips_at_the_same_step(monkeypatch):
    results = run_function(3, "tests.dist.test_reliability:nonfinite_on_the_middle_stage", timeout=200)
    values = [r["value"] for r in results]
    assert all(r["error"] is None for r in results), [r["error"] for r in results]
    for schedule in ("2bw", "1f1b", "zb"):
        raised = {v[schedule][0] for v in values}
        assert len(raised) == 1 and all("in step 3: stage(s) [1]" in v[schedule][1] for v in values), schedule
    assert all(v["skip"][:2] == values[0]["skip"][:2] for v in values) and values[0]["skip"][1] == [3]
    # the ranks trained on after the skip exactly as all three stages do in one process
    from fxpipe.runtime import StageWorker

    monkeypatch.setattr(StageWorker, "_do_b", resume.poisoning(StageWorker._do_b))
    pipe = resume.compile("2bw", 3, 4, dropout=0.0, nonfinite="skip")
    with pytest.warns(RuntimeWarning):
        for t in range(1, 8):
            pipe.step(*resume.batch(t))
    for k, w in pipe.state_dict().items():
        assert torch.equal(w.double(), values[0]["skip"][2][k]), k
