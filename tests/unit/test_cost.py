"""Tests of the cost model: FLOPs against hand counts, scaling in b, measured mode, the device model."""

import dataclasses
import math

import pytest
import sympy
import torch
from torch import nn

import fxpipe
from fxpipe.cost import DeviceModel, Linear, annotate, b
from fxpipe.errors import PlanError


def linear_gm(batch=4):
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))
    return fxpipe.trace(model, (torch.randn(batch, 16),)), model


def test_analytic_flops_and_bytes_match_hand_counts():
    gm, _ = linear_gm(4)
    costs = annotate(gm, mode="analytic")
    lin = [n for n in gm.graph.nodes if n.op == "call_function" and "linear" in str(n.target)]
    assert [costs.nodes[n.name].flops(4) for n in lin] == [2 * 4 * 16 * 32, 2 * 4 * 32 * 8]
    assert costs.nodes[lin[0].name].out_bytes(4) == 4 * 32 * 4
    # every node has its cost attached, and a NodeCost for placeholders/parameters too
    assert all("fxpipe_cost" in n.meta for n in gm.graph.nodes if n.op != "output")


def test_costs_are_linear_in_b_as_sympy():
    gm, _ = linear_gm(4)
    costs = annotate(gm)
    lin = next(n for n in gm.graph.nodes if "linear" in str(n.target))
    c = costs.nodes[lin.name]
    assert c.flops.expr == sympy.Float(2 * 16 * 32) * b
    assert c.flops(8) == 2 * c.flops(4)  # FLOPs scale with the samples processed
    assert c.fwd_time(8) > c.fwd_time(4) > 0
    assert math.isclose(float(c.fwd_time.expr.subs(b, 8)), c.fwd_time(8))
    # a parameter-only node does not scale with b
    w = next(n for n in gm.graph.nodes if n.op == "get_attr")
    assert costs.nodes[w.name].out_bytes.a == 0


def test_backward_is_twice_forward_in_analytic_mode():
    gm, _ = linear_gm(64)
    dev = DeviceModel(op_latency=0.0)
    costs = annotate(gm, device=dev)
    lin = next(n for n in gm.graph.nodes if "linear" in str(n.target))
    c = costs.nodes[lin.name]
    assert math.isclose(c.bwd_time(64), 2 * c.fwd_time(64))


def test_sdpa_flops_counted():
    class Attn(nn.Module):
        def forward(self, q):
            return torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)

    q = torch.randn(2, 4, 16, 8)
    gm = fxpipe.trace(Attn(), (q,))
    costs = annotate(gm)
    assert costs.total("flops", 2) == 4 * 2 * 4 * 16 * 16 * 8


def test_measured_mode_times_every_compute_node_and_keeps_state():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Dropout(0.1), nn.Linear(32, 8))
    x = torch.randn(8, 16)
    gm = fxpipe.trace(model, (x,))
    stats = model[1].running_mean.clone()
    rng = torch.get_rng_state()
    costs = annotate(gm, (x,), mode="measured", repeats=2)
    compute = [n for n in gm.graph.nodes if n.op == "call_function"]
    assert all(costs.nodes[n.name].fwd_time(8) > 0 for n in compute)
    assert any(costs.nodes[n.name].bwd_time(8) > 0 for n in compute)
    assert torch.equal(model[1].running_mean, stats) and torch.equal(torch.get_rng_state(), rng)


def test_linear_fit():
    f = Linear.fit(10.0, 2, scales=True, fixed=1.0)
    assert (f.a, f.c) == (4.5, 1.0) and f(2) == 10.0
    assert Linear.fit(3.0, 2, scales=False)(100) == 3.0


def test_device_model_defaults_overrides_and_errors():
    cpu = DeviceModel.cpu(p2p_bandwidth=1e9)
    assert cpu.p2p_bandwidth == 1e9 and cpu.memory_bytes > 0
    assert DeviceModel.gpu().peak_flops > cpu.peak_flops
    assert cpu.measure_p2p() is cpu  # no process group: unchanged
    with pytest.raises(PlanError, match=r"DeviceModel.peak_flops must be a positive, finite number, found -1"):
        DeviceModel(peak_flops=-1)


