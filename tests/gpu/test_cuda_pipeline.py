"""The CUDA path, on a machine with a GPU (skipped elsewhere; this project's CI has none).

Run it on its own — ``pytest tests/gpu`` — not together with ``tests/kernels``, whose conftest
switches Triton to its CPU interpreter for the whole session. Every stage runs in this process on
one GPU (``device="cuda"``): stages, flat weight versions, batches and the loss live there, and
``kernels="auto"`` takes the fused Triton gradient accumulation and update. The numbers must
equal the references trained on the same GPU, as on the CPU.
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
