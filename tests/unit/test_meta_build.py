"""Models built on the meta device, in one process: the trace equals a real one (fingerprint),
a plan made on meta runs on a real model, stages materialise from a state dict, a torch.save
file, a Pipeline.save checkpoint or the modules' initialisers (the same values in every layout),
and every user error says what was expected, what was found and what to do."""

import functools
import warnings

import pytest
import torch
from torch import nn

import fxpipe
from fxpipe.codegen import split
from fxpipe.errors import ConfigError, FxpipeError
from fxpipe.materialize import Materializer
from fxpipe.plan import graph_fingerprint
from tests.models import gpt2_tiny, mlp, rmsnorm_residual


def on_meta(factory, **kw):
    with torch.device("meta"):
        model, example = factory(**kw)
    meta = {k: v.to("meta") for k, v in example.items()} if isinstance(example, dict) else \
        tuple(v.to("meta") for v in example)
    return model, meta


def mse(out, y):
    return (out - y).pow(2).mean()


def train(model, example, steps=3, **kw):
    pipe = fxpipe.compile(model, example, loss_fn=mse, microbatches=2, verbose=False,
                          optimizer=functools.partial(torch.optim.AdamW, lr=1e-2), **kw)
    g = torch.Generator().manual_seed(3)
    losses = [pipe.step(torch.randn(8, 16, generator=g), torch.randn(8, 8, generator=g)) for _ in range(steps)]
    return pipe, losses


def test_meta_trace_equals_real_trace_and_allocates_nothing():
    real, example = gpt2_tiny()
    model, meta = on_meta(gpt2_tiny)
    gm_real, gm_meta = fxpipe.trace(real, example), fxpipe.trace(model, meta)
    # meta kernels alone give scaled_dot_product_attention other strides (and a `contiguous` node)
    assert graph_fingerprint(gm_meta) == graph_fingerprint(gm_real)
    assert gm_meta.meta["fxpipe"].device == torch.device("cpu")
    assert all(t.is_meta for t in (*gm_meta.parameters(), *gm_meta.buffers()))
    own = {id(t) for t in (*model.parameters(), *model.buffers())}
    assert all(id(t) in own for t in gm_meta.parameters())  # the model's own (meta) tensors


def test_plan_made_on_meta_runs_the_real_model_bitwise():
    model, meta = on_meta(mlp)
    plan = fxpipe.plan(model, meta, stages=2, microbatches=2)
    real, example = mlp()
    sd = {k: v.clone() for k, v in real.state_dict().items()}
    full, full_losses = train(real, example, stages=2, plan=plan)
    built, losses = train(model, meta, stages=2, plan=plan.to_json(), weights=sd)
    assert losses == full_losses
    assert all(torch.equal(t, built.state_dict()[k]) for k, t in full.state_dict().items())
    assert all(t.is_meta for t in model.parameters())  # the model itself stays on meta


