"""Interleaved 1F1B (``chunks`` stages per rank): its order, its lists under NCCL's rules, the
rank that joins a collective once for several stages, the planner's price, and the errors.

The numbers (every case against the single-device references, in one process and on 2-4 gloo
ranks) are checked with the other cases: tests/cases.py's ``i2_*``/``i3_*``, run by
tests/unit/test_pipeline.py and tests/dist/test_pipeline_dist.py; the real posts under gloo by
tests/dist/test_post_order.py.
"""

from __future__ import annotations

import itertools

import pytest
import torch

import fxpipe
from fxpipe.deps import CommOp, CommOrderError, Rendezvous
from fxpipe.errors import ConfigError, PlanError, ScheduleError
from fxpipe.schedule import (Action, Kind, Program, compute_only, eval_lanes, generate, interleaved_in_flight, lane_of,
                             validate)
from fxpipe.simulate import Costs, simulate
from tests import resume


def _order(lst):
    return " ".join(f"{a.kind.value}{a.stage}:{a.index}" for a in lst if a.kind in (Kind.F, Kind.B))


def test_megatrons_order_on_two_ranks():
    # Narayanan et al. (SC 2021), d = 2, v = 2, m = 4: forwards in rounds of d micro-batches
    # through the rank's stages, backwards through the same rounds with the stages reversed
    lanes = generate("1f1b", 4, 4, chunks=2)
    assert _order(lanes[0]) == ("F0:1 F0:2 F2:1 F2:2 F0:3 B2:1 F0:4 B2:2 F2:3 B0:1 F2:4 B0:2 B2:3 B2:4 B0:3 B0:4")
    assert _order(lanes[1]) == ("F1:1 F1:2 F3:1 B3:1 F3:2 B3:2 F1:3 B1:1 F1:4 B1:2 F3:3 B3:3 F3:4 B3:4 B1:3 B1:4")
    assert {lane_of(a.stage, 4, 2) for r, lst in lanes.items() for a in lst} == {0, 1}
    assert all(lane_of(a.stage, 4, 2) == r for r, lst in lanes.items() for a in lst)


GRID = [(d, v, m) for d, v, m in [(2, 2, 2), (2, 2, 4), (2, 2, 8), (2, 3, 4), (2, 4, 4), (3, 2, 3), (3, 2, 6),
                                  (4, 2, 4), (4, 3, 8)]]


@pytest.mark.parametrize("d,v,m", GRID)
def test_lists_validate_with_every_option(d, v, m):
    # the validator's replay runs the lanes under NCCL's pairing and one post order per rank,
    # each lane joining a collective once for all its stages
    for clip, width, tied, recompute in itertools.product((False, True), (1, 2), (None, True, [0, d], [1, d + 1]),
                                                          (False, True)):
        lanes = generate("1f1b", d * v, m, 3, chunks=v, clip=clip, width=width, tied=tied, recompute=recompute)
        validate(lanes, "1f1b", d * v, m, 3, chunks=v, clip=clip, width=width, tied=tied, recompute=recompute)
        for r, lst in lanes.items():
            held, most = set(), 0
            for a in lst:
                if a.kind is Kind.F:
                    held.add((a.stage, a.index))
                    most = max(most, len(held))
                elif a.kind is Kind.B:
                    held.discard((a.stage, a.index))
            assert most == interleaved_in_flight(r, d * v, v, m)


@pytest.mark.parametrize("d,v,m", [(2, 2, 4), (3, 2, 6), (2, 3, 2)])
def test_segments_repeat_and_concatenate_to_the_validated_lists(d, v, m):
    n = 7
    for opts in ({}, {"clip": True, "width": 2, "tied": True}, {"recompute": True, "clip": True}):
        program = Program("1f1b", d * v, m, chunks=v, **opts)
        full = generate("1f1b", d * v, m, n, chunks=v, **opts)
        for r in range(d):
            ran = [a for t in range(1, n + 1) for a in program.segment(r, t)] + program.drain(r, n)
            assert ran == full[r], (d, v, m, opts, r)
            assert program.segment(r, n)[-1].kind is Kind.END_STEP
        assert len(program._parts) <= Program.PERIOD_FROM


