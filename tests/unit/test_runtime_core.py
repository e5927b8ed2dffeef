"""The runtime core: bounded periodic schedules, NCCL's matching rules enforced in one process,
and the state a long run holds.

Multi-process recordings of real posts live in tests/dist/test_post_order.py.
"""

from __future__ import annotations

import functools
import itertools
import re

import pytest
import torch

import fxpipe
from fxpipe.comm import LocalHub
from fxpipe.deps import CommOp, CommOrderError, Rendezvous
from fxpipe.schedule import SCHEDULES, Kind, Program, generate, validate
from tests.models import gpt2_tiny

# ---------------------------------------------------------------------------------------------
# Schedules as bounded, periodic data

CONFIGS = [(1, 2), (2, 2), (2, 3), (3, 3), (3, 5), (4, 4), (4, 8)]
OPTIONS = [{}, {"width": 2}, {"tied": True}, {"clip": True}, {"recompute": True},
           {"width": 2, "tied": True, "clip": True, "recompute": True}, {"tied": [1, 2], "clip": True}]


#: every schedule, and the 1F1B-ordered ones with stages running forwards ahead (schedule.warmup)
WITH_LOOKAHEAD = [(s, 0) for s in SCHEDULES] + [("2bw", 1), ("1f1b", 1), ("2bw", 2)]


def _skip(schedule: str, d: int, m: int, opts: dict, lookahead: int = 0) -> bool:
    return schedule == "2bw" and m < d + lookahead or (opts.get("tied") == [1, 2] and d < 3)


@pytest.mark.parametrize("schedule,lookahead", WITH_LOOKAHEAD)
def test_segments_repeat_and_concatenate_to_the_validated_lists(schedule, lookahead):
    # What the runtime executes for 9 steps and a flush -- Program's segments, the later ones
    # moved copies of the PERIOD_FROM-th -- is exactly generate()'s 9-step list, which the
    # validator proves deadlock-free under NCCL's rules.
    n = 9
    for (d, m), opts in itertools.product(CONFIGS + [(2, 4), (3, 6)], OPTIONS):
        if _skip(schedule, d, m, opts, lookahead):
            continue
        opts = {**opts, "lookahead": lookahead} if lookahead else opts
        program = Program(schedule, d, m, **opts)
        full = generate(schedule, d, m, n, **opts)
        validate(full, schedule, d, m, n, **opts)
        for s in range(d):
            ran = [a for t in range(1, n + 1) for a in program.segment(s, t)] + program.drain(s, n)
            assert ran == full[s], (schedule, d, m, opts, s)
            assert program.segment(s, n)[-1].kind is Kind.END_STEP
        assert len(program._parts) <= Program.PERIOD_FROM  # bounded, however long the run


def test_an_epoch_after_a_flush_is_the_first_epoch_moved():
    # After a flush at batch 3 the pipeline fills again: batch 4 uses W(2) (2bw: max(t-2, 0)).
    program = Program("2bw", 2, 2)
    seg = program.segment(0, 4, epoch_start=3)
    first = program.segment(0, 1)
    assert [(a.kind, a.index) for a in seg] == [(a.kind, a.index + (6 if a.microbatch else 3)) for a in first]
    assert {a.version for a in seg if a.kind in (Kind.F, Kind.B)} == {2}


@pytest.mark.parametrize("schedule,lookahead", WITH_LOOKAHEAD)
def test_step_boundaries_match_on_every_channel(schedule, lookahead):
    # At END_STEP t both ranks of each pair have posted the same operations, so a caller that
    # stops stepping (or flushes, evaluates, checkpoints) leaves no receive without its send:
    # a script that ends without flush() waits for its posted receives at exit (runtime.drain).
    for (d, m), opts in itertools.product(CONFIGS + [(2, 4), (3, 6)], OPTIONS):
        if d < 2 or _skip(schedule, d, m, opts, lookahead):
            continue
        opts = {**opts, "lookahead": lookahead} if lookahead else opts
        lists = generate(schedule, d, m, 4, **opts)
        for s in range(d - 1):
            for t in range(1, 5):
                def posted(stage, peer):
                    out = []
                    for a in lists[stage]:
                        if a.kind is Kind.END_STEP and a.index == t:
                            return out
                        if a.peer == peer:
                            out.append(a)
                mine, theirs = posted(s, s + 1), posted(s + 1, s)
                assert [a.counterpart() for a in mine] == theirs, (schedule, d, m, opts, s, t)


# ---------------------------------------------------------------------------------------------
# The strict communicator (NCCL's rules in one process)


def test_rendezvous_names_both_ranks_when_two_sends_meet():
    engine = Rendezvous({})
    engine.post(CommOp(0, "send", "0SEND_ACT3", ("act", 3), peer=1))
    with pytest.raises(CommOrderError, match=re.escape(
        "point-to-point order mismatch between ranks 1 and 0: rank 1: send to rank 0 (1SEND_GRAD2) is matched "
        "with rank 0: send to rank 1 (0SEND_ACT3)"
    )):
        engine.post(CommOp(1, "send", "1SEND_GRAD2", ("grad", 2), peer=0))