@pytest.mark.parametrize("field", ["p2p_bandwidth", "memory_bytes", "allreduce_bandwidth", "peak_flops"])
def test_device_model_refuses_an_infinite_figure(field):
    # an infinite link or memory used to be accepted, and fxpipe.plan(device=...) then failed in a
    # Cluster 'cpu' the user never made
    with pytest.raises(PlanError, match=rf"DeviceModel.{field} must be a positive, finite number, found inf; "
                                        rf"pass e.g. DeviceModel\({field}="):
        DeviceModel(**{field: math.inf})
    with pytest.raises(PlanError, match=rf"DeviceModel.{field} must be a positive, finite number, found nan"):
        DeviceModel(**{field: math.nan})


def test_annotate_rejects_untraced_graphs():
    gm = torch.fx.symbolic_trace(nn.Linear(2, 2))
    with pytest.raises(PlanError, match="fxpipe.trace"):
        annotate(gm)


def test_measured_plan_end_to_end():
    from fxpipe.partition import plan

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(32, 32), nn.Tanh()) for _ in range(4)])
    x = torch.randn(8, 32)
    p = plan(model, (x,), stages=2, microbatches=4, cost_mode="measured")
    assert p.cost_mode == "measured" and p.stages == 2


class _RouterNorm(nn.Module):
    """A mixture-of-experts router's shape: top-2 of a softmax, renormalised in place
    (``w /= w.sum(...)``, as Mixtral's router), the weights then read by a product that saves them."""

    def __init__(self):
        super().__init__()
        self.gate, self.expert = nn.Linear(16, 4), nn.Linear(16, 2)

    def forward(self, x):
        w, _ = torch.topk(torch.softmax(self.gate(x), -1), 2)
        w /= w.sum(-1, keepdim=True)
        return self.expert(x) * w


@pytest.mark.parametrize("mode", ["measured", "calibrated"])
def test_nodes_that_write_in_place_are_measured(mode):
    # Timing each node again re-ran the in-place division on the graph's own tensor, whose
    # version then no longer matched what the product's backward had saved: "one of the variables
    # needed for gradient computation has been modified by an inplace operation" (Mixtral,
    # DeepSeek-V3). A writing node is now timed on copies, and each backward on its own copies.
    model, x = _RouterNorm(), torch.randn(8, 16)
    gm = fxpipe.trace(model, (x,))
    assert any(n.target is torch.ops.aten.div_.Tensor for n in gm.graph.nodes)
    before = model(x)
    if mode == "measured":
        costs = annotate(gm, (x,), mode=mode, repeats=3)
        div = next(n.name for n in gm.graph.nodes if n.target is torch.ops.aten.div_.Tensor)
        assert costs.nodes[div].fwd_time(8) > 0
    else:  # the calibration times every node alone too
        pipe = fxpipe.compile(model, (x,), loss_fn=torch.nn.functional.mse_loss, stages=2, microbatches=4,
                              cost_mode=mode, verbose=False)
        assert pipe.plan.device != DeviceModel.for_device(torch.device("cpu"))  # the fitted one
    assert torch.equal(model(x), before)  # the model's weights untouched


def test_measured_times_fit_two_batch_sizes():
    from fxpipe.cost import fit_two_sizes

    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 64))
    gm8 = fxpipe.trace(model, (torch.randn(8, 64),))
    gm4 = fxpipe.trace(model, (torch.randn(4, 64),))
    c8 = annotate(gm8, (torch.randn(8, 64),), mode="measured", repeats=3)
    c4 = annotate(gm4, (torch.randn(4, 64),), mode="measured", repeats=3)
    fitted = fit_two_sizes(gm8, c8, c4)
    for name, c in fitted.nodes.items():
        if not c.batch_dependent or c.fwd_time(8) == 0:
            continue
        # the line passes through both measurements (or is the non-negative clamp of it)
        assert c.fwd_time.a >= 0 and c.fwd_time.c >= 0
        if c.fwd_time.c > 0 and c8.nodes[name].fwd_time(8) >= c4.nodes[name].fwd_time(4):
            assert math.isclose(c.fwd_time(8), c8.nodes[name].fwd_time(8), rel_tol=1e-9)
            assert math.isclose(c.fwd_time(4), c4.nodes[name].fwd_time(4), rel_tol=1e-9)
    node = next(n for n in gm8.graph.nodes if n.name in fitted.nodes and fitted.nodes[n.name].batch_dependent)
    assert node.meta["fxpipe_cost"] is fitted.nodes[node.name]
    with pytest.raises(PlanError, match="two different micro-batch sizes"):
        fit_two_sizes(gm8, c8, c8)
    with pytest.raises(PlanError, match="two sets of measured costs"):
        fit_two_sizes(gm8, c8, annotate(gm4))


