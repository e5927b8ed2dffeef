"""Pipeline.save / Pipeline.load in one process: exact resume, resharding, and the errors."""

import os
import re
import warnings

import pytest
import torch

from fxpipe.errors import CheckpointError, FxpipeError
from tests import resume


def _equal(a: dict, b: dict) -> None:
    assert a["losses"] == b["losses"]
    assert a["state"].keys() == b["state"].keys()
    for k in a["state"]:
        assert torch.equal(a["state"][k], b["state"][k]), k


@pytest.mark.parametrize("schedule", ["2bw", "1f1b", "gpipe", "zb"])
def test_resume_is_bitwise_the_uninterrupted_run(tmp_path, schedule):
    # dropout, AdamW, a LambdaLR schedule and clipping; the resumed pipeline is compiled lazily
    full = resume.run(resume.compile(schedule, 2, 2), 0, 6)
    resume.run(resume.compile(schedule, 2, 2), 0, 3, save=str(tmp_path))
    resumed = resume.run(resume.compile(schedule, 2, 2, lazy=True), 3, 3, load=str(tmp_path))
    assert resumed["steps"] == 6
    _equal({"losses": full["losses"][3:], "state": full["state"]}, resumed)


def test_checkpoints_of_the_torch_and_the_fused_optimizer_load_into_each_other(tmp_path):
    # torch.optim -> fused kernels -> torch.optim: one format, so the optimizer state and both
    # weight versions come back bitwise, and the fused pipeline resumes where torch.optim stopped.
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    resume.run(resume.compile("2bw", 2, 2), 0, 3, save=str(tmp_path / "a"))
    fused = resume.compile("2bw", 2, 2, kernels="torch")
    fused.load(str(tmp_path / "a"))
    fused.save(str(tmp_path / "b"))
    fused.wait_for_checkpoint()  # another pipeline reads it
    torch_again = resume.compile("2bw", 2, 2)
    torch_again.load(str(tmp_path / "b"))
    torch_again.save(str(tmp_path / "c"))
    torch_again.wait_for_checkpoint()
    files = {}
    for name in "abc":
        dcp_to_torch_save(tmp_path / name / "step-00000003", tmp_path / f"{name}.pt")
        files[name] = torch.load(tmp_path / f"{name}.pt", weights_only=False)
    a, b, c = files["a"], files["b"], files["c"]
    assert a["optim"]["state"]["blocks.0.fc.weight"]["exp_avg"].abs().sum() > 0
    for section in ("model", "model_previous"):
        for k in a[section]:
            assert torch.equal(a[section][k], b[section][k]) and torch.equal(a[section][k], c[section][k]), k
    for k, st in a["optim"]["state"].items():
        for name, v in st.items():
            assert torch.equal(v, b["optim"]["state"][k][name]) and torch.equal(v, c["optim"]["state"][k][name]), k
    assert fused.step(*resume.batch(4)) == torch_again.step(*resume.batch(4))  # batch 4 reads W(2)


# (stages, microbatches, width) of the layout a d = 2, m = 4 checkpoint is loaded into; the
# global batch stays 8 sequences (w = 2 halves m).
RESHARD = [(3, 4, 1), (1, 4, 1), (2, 2, 2)]


@pytest.mark.parametrize("stages,microbatches,width", RESHARD)
def test_a_checkpoint_loads_into_another_layout(tmp_path, stages, microbatches, width):
    layout = dict(dropout=0.0, dtype=torch.float64)
    resume.run(resume.compile("2bw", 2, 4, **layout), 0, 3, save=str(tmp_path))
    layout["width"] = width
    full = resume.run(resume.compile("2bw", stages, microbatches, **layout), 0, 5)
    resumed = resume.run(resume.compile("2bw", stages, microbatches, **layout), 3, 2, load=str(tmp_path))
    assert resume.max_rel_diff(resumed, {"losses": full["losses"][3:], "state": full["state"]}) < 1e-5


def test_latest_names_the_newest_checkpoint(tmp_path):
    pipe = resume.compile("1f1b", 2, 2)
    for t in range(1, 5):
        pipe.step(*resume.batch(t))
        if t % 2 == 0:
            path = pipe.save(str(tmp_path), extra={"next_batch": t + 1})
    assert pipe.wait_for_checkpoint() == path == str(tmp_path / "step-00000004")
    assert (tmp_path / "latest").read_text().strip() == "step-00000004"
    assert sorted(os.listdir(tmp_path)) == ["latest", "step-00000002", "step-00000004"]
    other = resume.compile("1f1b", 2, 2)
    assert other.load(str(tmp_path / "step-00000002")) == {"next_batch": 3} and other.steps == 2
    assert other.load(str(tmp_path)) == {"next_batch": 5} and other.steps == 4


