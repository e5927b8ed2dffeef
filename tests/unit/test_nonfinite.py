"""A NaN or infinite loss or gradient: found by the per-step norm all-reduce, agreed on by every
rank before any weight changes; ``nonfinite="raise"`` stops, ``"skip"`` drops the update."""

import math

import pytest
import torch

from fxpipe.errors import NonFiniteError
from fxpipe.runtime import StageWorker
from fxpipe.weights import WeightStore
from tests import resume

BAD = 3  # the batch whose gradient (or loss) is poisoned


def _snapshot(store: WeightStore, version: int) -> dict:
    state = {n: {k: v.clone() for k, v in st.items()} for n, st in store.optimizer_state().items()}
    weights = {dt: b.clone() for dt, b in store.slots[store.slot(version)].items()}
    return {"weights": weights, "optim": state, "steps": store.optimizer_steps}


def _same(a: dict, b: dict) -> bool:
    return (a["steps"] == b["steps"] and all(torch.equal(a["weights"][dt], b["weights"][dt]) for dt in a["weights"])
            and a["optim"].keys() == b["optim"].keys()
            and all(torch.equal(v, b["optim"][n][k]) for n, st in a["optim"].items() for k, v in st.items()))


@pytest.fixture
def poisoned_gradient(monkeypatch):
    """Stage 1 (of 3) writes a NaN into one weight gradient of batch BAD once its first backward
    of that batch has accumulated (after ``B``, or after ``W`` where zb split it:
    :func:`tests.resume.poisoning`); every UPDATE BAD records the store before and after."""
    seen = {}
    update = WeightStore.update

    def record(self, t, coef, *, skip=False):
        before = _snapshot(self, t - 1)
        update(self, t, coef, skip=skip)
        if t == BAD:
            seen.setdefault("updates", []).append((before, _snapshot(self, t)))

    monkeypatch.setattr(StageWorker, "_do_b", resume.poisoning(StageWorker._do_b, BAD))
    monkeypatch.setattr(StageWorker, "_do_w", resume.poisoning(StageWorker._do_w, BAD))
    monkeypatch.setattr(WeightStore, "update", record)
    return seen


@pytest.mark.parametrize("schedule", ["2bw", "1f1b", "gpipe", "zb"])
def test_raise_stops_every_rank_before_the_bad_update(poisoned_gradient, schedule):
    pipe = resume.compile(schedule, 3, 4, dropout=0.0)
    with pytest.raises(NonFiniteError, match=rf"in step {BAD}: stage\(s\) \[1\]\. No weight or optimizer state took it in"):
        for t in range(1, 8):
            pipe.step(*resume.batch(t))
    assert len(poisoned_gradient["updates"]) == 3  # every stage ran UPDATE BAD as a no-op
    assert all(_same(before, after) for before, after in poisoned_gradient["updates"])
    with pytest.raises(NonFiniteError):  # stopped
        pipe.step(*resume.batch(t + 1))
    # What it holds is bitwise the state of a clean run stopped after step BAD - 1.
    clean = resume.compile(schedule, 3, 4, dropout=0.0)
    for t in range(1, BAD):
        clean.step(*resume.batch(t))
    got, want = pipe.state_dict(), clean.state_dict()
    assert all(torch.equal(got[k], want[k]) for k in want)
    for wk, ref in zip(pipe.workers.values(), clean.workers.values()):
        assert _same(_snapshot(wk.store, wk.store.updates), _snapshot(ref.store, ref.store.updates))


@pytest.mark.parametrize("schedule, where", [("2bw", "flush"), ("1f1b", "eval_step"), ("gpipe", "save"), ("zb", "flush")])
def test_a_bad_batch_found_by_a_flush_then_load_resumes(poisoned_gradient, schedule, where, tmp_path):
    # The bad batch is the last before a flush, so its check runs in the drain: flush (or
    # eval_step, save, state_dict) raises. The drain was not marked done, and the load the
    # error asks for drained again: KeyError 11 (2bw), KeyError (TIED_START, 3) (1f1b, gpipe),
    # and on ranks, operations that cannot pair.
    pipe = resume.compile(schedule, 3, 4, dropout=0.0)
    for t in range(1, BAD):
        pipe.step(*resume.batch(t))
    pipe.save(str(tmp_path))
    pipe.step(*resume.batch(BAD))
    with pytest.raises(NonFiniteError, match=rf"in step {BAD}: stage\(s\) \[1\]"):
        {"flush": pipe.flush, "eval_step": lambda: pipe.eval_step(*resume.batch(BAD + 1)),
         "save": lambda: pipe.save(str(tmp_path / "again"))}[where]()
    assert pipe.load(str(tmp_path)) is None and pipe.steps == BAD - 1
    clean = resume.compile(schedule, 3, 4, dropout=0.0)
    for t in range(1, BAD):
        clean.step(*resume.batch(t))
    assert float(pipe.step(*resume.batch(BAD + 1))) == float(clean.step(*resume.batch(BAD + 1)))