def test_planner_searching_b_with_measured_costs_measures_a_second_size(monkeypatch):
    import fxpipe.partition as partition

    seen = []
    real = partition.annotate

    def spy(gm, example_inputs=None, **kw):
        costs = real(gm, example_inputs, **kw)
        seen.append((costs.mode, costs.batch_size))
        return costs

    monkeypatch.setattr(partition, "annotate", spy)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))
    p = partition.plan(model, (torch.randn(4, 16),), global_batch=16, cost_mode="measured", world_size=1)
    assert seen == [("measured", 4), ("measured", 2)]
    assert p.microbatch_size * p.microbatches == 16


class _Transposed(nn.Module):
    """``x.transpose(0, 1).contiguous()``: a copy at 2 samples or more, none at one, where
    torch.export leaves the copy out (Mamba's graph, Mixtral's)."""

    def __init__(self):
        super().__init__()
        self.l = nn.Linear(8, 8)

    def forward(self, x):
        return self.l(x.transpose(0, 1).contiguous()).sum()


def test_the_second_size_measured_is_never_a_single_sample(monkeypatch):
    # Traced at b = 2, the second size was 1, whose trace lacks the copy: "the traces at
    # micro-batch sizes 2 and 1 differ", and global_batch= with cost_mode="measured" failed for
    # Mixtral, DeepSeek-V3 and Mamba. It is now twice b where half would be one sample.
    import fxpipe.partition as partition

    seen = []
    real = partition.annotate

    def spy(gm, example_inputs=None, **kw):
        costs = real(gm, example_inputs, **kw)
        seen.append(costs.batch_size)
        return costs

    monkeypatch.setattr(partition, "annotate", spy)
    model = _Transposed()
    example = (torch.randn(2, 4, 8),)
    p = partition.plan(model, example, global_batch=16, cost_mode="measured", world_size=1)
    assert seen == [2, 4] and p.microbatch_size * p.microbatches == 16
    one = (torch.randn(1, 4, 8),)  # traced at one sample, the two traces still differ, and the error says why
    with pytest.raises(PlanError, match=r"differ in nodes \['contiguous'\].*torch\.export specialises a "
                                        r"micro-batch of one sample: an example of 2 or more may fit"):
        partition.plan(model, one, global_batch=16, cost_mode="measured", world_size=1)


def test_a_mixture_of_experts_grouped_matmul_is_priced_by_its_flops():
    # torch's FLOP counter has no formula for grouped matrix products, and transformers' fallback
    # is a custom op whose fake kernel computes nothing: Mixtral's expert layers, most of its
    # compute, were priced at 0 FLOPs, and the planner balanced its stages without them.
    pytest.importorskip("transformers")
    from tests.models import hf_architecture

    model, example = hf_architecture("mixtral", batch=2)
    gm = fxpipe.trace(model, example)
    costs = annotate(gm, example)
    grouped = [n for n in gm.graph.nodes if "grouped_mm" in str(n.target)]
    assert len(grouped) == 4  # gate-up and down projections of 2 layers
    for n in grouped:
        tokens, k = n.args[0].meta["val"].shape  # (tokens x top-2 experts, K) @ (experts, K, N)
        assert costs.nodes[n.name].flops(2) == 2 * tokens * k * n.meta["val"].shape[-1]
    experts = sum(costs.nodes[n.name].flops(2) for n in grouped)
    assert experts > 0.5 * sum(c.flops(2) for c in costs.nodes.values())


