"""trace: the captured graph computes what the model computes, on the model's own parameters.

Per model of the zoo: same outputs, same gradients on the SAME Parameter objects, the same
dropout draws under the same seed; then the clean-ups (tied weights read through one
parameter, no guard node, no dead reads), the node metadata, the symbolic_trace fallback with
leaf modules, and the error for a model nothing can trace.
"""

from __future__ import annotations

import operator
from pathlib import Path

import pytest
import torch
import torch.utils._pytree as pytree
from torch import nn

import fxpipe
from fxpipe.errors import TraceError
from fxpipe.trace import NodeInfo, TensorSpec, TraceInfo, normalize_inputs
from tests import models


def _build(name, **kw):
    if name in models.HF:
        pytest.importorskip("transformers")
    return models.ZOO[name](**kw)


def _call(model, inputs):
    args, kwargs = normalize_inputs(inputs)
    return pytree.tree_leaves(model(*args, **kwargs))


def _loss(outputs) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    return sum((o * torch.randn(o.shape, generator=g)).sum() for o in outputs if o.is_floating_point())


@pytest.mark.parametrize("name", list(models.ZOO))
def test_same_outputs_and_gradients_on_the_same_parameters(name):
    model, inputs = _build(name)
    gm = fxpipe.trace(model, inputs)
    assert gm.meta["fxpipe"].path == "export"
    # the graph holds the model's own Parameter objects, not copies
    own = {id(p) for p in model.parameters()}
    assert {id(p) for p in gm.parameters()} <= own

    state = {k: v.clone() for k, v in model.state_dict().items()}
    eager = _call(model, inputs)
    _loss(eager).backward()
    ref = {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    model.load_state_dict(state)  # BatchNorm statistics moved in the eager forward

    traced = _call(gm, inputs)
    assert len(traced) == len(eager)
    for i, (a, b) in enumerate(zip(traced, eager)):
        assert torch.equal(a, b), f"{name}: output {i} differs by {(a - b).abs().max().item():.3g}"
    _loss(traced).backward()
    for n, p in model.named_parameters():
        if ref[n] is None:
            assert p.grad is None, f"{name}: {n} got a gradient through the graph but not in eager"
        else:
            assert p.grad is not None and torch.equal(p.grad, ref[n]), f"{name}: gradient of {n} differs"


class _Checkpointed(nn.Module):
    """Residual blocks, each through torch.utils.checkpoint in the given mode, then the last two
    through checkpoint_sequential."""

    def __init__(self, reentrant: bool):
        super().__init__()
        self.reentrant = reentrant
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(8), nn.Linear(8, 8), nn.Tanh()) for _ in range(4))

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint, checkpoint_sequential

        for block in self.blocks[:2]:
            x = x + checkpoint(block, x, use_reentrant=self.reentrant)
        return checkpoint_sequential(nn.Sequential(*self.blocks[2:]), 2, x, use_reentrant=self.reentrant).sum(-1)


@pytest.mark.parametrize("prefer", ["export", "symbolic_trace"])
def test_a_reentrant_checkpoint_is_traced_through_and_said(prefer):
    # torch.utils.checkpoint(..., use_reentrant=True) runs its function under no_grad inside an
    # autograd function: the trace recorded the blocks without gradient, and the first backward
    # failed ("element 0 of tensors does not require grad"). The trace now runs the function
    # inline, says so, and computes what the non-reentrant checkpoint does (eager's reentrant one
    # leaves the first block untrained: its input takes no gradient, as torch warns).
    from torch.utils.checkpoint import CheckpointFunction

    torch.manual_seed(0)
    model, x = _Checkpointed(reentrant=True), torch.randn(3, 8)
    with pytest.warns(RuntimeWarning, match=r"_Checkpointed calls torch\.utils\.checkpoint\.checkpoint with "
                                            r"use_reentrant=True \(3 call\(s\) in one forward, of Sequential, "
                                            r"checkpoint_sequential\.<locals>\.run_function\.<locals>\.forward\); it "
                                            r"is traced without the checkpoint.*compile\(recompute=True\)"):
        gm = fxpipe.trace(model, (x,), prefer=prefer)
    assert "apply" not in CheckpointFunction.__dict__  # torch's own again
    model.reentrant = False
    eager = model(x)
    eager.sum().backward()
    ref = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    traced = _call(gm, (x,))[0]
    assert torch.equal(traced, eager)
    traced.sum().backward()
    assert all(torch.equal(p.grad, ref[n]) for n, p in model.named_parameters())


