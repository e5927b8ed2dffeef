"""schedule="zb" (ZB-H1): the split backward (fxpipe/backward.py), its order's time and memory in
the simulator, the planner's formulas, and what a real run keeps alive. The numerics (zb equals
plain gradient accumulation) are the zb cases of tests/cases.py, run by tests/unit/test_pipeline.py
and tests/dist/test_pipeline_dist.py."""

from __future__ import annotations

import collections
import dataclasses
import re
import warnings
import weakref

import pytest
import torch
from torch import nn

import fxpipe
from fxpipe import backward
from fxpipe.backward import SavedTensors, SplitCache, _shape, backward_input
from fxpipe.errors import ScheduleError
from fxpipe.cost import annotate
from fxpipe.partition import StageModel, chain_from_graph, pipeline_time, stage_memory
from fxpipe.schedule import Action, Kind, generate, validate, zb_bounds, zb_split
from fxpipe.simulate import Costs, render_svg, simulate
from tests.cases import CASES, build

SVG = "{http://www.w3.org/2000/svg}"


def legend(svg: str) -> set[str]:
    import xml.etree.ElementTree as ET

    return {t.text for t in ET.fromstring(svg).iter(SVG + "text") if t.get("class") == "legend"}

# ---------------------------------------------------------------------------------------------
# The split: I then W equals one backward, and W never runs the input-gradient chain again


class _Counted(torch.autograd.Function):
    """Identity whose backward counts its calls: an op of the input-gradient chain."""

    calls = 0

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        _Counted.calls += 1
        return g


def _graph(xs, w):
    h = _Counted.apply(xs[0] @ w["a"]).relu()
    h = torch.nn.functional.layer_norm(h, (4,), w["ln"][0], w["ln"][1]) @ w["b"] + w["c"][0]
    return [h.tanh(), (w["c"] * 2).sum().reshape(1)]  # the second output does not depend on x


def _weights():
    g = torch.Generator().manual_seed(0)
    return {n: torch.randn(*shape, dtype=torch.float64, generator=g, requires_grad=True)
            for n, shape in (("a", (4, 4)), ("b", (4, 4)), ("c", (2, 4)), ("ln", (2, 4)))}


def test_input_then_weight_pass_equals_one_backward_and_w_skips_the_input_chain():
    w = _weights()
    x = [torch.randn(3, 4, dtype=torch.float64, requires_grad=True)]
    outs = _graph(x, w)
    seeds = [torch.randn_like(o) for o in outs]
    ref = torch.autograd.grad(outs, x + list(w.values()), seeds)
    outs = _graph(x, w)
    _Counted.calls = 0
    got = backward_input(outs, seeds, x, w)
    assert not isinstance(got, str), got
    input_grads, pending = got
    assert _Counted.calls == 1  # I ran the chain once
    assert torch.allclose(input_grads[0], ref[0])
    del outs
    grads = pending.run()
    assert _Counted.calls == 1, "W ran an op of the input-gradient chain again"
    for (name, _), r in zip(w.items(), ref[1:]):
        assert torch.allclose(grads[name], r), name


def test_w_adds_into_given_buffers_as_a_plain_backward_adds_into_grad():
    """``run(into=...)``: each gradient is added into its buffer (which holds an earlier
    micro-batch's sum), a weight the outputs do not reach keeps its buffer as it was, nothing is
    returned, and the leaves' ``.grad`` is put back as the caller had it."""
    w = _weights()
    x = [torch.randn(3, 4, dtype=torch.float64, requires_grad=True)]
    outs = _graph(x, w)
    seeds = [torch.randn_like(o) for o in outs]
    ref = torch.autograd.grad(outs, list(w.values()), seeds)
    w["unused"] = torch.randn(2, dtype=torch.float64, requires_grad=True)
    w["a"].grad = marker = torch.zeros_like(w["a"])
    into = {n: torch.full_like(p, 0.5) for n, p in w.items()}
    buffers = dict(into)
    _, pending = backward_input(_graph(x, w), seeds, x, w)
    assert pending.run(into=into) == {}
    for (name, buf), r in zip(buffers.items(), ref):
        assert into[name] is buf and torch.allclose(buf, r + 0.5), name
    assert torch.equal(buffers["unused"], torch.full((2,), 0.5, dtype=torch.float64))
    assert w["a"].grad is marker and torch.equal(marker, torch.zeros_like(marker))
    assert all(p.grad is None for n, p in w.items() if n != "a")


