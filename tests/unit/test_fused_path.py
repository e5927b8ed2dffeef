"""The fused update path (fxpipe.kernels, here with its torch math: kernels="torch") takes what
torch.optim takes: parameter groups with their own hyper-parameters, frozen parameters, and,
for what the kernels do not implement, a fallback to torch.optim for that stage, said in one
line and in describe()."""

import functools

import pytest
import torch

import fxpipe
from tests.models import rmsnorm_residual


def _groups(named):
    """Three groups with their own lr, weight decay and betas; names decide, as users write it."""
    named = list(named)
    norms = [p for n, p in named if "norm" in n]
    embed = [p for n, p in named if "embed" in n]
    rest = [p for n, p in named if "norm" not in n and "embed" not in n]
    return torch.optim.AdamW([
        {"params": rest, "weight_decay": 0.1},
        {"params": norms, "weight_decay": 0.0, "lr": 5e-3},
        {"params": embed, "betas": (0.8, 0.99), "eps": 1e-6},
    ], lr=1e-2)


def _sgd_groups(named):
    named = list(named)
    return torch.optim.SGD([
        {"params": [p for n, p in named if "norm" not in n], "momentum": 0.9, "nesterov": True},
        {"params": [p for n, p in named if "norm" in n], "momentum": 0.5, "dampening": 0.1, "weight_decay": 1e-2},
    ], lr=5e-2)


def _decay(opt):
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))


def _train(kernels: str, optimizer, *, schedule="2bw", frozen=False, steps=6, sched=_decay):
    model, example = rmsnorm_residual(batch=2)
    if frozen:
        model.final_norm.weight.requires_grad_(False)
    pipe = fxpipe.compile(model, example, loss_fn=lambda out, y: out.float().pow(2).mean(), microbatches=2,
                          schedule=schedule, stages=2, kernels=kernels, optimizer=optimizer, lr_scheduler=sched,
                          verbose=False)
    g = torch.Generator().manual_seed(0)
    losses = []
    for _ in range(steps):
        x = torch.randint(0, 50, (4, 8), generator=g)
        losses.append(pipe.step(x, x))
    return pipe, losses, pipe.state_dict()


@pytest.mark.parametrize("optimizer", [_groups, _sgd_groups], ids=["adamw-groups", "sgd-groups"])
@pytest.mark.parametrize("schedule", ["2bw", "1f1b", "zb"])
def test_param_groups_train_through_the_fused_path_as_torch_optim_does(optimizer, schedule):
    fused, losses, state = _train("torch", optimizer, schedule=schedule)
    assert "update: stage 0 fused (torch), stage 1 fused (torch)" in fused.describe()
    plain, ref_losses, ref_state = _train("off", optimizer, schedule=schedule)
    assert "stage 0 torch.optim" in plain.describe()
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    for k, v in ref_state.items():
        assert torch.allclose(state[k], v, rtol=1e-5, atol=1e-6), k


def test_frozen_parameters_are_left_alone_by_the_fused_update():
    # AdamW's decoupled decay would shrink a frozen weight if its range were updated
    model, _ = rmsnorm_residual(batch=2)
    before = model.final_norm.weight.detach().clone()
    pipe, _, state = _train("torch", functools.partial(torch.optim.AdamW, lr=1e-2, weight_decay=0.5), frozen=True)
    assert torch.equal(state["final_norm.weight"], before)


@pytest.mark.parametrize("optimizer,why", [
    (functools.partial(torch.optim.RMSprop, lr=1e-3), "expected torch.optim.SGD, Adam or AdamW, found RMSprop"),
    (functools.partial(torch.optim.Adam, lr=1e-3, amsgrad=True), "Adam(amsgrad=True) is not implemented by the fused"),
])
def test_what_the_kernels_cannot_do_falls_back_to_torch_optim_in_one_line(optimizer, why):
    with pytest.warns(RuntimeWarning, match=r"stage 0 updates with torch.optim instead of the fused kernels: .*"
                                            + why.replace("(", r"\(").replace(")", r"\)")):
        pipe, losses, state = _train("torch", optimizer, steps=3)
    assert "update: stage 0 torch.optim, stage 1 torch.optim" in pipe.describe()
    _, ref_losses, ref_state = _train("off", optimizer, steps=3)  # exactly torch.optim's numbers
    assert losses == ref_losses and all(torch.equal(state[k], v) for k, v in ref_state.items())


