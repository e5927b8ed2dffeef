"""The dumps show what runs: ``pipe.dump()`` draws the pipeline's own Program, ``fxpipe inspect``
what a default ``fxpipe.compile`` runs (both with the per-step norm all-reduce)."""

from __future__ import annotations

import functools

import torch
from torch import nn

import fxpipe
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