def test_i_frees_what_only_the_input_chain_saved_and_outer_hooks_still_apply():
    """x -> Linear -> GELU -> Linear -> tanh: during I, each tensor only the input chain reads is
    freed once the next node has read (tanh's output before the first Linear runs); after I,
    GELU's saved input is gone too, while what W reads (each Linear's input) stays; the weight gradients equal a plain
    backward's, and a saved-tensor hook the caller had in force still packs and unpacks."""
    g = torch.Generator().manual_seed(0)
    w = {n: torch.randn(*s, dtype=torch.float64, generator=g, requires_grad=True)
         for n, s in (("fc", (8, 4)), ("out", (4, 8)))}
    x = torch.randn(3, 4, dtype=torch.float64, generator=g, requires_grad=True)

    def forward():
        h = x @ w["fc"].T
        return (torch.nn.functional.gelu(h) @ w["out"].T).tanh().sum(), h  # tanh saves its output

    ref = torch.autograd.grad(forward()[0], [x, *w.values()])
    outer = collections.Counter()

    def pack(t):
        outer["pack"] += 1
        return ("boxed", t)

    def unpack(box):
        outer["unpack"] += 1
        return box[1]

    saved = SavedTensors()
    with torch.autograd.graph.saved_tensors_hooks(pack, unpack), saved.hooks():
        loss, h = forward()
    h, fc = weakref.ref(h), h.grad_fn  # the GELU's input: only GeluBackward saved it
    before = len(saved)
    at_fc = []  # node by node, as a plain backward: tanh's output is gone once GeluBackward has read
    hook = fc.register_prehook(lambda grads: at_fc.append(len(saved)))
    input_grads, pending = backward_input([loss], [None], [x], w, saved)
    hook.remove()
    del loss, fc
    assert at_fc == [before - 1], (at_fc, before)
    assert h() is None, "I kept a tensor only the input chain reads"
    assert 0 < len(saved) < before
    grads = pending.run()
    assert len(saved) == 0, "W's calls left what they read alive"
    assert torch.allclose(input_grads[0], ref[0])
    for name, r in zip(w, ref[1:]):
        assert torch.allclose(grads[name], r), name
    assert outer["pack"] == before and outer["unpack"] > 0
    # without outer hooks: nothing the graph saved outlives it (a saved output must not hold its node)
    saved = SavedTensors()
    with saved.hooks():
        loss, _ = forward()
    _, pending = backward_input([loss], [None], [x], w, saved)
    saved, loss = weakref.ref(saved), None
    pending.run()
    del pending
    assert saved() is None, "the saved tensors kept their graph alive"


def test_first_stage_has_no_input_chain_and_w_does_the_whole_backward():
    w = _weights()
    outs = [(torch.ones(3, 4, dtype=torch.float64) @ w["a"]).sum()]
    ref = torch.autograd.grad(outs, [w["a"]])
    outs = [(torch.ones(3, 4, dtype=torch.float64) @ w["a"]).sum()]
    input_grads, pending = backward_input(outs, [None], [], w)
    assert input_grads == [] and torch.allclose(pending.run()["a"], ref[0])


def test_an_input_that_does_not_reach_the_outputs_gets_none():
    w = _weights()
    x = [torch.randn(3, 4, dtype=torch.float64, requires_grad=True) for _ in range(2)]
    input_grads, pending = backward_input([(x[0] @ w["a"]).sum()], [None], x, w)
    assert input_grads[1] is None and input_grads[0] is not None and set(pending.run()) == {"a"}


def test_a_weight_read_at_two_depths_splits_where_w_has_its_formula_and_not_otherwise():
    """A weight read at two depths of the input chain: through ``mm`` W computes each anchor's
    weight gradient itself and the split is exact, with the chain run once; through an operator
    W must run through autograd (``*``), that call would run the chain between the two again, so
    the split is refused with the reason (as where there is no weight to defer)."""
    w = _weights()
    x = [torch.randn(3, 4, dtype=torch.float64, requires_grad=True)]

    def twice(xs):
        return [(_Counted.apply((xs[0] @ w["a"]).relu()) @ w["a"]).sum()]

    ref = torch.autograd.grad(twice(x), [x[0], w["a"]])
    _Counted.calls = 0
    input_grads, pending = backward_input(twice(x), [None], x, w)
    assert [c.edges for c in pending.calls] == [[]]  # no autograd call in W
    assert torch.allclose(input_grads[0], ref[0]) and torch.allclose(pending.run()["a"], ref[1])
    assert _Counted.calls == 1, "W ran an op of the input-gradient chain again"
    reason = backward_input([((x[0] * w["c"][0]).relu() * w["c"][0]).sum()], [None], x, w)
    assert isinstance(reason, str) and "read at two depths of the input-gradient chain" in reason
    assert "no weight-gradient formula" in reason
    # one weight read by both kinds: the autograd call (for ``*``) must not lie above the ``mm``
    below = backward_input([(_Counted.apply(x[0] @ w["a"]).relu() * w["a"][0]).sum()], [None], x, w)
    assert isinstance(below, str) and "read at two depths" in below

    def above(xs):  # the ``*`` below the ``mm``: its call runs nothing of the chain
        return [(_Counted.apply((xs[0] * w["a"][0]).relu()) @ w["a"]).sum()]

    ref = torch.autograd.grad(above(x), [x[0], w["a"]])
    _Counted.calls = 0
    input_grads, pending = backward_input(above(x), [None], x, w)
    assert [(len(c.edges), len(c.direct)) for c in pending.calls] == [(1, 1)]
    assert torch.allclose(input_grads[0], ref[0]) and torch.allclose(pending.run()["a"], ref[1])
    assert _Counted.calls == 1, "W ran an op of the input-gradient chain again"
    assert "no trainable weight" in backward_input([(x[0] * 2).sum()], [None], x, {})