@pytest.mark.parametrize("optimizer", [_groups, _sgd_groups], ids=["adamw-groups", "sgd-groups"])
def test_float64_trains_through_the_fused_torch_math_as_torch_optim_does(optimizer):
    # float64 weights and float64 optimizer state, as torch.optim keeps them
    def train(kernels):
        model, example = rmsnorm_residual(batch=2)
        pipe = fxpipe.compile(model.double(), example, loss_fn=lambda out, y: out.pow(2).mean(), microbatches=2,
                              stages=2, kernels=kernels, optimizer=optimizer, verbose=False)
        g = torch.Generator().manual_seed(0)
        losses = [pipe.step(x, x) for x in (torch.randint(0, 50, (4, 8), generator=g) for _ in range(5))]
        return pipe, losses, pipe.state_dict()

    fused, losses, state = train("torch")
    assert "update: stage 0 fused (torch), stage 1 fused (torch)" in fused.describe()
    assert all(st.dtype == torch.float64 for wk in fused.workers.values() for s in wk.store.strategy.state.values()
               for st in s.values())
    _, ref_losses, ref_state = train("off")
    assert losses == pytest.approx(ref_losses, rel=1e-12)
    for k, v in ref_state.items():
        assert torch.allclose(state[k], v, rtol=1e-10, atol=1e-13), k


def test_the_fused_path_steps_the_scheduler_without_torchs_order_warning():
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _train("torch", functools.partial(torch.optim.AdamW, lr=1e-2), steps=3)  # with a LambdaLR
    assert not [w for w in caught if "lr_scheduler.step()" in str(w.message)]


def _one_cycle(opt):
    # cycles Adam's beta1 and SGD's momentum every step, with the lr
    return torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=5e-2, total_steps=8, pct_start=0.5)


@pytest.mark.parametrize("optimizer", [
    functools.partial(torch.optim.AdamW, lr=1e-2, weight_decay=0.1),
    functools.partial(torch.optim.SGD, lr=1e-2, momentum=0.9),
], ids=["adamw", "sgd"])
def test_a_scheduler_that_cycles_momentum_steps_the_fused_path_as_torch_optim(optimizer):
    # the fused update reads every hyper-parameter at each step, not only the lr
    fused, losses, state = _train("torch", optimizer, sched=_one_cycle)
    groups = fused.workers[0].store.optimizer.param_groups
    assert all((g["betas"][0] if "betas" in g else g["momentum"]) != 0.95 for g in groups)  # moved off its start
    _, ref_losses, ref_state = _train("off", optimizer, sched=_one_cycle)
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    for k, v in ref_state.items():
        assert torch.allclose(state[k], v, rtol=1e-5, atol=1e-6), k


def test_parameters_the_factory_leaves_out_are_not_stepped_as_under_torch_optim():
    def no_norms(named):  # the norms' weights take gradients but are in no group
        return torch.optim.AdamW([p for n, p in named if "norm" not in n], lr=1e-2, weight_decay=0.1)

    model, _ = rmsnorm_residual(batch=2)
    before = {n: p.detach().clone() for n, p in model.named_parameters() if "norm" in n}
    fused, losses, state = _train("torch", no_norms)
    assert "update: stage 0 fused (torch), stage 1 fused (torch)" in fused.describe()
    assert before and all(torch.equal(state[n], v) for n, v in before.items())
    _, ref_losses, ref_state = _train("off", no_norms)
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    for k, v in ref_state.items():
        assert torch.allclose(state[k], v, rtol=1e-5, atol=1e-6), k


def test_sgd_groups_with_and_without_momentum_fall_back_to_torch_optim():
    def mixed(named):
        named = list(named)
        return torch.optim.SGD([{"params": [p for n, p in named if "norm" not in n], "momentum": 0.9},
                                {"params": [p for n, p in named if "norm" in n]}], lr=5e-2)

    with pytest.warns(RuntimeWarning, match=r"stage 0 updates with torch.optim instead of the fused kernels: the param "
                                            r"groups keep different optimizer state .*SGD with momentum in some groups"):
        pipe, losses, state = _train("torch", mixed, steps=3)
    assert "update: stage 0 torch.optim, stage 1 torch.optim" in pipe.describe()
    _, ref_losses, ref_state = _train("off", mixed, steps=3)
    assert losses == ref_losses and all(torch.equal(state[k], v) for k, v in ref_state.items())


def test_a_kernel_backend_that_cannot_run_falls_back_to_torch_optim(monkeypatch):
    import fxpipe.kernels as kernels

    def broken(device, force=None):
        raise kernels.KernelBackendError("fxpipe.kernels: backend 'triton' needs the triton package, which failed "
                                         "to import (no module named 'triton')")

    monkeypatch.setattr(kernels, "ops", broken)
    with pytest.warns(RuntimeWarning, match=r"stage 0 updates with torch.optim instead of the fused kernels: "
                                            r"fxpipe.kernels: backend 'triton' needs the triton package"):
        pipe, _, _ = _train("torch", functools.partial(torch.optim.AdamW, lr=1e-2), steps=1)
    assert "update: stage 0 torch.optim, stage 1 torch.optim" in pipe.describe()
