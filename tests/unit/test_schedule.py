"""Schedules as data: literal gpipe/1f1b/2bw lists, the validator's planted errors, stream lowering."""

from __future__ import annotations

import itertools
import re

import pytest

from fxpipe.errors import ScheduleError
from fxpipe.simulate import Costs, simulate
from fxpipe.schedule import (
    SCHEDULES,
    Action,
    Kind,
    actions_by_rank,
    batch_of,
    compute_only,
    generate,
    lower_to_streams,
    rank_of,
    stage_and_replica,
    validate,
    version_of,
    warmup,
)

# ---------------------------------------------------------------------------------------------
# Action strings


@pytest.mark.parametrize(
    "text", ["1F3", "1F3v0", "0B12v4", "2R7v1", "0SEND_ACT3", "1RECV_ACT3", "1SEND_GRAD9", "0RECV_GRAD9",
             "0UPDATE2", "1I3v0", "1W3v0", "0I12v4", "3DP_START1", "3DP_WAIT1", "0TIED_START5", "0TIED_WAIT5", "2NORM_START1", "2NORM_WAIT1"],
)
def test_action_round_trip(text):
    a = Action.parse(text)
    assert str(a) == text
    assert Action.parse(str(a)) == a


def test_action_fields():
    a = Action.parse("1F3v0")
    assert (a.stage, a.kind, a.index, a.version) == (1, Kind.F, 3, 0)
    assert a.microbatch == 3 and a.batch is None
    assert Action.parse("0UPDATE2").batch == 2 and Action.parse("0UPDATE2").microbatch is None
    assert Action.parse("0SEND_ACT3").peer == 1 and Action.parse("1SEND_GRAD3").peer == 0
    assert Action.parse("0SEND_ACT3").counterpart() == Action.parse("1RECV_ACT3")
    assert Action.parse("0RECV_GRAD3").counterpart() == Action.parse("1SEND_GRAD3")
    assert repr([Action(0, Kind.B, 2, 1)]) == "[0B2v1]"


@pytest.mark.parametrize("text", ["F3", "1X3", "1F", "1f3", "1F3v", "1F3 v0"])
def test_action_parse_rejects(text):
    with pytest.raises(ScheduleError, match="cannot parse action .*expected '<stage><KIND><index>"):
        Action.parse(text)


def test_every_generated_action_round_trips():
    for a in itertools.chain.from_iterable(
        generate("2bw", 3, 4, 3, width=2, tied=True, clip=True, recompute=True).values()
    ):
        assert Action.parse(str(a)) == a


# ---------------------------------------------------------------------------------------------
# Literal schedules (F/R/B/UPDATE skeleton per stage), as torchgpipe tests its clock cycles