def check_w_formulas(device: str) -> None:
    """The anchors W computes itself (``mm``, ``addmm``, ``layer_norm``, an elementwise gain,
    ``convolution``, ``native_batch_norm``) give exactly the gradients a plain backward gives on
    ``device``, whatever the layout of the weight (``x @ W.T`` and ``x @ W``), the scalars of
    ``addmm``, an affine layer norm with or without its bias, a gain on either side of ``*`` and
    broadcast, a convolution with or without bias (strided, padded, grouped, transposed), a
    BatchNorm with and without weights and statistics, and the dtype; a weight reached through
    anything more than a ``t`` (here ``W * 2``) goes through autograd, and so does an operator
    without a formula (``/``)."""
    torch.manual_seed(0)
    for dtype in (torch.float32, torch.float64, torch.bfloat16):
        w = {"lin": torch.randn(6, 5), "b": torch.randn(6), "rowmajor": torch.randn(6, 4), "ln": torch.randn(4),
             "ln_b": torch.randn(4), "ln2": torch.randn(4), "scaled": torch.randn(4, 4), "doubled": torch.randn(4, 4),
             "mul": torch.randn(4), "gain_left": torch.randn(6, 1), "conv": torch.randn(4, 2, 3), "conv_b": torch.randn(4),
             "grouped": torch.randn(4, 2, 1), "up": torch.randn(4, 3, 2), "up_b": torch.randn(3), "bn": torch.randn(3),
             "bn_b": torch.randn(3), "div": torch.rand(4) + 1}
        w = {n: t.to(device, dtype).requires_grad_() for n, t in w.items()}
        x = [torch.randn(2, 3, 5, dtype=dtype, device=device, requires_grad=True)]

        def graph(xs):
            h = torch.nn.functional.linear(xs[0], w["lin"], w["b"]).tanh()  # 3-D: addmm on a view
            h = torch.nn.functional.layer_norm(h.reshape(6, 6) @ w["rowmajor"], (4,), w["ln"], w["ln_b"])
            h = torch.nn.functional.layer_norm(h, (4,), w["ln2"])  # no bias
            h = torch.addmm(h, h, w["scaled"], beta=0.5, alpha=2.0)
            h = torch.nn.functional.layer_norm(h @ (w["doubled"] * 2), (4,))  # not affine
            h = w["gain_left"] * (h * w["mul"])  # gains, broadcast, on both sides of *
            c = torch.nn.functional.conv1d(h.reshape(3, 2, 4), w["conv"], w["conv_b"], stride=2, padding=1)
            c = torch.nn.functional.conv1d(c, w["grouped"], groups=2)  # no bias
            c = torch.nn.functional.conv_transpose1d(c, w["up"], w["up_b"], stride=2)
            stats = torch.zeros(3, dtype=dtype, device=device), torch.ones(3, dtype=dtype, device=device)
            c = torch.nn.functional.batch_norm(c, *stats, w["bn"], w["bn_b"], training=True)  # updates stats
            c = torch.nn.functional.batch_norm(c, None, None, training=True)  # no weight, no statistics
            return [(c.square().sum() + (h / w["div"]).square().sum()).reshape(1)]

        # bit for bit needs cuDNN's deterministic algorithms: some of its weight gradients use atomics
        with torch.backends.cudnn.flags(enabled=True, benchmark=False, deterministic=True):
            # cuDNN's BatchNorm has a node of its own, which W leaves to autograd; whether the graph's
            # first batch_norm takes it depends on the dtype, its weight and bias and the input's shape
            probe = torch.ones(3, 3, 4, dtype=dtype, device=device)
            stats = torch.zeros(3, dtype=dtype, device=device), torch.ones(3, dtype=dtype, device=device)
            first_bn = torch.nn.functional.batch_norm(probe, *stats, w["bn"], w["bn_b"], training=True)
            native_bn = type(first_bn.grad_fn) is backward._BatchNorm
            ref = torch.autograd.grad(graph(x), [x[0], *w.values()])
            input_grads, pending = backward_input(graph(x), [None], x, w)
            direct = {name for call in pending.calls for _, sinks, _ in call.direct for _, name, _ in sinks}
            assert direct == set(w) - {"doubled", "div"} - (set() if native_bn else {"bn", "bn_b"}), direct
            assert torch.equal(input_grads[0], ref[0])
            got = pending.run()
        for (name, _), r in zip(w.items(), ref[1:]):
            assert got[name].dtype == dtype and torch.equal(got[name], r), (dtype, name)


def test_w_computes_its_anchors_weight_gradients_bit_for_bit_as_autograd():
    check_w_formulas("cpu")


def test_the_analysis_is_done_once_per_graph_shape_and_redone_when_the_shape_changes():
    w = _weights()
    x = [torch.randn(3, 4, dtype=torch.float64, requires_grad=True)]
    seeds = [torch.randn(3, 4, dtype=torch.float64), torch.ones(1, dtype=torch.float64)]

    def check(graph, weights, cache):
        ref = torch.autograd.grad(graph(x, w), x + list(weights.values()), seeds, allow_unused=True)
        _Counted.calls = 0
        got = backward_input(graph(x, w), seeds, x, weights, cache=cache)
        input_grads, pending = got
        grads = pending.run()
        assert _Counted.calls == 1, "W ran an op of the input-gradient chain again"
        assert torch.allclose(input_grads[0], ref[0])
        assert set(grads) == {n for n, r in zip(weights, ref[1:]) if r is not None}
        for name, r in zip(weights, ref[1:]):
            assert r is None or torch.allclose(grads[name], r), name

    cache = SplitCache()
    for _ in range(3):  # micro-batches: a new graph of the same shape each time
        check(_graph, w, cache)
    assert (cache.misses, cache.hits) == (1, 2)

    def other(xs, w):  # the same types and weights, the two matmuls' weights swapped
        h = _Counted.apply(xs[0] @ w["b"]).relu()
        h = torch.nn.functional.layer_norm(h, (4,), w["ln"][0], w["ln"][1]) @ w["a"] + w["c"][0]
        return [h.tanh(), (w["c"] * 2).sum().reshape(1)]

    check(other, w, cache)
    assert (cache.misses, cache.hits) == (2, 2)
    frozen = {n: t for n, t in w.items() if n != "b"}  # a weight frozen between steps
    w["b"].requires_grad_(False)
    check(other, frozen, cache)
    check(other, frozen, cache)
    assert (cache.misses, cache.hits) == (3, 3)
    w["b"].requires_grad_(True)
    # a graph that cannot split gives its reason again on a hit, running nothing
    cache = SplitCache()
    reasons = [backward_input([((x[0] * w["c"][0]).relu() * w["c"][0]).sum()], [None], x, w, cache=cache)
               for _ in range(2)]
    assert reasons[0] == reasons[1] and "two depths" in reasons[0] and (cache.misses, cache.hits) == (1, 1)