@pytest.mark.parametrize("name", ["mlp", "transformer_encoder", "gpt2_tiny", "bert_tiny"])
def test_dropout_draws_random_numbers_in_eager_order(name):
    model, inputs = _build(name, dropout=0.3)
    model.train()
    gm = fxpipe.trace(model, inputs)
    assert gm.meta["fxpipe"].training
    torch.manual_seed(11)
    eager = _call(model, inputs)
    torch.manual_seed(11)
    traced = _call(gm, inputs)
    for a, b in zip(traced, eager):
        assert torch.equal(a, b), f"{name}: dropout masks differ under the same seed"
    torch.manual_seed(12)
    assert not torch.equal(_call(gm, inputs)[0], eager[0]), "dropout had no effect: the test proves nothing"


def test_tied_weights_are_one_parameter_read_by_every_user():
    model, inputs = _build("gpt2_tiny")
    assert model.lm_head.weight is model.transformer.wte.weight
    gm = fxpipe.trace(model, inputs)
    info: TraceInfo = gm.meta["fxpipe"]
    assert info.tied == {"transformer.wte.weight": ("lm_head.weight",)}
    reads = [n for n in gm.graph.nodes if n.op == "get_attr" and gm.get_parameter(n.target) is model.lm_head.weight]
    assert [n.target for n in reads] == ["transformer.wte.weight"], "the tied weight must be read under one name"
    users = {u.target for n in reads for u in n.users}
    assert users == {torch.ops.aten.embedding.default, torch.ops.aten.linear.default}
    assert sum(p is model.lm_head.weight for p in gm.parameters()) == 1
    for n in reads[0].users:
        assert "transformer.wte.weight" in n.meta["fxpipe"].params


@pytest.mark.parametrize("name", list(models.ZOO))
def test_no_guard_node_and_no_dead_parameter_reads(name):
    model, inputs = _build(name)
    gm = fxpipe.trace(model, inputs)
    assert not hasattr(gm, "_guards_fn")
    assert all("_guards_fn" not in str(n.target) for n in gm.graph.nodes)
    dead = [n.format_node() for n in gm.graph.nodes if n.op == "get_attr" and not n.users]
    assert not dead, f"{name}: dead reads {dead}"
    # flat placeholders in pytree order, and a flat output tuple
    info = gm.meta["fxpipe"]
    assert info.input_names == tuple(n.name for n in gm.graph.nodes if n.op == "placeholder")
    out = next(n for n in gm.graph.nodes if n.op == "output")
    assert isinstance(out.args[0], tuple)


def test_node_metadata():
    model, inputs = _build("gpt2_tiny")
    gm = fxpipe.trace(model, inputs)
    for n in gm.graph.nodes:
        if n.op == "output":
            continue
        info = n.meta["fxpipe"]
        assert isinstance(info, NodeInfo), n.format_node()
        val = n.meta.get("val")
        if isinstance(val, torch.Tensor):
            assert info.outputs == (TensorSpec.of(val),), n.name
            assert info.out_bytes == val.numel() * val.element_size()
    nodes = {n.name: n for n in gm.graph.nodes}
    qkv = nodes["addmm"].meta["fxpipe"]  # GPT-2's Conv1D c_attn of block 0
    assert qkv.module_path == "transformer.h.0.attn.c_attn"
    assert set(qkv.params) == {"transformer.h.0.attn.c_attn.weight", "transformer.h.0.attn.c_attn.bias"}
    assert qkv.param_bytes == (32 * 96 + 96) * 4
    assert qkv.shapes == ((32, 96),)
    assert nodes["input_ids"].meta["fxpipe"].outputs == (TensorSpec((2, 16), "int64"),)
    split = nodes["split"].meta["fxpipe"]  # a tuple-returning op lists every output
    assert split.shapes == ((2, 16, 32),) * 3
    assert gm.meta["fxpipe"].batch_size == 2


