"""benchmarks/limit.py end to end on its smallest run (two ranks, two measured steps): the figures
it prints for an fxpipe schedule agree with each other. Its own arithmetic has no other test, and
a name reused in it once reported one action's time as the run's. And ``--runtime`` on one round."""

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
    # zb splits the backwards around its drain and runs the steady state's whole (zb_split)
    assert {(s, k) for s, k, _, _ in got["per_action"]} == {(s, k) for s in (0, 1)
                                                           for k in ("F", "B", "I", "W", "UPDATE")}
    assert all(sim > 0 and took > 0 for s, k, sim, took in got["per_action"] if (s, k) != (0, "I"))
    assert got["replayed"] == pytest.approx(wall_ms / 1e3, rel=0.5)
    assert got["predicted"] > 0 and got["lookahead"] == 0


def test_the_runtime_cost_sets_a_pipeline_step_against_an_eager_step_of_the_same_work(monkeypatch, request, capsys):
    monkeypatch.syspath_prepend(str(request.config.rootpath / "benchmarks"))
    import limit
    import torch

    threads = torch.get_num_threads()
    try:
        limit.runtime_cost(1, ("2bw",))
    finally:
        torch.set_num_threads(threads)
    rows = {line.split("  ")[0]: line.split()[-2:] for line in capsys.readouterr().out.splitlines()
            if line.startswith(("eager", "fxpipe"))}
    assert list(rows) == ["eager (a limit trainer's step)", "fxpipe 2bw, both stages in one process"]
    ms, ratio = map(float, rows["fxpipe 2bw, both stages in one process"])
    assert ms > 0
    # the same model, micro-batches and optimizer on one thread: a pipeline that ran a stage
    # twice, or skipped one, would read about 2 or 0.5 of the eager step
    assert 0.75 < ratio < 1.35
    assert rows["eager (a limit trainer's step)"][1] == "1.000"