def test_a_graph_shape_tells_shared_nodes_and_input_slots_apart():
    a = torch.randn(4, 4, requires_grad=True)
    x = torch.randn(3, 4, requires_grad=True)
    labels = {id(a): "a", id(x): "x"}

    def shape(out):
        return _shape([torch.autograd.graph.get_gradient_edge(out)], labels)[1]

    h = x @ a
    shared = shape(h * h)  # one matmul read twice
    assert shape((x @ a) * (x @ a)) != shared  # two matmuls
    assert shape(x @ a * (h := x @ a)) != shared and shape(h * h) == shared
    assert shape(x @ a) != shape(a.T @ x.T)
    unbound = torch.randn(2, 4, requires_grad=True)
    first, second = unbound.unbind(0)
    labels[id(unbound)] = "u"
    assert shape(first * 2) != shape(second * 2)  # the same node, entered at another slot
    assert shape(first * second) != shape(first * first)  # ... when it was seen before


class _SharedLayer(nn.Module):
    """Wide layers, then one small layer applied at three depths: the planner cuts among the wide
    ones, so the second stage reads the shared weights at three depths of its input chain. The
    shared layer is a Linear, a Linear and an elementwise gain (whose weight gradients W computes
    itself), or a Linear and a learnt divisor (which W must run through autograd)."""

    def __init__(self, extra: str | None = None):
        super().__init__()
        torch.manual_seed(0)
        self.wide = nn.Sequential(nn.Linear(6, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 8))
        self.shared = nn.Linear(8, 8)
        self.extra = extra
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, 8)) if extra else None
        self.out = nn.Linear(8, 3)

    def forward(self, x):
        h = self.wide(x)
        for _ in range(3):
            h = torch.tanh(self.shared(h))
            if self.extra == "gain":
                h = h * self.scale
            elif self.extra == "divisor":
                h = h / self.scale
        return self.out(h)


@pytest.mark.parametrize("extra", [None, "gain", "divisor"])
def test_a_layer_applied_at_three_depths_splits_or_falls_back_to_a_plain_backward_and_says_why(extra):
    from tests.reference import train_flush

    model = _SharedLayer(extra).double()
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(8, 6, generator=g, dtype=torch.float64), torch.randint(0, 3, (8,), generator=g))
               for _ in range(4)]
    opt = lambda named: torch.optim.SGD([p for _, p in named], lr=0.1)  # noqa: E731
    loss_fn = nn.functional.cross_entropy
    pipe = fxpipe.compile(model, (batches[0][0][:2],), loss_fn=loss_fn, optimizer=opt, microbatches=4, stages=2,
                          schedule="zb", verbose=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        losses = [pipe.step(*b) for b in batches]
    unsplit = {w.index: w.store.unsplit for w in pipe.workers.values()}
    said = [str(c.message) for c in caught if "runs unsplit" in str(c.message)]
    assert unsplit[0] is None
    if extra == "divisor":
        assert "read at two depths of the input-gradient chain" in unsplit[1]
        assert len(said) == 1 and said[0].startswith("fxpipe: zb on stage 1: its backward runs unsplit in I (W is "
                                                     "empty)")
    else:
        assert unsplit[1] is None and said == []
    ref_losses, ref = train_flush(_SharedLayer(extra).double(), batches, 4, loss_fn, opt)
    assert losses == pytest.approx(ref_losses, rel=1e-10)
    for k, v in ref.state_dict().items():
        assert torch.allclose(pipe.state_dict()[k], v, rtol=1e-10, atol=1e-12), k


# ---------------------------------------------------------------------------------------------
# The order: shorter than 1f1b, within its in-flight bound


@pytest.mark.parametrize("d,m", [(2, 4), (3, 6), (4, 4), (4, 8)])
@pytest.mark.parametrize("i_cost,w_cost", [(1.0, 1.0), (1.2, 0.8)])
def test_zb_step_time_is_the_papers_formula_and_beats_1f1b(d, m, i_cost, w_cost):
    costs = Costs(forward=1.0, backward=i_cost + w_cost, backward_input=i_cost, backward_weight=w_cost)
    zb = simulate(generate("zb", d, m, 4), costs)
    flush = simulate(generate("1f1b", d, m, 4), costs)
    # ZB-H1 (Qi et al. 2024, section 3): m (F + I + W) + (d - 1)(F + I - W), for m >= d
    assert zb.step_time == pytest.approx(m * 3.0 + (d - 1) * (1.0 + i_cost - w_cost))
    assert flush.step_time == pytest.approx((m + d - 1) * 3.0)
    assert zb.step_time < flush.step_time
    if i_cost == w_cost:
        assert zb.step_time == pytest.approx(pipeline_time("zb", d, m, 3.0, forward=1.0))
        assert zb.step_time == pytest.approx(pipeline_time("zb", d, m, 3.0))  # forward = a third


def test_default_split_of_a_backward_and_the_first_stage():
    c = Costs(forward=1.0, backward=[2.0, 3.0])
    assert (c.per_stage("backward_input", 1), c.per_stage("backward_weight", 1)) == (1.5, 1.5)
    tl = simulate(generate("zb", 2, 2, 1), c)
    span = {e.action: e.end - e.start for e in tl.events if e.stream == "compute"}
    assert span["0I1v0"] == 0 and span["0W1v0"] == 2.0  # the first stage's W is its whole backward
    assert span["1I1v0"] == 1.5 and span["1W1v0"] == 1.5
    # a calibrated split that costs more than a backward: the first stage runs a plain backward
    dear = Costs(forward=1.0, backward=[2.0, 3.0], backward_input=[1.4, 2.1], backward_weight=[1.0, 1.5])
    span = {e.action: e.end - e.start for e in simulate(generate("zb", 2, 2, 1), dear).events}
    assert span["0W1v0"] == 2.0 and (span["1I1v0"], span["1W1v0"]) == pytest.approx((2.1, 1.5))


def test_calibration_times_the_split_against_a_whole_backward():
    """``calibrate(split=True)`` cuts the graph in the middle (every live value becomes a boundary
    input) and times I and W against a whole backward of the second half, each in ZB-H1's order
    on the last stage (``F k+1, I k+1, W k``); a graph that cannot be
    split gives (1, 0), the runtime's fallback. A zb plan with a calibrated split takes its step
    time from the simulator with those costs."""
    from fxpipe.calibrate import _time_split, _timing_setup
    from fxpipe.cost import DeviceModel
    from fxpipe.simulate import Costs
    from fxpipe.partition import plan

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(64, 64), nn.Tanh()) for _ in range(4)])
    x = torch.randn(16, 64)
    gm = fxpipe.trace(model, (x,))
    i, w = _time_split(gm, _timing_setup(gm, (x,), None)[2], lambda: None, 3)
    assert i > 0 and w > 0  # split (the fallback is (1, 0)); on so small a model the graph walk dominates

    class Twice(nn.Module):  # the second half divides by one learnt scale at two depths
        def __init__(self):
            super().__init__()
            self.first, self.scale = nn.Sequential(*[nn.Linear(8, 8) for _ in range(4)]), nn.Parameter(torch.ones(8))

        def forward(self, x):
            return torch.tanh(self.first(x) / self.scale) / self.scale

    twice = fxpipe.trace(Twice(), (torch.randn(4, 8),))
    assert _time_split(twice, _timing_setup(twice, (torch.randn(4, 8),), None)[2], lambda: None, 1) == (1.0, 0.0)

    dev = DeviceModel(backward_input_share=0.7, backward_weight_share=0.5)
    p = plan(model, (x[:4],), stages=2, microbatches=4, schedule="zb", device=dev, world_size=2)
    costs = Costs.of_plan(p)
    assert costs.per_stage("backward_input", 1) == pytest.approx(0.7 * costs.per_stage("backward", 1))
    assert p.step_time == pytest.approx(simulate(generate("zb", 2, 4, 8), costs).step_time)


