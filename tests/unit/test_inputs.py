"""Bad input is caught before any communication, with a message that says what was expected,
what was found and what to do (fxpipe/inputs.py, PipelineConfig, WeightStore).

Every pipeline here runs in ONE process with tiny inline models. The pipelines the error tests
share are never stepped successfully: a rejected batch must leave them untouched, which
test_rejected_step_leaves_no_state checks on its own pipelines.
"""

import copy
import dataclasses
import enum
import functools
import re

import pytest
import torch
from torch import nn
import torch.nn.functional as F

import fxpipe
from fxpipe.errors import ConfigError, FxpipeError, InputError

B, M = 4, 4  # traced micro-batch size, micro-batches per step
SGD = functools.partial(torch.optim.SGD, lr=0.1)


def _mse(out, y):
    return (out - y).pow(2).mean()


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 4))


class Tagger(nn.Module):
    """Keyword inputs: token ids (a sequence length in dim 1) and a mask."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(50, 16)
        self.head = nn.Linear(16, 4)

    def forward(self, input_ids, mask):
        return self.head(self.emb(input_ids)) * mask.unsqueeze(-1)


def _compile(model=None, example=None, **kw):
    kw = {"loss_fn": _mse, "optimizer": SGD, "microbatches": M, "stages": 2, "schedule": "1f1b",
          "verbose": False, **kw}
    return fxpipe.compile(model if model is not None else _mlp(),
                          example if example is not None else (torch.randn(B, 16),), **kw)


def _batch(n=B * M, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 16, generator=g), torch.randn(n, 4, generator=g)


@pytest.fixture(scope="module")
def pipe():
    return _compile()


@pytest.fixture(scope="module")
def tagger():
    example = {"input_ids": torch.randint(0, 50, (2, 8)), "mask": torch.ones(2, 8)}
    return _compile(Tagger(), example, loss_fn=lambda out, y: out.pow(2).mean())


def _tokens(n=2 * M, seq=8):
    return {"input_ids": torch.randint(0, 50, (n, seq)), "mask": torch.ones(n, seq)}


def _unread(n=2 * M):
    """A target for the tagger's loss, which reads none (a loss_fn always gets one)."""
    return torch.zeros(n)


# ------------------------------------------------------------------------- structure


def test_missing_keyword_input_is_named(tagger):
    batch = _tokens()
    del batch["mask"]
    with pytest.raises(InputError, match=re.escape(
            "step(): missing keyword input ['mask']; the model was traced with keyword inputs "
            "['input_ids', 'mask']. Pass the same inputs as the example, by the same names.")):
        tagger.step(batch, _unread())


def test_unexpected_keyword_input_is_named(tagger):
    batch = {**_tokens(), "labels": torch.zeros(8, 8)}
    with pytest.raises(InputError, match=re.escape(
            "step(): unexpected keyword input ['labels']; the model was traced with keyword inputs "
            "['input_ids', 'mask']")):
        tagger.step(batch, _unread())


def test_wrong_number_of_positional_inputs(pipe):
    x, y = _batch()
    with pytest.raises(InputError, match=re.escape(
            "step(): expected 1 positional input as traced, got 2; the model was traced with 1 positional "
            "input and no keyword inputs")):
        pipe.step((x, x), y)


def test_inputs_of_an_unknown_kind(pipe):
    with pytest.raises(InputError, match=r"step\(\): inputs must be a tensor, a tuple/list .* got str"):
        pipe.step("x", None)


def test_keyword_order_does_not_matter():
    example = {"input_ids": torch.randint(0, 50, (2, 8)), "mask": torch.ones(2, 8)}
    a = _compile(Tagger(), example, loss_fn=lambda out, y: out.pow(2).mean())
    b = _compile(Tagger(), example, loss_fn=lambda out, y: out.pow(2).mean())
    batch = _tokens()
    assert a.step(batch, _unread()) == b.step({"mask": batch["mask"], "input_ids": batch["input_ids"]}, _unread())


# ------------------------------------------------------------------------- shapes, dtypes, devices


def test_feature_size_that_differs(pipe):
    x, y = _batch()
    with pytest.raises(InputError, match=re.escape(
            "step(): input 'input_1' (positional 0): expected size 16 in dim 1 (traced shape [4, 16] per "
            "micro-batch), got 15 (shape [16, 15])")) as e:
        pipe.step(x[:, :15], y)
    assert "compile with an example of the new shape" in str(e.value)


def test_sequence_length_that_differs(tagger):
    batch = _tokens(seq=8)
    batch["input_ids"] = batch["input_ids"][:, :6]
    with pytest.raises(InputError, match=re.escape(
            "step(): input 'input_ids': expected size 8 in dim 1 (traced shape [2, 8] per micro-batch), "
            "got 6 (shape [8, 6])")):
        tagger.step(batch, _unread())


def test_number_of_dims_that_differs(pipe):
    x, y = _batch()
    with pytest.raises(InputError, match=re.escape(
            "expected 2 dims (traced shape [4, 16] per micro-batch), got 3 dims (shape [16, 1, 16])")):
        pipe.step(x.unsqueeze(1), y)


def test_dtype_that_differs(pipe, tagger):
    x, y = _batch()
    with pytest.raises(InputError, match=re.escape(
            "step(): input 'input_1' (positional 0): expected torch.float32 as traced, got torch.float64; "
            "convert with .float()")):
        pipe.step(x.double(), y)
    batch = _tokens()
    batch["input_ids"] = batch["input_ids"].int()
    with pytest.raises(InputError, match=re.escape(
            "input 'input_ids': expected torch.int64 as traced, got torch.int32; convert with .long()")):
        tagger.step(batch, _unread())


