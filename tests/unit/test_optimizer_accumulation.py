"""compile(accumulate="optimizer"): AdamA, each micro-batch's gradient folded into Adam's moments
at once and no gradient buffer — against tests/reference.train_adama (the paper's equations)."""

import copy
import functools
import re
import math

import pytest
import torch

import fxpipe
from fxpipe.demo import GPT, GPTConfig, fibonacci_batch, lm_loss
from fxpipe.errors import ConfigError, NonFiniteError
from fxpipe.weights import weight_bytes
from tests.cases import relative_update_error
from tests.reference import train_adama

LR, WD = 1e-3, 0.01
ADAMW = functools.partial(torch.optim.AdamW, lr=LR, weight_decay=WD)


def gpt(tied=False, steps=10):
    """The demo GPT (untied: AdamA needs each weight on one stage) and its batches."""
    torch.manual_seed(0)
    net = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32, tie_weights=tied))
    g = torch.Generator().manual_seed(3)
    return net, [fibonacci_batch(8, 16, 64, g) for _ in range(steps)]


def compile_adama(net, batches, **kw):
    kw = {"optimizer": ADAMW, "microbatches": 4, "stages": 2, "accumulate": "optimizer", "verbose": False, **kw}
    return fxpipe.compile(copy.deepcopy(net), (batches[0][0][:2],), loss_fn=lm_loss, **kw)


@pytest.mark.parametrize("schedule", ["2bw", "1f1b", "gpipe", "zb"])
def test_matches_the_adama_reference(schedule):
    net, batches = gpt()
    initial = {n: p.detach().clone() for n, p in net.named_parameters()}
    pipe = compile_adama(net, batches, schedule=schedule)
    losses = [pipe.step(*b) for b in batches]
    ref_losses, ref = train_adama(net, batches, 4, lm_loss, lr=LR, weight_decay=WD, schedule=schedule)
    assert "stage 0 AdamA (torch), stage 1 AdamA (torch)" in pipe.describe()
    assert relative_update_error(initial, pipe.state_dict(), dict(ref.named_parameters())) <= 1e-4
    assert max(abs(a - b) for a, b in zip(losses, ref_losses)) <= 1e-5


def test_bf16_adama_stays_near_fp32_adama():
    net, batches = gpt()
    initial = {n: p.detach().clone() for n, p in net.named_parameters()}
    pipe = compile_adama(net, batches, precision="bf16")
    for b in batches:
        pipe.step(*b)
    _, ref = train_adama(net, batches, 4, lm_loss, lr=LR, weight_decay=WD)
    assert relative_update_error(initial, pipe.state_dict(), dict(ref.named_parameters())) <= 0.05


def test_no_gradient_buffer_and_the_planner_counts_the_saving():
    net, batches = gpt(steps=2)
    adama = compile_adama(net, batches, schedule="1f1b")
    plain = compile_adama(net, batches, schedule="1f1b", accumulate="gradients", kernels="torch")
    for pipe in (adama, plain):
        for b in batches:
            pipe.step(*b)
    saved = 0
    for s, wk in adama.workers.items():
        store = wk.store
        assert store.grad_pool == []
        modelled = sum(weight_bytes(sl.numel, sl.dtype.itemsize, requires_grad=sl.requires_grad, schedule="1f1b",
                                    grad_buffers=0, optimizer_bytes_per_param=8, accumulation="optimizer")
                       for sl in store.layout.slots)
        assert store.nbytes() == modelled
        saved += plain.workers[s].store.nbytes() - store.nbytes()
    params = sum(p.numel() for p in net.parameters())
    assert saved == 4 * params  # the fp32 gradient accumulator of the default path (one: a flush schedule)
    # the plan prices each stage's weights with the same model
    assert adama.plan.stage_plans[0].memory < plain.plan.stage_plans[0].memory


def test_a_non_finite_gradient_stops_every_rank_a_step_later():
    net, batches = gpt(steps=6)
    bad = 3

    def loss(out, y):
        return lm_loss(out, y % 64) * torch.where((y >= 64).any(), float("nan"), 1.0)
    batches[bad - 1][1][0, 0] += 64
    pipe = fxpipe.compile(copy.deepcopy(net), (batches[0][0][:2],), loss_fn=loss, optimizer=ADAMW, microbatches=4,
                          stages=2, accumulate="optimizer", verbose=False)
    with pytest.raises(NonFiniteError, match=r"by step 3: with accumulate='optimizer' \(AdamA\).*took it in"):
        for b in batches:
            pipe.step(*b)
    assert pipe.t == bad + 1  # found in the next step's segment, when every rank holds the sum