def test_a_costly_split_moves_the_cut_where_the_simulator_says():
    """With I + W dearer than a backward (a calibrated split), zb's first stage, which runs its
    whole backward as W, should take more of the graph than balanced stages give it where the
    later stages split most of their backwards: at m = d every one of them (zb_split). The
    planner moves the cut to the allowed position of lowest simulated step (the best of every
    single cut here) and stays within the memory limit. At m = 2d only the warm-up's and the
    cool-down's backwards run split, and the balanced cut is the best there."""
    from fxpipe.cost import DeviceModel
    from fxpipe.simulate import Costs
    from fxpipe.partition import plan

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(64, 64), nn.Tanh()) for _ in range(8)])
    x = torch.randn(8, 64)
    gm = fxpipe.trace(model, (x,))
    links = dict(p2p_latency=1e-7, p2p_bandwidth=1e12)  # compute-bound: a tiny model's sends would dominate
    dear = DeviceModel(backward_input_share=0.7, backward_weight_share=0.6, **links)
    lists = generate("zb", 2, 2, 8)

    def step(p):  # the simulated step of p's cuts under the dear split
        return simulate(lists, Costs.of_plan(dataclasses.replace(p, device=dear))).step_time

    balanced = plan(gm, stages=2, microbatches=2, schedule="zb", device=DeviceModel(**links), world_size=2)
    moved = plan(gm, stages=2, microbatches=2, schedule="zb", device=dear, world_size=2)
    first = lambda p: p.stage_plans[0].forward_time  # noqa: E731
    assert first(moved) > first(balanced)
    assert moved.step_time == pytest.approx(step(moved)) and moved.step_time < 0.99 * step(balanced)
    assert plan(gm, stages=2, microbatches=2, schedule="zb", device=dear, world_size=2).assignment_pairs == \
        moved.assignment_pairs  # deterministic: every rank plans the same cuts

    # every allowed single cut, priced the same way: the planner's is the best of them
    chain = chain_from_graph(gm, annotate(gm, mode="analytic", device=dear), 8, schedule="zb")
    best = min(step(_with_cut(moved, gm, chain, c, dear)) for c in range(chain.n - 1) if chain.valid[c])
    assert moved.step_time == pytest.approx(best, rel=1e-9)

    # a memory limit the moved first stage breaks keeps the cut where it fits
    tight = moved.stage_plans[0].memory - 1.0
    fitted = plan(gm, stages=2, microbatches=2, schedule="zb", device=dear, world_size=2, device_memory=tight)
    assert all(sp.memory <= tight for sp in fitted.stage_plans) and first(fitted) < first(moved)




def test_a_costly_split_leaves_the_balanced_cut_where_the_steady_state_runs_whole():
    """At m = 2d the later stage splits only its first and last backward of a step (zb_split):
    the balanced cut is the simulator's best, and the planner keeps it."""
    from fxpipe.cost import DeviceModel
    from fxpipe.partition import plan

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(64, 64), nn.Tanh()) for _ in range(8)])
    gm = fxpipe.trace(model, (torch.randn(8, 64),))
    links = dict(p2p_latency=1e-7, p2p_bandwidth=1e12)
    dear = DeviceModel(backward_input_share=0.7, backward_weight_share=0.6, **links)
    balanced = plan(gm, stages=2, microbatches=4, schedule="zb", device=DeviceModel(**links), world_size=2)
    kept = plan(gm, stages=2, microbatches=4, schedule="zb", device=dear, world_size=2)
    assert kept.assignment_pairs == balanced.assignment_pairs


