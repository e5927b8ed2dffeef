"""The SVG timelines read at a glance: unit on the axis, the window and its numbers in the title,
a legend of exactly the kinds drawn, a key to the labels, idle time summed per rank."""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET

import pytest
import torch
from torch import nn

from fxpipe.inspect import inspect_pipeline
from fxpipe.schedule import generate
from fxpipe.simulate import Costs, idle_by_rank, render_svg, simulate, timeline_from_events

SVG = "{http://www.w3.org/2000/svg}"


def _texts(svg: str) -> list[str]:
    return [t.text or "" for t in ET.fromstring(svg).iter(SVG + "text")]


def _legend(svg: str) -> set[str]:
    return {t.text for t in ET.fromstring(svg).iter(SVG + "text") if t.get("class") == "legend"}


def _idle_rows(svg: str, unit: str) -> list[tuple[float, float]]:
    """(idle time, idle %) printed under each rank's label."""
    rows = [re.fullmatch(rf"idle ([\d.]+) {unit} \(([\d.]+)%\)", t) for t in _texts(svg)]
    return [(float(r[1]), float(r[2])) for r in rows if r]


def _axis(svg: str) -> list[float]:
    """The tick values, left to right (the numbers printed right under the axis line)."""
    root = ET.fromstring(svg)
    axis = max(float(line.get("y1")) for line in root.iter(SVG + "line") if line.get("stroke") == "#333333")
    return [float(t.text) for t in root.iter(SVG + "text") if float(t.get("y")) == axis + 15]


def test_simulated_picture_says_its_unit_window_numbers_and_only_the_kinds_present():
    lists = generate("2bw", 2, 4, 3, clip=True)
    tl = simulate(lists, Costs(1.0, 2.0, p2p=0.25, reduce=0.5, update=0.5))
    svg = render_svg(tl, title="2bw d=2 m=4", width=2000)
    texts = _texts(svg)
    summary = texts[1]
    assert summary.startswith("steps 1-3, then the flush; ")
    assert f"makespan {tl.makespan:.4g} units" in summary and f"bubble {100 * tl.bubble:.1f}% (idle share" in summary
    assert any(t.startswith("time in abstract units (those of the simulator's Costs, not seconds)") for t in texts)
    ticks = _axis(svg)
    assert ticks[0] == 0 and ticks[1] - ticks[0] in (1, 2, 2.5, 5, 10) and ticks[-1] <= tl.makespan
    # No recomputation, no data parallelism, no tied weights: none of them in the legend.
    assert _legend(svg) == {"F forward", "B backward", "U optimizer step", "send/recv activations",
                            "send/recv gradients", "all-reduce: grad norm", "idle (hatched)"}
    # Micro-batches numbered within their step (batch 3's first is micro-batch 9 of the run).
    assert {"F1v0", "B4v0", "F1v1", "U1"} <= set(texts) and "F9v1" not in texts
    assert "key: F1v0 = forward of micro-batch 1 (of 4) of its step on weight version 0; " \
           "U1 = optimizer step with step 1's gradients; hatched = idle" in texts
    idle = _idle_rows(svg, "units")
    assert [i for i, _ in idle] == pytest.approx(list(idle_by_rank(tl).values()), rel=1e-3)
    assert sum(i for i, _ in idle) == pytest.approx(tl.bubble * 2 * tl.makespan, rel=1e-3)
    assert [p for _, p in idle] == pytest.approx([100 * i / tl.makespan for i, _ in idle], abs=0.06)


def test_legend_follows_the_kinds_present():
    tl = simulate(generate("1f1b", 2, 2, 1, width=2, recompute=[True, False], tied=[0, 1]),
                  Costs(1.0, 2.0, reduce=0.5))
    svg = render_svg(tl, unit="s")
    assert _legend(svg) == {"F forward", "R recomputed forward", "B backward", "U optimizer step (not priced: a tick)",
                            "all-reduce: DP grads, tied grads", "idle (hatched)"}
    assert any(t.startswith("time in ms since the window's start") for t in _texts(svg))
    assert "R1v0" in _texts(svg)


def _recorded(apart: bool):
    """A 2bw run of 6 steps, timed by the simulator, as recorded from step 5 on (each rank from its
    own step() call when ``apart``), 8.1 s into the run."""
    tl = simulate(generate("2bw", 2, 2, 6), Costs(0.004, 0.008, p2p=0.0005, update=0.001))
    begin = {e.rank: e.end for e in tl.events if e.action.endswith("END_STEP4")}
    if not apart:
        begin = dict.fromkeys(begin, min(begin.values()))
    events = [(e.rank, e.action, 8.1 + e.start, 8.1 + e.end) for e in tl.events
              if e.start >= begin[e.rank] and not e.action.endswith("END_STEP4")]
    return timeline_from_events(events, apart=apart)


@pytest.mark.parametrize("apart", [False, True])
def test_recorded_timeline_in_ms_from_the_windows_start(apart):
    tl = _recorded(apart)
    svg = render_svg(tl, title="recorded", microbatches=2, total_steps=6)
    texts = _texts(svg)
    t0 = min(e.start for e in tl.events)
    assert texts[1].startswith(f"steps 5-6 of 6, then the flush, t = {t0:.3f}-{t0 + tl.makespan:.3f} s of the run; ")
    assert f"makespan {1e3 * tl.makespan:.4g} ms" in texts[1]
    assert f"time in ms since the window's start (t = {t0:.3f} s of the run)" in texts
    ticks = _axis(svg)
    assert ticks[0] == 0 and ticks[-1] <= 1e3 * tl.makespan and len(ticks) >= 5
    assert {"F1v3", "B2v3", "U5", "U6"} <= set(texts)  # micro-batch 9 of the run = step 5's first
    # Idle per rank in ms and %, over the time each rank was recorded; they add up to the bubble.
    windows = [tl.window(r) for r in tl.ranks]
    idle = _idle_rows(svg, "ms")
    assert [i for i, _ in idle] == pytest.approx([1e3 * v for v in idle_by_rank(tl).values()], rel=1e-3)
    assert sum(i for i, _ in idle) == pytest.approx(1e3 * tl.bubble * sum(b - a for a, b in windows), rel=1e-3)
    assert [p for _, p in idle] == pytest.approx([1e-1 * i / (b - a) for (i, _), (a, b) in zip(idle, windows)],
                                                 abs=0.06)
    # Rank 1 starts its step 5 later than rank 0: with separate processes that lead-in is unknown.
    assert (windows[1][0] > windows[0][0]) is apart
    assert ("before this rank's first record" in svg) is apart
    assert "the ranks' recorded time" in texts[1] if apart else "2 ranks x makespan" in texts[1]


def test_inspect_schedule_picture_is_a_prediction_in_ms(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
    inspect_pipeline(model, (torch.randn(2, 8),), str(tmp_path), stages=2, microbatches=4)
    texts = _texts((tmp_path / "schedule.svg").read_text())
    assert texts[0] == ("schedule simulated with the plan's analytic costs (a prediction): "
                        "2bw (lookahead 1), 2 stages x 1 replica, 4 micro-batches of 2 per step")
    assert texts[1].startswith("steps 1-3, then the flush; makespan ") and " ms; bubble " in texts[1]
    assert "time in ms since the window's start" in texts
    assert any(t.startswith("key: F1v0 = forward of micro-batch 1 (of 4) of its step") for t in texts)