def test_keep_deletes_the_oldest_checkpoints_once_the_new_one_is_complete(tmp_path):
    (tmp_path / "step-00000009").mkdir()  # a later step's, left by another run
    (tmp_path / "notes").mkdir()  # not a checkpoint
    pipe = resume.compile("1f1b", 2, 2)
    for t in range(1, 6):
        pipe.step(*resume.batch(t))
        pipe.save(str(tmp_path), keep=2)
        pipe.wait_for_checkpoint()
        names = sorted(os.listdir(tmp_path))
        kept = [f"step-{s:08d}" for s in range(max(t - 1, 1), t + 1)]
        assert names == sorted(["latest", "notes", "step-00000009", *kept]), (t, names)
    assert (tmp_path / "latest").read_text().strip() == "step-00000005"
    other = resume.compile("1f1b", 2, 2)
    other.load(str(tmp_path / "step-00000004"))
    assert other.steps == 4
    for bad in (0, -1, 1.5, True, "2"):
        with pytest.raises(CheckpointError, match=re.escape(f"save: keep must be an int >= 1 (how many of the newest "
                                                            f"checkpoints to keep) or None (keep all), found {bad!r}")):
            pipe.save(str(tmp_path), keep=bad)


def test_keep_prunes_only_this_runs_checkpoints_while_training_goes_on(tmp_path):
    # a first run leaves steps 2, 4 and 6; a second resumes from 2 (a roll-back), so 4 and 6 are
    # another trajectory: neither its count nor its to delete, also once it passes them
    first = resume.compile("1f1b", 2, 2)
    for t in range(1, 7):
        first.step(*resume.batch(t))
        if t % 2 == 0:
            first.save(str(tmp_path))
    first.wait_for_checkpoint()
    (tmp_path / "step-00000001").symlink_to(tmp_path / "step-00000002")  # a link: never touched
    pipe = resume.compile("1f1b", 2, 2)
    pipe.load(str(tmp_path / "step-00000002"))
    for t in range(3, 10, 2):
        pipe.step(*resume.batch(t))
        pipe.save(str(tmp_path), keep=2)  # no wait: the writer finishes while steps run on
        pipe.step(*resume.batch(t + 1))
    pipe.wait_for_checkpoint()
    names = sorted(os.listdir(tmp_path))
    assert names == ["latest", "step-00000001", "step-00000004", "step-00000006", "step-00000007",
                     "step-00000009"], names
    assert (tmp_path / "latest").read_text().strip() == "step-00000009"
    again = resume.compile("1f1b", 2, 2)
    again.load(str(tmp_path))
    assert again.steps == 9


def test_a_checkpoint_keep_cannot_delete_is_a_warning_not_a_failed_save(tmp_path, monkeypatch):
    import shutil

    def refuse(path, *args, **kwargs):
        raise PermissionError(13, "Permission denied", path)

    pipe = resume.compile("1f1b", 2, 2)
    pipe.step(*resume.batch(1))
    pipe.save(str(tmp_path), keep=1)
    pipe.wait_for_checkpoint()
    monkeypatch.setattr(shutil, "rmtree", refuse)
    pipe.step(*resume.batch(2))
    pipe.save(str(tmp_path), keep=1)
    with pytest.warns(RuntimeWarning, match=r"fxpipe save: could not delete the old checkpoint .*step-00000001.* "
                                            r"\(\[Errno 13\] Permission denied.*delete it yourself"):
        assert pipe.wait_for_checkpoint() == str(tmp_path / "step-00000002")
    assert (tmp_path / "latest").read_text().strip() == "step-00000002"
    assert "step-00000001" not in os.listdir(tmp_path)  # renamed aside: no half checkpoint under its name


def test_a_save_over_a_rolled_back_runs_checkpoint_replaces_it_only_once_complete(tmp_path, monkeypatch):
    # a first run saves steps 1 and 2; a second resumes from 1 on other data and saves its own step 2,
    # which is cut short the first time: the first run's step 2 (which latest names) must stay whole
    from concurrent.futures import Future

    import fxpipe.checkpoint as ckpt

    def state(path):
        pipe = resume.compile("1f1b", 2, 2)
        pipe.load(str(path))
        return pipe.state_dict()

    first = resume.compile("1f1b", 2, 2)
    for t in (1, 2):
        first.step(*resume.batch(t))
        first.save(str(tmp_path))
    first.wait_for_checkpoint()
    assert sorted(os.listdir(tmp_path)) == ["latest", "step-00000001", "step-00000002"]  # written in place
    old = first.state_dict()
    second = resume.compile("1f1b", 2, 2)
    second.load(str(tmp_path / "step-00000001"))
    second.step(*resume.batch(7))

    def cut_short(state_dict, *, checkpoint_id, **kwargs):  # part of the files, then the disk fills
        (tmp_path / checkpoint_id / "__0_0.distcp").write_bytes(b"half")
        (tmp_path / checkpoint_id / ".metadata").write_bytes(b"stale")
        failed = Future()
        failed.set_exception(OSError(28, "No space left on device"))
        return failed

    monkeypatch.setattr(ckpt.dcp, "async_save", cut_short)
    second.save(str(tmp_path))
    with pytest.raises(FxpipeError, match=r"writing checkpoint .*step-00000002 failed: .*No space left on device"):
        second.wait_for_checkpoint()
    assert (tmp_path / "latest").read_text().strip() == "step-00000002"
    assert all(torch.equal(old[k], v) for k, v in state(tmp_path).items())
    monkeypatch.undo()
    second.save(str(tmp_path))
    with pytest.warns(RuntimeWarning, match=r"fxpipe save: replaced .*step-00000002, a checkpoint of this step from "
                                            r"another run .*save into another folder to keep both") as caught:
        second.wait_for_checkpoint()
    assert not [w for w in caught if "Detected an existing checkpoint" in str(w.message)]  # DCP wrote a fresh folder
    assert sorted(os.listdir(tmp_path)) == ["latest", "step-00000001", "step-00000002"]
    new = second.state_dict()
    assert any(not torch.equal(old[k], new[k]) for k in new)
    assert all(torch.equal(new[k], v) for k, v in state(tmp_path).items())
    with warnings.catch_warnings():  # its own checkpoint of a step: saved again without a word
        warnings.simplefilter("error", RuntimeWarning)
        second.save(str(tmp_path))
        second.wait_for_checkpoint()
    assert sorted(os.listdir(tmp_path)) == ["latest", "step-00000001", "step-00000002"]