def test_buffers_are_listed_and_updated_in_place():
    model, inputs = _build("cnn_bn")
    gm = fxpipe.trace(model, inputs)
    bn = next(n for n in gm.graph.nodes if n.target is torch.ops.aten.batch_norm.default)
    assert set(bn.meta["fxpipe"].buffers) == {"bn1.running_mean", "bn1.running_var"}
    before = model.bn1.running_mean.clone()
    gm(*inputs)
    assert not torch.equal(model.bn1.running_mean, before), "the graph must update the model's own statistics"
    assert model.bn1.num_batches_tracked.item() == 1


# --------------------------------------------------------------------------------------------
# fallback and errors


class Gate(nn.Module):
    """Data-dependent Python control flow: neither export nor symbolic_trace can capture it."""

    def forward(self, x):
        if x.sum() > 0:
            return x * 2
        return x - 1


class Gated(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(4, 4)
        self.gate = Gate()
        self.out = nn.Linear(4, 2)

    def forward(self, x):
        return self.out(self.gate(self.inp(x)))


def test_symbolic_trace_fallback_with_leaf_modules():
    torch.manual_seed(0)
    model, x = Gated(), torch.randn(3, 4)
    gm = fxpipe.trace(model, (x,), leaf_modules=[Gate])
    info = gm.meta["fxpipe"]
    assert info.path == "symbolic_trace"
    assert any(n.op == "call_module" and n.target == "gate" for n in gm.graph.nodes)
    assert torch.equal(gm(x), model(x))
    gm(x).sum().backward()
    ref = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    model(x).sum().backward()
    for n, p in model.named_parameters():
        assert torch.equal(p.grad, ref[n]), n
    gate = next(n for n in gm.graph.nodes if n.op == "call_module" and n.target == "gate")
    assert gate.meta["fxpipe"].shapes == ((3, 4),) and gate.meta["fxpipe"].module_path == "gate"
    # leaf modules by qualified name work too
    assert fxpipe.trace(model, (x,), leaf_modules=["gate"]).meta["fxpipe"].path == "symbolic_trace"


@pytest.mark.parametrize("by_keyword", [False, True])
def test_the_symbolic_trace_path_feeds_the_inputs_in_the_models_order(by_keyword):
    # The placeholders were reordered by prepending each to the graph's first node, itself the
    # first placeholder: two inputs came out swapped, three rotated. Inputs of one shape then
    # trained on each other's data without an error.
    class Three(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b, self.c = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)

        def forward(self, x, y, z):
            return self.a(x) + 2 * self.b(y) + 3 * self.c(z)

    torch.manual_seed(0)
    model, inputs = Three(), [torch.randn(3, 4) for _ in range(3)]
    example = dict(zip("xyz", inputs)) if by_keyword else tuple(inputs)
    gm = fxpipe.trace(model, example, prefer="symbolic_trace")
    assert gm.meta["fxpipe"].path == "symbolic_trace"
    got = gm(**example) if by_keyword else gm(*example)
    assert torch.equal(got, model(*inputs))


def test_untraceable_model_raises_a_trace_error_naming_class_module_and_line():
    with pytest.raises(TraceError) as e:
        fxpipe.trace(Gated(), (torch.randn(3, 4),))
    msg = str(e.value)
    assert "fxpipe could not trace Gated" in msg
    assert "(module 'gate')" in msg
    assert f"{Path(__file__).name}:" in msg and "if x.sum() > 0:" in msg
    assert "leaf_modules" in msg and "use_cache=False" in msg
    assert "torch.export:" in msg and "torch.fx.symbolic_trace:" in msg
    assert e.value.__cause__ is not None, "the original exception must be chained"


class LayerDropStack(nn.Module):
    """Layer stacks as transformers before 5.23 wrote them: in training, each layer draws
    ``torch.rand([])`` and is skipped when the draw is below the LayerDrop rate, even at a rate
    of 0. The encoder keeps its own copy of the rate (Bart, OPT, Whisper); the decoder reads its
    config's and branches on the comparison's tensor (wav2vec2)."""

    def __init__(self, encoder_rate=0.0, decoder_rate=0.0):
        import types

        super().__init__()
        self.config = types.SimpleNamespace(layerdrop=decoder_rate)
        self.layerdrop = encoder_rate
        self.encoder = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))
        self.decoder = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))

    def forward(self, x):
        for layer in self.encoder:
            dropped = False
            if self.training:
                draw = torch.rand([])
                if draw < self.layerdrop:
                    dropped = True
            if not dropped:
                x = torch.tanh(layer(x))
        for layer in self.decoder:
            skip = False
            if self.training:
                skip = torch.rand([]) < self.config.layerdrop
            if not skip:
                x = torch.tanh(layer(x))
        return x


