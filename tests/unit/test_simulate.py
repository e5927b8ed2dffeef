"""Simulated timelines: bubble fractions, 2bw's vanishing bubble, memory peaks and the three renderings."""

from __future__ import annotations

import dataclasses
import json
import xml.etree.ElementTree as ET

import pytest

from fxpipe.errors import ScheduleError
from fxpipe.schedule import Action, Kind, Program, generate, lower_to_streams, min_microbatches
from fxpipe.simulate import (
    Costs,
    chrome_trace,
    format_grid,
    render_svg,
    simulate,
    timeline_from_events,
    write_schedule_dumps,
)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("d,m", [(2, 2), (2, 4), (4, 8), (3, 5), (4, 4)])
@pytest.mark.parametrize("fwd,bwd", [(1.0, 1.0), (1.0, 2.0), (0.5, 1.5)])
def test_flush_bubble_is_exact(schedule, d, m, fwd, bwd):
    tl = simulate(generate(schedule, d, m, 1), Costs(forward=fwd, backward=bwd))
    assert tl.bubble == pytest.approx((d - 1) / (m + d - 1), abs=1e-12)
    assert tl.makespan == pytest.approx((m + d - 1) * (fwd + bwd))


@pytest.mark.parametrize("schedule, idle", [("1f1b", 0.2), ("gpipe", 0.2), ("2bw", 0.0)])
def test_each_rank_s_busy_time_over_the_steady_step_is_the_schedule_s_own_bubble(schedule, idle):
    # d = 2, m = 4, F = 1, B = 2: every rank computes 12 a step; 1F1B's flush idles each for one F + B
    steps = 8
    tl = simulate(generate(schedule, 2, 4, steps), Costs(1.0, 2.0))
    assert [tl.busy(r) for r in tl.ranks] == [12.0 * steps] * 2
    assert [tl.steady_idle(r) for r in tl.ranks] == pytest.approx([idle] * 2)


def test_2bw_bubble_vanishes_with_steps():
    bubbles = [simulate(generate("2bw", 4, 4, steps), Costs(1.0, 2.0)).bubble for steps in (2, 5, 10, 50)]
    assert bubbles == sorted(bubbles, reverse=True) and len(set(bubbles)) == 4
    assert bubbles[-1] < 0.05
    # Steady state: one batch per m * (fwd + bwd), i.e. no bubble between steps.
    assert simulate(generate("2bw", 4, 4, 10), Costs(1.0, 2.0)).step_time == pytest.approx(12.0)
    # The flushing 1f1b pays the fill and drain every step.
    assert simulate(generate("1f1b", 4, 4, 10), Costs(1.0, 2.0)).step_time == pytest.approx(21.0)


def test_peak_in_flight_matches_memory_formula():
    for schedule, want in (("gpipe", {0: 8, 1: 8, 2: 8, 3: 8}), ("1f1b", {0: 4, 1: 3, 2: 2, 3: 1}),
                           ("2bw", {0: 4, 1: 3, 2: 2, 3: 1})):
        assert simulate(generate(schedule, 4, 8, 2), Costs()).peak_in_flight == want


def test_costs_of_communication_recompute_and_reductions_lengthen_the_run():
    base = simulate(generate("2bw", 2, 2, 4), Costs(1.0, 2.0)).makespan
    slow = simulate(generate("2bw", 2, 2, 4, recompute=True, width=2), Costs(1.0, 2.0, p2p=0.25, reduce=0.5, update=0.1))
    assert slow.makespan > base
    # Recomputation adds one forward per micro-batch per stage: 8 micro-batches on stage 0.
    rec = simulate(generate("gpipe", 1, 8, 1, recompute=True), Costs(1.0, 2.0))
    assert rec.makespan == pytest.approx(8 * (1 + 2 + 1))


def test_per_stage_costs():
    tl = simulate(generate("gpipe", 2, 2, 1), Costs(forward=[1.0, 3.0], backward=[2.0, 6.0]))
    # The slow stage sets the pace: stage 1 runs 2 * (3 + 6) after stage 0's first forward.
    assert tl.makespan == pytest.approx(1 + 2 * 9 + 2)
    with pytest.raises(ScheduleError, match="Costs.forward has 1 entries, expected one per stage"):
        simulate(generate("gpipe", 2, 2, 1), Costs(forward=[1.0]))