def test_a_replacement_whose_rename_fails_puts_the_old_checkpoint_back(tmp_path, monkeypatch):
    pipe = resume.compile("1f1b", 2, 2)
    pipe.step(*resume.batch(1))
    pipe.save(str(tmp_path))
    pipe.wait_for_checkpoint()
    before = pipe.state_dict()
    rename = os.rename

    def refuse_the_new(src, dst):  # a filesystem that renames no folder but the one set aside
        if str(src).endswith(".partial"):
            raise OSError(95, "Operation not supported", src)
        rename(src, dst)

    monkeypatch.setattr(os, "rename", refuse_the_new)
    pipe.save(str(tmp_path))  # the same step again: a replacement
    with pytest.raises(FxpipeError, match=r"writing checkpoint .*step-00000001 failed: .*Operation not supported"):
        pipe.wait_for_checkpoint()
    monkeypatch.undo()
    assert (tmp_path / "latest").read_text().strip() == "step-00000001"
    again = resume.compile("1f1b", 2, 2)
    again.load(str(tmp_path))
    assert all(torch.equal(before[k], v) for k, v in again.state_dict().items())


def test_a_crash_between_a_replacements_two_renames_loads_the_new_checkpoint(tmp_path):
    # the state such a crash leaves: the old step-1 renamed aside, the complete new one still hidden
    import shutil

    old = resume.compile("1f1b", 2, 2)
    old.step(*resume.batch(1))
    old.save(str(tmp_path / "old"))
    old.wait_for_checkpoint()
    new = resume.compile("1f1b", 2, 2)
    new.step(*resume.batch(5))
    new.save(str(tmp_path / "run"))
    new.wait_for_checkpoint()
    shutil.copytree(tmp_path / "old" / "step-00000001", tmp_path / "run" / ".replaced-step-00000001")
    os.rename(tmp_path / "run" / "step-00000001", tmp_path / "run" / ".step-00000001.partial")
    assert (tmp_path / "run" / "latest").read_text().strip() == "step-00000001"
    again = resume.compile("1f1b", 2, 2)
    again.load(str(tmp_path / "run"))
    assert again.steps == 1
    want = new.state_dict()
    assert all(torch.equal(want[k], v) for k, v in again.state_dict().items())
    again.step(*resume.batch(2))
    again.save(str(tmp_path / "run"))  # the step's name is free again: written in place, and latest names it
    again.wait_for_checkpoint()
    assert (tmp_path / "run" / "latest").read_text().strip() == "step-00000002"


def test_a_lazy_2bw_pipeline_of_more_stages_than_the_checkpoints_micro_batches_says_so(tmp_path):
    import fxpipe
    from fxpipe.demo import lm_loss

    resume.run(resume.compile("2bw", 2, 2), 0, 1, save=str(tmp_path))
    lazy = fxpipe.compile(resume.model(), None, loss_fn=lm_loss, schedule="2bw", stages=4, verbose=False)
    with pytest.raises(CheckpointError, match=r"load: .*step-00000001 was trained with 2 micro-batches per step, which "
                                              r"this pipeline would take \(microbatches=None\), but its 4 stages under "
                                              r"schedule='2bw' need at least 4\. Pass microbatches >= 4 to compile"):
        lazy.load(str(tmp_path))


