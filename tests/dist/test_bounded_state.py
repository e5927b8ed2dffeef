"""Under real process groups, a rank holds as much after 60 steps as after 30 (gloo marks a send
complete only once it is waited for: a runtime that only polled would keep every send forever)."""

import functools

import pytest
import torch

from tests.dist.harness import run_function

pytestmark = [pytest.mark.dist, pytest.mark.timeout(300)]

HELD = ("sends", "reductions", "recv_act", "recv_grad", "ctx", "inputs", "targets", "losses", "norm_sq", "clip_coef",
        "batch_loss", "loss_posts", "loss_check", "nonfinite", "dropped")


def held_after_30_and_60_steps(rank: int, world: int) -> list[dict]:
    import fxpipe
    from fxpipe.demo import GPT, GPTConfig, fibonacci_batch, lm_loss

    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_embd=16, n_head=2, vocab_size=32, block_size=8))  # tied embedding
    x, y = fibonacci_batch(4, 8, 32, torch.Generator().manual_seed(0))
    pipe = fxpipe.compile(model, (x[:1],), loss_fn=lm_loss, microbatches=2, stages=2, schedule="2bw",
                          max_grad_norm=1.0, verbose=False, optimizer=functools.partial(torch.optim.AdamW, lr=1e-3))
    out = []
    for i in range(1, 61):
        pipe.step(x, y)
        if i in (30, 60):
            (wk,) = pipe.workers.values()
            out.append({name: len(getattr(wk, name)) for name in HELD})
    pipe.flush()
    return out


@pytest.mark.slow  # 4 ranks; tests/unit/test_runtime_core.py proves the same in one process, by default
def test_ranks_hold_the_same_after_30_and_60_steps():
    results = run_function(4, "tests.dist.test_bounded_state:held_after_30_and_60_steps", timeout=240)
    for rank, res in enumerate(results):
        assert res["error"] is None, res["error"]
        at30, at60 = res["value"]
        assert at30 == at60, (rank, at30, at60)
        assert at60["sends"] <= 4, (rank, at60)