LITERAL = {
    ("gpipe", 2, 2, 1): [
        "0F1v0 0F2v0 0B1v0 0B2v0 0UPDATE1",
        "1F1v0 1F2v0 1B1v0 1B2v0 1UPDATE1",
    ],
    ("gpipe", 2, 4, 1): [
        "0F1v0 0F2v0 0F3v0 0F4v0 0B1v0 0B2v0 0B3v0 0B4v0 0UPDATE1",
        "1F1v0 1F2v0 1F3v0 1F4v0 1B1v0 1B2v0 1B3v0 1B4v0 1UPDATE1",
    ],
    ("gpipe", 4, 8, 1): [
        f"{s}F1v0 {s}F2v0 {s}F3v0 {s}F4v0 {s}F5v0 {s}F6v0 {s}F7v0 {s}F8v0 "
        f"{s}B1v0 {s}B2v0 {s}B3v0 {s}B4v0 {s}B5v0 {s}B6v0 {s}B7v0 {s}B8v0 {s}UPDATE1"
        for s in range(4)
    ],
    ("gpipe", 2, 2, 2): [
        "0F1v0 0F2v0 0B1v0 0B2v0 0UPDATE1 0F3v1 0F4v1 0B3v1 0B4v1 0UPDATE2",
        "1F1v0 1F2v0 1B1v0 1B2v0 1UPDATE1 1F3v1 1F4v1 1B3v1 1B4v1 1UPDATE2",
    ],
    ("1f1b", 2, 2, 1): [
        "0F1v0 0F2v0 0B1v0 0B2v0 0UPDATE1",
        "1F1v0 1B1v0 1F2v0 1B2v0 1UPDATE1",
    ],
    ("1f1b", 2, 4, 1): [
        "0F1v0 0F2v0 0B1v0 0F3v0 0B2v0 0F4v0 0B3v0 0B4v0 0UPDATE1",
        "1F1v0 1B1v0 1F2v0 1B2v0 1F3v0 1B3v0 1F4v0 1B4v0 1UPDATE1",
    ],
    ("1f1b", 4, 8, 1): [
        "0F1v0 0F2v0 0F3v0 0F4v0 0B1v0 0F5v0 0B2v0 0F6v0 0B3v0 0F7v0 0B4v0 0F8v0 0B5v0 0B6v0 0B7v0 0B8v0 0UPDATE1",
        "1F1v0 1F2v0 1F3v0 1B1v0 1F4v0 1B2v0 1F5v0 1B3v0 1F6v0 1B4v0 1F7v0 1B5v0 1F8v0 1B6v0 1B7v0 1B8v0 1UPDATE1",
        "2F1v0 2F2v0 2B1v0 2F3v0 2B2v0 2F4v0 2B3v0 2F5v0 2B4v0 2F6v0 2B5v0 2F7v0 2B6v0 2F8v0 2B7v0 2B8v0 2UPDATE1",
        "3F1v0 3B1v0 3F2v0 3B2v0 3F3v0 3B3v0 3F4v0 3B4v0 3F5v0 3B5v0 3F6v0 3B6v0 3F7v0 3B7v0 3F8v0 3B8v0 3UPDATE1",
    ],
    ("1f1b", 2, 2, 2): [  # flush: the second step starts over with the warm-up
        "0F1v0 0F2v0 0B1v0 0B2v0 0UPDATE1 0F3v1 0F4v1 0B3v1 0B4v1 0UPDATE2",
        "1F1v0 1B1v0 1F2v0 1B2v0 1UPDATE1 1F3v1 1B3v1 1F4v1 1B4v1 1UPDATE2",
    ],
    ("zb", 2, 4, 1): [  # ZB-H1: stage 1 defers W1 to the cool-down; the steady state's backwards whole
        "0F1v0 0F2v0 0B1v0 0F3v0 0B2v0 0F4v0 0I3v0 0W3v0 0I4v0 0W4v0 0UPDATE1",
        "1F1v0 1I1v0 1F2v0 1B2v0 1F3v0 1B3v0 1F4v0 1I4v0 1W1v0 1W4v0 1UPDATE1",
    ],
    ("zb", 4, 4, 1): [  # stage i defers up to i weight passes: d = 4 micro-batches in flight on every stage
        "0F1v0 0F2v0 0F3v0 0F4v0 0I1v0 0W1v0 0I2v0 0W2v0 0I3v0 0W3v0 0I4v0 0W4v0 0UPDATE1",
        "1F1v0 1F2v0 1F3v0 1I1v0 1F4v0 1I2v0 1W1v0 1I3v0 1W2v0 1I4v0 1W3v0 1W4v0 1UPDATE1",
        "2F1v0 2F2v0 2I1v0 2F3v0 2I2v0 2F4v0 2I3v0 2W1v0 2I4v0 2W2v0 2W3v0 2W4v0 2UPDATE1",
        "3F1v0 3I1v0 3F2v0 3I2v0 3F3v0 3I3v0 3F4v0 3I4v0 3W1v0 3W2v0 3W3v0 3W4v0 3UPDATE1",
    ],
    ("zb", 2, 2, 2): [  # flush: every W of batch 1 before UPDATE1, the second step starts over
        "0F1v0 0F2v0 0I1v0 0W1v0 0I2v0 0W2v0 0UPDATE1 0F3v1 0F4v1 0I3v1 0W3v1 0I4v1 0W4v1 0UPDATE2",
        "1F1v0 1I1v0 1F2v0 1I2v0 1W1v0 1W2v0 1UPDATE1 1F3v1 1I3v1 1F4v1 1I4v1 1W3v1 1W4v1 1UPDATE2",
    ],
    ("2bw", 2, 2, 3): [  # docs/design.md: F1[0] F2[0] B1[0] F3[0] B2[0] → W1 | F4[0] B3[0] F5[1] B4[0] → W2 | …
        "0F1v0 0F2v0 0B1v0 0F3v0 0B2v0 0UPDATE1 0F4v0 0B3v0 0F5v1 0B4v0 0UPDATE2 0F6v1 0B5v1 0B6v1 0UPDATE3",
        "1F1v0 1B1v0 1F2v0 1B2v0 1UPDATE1 1F3v0 1B3v0 1F4v0 1B4v0 1UPDATE2 1F5v1 1B5v1 1F6v1 1B6v1 1UPDATE3",
    ],
    ("2bw", 2, 4, 3): [
        "0F1v0 0F2v0 0B1v0 0F3v0 0B2v0 0F4v0 0B3v0 0F5v0 0B4v0 0UPDATE1 0F6v0 0B5v0 0F7v0 0B6v0 0F8v0 0B7v0 "
        "0F9v1 0B8v0 0UPDATE2 0F10v1 0B9v1 0F11v1 0B10v1 0F12v1 0B11v1 0B12v1 0UPDATE3",
        "1F1v0 1B1v0 1F2v0 1B2v0 1F3v0 1B3v0 1F4v0 1B4v0 1UPDATE1 1F5v0 1B5v0 1F6v0 1B6v0 1F7v0 1B7v0 1F8v0 "
        "1B8v0 1UPDATE2 1F9v1 1B9v1 1F10v1 1B10v1 1F11v1 1B11v1 1F12v1 1B12v1 1UPDATE3",
    ],
    ("2bw", 4, 8, 2): [
        "0F1v0 0F2v0 0F3v0 0F4v0 0B1v0 0F5v0 0B2v0 0F6v0 0B3v0 0F7v0 0B4v0 0F8v0 0B5v0 0F9v0 0B6v0 0F10v0 0B7v0 "
        "0F11v0 0B8v0 0UPDATE1 0F12v0 0B9v0 0F13v0 0B10v0 0F14v0 0B11v0 0F15v0 0B12v0 0F16v0 0B13v0 0B14v0 "
        "0B15v0 0B16v0 0UPDATE2",
        "1F1v0 1F2v0 1F3v0 1B1v0 1F4v0 1B2v0 1F5v0 1B3v0 1F6v0 1B4v0 1F7v0 1B5v0 1F8v0 1B6v0 1F9v0 1B7v0 1F10v0 "
        "1B8v0 1UPDATE1 1F11v0 1B9v0 1F12v0 1B10v0 1F13v0 1B11v0 1F14v0 1B12v0 1F15v0 1B13v0 1F16v0 1B14v0 "
        "1B15v0 1B16v0 1UPDATE2",
        "2F1v0 2F2v0 2B1v0 2F3v0 2B2v0 2F4v0 2B3v0 2F5v0 2B4v0 2F6v0 2B5v0 2F7v0 2B6v0 2F8v0 2B7v0 2F9v0 2B8v0 "
        "2UPDATE1 2F10v0 2B9v0 2F11v0 2B10v0 2F12v0 2B11v0 2F13v0 2B12v0 2F14v0 2B13v0 2F15v0 2B14v0 2F16v0 "
        "2B15v0 2B16v0 2UPDATE2",
        "3F1v0 3B1v0 3F2v0 3B2v0 3F3v0 3B3v0 3F4v0 3B4v0 3F5v0 3B5v0 3F6v0 3B6v0 3F7v0 3B7v0 3F8v0 3B8v0 "
        "3UPDATE1 3F9v0 3B9v0 3F10v0 3B10v0 3F11v0 3B11v0 3F12v0 3B12v0 3F13v0 3B13v0 3F14v0 3B14v0 3F15v0 "
        "3B15v0 3F16v0 3B16v0 3UPDATE2",
    ],
}