@pytest.mark.parametrize("schedule", ["2bw", "1f1b", "gpipe", "zb"])
def test_stages_sharing_cores_compute_at_the_hosts_pace(schedule):
    """CPU ranks on one host (``Costs.cores``): with a core per stage nothing changes; with one
    core for all, every step takes the whole work of every stage (4 stages x 4 micro-batches x
    (1 + 2)), bubbles or not; in between, the pace lies between the two."""
    lists = generate(schedule, 4, 4, 8)
    own = simulate(lists, Costs(1.0, 2.0))
    shared = simulate(lists, Costs(1.0, 2.0, cores=4))
    assert {(e.rank, e.action, round(e.start, 9), round(e.end, 9)) for e in shared.events} == \
        {(e.rank, e.action, e.start, e.end) for e in own.events}
    one = simulate(lists, Costs(1.0, 2.0, cores=1)).step_time
    assert one == pytest.approx(48.0)
    assert own.step_time < simulate(lists, Costs(1.0, 2.0, cores=2)).step_time < one


def test_a_rank_computing_alone_runs_at_full_speed():
    """gpipe, 2 stages on 1.5 cores (forward 1, backward 2): a pass that runs alone takes its
    own time; passes of both stages at once run at 0.75 of their speed."""
    tl = simulate(generate("gpipe", 2, 2, 1), Costs(1.0, 2.0, cores=1.5))
    span = {e.action: (e.start, e.end) for e in tl.events if e.stream == "compute" and e.end > e.start}
    assert span["0F1v0"] == (0.0, 1.0)  # alone: stage 1 waits for it
    assert span["0F2v0"] == span["1F1v0"] == pytest.approx((1.0, 1 + 1 / 0.75))  # together
    assert span["1B1v0"][1] - span["1B1v0"][0] == pytest.approx(2.0)  # alone again
    assert span["0B1v0"] == span["1B2v0"] == pytest.approx((span["1B1v0"][1], span["1B1v0"][1] + 2 / 0.75))
    assert tl.makespan == pytest.approx(10.0)


def test_simulator_reports_mismatch():
    lists = {s: list(v) for s, v in generate("gpipe", 2, 2, 1).items()}
    i, j = lists[1].index(Action.parse("1RECV_ACT1")), lists[1].index(Action.parse("1RECV_ACT2"))
    lists[1][i], lists[1][j] = lists[1][j], lists[1][i]
    # the same engine, and so the same error, as the validator and the single-process driver
    with pytest.raises(ScheduleError, match=r"point-to-point order mismatch between ranks 1 and 0: rank 1: recv from rank 0 "
                                            r"\(1RECV_ACT2\) is matched with rank 0: send to rank 1 \(0SEND_ACT1\)"):
        simulate(lists, Costs())


def test_text_grid_literal():
    grid = format_grid(simulate(generate("1f1b", 2, 2, 1), Costs(1.0, 1.0)))
    assert grid.splitlines() == [
        "time  rank 0  rank 1",
        "0     0F1v0   .",
        "1     0F2v0   1F1v0",
        "2     .       1B1v0",
        "3     0B1v0   1F2v0",
        "4     .       1B2v0",
        "5     0B2v0   .",
        "makespan 6  step time 6  bubble 0.333  peak in flight {0: 2, 1: 1}",
    ]


def test_chrome_trace():
    tl = simulate(generate("2bw", 2, 2, 2), Costs(1.0, 2.0, p2p=0.5))
    trace = chrome_trace(tl)
    events = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(events) == len(tl.events)
    f = next(e for e in events if e["name"] == "1F1v0")
    assert (f["pid"], f["tid"], f["cat"], f["args"]["version"]) == (1, 0, "F", 0)
    assert f["ts"] == pytest.approx(1.5e6) and f["dur"] == pytest.approx(1e6)
    json.dumps(trace)  # serialisable as is


def test_svg_is_self_contained():
    svg = render_svg(simulate(generate("2bw", 2, 2, 3, width=2), Costs(1.0, 2.0, p2p=0.2, reduce=0.5, update=0.3)), title="2bw d=2 m=2")
    root = ET.fromstring(svg)
    assert root.tag == "{http://www.w3.org/2000/svg}svg"
    lowered = svg.lower()
    for forbidden in ("href", "<script", "@import", "url(", "<image", "https://"):
        assert forbidden not in lowered
    texts = {t.text for t in root.iter("{http://www.w3.org/2000/svg}text")}
    assert {"rank 0, stage 0", "rank 1, stage 1", "F1v1", "B1v0"} <= texts  # F1v1: step 3's first forward
    assert any(r.get("fill") == "#e15759" for r in root.iter("{http://www.w3.org/2000/svg}rect"))  # UPDATE