def test_calibrate_fits_the_roofline_to_the_measured_totals(monkeypatch):
    """The calibrated model's node times sum to the measured forward and backward of the whole
    graph (timed here by a fake clock: 3 s forward, 5 s backward), keeping the roofline's
    proportions between nodes; an optimizer factory gives the update time per byte."""
    import fxpipe.calibrate as cost  # the timing of fxpipe.cost's DeviceModel

    gm, _ = linear_gm(64)
    clock = iter(x for _ in range(100) for x in (0.0, 3.0, 8.0))  # once(): t0, t1 (fwd 3 s), end (bwd 5 s)
    monkeypatch.setattr(cost.time, "perf_counter", lambda: next(clock))
    monkeypatch.setattr(cost, "_time_random", lambda *a: 0.0)  # this graph draws no random number
    monkeypatch.setattr(cost, "_roofs", lambda *a: (1.0, 1.0))  # as the roofline has them (next test)
    dev = DeviceModel(op_latency=1e-6)
    cal = dev.calibrate(gm, repeats=3)
    monkeypatch.undo()
    before, after = annotate(gm, device=dev), annotate(gm, device=cal)
    nodes = [n for n, c in after.nodes.items() if c.fwd_time(64) > 0]
    assert math.isclose(sum(after.nodes[n].fwd_time(64) for n in nodes), 3.0, rel_tol=1e-9)
    grads = [n for n in nodes if after.nodes[n].requires_grad]
    assert math.isclose(sum(after.nodes[n].bwd_time(64) for n in grads), 5.0, rel_tol=1e-9)
    lat = cal.op_latency  # proportions above the fixed cost are the roofline's
    ratios = [(after.nodes[n].fwd_time(64) - lat) / (before.nodes[n].fwd_time(64) - dev.op_latency) for n in nodes]
    assert max(ratios) == pytest.approx(min(ratios), rel=1e-9)
    assert cal.update_time_per_byte is None and cal.update_time(1e6) == pytest.approx(8e6 / cal.mem_bandwidth)
    timed = dev.calibrate(gm, repeats=1, optimizer=lambda named: torch.optim.Adam([p for _, p in named]))
    assert timed.update_time_per_byte > 0 and timed.copy_time_per_byte > 0 and timed.backward_ratio > 0
    calls = []  # ranks calibrating together line up every timed run (two warm-ups, then the repeats)
    dev.calibrate(gm, repeats=3, barrier=lambda: calls.append(1))
    assert len(calls) == 5


def test_calibrate_fits_the_two_roofs_and_their_backwards_apart(monkeypatch):
    """Timed alone, this machine runs the FLOP-bound nodes (the linears) 2x faster than the
    roofline prices them and the byte-bound ones (the GELU, the residual add) 2x slower, with a
    backward of 2x and 1x their forward: ``_roofs`` finds the FLOP roof 4x faster relative to the
    memory roof and the byte-bound backward ratio half the FLOP-bound one. ``calibrate`` prices
    with both, then fits the totals: forward 3 s, backward 5 s, as the clock says."""
    import fxpipe.calibrate as cost  # the timing of fxpipe.cost's DeviceModel
    from fxpipe.calibrate import _roofs

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc, self.proj = nn.Linear(256, 256), nn.Linear(256, 256)

        def forward(self, x):
            return x + self.proj(nn.functional.gelu(self.fc(x)))

    gm = fxpipe.trace(Block(), (torch.randn(64, 256),))
    dev = DeviceModel(op_latency=1e-6)
    roof = dataclasses.replace(dev, op_latency=0.0)  # a node's roofline time alone
    priced = {name: (c.fwd_time(64), c.flops(64) / dev.peak_flops >= c.bytes_moved(64) / dev.mem_bandwidth)
              for name, c in annotate(gm, device=roof).nodes.items() if c.fwd_time(64) > 0}
    assert sorted(flops for _, flops in priced.values()) == [False, False, True, True]  # gelu, add; two linears
    fake = {n: (dev.op_latency + (t / 2 if flops else 2 * t), dev.op_latency + (t if flops else 2 * t))
            for n, (t, flops) in priced.items()}
    monkeypatch.setattr(cost, "measure_nodes", lambda *a: fake)
    assert _roofs(gm, None, None, 3, dev) == pytest.approx((4.0, 0.5))

    monkeypatch.setattr(cost, "_roofs", lambda *a: (4.0, 0.5))
    monkeypatch.setattr(cost, "_time_random", lambda *a: 0.0)
    clock = iter(x for _ in range(100) for x in (0.0, 3.0, 8.0))
    monkeypatch.setattr(cost.time, "perf_counter", lambda: next(clock))
    cal = dev.calibrate(gm, repeats=3)
    monkeypatch.undo()
    assert cal.peak_flops / cal.mem_bandwidth == pytest.approx(4 * dev.peak_flops / dev.mem_bandwidth)
    assert cal.backward_ratio_bytes == pytest.approx(0.5 * cal.backward_ratio)
    after = annotate(gm, device=cal).nodes
    assert sum(after[n].fwd_time(64) for n in priced) == pytest.approx(3.0)
    assert sum(after[n].bwd_time(64) for n in priced) == pytest.approx(5.0)
    for n, (t, flops) in priced.items():  # each node's backward at its group's ratio
        ratio = cal.backward_ratio if flops else cal.backward_ratio_bytes
        assert after[n].bwd_time(64) - cal.op_latency == pytest.approx(ratio * (after[n].fwd_time(64) - cal.op_latency))
    # analytic costs keep one ratio for both until a calibration sets the second
    plain = annotate(gm, device=dev).nodes
    assert all(plain[n].bwd_time(64) - dev.op_latency == pytest.approx(2 * (plain[n].fwd_time(64) - dev.op_latency))
               for n in priced)