def test_loading_another_models_checkpoint_names_every_missing_and_unexpected_key(tmp_path):
    import fxpipe
    from fxpipe.demo import GPT, GPTConfig, lm_loss

    pipe = resume.compile("1f1b", 2, 2)
    pipe.step(*resume.batch(1))
    pipe.save(str(tmp_path))
    wider = GPT(GPTConfig(n_layer=3, n_embd=16, n_head=2, vocab_size=32, block_size=resume.SEQ))
    other = fxpipe.compile(wider, (resume.batch(0)[0][:2],), loss_fn=lm_loss, microbatches=2, stages=2,
                           schedule="1f1b", verbose=False)
    with pytest.raises(CheckpointError, match=r"missing 12 keys: \['blocks\.2\.attn\.proj\.bias'") as info:
        other.load(str(tmp_path))
    assert "does not fit this model (GPT)" in str(info.value) and "unexpected" not in str(info.value)
    narrower = GPT(GPTConfig(n_layer=1, n_embd=16, n_head=2, vocab_size=32, block_size=resume.SEQ))
    other = fxpipe.compile(narrower, (resume.batch(0)[0][:2],), loss_fn=lm_loss, microbatches=2, stages=2,
                           schedule="1f1b", verbose=False)
    with pytest.raises(CheckpointError, match=r"unexpected 12 keys: \['blocks\.1\.attn\.proj\.bias'"):
        other.load(str(tmp_path))
    wider = GPT(GPTConfig(n_layer=2, n_embd=32, n_head=2, vocab_size=32, block_size=resume.SEQ))
    other = fxpipe.compile(wider, (resume.batch(0)[0][:2],), loss_fn=lm_loss, microbatches=2, stages=2,
                           schedule="1f1b", verbose=False)
    with pytest.raises(CheckpointError, match=r"of another shape or dtype: \['blocks\.0\.attn\.proj\.bias is \[16\] "
                                              r"torch\.float32 there, \[32\] torch\.float32 here'"):
        other.load(str(tmp_path))


def test_checkpoint_errors_say_what_to_do(tmp_path):
    pipe = resume.compile("1f1b", 2, 2)
    with pytest.raises(CheckpointError, match=r"no checkpoint at .*expected a checkpoint directory"):
        pipe.load(str(tmp_path / "nothing"))
    with pytest.raises(CheckpointError, match="extra must be a dict"):
        pipe.save(str(tmp_path), extra=[1, 2])
    with pytest.raises(CheckpointError, match=r"save: extra must pickle \(the checkpoint keeps it with torch\.save's "
                                              r"pickler\), but .*Keep plain data in it"):
        pipe.save(str(tmp_path), extra={"sampler": lambda: 0})
    a_file = tmp_path / "a_file"
    a_file.write_text("")
    with pytest.raises(CheckpointError, match=rf"save: cannot write a checkpoint into '{a_file}/step-00000000': Not a "
                                              r"directory\. Pass a directory every rank can create and write"):
        pipe.save(str(a_file))
    pipe.step(*resume.batch(1))
    pipe.save(str(tmp_path))
    pipe.wait_for_checkpoint()  # another pipeline reads it
    with pytest.raises(CheckpointError, match=r"schedule '1f1b', which keeps one weight version; 2bw needs W\(t-1\) too\. "
                                              r"Resume with a schedule of one weight version: '1f1b', 'gpipe' or "
                                              r"'zb'\."):
        resume.compile("2bw", 2, 2).load(str(tmp_path))
    import fxpipe
    from fxpipe.demo import lm_loss

    other = fxpipe.compile(resume.model(), (resume.batch(0)[0][:2],), loss_fn=lm_loss, microbatches=2, stages=2,
                           schedule="1f1b", verbose=False, seed=7)
    with pytest.raises(CheckpointError, match=r"trained with seed=0, this pipeline has seed=7"):
        other.load(str(tmp_path))
    # a torn checkpoint: DCP's own exception is a BaseException, which would pass `except Exception`
    saver = resume.compile("1f1b", 2, 2)
    path = saver.save(str(tmp_path / "torn"))
    saver.wait_for_checkpoint()
    import glob
    import os

    for shard in glob.glob(os.path.join(path, "*.distcp")):
        open(shard, "wb").close()
    with pytest.raises(CheckpointError, match=rf"{re.escape(path)} is not a checkpoint fxpipe can read \(.*\): a file "
                                              r"of it is missing, cut short or from another program"):
        pipe.load(path)


def test_a_checkpoint_converts_to_one_torch_save_file_the_plain_model_loads(tmp_path):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    pipe = resume.compile("2bw", 2, 2)
    for t in range(1, 3):
        pipe.step(*resume.batch(t))
    path = pipe.save(str(tmp_path / "run"))
    pipe.wait_for_checkpoint()
    dcp_to_torch_save(path, tmp_path / "ckpt.pt")
    sd = torch.load(tmp_path / "ckpt.pt", weights_only=False)
    model = resume.model()
    model.load_state_dict(sd["model"])  # strict: every key, tied aliases included
    newest = pipe.state_dict()
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in newest.items())


# ------------------------------------------------------------------ what a resume must keep


def _resumes_as_uninterrupted(tmp_path, make, at: int = 3, total: int = 5) -> tuple[dict, dict]:
    """``make()`` trained ``total`` steps straight, and trained ``at`` steps, saved, loaded into
    a fresh ``make()`` that finishes: (uninterrupted, resumed), comparable with :func:`_equal`."""
    full = resume.run(make(), 0, total)
    resume.run(make(), 0, at, save=str(tmp_path))
    resumed = resume.run(make(), at, total - at, load=str(tmp_path))
    return {"losses": full["losses"][at:], "state": full["state"]}, resumed