@pytest.mark.parametrize("key", sorted(LITERAL), ids=lambda k: "-".join(map(str, k)))
def test_literal_compute_order(key):
    schedule, d, m, steps = key
    lists = generate(schedule, d, m, steps)
    assert [compute_only(lists[s]) for s in range(d)] == LITERAL[key]
    validate(lists, schedule, d, m, steps)


def _design_notation(actions):
    """Render a list the way the design writes it: ``F1[0] ... → W1 | ...``."""
    out = []
    for a in actions:
        if a.kind in (Kind.F, Kind.B):
            out.append(f"{a.kind.value}{a.index}[{a.version}]")
        elif a.kind is Kind.UPDATE:
            out.append(f"→ W{a.index} |")
    return " ".join(out)


def test_design_md_2bw_example_literally():
    lists = generate("2bw", 2, 2, 3)
    assert _design_notation(lists[0]).startswith(
        "F1[0] F2[0] B1[0] F3[0] B2[0] → W1 | F4[0] B3[0] F5[1] B4[0] → W2 |"
    )
    assert _design_notation(lists[1]).startswith(
        "F1[0] B1[0] F2[0] B2[0] → W1 | F3[0] B3[0] F4[0] B4[0] → W2 | F5[1] B5[1] F6[1] B6[1] → W3 |"
    )


def test_full_lists_with_p2p_2bw():
    # Step 1 ends where stage 0 first needs batch 2's data (before F3). Stage 1 sends GRAD2
    # within step 1, so stage 0 posts RECV_GRAD2 before its END_STEP1 too; stage 1's RECV_ACT3
    # waits until after its own END_STEP1: stopping there leaves no post unmatched.
    lists = generate("2bw", 2, 2, 2)
    assert " ".join(map(str, lists[0])) == (
        "0F1v0 0SEND_ACT1 0F2v0 0SEND_ACT2 0RECV_GRAD1 0RECV_GRAD2 0B1v0 0LOSS1 0END_STEP1 0F3v0 0SEND_ACT3 0B2v0 "
        "0UPDATE1 0F4v0 0SEND_ACT4 0RECV_GRAD3 0RECV_GRAD4 0B3v0 0LOSS2 0END_STEP2 0B4v0 0UPDATE2"
    )
    assert " ".join(map(str, lists[1])) == (
        "1RECV_ACT1 1RECV_ACT2 1F1v0 1B1v0 1SEND_GRAD1 1F2v0 1B2v0 1SEND_GRAD2 1UPDATE1 1LOSS1 1END_STEP1 "
        "1RECV_ACT3 1RECV_ACT4 1F3v0 1B3v0 1SEND_GRAD3 1F4v0 1B4v0 1SEND_GRAD4 1UPDATE2 1LOSS2 1END_STEP2"
    )


def test_full_lists_with_p2p_gpipe():
    lists = generate("gpipe", 2, 2, 1)
    assert " ".join(map(str, lists[0])) == (
        "0F1v0 0SEND_ACT1 0F2v0 0SEND_ACT2 0RECV_GRAD1 0RECV_GRAD2 0B1v0 0B2v0 0UPDATE1 0LOSS1 0END_STEP1"
    )
    assert " ".join(map(str, lists[1])) == (
        "1RECV_ACT1 1RECV_ACT2 1F1v0 1F2v0 1B1v0 1SEND_GRAD1 1B2v0 1SEND_GRAD2 1UPDATE1 1LOSS1 1END_STEP1"
    )