def _with_cut(p, gm, chain, c, device):
    """``p`` with its one cut after chain position ``c`` (stage plans as the planner builds them)."""
    from fxpipe.partition import StageModel, _assignment, _stage_plan

    model = StageModel.for_schedule(p.schedule, 2, p.microbatches, False, device)
    bounds = ((0, c), (c + 1, chain.n - 1))
    sps = tuple(_stage_plan(gm, chain, model, s, l, r) for s, (l, r) in enumerate(bounds))
    return dataclasses.replace(p, stage_plans=sps, assignment_pairs=_assignment(gm, bounds))


@pytest.mark.parametrize("d,m", [(2, 2), (2, 4), (3, 5), (4, 4), (4, 8), (4, 2), (5, 3)])
@pytest.mark.parametrize("recompute", [False, True])
def test_peak_in_flight_is_within_the_bound(d, m, recompute):
    tl = simulate(generate("zb", d, m, 3, recompute=recompute), Costs())
    want = {s: zb_bounds(s, d, m, recompute)[0] for s in range(d)}
    assert tl.peak_in_flight == want
    assert all(v <= min(d, m) for v in want.values())
    if not recompute:  # the paper's ZB-H1: the peak of 1f1b's first stage on every stage
        assert set(want.values()) == {min(d, m)}


def test_recomputing_stages_run_r_i_w_together():
    """A recomputing stage defers no W: each backward is ``R k, B k`` or, where zb splits it (the
    cool-down's, zb_split), ``R k, I k, W k``, adjacent."""
    lists = generate("zb", 3, 6, 2, recompute=[True, True, False])
    for s in (0, 1):
        compute = [a for a in lists[s] if a.kind in (Kind.R, Kind.B, Kind.I, Kind.W)]
        groups, j = [], 0
        while j < len(compute):
            n = 2 if compute[j + 1].kind is Kind.B else 3
            groups.append(compute[j:j + n])
            j += n
        assert all([a.kind for a in g] in ([Kind.R, Kind.B], [Kind.R, Kind.I, Kind.W]) and len({a.index for a in g}) == 1
                   for g in groups)
        assert {g[0].index for g in groups if len(g) == 3} == {k for k in range(1, 13) if zb_split(s, 3, 6, k, True)}
        assert any(len(g) == 3 for g in groups) and any(len(g) == 2 for g in groups)
    assert any(a.kind is Kind.W for a in lists[2])  # stage 2 still defers


def test_validator_rejects_broken_zb_lists():
    d, m = 2, 4
    good = generate("zb", d, m, 1)

    def broken(stage, edit):
        lists = {s: list(v) for s, v in good.items()}
        edit(lists[stage])
        return lists

    def swap(kind_a, kind_b, k):
        def edit(lst):
            i = lst.index(next(a for a in lst if a.kind is kind_a and a.index == k))
            j = lst.index(next(a for a in lst if a.kind is kind_b and a.index == k))
            lst[i], lst[j] = lst[j], lst[i]
        return edit

    with pytest.raises(ScheduleError, match="weight pass of micro-batch 1 before its input-gradient pass"):
        validate(broken(1, swap(Kind.I, Kind.W, 1)), "zb", d, m)
    def late(kind, k, after):
        """Stage 1's ``kind k`` and its SEND_GRAD moved to right after its ``F after``."""
        def edit(lst):
            moved = [a for a in lst if a.index == k and a.kind in (kind, Kind.SEND_GRAD)]
            for a in moved:
                lst.remove(a)
            at = lst.index(Action(1, Kind.F, after, 0)) + 1
            lst[at:at] = moved
        return edit

    # F2 F3 B2: micro-batches 1 (past its I), 2 and 3 in flight
    with pytest.raises(ScheduleError, match=r"3 micro-batches of activations in flight, expected at most min\(d, m\) = 2"):
        validate(broken(1, late(Kind.B, 2, after=3)), "zb", d, m)
    # F1 F2 I1: the last stage holding two whole micro-batches
    with pytest.raises(ScheduleError, match=r"1F2v0 .*2 micro-batches between their F and their I, expected at most "
                                            r"min\(d - s, m\) = 1 \(zb on stage 1 of 2"):
        validate(broken(1, late(Kind.I, 1, after=2)), "zb", d, m)
    # which micro-batches zb splits is fixed (zb_split: the runtime's forward prepares for it)
    with pytest.raises(ScheduleError, match=re.escape("zb has no B1 on stage 1 (its backward of micro-batch 1 is "
                                                      "I + W). Use 1I1 and 1W1 instead")):
        validate(broken(1, lambda lst: (lst.__setitem__(lst.index(Action(1, Kind.I, 1, 0)), Action(1, Kind.B, 1, 0)),
                                        lst.remove(Action(1, Kind.W, 1, 0)))), "zb", d, m)

    def split_b2(lst):
        at = lst.index(Action(1, Kind.B, 2, 0))
        lst[at:at + 1] = [Action(1, Kind.I, 2, 0), Action(1, Kind.W, 2, 0)]

    with pytest.raises(ScheduleError, match=re.escape("zb has no I2 on stage 1 (its backward of micro-batch 2 is B). "
                                                      "Use 1B2 instead")):
        validate(broken(1, split_b2), "zb", d, m)
    with pytest.raises(ScheduleError, match=r"1UPDATE1 .*: 2 weight versions alive after it \(W\(0\), W\(1\)\)"):
        validate(broken(1, lambda lst: (lst.remove(Action(1, Kind.W, 4, 0)), lst.append(Action(1, Kind.W, 4, 0)))),
                 "zb", d, m)
    rc = generate("zb", d, m, 1, recompute=True)  # stage 0: ... R3 I3 W3 R4 I4 W4 -> ... R3 I3 R4 I4 W3 W4
    rc[0] = [a for a in rc[0] if a != Action(0, Kind.W, 3, 0)]
    rc[0].insert(rc[0].index(Action(0, Kind.W, 4, 0)), Action(0, Kind.W, 3, 0))
    with pytest.raises(ScheduleError, match="stage 0 recomputes, so W3 must directly follow I3 \\(found 0I4v0"):
        validate(rc, "zb", d, m, recompute=True)