def test_a_calibration_whose_per_node_timing_runs_out_of_memory_keeps_one_factor(monkeypatch):
    """Timing each node alone holds every node's output at once; where that does not fit, the
    calibration still fits the whole model, with the roofline's own proportions, and says so."""
    import fxpipe.calibrate as cost  # the timing of fxpipe.cost's DeviceModel

    def out_of_memory(*a):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(cost, "measure_nodes", out_of_memory)
    gm, _ = linear_gm(64)
    dev = DeviceModel(op_latency=1e-6, backward_ratio_bytes=1.5)
    with pytest.warns(RuntimeWarning, match=r"calibrate could not time each node of the model alone \(OutOfMemoryError"
                                            r".*keep the device model's proportions\. Calibrate a smaller micro-batch"):
        cal = dev.calibrate(gm, repeats=1)
    assert cal.peak_flops / cal.mem_bandwidth == pytest.approx(dev.peak_flops / dev.mem_bandwidth)
    assert cal.backward_ratio_bytes == pytest.approx(1.5 / 2.0 * cal.backward_ratio)


def test_the_update_is_timed_as_training_runs_it():
    """``_time_update`` times the optimizer step (with the zeroing of the accumulator) and the
    version copy separately, each right after an untimed forward and backward (``before``), over
    flat per-dtype buffers; ``update_time`` adds one copy per ``copies``."""
    from fxpipe.calibrate import _time_update

    params = [torch.randn(64, 32, requires_grad=True), torch.randn(32, requires_grad=True),
              torch.randn(16, dtype=torch.float64, requires_grad=True)]
    named = list(zip(["fc.weight", "fc.bias", "scale"], params))
    calls, seen, names = [], [], []

    def factory(named):  # a factory may group by name, as it does in training
        names.extend(n for n, _ in named)
        seen.extend(q for _, q in named)
        return torch.optim.Adam([q for _, q in named])

    step, copy = _time_update(factory, named, torch.device("cpu"), lambda: None, 4, lambda: calls.append(1))
    assert step > 0 and copy > 0
    assert len(calls) == 1 + 4  # the untimed first step, then one before each timed update
    assert [q.shape for q in seen] == [p.shape for p in params] and [q.dtype for q in seen] == [p.dtype for p in params]
    assert names == ["fc.weight", "fc.bias", "scale"]
    assert seen[0].untyped_storage().data_ptr() == seen[1].untyped_storage().data_ptr()  # one flat buffer per dtype
    assert all(torch.count_nonzero(q.grad) == 0 for q in seen)  # the accumulator is zeroed after each step
    seen.clear()  # a parameter past the budget is passed over, and the smallest taken if none fits
    _time_update(factory, named, torch.device("cpu"), lambda: None, 1, lambda: None, budget=48)
    assert [q.shape for q in seen] == [(32,), (16,)]
    seen.clear()
    _time_update(factory, named, torch.device("cpu"), lambda: None, 1, lambda: None, budget=8)
    assert [q.shape for q in seen] == [(16,)]
    dev = DeviceModel(update_time_per_byte=2e-9, copy_time_per_byte=5e-10)
    assert dev.update_time(1e6) == pytest.approx(2e-3) and dev.update_time(1e6, copies=1) == pytest.approx(2.5e-3)
    assert DeviceModel().update_time(1e6, copies=1) == pytest.approx(10e6 / DeviceModel().mem_bandwidth)