def test_timeline_from_recorded_events():
    recorded = [(0, "0F1v0", 0.0, 0.1), (1, "1F1v0", 0.1, 0.2), (1, "1B1v0", 0.2, 0.4), (0, "0B1v0", 0.4, 0.6),
                (0, "0UPDATE1", 0.6, 0.65), (1, "1UPDATE1", 0.4, 0.45), (0, "0SEND_ACT1", 0.1, 0.1)]
    tl = timeline_from_events(recorded)
    assert tl.makespan == pytest.approx(0.65)
    assert tl.peak_in_flight == {0: 1, 1: 1}
    assert {e.stream for e in tl.events} == {"compute", "p2p_next"}
    assert "0F1v0" in format_grid(tl) and "1B1v0" in render_svg(tl)


def test_write_schedule_dumps(tmp_path):
    lists = generate("2bw", 2, 4, 3, clip=True)
    paths = write_schedule_dumps(tmp_path / "dumps", lists, Costs(1.0, 2.0), name="2bw")
    assert sorted(paths) == ["json", "svg", "txt"]
    text = paths["txt"].read_text()
    assert "0F1v0" in text and "bubble" in text and "*" not in text.split("# timeline")[0].splitlines()[2]
    assert json.loads(paths["json"].read_text())["traceEvents"]
    ET.fromstring(paths["svg"].read_text())


@pytest.mark.parametrize("schedule", ["2bw", "1f1b", "gpipe"])
def test_planner_step_time_equals_the_simulator(schedule):
    # The planner prices a step with a closed form; on the generated lists with balanced stages
    # and free communication the simulator measures exactly that.
    from fxpipe.partition import pipeline_time

    # m < d too, where 2bw takes none (1f1b and zb hold min(d - s, m) micro-batches there)
    for d, m in ((2, 2), (2, 4), (3, 6), (4, 4), (4, 8), (2, 1), (4, 2), (5, 3), (6, 2)):
        if m < min_microbatches(schedule, d):
            continue
        tl = simulate(generate(schedule, d, m, 8), Costs(forward=1.0, backward=2.0))
        assert tl.step_time == pytest.approx(pipeline_time(schedule, d, m, 3.0)), (d, m)


def test_zbs_closed_form_is_exact_at_equal_passes_and_a_lower_bound_otherwise():
    import random

    from fxpipe.partition import pipeline_time

    for d, m in ((2, 4), (3, 6), (4, 8)):  # F = I = W: a backward of two forwards split in halves
        tl = simulate(generate("zb", d, m, 1), Costs(forward=1.0, backward=2.0))
        assert tl.makespan == pytest.approx(pipeline_time("zb", d, m, 3.0, forward=1.0)), (d, m)
    rng, above = random.Random(0), 0
    for _ in range(60):
        f, i, w = rng.uniform(0.5, 2), rng.uniform(0.3, 3), rng.uniform(0.3, 3)
        d = rng.randint(2, 4)
        m = rng.randint(d, 8)
        closed = m * (f + i + w) + (d - 1) * (f + i - w)
        tl = simulate(generate("zb", d, m, 1), Costs(forward=f, backward=i + w, backward_input=i, backward_weight=w))
        assert closed <= tl.makespan * (1 + 1e-12), (f, i, w, d, m)
        above += closed < tl.makespan * (1 - 1e-9)
    assert above  # where the weight pass outlasts the forward the simulator reads more


def test_simulate_times_an_eval_pass():
    # Program.eval's lists send what EVAL k produced: the lowering makes SEND_ACT k wait for it.
    program = Program("1f1b", 3, 4)
    lists = {s: program.eval(s) for s in range(3)}
    send = next(op for op in lower_to_streams(lists[0]) if op.action.kind is Kind.SEND_ACT)
    assert send.waits == ("0EVAL1",)
    tl = simulate(lists, Costs(forward=1.0, p2p=0.5))
    assert tl.makespan == pytest.approx(4 + 2 * (1 + 0.5))  # m forwards, each stage 1.5 later
    assert sorted(e.action for e in tl.events if e.rank == 2 and e.stream == "compute") == \
        ["2EVAL1", "2EVAL2", "2EVAL3", "2EVAL4"]
    texts = {t.text for t in ET.fromstring(render_svg(tl)).iter("{http://www.w3.org/2000/svg}text")}
    assert "an eval pass; makespan 7 units; bubble 42.9% (idle share of 3 ranks x makespan)" in texts
    assert "key: E1 = eval forward of micro-batch 1 of the batch (newest weights); hatched = idle" in texts


