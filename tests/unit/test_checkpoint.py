"""Pipeline.save / Pipeline.load in one process: exact resume, resharding, and the errors."""

import os

import pytest
import torch

from fxpipe.checkpoint import CheckpointError
from tests import resume


def _equal(a: dict, b: dict) -> None:
    assert a["losses"] == b["losses"]
    assert a["state"].keys() == b["state"].keys()
    for k in a["state"]:
        assert torch.equal(a["state"][k], b["state"][k]), k


@pytest.mark.parametrize("schedule", ["2bw", "1f1b", "gpipe"])
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


def test_loading_another_models_checkpoint_names_every_missing_and_unexpected_key(tmp_path):
    import fxpipe
    from fxpipe.demo import GPT, GPTConfig, lm_loss

    pipe = resume.compile("1f1b", 2, 2)
    pipe.step(*resume.batch(1))
    pipe.save(str(tmp_path))
    wider = GPT(GPTConfig(n_layer=3, n_embd=16, n_head=2, vocab_size=32, block_size=resume.SEQ))
    other = fxpipe.compile(wider, (resume.batch(0)[0][:2],), loss_fn=lm_loss, microbatches=2, stages=2,
                           schedule="1f1b", verbose=False)
    with pytest.raises(CheckpointError, match=r"missing 12 model keys: \['blocks\.2\.attn\.proj\.bias'") as info:
        other.load(str(tmp_path))
    assert "does not fit this model (GPT)" in str(info.value) and "unexpected" not in str(info.value)
    narrower = GPT(GPTConfig(n_layer=1, n_embd=16, n_head=2, vocab_size=32, block_size=resume.SEQ))
    other = fxpipe.compile(narrower, (resume.batch(0)[0][:2],), loss_fn=lm_loss, microbatches=2, stages=2,
                           schedule="1f1b", verbose=False)
    with pytest.raises(CheckpointError, match=r"unexpected 12 model keys: \['blocks\.1\.attn\.proj\.bias'"):
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
    pipe.step(*resume.batch(1))
    pipe.save(str(tmp_path))
    pipe.wait_for_checkpoint()  # another pipeline reads it
    with pytest.raises(CheckpointError, match=r"schedule '1f1b', which keeps one weight version; 2bw needs W\(t-1\)"):
        resume.compile("2bw", 2, 2).load(str(tmp_path))
    import fxpipe
    from fxpipe.demo import lm_loss

    other = fxpipe.compile(resume.model(), (resume.batch(0)[0][:2],), loss_fn=lm_loss, microbatches=2, stages=2,
                           schedule="1f1b", verbose=False, seed=7)
    with pytest.raises(CheckpointError, match=r"trained with seed=0, this pipeline has seed=7"):
        other.load(str(tmp_path))


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