def test_the_simulator_prices_the_copy_where_the_runtime_makes_one():
    """2bw copies ``W(t-1)`` into the slot of ``W(t)`` at each update, and so does mixed
    precision (the master's rounded copy); a single fp32 version copies nothing."""
    from fxpipe.simulate import Costs
    from fxpipe.partition import plan

    model = nn.Sequential(nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 32))
    dev = DeviceModel(update_time_per_byte=2e-9, copy_time_per_byte=1e-9)

    def update(schedule, precision="fp32"):
        p = plan(model, (torch.randn(4, 32),), stages=2, microbatches=2, schedule=schedule, device=dev,
                 world_size=2, precision=precision)
        return [Costs.of_plan(p).per_stage("update", s) / sp.param_bytes for s, sp in enumerate(p.stage_plans)]

    assert update("1f1b") == pytest.approx([2e-9, 2e-9])
    assert update("2bw") == pytest.approx([3e-9, 3e-9])
    assert update("1f1b", "bf16") == pytest.approx([3e-9, 3e-9])


def test_calibrate_alone_measures_how_many_ranks_the_host_runs_at_once(monkeypatch):
    """Two ranks on one host: a lined-up run takes this rank 8 s (3 + 5) but lasts 10 s barrier
    to barrier (the slower rank's time), and the run alone right after it 6 s (2 + 4), so the host
    runs 2 * 6 / 10 = 1.2 ranks at full speed at once, and the model holds the speed alone. The
    host's pace drifts (the third pair runs at half speed, both runs alike): the ratio of each
    pair is the same, so the drift is not read as sharing. The other ranks wait in the barrier
    meanwhile, and only the rank timing alone times the rest (here the random numbers' pace and
    the roofs); a rank not timing alone, or a host of one rank, measures no sharing."""
    import fxpipe.calibrate as cost  # the timing of fxpipe.cost's DeviceModel

    gm, _ = linear_gm(64)
    dev = DeviceModel(op_latency=1e-6, random_time_per_element=7e-9)
    calls = []
    timed_random = []
    monkeypatch.setattr(cost, "_time_random", lambda *a: timed_random.append(1) or 0.0)  # the graph draws none
    monkeypatch.setattr(cost, "_roofs", lambda *a: timed_random.append(2) or (1.0, 1.0))

    def clock(alone: bool):
        ticks = [x + 10.0 * i for i in range(2) for x in (0.0, 3.0, 8.0)]  # two warm-ups
        for i, pace in enumerate((1.0, 1.0, 2.0)):  # three repeats: lined up, its closing barrier, alone
            start = 100.0 * (i + 1)
            ticks += [start + pace * x for x in (0.0, 3.0, 8.0, 10.0)]
            ticks += [start + 50.0 + pace * x for x in (0.0, 2.0, 6.0)] if alone else []
        return iter(ticks)

    monkeypatch.setattr(cost.time, "perf_counter", clock(True).__next__)
    cal = dev.calibrate(gm, repeats=3, barrier=lambda: calls.append(1), host_ranks=2, alone=True)
    assert cal.host_cores == pytest.approx(1.2) and len(calls) == 2 + 3 * 3 + 1
    assert sorted(timed_random) == [1, 2] and cal.random_time_per_element == 0.0
    nodes = [c for c in annotate(gm, device=cal).nodes.values() if c.fwd_time(64) > 0]
    assert math.isclose(sum(c.fwd_time(64) for c in nodes), 2.0, rel_tol=1e-9)

    monkeypatch.setattr(cost.time, "perf_counter", clock(False).__next__)
    calls.clear()
    timed_random.clear()
    other = dev.calibrate(gm, repeats=3, barrier=lambda: calls.append(1), host_ranks=2, alone=False)
    assert other.host_cores is None and len(calls) == 2 + 3 * 3 + 1
    assert timed_random == [] and other.random_time_per_element == 7e-9
    monkeypatch.setattr(cost.time, "perf_counter", clock(False).__next__)
    assert dev.calibrate(gm, repeats=3, barrier=lambda: None).host_cores is None


