"""codegen: stages run one after another compute exactly what the original model computes.

The transparency contract (torchgpipe's test_transparency, here per cut): for every model of
the zoo, cut into 2, 3 and 4 stages at evenly spaced and at awkward points, running the stage
modules in turn gives the eager outputs bit for bit and, after backward, every original
parameter's gradient (tied copies summed). Then the pieces: boundaries and forwarding, flat
buffers and in-place gradient accumulation, functional_call with a second weight version,
BatchNorm statistics, tied-weight training and the state dict, and the errors.
"""

from __future__ import annotations

import copy
import functools
import re
from dataclasses import dataclass

import pytest
import torch
import torch.utils._pytree as pytree
from torch import nn

import fxpipe
from fxpipe import codegen
from fxpipe.errors import FxpipeError, PlanError
from fxpipe.trace import TensorSpec, normalize_inputs
from tests import models

# --------------------------------------------------------------------------------------------
# helpers


@dataclass
class Ref:
    outputs: list[torch.Tensor]
    grads: dict[str, torch.Tensor | None]
    buffers: dict[str, torch.Tensor]  # after one forward (BatchNorm statistics move)
    weights: list[torch.Tensor | None]  # fixed random weights of the test loss


def _loss(outputs, weights) -> torch.Tensor:
    """sum(w * out) over floating outputs, with fixed random w: every output element gets its own
    gradient, so a misrouted boundary value cannot hide behind a symmetric loss."""
    total = 0
    for o, w in zip(outputs, weights):
        if w is not None:
            total = total + (o * w).sum()
    return total


def _weights(outputs) -> list[torch.Tensor | None]:
    g = torch.Generator().manual_seed(1234)
    return [
        torch.randn(o.shape, generator=g, dtype=o.dtype) if o.is_floating_point() and o.requires_grad else None
        for o in outputs
    ]


def _factory(name):
    if name in models.HF:
        pytest.importorskip("transformers")
    return models.ZOO[name]


@functools.cache
def traced(name: str):
    """(model, gm, flat inputs, eager reference) for a zoo model, traced once per session.

    The eager forward/backward runs after tracing; the model's state is then restored, so a
    split made afterwards starts from the state the reference started from."""
    model, inputs = _factory(name)()
    args, kwargs = normalize_inputs(inputs)
    gm = fxpipe.trace(model, inputs)
    info = gm.meta["fxpipe"]
    init = {k: v.clone() for k, v in model.state_dict().items()}
    out = pytree.tree_leaves(model(*args, **kwargs))
    weights = _weights(out)
    _loss(out, weights).backward()
    ref = Ref(
        outputs=[o.detach().clone() for o in out],
        grads={n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()},
        buffers={n: b.clone() for n, b in model.named_buffers()},
        weights=weights,
    )
    model.zero_grad(set_to_none=True)
    model.load_state_dict(init)
    return model, gm, info.flatten_inputs(args, kwargs), ref


def compute_nodes(gm) -> list[str]:
    return [n.name for n in gm.graph.nodes if n.op in ("call_function", "call_method", "call_module")]