def test_reductions_recompute_and_their_window_2bw():
    lists = generate("2bw", 2, 2, 2, width=2, tied=True, clip=True, recompute=[False, True])
    # The cross-stage collectives sit at cuts that every channel respects: ACT3 is posted before
    # TIED_START1 on both ranks, GRAD4 after NORM_START1 on both (NCCL's rule (b)).
    assert " ".join(map(str, lists[0])) == (
        "0F1v0 0SEND_ACT1 0F2v0 0SEND_ACT2 0RECV_GRAD1 0RECV_GRAD2 0B1v0 0LOSS1 0END_STEP1 0F3v0 0SEND_ACT3 0B2v0 "
        "0DP_START1 0TIED_START1 0F4v0 0SEND_ACT4 0RECV_GRAD3 0B3v0 0DP_WAIT1 0TIED_WAIT1 0NORM_START1 "
        "0RECV_GRAD4 0LOSS2 0END_STEP2 0B4v0 0NORM_WAIT1 0UPDATE1 "
        "0DP_START2 0TIED_START2 0DP_WAIT2 0TIED_WAIT2 0NORM_START2 0NORM_WAIT2 0UPDATE2"
    )
    assert " ".join(map(str, lists[1])) == (
        "1RECV_ACT1 1RECV_ACT2 1F1v0 1R1v0 1B1v0 1SEND_GRAD1 1F2v0 1R2v0 1B2v0 1SEND_GRAD2 1DP_START1 "
        "1LOSS1 1END_STEP1 1RECV_ACT3 1TIED_START1 1RECV_ACT4 1F3v0 1R3v0 1B3v0 1SEND_GRAD3 1DP_WAIT1 1TIED_WAIT1 "
        "1NORM_START1 1F4v0 1R4v0 1B4v0 1SEND_GRAD4 1NORM_WAIT1 1UPDATE1 "
        "1DP_START2 1LOSS2 1END_STEP2 1TIED_START2 1DP_WAIT2 1TIED_WAIT2 1NORM_START2 1NORM_WAIT2 1UPDATE2"
    )
    # The recomputing stage runs R k right before B k; batch 1's reductions overlap F3/B3/F4/B4.
    assert compute_only(lists[1]) == (
        "1F1v0 1R1v0 1B1v0 1F2v0 1R2v0 1B2v0 1F3v0 1R3v0 1B3v0 1F4v0 1R4v0 1B4v0 1UPDATE1 1UPDATE2"
    )
    validate(lists, "2bw", 2, 2, 2, width=2, tied=True, clip=True, recompute=[False, True])


def test_width_one_has_no_dp_and_untied_has_no_tied_reduction():
    kinds = {a.kind for lst in generate("2bw", 3, 3, 2).values() for a in lst}
    assert not kinds & {Kind.DP_START, Kind.DP_WAIT, Kind.TIED_START, Kind.NORM_START, Kind.R}
    lists = generate("1f1b", 3, 3, 2, tied=True)
    assert [any(a.kind is Kind.TIED_START for a in lists[s]) for s in range(3)] == [True, False, True]