def test_rendezvous_completes_in_post_order_and_finds_cycles():
    # Rank 0 posts the all-reduce before its send, rank 1 receives before the all-reduce: gloo
    # runs this, NCCL may hang. Here neither completes and blocked() says why.
    engine = Rendezvous({"g": [0, 1]})
    ar0 = engine.post(CommOp(0, "collective", "0NORM_START1", "n", group="g"))
    send = engine.post(CommOp(0, "send", "0SEND_ACT4", "a4", peer=1))
    recv = engine.post(CommOp(1, "recv", "1RECV_ACT4", "a4", peer=0))
    ar1 = engine.post(CommOp(1, "collective", "1NORM_START1", "n", group="g"))
    assert not any(op.done for op in (ar0, send, recv, ar1))
    assert engine.blocked() == [
        "rank 0: collective on group 'g' (0NORM_START1) waits: rank 1 first completes 1RECV_ACT4",
        "rank 1: recv from rank 0 (1RECV_ACT4) waits: rank 0 first completes 0NORM_START1",
    ]
    # The consistent order completes everything and leaves nothing behind.
    engine = Rendezvous({"g": [0, 1]})
    ops = [engine.post(CommOp(0, "send", "s", "a4", peer=1)), engine.post(CommOp(1, "recv", "r", "a4", peer=0)),
           engine.post(CommOp(0, "collective", "c0", "n", group="g")),
           engine.post(CommOp(1, "collective", "c1", "n", group="g"))]
    assert all(op.done for op in ops) and len(engine) == 0


def test_local_hub_checks_shapes_and_moves_data_at_completion():
    hub = LocalHub(2, {"all": [0, 1]})
    a, b = hub.comm(0), hub.comm(1)
    x = torch.arange(4.0)
    h = a.isend([x], 1, "0SEND_ACT1")
    buf = torch.zeros(4)
    hr = b.irecv([buf], 0, "1RECV_ACT1")
    assert h.ready() and hr.ready() and torch.equal(buf, x)
    a.isend([torch.zeros(3)], 1, "0SEND_ACT2")
    with pytest.raises(CommOrderError, match=r"rank 1: recv from rank 0 \(1RECV_ACT2\) is matched with rank 0: send to rank "
                                             r"1 \(0SEND_ACT2\) .*expected a send of \(\(\(4,\), torch.float32\),\), "
                                             r"found a send of \(\(\(3,\), torch.float32\),\)"):
        b.irecv([torch.zeros(4)], 0, "1RECV_ACT2")


# ---------------------------------------------------------------------------------------------
# Bounded state: a long run holds exactly what a short one does


def _held(pipe) -> dict[str, int]:
    """Summed lengths of every container the driver, the workers and the communicator hold."""
    sizes = {
        "program": sum(len(seg) + len(drain) for parts in pipe.program._parts.values() for seg, drain in parts.values()),
        "hub": len(pipe.hub.engine) + len(pipe.hub.engine.queue),
        "timeline": len(pipe.timeline),
        "loss sums": len(pipe._loss_sums),
    }
    for r, wk in pipe.workers.items():
        for name in ("inputs", "targets", "recv_act", "recv_grad", "ctx", "sends", "reductions", "norm_sq",
                     "clip_coef", "losses", "eval_weights", "batch_loss", "loss_posts", "loss_check", "nonfinite", "dropped",
                     "reached_counts", "batch_scale", "updated_flags"):
            sizes[f"{r}.{name}"] = len(getattr(wk, name))
    return sizes


@pytest.mark.parametrize("schedule, m", [("2bw", 2), ("1f1b", 2), ("zb", 4)])
def test_state_is_the_same_after_30_and_300_steps(schedule, m):
    # d = 2, w = 2 (4 ranks in this process), clipping, a tied embedding on both stages; zb at m = 4,
    # where its last stage runs whole backwards (B) between split ones (I, W)
    model, example = gpt2_tiny(batch=1, seq=4, labels=True)
    plan = fxpipe.plan(model, example, stages=2, microbatches=m, schedule=schedule, world_size=4, clip=True)
    pipe = fxpipe.compile(model, example, plan=plan, optimizer=functools.partial(torch.optim.SGD, lr=1e-3),
                          microbatches=m, schedule=schedule, max_grad_norm=1.0, verbose=False)
    assert (pipe.plan.stages, pipe.plan.width, pipe.topology.tied_stages) == (2, 2, [0, 1])
    ids = torch.randint(0, 100, (2 * m, 4))
    batch = {"input_ids": ids, "labels": ids}
    held = {}
    for t in range(1, 301):
        pipe.step(batch)
        if t in (30, 300):
            held[t] = _held(pipe)
    assert held[30] == held[300]
    assert sum(held[300].values()) < 1000