def test_a_non_finite_gradient_in_the_last_step_before_a_flush_stops_it():
    # Under 2bw the first stage updates batch t in the flush's drain, after batch t's loss sum:
    # the flush carries that update's flag in one more all-reduce, so a save never writes it
    class SqrtAbs(torch.nn.Module):  # finite forward; d/dw sqrt|x w| is NaN where x = 0
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.ones(8))

        def forward(self, x):
            return torch.sqrt((x * self.w).abs())

    torch.manual_seed(0)
    net = torch.nn.Sequential(SqrtAbs(), torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    xs, y = [torch.rand(8, 8) + 0.5 for _ in range(3)], torch.randn(8, 1)
    xs[2][0, 0] = 0.0  # step 3: NaN in the first stage's gradient only; every loss is finite
    pipe = fxpipe.compile(net, (xs[0][:2],), loss_fn=torch.nn.functional.mse_loss, microbatches=4, stages=2,
                          schedule="2bw", optimizer=functools.partial(torch.optim.Adam, lr=1e-3),
                          accumulate="optimizer", verbose=False)
    losses = [pipe.step(x, y) for x in xs]
    assert all(math.isfinite(v) for v in losses)
    with pytest.raises(NonFiniteError, match=r"gradient by step 3: with accumulate='optimizer' \(AdamA\)"):
        pipe.flush()


@pytest.mark.parametrize("frozen", [0, 1], ids=["first-stage", "last-stage"])
def test_a_stage_with_nothing_to_train_runs_under_adama(frozen):
    # fine-tuning with one stage frozen: that stage has no optimizer to fold into
    net, batches = gpt(steps=3)
    planned = compile_adama(net, batches, schedule="1f1b")
    keys = {k for n in planned.workers[frozen].store.opt_params for k in planned.staged.originals[n]}
    for n, p in net.named_parameters():
        p.requires_grad_(n not in keys)
    initial = {n: p.detach().clone() for n, p in net.named_parameters()}
    pipe = compile_adama(net, batches, schedule="1f1b", plan=planned.plan, stages=None)  # the same cut
    assert not pipe.workers[frozen].store.opt_params and pipe.workers[1 - frozen].store.opt_params
    losses = [pipe.step(*b) for b in batches]
    ref_losses, ref = train_adama(net, batches, 4, lm_loss, lr=LR, weight_decay=WD, schedule="1f1b")
    assert relative_update_error(initial, pipe.state_dict(), dict(ref.named_parameters())) <= 1e-4
    assert max(abs(a - b) for a, b in zip(losses, ref_losses)) <= 1e-5


def test_what_adama_cannot_do_is_rejected_at_compile():
    net, batches = gpt(steps=1)
    example = (batches[0][0][:2],)

    def compile_with(model=net, **kw):
        kw = {"optimizer": ADAMW, "microbatches": 4, "stages": 2, "accumulate": "optimizer", "verbose": False, **kw}
        return fxpipe.compile(copy.deepcopy(model), example, loss_fn=lm_loss, **kw)
    with pytest.raises(ConfigError, match=r"max_grad_norm must be compatible with accumulate='optimizer' \(AdamA\), "
                                          r"found 1.0; clipping needs the whole batch's gradient"):
        compile_with(max_grad_norm=1.0)
    with pytest.raises(ConfigError, match=r"precision must be compatible .* found 'fp16'; fp16's loss scale"):
        compile_with(precision="fp16")
    with pytest.raises(ConfigError, match=r"nonfinite must be compatible .* found 'skip'; a non-finite gradient"):
        compile_with(nonfinite="skip")
    with pytest.raises(ConfigError, match=r"accumulate must be 'gradients' or 'optimizer', found 'adam'"):
        compile_with(accumulate="adam")
    with pytest.raises(ConfigError, match=r"holds torch.float64 weights\. Build the model in float32"):
        compile_adama(copy.deepcopy(net).double(), batches)
    with pytest.raises(ConfigError, match=re.escape(
            "fxpipe.compile: accumulate='optimizer' (AdamA) folds each micro-batch's gradient into Adam's moments, so "
            "it needs torch.optim.AdamW, or Adam without weight decay, but the optimizer factory made SGD. Train it "
            "with accumulate='gradients' (the default)")):
        compile_with(optimizer=functools.partial(torch.optim.SGD, lr=0.1))
    with pytest.raises(ConfigError, match=r"needs each weight on one stage; 'wte.weight' is read on stages \[0, 1\]"):
        compile_with(model=gpt(tied=True)[0])
    plan = fxpipe.plan(net, example, stages=1, world_size=2, microbatches=4)
    with pytest.raises(ConfigError, match=r"needs one replica \(width 1\), the plan has width 2.*Pass stages=2"):
        compile_with(stages=None, plan=plan)


def test_adama_resumes_bitwise_from_a_checkpoint(tmp_path):
    net, batches = gpt(steps=6)
    whole = compile_adama(net, batches)
    expected = [whole.step(*b) for b in batches]
    first = compile_adama(net, batches)
    for b in batches[:3]:
        first.step(*b)
    first.save(str(tmp_path))
    first.wait_for_checkpoint()
    second = fxpipe.compile(copy.deepcopy(net), loss_fn=lm_loss, optimizer=ADAMW, microbatches=4, stages=2,
                            accumulate="optimizer", verbose=False)
    second.load(str(tmp_path))
    assert [second.step(*b) for b in batches[3:]] == expected[3:]
    a, b = whole.state_dict(), second.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