def test_picture_draws_i_and_w_in_their_own_colours():
    svg = render_svg(simulate(generate("zb", 2, 4, 1), Costs(1.0, 2.0)))
    assert legend(svg) == {"F forward", "B backward", "I input-gradient backward", "W weight-gradient backward",
                           "U optimizer step (not priced: a tick)", "idle (hatched)"}
    assert "I1v0" in svg and "W1v0" in svg


# ---------------------------------------------------------------------------------------------
# The planner's memory model


def test_planner_counts_zb_activations():
    device = fxpipe.cost.DeviceModel.for_device(torch.device("cpu"))

    def held(schedule, m, recompute=False):  # per stage, (whole activations, deferred W, kept outputs) at each moment
        sm = StageModel.for_schedule(schedule, 4, m, recompute, device)
        return [[(h.whole, h.deferred, h.outputs) for h in sm.moments[s]] for s in range(4)]

    # 1f1b's whole micro-batches (d - s), the rest of ZB-H1's min(d, m) deferred, and between an
    # I and its W one more deferred: min(d, m) micro-batches on every stage at every moment
    assert held("zb", 8) == [[(4, 0, 0)], [(3, 1, 0), (2, 2, 0)], [(2, 2, 0), (1, 3, 0)], [(1, 3, 0), (0, 4, 0)]]
    assert held("zb", 2) == [[(2, 0, 0)], [(2, 0, 0), (1, 1, 0)], [(2, 0, 0), (1, 1, 0)], [(1, 1, 0), (0, 2, 0)]]
    assert held("1f1b", 8) == [[(4, 0, 0)], [(3, 0, 0)], [(2, 0, 0)], [(1, 0, 0)]]
    # recomputing: one micro-batch whole (or deferred), the inputs of 1f1b's count kept
    assert held("zb", 8, True) == [[(1, 0, 4)], [(1, 0, 3), (0, 1, 3)], [(1, 0, 2), (0, 1, 2)], [(1, 0, 1), (0, 1, 1)]]
    assert pipeline_time("zb", 4, 8, 3.0, recompute=True) == pipeline_time("1f1b", 4, 8, 3.0)


def test_planner_prices_a_deferred_w_at_the_inputs_its_weights_read():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b, self.c = nn.Linear(16, 32), nn.Linear(32, 8), nn.Linear(32, 8)
            self.frozen = nn.Linear(8, 8).requires_grad_(False)

        def forward(self, x):
            h = torch.nn.functional.gelu(self.a(x))  # GELU's input: only the input chain reads it
            y = self.b(h.view(2, 2, 32)).view(4, 8) + self.c(h)  # h read by two weights (one through a view): once
            return self.frozen(torch.tanh(y))  # a frozen weight has no W

    gm = fxpipe.trace(Net(), (torch.randn(4, 16),))
    costs = annotate(gm)
    chain = chain_from_graph(gm, costs, 4, schedule="zb")
    reader = {t: name for name, nd in zip(chain.names, (n for n in gm.graph.nodes if n.name in chain.names))
              for t in nd.meta["fxpipe"].params}
    reads = dict(zip(chain.names, chain.weight_reads))
    gelu = next(n.name for n in gm.graph.nodes if "gelu" in str(n.target))
    h, y = 4 * 32 * 4, 4 * 8 * 4  # bytes of h and of each of b's and c's outputs at micro-batch size 4
    assert chain.act[chain.names.index(gelu)] == h
    # x is the graph's input (the stage's input buffer): a's share is the gradient I records
    # flowing into it (an anchor's), the size of its output
    assert reads[reader["a.weight"]] == h
    assert reads[reader["b.weight"]] + reads[reader["c.weight"]] == h + 2 * y  # h once, two anchors' gradients
    assert reads[reader["frozen.weight"]] == 0 and sum(reads.values()) == 2 * h + 2 * y
    # the last of 2 stages, at the fuller of ZB-H1's two moments: one micro-batch whole and one
    # W deferred, with one more received input than 1f1b (ZB-H1 keeps min(d, m) micro-batches'
    # inputs between F and W); or two W deferred and none whole, with the next input received
    # (the last stage has no output cut: no gradient receive either way)
    device = costs.device
    zb, flush = (StageModel.for_schedule(s, 2, 4, False, device) for s in ("zb", "1f1b"))
    n = chain.n
    # a(x) crosses the cut after it, and its gradient back with its reached-flag byte
    assert chain.cross[0] == h and chain.cross_grad[0] == h + 1
    E, A, inp = h + 2 * y, float(chain.act[1:].sum()), chain.cross[0]
    assert stage_memory(chain, zb, 1, 1, n - 1) == stage_memory(chain, flush, 1, 1, n - 1) + max(
        E + inp, 2 * E + inp - A)
    assert stage_memory(chain, zb, 0, 0, n - 1) == stage_memory(chain, flush, 0, 0, n - 1)
    # a stage whose input carries no gradient has an empty I: its W keeps the whole activations
    acts = float(chain.act.sum())
    assert stage_memory(chain, zb, 1, 0, n - 1) == stage_memory(chain, flush, 1, 0, n - 1) + acts


