"""The CUDA path, on a machine with a GPU (skipped elsewhere; this project's CI has none).

Run it on its own — ``pytest tests/gpu`` — not together with ``tests/kernels``, whose conftest
switches Triton to its CPU interpreter for the whole session. Every stage runs in this process on
one GPU (``device="cuda"``): stages, flat weight versions, batches and the loss live there, and
``kernels="auto"`` takes the fused Triton gradient accumulation and update (float64 models fall
back to torch.optim, which the tests assert). The numbers must equal the references trained on
the same GPU, as on the CPU.
"""

import pytest
import torch

import fxpipe
from tests.cases import CASES, build, compare

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize("name", ["2bw_adamw_clip", "2bw_sgd", "1f1b_adamw", "gpt2_2bw", "llama_2bw_adamw"])
def test_cuda_pipeline_matches_the_reference_on_the_gpu(name):
    case = CASES[name]
    model, example, batches, loss_fn, opt = build(case)
    pipe = fxpipe.compile(
        model, example, loss_fn=loss_fn, optimizer=opt, microbatches=case.microbatches, schedule=case.schedule,
        stages=case.stages, max_grad_norm=case.max_grad_norm, device="cuda", verbose=False,
    )
    assert pipe.device.type == "cuda"
    # float32 cases take the fused Triton update; the float64 ones fall back to torch.optim
    path = "torch.optim" if case.dtype == torch.float64 else "fused (triton)"
    assert f"stage 0 {path}, stage 1 {path}" in pipe.describe()
    losses = [pipe.step(x, y, sync=False) for x, y in batches]
    assert all(isinstance(v, torch.Tensor) and v.device.type == "cuda" for v in losses)
    mismatches = compare(case, [float(v) for v in losses], pipe.state_dict(), device="cuda")
    assert not mismatches, "\n".join(mismatches)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
@pytest.mark.timeout(600)
def test_nccl_ranks_match_the_reference():
    # One process per GPU, NCCL between them, exactly as under torchrun.
    from tests.dist.test_pipeline_dist import check_cases

    check_cases(2, ["2bw_adamw_clip", "1f1b_adamw", "gpt2_2bw", "llama_2bw_adamw"], 500, backend="nccl")


@pytest.mark.parametrize("schedule", ["2bw", "1f1b"])
def test_cuda_resume_is_bitwise_the_uninterrupted_run(tmp_path, schedule):
    # Checkpoints of GPU stages (fused optimizer state, CUDA RNG) resume bit for bit.
    from tests import resume

    def run(start, steps, **io):
        return resume.run(resume.compile(schedule, 2, 2, kernels="auto", device="cuda"), start, steps, **io)

    full = run(0, 6)
    run(0, 3, save=str(tmp_path))
    resumed = run(3, 3, load=str(tmp_path))
    assert resumed["losses"] == full["losses"][3:]
    assert all(torch.equal(v, resumed["state"][k]) for k, v in full["state"].items())


def test_cuda_nonfinite_gradient_is_skipped_everywhere(monkeypatch):
    # The non-finite flag is read on the host at NORM_WAIT; on the GPU that is a sync, not a hang.
    from fxpipe.runtime import StageWorker
    from tests import resume
    from tests.dist.test_reliability import _poisoning

    monkeypatch.setattr(StageWorker, "_do_b", _poisoning(StageWorker._do_b))
    pipe = resume.compile("2bw", 3, 4, dropout=0.0, kernels="auto", device="cuda", nonfinite="skip")
    with pytest.warns(RuntimeWarning, match=r"step 3: stage\(s\) \[1\]"):
        for t in range(1, 7):
            pipe.step(*resume.batch(t))
    assert pipe.skipped_steps == [3]