def _no_bias(named):
    # the README: a trainable parameter the factory puts in no group is not stepped
    return torch.optim.AdamW([p for n, p in named if "bias" not in n], lr=1e-2)


@pytest.mark.parametrize("kernels", ["off", "torch"])
def test_parameters_left_out_of_every_group_save_and_resume(tmp_path, kernels):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    def make():
        return resume.compile("1f1b", 2, 2, kernels=kernels, optimizer=_no_bias)

    full, resumed = _resumes_as_uninterrupted(tmp_path, make)
    _equal(full, resumed)
    dcp_to_torch_save(tmp_path / "step-00000003", tmp_path / "ckpt.pt")
    optim = torch.load(tmp_path / "ckpt.pt", weights_only=False)["optim"]
    for section in ("state", "param_groups"):  # as torch.optim keeps them: nothing for a parameter never stepped
        assert "blocks.0.fc.weight" in optim[section] and not any("bias" in k for k in optim[section]), section
    # the other way round: a parameter stepped here that the checkpoint's run did not step
    with pytest.raises(CheckpointError, match=r"this pipeline's optimizer steps 13 parameters that .* holds no optimizer "
                                              r"hyper-parameters for: \['blocks\.0\.attn\.proj\.bias'.*Resume with the "
                                              r"same requires_grad flags and optimizer factory"):
        resume.compile("1f1b", 2, 2, kernels=kernels).load(str(tmp_path))


def _sgd(named):
    return torch.optim.SGD([p for _, p in named], lr=0.05, momentum=0.9)


def test_sgd_momentum_of_a_torch_optim_checkpoint_resumes_on_the_fused_path(tmp_path):
    # torch's SGD keeps no `step`: the update count is saved apart, so the fused update (CUDA's
    # default; "torch" here) does not take its next step for the first and overwrite the momentum
    layout = dict(optimizer=_sgd, dropout=0.0, dtype=torch.float64)
    full = resume.run(resume.compile("1f1b", 2, 2, **layout), 0, 5)
    resume.run(resume.compile("1f1b", 2, 2, **layout), 0, 3, save=str(tmp_path))
    fused = resume.compile("1f1b", 2, 2, kernels="torch", **layout)
    resumed = resume.run(fused, 3, 2, load=str(tmp_path))
    assert [wk.store.path for wk in fused.workers.values()] == ["fused (torch)"] * 2
    assert [wk.store.optimizer_steps for wk in fused.workers.values()] == [5, 5]
    assert resume.max_rel_diff(resumed, {"losses": full["losses"][3:], "state": full["state"]}) < 1e-12


def test_a_checkpoint_without_the_update_count_counts_adams_step(tmp_path, monkeypatch):
    # checkpoints written before optimizer_steps was saved still resume: Adam's `step` counts
    from fxpipe import checkpoint

    state = checkpoint.state

    def without_count(pipe, extra):
        sd = state(pipe, extra)
        del sd["optimizer_steps"]
        return sd

    monkeypatch.setattr(checkpoint, "state", without_count)
    resume.run(resume.compile("1f1b", 2, 2), 0, 3, save=str(tmp_path))
    fused = resume.compile("1f1b", 2, 2, kernels="torch")
    fused.load(str(tmp_path))
    assert [wk.store.optimizer_steps for wk in fused.workers.values()] == [3, 3]


def _groups(named):
    # stage 0 holds two param groups (wte/wpe, blocks.0), stage 1 three (blocks.1, ln_f, the tied wte)
    rules = [(("wte", "wpe"), 5e-3), (("blocks.0.",), 1e-2), (("blocks.1.",), 4e-2), (("ln_f",), 2e-2)]
    groups = [{"params": [p for n, p in named if n.startswith(prefixes)], "lr": lr} for prefixes, lr in rules]
    return torch.optim.AdamW([g for g in groups if g["params"]])


def _warmup_cosine(opt):
    L = torch.optim.lr_scheduler
    return L.SequentialLR(opt, [L.LinearLR(opt, start_factor=0.5, total_iters=2), L.CosineAnnealingLR(opt, T_max=10)],
                          milestones=[2])


def _chained(opt):
    L = torch.optim.lr_scheduler
    # CosineAnnealingLR reads its base_lrs where a period ends (at step 3 of T_max=2)
    return L.ChainedScheduler([L.LinearLR(opt, start_factor=0.5, total_iters=2), L.CosineAnnealingLR(opt, T_max=2)])