def test_picture_without_idle_time_has_no_idle_legend_or_key():
    tl = simulate(generate("gpipe", 1, 2, 2), Costs(1.0, 2.0, update=0.5))
    root = ET.fromstring(render_svg(tl))
    texts = [t.text for t in root.iter("{http://www.w3.org/2000/svg}text")]
    legend = {t.text for t in root.iter("{http://www.w3.org/2000/svg}text") if t.get("class") == "legend"}
    assert tl.bubble == 0 and legend == {"F forward", "B backward", "U optimizer step"}
    assert "key: F1v0 = forward of micro-batch 1 (of 2) of its step on weight version 0; " \
           "U1 = optimizer step with step 1's gradients" in texts
    assert "idle 0 units (0.0%)" in texts and not any("hatched" in t for t in texts)
    assert not any(p.get("stroke") == "#bdbdbd" for p in root.iter("{http://www.w3.org/2000/svg}path"))  # hatching


@pytest.mark.parametrize("schedule,recompute", [("2bw", False), ("1f1b", True), ("gpipe", False), ("zb", False)])
def test_replaying_a_timelines_own_action_times_gives_its_step_time(schedule, recompute):
    """``Costs.measured`` maps every compute kind back to the field that times it (zb's first
    stage included, whose W is its whole backward; recomputation's R apart from F): costs
    that predict nothing alike, given the action times of a run, reproduce that run exactly."""
    lists = generate(schedule, 3, 6, 4, recompute=recompute)
    costs = Costs(forward=[1.0, 1.5, 1.2], backward=[2.0, 3.5, 2.5], backward_input=[0.9, 1.6, 1.0],
                  recompute=[0.7, 1.1, 0.8], update=[0.3, 0.2, 0.4], p2p=0.05)
    tl = simulate(lists, costs)
    wrong = Costs(forward=9.0, backward=9.0, backward_input=4.0, recompute=9.0, update=9.0, p2p=0.05, cores=1.0)
    replay = wrong.measured(tl.action_times())
    assert replay.cores is None
    if schedule == "zb":
        assert replay.per_stage("backward", 0) == pytest.approx(2.0)  # stage 0's W (I costs 0 there)
    assert simulate(lists, replay).step_time == pytest.approx(tl.step_time)


@pytest.mark.parametrize("schedule", ["2bw", "1f1b", "gpipe", "zb"])
def test_a_replay_takes_the_slowdown_of_shared_cores_from_the_measured_times(schedule):
    """Three stages on two cores: the simulated actions ran slower than their costs, and a replay
    at those times, without cores, comes close to the run (not exactly: a mean over actions
    that ran at different shares of the cores)."""
    lists = generate(schedule, 3, 6, 4)
    costs = Costs(forward=[1.0, 1.5, 1.2], backward=[2.0, 3.5, 2.5], update=[0.3, 0.2, 0.4], p2p=0.05, cores=2.0)
    tl = simulate(lists, costs)
    times = tl.action_times()
    assert times[0, Kind.F] > 1.0
    replayed = simulate(lists, costs.measured(times)).step_time
    assert replayed == pytest.approx(tl.step_time, rel=0.04)
    # the same costs without the slowdown are 7.5% or more short of the run
    assert simulate(lists, dataclasses.replace(costs, cores=None)).step_time < 0.93 * tl.step_time


def test_measured_costs_keep_the_predicted_ones_where_a_stage_has_no_timed_action():
    costs = Costs(forward=[1.0, 2.0], backward=[2.0, 4.0], backward_input=[0.5, 1.0], update=0.5, cores=1.5)
    got = costs.measured({(0, Kind.F): 1.25, (0, Kind.B): 2.5, (1, Kind.I): 1.0, (1, Kind.W): 2.0})
    assert got.forward == [1.25, 2.0]  # stage 1's forward was not timed: the prediction stays
    assert got.backward == [2.5, 3.0]  # stage 1's: I + W
    # stage 0 timed a whole backward only: its halves keep the predicted split (a quarter in I)
    assert got.backward_input == [0.625, 1.0] and got.backward_weight == [1.875, 2.0]
    assert got.update == 0.5 and got.cores is None
    assert Costs(forward=[1.0, 2.0]).measured({}) == Costs(forward=[1.0, 2.0])  # nothing timed: only cores go
    assert Costs().measured({}).cores is None


def test_a_zb_stage_that_runs_its_backward_unsplit_is_priced_whole_in_i():
    """A stage zb cannot split runs its whole backward in I and an empty W: the measured I is
    the stage's backward (I + W), and the simulator times its I and W as they ran."""
    costs = Costs(forward=[1.0, 1.0], backward=[2.0, 2.0], backward_input=[1.0, 1.0])
    got = costs.measured({(1, Kind.I): 3.0, (1, Kind.W): 0.0})
    assert got.backward == [2.0, 3.0] and got.backward_input == [1.0, 3.0] and got.backward_weight == [1.0, 0.0]
    lists = generate("zb", 2, 4, 2)
    assert simulate(lists, got).makespan > simulate(lists, costs).makespan  # stage 1 takes longer in all
