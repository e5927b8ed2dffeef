"""benchmarks/limit.py's arithmetic for the shares of the limit: each system's run against the
limit runs right before and right after it, and the ratios of medians printed beside them."""

import re

import pytest


@pytest.fixture
def limit(monkeypatch, request):
    monkeypatch.syspath_prepend(str(request.config.rootpath / "benchmarks"))
    import limit

    return limit


def _system(limit, rate: float, steps: int = 4) -> list[dict]:
    """A pipeline's two ranks, as limit.run returns them, training at ``rate`` samples/s."""
    samples = limit.BATCH * steps
    return [{"samples": samples, "seconds": samples / rate, "peak_mib": 600.0, "cpu": {"main": 1.0, "process": 1.0}}
            for _ in range(2)]


def _limit_run(limit, rate: float, steps: int = 4) -> list[dict]:
    """The limit's two trainers, each at half of ``rate``, side by side."""
    step = limit.BATCH / (rate / 2)
    stamps = [i * step for i in range(steps + 1)]
    return [{"samples": limit.BATCH * steps, "seconds": steps * step, "stamps": stamps, "peak_mib": 600.0,
             "cpu": {"main": 1.0, "process": 1.0}} for _ in range(2)]


def _row(out: str, label: str) -> list[str]:
    line = next(line for line in out.splitlines() if line.startswith(label))
    return re.findall(r"\d+\.\d+", line)


def test_a_share_is_of_the_mean_of_the_limit_runs_around_it(limit):
    assert limit.shares([30.0, 45.0], [(40.0, 20.0), (50.0, 40.0)]) == [1.0, 1.0]
    with pytest.raises(ValueError):
        limit.shares([30.0], [])


def test_the_table_gives_shares_of_the_bracketing_limits_and_the_ratios_of_medians_beside(limit, capsys):
    # one round: limit 40, GPipe 35, limit 30, 1F1B 25, limit 20 (the host slowing throughout)
    results = {"limit": [_limit_run(limit, r) for r in (40.0, 30.0, 20.0)],
               "pippy gpipe": [_system(limit, 35.0)], "pippy 1f1b": [_system(limit, 25.0)]}
    limit.report(results, {"pippy gpipe": [(40.0, 30.0)], "pippy 1f1b": [(30.0, 20.0)]})
    out = capsys.readouterr().out
    # samples/s, % of limit, vs PiPPy 1F1B: each run at the pace of the limit around it
    assert _row(out, "PiPPy ScheduleGPipe")[:3] == ["35.0", "100.0", "1.000"]
    assert _row(out, "PiPPy Schedule1F1B")[:3] == ["25.0", "100.0", "1.000"]
    assert _row(out, "physical limit")[:3] == ["30.0", "100.0", "1.000"]  # the median of its three runs
    # the same figures as ratios of the medians: against the limit's median, 30
    assert "PiPPy ScheduleGPipe 116.7%, 1.400x" in out and "PiPPy Schedule1F1B 83.3%, 1.000x" in out
    assert "limit runs right before and right after it" in out


def test_without_brackets_each_round_s_one_limit_run_stands_for_it(limit, capsys):
    results = {"limit": [_limit_run(limit, 40.0), _limit_run(limit, 20.0), _limit_run(limit, 30.0)],
               "pippy 1f1b": [_system(limit, r) for r in (36.0, 19.0, 24.0)]}
    limit.report(results)
    out = capsys.readouterr().out
    # shares 90%, 95% and 80%: their median, where the ratio of the medians reads 24 / 30
    assert _row(out, "PiPPy Schedule1F1B")[:2] == ["24.0", "90.0"]
    assert "PiPPy Schedule1F1B 80.0%, 1.000x" in out
    assert "its round's limit run" in out
    assert re.search(r"36\.0 \(90\.0%: 40\.0 / 40\.0\)", out)


def test_the_timed_steps_follow_one_untimed_step_after_the_warmup(limit):
    """After the warmup the ranks meet, and the step after that refills a pipeline the meeting
    drained: it is run but neither timed nor counted."""
    seen, timing = [], []
    batches = [(i, None) for i in range(6)]
    seconds, samples = limit._timed(lambda x, y: seen.append(x), batches, warmup=2,
                                    start=lambda: timing.append(len(seen)), batch=8)
    assert seen == list(range(6))
    assert timing == [3]  # warmup 0, 1; untimed 2; timed 3, 4, 5
    assert samples == 3 * 8 and seconds > 0


def test_the_cpu_table_sets_all_ranks_main_threads_against_one_limit_trainer(limit, capsys):
    results = {"limit": [_limit_run(limit, 40.0)], "pippy 1f1b": [_system(limit, 30.0)]}
    for trainer, main in zip(results["limit"][0], (1400.0, 1500.0)):
        trainer["cpu"] = {"main": main, "process": main}
    for rank, main in zip(results["pippy 1f1b"][0], (740.0, 782.5)):
        rank["cpu"] = {"main": main, "process": main + 10}
    limit.report(results, {"pippy 1f1b": [(40.0, 40.0)]})
    out = capsys.readouterr().out.split("CPU time per step")[1]
    assert "all ranks / a limit trainer" in out
    assert re.search(r"PiPPy Schedule1F1B \(baseline\)\s+740 / 750\s+782 / 792\s+1\.050", out)  # 1522.5 / 1450
    assert re.search(r"physical limit.*1400 / 1400\s+1500 / 1500\s+1\.000", out)


def test_the_report_turns_1f1b_s_replayed_bubble_into_its_ceiling_and_what_pippy_would_have_to_read(limit, capsys):
    def fxpipe_run(rate: float, idle: float) -> list[dict]:
        ranks = _system(limit, rate)
        for r in ranks:
            r.update(predicted=1.0, replayed=1.0, idle=idle, profile={"step": 1.0}, per_action=[], lookahead=0,
                     cores=None, stages=[])
        return ranks

    results = {"limit": [_limit_run(limit, 40.0)], "fxpipe 2bw": [fxpipe_run(38.0, 0.005)],
               "fxpipe 1f1b": [fxpipe_run(31.0, 0.2)], "fxpipe 1f1b chunks=2": [fxpipe_run(34.0, 0.12)],
               "pippy 1f1b": [_system(limit, 30.0)]}
    limit.report(results, {n: [(40.0, 40.0)] for n in results if n != "limit"})
    out = capsys.readouterr().out
    assert "fxpipe 2bw 0.5%; fxpipe 1f1b 20.0%; fxpipe 1f1b, chunks=2" in out
    # 1F1B's bubble leaves it 80% of the limit; 1.10x PiPPy's 75% would need 82.5%
    assert "fxpipe 1f1b with one stage per rank reaches at most about 80.0% of the limit here" in out
    assert "would need PiPPy's at or below 72.7% (it read 75.0%)" in out
    assert "In the replay: fxpipe 1f1b, chunks=2 (interleaved: 4 stages on 2 ranks) 12.0%." in out