@pytest.mark.parametrize("scheduler", [_warmup_cosine, _chained], ids=["SequentialLR", "ChainedScheduler"])
def test_nested_lr_schedulers_resume_with_each_stages_own_groups(tmp_path, scheduler):
    # the nested schedulers' per-group lists (base_lrs, _last_lr) are each stage's own, as at the top level
    pipes = []

    def make():
        pipes.append(resume.compile("1f1b", 2, 2, dropout=0.0, dtype=torch.float64, optimizer=_groups,
                                    lr_scheduler=scheduler))
        return pipes[-1]

    full, resumed = _resumes_as_uninterrupted(tmp_path, make, at=1)
    _equal(full, resumed)
    lrs = [[[g["lr"] for g in wk.store.optimizer.param_groups] for wk in p.workers.values()] for p in (pipes[0], pipes[2])]
    assert lrs[0] == lrs[1] and len(lrs[1][1]) == 3


def test_a_nested_scheduler_of_another_shape_is_named(tmp_path):
    def three(opt):
        L = torch.optim.lr_scheduler
        return L.SequentialLR(opt, [L.LinearLR(opt, total_iters=2), L.ConstantLR(opt, total_iters=2),
                                    L.CosineAnnealingLR(opt, T_max=10)], milestones=[2, 4])

    resume.run(resume.compile("1f1b", 2, 2, lr_scheduler=_warmup_cosine), 0, 1, save=str(tmp_path))
    with pytest.raises(CheckpointError, match=r"holds an lr scheduler of 2 nested schedulers, this pipeline's "
                                              r"lr_scheduler factory builds 3\. Resume with the scheduler the"):
        resume.compile("1f1b", 2, 2, lr_scheduler=three).load(str(tmp_path))


def test_a_fully_frozen_first_stage_keeps_the_lr_schedule(tmp_path):
    # stage 0 trains nothing, so it has no optimizer and no scheduler: the last stage's is saved
    pipes = []

    def make():
        pipes.append(resume.compile("1f1b", 2, 2, dropout=0.0, dtype=torch.float64,
                                    trainable=lambda n: n.startswith("ln_f")))
        return pipes[-1]

    full, resumed = _resumes_as_uninterrupted(tmp_path, make)
    assert pipes[0].workers[0].store.optimizer is None
    _equal(full, resumed)
    assert pipes[2].workers[1].store.lr_scheduler.last_epoch == 5


def test_schedulers_that_differ_between_stages_cannot_be_saved(tmp_path):
    # a checkpoint keeps one scheduler state for every stage
    def by_size(opt):
        return torch.optim.lr_scheduler.StepLR(opt, step_size=len(opt.param_groups[0]["params"]))

    pipe = resume.compile("1f1b", 2, 2, lr_scheduler=by_size)
    pipe.step(*resume.batch(1))
    with pytest.raises(CheckpointError, match=r"the lr scheduler's state \(less its per-group lists\) differs between "
                                              r"stage 0 and stages \[1\].*Make the lr_scheduler factory build the same "
                                              r"scheduler"):
        pipe.save(str(tmp_path))


def test_a_run_resumes_with_an_lr_scheduler_added_or_removed(tmp_path):
    # a scheduler adds initial_lr (OneCycleLR also max_lr, min_lr, the momenta) to the param groups
    import functools

    def one_cycle(opt):
        return torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=2e-2, total_steps=20)

    resume.run(resume.compile("1f1b", 2, 2, lr_scheduler=None), 0, 2, save=str(tmp_path / "plain"))
    added = resume.compile("1f1b", 2, 2, lr_scheduler=one_cycle)
    resume.run(added, 2, 1, load=str(tmp_path / "plain"), save=str(tmp_path / "cycled"))
    assert added.workers[0].store.optimizer.param_groups[0]["max_lr"] == 2e-2
    removed = resume.compile("1f1b", 2, 2, lr_scheduler=None)
    resume.run(removed, 3, 1, load=str(tmp_path / "cycled"))
    assert "max_lr" not in removed.workers[0].store.optimizer.param_groups[0]
    # what remains an error is another optimizer, named as the cause; Adam and Adamax have every
    # hyper-parameter AdamW's groups hold, and loaded (Adam then trained as AdamW, Adamax failed
    # at its first update)
    for other in (functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9), torch.optim.Adam, torch.optim.Adamax):
        pipe = resume.compile("1f1b", 2, 2, optimizer=other)
        name = type(pipe.workers[0].store.optimizer).__name__
        with pytest.raises(CheckpointError, match=re.escape(
                f"was trained with AdamW, and this pipeline's optimizer factory builds {name}: the saved optimizer "
                f"state and hyper-parameters are AdamW's. Resume with the optimizer the checkpoint was trained with "
                f"(pipe.load_state_dict takes its weights alone).")):
            pipe.load(str(tmp_path / "plain"))


# the per-micro-batch and per-step records of a worker, which a flush leaves empty
_IN_FLIGHT = ("inputs", "targets", "recv_act", "recv_grad", "ctx", "sends", "loss_posts", "reductions", "norm_sq",
              "clip_coef", "loss_check", "nonfinite", "dropped", "losses", "batch_loss", "batch_scale", "updated_flags")


