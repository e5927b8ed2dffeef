"""The weight store's memory equals the memory model the planner prices stages with."""

import functools

import pytest
import torch

import fxpipe
from fxpipe.weights import weight_bytes
from tests.models import gpt2_tiny, rmsnorm_residual


def _modelled(store, schedule, grad_buffers, optimizer_bytes, accumulation):
    return sum(weight_bytes(s.numel, s.dtype.itemsize, requires_grad=s.requires_grad, schedule=schedule,
                            grad_buffers=grad_buffers, optimizer_bytes_per_param=optimizer_bytes,
                            accumulation=accumulation) for s in store.layout.slots)


@pytest.mark.parametrize("schedule,clip", [("2bw", True), ("2bw", False), ("1f1b", False), ("gpipe", True)])
def test_store_bytes_equal_the_model_torch_optim(schedule, clip):
    # SGD with momentum holds one fp32 buffer per element (4 bytes) once it has stepped.
    model, example = rmsnorm_residual(batch=1)
    model.final_norm.weight.requires_grad_(False)  # a frozen parameter: one copy per version, nothing else
    pipe = fxpipe.compile(model, example, loss_fn=lambda out, y: out.float().pow(2).mean(), microbatches=2,
                          schedule=schedule, stages=2, max_grad_norm=1.0 if clip else None, verbose=False,
                          optimizer=functools.partial(torch.optim.SGD, lr=1e-3, momentum=0.9))
    x = torch.randint(0, 50, (2, 8))
    for _ in range(3):
        pipe.step(x, x)
    pipe.flush()
    # With or without clipping every step reduces the norm: 2bw, which overlaps it with the next
    # batch, keeps two gradient buffers; a flush schedule, which finishes it first, one.
    buffers = 2 if schedule == "2bw" else 1
    for wk in pipe.workers.values():
        assert len(wk.store.grad_pool) == buffers
        assert wk.store.nbytes() == _modelled(wk.store, schedule, buffers, 4, "autograd")


def test_store_bytes_equal_the_model_fused_path():
    # The fused path keeps AdamW's two fp32 moments flat (8 bytes per element) and one scratch gradient.
    model, example = gpt2_tiny(batch=1, seq=4, labels=True)
    pipe = fxpipe.compile(model, example, microbatches=2, schedule="2bw", stages=2, kernels="torch", verbose=False,
                          optimizer=functools.partial(torch.optim.AdamW, lr=1e-3))
    ids = torch.randint(0, 100, (2, 4))
    pipe.step({"input_ids": ids, "labels": ids})
    for wk in pipe.workers.values():  # the tied embedding: two gradient buffers on both stages
        assert wk.store.nbytes() == _modelled(wk.store, "2bw", 2, 8, "fused")


def test_planner_prices_the_store():
    # plan() costs each parameter with weight_bytes: frozen or not, per schedule and accumulation.
    assert weight_bytes(10, 4, requires_grad=True, schedule="2bw", grad_buffers=2, optimizer_bytes_per_param=8) \
        == 2 * 40 + 2 * 40 + 80
    assert weight_bytes(10, 4, requires_grad=True, schedule="1f1b", grad_buffers=1, optimizer_bytes_per_param=8,
                        accumulation="fused") == 40 + 2 * 40 + 80
    # frozen: two versions, and its (unused) place in the two gradient buffers of the flat layout
    assert weight_bytes(10, 2, requires_grad=False, schedule="2bw", grad_buffers=2, optimizer_bytes_per_param=8) == 80


@pytest.mark.parametrize("schedule", ["2bw", "1f1b", "gpipe", "zb"])
def test_plan_counts_the_gradient_buffers_the_runtime_keeps(schedule):
    # Every step reduces the norm and the tied embedding's gradient. 2bw overlaps those reductions
    # with the next batch, so both stages keep two buffers; a flush schedule finishes them before
    # the next batch starts and keeps one. The plan's memory_grads is what the store allocates.
    model, example = gpt2_tiny(batch=1, seq=4, labels=True)
    pipe = fxpipe.compile(model, example, microbatches=2, schedule=schedule, stages=2, verbose=False)
    assert pipe.staged.tied  # the embedding's copies on the first and last stage
    for wk in pipe.workers.values():
        assert len(wk.store.grad_pool) == (2 if schedule == "2bw" else 1)
        held = sum(b.nbytes for g in wk.store.grad_pool for b in g.values())
        assert held == pipe.plan.stage_plans[wk.index].memory_grads, (wk.index, held)