def test_a_layer_stack_drawing_for_layerdrop_at_rate_0_traces_and_trains_as_eager():
    import functools

    from tests.reference import train_flush

    torch.manual_seed(0)
    model = LayerDropStack()
    gm = fxpipe.trace(model, (torch.randn(2, 4),))
    assert gm.meta["fxpipe"].path == "export"
    assert not [n for n in gm.graph.nodes if "rand" in str(n.target)], "the unread draws are deleted"
    assert type(model.layerdrop) is float and type(model.config.layerdrop) is float  # given back as they were
    fx_path = fxpipe.trace(model, (torch.randn(2, 4),), prefer="symbolic_trace")  # draws at trace time, all kept
    assert len([n for n in fx_path.graph.nodes if n.op == "call_function" and n.target is torch.tanh]) == 4
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(8, 4, generator=g), torch.randn(8, 4, generator=g)) for _ in range(3)]
    opt = functools.partial(torch.optim.SGD, lr=0.1)
    loss_fn = nn.functional.mse_loss
    pipe = fxpipe.compile(model, (batches[0][0][:2],), loss_fn=loss_fn, optimizer=opt, microbatches=4, stages=2,
                          schedule="zb", verbose=False)
    losses = [pipe.step(x, y) for x, y in batches]
    ref_losses, ref = train_flush(model.double(), [(x.double(), y.double()) for x, y in batches], 4, loss_fn, opt)
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    sd = pipe.state_dict()
    assert all(torch.allclose(sd[k].double(), p, atol=1e-6) for k, p in ref.named_parameters())


@pytest.mark.parametrize("rates,named", [((0.1, 0.0), "LayerDropStack.layerdrop = 0.1"),
                                         ((0.0, 0.2), "SimpleNamespace.layerdrop = 0.2")])
def test_a_layerdrop_rate_above_0_is_refused_with_how_to_turn_it_off(rates, named):
    with pytest.raises(TraceError) as e:
        fxpipe.trace(LayerDropStack(*rates), (torch.randn(2, 4),))
    msg = str(e.value)
    assert f"fxpipe cannot trace LayerDropStack with LayerDrop on ({named})" in msg
    assert "a pipeline runs one fixed graph" in msg and "layerdrop=0.0" in msg
    # refused before either tracer runs: symbolic_trace would run the draws and keep one choice
    with pytest.raises(TraceError, match="LayerDrop on"):
        fxpipe.trace(LayerDropStack(*rates), (torch.randn(2, 4),), prefer="symbolic_trace")
    fxpipe.trace(LayerDropStack(*rates).eval(), (torch.randn(2, 4),))  # no draws in eval mode


class MaskedSum(nn.Module):
    """A boolean-mask index: a size that depends on the values, not only on the input's shape."""

    def forward(self, y):
        return y[y > 0].sum().expand(y.shape[-1])