def test_calibrate_calls_the_model_as_it_was_traced():
    """Keyword inputs (a Hugging Face model's ``input_ids=``, ``labels=``) reach the traced
    graph by name, as ``compile(cost_mode="calibrated")`` passes them."""

    class Keywords(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb, self.head = nn.Embedding(16, 8), nn.Linear(8, 16)

        def forward(self, input_ids=None, labels=None):
            logits = self.head(self.emb(input_ids))
            return nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())

    ids = torch.randint(0, 16, (4, 6))
    example = {"input_ids": ids, "labels": ids}
    gm = fxpipe.trace(Keywords(), example)
    assert DeviceModel().calibrate(gm, example, repeats=1).backward_ratio > 0
    pipe = fxpipe.compile(Keywords(), example, stages=2, microbatches=2, cost_mode="calibrated", verbose=False)
    pipe.step({"input_ids": torch.cat([ids, ids]), "labels": torch.cat([ids, ids])})


def test_random_numbers_are_priced_at_the_generators_pace():
    """Dropout draws one number per element in training (none with p = 0 or in eval mode, nor
    in its backward); the analytic forward adds them at ``random_time_per_element``, which
    ``calibrate`` measures and leaves out of the roofline's fit."""
    from fxpipe.cost import _random_elements

    model = nn.Sequential(nn.Linear(16, 16), nn.Dropout(0.1), nn.Linear(16, 16), nn.Dropout(0.0))
    x = torch.randn(4, 16)
    gm = fxpipe.trace(model, (x,))
    drawn = {n.name: _random_elements(n) for n in gm.graph.nodes if _random_elements(n)}
    assert list(drawn.values()) == [64.0]
    assert sum(_random_elements(n) for n in fxpipe.trace(model.eval(), (x,)).graph.nodes) == 0
    (name,) = drawn
    plain, priced = annotate(gm, device=DeviceModel()), annotate(gm, device=DeviceModel(random_time_per_element=1e-6))
    assert priced.nodes[name].fwd_time(4) - plain.nodes[name].fwd_time(4) == pytest.approx(64e-6)
    assert priced.nodes[name].bwd_time(4) == pytest.approx(plain.nodes[name].bwd_time(4))
    cal = DeviceModel.cpu().calibrate(fxpipe.trace(model.train(), (x,)), (x,), repeats=3)
    assert 0 < cal.random_time_per_element < 1e-6  # nanoseconds per number on a CPU


def test_calibrate_leaves_buffers_and_gradients_as_it_found_them():
    """BatchNorm's running statistics move in every timed forward, and the timed backwards
    accumulate into ``.grad`` as the runtime's do; calibrating (the split timing included) puts
    both back, so a calibrated compile trains the model it was given."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 8), nn.BatchNorm1d(8))
    x = torch.randn(16, 8)
    before = {n: b.clone() for n, b in model.named_buffers()}
    held = torch.ones(8, 8)
    model[0].weight.grad = held  # a gradient the user left there; the rest have none
    gm = fxpipe.trace(model, (x,))
    DeviceModel.cpu().calibrate(gm, (x,), repeats=2, split=True)
    for n, b in model.named_buffers():
        assert torch.equal(b, before[n]), n
    assert model[0].weight.grad is held and torch.equal(held, torch.ones(8, 8))  # the traced graph shares it
    assert all(p.grad is None for p in model.parameters() if p is not model[0].weight)


def test_calibrate_refuses_a_meta_model():
    with torch.device("meta"):
        model = nn.Linear(4, 4)
    gm = fxpipe.trace(model, (torch.randn(2, 4),))
    if not any(p.is_meta for p in gm.parameters()):
        pytest.skip("the trace materialised the parameters")
    with pytest.raises(PlanError, match="meta device"):
        DeviceModel().calibrate(gm)


def test_calibrated_compile_plans_with_this_machines_speed():
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(32, 32), nn.Tanh()) for _ in range(4)])
    pipe = fxpipe.compile(model, (torch.randn(8, 32),), loss_fn=lambda out, y: out.pow(2).mean(), stages=2,
                          microbatches=2, cost_mode="calibrated", verbose=False)
    dev = pipe.plan.device
    assert dev.update_time_per_byte is not None and dev.backward_ratio != 2.0
    assert DeviceModel(**{**dev.__dict__}).backward_ratio == dev.backward_ratio  # survives the plan's JSON
    pipe.step(torch.randn(16, 32), torch.zeros(16, 32))