class _Signed(nn.Module):
    """A leaf with data-dependent control flow: fake tensors cannot run it."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(32, 32)

    def forward(self, x):
        return self.lin(x) if x.sum() > 0 else -self.lin(x)


def _with_leaf():
    model, example = mlp()
    model[2] = nn.Sequential(_Signed(), nn.ReLU())
    return model, example


@pytest.mark.parametrize("factory, leaf", [(mlp, nn.Linear), (_with_leaf, _Signed)])
def test_a_meta_model_on_the_symbolic_trace_path_trains_as_the_real_one(factory, leaf):
    # The symbolic_trace path's shape pass ran a meta model's parameters beside the real example
    # on fake tensors of two devices: "Tensor on device meta is not on the expected device cpu".
    # Meta tensors now stand in as on the traced device (zeros where a data-dependent leaf runs
    # on a real copy).
    model, meta = on_meta(factory)
    real, example = factory()
    gm_meta, gm_real = fxpipe.trace(model, meta, leaf_modules=leaf), fxpipe.trace(real, example, leaf_modules=leaf)
    assert gm_meta.meta["fxpipe"].path == gm_real.meta["fxpipe"].path == "symbolic_trace"
    shapes = lambda gm: [(n.name, n.meta["fxpipe"].outputs) for n in gm.graph.nodes if n.op != "output"]  # noqa: E731
    assert shapes(gm_meta) == shapes(gm_real)
    assert all(p.is_meta for p in model.parameters())
    sd = {k: v.clone() for k, v in real.state_dict().items()}
    full, full_losses = train(real, example, stages=2, leaf_modules=leaf)
    built, losses = train(model, meta, stages=2, leaf_modules=leaf, weights=sd)
    assert losses == full_losses
    assert all(torch.equal(t, built.state_dict()[k]) for k, t in full.state_dict().items())


def test_weights_from_a_file_and_from_a_checkpoint(tmp_path):
    real, example = mlp()
    torch.save(real.state_dict(), tmp_path / "w.pt")
    pipe, _ = train(real, example, steps=1, stages=2)
    pipe.save(str(tmp_path / "ckpt"))
    pipe.wait_for_checkpoint()
    trained = pipe.state_dict()
    from_file = fxpipe.compile(*on_meta(mlp), loss_fn=mse, microbatches=2, stages=2, verbose=False,
                               weights=str(tmp_path / "w.pt")).state_dict()
    assert all(torch.equal(t, from_file[k]) for k, t in real.state_dict().items())
    from_ckpt = fxpipe.compile(*on_meta(mlp), loss_fn=mse, microbatches=2, stages=1, verbose=False,
                               weights=tmp_path / "ckpt").state_dict()
    assert all(torch.equal(t, from_ckpt[k]) for k, t in trained.items())


def test_initialisers_give_the_same_weights_in_every_layout():
    one = fxpipe.compile(*on_meta(gpt2_tiny, labels=True), microbatches=2, stages=1, verbose=False).state_dict()
    two = fxpipe.compile(*on_meta(gpt2_tiny, labels=True), microbatches=2, stages=2, verbose=False, seed=0).state_dict()
    assert one.keys() == two.keys()
    assert all(torch.equal(t, two[k]) for k, t in one.items())
    # Hugging Face's _init_weights: normal(0.02), LayerNorm ones, and GPT-2's parent modules
    # rescale their child c_proj by 1/sqrt(2 n_layer) (a parent writing its child's tensor)
    assert torch.equal(one["transformer.h.0.ln_1.weight"], torch.ones(32))
    assert one["transformer.wte.weight"] is one["lm_head.weight"] or torch.equal(one["transformer.wte.weight"], one["lm_head.weight"])
    assert 0.017 < float(one["transformer.h.0.attn.c_attn.weight"].std()) < 0.023
    assert 0.008 < float(one["transformer.h.0.attn.c_proj.weight"].std()) < 0.012
    # torch modules: reset_parameters (Linear: uniform within 1/sqrt(fan_in))
    state = fxpipe.compile(*on_meta(mlp), loss_fn=mse, microbatches=2, stages=2, verbose=False).state_dict()
    w = state["0.weight"]
    assert w.abs().max() <= 16 ** -0.5 and w.std() > 0.1 and not torch.isnan(w).any()
    other = fxpipe.compile(*on_meta(mlp), loss_fn=mse, microbatches=2, stages=2, verbose=False, seed=1).state_dict()
    assert not torch.equal(w, other["0.weight"])  # the streams follow compile(seed=)


def test_a_model_partly_on_meta_is_initialised_there_with_a_warning():
    # one Linear left on meta by mistake was filled with random values without a word
    model, example = mlp()
    kept = model[0].weight.detach().clone()
    model[3].to_empty(device="meta")
    with pytest.warns(RuntimeWarning, match=r"fxpipe.compile: 2 of the model's 8 parameters are on the meta device \(in "
                                            r"3\) and the rest are not: the meta ones are filled by their modules' "
                                            r"initialisers \(random values\), the others keep theirs"):
        pipe = fxpipe.compile(model, example, loss_fn=mse, microbatches=2, stages=2, verbose=False)
    state = pipe.state_dict()
    assert torch.equal(state["0.weight"], kept) and not state["3.weight"].isnan().any()
    with warnings.catch_warnings():  # a model wholly on meta, the documented way: no warning
        warnings.simplefilter("error", RuntimeWarning)
        fxpipe.compile(*on_meta(mlp), loss_fn=mse, microbatches=2, stages=2, verbose=False)


def test_split_builds_only_the_requested_stage_from_a_meta_model():
    model, meta = on_meta(mlp)
    gm = fxpipe.trace(model, meta)
    names = [n.name for n in gm.graph.nodes if n.op.startswith("call")]
    assignment = {n: int(i > 4) for i, n in enumerate(names)}
    staged = split(gm, assignment, build=[1], source=Materializer(model, gm, device="cpu"))
    assert all(b.is_meta for b in staged.stages[0].flat.buffers.values())
    assert not any(b.is_meta or torch.isnan(b).any() for b in staged.stages[1].flat.buffers.values())
    with pytest.raises(FxpipeError, match="meta device.*source="):
        split(gm, assignment, build=[1])


def test_weights_errors_name_the_keys_before_anything_is_built(tmp_path):
    real, _ = mlp()
    sd = dict(real.state_dict())
    sd.pop("3.bias")
    sd["head.weight"] = torch.zeros(2)
    sd["5.weight"] = torch.zeros(4, 4)
    with pytest.raises(ConfigError) as e:
        fxpipe.compile(*on_meta(mlp), loss_fn=mse, microbatches=2, stages=2, verbose=False, weights=sd)
    msg = str(e.value)
    assert "missing 1 keys: ['3.bias']" in msg
    assert "unexpected 1 keys: ['head.weight']" in msg
    assert "1 tensors of another shape: ['5.weight is [4, 4] there, [32, 32] here']" in msg
    assert "Pass weights= a state dict" in msg
    with pytest.raises(ConfigError, match="weights must be an existing file.*found '.*nope.pt'.*check the path"):
        fxpipe.compile(*on_meta(mlp), weights=str(tmp_path / "nope.pt"))
    with pytest.raises(ConfigError, match="weights must be a state dict.*found 'list'"):
        fxpipe.compile(*on_meta(mlp), weights=[1, 2])
    torch.save([1, 2], tmp_path / "list.pt")
    with pytest.raises(ConfigError, match="holds a list, expected a state dict"):
        fxpipe.compile(*on_meta(mlp), loss_fn=mse, microbatches=2, verbose=False, weights=str(tmp_path / "list.pt"))
    (tmp_path / "torn.pt").write_bytes(b"not what torch.save writes")
    with pytest.raises(ConfigError, match=r"weights file '.*torn\.pt' is not a file torch\.save wrote whole "
                                          r"\(RuntimeError: .*\); pass torch\.save\(model\.state_dict\(\), path\)'s file"):
        fxpipe.compile(*on_meta(mlp), loss_fn=mse, microbatches=2, verbose=False, weights=str(tmp_path / "torn.pt"))


def test_a_module_without_an_initialiser_is_rejected_by_name():
    # tests/models' RMSNorm sets its weight to ones in __init__ and has no reset_parameters
    model, meta = on_meta(rmsnorm_residual)
    with pytest.raises(ConfigError) as e:
        fxpipe.compile(model, meta, loss_fn=lambda o, y: o.mean(), microbatches=2, verbose=False)
    msg = str(e.value)
    assert "(RMSNorm at" in msg and "neither its module nor an enclosing one has an initialiser" in msg
    assert "Pass weights=" in msg and "reset_parameters()" in msg


def test_an_initialiser_that_leaves_a_tensor_unset_is_reported():
    class Scale(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Parameter(torch.ones(4))
            self.b = nn.Parameter(torch.ones(4))

        def reset_parameters(self):
            nn.init.ones_(self.a)  # forgets b

        def forward(self, x):
            return x * self.a * self.b

    with torch.device("meta"):
        model = Scale()
    with pytest.raises(ConfigError, match=r"left 1 tensors without a value: \['b \(Scale\)'\]"):
        fxpipe.compile(model, (torch.randn(2, 4, device="meta"),), loss_fn=lambda o, y: o.mean(), microbatches=2,
                       verbose=False)