def test_skip_drops_the_update_everywhere_and_trains_on(poisoned_gradient):
    pipe = resume.compile("2bw", 3, 4, dropout=0.0, nonfinite="skip")
    with pytest.warns(RuntimeWarning, match=rf"step {BAD}: stage\(s\) \[1\]; that update was skipped on every rank"):
        losses = [float(pipe.step(*resume.batch(t))) for t in range(1, BAD + 2)]
        # the last stage reduced batch BAD's norm during the next step: that norm is not finite
        step, norm = pipe.grad_norm
        assert step == BAD and math.isnan(norm)
        losses += [float(pipe.step(*resume.batch(t))) for t in range(BAD + 2, 8)]
    assert pipe.skipped_steps == [BAD]
    assert all(math.isfinite(x) for x in losses)
    pipe.flush()
    assert pipe.grad_norm[0] == 7 and math.isfinite(pipe.grad_norm[1])
    assert len(poisoned_gradient["updates"]) == 3 and all(_same(b, a) for b, a in poisoned_gradient["updates"])
    assert all(wk.store.optimizer_steps == wk.store.updates - 1 for wk in pipe.workers.values())


def test_a_rollback_forgets_the_skips_of_the_steps_it_undid(poisoned_gradient, tmp_path):
    # skipped_steps kept the undone steps' skips, and the retrained ones were added again
    pipe = resume.compile("1f1b", 3, 4, dropout=0.0, nonfinite="skip")
    for t in range(1, BAD):
        pipe.step(*resume.batch(t))
    pipe.save(str(tmp_path))
    pipe.wait_for_checkpoint()
    with pytest.warns(RuntimeWarning, match=rf"step {BAD}: stage\(s\) \[1\]"):
        for t in range(BAD, BAD + 2):
            pipe.step(*resume.batch(t))
        pipe.flush()
    assert pipe.skipped_steps == [BAD]
    pipe.load(str(tmp_path))
    assert pipe.skipped_steps == []
    with pytest.warns(RuntimeWarning, match=rf"step {BAD}: stage\(s\) \[1\]"):
        pipe.step(*resume.batch(BAD))
        pipe.flush()
    assert pipe.skipped_steps == [BAD]


def test_a_resumed_run_lists_the_skips_before_its_checkpoint(poisoned_gradient, tmp_path):
    # skipped_steps was not in the checkpoint: a run resumed after a skip listed none of it
    pipe = resume.compile("1f1b", 3, 4, dropout=0.0, nonfinite="skip")
    with pytest.warns(RuntimeWarning, match=rf"step {BAD}: stage\(s\) \[1\]"):
        for t in range(1, BAD + 2):
            pipe.step(*resume.batch(t))
    pipe.save(str(tmp_path))
    pipe.wait_for_checkpoint()
    resumed = resume.compile("1f1b", 3, 4, dropout=0.0, nonfinite="skip", lazy=True)
    resumed.load(str(tmp_path))
    assert resumed.skipped_steps == pipe.skipped_steps == [BAD]


def test_an_infinite_loss_with_finite_gradients_is_caught_too():
    # inf + loss: the gradient is that of the loss alone (finite); only the loss shows it.
    from fxpipe.demo import lm_loss

    def loss_fn(out, y):
        return lm_loss(out, y.clamp(min=0)) + (float("inf") if bool((y < 0).any()) else 0.0)

    pipe = resume.compile("1f1b", 3, 4, dropout=0.0, loss_fn=loss_fn, nonfinite="skip")
    with pytest.warns(RuntimeWarning, match=r"step 2: stage\(s\) \[2\]"):
        for t in range(1, 4):
            x, y = resume.batch(t)
            if t == 2:
                y = y.clone()
                y[0, 0] = -1
            pipe.step(x, y)
    assert pipe.skipped_steps == [2]