def test_a_lane_posts_every_stages_part_of_a_collective_before_it_waits():
    lane = generate("1f1b", 4, 2, 1, chunks=2, clip=True)[0]
    starts = [i for i, a in enumerate(lane) if a.kind is Kind.NORM_START]
    waits = [i for i, a in enumerate(lane) if a.kind is Kind.NORM_WAIT]
    assert len(starts) == 2 and max(starts) < min(waits)
    # a wait moved between the two parts would wait for a collective the rank has not joined yet
    moved = list(lane)
    moved.insert(starts[1], moved.pop(waits[0]))
    lanes = generate("1f1b", 4, 2, 1, chunks=2, clip=True)
    with pytest.raises(ScheduleError, match="deadlock"):
        validate({0: moved, 1: lanes[1]}, "1f1b", 4, 2, 1, chunks=2, clip=True)


def test_a_receive_out_of_its_pairs_queue_order_is_rejected():
    lanes = generate("1f1b", 4, 4, 1, chunks=2)
    lane = list(lanes[1])
    # two receives posted one after the other (3RECV_ACT1 3RECV_ACT2), swapped
    i = next(i for i in range(len(lane) - 1) if lane[i].kind is lane[i + 1].kind is Kind.RECV_ACT)
    lane[i], lane[i + 1] = lane[i + 1], lane[i]
    with pytest.raises(ScheduleError, match="order mismatch"):
        validate({0: lanes[0], 1: lane}, "1f1b", 4, 4, 1, chunks=2)


def test_eval_lanes_run_every_stage_once_per_micro_batch():
    lanes = eval_lanes(6, 3, 4)
    evals = sorted((a.stage, a.index) for lst in lanes.values() for a in lst if a.kind is Kind.EVAL)
    assert evals == [(s, k) for s in range(6) for k in range(1, 5)]
    engine = Rendezvous({"LOSS": [0, 0, 0, 1, 1, 1]})
    from fxpipe.deps import interleave
    from fxpipe.schedule import comm_op, waits_for

    posted = {}

    def ready(r, a):
        need = waits_for(a, 6)
        return need is None or (need in posted and posted[need].done)

    def run(r, i):
        a = lanes[r][i]
        if a.kind in (Kind.SEND_ACT, Kind.RECV_ACT, Kind.LOSS):
            posted[a] = engine.post(comm_op(a, 6, 3))

    assert interleave(lanes, ready, run) == {} and len(engine) == 0


def test_a_rank_of_several_members_joins_a_collective_once():
    done = []
    engine = Rendezvous({"g": [0, 0, 1]}, on_complete=lambda ops: done.append([o.label for o in ops]))
    a = engine.post(CommOp(0, "collective", "0NORM_START1", ("N", 1), group="g", member=0))
    assert a.held and not a.done and len(engine.queue) == 0  # the rank has not joined yet
    b = engine.post(CommOp(1, "collective", "1NORM_START1", ("N", 1), group="g", member=1))
    assert not b.done
    c = engine.post(CommOp(0, "collective", "2NORM_START1", ("N", 1), group="g", member=2))
    assert a.done and b.done and c.done and not c.held
    assert done == [["0NORM_START1", "2NORM_START1", "1NORM_START1"]]  # every part, by rank
    with pytest.raises(CommOrderError, match="parts came from 3"):
        for member in (0, 2, 4):
            engine.post(CommOp(0, "collective", f"{member}X", ("N", 2), group="g", member=member))


def test_a_rank_sums_its_stages_parts_in_one_process():
    # LocalHub: the rank's two parts and the other rank's part sum to one total everywhere
    from fxpipe.comm import LocalHub

    hub = LocalHub(2, {"all": [0, 0, 1, 1]})
    c0, c1 = hub.comm(0), hub.comm(1)
    t = [torch.tensor([float(x)]) for x in (1, 2, 4, 8)]
    h = [c0.all_reduce(t[0], "all", "a", member=0), c1.all_reduce(t[1], "all", "b", member=1),
         c0.all_reduce(t[2], "all", "c", member=2)]
    assert not any(x.ready() for x in h)
    h.append(c1.all_reduce(t[3], "all", "d", member=3))
    assert all(x.ready() for x in h) and [float(x) for x in t] == [15.0] * 4


def test_interleaving_cuts_the_bubble():
    # equal stages, free transfers: 1F1B's bubble is (d-1)/(m+d-1), interleaved (d-1)/(vm+d-1)
    d, m = 2, 4
    for v in (1, 2, 4):
        lists = generate("1f1b", d * v, m, 6, chunks=v)
        tl = simulate(lists, Costs(forward=1.0 / v, backward=2.0 / v, update=0.0, p2p=0.0), chunks=v)
        work = m * 3.0  # a rank's F and B of every micro-batch, over its v stages
        assert tl.step_time == pytest.approx(work / (1 - (d - 1) / (v * m + d - 1)))


