"""Measured costs under torchrun-like ranks: the link figures come from a real ping-pong between
ranks 0 and 1, rank 0 profiles and plans, and every rank trains on the one broadcast plan. A
calibrated plan on one host also knows how many ranks the host's cores run at once."""

import json

import pytest

from tests.dist.harness import run_function

pytestmark = [pytest.mark.dist, pytest.mark.timeout(300)]


def measured_compile(rank, world):
    import functools

    import torch

    import fxpipe
    from fxpipe.demo import GPT, GPTConfig, fibonacci_batch, lm_loss

    torch.manual_seed(0)
    cfg = GPTConfig(n_layer=2, n_embd=32)
    x, y = fibonacci_batch(8, 16, cfg.vocab_size, torch.Generator().manual_seed(0))
    pipe = fxpipe.compile(GPT(cfg), (x[:2],), loss_fn=lm_loss, microbatches=4, stages=2, cost_mode="measured",
                          optimizer=functools.partial(torch.optim.SGD, lr=0.1), verbose=False)
    losses = [float(pipe.step(x, y)) for _ in range(2)]  # rank 0: a Loss handle, resolved here
    calibrated = fxpipe.compile(GPT(cfg), (x[:2],), loss_fn=lm_loss, microbatches=4, stages=2,
                                cost_mode="calibrated", optimizer=functools.partial(torch.optim.SGD, lr=0.1),
                                verbose=False)
    float(calibrated.step(x, y))  # every rank waits for the step's loss
    return {"plan": pipe.plan.to_json(), "losses": losses, "calibrated": calibrated.plan.to_json()}


def test_measured_mode_measures_links_and_shares_one_plan():
    from fxpipe.cost import DeviceModel

    results = run_function(2, "tests.dist.test_measured_plan:measured_compile", timeout=240)
    errors = [f"rank {r}:\n{res['error']}" for r, res in enumerate(results) if res["error"]]
    assert not errors, "\n".join(errors)
    plans = [res["value"]["plan"] for res in results]
    assert plans[0] == plans[1], "the ranks trained on different plans"
    plan = json.loads(plans[0])
    assert plan["cost_mode"] == "measured"
    default = DeviceModel.cpu()
    link = plan["device"]
    assert link["p2p_latency"] > 0 and link["p2p_bandwidth"] > 0
    assert (link["p2p_latency"], link["p2p_bandwidth"]) != (default.p2p_latency, default.p2p_bandwidth)
    assert results[0]["value"]["losses"] == results[1]["value"]["losses"]  # the loss on every rank
    calibrated = [json.loads(res["value"]["calibrated"]) for res in results]
    assert calibrated[0] == calibrated[1]
    # both ranks run on this host: rank 0 timed the model alone too, and the host's cores (at
    # least one rank's worth, at most one per rank) went into the plan
    assert 1.0 <= calibrated[0]["device"]["host_cores"] <= 2.0
