"""The runtime's fused kernel path (fxpipe.kernels) against its torch.optim path and the reference.

tests/kernels/conftest.py sets TRITON_INTERPRET=1 before any kernel import, so ``kernels="triton"``
runs the real Triton kernels on the CPU through the interpreter.
"""

import pytest

import fxpipe
from tests.cases import CASES, build, compare


def _train(case, kernels):
    model, example, batches, loss_fn, opt = build(case)
    pipe = fxpipe.compile(
        model, example, loss_fn=loss_fn, optimizer=opt, microbatches=case.microbatches, schedule=case.schedule,
        stages=case.stages, max_grad_norm=case.max_grad_norm, kernels=kernels, verbose=False,
    )
    losses = [pipe.step(x, y) for x, y in batches[:4]]
    return pipe, losses, pipe.state_dict()


@pytest.mark.parametrize("name", ["2bw_adamw_clip", "2bw_sgd"])
@pytest.mark.parametrize("kernels", ["triton", "torch"])
def test_fused_path_matches_torch_optim_path(name, kernels):
    case = CASES[name]
    pipe, losses, state = _train(case, kernels)
    assert all(wk.store.strategy.ops.name == kernels for wk in pipe.workers.values())
    _, ref_losses, ref_state = _train(case, "off")
    assert losses == pytest.approx(ref_losses, rel=1e-6)
    for key, ref in ref_state.items():
        assert (state[key] - ref).abs().max() <= 1e-5 * max(ref.abs().max(), 1e-12), key
    short = type(case)(**{**case.__dict__, "steps": 4})
    assert not compare(short, losses, state)


def test_unsupported_optimizer_on_fused_path_says_what_to_do():
    import functools

    import torch

    case = CASES["2bw_sgd"]
    model, example, batches, loss_fn, _ = build(case)
    with pytest.raises(Exception, match="(?i)rmsprop|not supported|supports"):
        fxpipe.compile(model, example, loss_fn=loss_fn, optimizer=functools.partial(torch.optim.RMSprop, lr=0.01),
                       stages=2, microbatches=4, kernels="triton", verbose=False)


def test_float64_on_the_triton_kernels_says_they_take_no_float64():
    # kernels="triton" never falls back; "auto" on CUDA updates such a stage with torch.optim instead
    from tests.models import rmsnorm_residual

    model, example = rmsnorm_residual(batch=2)
    with pytest.raises(Exception, match=r"the triton kernels update torch\.float32, torch\.bfloat16, torch\.float16 "
                                        r"weights, this stage holds torch\.float64"):
        fxpipe.compile(model.double(), example, loss_fn=lambda out, y: out.pow(2).mean(), microbatches=2, stages=2,
                       kernels="triton", verbose=False)