def test_version_rule():
    m = 3
    assert [version_of("2bw", k, m) for k in range(1, 13)] == [0, 0, 0, 0, 0, 0, 1, 1, 1, 2, 2, 2]
    assert [version_of("1f1b", k, m) for k in range(1, 10)] == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    assert [batch_of(k, m) for k in (1, 3, 4, 9)] == [1, 1, 2, 3]
    lists = generate("2bw", 4, 4, 5)
    for s, lst in lists.items():
        for a in lst:
            if a.kind in (Kind.F, Kind.B):
                assert a.version == max((a.index - 1) // 4 - 1, 0), (s, a)


def test_rank_mapping():
    d, w = 4, 3
    assert [rank_of(s, r, d) for r in range(w) for s in range(d)] == list(range(12))
    assert stage_and_replica(6, d) == (2, 1)
    lists = generate("1f1b", d, 4, 1, width=w)
    by_rank = actions_by_rank(lists, w)
    assert sorted(by_rank) == list(range(12))
    assert by_rank[6] == by_rank[2] == lists[2]  # replica-major: rank = replica * d + stage
    by_rank = actions_by_rank(lists, w, layout="stage")
    assert sorted(by_rank) == list(range(12)) and by_rank[6] == by_rank[7] == lists[2]  # rank = stage * w + replica


def test_generate_errors():
    with pytest.raises(ScheduleError, match=r"2bw needs at least as many micro-batches as stages \(m >= d\), found m=2 < d=4"):
        generate("2bw", 4, 2, 1)
    with pytest.raises(ScheduleError, match="unknown schedule 'zb2': expected one of 2bw, 1f1b, gpipe, zb"):
        generate("zb2", 2, 2)
    with pytest.raises(ScheduleError, match="recompute needs one bool per stage: expected 3, found 2"):
        generate("1f1b", 3, 3, recompute=[True, False])


CASES = [(2, 2, 3), (2, 4, 2), (4, 8, 2), (3, 5, 3), (4, 4, 3), (1, 3, 2), (5, 5, 2)]
OPTIONS = [{}, {"width": 2}, {"tied": True}, {"clip": True}, {"recompute": True},
           {"width": 2, "tied": True, "clip": True, "recompute": True}]


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_generated_lists_validate(schedule):
    for (d, m, steps), opts in itertools.product(CASES, OPTIONS):
        lists = generate(schedule, d, m, steps, **opts)
        validate(lists, schedule, d, m, steps, **opts)


@pytest.mark.parametrize("schedule", ["2bw", "1f1b"])
def test_lookahead_lists_validate_and_hold_one_more_micro_batch_per_unit(schedule):
    # Every stage but the last runs `lookahead` forwards ahead of 1F1B's order; the validator
    # (NCCL's matching rules replayed, both weight-version rules) accepts every such list, and
    # counts the extra micro-batches: told lookahead=0, it rejects them.
    for (d, m, steps), opts, lookahead in itertools.product(CASES + [(2, 6, 3), (3, 7, 2)], OPTIONS, (1, 2)):
        if schedule == "2bw" and m < d + lookahead:
            continue
        lists = generate(schedule, d, m, steps, lookahead=lookahead, **opts)
        validate(lists, schedule, d, m, steps, lookahead=lookahead, **opts)
        for s in range(d):
            peak = held = 0
            for a in lists[s]:
                held += (a.kind is Kind.F) - (a.kind is Kind.B)
                peak = max(peak, held)
            ahead = d - s + (lookahead if s < d - 1 else 0)
            assert peak == (ahead if schedule == "2bw" else min(ahead, m)), (d, m, opts, lookahead, s)
        if d > 1 and m > d:
            with pytest.raises(ScheduleError, match="micro-batches of activations in flight, expected at most"):
                validate(lists, schedule, d, m, steps, **opts)


def test_lookahead_order_and_errors():
    # stage 0 runs one forward more before its first backward; the last stage is 1F1B's; the
    # numbers' order (each stage's backwards, every weight version) is unchanged
    lists = generate("2bw", 2, 4, 2, lookahead=1)
    assert compute_only(lists[0]).startswith("0F1v0 0F2v0 0F3v0 0B1v0 0F4v0 0B2v0 0F5v0 0B3v0 0F6v0 0B4v0 0UPDATE1")
    assert compute_only(lists[1]) == compute_only(generate("2bw", 2, 4, 2)[1])
    plain = generate("2bw", 2, 4, 2)
    for s in range(2):
        for kind in (Kind.B, Kind.UPDATE):
            assert [a for a in lists[s] if a.kind is kind] == [a for a in plain[s] if a.kind is kind]
    with pytest.raises(ScheduleError, match=r"lookahead=1 runs forwards ahead of 1F1B's order, which only 2bw and "
                                            r"1f1b follow; found schedule='zb': pass lookahead=0"):
        generate("zb", 2, 4, lookahead=1)
    with pytest.raises(ScheduleError, match=r"lookahead must be an int >= 0, found -1"):
        generate("2bw", 2, 4, lookahead=-1)
    with pytest.raises(ScheduleError, match=r"2bw with lookahead=2 needs m >= d \+ lookahead micro-batches, found "
                                            r"m=3 with d=2: pass microbatches=4 or more, or lookahead=1"):
        generate("2bw", 2, 3, lookahead=2)


def test_1f1b_with_fewer_microbatches_than_stages():
    lists = generate("1f1b", 4, 2, 2)
    validate(lists, "1f1b", 4, 2, 2)
    assert compute_only(lists[0]) == "0F1v0 0F2v0 0B1v0 0B2v0 0UPDATE1 0F3v1 0F4v1 0B3v1 0B4v1 0UPDATE2"
    assert compute_only(lists[3]) == "3F1v0 3B1v0 3F2v0 3B2v0 3UPDATE1 3F3v1 3B3v1 3F4v1 3B4v1 3UPDATE2"


# ---------------------------------------------------------------------------------------------
# Planted errors


def _lists(schedule="2bw", d=2, m=2, steps=3, **opts):
    return {s: list(v) for s, v in generate(schedule, d, m, steps, **opts).items()}


def _swap(lst, a, b):
    i, j = lst.index(Action.parse(a)), lst.index(Action.parse(b))
    lst[i], lst[j] = lst[j], lst[i]


def _move_before(lst, moved, anchor):
    a = Action.parse(moved)
    lst.remove(a)
    lst.insert(lst.index(Action.parse(anchor)), a)


def test_planted_swap_f_b():
    lists = _lists()
    _swap(lists[1], "1F2v0", "1B2v0")
    with pytest.raises(ScheduleError, match=r"1B2v0 at position \d+ on stage 1 \(rank 1\): backward of micro-batch 2 before its forward") as info:
        validate(lists, "2bw", 2, 2, 3)
    assert "*1B2v0*" in str(info.value)  # the grid excerpt marks the failing cell


def test_planted_dropped_recv():
    lists = _lists()
    lists[1].remove(Action.parse("1RECV_ACT3"))
    with pytest.raises(ScheduleError, match="1F3v0 .* on stage 1 .*no RECV_ACT3 posted before the forward that consumes it. Insert 1RECV_ACT3"):
        validate(lists, "2bw", 2, 2, 3)


def test_planted_wrong_version():
    lists = _lists()
    i = lists[1].index(Action.parse("1F3v0"))
    lists[1][i] = Action.parse("1F3v1")
    with pytest.raises(ScheduleError, match=re.escape("micro-batch 3 uses version 1, expected 0 (2bw: max(floor((k-1)/m) - 1, 0), m=2)")):
        validate(lists, "2bw", 2, 2, 3)


def test_planted_three_versions_alive():
    lists = _lists()
    _move_before(lists[0], "0UPDATE2", "0B4v0")  # W(2) while F4 (W0) and F5 (W1) are in flight
    with pytest.raises(ScheduleError, match=re.escape("0UPDATE2 at position") + r".*3 weight versions alive after it \(W\(0\), W\(1\), W\(2\)\), expected at most 2 for 2bw"):
        validate(lists, "2bw", 2, 2, 3)


def test_planted_reduction_waited_too_late():
    opts = {"width": 2}
    lists = _lists(**opts)
    _move_before(lists[0], "0UPDATE1", "0DP_WAIT1")
    with pytest.raises(ScheduleError, match=r"0UPDATE1 at position \d+ on stage 0 \(ranks 0, 2\): DP_START1 \(position \d+\) is not waited for before UPDATE1. Insert 0DP_WAIT1"):
        validate(lists, "2bw", 2, 2, 3, **opts)


def test_planted_send_before_its_forward():
    lists = _lists()
    _move_before(lists[0], "0SEND_ACT2", "0F2v0")
    with pytest.raises(ScheduleError, match=r"0SEND_ACT2 at position \d+ on stage 0 \(rank 0\): sends micro-batch 2 "
                                            r"before 0F2 produced it. Move it after 0F2"):
        validate(lists, "2bw", 2, 2, 3)


def test_planted_reduction_waited_before_it_started():
    opts = {"width": 2}
    lists = _lists(**opts)
    _move_before(lists[1], "1DP_WAIT1", "1DP_START1")
    with pytest.raises(ScheduleError, match=r"1DP_WAIT1 at position \d+ on stage 1 \(ranks 1, 3\): waits for "
                                            r"DP_START1, which was not issued before. Insert 1DP_START1 after the last "
                                            r"backward of batch 1"):
        validate(lists, "2bw", 2, 2, 3, **opts)


def test_planted_update_after_the_forward_that_needs_it():
    lists = _lists(schedule="1f1b")
    _move_before(lists[0], "0UPDATE1", "0B4v1")
    with pytest.raises(ScheduleError, match=r"0F3v1 .*version 1 is not alive here \(newest produced: W\(0\)\). Run UPDATE1 before"):
        validate(lists, "1f1b", 2, 2, 3)


def test_planted_too_many_in_flight_1f1b():
    lists = _lists(schedule="1f1b", d=2, m=4, steps=1)
    _move_before(lists[1], "1F2v0", "1B1v0")
    _move_before(lists[1], "1RECV_ACT2", "1F2v0")
    with pytest.raises(ScheduleError, match=r"1F2v0 .*2 micro-batches of activations in flight, expected at most 1 \(1f1b on stage 1 of 2\)"):
        validate(lists, "1f1b", 2, 4, 1)


def test_planted_missing_reduction():
    lists = _lists(schedule="1f1b")
    with pytest.raises(ScheduleError, match=r"missing DP_START1 \(width=2"):
        validate(lists, "1f1b", 2, 2, 3, width=2)


def test_planted_p2p_order_mismatch():
    lists = _lists(schedule="gpipe", steps=1)
    _swap(lists[1], "1SEND_GRAD1", "1SEND_GRAD2")
    _swap(lists[1], "1B1v0", "1B2v0")
    with pytest.raises(ScheduleError, match=re.escape(
        "point-to-point order mismatch between ranks 1 and 0: rank 1: send to rank 0 (1SEND_GRAD2) is matched "
        "with rank 0: recv from rank 1 (0RECV_GRAD1)"
    )):
        validate(lists, "gpipe", 2, 2, 1)


def test_planted_deadlock():
    # Stage 1 posts the tied-weight sum before the gradient stage 0 receives ahead of it: gloo
    # would run this (it matches per direction and runs collectives on their own threads), NCCL
    # can hang on it. Stage 0 blocks in B2 on the receive, stage 1 on the sum's wait.
    opts = {"tied": True}
    lists = _lists(schedule="1f1b", steps=1, **opts)
    send = Action.parse("1SEND_GRAD2")
    lists[1].remove(send)
    lists[1].insert(lists[1].index(Action.parse("1TIED_START1")) + 1, send)
    with pytest.raises(ScheduleError, match=r"deadlock: stage 0 at 0B2v0 \(position \d+\); stage 1 at 1TIED_WAIT1 .*posts never "
                       r"completed: rank 0: recv from rank 1 \(0RECV_GRAD2\) waits: rank 1 first completes 1TIED_START1"):
        validate(lists, "1f1b", 2, 2, 1, **opts)


def test_planted_collective_order():
    opts = {"tied": True, "width": 2}
    lists = _lists(schedule="2bw", steps=3, **opts)
    lists[1] = [a for a in lists[1] if not (a.kind in (Kind.TIED_START, Kind.TIED_WAIT) and a.index == 1)]
    with pytest.raises(ScheduleError, match=r"missing TIED_START1"):
        validate(lists, "2bw", 2, 2, 3, **opts)
    # Stage 0's sum of batch 1 finds no partner; posts complete in order, so its ACT4 never goes.
    with pytest.raises(ScheduleError, match=re.escape(
        "posts never completed: rank 0: collective on group 'TIED_START' (0TIED_START1) waits: no matching post "
        "yet | rank 1: recv from rank 0 (1RECV_ACT4) waits: rank 0 first completes 0TIED_START1"
    )):
        validate(lists, "2bw", 2, 2, 3, width=2)


def _moved(lst, actions, j):
    """``lst`` with ``actions`` (adjacent in it) taken out and put back at position ``j``."""
    i = lst.index(actions[0])
    rest = lst[:i] + lst[i + len(actions):]
    return rest[:j] + list(actions) + rest[j:]


def test_planted_forward_of_the_next_batch_before_end_step():
    # 2bw's first stage runs batch 1's backwards after END_STEP1, never batch 2's forwards before it.
    lists = _lists(steps=2)
    end = [Action.parse("0LOSS1"), Action.parse("0END_STEP1")]
    lists[0] = _moved(lists[0], end, lists[0].index(Action.parse("0SEND_ACT3")) - 1)  # after F3
    with pytest.raises(ScheduleError, match=re.escape(
        "0F3v0 at position 7 on stage 0 (rank 0): forward of batch 2 before END_STEP1 (position 10): step 1 would "
        "run it before the caller passes batch 2. Move 0END_STEP1 (with its LOSS) right before the stage's first "
        "forward of batch 2"
    )):
        validate(lists, "2bw", 2, 2, 2)


def test_planted_forward_after_its_end_step():
    lists = _lists(schedule="1f1b", steps=2)
    end = [Action.parse("1LOSS1"), Action.parse("1END_STEP1")]
    lists[1] = _moved(lists[1], end, lists[1].index(Action.parse("1F2v0")))
    with pytest.raises(ScheduleError, match=re.escape(
        "1F2v0 at position 7 on stage 1 (rank 1): forward of batch 1 after END_STEP1 (position 6): step 1 would "
        "return before its forwards ran. Move 1END_STEP1 (with its LOSS) after the stage's last forward of batch 1"
    )):
        validate(lists, "1f1b", 2, 2, 2)


def test_planted_end_steps_out_of_order_or_without_their_loss():
    lists = _lists(schedule="gpipe", d=1, steps=2)
    i, j = (lists[0].index(Action.parse(f"0END_STEP{t}")) for t in (1, 2))
    lists[0][i], lists[0][j] = lists[0][j], lists[0][i]
    with pytest.raises(ScheduleError, match=re.escape(
        "0END_STEP2 at position 6 on stage 0 (rank 0): END_STEP2 where END_STEP1 next: expected END_STEP1..2, "
        "one per step, in order. Each step's segment ends once"
    )):
        validate(lists, "gpipe", 1, 2, 2)
    lists = _lists(schedule="zb", steps=2)
    lists[0].remove(Action.parse("0END_STEP1"))
    lists[0].insert(lists[0].index(Action.parse("0LOSS1")) - 1, Action.parse("0END_STEP1"))
    with pytest.raises(ScheduleError, match=re.escape(
        "0END_STEP1 at position 10 on stage 0 (rank 0): END_STEP1 is not directly preceded by LOSS1 (found 0W2v0). "
        "Put 0LOSS1 right before it"
    )):
        validate(lists, "zb", 2, 2, 2)
    lists = _lists(schedule="1f1b", steps=2)
    lists[1] = [a for a in lists[1] if a != Action.parse("1END_STEP2")]
    with pytest.raises(ScheduleError, match=re.escape("no END_STEP2: expected END_STEP1..2, one per step. Insert "
                                                      "1LOSS2 1END_STEP2")):
        validate(lists, "1f1b", 2, 2, 2)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_every_end_step_moved_across_a_forward_is_rejected(schedule):
    # The reviewer's sweep: END_STEP1 (alone, or with its LOSS) moved anywhere in one stage's
    # list; wherever a forward of batch 1 ends up after it or one of batch 2 before it, the
    # lists are rejected. The invariant, on every stage of every schedule (2bw's included):
    # END_STEP t-1 < every F of batch t < END_STEP t.
    for d in (1, 2, 3):
        m, base = max(d, 2), _lists(schedule, d, max(d, 2), 2)
        for s, lst in base.items():
            i = lst.index(Action(s, Kind.END_STEP, 1))
            for moved in (lst[i:i + 1], lst[i - 1:i + 1]):
                for j in range(len(lst) - len(moved) + 1):
                    new = _moved(lst, moved, j)
                    e = new.index(Action(s, Kind.END_STEP, 1))
                    if not any(a.kind is Kind.F and (batch_of(a.index, m) > 1) == (p < e) for p, a in enumerate(new)):
                        continue
                    with pytest.raises(ScheduleError):
                        validate({**base, s: new}, schedule, d, m, 2)


def test_planted_recompute_long_before_its_backward():
    # R k moved right after F k: every recomputed activation set is alive from F to B. The
    # compute right before B k (zb: B k or I k, zb_split) must be R k, whether or not recompute= is passed.
    for schedule, backward in (("1f1b", "B"), ("2bw", "B"), ("gpipe", "B"), ("zb", "B")):
        lists = _lists(schedule, d=2, m=4, steps=1, recompute=True)
        early = []
        for a in lists[0]:
            if a.kind is not Kind.R:
                early.append(a)
            if a.kind is Kind.F:
                early.append(a._replace(kind=Kind.R))
        lists[0] = early
        found = "0R4v0" if schedule == "gpipe" else "0R2v0"
        for recompute in (True, None):
            with pytest.raises(ScheduleError, match=re.escape(
                f"stage 0 recomputes, so {backward}1 must directly follow R1 (found {found} before it). Move 0R1 "
                f"right before it"
            )):
                validate(lists, schedule, 2, 4, 1, recompute=recompute)
    lists = _lists("1f1b", d=2, m=2, steps=1, recompute=True)
    _swap(lists[1], "1R2v0", "1B2v0")
    with pytest.raises(ScheduleError, match=re.escape("1R2v0 at position") + ".*recompute of micro-batch 2 after its "
                       "backward. Move it right before 1B2"):
        validate(lists, "1f1b", 2, 2, 1)


def test_validate_wrong_keys():
    with pytest.raises(ScheduleError, match=r"expected one action list per stage 0..2, found keys \[0, 1\]"):
        validate(_lists(), "2bw", 3, 3, 3)


# ---------------------------------------------------------------------------------------------
# Stream lowering


def test_lowering_waits_exactly_on_dependencies():
    lists = generate("2bw", 3, 3, 2, width=2, tied=True, clip=True)
    for s, lst in lists.items():
        ops = lower_to_streams(lst)
        assert [op.action for op in ops] == lst
        for op in ops:
            a = op.action
            if a.kind is Kind.F:
                assert op.stream == "compute"
                assert op.waits == ((f"{s}RECV_ACT{a.index}",) if s > 0 else ())
            elif a.kind is Kind.B:
                assert op.waits == ((f"{s}RECV_GRAD{a.index}",) if s < 2 else ())
            elif a.kind in (Kind.RECV_ACT, Kind.RECV_GRAD):
                assert op.waits == ()  # a receive waits on no compute at all
                assert op.stream == ("p2p_prev" if a.kind is Kind.RECV_ACT else "p2p_next")
            elif a.kind is Kind.SEND_ACT:
                assert op.stream == "p2p_next" and op.waits == (f"{s}F{a.index}v{version_of('2bw', a.index, 3)}",)
            elif a.kind is Kind.SEND_GRAD:
                assert op.stream == "p2p_prev" and op.waits == (f"{s}B{a.index}v{version_of('2bw', a.index, 3)}",)
            elif a.kind in (Kind.DP_START, Kind.TIED_START):
                assert op.stream == "reduce" and op.waits == (f"{s}B{3 * a.index}v{version_of('2bw', 3 * a.index, 3)}",)
            elif a.kind is Kind.NORM_START:
                assert op.stream == "reduce"
                assert set(op.waits) >= {f"{s}DP_START{a.index}"}
            elif a.kind in (Kind.DP_WAIT, Kind.TIED_WAIT, Kind.NORM_WAIT):
                assert op.stream == "compute" and op.waits == (f"{s}{a.kind.value.replace('WAIT', 'START')}{a.index}",)
            elif a.kind is Kind.UPDATE:
                assert op.stream == "compute" and op.waits == ()
            assert op.records == str(a)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_streams_run_every_schedule(schedule):
    # The simulator runs the lowered streams (the plan a CUDA rank carries out): every op runs,
    # and compute consumes what it receives only after the receive ran.
    lists = generate(schedule, 3, 3, 3, width=2, tied=True, clip=True, recompute=True)
    events = simulate(lists, Costs(1.0, 2.0, p2p=0.25, reduce=0.5, update=0.1)).events
    assert len(events) == sum(map(len, lists.values()))
    end = {(e.rank, e.action): e.end for e in events}
    for e in events:
        a = Action.parse(e.action)
        if a.kind is Kind.F and a.stage > 0:
            assert end[a.stage, f"{a.stage}RECV_ACT{a.index}"] <= e.start


def test_streams_communication_does_not_wait_for_unrelated_compute():
    # With stage 1's compute 100x slower, its receives of later micro-batches still complete
    # during its first forward: receives depend on no compute, only on their channel's order.
    events = simulate(generate("gpipe", 2, 4, 1), Costs(forward=[1.0, 100.0], backward=[1.0, 1.0])).events
    end = {e.action: e.end for e in events}
    assert end["1RECV_ACT4"] < end["1F1v0"]
    assert end["0SEND_ACT4"] < end["1F1v0"]


@pytest.mark.parametrize("d,m,width,tied,ahead", [(2, 4, 1, True, 0), (3, 6, 2, True, 0), (4, 8, 2, False, 0),
                                                  (3, 3, 1, True, 0), (2, 4, 1, False, 1), (3, 6, 2, True, 1),
                                                  (4, 8, 1, False, 2)])
def test_later_stages_post_the_norm_at_an_earlier_consistent_cut(d, m, width, tied, ahead):
    # Stage 0 waits for the norm right before F((t+1)m+1); stage s posts its part as many
    # forwards earlier as it runs behind stage 0 (s; with a lookahead, the last stage, which
    # runs none ahead, d - 1 + lookahead), not before stage 0 can have started a tied
    # all-reduce, so stage 0 does not wait for the last stage's final forward and backward of
    # the batch (with a lookahead: nor for the forwards it runs ahead). The lists stay deadlock-free.
    lists = generate("2bw", d, m, 4, width=width, tied=tied, clip=True, lookahead=ahead)
    validate(lists, "2bw", d, m, 4, width=width, tied=tied, clip=True, lookahead=ahead)
    for s, lst in lists.items():
        pos = {str(a): i for i, a in enumerate(lst)}
        behind = warmup(0, d, ahead) - warmup(s, d, ahead)
        assert behind == (s if s < d - 1 else d - 1 + ahead)
        for t in (1, 2):
            cut = (t + 1) * m + 1 - behind
            if tied and s > 0:
                cut = max(cut, t * m + d)
            first_f = (t + 1) * m + 1
            norm = pos[f"{s}NORM_START{t}"]
            assert norm < pos[f"{s}F{cut}v{version_of('2bw', cut, m)}"]
            assert pos[f"{s}UPDATE{t}"] < pos[f"{s}F{first_f}v{version_of('2bw', first_f, m)}"]
            joins_first = width > 1 or (tied and s == d - 1)  # else the norm is posted at the last B
            if s > 0 and cut < first_f and joins_first:
                assert pos[f"{s}F{cut - 1}v{version_of('2bw', cut - 1, m)}"] < norm  # not earlier than needed
