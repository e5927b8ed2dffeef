"""The dumps show what runs: ``pipe.dump()`` draws the pipeline's own Program, ``fxpipe inspect``
what a default ``fxpipe.compile`` runs (both with the per-step norm all-reduce)."""

from __future__ import annotations

import functools
import re

import pytest
import torch
from torch import nn

import fxpipe
from fxpipe.errors import ConfigError
from fxpipe.inspect import inspect_pipeline
from fxpipe.schedule import format_actions


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))


def _actions(path) -> str:
    """The action-list grid of a schedule.txt / timeline.txt (the part before the timeline)."""
    return path.read_text().split("\n# timeline")[0].split("\n", 1)[1].strip()


def test_dump_draws_the_program_the_pipeline_runs(tmp_path):
    # max_grad_norm=None (the default): the pipeline still posts NORM_START/NORM_WAIT every step
    # (the non-finite check), which moves 2bw's UPDATEs; the dumps used to leave them out.
    pipe = fxpipe.compile(_model(), (torch.randn(2, 8),), loss_fn=nn.functional.mse_loss,
                          optimizer=functools.partial(torch.optim.SGD, lr=0.1), microbatches=2, schedule="2bw",
                          stages=2, verbose=False)
    assert pipe.config.max_grad_norm is None
    pipe.record = True
    for _ in range(2):
        pipe.step(torch.randn(4, 8), torch.randn(4, 4))
    pipe.flush()
    pipe.dump(str(tmp_path))
    runs = format_actions(pipe.program.lists(3)).strip()
    assert "0NORM_START1" in runs and "1NORM_WAIT1" in runs
    assert _actions(tmp_path / "schedule.txt") == runs
    assert _actions(tmp_path / "timeline.txt") == runs
    assert '"name": "0NORM_START1"' in (tmp_path / "schedule.json").read_text()


def test_inspect_draws_what_a_default_compile_runs(tmp_path):
    inspect_pipeline(_model(), (torch.randn(2, 8),), str(tmp_path / "inspect"), stages=2, microbatches=4)
    pipe = fxpipe.compile(_model(), (torch.randn(2, 8),), loss_fn=nn.functional.mse_loss, microbatches=4,
                          stages=2, verbose=False)
    pipe.dump(str(tmp_path / "dump"))
    drawn = _actions(tmp_path / "inspect" / "schedule.txt")
    assert "NORM_START1" in drawn
    assert drawn == _actions(tmp_path / "dump" / "schedule.txt") == format_actions(pipe.program.lists(3)).strip()


def test_inspect_titles_one_stage_and_one_micro_batch_in_the_singular(tmp_path):
    inspect_pipeline(_model(), (torch.randn(2, 8),), str(tmp_path), stages=1, microbatches=1, schedule="gpipe")
    svg = (tmp_path / "schedule.svg").read_text()
    assert "gpipe, 1 stage x 1 replica, 1 micro-batch of 2 per step</text>" in svg


@pytest.mark.parametrize("bad", [0, -2, 2.0])
def test_inspect_rejects_a_microbatch_count_below_one(tmp_path, bad):
    with pytest.raises(ConfigError, match=re.escape(
        f"microbatches must be an int >= 1 (micro-batches per step), found {bad!r}: pass a positive number, or "
        f"None for the default max(2 x stages, 4) = 6"
    )):
        inspect_pipeline(_model(), (torch.randn(2, 8),), str(tmp_path), stages=3, microbatches=bad)
    assert not (tmp_path / "schedule.svg").exists()


def test_cli_microbatches_help_and_zero(tmp_path, capsys):
    from fxpipe.cli import build_parser, main

    sub = next(a for a in build_parser()._actions if a.dest == "cmd").choices["inspect"]
    assert "micro-batches per step (default: max(2 x stages, 4))" in " ".join(sub.format_help().split())
    with pytest.raises(SystemExit) as e:
        main(["inspect", "fxpipe.demo:demo_factory", "--microbatches", "0", "--out", str(tmp_path / "out")])
    assert e.value.code == 2 and not (tmp_path / "out").exists()
    err = capsys.readouterr().err
    assert ("argument --microbatches: expected a positive integer, found 0 (micro-batches per step): pass "
            "--microbatches N with N >= 1, or leave it out for the default max(2 x stages, 4)") in err