def even_assignment(gm, d: int) -> dict[str, int]:
    """d stages of (nearly) equal node counts: the planner's job done crudely."""
    names = compute_nodes(gm)
    return {n: i * d // len(names) for i, n in enumerate(names)}


def cut_after(gm, cuts: list[str]) -> dict[str, int]:
    """Stage numbers that go up by one right after each node named in ``cuts``."""
    names = compute_nodes(gm)
    missing = [c for c in cuts if c not in names]
    assert not missing, f"cut points {missing} are not compute nodes of the trace; update AWKWARD"
    stage, out = 0, {}
    for n in names:
        out[n] = stage
        if n in cuts:
            stage += 1
    return out


# Deliberately awkward cut points, in graph order; d stages use the first d-1. Each list cuts
# inside attention (after the q/k/v projection, before softmax / scaled_dot_product_attention)
# and across a residual, so that the skip value is forwarded through a stage that never reads it.
AWKWARD = {
    "mlp": ["linear", "dropout", "relu_2"],
    # conv | num_batches_tracked += 1 | running stats of bn1 on the next stage
    "cnn_bn": ["conv2d", "add_", "add__1"],
    "transformer_encoder": ["linear", "transpose_3", "linear_2"],
    # inside the first RMSNorm, after the up-projection, inside block 2: `embedding` is the skip
    "rmsnorm_residual": ["mul", "linear", "gelu_1"],
    # after c_attn (qkv), between split's getitems (moved home), inside the MLP of block 0
    "gpt2_tiny": ["addmm", "getitem", "layer_norm_1"],
    # after the query, after the value projection, inside the feed-forward of layer 0
    "bert_tiny": ["linear", "linear_2", "linear_4"],
}


def run_stages(staged, *flat_in) -> tuple:
    """Every stage module in turn on the flat model inputs, boundary values handed on: what the
    pipeline computes for one micro-batch (the runtime's forward, without its schedule)."""
    env = dict(zip(staged.input_names, flat_in))
    carry: tuple = ()
    for st in staged.stages:
        carry = st.module(*[env[n] for n in st.model_inputs], *carry)
    return tuple(carry)


def _buffers(st) -> dict[str, torch.Tensor]:
    return {name: st.module.get_buffer(name) for name in st.buffer_names}


def _stage_state(st) -> dict[str, torch.Tensor]:
    """A stage's canonical name -> tensor, as the pipeline gathers them for StagedModel.state_dict."""
    return {**{n: p.detach() for n, p in st.flat.params.items()}, **{n: b.detach() for n, b in _buffers(st).items()}}


def call_staged(staged, *args, **kwargs):
    """:func:`run_stages` with the model's own calling convention and output structure."""
    info = staged.trace_info
    return info.unflatten_output(run_stages(staged, *info.flatten_inputs(args, kwargs)))


def run_checked(staged, flat_in) -> tuple:
    """run_stages, step by step, checking the documented stage contract on the way."""
    env = dict(zip(staged.input_names, flat_in))
    carry: tuple = ()
    for st in staged.stages:
        if st.index > 0:
            assert st.inputs == staged.stages[st.index - 1].outputs
        for name in st.model_inputs:
            assert all(name not in s.inputs for s in staged.stages), f"model input {name} was sent"
        for name, spec, value in zip(st.inputs, st.input_specs, carry):
            assert spec == TensorSpec.of(value), f"stage {st.index} input {name}"
        carry = st.module(*[env[n] for n in st.model_inputs], *carry)
        assert isinstance(carry, tuple) and len(carry) == len(st.outputs), f"stage {st.index} returned {type(carry)}"
        for name, spec, value in zip(st.outputs, st.output_specs, carry):
            assert spec is None or spec.shape == tuple(value.shape), f"stage {st.index} output {name}"
    return carry


def _rel_close(a: torch.Tensor, b: torch.Tensor, rel: float = 1e-6) -> bool:
    return a.shape == b.shape and (a - b).abs().max().item() <= rel * max(b.abs().max().item(), 1e-30)


def check_transparent(name, staged, flat_in, ref) -> None:
    out = run_checked(staged, flat_in)
    assert len(out) == len(ref.outputs)
    for i, (a, b) in enumerate(zip(out, ref.outputs)):
        assert torch.equal(a, b), (
            f"{name}: output {i} ({staged.output_names[i]}) differs from eager by "
            f"{(a.float() - b.float()).abs().max().item():.3g}"
        )
    _loss(out, ref.weights).backward()
    for pname, g_ref in ref.grads.items():
        copies = [st.flat.params[pname].grad for st in staged.stages if pname in st.flat.params]
        if g_ref is None:
            assert all(g is None or not g.any() for g in copies), f"{name}: {pname} has a gradient, eager has none"
            continue
        assert copies, f"{name}: parameter {pname} is on no stage"
        total = copies[0].clone()
        for g in copies[1:]:
            total += g
        if len(copies) == 1:
            assert torch.equal(total, g_ref), (
                f"{name}: gradient of {pname} differs from eager by {(total - g_ref).abs().max().item():.3g}"
            )
        else:  # tied copies are summed in another order than autograd sums them in eager
            assert _rel_close(total, g_ref), (
                f"{name}: summed gradient of tied {pname} (stages "
                f"{[st.index for st in staged.stages if pname in st.flat.params]}) differs from eager by "
                f"{(total - g_ref).abs().max().item():.3g}"
            )
    for st in staged.stages:
        for bname, b in _buffers(st).items():
            assert torch.equal(b, ref.buffers[bname]), f"{name}: buffer {bname} on stage {st.index} after forward"


# --------------------------------------------------------------------------------------------
# transparency


@pytest.mark.parametrize("d", [2, 3, 4])
@pytest.mark.parametrize("name", list(models.ZOO))
def test_transparent_even_cuts(name, d):
    _, gm, flat_in, ref = traced(name)
    staged = codegen.split(gm, even_assignment(gm, d))
    assert staged.num_stages == d
    check_transparent(name, staged, flat_in, ref)


@pytest.mark.parametrize("d", [2, 3, 4])
@pytest.mark.parametrize("name", list(models.ZOO))
def test_transparent_awkward_cuts(name, d):
    _, gm, flat_in, ref = traced(name)
    staged = codegen.split(gm, cut_after(gm, AWKWARD[name][: d - 1]))
    check_transparent(name, staged, flat_in, ref)


@pytest.mark.parametrize("d", [2, 4])
@pytest.mark.parametrize("name", ["gpt2_tiny", "transformer_encoder"])
def test_transparent_planner_cuts(name, d):
    partition = pytest.importorskip("fxpipe.partition")
    _, gm, flat_in, ref = traced(name)
    plan = partition.plan(gm, None, stages=d, microbatches=4, cost_mode="analytic")
    staged = codegen.from_plan(gm, plan)
    assert staged.num_stages == d
    check_transparent(name, staged, flat_in, ref)


def test_dropout_draws_in_eager_order():
    """With dropout on, the stages draw random numbers in the eager order: same seed, same out."""
    pytest.importorskip("transformers")
    model, inputs = models.gpt2_tiny(dropout=0.2)
    gm = fxpipe.trace(model, inputs)
    staged = codegen.split(gm, cut_after(gm, AWKWARD["gpt2_tiny"]))
    torch.manual_seed(7)
    eager = model(**inputs).logits
    torch.manual_seed(7)
    piped = call_staged(staged, **inputs).logits
    assert torch.equal(eager, piped)
    torch.manual_seed(8)
    assert not torch.equal(eager, call_staged(staged, **inputs).logits), "dropout had no effect: the test proves nothing"


def test_symbolic_trace_path_with_leaf_modules():
    """The fallback path keeps nn modules as call_module nodes; their parameters are replaced
    by flat views in the stage's copy of the module."""
    model, (x,) = models.mlp()
    gm = fxpipe.trace(model, (x,), prefer="symbolic_trace")
    assert any(n.op == "call_module" for n in gm.graph.nodes)
    staged = codegen.split(gm, even_assignment(gm, 3))
    out = run_stages(staged, x)[0]
    assert torch.equal(out, model(x))
    out.sum().backward()
    model(x).sum().backward()
    for name, p in model.named_parameters():
        (st,) = [s for s in staged.stages if name in s.flat.params]
        assert torch.equal(st.flat.params[name].grad, p.grad), name
        sub = st.module.get_submodule(name.rpartition(".")[0])
        assert sub.get_parameter(name.rpartition(".")[2]) is st.flat.params[name]


# --------------------------------------------------------------------------------------------
# boundaries


def test_boundaries_forward_skip_values_and_never_send_model_inputs():
    pytest.importorskip("transformers")
    _, gm, _, _ = traced("bert_tiny")
    staged = codegen.split(gm, cut_after(gm, AWKWARD["bert_tiny"]))
    s0, s1, s2, s3 = staged.stages
    # the embedding output (residual of layer 0's attention) is made on stage 0 and first read
    # by add_4 on stage 2: stage 1 takes it in and hands it on unchanged
    assert "dropout" in s0.outputs and "dropout" in s1.inputs and "dropout" in s1.outputs
    assert "dropout" in s2.inputs and "dropout" not in s2.outputs
    assert s2.produced_on["dropout"] == 0
    assert "dropout: float32[2, 16, 32]  (made on stage 0, forwarded)" in s2.code
    assert "dropout" not in s1.nodes
    # the attention mask is a model input: read where needed, never sent
    assert "attention_mask" in s0.model_inputs
    assert all("attention_mask" not in s.inputs + s.outputs for s in staged.stages)
    # boundary order is graph order of the producers
    order = {n: i for i, n in enumerate(compute_nodes(gm))}
    for st in staged.stages[:-1]:
        assert list(st.outputs) == sorted(st.outputs, key=order.__getitem__)
    assert s3.outputs == staged.output_names == ("linear_13",)


def test_getitems_run_on_their_tuples_stage():
    pytest.importorskip("transformers")
    _, gm, _, _ = traced("gpt2_tiny")
    staged = codegen.split(gm, cut_after(gm, ["addmm", "getitem"]))
    a = staged.assignment
    assert a["split"] == a["getitem"] == a["getitem_1"] == a["getitem_2"] == 1
    assert all("split" not in st.inputs for st in staged.stages)


class _SizeThenView(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        n = x.size(0)  # a Python int in the fx fallback's graph
        return self.lin(x).view(n, -1)


def test_non_tensor_crossing_a_cut_names_the_node():
    gm = fxpipe.trace(_SizeThenView(), (torch.randn(2, 4),), prefer="symbolic_trace")
    names = compute_nodes(gm)
    assert names[0] == "size"
    with pytest.raises(PlanError, match=r"'size' crosses the cut between stages 0 and 1.*not a tensor") as e:
        codegen.split(gm, cut_after(gm, ["size"]))
    assert "call_method[target=size]" in str(e.value) and "on one stage" in str(e.value)


def test_assignment_errors_say_what_to_do():
    _, gm, _, _ = traced("mlp")
    names = compute_nodes(gm)
    with pytest.raises(PlanError, match=r"'linear_1' \(stage 0\) comes after 'dropout' \(stage 1\)"):
        codegen.split(gm, {n: (1 if n == "dropout" else 0) for n in names})
    with pytest.raises(PlanError, match=r"stage\(s\) \[1\] have none"):
        codegen.split(gm, {n: (0 if i < 4 else 2) for i, n in enumerate(names)})
    with pytest.raises(PlanError, match="(?s)gives no stage to 1 compute node.*linear_3"):
        codegen.split(gm, {n: 0 for n in names[:-1]})
    with pytest.raises(PlanError, match="not in the graph.*'nope'.*re-plan"):
        codegen.split(gm, {**{n: 0 for n in names}, "nope": 0})
    with pytest.raises(PlanError, match="must be an int"):
        codegen.split(gm, {n: "0" for n in names})


class _ReadsRunningMean(nn.Module):
    def __init__(self):
        super().__init__()
        self.bn = nn.BatchNorm1d(4)
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return self.lin(self.bn(x)) + self.bn.running_mean


def test_buffer_updated_on_one_stage_and_read_on_another_is_refused():
    gm = fxpipe.trace(_ReadsRunningMean(), (torch.randn(3, 4),))
    names = compute_nodes(gm)
    bn = next(n for n in names if "batch_norm" in n)
    with pytest.raises(PlanError, match=r"buffer 'bn.running_mean' is updated in place on stage 0"):
        codegen.split(gm, cut_after(gm, [bn]))


# --------------------------------------------------------------------------------------------
# flat parameters


def test_parameters_are_views_of_one_flat_buffer():
    model, gm, flat_in, ref = traced("rmsnorm_residual")
    staged = codegen.split(gm, even_assignment(gm, 2))
    orig = {n: p.detach().clone() for n, p in model.named_parameters()}
    for st in staged.stages:
        (flat,) = st.flat.buffers.values()
        lo, hi = flat.data_ptr(), flat.data_ptr() + flat.numel() * flat.element_size()
        for slot in st.flat.layout.slots:
            p = st.flat.params[slot.name]
            assert p.data_ptr() == flat.data_ptr() + slot.offset * flat.element_size() and lo <= p.data_ptr() < hi
            assert p.is_leaf and torch.equal(p, orig[slot.name])
            assert p is not dict(model.named_parameters())[slot.name]
        assert sum(s.numel for s in st.flat.layout.slots) == flat.numel()
        # in the stage module, the parameter IS the flat view
        for name in st.param_names:
            assert st.module.get_parameter(name) is st.flat.params[name]
    # the original model is untouched by a training step through the stages
    _loss(run_stages(staged, *flat_in), ref.weights).backward()
    for n, p in model.named_parameters():
        assert torch.equal(p, orig[n]) and p.grad is None


def test_functional_call_with_a_second_weight_version_and_batchnorm_stats():
    """The runtime's 2BW path: a spare buffer of the same layout, passed through
    functional_call; buffers stay module attributes and are updated in place."""
    model, gm, flat_in, ref = traced("cnn_bn")
    staged = codegen.split(gm, cut_after(gm, AWKWARD["cnn_bn"]))
    carry: tuple = ()
    spares, versions = [], []
    for st in staged.stages:
        spare = st.flat.layout.empty_like()
        for dt, b in st.flat.clone_buffers().items():
            spare[dt].copy_(b)
        spares.append(spare)
        leaves = st.flat.layout.views(spare)  # as the weight store makes a version's leaves
        for v in leaves.values():
            v.requires_grad_(True)
        versions.append(leaves)
        carry = torch.func.functional_call(st.module, leaves, (*[flat_in[0]] * len(st.model_inputs), *carry))
    assert torch.equal(carry[0], ref.outputs[0])
    _loss(carry, ref.weights).backward()
    for st, leaves in zip(staged.stages, versions):
        for name in st.param_names:
            assert torch.equal(leaves[name].grad, ref.grads[name]), name
        for bname, b in _buffers(st).items():
            assert torch.equal(b, ref.buffers[bname]), f"BatchNorm buffer {bname} not updated in place"
    # plain views work too, and a layout mismatch is refused with the numbers
    st = staged.stages[0]
    out = torch.func.functional_call(st.module, st.flat.layout.views(spares[0]), (flat_in[0],))
    assert out[0].shape == tuple(st.output_specs[0].shape)
    with pytest.raises(ValueError, match="does not fit the layout: expected a contiguous 1-D"):
        st.flat.layout.views({dt: b[:-1] for dt, b in spares[0].items()})


class _MixedDtypes(nn.Module):
    """float32 and float64 parameters, one of them frozen."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.lin.bias.requires_grad_(False)
        self.scale = nn.Parameter(torch.linspace(0.5, 2.0, 4, dtype=torch.float64))
        self.head = nn.Linear(4, 3)

    def forward(self, x):
        return self.head((self.lin(x).double() * self.scale).float())


def test_one_flat_buffer_per_dtype_and_frozen_parameters_get_no_gradient():
    torch.manual_seed(0)
    model, x = _MixedDtypes(), torch.randn(5, 4)
    gm = fxpipe.trace(model, (x,))
    staged = codegen.split(gm, even_assignment(gm, 2))
    st = next(s for s in staged.stages if "scale" in s.param_names)
    assert set(st.flat.buffers) == {torch.float32, torch.float64}
    assert st.flat.buffers[torch.float64].numel() == 4
    frozen = next(s for s in staged.stages if "lin.bias" in s.param_names).flat.params["lin.bias"]
    assert not frozen.requires_grad and frozen.grad is None
    ref_out = model(x)
    ref_out.sum().backward()
    out = run_stages(staged, x)[0]
    assert torch.equal(out, ref_out)
    out.sum().backward()
    for name, p in model.named_parameters():
        (copy_,) = [s.flat.params[name] for s in staged.stages if name in s.flat.params]
        assert (copy_.grad is None) == (p.grad is None), name
        if p.grad is not None:
            assert torch.equal(copy_.grad, p.grad), name


def test_build_subset_leaves_other_stages_on_meta_device():
    _, gm, flat_in, _ = traced("mlp")
    staged = codegen.split(gm, even_assignment(gm, 2), build=[1])
    s0, s1 = staged.stages
    assert all(b.is_meta for b in s0.flat.buffers.values())
    assert not any(b.is_meta for b in s1.flat.buffers.values())
    assert "def forward" in s0.code and s0.input_specs == () and s1.input_specs[0].shape == (4, 32)


# --------------------------------------------------------------------------------------------
# tied weights, training, state dict


def test_tied_weights_have_a_copy_per_stage_and_load_into_the_original():
    pytest.importorskip("transformers")
    model, inputs = models.gpt2_tiny(labels=True)
    gm = fxpipe.trace(model, inputs)
    staged = codegen.split(gm, even_assignment(gm, 3))
    assert [(t.name, t.stages) for t in staged.tied] == [("transformer.wte.weight", (0, 2))]
    assert staged.originals["transformer.wte.weight"] == ["transformer.wte.weight", "lm_head.weight"]
    # Training through the pipeline keeps the copies equal and equals eager training
    # (tests/unit/test_pipeline.py, the gpt2 cases); here: the merged state dict loads strictly
    # into the original and the stages compute what it computes.
    sd = staged.state_dict([_stage_state(st) for st in staged.stages])
    assert set(sd) == set(model.state_dict())
    fresh, _ = models.gpt2_tiny(seed=1)
    fresh.load_state_dict(sd)  # strict
    assert torch.equal(fresh(**inputs).logits, call_staged(staged, **inputs).logits)
    wte2 = staged.stages[2].flat.params["transformer.wte.weight"]
    with torch.no_grad():
        wte2[0, 0] += 1.0
    with pytest.raises(FxpipeError, match=r"copies of tied tensor 'transformer.wte.weight' on stages 0 and 2 differ"):
        staged.state_dict([_stage_state(st) for st in staged.stages])


@pytest.mark.parametrize("name", list(models.ZOO))
def test_state_dict_loads_strictly_into_the_original(name):
    model, gm, _, _ = traced(name)
    staged = codegen.split(gm, even_assignment(gm, 3))
    sd = staged.state_dict([_stage_state(st) for st in staged.stages])
    fresh = copy.deepcopy(model)
    fresh.load_state_dict(sd)
    for k, v in model.state_dict().items():
        assert torch.equal(sd[k], v), k


# --------------------------------------------------------------------------------------------
# readable code


def test_stage_code_names_inputs_outputs_parameters(tmp_path):
    pytest.importorskip("transformers")
    _, gm, _, _ = traced("gpt2_tiny")
    staged = codegen.split(gm, even_assignment(gm, 3))
    code = staged.stages[2].code
    assert code.startswith("# fxpipe stage 2 of 3")
    assert "# inputs, from stage 1, in order:" in code
    assert "# outputs, the model's flat outputs:" in code
    assert re.search(r"#   transformer.wte.weight: float32\[100, 32\] @ \d+  \(tied: also on stage 0\)", code)
    assert "def forward(self, " in code
    compile(code, "stage_2.py", "exec")
    paths = codegen.write_stage_code(staged, tmp_path / "stages")
    assert [p.name for p in paths] == ["stage_0.py", "stage_1.py", "stage_2.py"]
    assert paths[1].read_text() == staged.stages[1].code


def test_a_model_built_on_the_cpu_is_timed_as_a_copy_moved_to_the_device():
    """``calibrate`` and measured costs time a model built on the CPU for a GPU as a copy on the
    GPU (fxpipe.device.moved_copy, which calibrate._timing_setup calls). The meta device stands in for
    the GPU here: the copy's weights and the devices tracing baked in (the demo GPT's positions and
    causal mask) are there, it runs there, and the model is left where it was."""
    from fxpipe.calibrate import _timing_setup
    from fxpipe.demo import GPT, GPTConfig
    from fxpipe.device import moved_copy

    torch.manual_seed(0)
    net = GPT(GPTConfig(n_layer=1, n_embd=16, n_head=2, vocab_size=32, block_size=8))
    x = torch.randint(0, 32, (2, 8))
    gm = fxpipe.trace(net, (x,))
    assert moved_copy(gm, torch.device("cpu")) is gm  # already there: no copy
    timed, dev, flat, _ = _timing_setup(gm, (x,), "meta")
    assert dev.type == "meta" and all(t.is_meta for t in flat)
    assert {p.device.type for p in timed.parameters()} == {"meta"}
    assert {p.device.type for p in gm.parameters()} == {"cpu"}
    assert [n.name for n in timed.graph.nodes] == [n.name for n in gm.graph.nodes]
    baked = [v for n in timed.graph.nodes for v in pytree.tree_leaves((n.args, n.kwargs)) if isinstance(v, torch.device)]
    assert baked and set(baked) == {torch.device("meta")}
    assert timed(x.to("meta"))[0].is_meta  # a copy whose baked devices stayed on the CPU fails here
    with pytest.raises(RuntimeError, match="not on the expected device"):
        copy.deepcopy(gm).to("meta")(x.to("meta"))


def test_device_constants_follow_the_stage_into_higher_order_subgraphs():
    """Export records a ``torch.no_grad()`` or ``torch.autocast`` block as a higher-order op over a
    subgraph (Llama's rotary embedding is one): the devices tracing on the CPU baked in there, and
    an autocast region's device type read from ``x.device``, follow the stage's device too, or a
    CUDA stage fails export's device assertion. Rewriting needs no GPU: it only edits the graphs."""
    from fxpipe.device import follow_device

    class Blocks(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            with torch.autocast(x.device.type, enabled=False):
                y = self.lin(x.float()) * torch.arange(4, device=x.device)
            with torch.no_grad():
                z = torch.ones(4, device=x.device)
            return (y + z).sum()

    gm = fxpipe.trace(Blocks(), (torch.randn(2, 4),))
    cuda = torch.device("cuda")
    moved = copy.deepcopy(gm)
    follow_device(moved, torch.device("cpu"), cuda)

    def constants(m):
        found = []
        for sub in m.modules():
            if isinstance(sub, torch.fx.GraphModule):
                for n in sub.graph.nodes:
                    found += [x for x in pytree.tree_leaves((n.args, n.kwargs)) if isinstance(x, torch.device)]
                    if n.target is torch.ops.higher_order.wrap_with_autocast:
                        found.append(n.args[0])
        return found

    before, after = constants(gm), constants(moved)
    assert len(after) == len(before) >= 4  # the assertion, arange, ones and the autocast region
    assert set(before) == {torch.device("cpu"), "cpu"} and set(after) == {cuda, "cuda"}
    assert "device = device(type='cuda')" in moved.submod_3.code  # the no_grad block's ones(...)