def _mlp(accumulate: str):
    import functools

    import fxpipe

    poison = [False]

    def loss_fn(out, y):
        loss = torch.nn.functional.mse_loss(out, y)
        return loss * float("nan") if poison[0] else loss

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16), torch.nn.Tanh(),
                              torch.nn.Linear(16, 4))
    pipe = fxpipe.compile(net, (torch.zeros(2, 8),), loss_fn=loss_fn, microbatches=4, stages=2, verbose=False,
                          schedule="2bw", accumulate=accumulate, optimizer=functools.partial(torch.optim.Adam, lr=1e-2),
                          lr_scheduler=resume.schedule_lr)
    return pipe, poison


def _mlp_batch(t: int):
    g = torch.Generator().manual_seed(t)
    return torch.randn(8, 8, generator=g), torch.randn(8, 4, generator=g)


@pytest.mark.parametrize("accumulate", ["gradients", "optimizer"], ids=["2bw", "2bw-AdamA"])
def test_load_revives_a_pipeline_a_non_finite_step_stopped(tmp_path, accumulate):
    # NonFiniteError says to load the last checkpoint: into the same pipeline, which then trains
    # as a fresh one loaded from it (nothing of the failed steps stays: no AdamA flag, no loss)
    from fxpipe.errors import NonFiniteError

    pipe, poison = _mlp(accumulate)
    for t in (1, 2):
        pipe.step(*_mlp_batch(t))
    pipe.save(str(tmp_path))
    poison[0] = True
    with pytest.raises(NonFiniteError):
        for t in (3, 4, 5):
            pipe.step(*_mlp_batch(t))
    with pytest.raises(NonFiniteError):  # stopped
        pipe.step(*_mlp_batch(t + 1))
    poison[0] = False
    pipe.load(str(tmp_path))
    assert pipe.steps == 2
    for wk in pipe.workers.values():
        assert not wk.halted and not any(getattr(wk, name) for name in _IN_FLIGHT), wk.index
    fresh, _ = _mlp(accumulate)
    fresh.load(str(tmp_path))
    for t in (3, 4, 5):
        assert float(pipe.step(*_mlp_batch(t))) == float(fresh.step(*_mlp_batch(t)))
    got, want = pipe.state_dict(), fresh.state_dict()
    assert all(torch.equal(got[k], want[k]) for k in want)