def test_every_problem_is_listed(tagger):
    batch = _tokens()
    batch["input_ids"] = batch["input_ids"][:, :6].int()
    batch["mask"] = batch["mask"].double()
    with pytest.raises(InputError, match=r"step\(\): 3 problems with the batch:\n  - input 'input_ids'") as e:
        tagger.step(batch, _unread())
    assert "got 6" in str(e.value) and "got torch.int32" in str(e.value) and "got torch.float64" in str(e.value)


def test_device_other_than_cpu_or_the_pipelines(pipe):
    x, y = _batch()
    with pytest.raises(InputError, match=re.escape(
            "step(): input 'input_1' (positional 0) is on meta, but the pipeline computes on cpu; pass CPU "
            "tensors (.cpu())")):
        pipe.step(x.to("meta"), y)
    with pytest.raises(InputError, match=re.escape("target is on meta, but the pipeline computes on cpu")):
        pipe.step(x, y.to("meta"))


def test_non_tensor_input_must_equal_the_traced_constant():
    class Scaled(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(16, 8), nn.Linear(8, 4)

        def forward(self, x, scale):
            return self.b(self.a(x)) * scale

    p = _compile(Scaled(), (torch.randn(B, 16), 3))
    x, y = _batch()
    with pytest.raises(InputError, match=re.escape(
            "step(): input 'scale' (positional 1): expected the constant 3 the model was traced with (non-tensor "
            "inputs are baked into the graph), got int 5")):
        p.step((x, 5), y)
    assert isinstance(p.step((x, 3), y), float)


class Act(enum.Enum):
    RELU = 1
    TANH = 2


def test_an_enum_input_must_equal_the_traced_one_too():
    # only numbers, strings and None were compared: another enum member was ignored, and the
    # step computed with the traced one
    class Head(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(16, 8), nn.Linear(8, 4)

        def forward(self, x, act=Act.RELU):
            h = self.a(x)
            return self.b(torch.relu(h) if act is Act.RELU else torch.tanh(h))

    p = _compile(Head(), {"x": torch.randn(B, 16), "act": Act.RELU})
    x, y = _batch()
    with pytest.raises(InputError, match=re.escape(
            "eval_step(): input 'act': expected the constant <Act.RELU: 1> the model was traced with (non-tensor "
            "inputs are baked into the graph), got Act <Act.TANH: 2>")):
        p.eval_step({"x": x, "act": Act.TANH}, y)
    with pytest.raises(InputError, match=re.escape("input 'act': expected the constant <Act.RELU: 1>")):
        p.step({"x": x, "act": 1}, y)
    assert isinstance(p.step({"x": x, "act": Act.RELU}, y), float)


@dataclasses.dataclass(frozen=True)
class _Mode:
    """A constant object of the kind torch.export refuses as an input (neither a tensor, a number,
    a string, nor a registered pytree node)."""
    scale: float


def test_a_constant_object_input_is_exported_baked_in_and_must_equal_the_traced_one():
    # export refuses such an input (and, before torch 2.12, an enum member too: on torch 2.11
    # the enum test above failed to compile, symbolic_trace refusing the non-tensor input as well)
    class Scaled(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(16, 8), nn.Linear(8, 4)

        def forward(self, x, mode):
            return self.b(torch.relu(self.a(x)) * mode.scale)

    model = Scaled()
    eager = copy.deepcopy(model)
    p = _compile(model, {"x": torch.randn(B, 16), "mode": _Mode(2.0)})
    assert p.trace_info.path == "export"
    assert "forward" not in vars(model)  # the model's own forward is back
    x, y = _batch()
    with pytest.raises(InputError, match=re.escape("input 'mode': expected the constant _Mode(scale=2.0)")):
        p.eval_step({"x": x, "mode": _Mode(3.0)}, y)
    got = p.eval_step({"x": x, "mode": _Mode(2.0)}, y)
    with torch.no_grad():
        expected = sum(float(_mse(eager(a, _Mode(2.0)), b)) for a, b in zip(x.chunk(M), y.chunk(M))) / M
    assert got == pytest.approx(expected, rel=1e-6)


class _Plain:
    """A config object compared by identity (no ``__eq__``)."""

    def __init__(self, scale):
        self.scale = scale

    def __repr__(self):
        return f"_Plain({self.scale})"


def test_a_constant_compared_by_identity_must_be_the_traced_object_and_the_graph_takes_it():
    # another _Plain(10.0) was accepted and the step computed with the traced 1.0 (loss 1.99 where
    # eager gave 11.4); and the graph's input check compared a stand-in string with the real value
    # (fxpipe.trace(model, ex)(**ex) and cost_mode="calibrated" raised)
    class Scaled(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(16, 8), nn.Linear(8, 4)

        def forward(self, x, cfg, act=Act.RELU):
            h = self.a(x) * cfg.scale
            return self.b(torch.relu(h) if act is Act.RELU else torch.tanh(h))

    cfg = _Plain(1.0)
    example = {"x": torch.randn(B, 16), "cfg": cfg, "act": Act.RELU}
    model = Scaled()
    assert fxpipe.trace(model, example)(**example).shape == (B, 4)
    p = _compile(model, example, cost_mode="calibrated")
    x, y = _batch()
    with pytest.raises(InputError, match=re.escape("input 'cfg': expected the constant _Plain(1.0) (the same object: "
                                                   "its class compares by identity) the model was traced with")):
        p.eval_step({"x": x, "cfg": _Plain(10.0), "act": Act.RELU}, y)
    assert isinstance(p.step({"x": x, "cfg": cfg, "act": Act.RELU}, y), float)


# ------------------------------------------------------------------------- batch sizes


def test_an_example_whose_tensors_disagree_on_dim_0_is_refused_at_compile():
    # a (T, T) mask every sample shares beside a (b, T, F) batch: compile took b from the mask,
    # and step() then asked for sizes no batch could meet
    class Masked(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 4)

        def forward(self, mask, x):
            return self.b(mask @ torch.relu(self.a(x)))

    with pytest.raises(ConfigError, match=re.escape(
            "fxpipe.compile: the example is one micro-batch, and every tensor input is cut along dim 0 into the "
            "micro-batches, so all of them need the micro-batch size there; found 5 in input 'mask' (positional 0) "
            "and 2 in input 'x' (positional 1). A tensor every sample shares (a mask, a table) belongs in the "
            "model: register it as a buffer")):
        _compile(Masked(), (torch.ones(5, 5), torch.randn(2, 5, 8)))


def test_batch_that_does_not_split_into_the_micro_batches(pipe):
    x, y = _batch(7)
    with pytest.raises(InputError, match=re.escape(
            "step(): the batch has 7 samples, which does not split into 4 equal micro-batches; pass 16 samples "
            "(4 per micro-batch x 4 micro-batches), got 7.")):
        pipe.step(x, y)


def test_batch_of_the_wrong_size_one_replica(pipe):
    x, y = _batch(8)
    with pytest.raises(InputError, match=re.escape(
            "step(): pass 16 samples (4 per micro-batch x 4 micro-batches), got 8. The micro-batch size b = 4 is "
            "fixed by the traced example; to train on 8 samples per step, compile with an example micro-batch "
            "of 2 samples.")) as e:
        pipe.step(x, y)
    assert "replica" not in str(e.value)


def test_a_short_batch_points_at_the_data_loaders_last_batch(pipe):
    hint = ("If it is the shorter last batch of an epoch, build the DataLoader with drop_last=True: every step "
            "trains on the same number of samples.")
    for n in (7, 8):  # fewer samples than a step takes, whether or not they split into the micro-batches
        with pytest.raises(InputError) as e:
            pipe.step(*_batch(n))
        assert str(e.value).endswith(hint)
    with pytest.raises(InputError) as e:  # more than a step takes is no loader's last batch
        pipe.step(*_batch(32))
    assert "drop_last" not in str(e.value)


def test_batch_of_the_wrong_size_two_replicas():
    model, example = _mlp(), (torch.randn(B, 16),)
    plan = fxpipe.plan(model, example, stages=2, microbatches=M, schedule="1f1b", world_size=4)
    assert (plan.stages, plan.width) == (2, 2)
    p = _compile(model, example, plan=plan)
    x, y = _batch(16)
    with pytest.raises(InputError, match=re.escape(
            "step(): the plan has w = 2 data-parallel replicas: pass 32 samples (4 per micro-batch x 4 "
            "micro-batches x 2 replicas), got 16.")):
        p.step(x, y)
    x, y = _batch(12)
    with pytest.raises(InputError, match=re.escape(
            "step(): the batch has 12 samples, which does not split into 8 equal micro-batches (4 micro-batches "
            "x 2 replicas); the plan has w = 2 data-parallel replicas: pass 32 samples")):
        p.step(x, y)
    assert "global batch: b·m·w = 4 x 4 x 2 = 32 samples per step" in str(p.plan)
    x, y = _batch(32)
    assert isinstance(p.step(x, y), float)


def test_inputs_that_disagree_on_the_batch_size(tagger):
    batch = _tokens()
    batch["mask"] = batch["mask"][:4]
    with pytest.raises(InputError, match=re.escape(
            "step(): pass 8 samples (2 per micro-batch x 4 micro-batches), got 4 in input 'mask'.")):
        tagger.step(batch, _unread())


def test_target_batch_must_match_the_inputs(pipe):
    x, y = _batch()
    with pytest.raises(InputError, match=re.escape(
            "step(): target: expected 16 samples in dim 0 like the inputs (4 per micro-batch x 4 micro-batches), "
            "got 8: the target is split along dim 0")):
        pipe.step(x, y[:8])
    # a wrong batch is reported once, not again for a target that matches it
    with pytest.raises(InputError) as e:
        pipe.step(x[:8], y[:8])
    assert "target" not in str(e.value)


def test_a_target_unlike_the_first_batchs_is_refused_and_the_pipeline_goes_on():
    # compile takes no example target: the first batch's sets its nesting, dtypes and sizes beyond
    # dim 0. Another one failed inside loss_fn on the last stage, mid-step, and the pipeline could
    # not go on ("ranks stopped part-way through it")
    p = _compile()
    x, y = _batch()
    first = p.step(x, y)
    for target, message in [
        (y.double(), "target: expected torch.float32 as in the first batch's target, got torch.float64; convert "
                     "with .float()"),
        (y[:, :3], "target: expected a torch.float32 tensor of shape [N, 4] as in the first batch's target, got "
                   "shape [16, 3]. A target's dims beyond the batch dim 0 stay as in the first batch, like the "
                   "inputs': pad or truncate to that size"),
        ({"y": y}, "target: expected a tensor as the first batch's target was, got a dict with keys ['y']; pass "
                   "the target in the same structure every step"),
        (3, "target: expected a torch.float32 tensor of shape [N, 4] as in the first batch's target, got int 3"),
    ]:
        with pytest.raises(InputError, match=re.escape(message)):
            p.step(x, target)
    with pytest.raises(InputError, match=re.escape("eval_step(): target: expected torch.float32")):
        p.eval_step(x, y.double())
    assert isinstance(p.step(x, y), float) and p.steps == 2 and first != p.step(x, y)


def test_a_dict_targets_key_order_and_a_numbers_type_are_free():
    def loss_fn(out, target):
        return _mse(out, target["y"]) * target["w"]

    p = _compile(loss_fn=loss_fn)
    x, y = _batch()
    p.step(x, {"y": y, "w": 1.0})
    assert isinstance(p.step(x, {"w": 2, "y": y}), float)  # another order, an int: as eager would take them
    with pytest.raises(InputError, match=re.escape("target['y']: expected a torch.float32 tensor of shape [N, 4] as "
                                                   "in the first batch's target, got int 2")):
        p.step(x, {"w": y, "y": 2})


def test_eval_step_checks_its_batch_too(pipe):
    x, y = _batch(8)
    with pytest.raises(InputError, match=re.escape("eval_step(): pass 16 samples")) as e:
        pipe.eval_step(x, y)
    # not step()'s "to train on 8 samples per step" advice
    assert str(e.value).endswith("and eval_step runs the training step's 4 micro-batches: evaluate a set of another "
                                 "size in batches of 16 (the last one dropped, or padded with samples the loss "
                                 "ignores).")


# ------------------------------------------------------------------------- the target and the loss


def test_a_missing_target_is_named_before_anything_runs(pipe):
    x, _ = _batch()
    message = ("step(): target: expected a target, since loss_fn(output, target) computes the loss, got None; pass "
               "the target of the same samples as the second argument (it is split along dim 0 like the inputs), "
               "or compile with loss_fn=None if the model's output is the loss")
    with pytest.raises(InputError, match=re.escape(message)):
        pipe.step(x)
    with pytest.raises(InputError, match=re.escape("eval_step(): target: expected a target")):
        pipe.eval_step(x)
    assert pipe.t == 0  # nothing was fed or run (test_rejected_step_leaves_no_state: nor under 2bw)
    lazy = fxpipe.compile(_mlp(), loss_fn=_mse, optimizer=SGD, microbatches=M, stages=2, verbose=False)
    with pytest.raises(InputError, match=re.escape(message)):
        lazy.step(x)
    assert lazy.plan is None  # nothing was traced or planned


class Scalar(nn.Module):
    """Its output is its loss."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(16, 8), nn.Linear(8, 4)

    def forward(self, x):
        return self.b(self.a(x)).pow(2).mean()


class Pair(nn.Module):
    """Two outputs, neither of them a loss."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(16, 4)

    def forward(self, x):
        return self.a(x), x.sum()


def test_a_target_without_a_loss_fn_is_refused():
    p = _compile(Scalar(), loss_fn=None)
    x, y = _batch()
    with pytest.raises(InputError, match=re.escape(
            "step(): target: expected None, since with loss_fn=None the model's output (or its .loss) is the loss "
            "and nothing reads a target, got a Tensor; pass loss_fn=... to compute the loss from the output and the "
            "target, or leave the target out (a Hugging Face model takes labels among its inputs)")):
        p.step(x, y)
    assert p.t == 0
    assert isinstance(p.step(x), float)


class TakesItsLabels(nn.Module):
    """A model of (x, y) that computes its own loss, in a dict under "loss"."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(16, 4)

    def forward(self, x, y):
        return {"loss": F.mse_loss(self.a(x), y)}


def test_the_inputs_of_a_model_that_takes_its_labels_go_in_one_tuple():
    # step(x, y) for a model of (x, y) with loss_fn=None read y as the target and said only that
    # one positional input was missing. It now says where y went, and how to pass it.
    x, y = _batch()
    p = _compile(TakesItsLabels(), (x[:B], y[:B]), loss_fn=None)
    with pytest.raises(InputError, match=re.escape(
            "step(): got 1 positional input and a target, but the model was traced with 2 positional inputs and no "
            "keyword inputs and, with loss_fn=None, takes no target (its output, or its .loss, is the loss). Pass "
            "all of the model's inputs as one tuple, step((x, y)), or compile with loss_fn=... to compute the loss "
            "from the output and the target.")):
        p.step(x, y)
    assert p.t == 0
    assert isinstance(p.step((x, y)), float)


def test_loss_fn_none_needs_a_model_that_returns_its_loss():
    expected = ("fxpipe.compile: loss_fn=None means the model's output is the loss: expected a scalar tensor or an "
                "output with a scalar .loss, but {} returns {}. Pass loss_fn=lambda output, target: ... (and the "
                "target to step()), or make the model return its loss.")
    with pytest.raises(ConfigError, match=re.escape(expected.format("Sequential", "a tensor of shape [4, 4]"))):
        _compile(loss_fn=None)
    with pytest.raises(ConfigError, match=re.escape(expected.format("Pair", "a tuple of 2 values, without a .loss"))):
        _compile(Pair(), loss_fn=None)
    lazy = fxpipe.compile(_mlp(), optimizer=SGD, microbatches=M, stages=2, verbose=False)  # found at the first step
    with pytest.raises(ConfigError, match=re.escape(expected.format("Sequential", "a tensor of shape [4, 4]"))):
        lazy.step(_batch()[0])
    assert lazy.plan is None


class LossAndLogits(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(16, 4)

    def forward(self, x):
        out = self.a(x)
        return out.pow(2).mean(), out


@pytest.mark.parametrize("loss_fn,message", [
    (lambda out, y: (out - y).pow(2).mean(1), "the loss must be a scalar tensor; found Tensor(4,). Make loss_fn return a "
                                               "mean/sum."),
    (lambda out, y: torch.tensor(float((out - y).pow(2).mean())),
     "the loss (torch.float32) does not depend on the model's output through autograd, so there is nothing to "
     "backpropagate: loss_fn detached it (.item(), .detach(), torch.tensor(...), an integer or comparison op, numpy)"),
])
def test_a_loss_fn_that_gives_no_scalar_to_backpropagate_is_named(loss_fn, message):
    # the detached one got only autograd's "element 0 of tensors does not require grad"
    p = _compile(loss_fn=loss_fn)
    with pytest.raises(TypeError, match=re.escape(message)):
        p.step(*_batch())


def test_a_model_returning_its_loss_first_in_a_tuple_is_told_how_fxpipe_reads_it():
    with pytest.raises(ConfigError, match=re.escape(
            "LossAndLogits returns a tuple of 2 values, without a .loss. Pass loss_fn=lambda output, target: ... (and "
            "the target to step()), or make the model return its loss. Its first value is a scalar: if that is the "
            "loss, return a dict with a 'loss' key ({'loss': loss, 'logits': logits}), which fxpipe reads, or the "
            "loss alone.")):
        _compile(LossAndLogits(), loss_fn=None)


def test_an_example_that_does_not_fit_forward_says_how_to_pass_it():
    # both tracers failed inside inspect ("too many positional arguments") and the advice was
    # about leaf modules and control flow
    class KeywordOnly(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(16, 4)

        def forward(self, *, x, mask):
            return self.a(x * mask)

    x = torch.randn(B, 16)
    with pytest.raises(fxpipe.errors.TraceError, match=re.escape(
            "fxpipe could not trace KeywordOnly: the example inputs do not fit KeywordOnly.forward(*, x, mask) (too "
            "many positional arguments; the example gives 2 positional inputs). The example is one micro-batch of "
            "what forward takes: a tuple of its positional inputs, or a dict of its inputs by name; its keyword-only "
            "parameters ['x', 'mask'] take a dict example, e.g. {'x': ..., 'mask': ...}")):
        _compile(KeywordOnly(), (x, x))
    with pytest.raises(fxpipe.errors.TraceError, match=re.escape(
            "the example inputs do not fit Sequential.forward(input) (missing a required argument: 'input'; the "
            "example gives 0 positional inputs and keyword inputs ['x'])")):
        _compile(_mlp(), {"x": x})
    assert isinstance(_compile(KeywordOnly(), {"x": x, "mask": x}).step({"x": torch.randn(B * M, 16),
                                                                            "mask": torch.ones(B * M, 16)},
                                                                           torch.randn(B * M, 4)), float)


def test_an_lr_scheduler_instance_is_told_to_pass_a_factory():
    made = torch.optim.lr_scheduler.StepLR(torch.optim.SGD([nn.Parameter(torch.ones(1))], lr=0.1), 2)
    with pytest.raises(ConfigError, match=re.escape(
            "lr_scheduler must be a callable taking the optimizer and returning a scheduler (or None), found "
            "<torch.optim.lr_scheduler.StepLR object")) as e:
        _compile(lr_scheduler=made)
    assert "functools.partial(torch.optim.lr_scheduler.StepLR, step_size=10)" in str(e.value)


def test_a_hugging_face_model_without_labels_is_told_to_pass_them():
    from tests.models import gpt2_tiny

    model, example = gpt2_tiny(batch=1, seq=4)
    with pytest.raises(ConfigError, match=re.escape(
            "but GPT2LMHeadModel returns a CausalLMOutputWithCrossAttentions with fields ['logits'], without a "
            ".loss.")) as e:
        fxpipe.compile(model, example, microbatches=2, stages=2, verbose=False)
    assert "pass labels among the example inputs and in every batch" in str(e.value)


class CastsItsInput(nn.Module):
    """Takes a float64 input and casts it itself: fine in eager, fine here."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(16, 8), nn.Linear(8, 4)

    def forward(self, x):
        return self.b(torch.relu(self.a(x.float())))


def test_an_example_whose_dtype_a_product_refuses_is_refused_at_compile():
    # eager refuses a float64 input to a float32 Linear; the trace's fake kernels do not, so
    # without this check the pipeline would plan and build and fail in its first step
    wide = torch.randn(B, 16, dtype=torch.float64)
    with pytest.raises(ConfigError, match=re.escape(
            "fxpipe.compile: linear at node 'linear' (module '0') needs one dtype for all its operands, as in eager "
            "PyTorch, but found input_1 float64, 0.weight float32, 0.bias float32: 'input_1' is float64, from the "
            "example input(s) ['input_1']. Training would fail at its first step. To fix it, give the inputs the "
            "model's dtype (x.float() in the example and in every batch); or convert the model to float64 "
            "(model.to(torch.float64)).")):
        _compile(example=(wide,))
    # autocast leaves float64 alone: mixed precision does not help, and the model stays float32
    with pytest.raises(ConfigError, match=re.escape(
            "but found input_1 float64, 0.weight float32 (as bfloat16 under autocast), 0.bias float32 (as bfloat16 "
            "under autocast): 'input_1' is float64, from the example input(s) ['input_1']. Training would fail at "
            "its first step. To fix it, give the inputs the model's dtype (x.float() in the example and in every "
            "batch).")):
        _compile(example=(wide,), precision="bf16")
    # a bf16 input: autocast would cast both operands
    with pytest.raises(ConfigError, match=re.escape(
            "or convert the model to bfloat16 (model.to(torch.bfloat16)); or train with precision='bf16' or "
            "'fp16', whose autocast casts both operands.")):
        _compile(example=(torch.randn(B, 16).bfloat16(),))
    x, y = _batch()
    assert isinstance(_compile(example=(torch.randn(B, 16).bfloat16(),), precision="bf16").step(x.bfloat16(), y),
                      float)
    assert isinstance(_compile(CastsItsInput(), (wide,)).step(x.double(), y), float)
    lazy = fxpipe.compile(_mlp(), loss_fn=_mse, optimizer=SGD, microbatches=M, stages=2, verbose=False)
    with pytest.raises(ConfigError, match="needs one dtype for all its operands"):  # found at the first step
        lazy.step(x.double(), y)
    assert lazy.plan is None


class Upsample(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.head = nn.ConvTranspose1d(2, 4, 3), nn.Linear(40, 4)

    def forward(self, x):
        return self.head(self.up(x).flatten(1))


def test_a_transposed_convolution_of_another_dtype_names_its_module():
    with pytest.raises(ConfigError, match=re.escape(
            "fxpipe.compile: conv_transpose1d at node 'conv_transpose1d' (module 'up') needs one dtype for all its "
            "operands")):
        _compile(Upsample(), (torch.randn(B, 2, 8, dtype=torch.float64),))


# ------------------------------------------------------------------------- the lazy path


def test_lazy_path_first_batch_defines_the_signature():
    pipe = fxpipe.compile(_mlp(), loss_fn=_mse, optimizer=SGD, microbatches=M, stages=2, schedule="1f1b",
                          verbose=False)
    x, y = _batch()
    with pytest.raises(InputError, match=re.escape(
            "step(): the batch has 7 samples, which does not split into 4 equal micro-batches; the first step "
            "traces the model on one micro-batch of it. Pass a multiple of 4 samples, e.g. 8.")):
        pipe.step(x[:7], y[:7])
    with pytest.raises(InputError, match=re.escape(
            "step(): every tensor of the first batch needs the same number of samples in dim 0, got 16 in "
            "positional input 0, 8 in target")):
        pipe.step(x, y[:8])
    with pytest.raises(InputError, match=re.escape(  # not planned on micro-batches of 0 samples
            "step(): the batch is empty (0 samples in dim 0); pass a global batch of a multiple of 4 samples.")):
        pipe.step(x[:0], y[:0])
    assert pipe.plan is None  # nothing was built
    assert isinstance(pipe.step(x, y), float)
    assert pipe.inputs.batch_size == B
    with pytest.raises(InputError, match=re.escape(
            "step(): pass 16 samples (4 per micro-batch x 4 micro-batches), got 8")):
        pipe.step(x[:8], y[:8])
    with pytest.raises(InputError, match=re.escape("expected size 16 in dim 1 (traced shape [4, 16] per micro-batch)")):
        pipe.step(x[:, :15], y)


# ------------------------------------------------------------------------- nothing was sent


def test_rejected_step_leaves_no_state():
    """2bw carries micro-batches across steps: a rejected batch must not count, feed or post
    anything, so the run after it equals a run without it, loss for loss and weight for weight."""
    batches = [_batch(seed=s) for s in (1, 2, 3)]

    def run(reject: bool):
        p = _compile(schedule="2bw")
        losses = []
        for i, (x, y) in enumerate(batches):
            if reject:
                for bad in ((x[:8], y[:8]), (x.double(), y), (x, y[:8]), (x, None)):
                    with pytest.raises(InputError):
                        p.step(*bad)
                assert p.t == i
            losses.append(p.step(x, y))
        return losses, p.state_dict()

    (clean, sd_clean), (rejected, sd_rejected) = run(False), run(True)
    assert clean == rejected
    assert all(torch.equal(sd_clean[k], sd_rejected[k]) for k in sd_clean)


# ------------------------------------------------------------------------- compile's arguments


@pytest.mark.parametrize("kwargs,message", [
    (dict(microbatches=0), "fxpipe.compile: microbatches must be an int >= 1 (or None), found 0; pass e.g. "
                           "microbatches=4, or None for the default (8)"),
    (dict(max_grad_norm=0.0), "fxpipe.compile: max_grad_norm must be a number > 0 (or None for no clipping), found "
                              "0.0; pass e.g. max_grad_norm=1.0, or None to train without clipping"),
    (dict(schedule="pipedream"), "fxpipe.compile: schedule must be '2bw', '1f1b', 'gpipe' or 'zb', found 'pipedream'; "
                                 "'2bw' is PipeDream-2BW (the default), '1f1b' PipeDream-Flush, 'gpipe' GPipe, 'zb' "
                                 "zero-bubble ZB-H1"),
    (dict(device="tpu"), "fxpipe.compile: device must be 'auto', 'cpu' or 'cuda[:i]' (or None, or a torch.device of "
                         "those), found 'tpu'; fxpipe computes on the CPU or on CUDA GPUs"),
    (dict(device=torch.device("mps")), "device must be 'auto', 'cpu' or 'cuda[:i]' (or None, or a torch.device of "
                                       "those), found device(type='mps')"),
    (dict(timeout=0), "fxpipe.compile: timeout must be a number of seconds > 0 (or None), found 0; pass e.g. "
                      "timeout=600, or None for 300 s (or the process group's own)"),
    (dict(nonfinite="ignore"), "fxpipe.compile: nonfinite must be 'raise' or 'skip' (or None), found 'ignore'; 'raise' stops "
                               "at a NaN/inf loss or gradient, 'skip' drops that step's update and trains on"),
    (dict(recompute="yes"), "fxpipe.compile: recompute must be True, False or None, found 'yes'; True recomputes "
                            "activations in the backward where that saves memory, False never, None lets the planner "
                            "decide"),
    (dict(device_model="cpu"), "fxpipe.compile: device_model must be a fxpipe.cost.DeviceModel (or None), found 'cpu'; "
                               "pass e.g. fxpipe.cost.DeviceModel.for_device(torch.device('cpu')) with your figures "
                               "replaced, or None for the device's defaults; the device to compute on is device="),
    (dict(stages=4, microbatches=2), "fxpipe.compile: microbatches must be >= stages = 4 for schedule='2bw', found 2; "
                                     "2bw's weight-version rule needs a step of at least one micro-batch per stage: "
                                     "pass microbatches >= 4, fewer stages, or schedule='1f1b' or 'zb', which take fewer"),
    (dict(schedule="zb", lookahead=1), "fxpipe.compile: lookahead=1 runs forwards ahead of 1F1B's order, which only "
                                       "2bw and 1f1b follow; found schedule='zb': pass lookahead=0, or schedule='2bw' "
                                       "or '1f1b'"),
    (dict(lookahead=True), "fxpipe.compile: lookahead must be an int >= 0, found True"),
    (dict(stages=2, microbatches=3, lookahead=2), "fxpipe.compile: microbatches must be >= stages + lookahead = 4 for "
                                                 "schedule='2bw' with lookahead=2, found 3; each forward of lookahead "
                                                 "moves 2bw's warm-up one micro-batch further: pass microbatches >= 4 "
                                                 "or lookahead=1"),
    (dict(plan={"stages": 2}), "fxpipe.compile: plan must be a fxpipe.Plan or its JSON (Plan.to_json()), or None, found a "
                               "dict; pass fxpipe.plan(model, example_inputs, ...)'s result or the text of `fxpipe plan "
                               "--json PATH` (to ask for a depth alone, pass stages= instead)"),
    (dict(plan="not json"), "fxpipe.compile: plan must be a fxpipe.Plan or its JSON (Plan.to_json()), found a string that "
                            "is no plan's JSON (JSONDecodeError: Expecting value: line 1 column 1 (char 0)); pass the "
                            "text Plan.to_json() or `fxpipe plan --json PATH` wrote"),
])
def test_compile_rejects_bad_arguments(kwargs, message):
    with pytest.raises(ConfigError, match=re.escape(message)) as e:
        fxpipe.compile(_mlp(), (torch.randn(B, 16),), verbose=False, **kwargs)
    assert isinstance(e.value, FxpipeError) and isinstance(e.value, ValueError)


def test_optimizer_factory_must_return_an_optimizer():
    with pytest.raises(ConfigError, match=re.escape(
            "optimizer factory returned list, expected a torch.optim.Optimizer (a factory without return gives None); "
            "pass e.g. functools.partial(torch.optim.AdamW, lr=1e-3)")):
        _compile(optimizer=lambda named: [p for _, p in named])
    with pytest.raises(ConfigError, match=re.escape("optimizer factory returned NoneType, expected")):
        _compile(optimizer=lambda named: None)  # forgot return: nothing would train


def test_an_optimizer_that_needs_a_closure_or_sparse_gradients_is_refused_at_compile():
    # both compiled, and failed at the first UPDATE, mid-step, leaving the pipeline broken
    with pytest.raises(ConfigError, match=re.escape(
            "fxpipe.compile: LBFGS.step needs a closure that re-evaluates the loss, but a pipeline steps each "
            "stage's optimizer once per batch with the gradients its micro-batches accumulated, and has no closure "
            "to give it. Use an optimizer that steps on gradients alone (SGD, Adam, AdamW, ...)")):
        _compile(optimizer=lambda named: torch.optim.LBFGS([p for _, p in named]))
    with pytest.raises(ConfigError, match=re.escape(
            "fxpipe.compile: SparseAdam takes sparse gradients only, but fxpipe accumulates every weight's gradient "
            "densely (in flat buffers). Use torch.optim.Adam or AdamW")):
        _compile(optimizer=lambda named: torch.optim.SparseAdam([p for _, p in named]))


def test_an_optimizer_over_tensors_the_factory_was_not_given_is_refused():
    # the DDP habit: an optimizer over the model's own parameters, which fxpipe does not train
    model = _mlp()
    with pytest.raises(ConfigError, match=r"the optimizer the factory returned holds 4 tensor\(s\) that are not among "
                                          r"the 2 parameters it was given \(\[.*\]\), which the stage would never "
                                          r"update: build it over the \(name, parameter\) pairs the factory "
                                          r"receives, not over model\.parameters\(\)"):
        _compile(model, optimizer=lambda named: torch.optim.SGD(model.parameters(), lr=0.1))


def test_a_factory_choosing_parameters_by_name_may_leave_a_stage_nothing_to_step():
    # the last Linear alone trains, as in eager: stage 0 holds none of it, and its optimizer's
    # group is empty (it was refused as "steps none of the parameters it was given")
    def last_only(named):
        return torch.optim.SGD([{"params": [p for n, p in named if n.startswith("2.")]}], lr=0.1)

    model = _mlp()
    eager = copy.deepcopy(model)
    pipe = _compile(model, optimizer=last_only)
    opt = last_only(list(eager.named_parameters()))
    x, y = _batch()
    for _ in range(2):
        pipe.step(x, y)
        opt.zero_grad()
        for a, b in zip(x.chunk(M), y.chunk(M)):
            (_mse(eager(a), b) / M).backward()
        opt.step()
    got = pipe.state_dict()
    for k, v in eager.state_dict().items():
        assert torch.allclose(got[k], v, rtol=1e-6, atol=1e-7), k
    assert torch.equal(got["0.weight"], model.state_dict()["0.weight"])


def test_an_optimizer_factory_that_raises_is_told_it_sees_one_stage():
    def by_name(named):  # looks up a parameter another stage holds
        return torch.optim.SGD([dict(named)["0.weight"]], lr=0.1)

    with pytest.raises(ConfigError, match=r"the optimizer factory raised KeyError: '0\.weight', on a stage holding \d+ "
                                          r"trainable parameters \[.*\]\. It is called once per stage with that "
                                          r"stage's \(name, parameter\) pairs only") as e:
        _compile(optimizer=by_name)
    assert isinstance(e.value.__cause__, KeyError)


def test_a_model_with_nothing_to_train_is_refused():
    model = _mlp().requires_grad_(False)
    with pytest.raises(ConfigError, match=r"fxpipe\.compile: nothing to train: every parameter of Sequential has "
                                          r"requires_grad=False"):
        _compile(model)


def test_arguments_that_contradict_the_plan_are_refused():
    model, example = _mlp(), (torch.randn(B, 16),)
    plan = fxpipe.plan(model, example, stages=2, microbatches=M, schedule="1f1b", recompute=False)
    with pytest.raises(ConfigError, match=re.escape(
            "fxpipe.compile: stages=3 contradicts the plan, which has 2 stages (width 1); the plan's would run. Pass "
            "stages=None (or 2) to run the plan, or make a plan for 3 stages (fxpipe.plan(..., stages=3)).")):
        _compile(model, example, plan=plan, stages=3)
    with pytest.raises(ConfigError, match=re.escape(
            "fxpipe.compile: recompute=True contradicts the plan, which recomputes on no stage; the plan's "
            "recomputation would run. Pass recompute=None to run the plan as it is, or make a plan with "
            "fxpipe.plan(..., recompute=True).")):
        _compile(model, example, plan=plan.to_json(), stages=None, recompute=True)
    with pytest.raises(ConfigError, match=re.escape(
            "fxpipe.compile: precision='bf16' contradicts the plan, made for precision='fp32': compile's precision "
            "would run on stages whose memory and time were priced for another. Pass precision='fp32', or make a "
            "plan for it (fxpipe.plan(..., precision='bf16')).")):
        _compile(model, example, plan=plan, precision="bf16")
    with pytest.raises(ConfigError, match=re.escape(
            "fxpipe.compile: schedule='2bw' contradicts the plan, made for schedule='1f1b': its cuts, memory and time "
            "were priced for that schedule. Pass schedule='1f1b', or make a plan for it (fxpipe.plan(..., "
            "schedule='2bw')).")):
        _compile(model, example, plan=plan, schedule="2bw")
    with pytest.raises(ConfigError, match=re.escape(
            f"fxpipe.compile: microbatches={2 * M} contradicts the plan, which runs m={M} (a global batch of b*m*w = "
            f"{B}*{M}*1); the plan's would run. Pass microbatches=None (or {M}) to run the plan, or make a plan for "
            f"{2 * M} (fxpipe.plan(..., microbatches={2 * M})).")):
        _compile(model, example, plan=plan, microbatches=2 * M)
    with pytest.raises(ConfigError, match=re.escape(
            "fxpipe.compile: lookahead=1 contradicts the plan, which runs lookahead=0; the plan's would run. Pass "
            "lookahead=None to run the plan as it is, or make a plan with fxpipe.plan(..., lookahead=1).")):
        _compile(model, example, plan=plan, lookahead=1)
    assert _compile(model, example, plan=plan, stages=2, recompute=False, lookahead=0).plan == plan


def test_a_lazy_pipeline_cuts_its_first_micro_batch_by_the_plans_width():
    model, example = _mlp(), (torch.randn(B, 16),)
    plan = fxpipe.plan(model, example, stages=2, microbatches=M, schedule="1f1b", world_size=4)
    assert plan.width == 2
    lazy = fxpipe.compile(model, loss_fn=_mse, optimizer=SGD, microbatches=M, schedule="1f1b", plan=plan,
                          verbose=False)
    assert isinstance(lazy.step(*_batch(B * M * 2)), float)
    assert lazy.plan == plan


def test_lr_scheduler_factory_must_return_a_scheduler():
    with pytest.raises(ConfigError, match=re.escape(
            "fxpipe.compile: the lr_scheduler factory returned int, expected a scheduler with a .step() method (a "
            "torch.optim.lr_scheduler.LRScheduler), stepped once per step; pass e.g. lambda optimizer: "
            "torch.optim.lr_scheduler.StepLR(optimizer, step_size=100)")):
        _compile(lr_scheduler=lambda optimizer: 5)
    with pytest.raises(ConfigError, match=re.escape("the lr_scheduler factory returned NoneType, expected a scheduler")):
        _compile(lr_scheduler=lambda optimizer: None)  # forgot return: the lr would never change
    with pytest.raises(ConfigError, match=re.escape(
            "fxpipe.compile: the lr_scheduler factory raised TypeError: StepLR.__init__() missing 1 required "
            "positional argument: 'step_size'. It is called once per stage with that stage's optimizer and must "
            "return its scheduler; pass e.g. functools.partial(torch.optim.lr_scheduler.StepLR, step_size=100)")):
        _compile(lr_scheduler=torch.optim.lr_scheduler.StepLR)  # its step_size not given


def test_input_errors_are_fxpipe_and_value_errors(pipe):
    with pytest.raises(FxpipeError):
        pipe.step(*_batch(8))
    with pytest.raises(ValueError):
        pipe.step(*_batch(8))


# ------------------------------------------------------------------------- the printed plan


def test_describe_states_the_global_batch_and_verbose_false_is_silent(capsys):
    p = _compile(verbose=False)
    assert capsys.readouterr().out == ""
    assert "global batch: b·m·w = 4 x 4 x 1 = 16 samples per step" in p.describe()
    _compile(verbose=True)
    assert "global batch: b·m·w = 4 x 4 x 1 = 16 samples per step" in capsys.readouterr().out