# ---------------------------------------------------------------------------------------------
# A real run: what each stage keeps alive


def _live_microbatches(schedule, recompute=False):
    """Per rank, the peak number of micro-batches whose autograd-saved tensors are alive, sampled
    after every action of two steps (saved tensors boxed by a saved_tensors_hooks pack hook)."""
    case = dataclasses.replace(CASES["gpt2_zb"], schedule=schedule, recompute=recompute, steps=2)
    model, example, batches, loss_fn, opt = build(case)
    pipe = fxpipe.compile(model, example, loss_fn=loss_fn, optimizer=opt, microbatches=4, stages=2,
                          schedule=schedule, recompute=recompute or None, verbose=False)
    pipe.step(*batches[0])  # set-up done outside the measurement
    live: dict = weakref.WeakKeyDictionary()
    current = [None]

    class Box:
        def __init__(self, t):
            self.t = t.detach()  # no grad_fn: a box holding an output would form a cycle with its node

    def pack(t):
        box = Box(t)
        live[box] = current[0]
        return box

    acting = [None]
    reads: dict = collections.defaultdict(set)  # (rank, kind, micro-batch index) -> ids of the boxes read there
    kept: dict = {}  # (rank, micro-batch index) -> ids of its boxes alive after its I or B
    kept_bytes: dict = {}  # the same: the bytes of their storages other than weights, each once,
    # and of the gradients I recorded at the anchors for W

    def unpack(box):
        reads[acting[0]].add(id(box))
        return box.t

    peak = collections.Counter()
    ctx_peak = collections.Counter()
    for r, wk in pipe.workers.items():
        run = wk.run

        def traced(a, run=run, r=r, wk=wk):
            current[0], acting[0] = (r, a.index), (r, a.kind, a.index)
            run(a)
            held = {mb for (rank, mb) in live.values() if rank == r}
            peak[r] = max(peak[r], len(held))
            ctx_peak[r] = max(ctx_peak[r], len(wk.ctx))
            if a.kind in (Kind.I, Kind.B):
                weights = {t.untyped_storage().data_ptr() for v in wk.store.leaves for t in v.values()}
                # the weights themselves (an anchor saves its weight for I's input gradient) cost nothing
                kept[r, a.index] = {id(b) for b, owner in live.items() if owner == (r, a.index)
                                    and b.t.untyped_storage().data_ptr() not in weights}
                storages = {b.t.untyped_storage().data_ptr(): b.t.untyped_storage().nbytes()
                            for b, owner in live.items() if owner == (r, a.index)}
                pending = wk.ctx.get(a.index, {}).get("pending")  # PendingWeights where I split
                for call in getattr(pending, "calls", ()):
                    grads = [*call.grads, *(g for _, _, g in call.direct)]
                    storages.update((g.untyped_storage().data_ptr(), g.untyped_storage().nbytes()) for g in grads)
                kept_bytes[r, a.index] = sum(n for ptr, n in storages.items() if ptr not in weights)

        wk.run = traced
    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        pipe.step(*batches[1])
    left = len(live)
    return dict(peak), dict(ctx_peak), left, (kept, reads, kept_bytes, pipe)


def test_a_real_zb_step_keeps_at_most_the_bound_alive():
    peak, ctx, left, detail = _live_microbatches("zb")
    assert peak == {0: 2, 1: 2} and ctx == {0: 2, 1: 2}  # min(d, m) = 2 on both stages
    assert left == 0, "a graph outlived its micro-batch's W"
    # what a micro-batch keeps from I to W is only what W reads: I freed what only its input chain saved
    kept, reads, kept_bytes, pipe = detail
    assert len(kept) == 8
    # the last stage's graph was analysed once, for the first of the 4 micro-batches it split in
    # 2 steps (zb_split: each step's first and last; the two between run a whole B)
    cache = pipe.workers[1].store.split_cache
    assert pipe.workers[1].store.unsplit is None and (cache.misses, cache.hits) == (1, 3)
    for (r, k), ids in kept.items():
        if zb_split(r, 2, 4, k):
            assert ids and ids <= reads[r, Kind.W, k], (r, k, len(ids - reads[r, Kind.W, k]))
        else:  # a whole B frees its micro-batch's saved tensors, as 1f1b's does
            assert not ids, (r, k, len(ids))
    # the planner prices a deferred micro-batch on the last stage at what its W reads (the
    # saved tensors and the anchors' gradients): within 5%
    gm = pipe.staged_graph
    chain = chain_from_graph(gm, annotate(gm), pipe.plan.microbatch_size, schedule="zb")
    priced = sum(w for name, w in zip(chain.names, chain.weight_reads) if pipe.plan.assignment[name] == 1)
    for k in (5, 8):
        assert priced == pytest.approx(kept_bytes[1, k], rel=0.05), (k, priced, kept_bytes[1, k])
    peak, ctx, left, _ = _live_microbatches("1f1b")
    assert peak == {0: 2, 1: 1} and ctx == {0: 2, 1: 1} and left == 0
    # recomputation: F keeps no graph; R k, I k, W k adjacent hold one micro-batch's at a time
    peak, ctx, left, _ = _live_microbatches("zb", recompute=True)
    assert peak == {0: 1, 1: 1} and left == 0


def test_inspect_draws_a_zb_plan(tmp_path):
    from fxpipe.inspect import inspect_pipeline

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
    inspect_pipeline(model, (torch.randn(2, 8),), str(tmp_path), stages=2, microbatches=4, schedule="zb")
    svg = (tmp_path / "schedule.svg").read_text()
    assert "zb, 2 stages x 1 replica" in svg
    assert {"I input-gradient backward", "W weight-gradient backward"} <= legend(svg)
