"""benchmarks/limit.py end to end on its smallest run (two ranks, two measured steps): the figures
it prints for an fxpipe schedule agree with each other. Its own arithmetic has no other test, and
a name reused in it once reported one action's time as the run's."""

import pytest

pytestmark = [pytest.mark.dist, pytest.mark.slow, pytest.mark.timeout(600)]


def test_an_fxpipe_run_reports_its_step_time_its_breakdown_and_a_replay_of_it(monkeypatch, request):
    monkeypatch.syspath_prepend(str(request.config.rootpath / "benchmarks"))  # spawned ranks inherit it
    import limit

    steps = 2
    ranks = limit.run("fxpipe zb", steps, 1)
    assert [r["samples"] for r in ranks] == [limit.BATCH * steps] * 2
    wall_ms = 1e3 * max(r["seconds"] for r in ranks) / steps
    for r in ranks:  # the same steps, timed by the loop and by fxpipe.profile
        assert r["profile"]["step"] == pytest.approx(wall_ms, rel=0.2)
    got = ranks[0]
    assert {(s, k) for s, k, _, _ in got["per_action"]} == {(s, k) for s in (0, 1) for k in ("F", "I", "W", "UPDATE")}
    assert all(sim > 0 and took > 0 for s, k, sim, took in got["per_action"] if (s, k) != (0, "I"))
    assert got["replayed"] == pytest.approx(wall_ms / 1e3, rel=0.5)
    assert got["predicted"] > 0 and got["lookahead"] == 0