def test_errors_say_what_to_pass():
    with pytest.raises(ScheduleError, match=r"only schedule='1f1b' does.*pass chunks=1"):
        generate("2bw", 4, 4, chunks=2)
    with pytest.raises(ScheduleError, match=r"multiple of 2 stages, found stages=5: pass stages=4 or 6"):
        generate("1f1b", 5, 4, chunks=2)
    with pytest.raises(ScheduleError, match=r"microbatches must be a multiple of 3; found microbatches=4: pass 3 or 6"):
        generate("1f1b", 6, 4, chunks=2)
    with pytest.raises(ScheduleError, match=r"every stage on one rank.*pass chunks=1, or stages=4"):
        generate("1f1b", 2, 4, chunks=2)
    with pytest.raises(ScheduleError, match="takes no lookahead"):
        generate("1f1b", 4, 4, chunks=2, lookahead=1)
    model, example = resume.model(0.0), (resume.batch(0)[0][:2],)
    with pytest.raises(ConfigError, match=r"chunks=2 interleaves stages.*found schedule='2bw'"):
        fxpipe.compile(model, example, schedule="2bw", stages=4, chunks=2)
    with pytest.raises(ConfigError, match=r"chunks must be an int >= 1"):
        fxpipe.compile(model, example, schedule="1f1b", stages=4, chunks=0)
    with pytest.raises(PlanError, match=r"chunks=2 needs stages="):
        fxpipe.plan(model, example, schedule="1f1b", microbatches=4, chunks=2)
    plan = fxpipe.plan(model, example, schedule="1f1b", stages=4, microbatches=4, chunks=2)
    with pytest.raises(ConfigError, match=r"chunks=1 contradicts the plan, which runs 2 stage\(s\) per rank"):
        fxpipe.compile(model, example, schedule="1f1b", plan=plan, chunks=1)


def test_the_plan_prices_the_interleaved_step_on_its_ranks():
    model, example = resume.model(0.0), (resume.batch(0)[0][:2],)
    plain = fxpipe.plan(model, example, schedule="1f1b", stages=4, microbatches=4, world_size=4)
    inter = fxpipe.plan(model, example, schedule="1f1b", stages=4, microbatches=4, chunks=2)
    assert (inter.chunks, inter.world_size, inter.stages) == (2, 2, 4)
    assert inter.memory_limit == pytest.approx(plain.memory_limit / 2)  # each stage in half a rank's memory
    lists = generate("1f1b", 4, 4, 8, chunks=2)
    pipe = simulate(lists, Costs.of_plan(inter), chunks=2).step_time
    assert inter.step_time == pytest.approx(pipe + inter.allreduce_time)  # a flush waits for its reductions
    # the cuts moved to balance what each rank runs, from the solver's balanced stages
    at_solvers_cuts = simulate(lists, Costs.of_plan(plain), chunks=2).step_time
    assert pipe <= at_solvers_cuts * (1 + 1e-9)
    assert inter.throughput == pytest.approx(inter.global_batch / inter.step_time)
    assert "interleaved, 2 stages per rank on 2 ranks per replica" in str(inter)


def test_resume_is_bitwise_the_uninterrupted_run(tmp_path):
    full = resume.run(resume.compile("1f1b", 4, 2, chunks=2), 0, 6)
    resume.run(resume.compile("1f1b", 4, 2, chunks=2), 0, 3, save=str(tmp_path))
    resumed = resume.run(resume.compile("1f1b", 4, 2, chunks=2, lazy=True), 3, 3, load=str(tmp_path))
    assert resumed["steps"] == 6
    assert full["losses"][3:] == resumed["losses"]
    assert all(torch.equal(full["state"][k], resumed["state"][k]) for k in full["state"])


@pytest.mark.parametrize("saved,loaded", [((4, 2), (2, None)), ((2, None), (4, 2))])
def test_a_checkpoint_moves_between_interleaved_and_not(tmp_path, saved, loaded):
    layout = dict(dropout=0.0, dtype=torch.float64)
    resume.run(resume.compile("1f1b", saved[0], 2, chunks=saved[1], **layout), 0, 3, save=str(tmp_path))
    full = resume.run(resume.compile("1f1b", loaded[0], 2, chunks=loaded[1], **layout), 0, 5)
    resumed = resume.run(resume.compile("1f1b", loaded[0], 2, chunks=loaded[1], **layout), 3, 2, load=str(tmp_path))
    assert resume.max_rel_diff(resumed, {"losses": full["losses"][3:], "state": full["state"]}) < 1e-5