class Masked(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(4, 4)
        self.masked = MaskedSum()
        self.out = nn.Linear(4, 2)

    def forward(self, x):
        return self.out(self.masked(self.inp(x)) + x)


def test_a_value_dependent_size_is_refused_by_name_and_a_leaf_module_takes_it():
    torch.manual_seed(0)
    model, x = Masked(), torch.randn(3, 4)
    with pytest.raises(TraceError) as e:
        fxpipe.trace(model, (x,))
    msg = str(e.value)
    assert "in module 'masked'" in msg and "depends on the input's values" in msg, msg
    assert "torch.where(mask, x, 0)" in msg and "leaf_modules" in msg, msg
    gm = fxpipe.trace(model, (x,), leaf_modules=[MaskedSum])
    assert gm.meta["fxpipe"].path == "symbolic_trace" and torch.equal(gm(x), model(x))


def test_an_example_the_model_cannot_run_is_a_trace_error_with_the_models_reason():
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    with pytest.raises(TraceError, match=r"the model fails on the example inputs at node '_0': RuntimeError: mat1 and "
                                         r"mat2 shapes cannot be multiplied \(2x7 and 8x16\)\. The example is one "
                                         r"micro-batch of what the model takes"):
        fxpipe.trace(model, (torch.randn(2, 7),))


def test_the_node_table_says_why_export_failed(tmp_path, monkeypatch):
    import importlib

    from fxpipe.inspect import write_node_table

    trace_module = importlib.import_module("fxpipe.trace")  # the module; fxpipe.trace is the function

    def refuse(*a, **k):
        raise RuntimeError("export refused this model\nsecond line")

    monkeypatch.setattr(trace_module, "_export", refuse)
    model, inputs = _build("mlp")
    gm = fxpipe.trace(model, inputs)
    assert gm.meta["fxpipe"].path == "symbolic_trace"
    txt = write_node_table(gm, str(tmp_path))[0]
    head = open(txt).read().splitlines()[:2]
    assert head[0].endswith("traced with symbolic_trace"), head
    assert head[1] == "# torch.export failed first: RuntimeError: export refused this model", head


def test_prefer_symbolic_trace_and_bad_arguments():
    model, inputs = _build("mlp")
    gm = fxpipe.trace(model, inputs, prefer="symbolic_trace")
    assert gm.meta["fxpipe"].path == "symbolic_trace"
    assert torch.equal(gm(*inputs), model(*inputs))
    with pytest.raises(ValueError, match="prefer must be"):
        fxpipe.trace(model, inputs, prefer="dynamo")
    with pytest.raises(TypeError, match="expects an nn.Module"):
        fxpipe.trace(lambda x: x, inputs)
    with pytest.raises(TypeError, match="Wrap a single tensor"):
        fxpipe.trace(model, [1, 2][0])
    with pytest.raises(TraceError, match="structure the model was traced with"):
        gm.meta["fxpipe"].flatten_inputs((), {"x": inputs[0]})


def test_getitem_users_of_tuples_survive_cleanup():
    """Multi-output ops keep their getitem users (codegen relies on them to move tuples)."""
    model, inputs = _build("gpt2_tiny")
    gm = fxpipe.trace(model, inputs)
    split = next(n for n in gm.graph.nodes if n.target is torch.ops.aten.split.Tensor)
    assert {u.target for u in split.users} == {operator.getitem}


def test_a_no_grad_block_that_raises_leaves_autograd_on():
    """Export records ``with torch.no_grad():`` as a higher-order op that switches grad mode off
    and, if its body raises, never back on. fxpipe's graphs run such blocks so that grad mode is
    restored: a pass that gives up on a node (the cost model's fake-tensor FLOP count does) or a
    stage that raises must not disable autograd for the rest of the program."""

    class NoGradFirst(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(10, 4)

        def forward(self, ids):
            with torch.no_grad():
                scale = self.emb(ids).abs().mean()
            return (self.emb(ids) * scale).sum()

    gm = fxpipe.trace(NoGradFirst(), (torch.tensor([1, 2]),))
    assert gm.meta["fxpipe"].path == "export"
    assert gm(torch.tensor([3, 4])).requires_grad and torch.is_grad_enabled()
    with pytest.raises(IndexError):
        gm(torch.tensor([3, 40]))  # the block's lookup fails: no such token
    assert torch.is_grad_enabled()
    assert gm(torch.tensor([3, 4])).requires_grad
