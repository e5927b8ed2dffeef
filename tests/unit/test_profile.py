"""fxpipe.profile: where a step's time goes, in parts that add up to the step."""

import time

import pytest
import torch
from torch import nn

import fxpipe
from fxpipe.profile import CATEGORIES, Profile
from fxpipe.schedule import Kind


def test_parts_add_up_to_the_steps_wall_time():
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(64, 64), nn.Tanh()) for _ in range(4)])
    pipe = fxpipe.compile(model, (torch.randn(8, 64),), loss_fn=lambda out, y: (out - y).pow(2).mean(), stages=2,
                          microbatches=4, verbose=False)
    x, y = torch.randn(32, 64), torch.randn(32, 64)
    pipe.step(x, y)
    pipe.profile = Profile()
    walls = []
    for _ in range(3):
        t0 = time.perf_counter()
        pipe.step(x, y)
        walls.append(time.perf_counter() - t0)
    s = pipe.profile.summary()
    assert list(s) == [*CATEGORIES, "step"] and pipe.profile.steps == 3
    assert s["step"] == pytest.approx(sum(s[c] for c in CATEGORIES))
    assert s["step"] <= 1e3 * sum(walls) / 3 + 1e-6 and s["step"] > 0.9 * 1e3 * sum(walls) / 3
    assert s["compute"] > 0 and s["optimizer"] > 0 and s["runtime overhead"] > 0
    assert s["waiting on a peer"] == 0  # one process: the driver runs an action only once it can


def test_blocked_time_counts_as_waiting_wherever_it_happens():
    p = Profile()
    p.action(Kind.F, 0.010, 0.004)  # a forward that waited 4 ms for its activations
    p.action(Kind.NORM_WAIT, 0.003, 0.003)  # a join whose peers were late
    p.action(Kind.SEND_ACT, 0.001, 0.0)
    p.action(Kind.UPDATE, 0.002, 0.0)
    p.step(0.020, 0.009)  # 2 ms blocked after the segment (the loss read)
    s = p.summary()
    assert s == pytest.approx({"compute": 6.0, "waiting on a peer": 9.0, "communication not hidden": 1.0,
                               "optimizer": 2.0, "runtime overhead": 2.0, "step": 20.0})


def test_action_times_are_per_stage_and_kind_without_the_waits():
    p = Profile()
    p.action(Kind.F, 0.010, 0.004, 0)
    p.action(Kind.F, 0.008, 0.0, 0)
    p.action(Kind.B, 0.020, 0.0, 1)
    p.action(Kind.UPDATE, 0.002, 0.0, 1)
    p.action(Kind.SEND_ACT, 0.001, 0.0, 0)  # communication: not a compute time
    p.action(Kind.F, 0.5, 0.0)  # no stage given: counted in the summary only
    p.action(Kind.EVAL, 0.3, 0.0, 0)  # eval_step's forward: not a cost of training's schedule
    assert p.action_times() == pytest.approx({(0, Kind.F): 0.007, (1, Kind.B): 0.020, (1, Kind.UPDATE): 0.002})


def test_a_pipelines_profile_times_each_stages_actions():
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(64, 64), nn.Tanh()) for _ in range(4)])
    pipe = fxpipe.compile(model, (torch.randn(8, 64),), loss_fn=lambda out, y: (out - y).pow(2).mean(), stages=2,
                          microbatches=4, schedule="zb", verbose=False)
    x, y = torch.randn(32, 64), torch.randn(32, 64)
    pipe.step(x, y)
    pipe.profile = Profile()
    pipe.step(x, y)
    times = pipe.profile.action_times()
    # zb splits the backwards of the warm-up and the cool-down and runs the rest whole (zb_split)
    assert set(times) == {(s, k) for s in (0, 1) for k in (Kind.F, Kind.B, Kind.I, Kind.W, Kind.UPDATE)}
    assert all(t > 0 for t in times.values())