class _Pooled(torch.nn.Module):
    """A pooler no node reads (a head the loss does not use) and a non-persistent buffer."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.pooler = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)
        self.register_buffer("scale", torch.full((8,), 0.5), persistent=False)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)) * self.scale)


def _pooled(seed: int):
    import fxpipe

    torch.manual_seed(seed)
    return fxpipe.compile(_Pooled(), (torch.randn(2, 8),), loss_fn=torch.nn.functional.mse_loss, microbatches=2,
                          stages=2, schedule="1f1b", verbose=False)


def test_parameters_no_node_reads_are_loaded_too(tmp_path):
    pipe = _pooled(0)
    pipe.step(torch.randn(4, 8), torch.randn(4, 8))
    pipe.save(str(tmp_path))
    pipe.wait_for_checkpoint()
    restarted = _pooled(1)  # another random init, as a restarted job builds its model
    assert not torch.equal(restarted.state_dict()["pooler.weight"], pipe.state_dict()["pooler.weight"])
    restarted.load(str(tmp_path))
    got, want = restarted.state_dict(), pipe.state_dict()
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    again = _pooled(2)
    again.load_state_dict(want)
    got = again.state_dict()
    assert all(torch.equal(got[k], want[k]) for k in want)
    got["pooler.weight"].fill_(42.0)  # a copy, like every other tensor of a state dict: the pipeline's stays
    assert torch.equal(again.state_dict()["pooler.weight"], want["pooler.weight"])


def test_load_state_dict_takes_a_model_with_a_non_persistent_buffer():
    # the buffer is in no state dict and keeps its value, as in PyTorch
    pipe = _pooled(0)
    other = _Pooled()
    sd = other.state_dict()
    assert "scale" not in sd
    pipe.load_state_dict(sd)
    got = pipe.state_dict()
    assert got.keys() == sd.keys() and all(torch.equal(got[k], sd[k]) for k in sd)
    assert all(torch.equal(b, torch.full((8,), 0.5)) for wk in pipe.workers.values() for b in wk.buffers.values())
    del sd["pooler.bias"]
    with pytest.raises(ValueError, match=r"load_state_dict: the state dict does not fit this model \(_Pooled\): "
                                         r"missing 1 keys: \['pooler\.bias'\]\. Nothing was loaded\. Pass a state "
                                         r"dict of the same model"):
        pipe.load_state_dict(sd)
    with pytest.raises(ValueError, match=r"load_state_dict: expected a state dict of tensors \(model\.state_dict\(\)\), "
                                         r"found 1 keys holding something else, e\.g\. \['pooler\.weight'\]"):
        pipe.load_state_dict({**other.state_dict(), "pooler.weight": 0})
    # a key the model does not have is refused too, as nn.Module.load_state_dict does
    with pytest.raises(ValueError, match=r"unexpected 1 keys: \['head\.weight'\]\. Nothing was loaded"):
        pipe.load_state_dict({**other.state_dict(), "head.weight": torch.zeros(2)})


def test_load_state_dict_refuses_tensors_of_another_shape_before_loading_any():
    # copy_ would broadcast a one-element bias or a one-row weight into the whole tensor
    pipe = _pooled(0)
    before = pipe.state_dict()
    key = next(k for k in before if k.endswith("bias") and before[k].numel() > 1)
    for wrong in (before[key][:1], torch.zeros(before[key].numel() + 1)):
        bad = {**before, key: wrong}
        with pytest.raises(ValueError, match=rf"1 tensors of another shape: \['{re.escape(key)} is "
                                             rf"\[{wrong.numel()}\] there, \[{before[key].numel()}\] here'\]\. "
                                             r"Nothing was loaded"):
            pipe.load_state_dict(bad)
        after = pipe.state_dict()
        assert all(torch.equal(before[k], after[k]) for k in before)


@pytest.mark.parametrize("saved_m,m", [(2, 4), (4, 2)])
def test_a_lazy_resume_into_another_micro_batch_count_keeps_the_global_batch(tmp_path, saved_m, m):
    # the traced micro-batch is re-cut from the checkpoint's (4 samples -> 2, or 2 -> 4 repeated)
    layout = dict(dropout=0.0, dtype=torch.float64)
    resume.run(resume.compile("2bw", 2, saved_m, **layout), 0, 3, save=str(tmp_path))
    full = resume.run(resume.compile("2bw", 2, m, **layout), 0, 5)
    pipe = resume.compile("2bw", 2, m, lazy=True, **layout)
    resumed = resume.run(pipe, 3, 2, load=str(tmp_path))
    assert (pipe.plan.microbatches, pipe.plan.microbatch_size) == (m, resume.GLOBAL_BATCH // m)
    assert resume.max_rel_diff(resumed, {"losses": full["losses"][3:], "state": full["state"]}) < 1e-5


def test_a_lazy_resume_takes_the_checkpoints_plan_only_where_it_has_the_asked_precision_and_recompute(tmp_path):
    # the saved plan was adopted whatever compile's precision and recompute said: a bf16 plan ran
    # in fp32, and recompute=True ran without recomputation
    import fxpipe
    from fxpipe.demo import lm_loss

    saved = resume.compile("1f1b", 2, 2, precision="bf16", recompute=False)
    resume.run(saved, 0, 1, save=str(tmp_path))

    def lazy(**kw):
        pipe = fxpipe.compile(resume.model(), loss_fn=lm_loss, schedule="1f1b", verbose=False, **kw)
        pipe.load(str(tmp_path))
        return pipe

    assert lazy(precision="bf16").plan == saved.plan  # the layout asked for is the checkpoint's
    other = lazy(precision="fp32")
    assert (other.plan.precision, other.config.precision) == ("fp32", "fp32")
    assert other.plan.microbatches * other.plan.microbatch_size == resume.GLOBAL_BATCH
    assert lazy(precision="bf16", recompute=True).plan != saved.plan  # planned anew, as compile would


def test_a_lazy_resume_into_a_micro_batch_count_that_does_not_divide_the_batch_says_which_do(tmp_path):
    resume.run(resume.compile("1f1b", 2, 2), 0, 1, save=str(tmp_path))
    with pytest.raises(CheckpointError, match=r"trained on global batches of 8 samples \(4 per micro-batch x 2 micro-"
                                              r"batches x 1 replicas\); this pipeline splits a batch into 3 micro-"
                                              r"batches x 1 replicas, which does not divide 8\. Pass microbatches= one "
                                              r"of \[1, 2, 4, 8\]"):
        resume.compile("1f1b", 2, 3, lazy=True).load(str(tmp_path))


def test_load_into_a_pipeline_whose_step_failed_part_way_says_to_compile_a_new_one(tmp_path):
    # unlike a non-finite step, an action that raised leaves the ranks part-way through a step
    calls = [0]

    def loss_fn(out, y):
        from fxpipe.demo import lm_loss

        calls[0] += 1
        if calls[0] == 3:  # step 2's first micro-batch
            raise ValueError("a bug in the user's loss")
        return lm_loss(out, y)

    pipe = resume.compile("1f1b", 2, 2, loss_fn=loss_fn)
    pipe.step(*resume.batch(1))
    pipe.save(str(tmp_path))
    with pytest.raises(ValueError, match="failed running action"):
        pipe.step(*resume.batch(2))
    from fxpipe.errors import FxpipeError

    for call in (pipe.load, pipe.save):
        with pytest.raises(FxpipeError, match=rf"^{call.__name__}\(\) after step 2 \(rank 1, action 1F\d+v\d+: ValueError: .*\) failed: this "
                                              r"pipeline's ranks stopped part-way through it.*Compile a new pipeline "
                                              r"and load the last checkpoint"):
            call(str(tmp_path))
    fresh = resume.compile("1f1b", 2, 2)
    assert fresh.load(str(tmp_path)) is None and fresh.steps == 1
