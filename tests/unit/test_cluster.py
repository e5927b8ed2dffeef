"""The cluster model: presets, files, links on the runtime's placement, all-reduce pricing, errors."""

import dataclasses
import json
import math

import numpy as np
import pytest

import fxpipe
from fxpipe.cluster import PRESETS, Cluster, Link
from fxpipe.cost import DeviceModel
from fxpipe.errors import PlanError
from fxpipe.cluster import placement, stage_links
from fxpipe.partition import Chain, reduction_time, stage_time
from fxpipe.schedule import rank_of
from tests.unit.test_partition import bare_model

TOML = """
name = "two-by-four"
accelerator = "toy"
nodes = 2
per_node = 4
memory_gb = 40
reserved_gb = 0.5
mem_bandwidth_gbs = 1555
efficiency = 0.5
[flops_tflops]
fp32 = 19.5
bf16 = 312
[intra]
bandwidth_gbs = 300
latency_us = 5
[inter]
bandwidth_gbs = 25
latency_us = 10
"""


def toy(**kw) -> Cluster:
    base = dict(name="toy", nodes=2, per_node=4, memory=40e9, flops={"fp32": 19.5e12, "bf16": 312e12},
                mem_bandwidth=1555e9, intra=Link(300e9, 5e-6), inter=Link(25e9, 10e-6), efficiency=0.5)
    return Cluster(**{**base, **kw})


def test_presets_hold_the_vendor_figures():
    p3 = fxpipe.Cluster.preset("p3.16xlarge", nodes=8)
    assert (p3.size, p3.per_node, p3.memory) == (64, 8, 16e9)
    assert p3.flops["fp16"] == 125e12 and p3.flops["fp32"] == 15.7e12 and "bf16" not in p3.flops
    assert p3.inter.bandwidth == 25e9 / 8  # 25 Gbit/s between instances
    assert p3.achievable_flops("fp16") == pytest.approx(0.30 * 125e12)
    for name, tflops in (("dgx-a100", 312e12), ("dgx-h100", 989e12)):
        c = fxpipe.Cluster.preset(name, nodes=2)
        assert c.size == 16 and c.memory == 80e9 and c.flops["bf16"] == tflops
        assert c.inter.bandwidth < c.intra.bandwidth
    assert Cluster.preset("dgx-a100", efficiency=0.4).efficiency == 0.4
    assert set(PRESETS) == {"p3.16xlarge", "dgx-a100", "dgx-h100"}


def test_json_and_toml_files(tmp_path):
    t = tmp_path / "c.toml"
    t.write_text(TOML)
    c = Cluster.from_file(t)
    assert c == toy(name="two-by-four", accelerator="toy", reserved=0.5e9)
    j = tmp_path / "c.json"
    j.write_text(json.dumps(c.to_dict()))
    assert Cluster.from_file(j) == c
    # every preset survives the file format
    p = tmp_path / "p3.json"
    p.write_text(json.dumps(Cluster.preset("p3.16xlarge", nodes=8).to_dict()))
    back = Cluster.from_file(p)
    assert back.to_dict() == Cluster.preset("p3.16xlarge", nodes=8).to_dict()
    assert back.usable_memory == pytest.approx(15e9)


def test_the_dict_and_file_formats_keep_whether_sends_overlap_compute(tmp_path):
    # to_dict used to drop overlap_p2p: this machine's cluster (its CPU ranks' sends share the
    # cores) came back from a file as one whose sends run beside compute
    local = Cluster.from_device_model(DeviceModel.cpu(), 2)
    assert not local.overlap_p2p and Cluster.preset("dgx-a100").overlap_p2p
    for c in (local, Cluster.preset("dgx-a100", nodes=2)):
        data = json.loads(json.dumps(c.to_dict()))
        assert data["overlap_p2p"] == c.overlap_p2p and Cluster.from_dict(data) == c
    t = tmp_path / "c.toml"
    t.write_text("overlap_p2p = false\n" + TOML)  # top-level keys before the tables
    assert not Cluster.from_file(t).overlap_p2p
    t.write_text(TOML)
    assert Cluster.from_file(t).overlap_p2p  # the default: sends run beside compute
    with pytest.raises(PlanError, match=r"overlap_p2p must be true or false, found 'yes'; write e\.g\. overlap_p2p = true"):
        Cluster.from_dict({**local.to_dict(), "overlap_p2p": "yes"})


def test_a_toml_file_without_tomllib_says_to_write_json(tmp_path, monkeypatch):
    # Python 3.10 (pyproject allows it) has no tomllib: a TOML file used to fail with a bare
    # ModuleNotFoundError; JSON files need nothing
    import sys

    monkeypatch.setitem(sys.modules, "tomllib", None)  # what `import tomllib` meets on 3.10
    monkeypatch.setitem(sys.modules, "tomli", None)
    t = tmp_path / "c.toml"
    t.write_text(TOML)
    with pytest.raises(PlanError, match=r"cluster file .*c\.toml': reading TOML needs Python 3\.11's tomllib or the "
                                        r"tomli package, .* write the same keys to a \.json file instead"):
        Cluster.from_file(t)
    j = tmp_path / "c.json"
    j.write_text(json.dumps(toy().to_dict()))
    assert Cluster.from_file(j) == toy()


def test_the_local_machine_is_a_one_node_cluster():
    dm = DeviceModel.cpu()
    c = Cluster.from_device_model(dm, 4)
    assert (c.nodes, c.per_node, c.usable_memory) == (1, 4, dm.memory_bytes)
    # a ring of 4 moves 2 (w - 1) / w of the data over the all-reduce bandwidth, 2 (w - 1) latencies
    assert c.allreduce_time(8e6, range(4)) == pytest.approx(1.5 * 8e6 / dm.allreduce_bandwidth + 6 * dm.p2p_latency)
    assert c.intra.time(1e6) == pytest.approx(dm.p2p_latency + 1e6 / dm.p2p_bandwidth)
    back = c.device_model()
    assert (back.peak_flops, back.p2p_bandwidth, back.allreduce_bandwidth) == (dm.peak_flops, dm.p2p_bandwidth,
                                                                              dm.allreduce_bandwidth)


def test_a_stage_pair_split_across_nodes_pays_the_slower_link():
    c = toy()  # 4 accelerators per node
    # d = 8, w = 1: ranks 0-3 on node 0, 4-7 on node 1; only stages 3 -> 4 cross
    links = stage_links(c, 8, 1)
    assert [i for i, link in enumerate(links) if link == (c.inter.latency, c.inter.bandwidth)] == [3]
    assert all(link == (c.intra.latency, c.intra.bandwidth) for i, link in enumerate(links) if i != 3)
    # the same compute on every stage: the two stages beside the border are the slow ones
    n = 8
    chain = Chain([1e-3] * n, [2e-3] * n, [1e6] * n, [64e6] * (n - 1), [64e6] * (n - 1), [True] * (n - 1))
    sm = bare_model(8, tuple(8 - s for s in range(8)), (False,) * 8, c.intra.latency, c.intra.bandwidth,
                    links=links)
    times = [stage_time(chain, sm, s, s, s) for s in range(8)]
    assert times[3] == pytest.approx(times[4]) and times[2] == pytest.approx(times[5])
    assert times[3] > times[2] > 0 and times[1] == pytest.approx(times[2])
    assert times[3] - times[2] == pytest.approx(2 * (c.inter.time(64e6) - c.intra.time(64e6)))
    # a layout whose replicas share nodes crosses nowhere: d = 2, w = 4
    assert stage_links(c, 2, 4) == ((c.intra.latency, c.intra.bandwidth),)


def test_replicas_inside_one_node_all_reduce_faster():
    c = toy()
    inside, across = [0, 1, 2, 3], [0, 4]
    assert c.allreduce_time(1e9, inside) < c.allreduce_time(1e9, [0, 1, 4, 5])
    assert c.allreduce_time(1e9, [0, 4]) == pytest.approx(2 * 1 / 2 * 1e9 / 25e9 + 2 * 1 * 10e-6)
    # rings leaving a node at once share its interface
    assert c.allreduce_time(1e9, across, [[0, 4], [1, 5], [2, 6]]) == pytest.approx(
        2 * 1 / 2 * 1e9 / (25e9 / 3) + 2 * 10e-6)
    assert c.allreduce_time(1e9, [0]) == 0.0


def test_reductions_priced_on_the_runtime_placement():
    c = toy()
    # every parameter read on one stage; 1e9 bytes per stage
    n = 4
    chain = Chain([1.0] * n, [1.0] * n, [1.0] * n, [1.0] * (n - 1), [1.0] * (n - 1), [True] * (n - 1),
                  [3e9] * n, tuple([i] for i in range(n)), tensor_param_bytes=[1e9] * n)
    # d = 2, w = 4: rank = replica*2 + stage, so stage 0's replicas are ranks 0,2,4,6: two nodes
    assert placement(c, 2, 4) == tuple((rank_of(s, r, 2), s, r, rank_of(s, r, 2) // 4) for r in range(4) for s in range(2))
    two = reduction_time(c, chain, [(0, 1), (2, 3)], 4)
    groups = [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert two == pytest.approx(c.allreduce_time(2e9, groups[0], groups))
    # d = 4, w = 2 on one node of 8: all inside, fast
    one_node = dataclasses.replace(c, nodes=1, per_node=8)
    inside = reduction_time(one_node, chain, [(0, 0), (1, 1), (2, 2), (3, 3)], 2)
    assert inside == pytest.approx(one_node.allreduce_time(1e9, [0, 4]))
    assert inside < two
    # a tied weight (read on stages 0 and 1) is reduced over its stages in every replica
    tied = Chain([1.0] * n, [1.0] * n, [1.0] * n, [1.0] * (n - 1), [1.0] * (n - 1), [True] * (n - 1),
                 [3e9], ([0, 3],), tensor_param_bytes=[1e9])
    assert reduction_time(c, tied, [(0, 1), (2, 3)], 1) == pytest.approx(c.allreduce_time(1e9, [0, 1]))


@pytest.mark.parametrize("schedule", ["2bw", "1f1b"])
def test_cuts_weigh_the_all_reduce_where_it_is_part_of_the_step(schedule):
    from itertools import combinations

    from fxpipe.partition import _cut_for_reduction, _Solver, partition_chain, pipeline_time

    c, d, w, m, n = toy(), 3, 2, 4, 12
    # equal compute everywhere, the parameters all in the first half (embedding-like): the
    # balanced-compute cuts leave the first stage all-reducing most of them
    param = [1e9] * 6 + [0.0] * 6
    chain = Chain([1e-3] * n, [2e-3] * n, [1.0] * n, [1.0] * (n - 1), [1.0] * (n - 1), [True] * (n - 1),
                  [1.0] * n, tuple([i] for i in range(n)), tensor_param_bytes=param)
    sm = bare_model(d, (3, 2, 1), (False,) * 3)

    def step(bounds):
        pipe = pipeline_time(schedule, d, m, max(stage_time(chain, sm, s, *b) for s, b in enumerate(bounds)),
                             forward=4e-3)
        ar = reduction_time(c, chain, bounds, w)
        return max(pipe, ar) if schedule == "2bw" else pipe + ar

    every = [tuple(zip((0, a + 1, b + 1), (a, b, n - 1))) for a, b in combinations(range(n - 1), 2)]
    best = min(step(b) for b in every)
    balanced = partition_chain(chain, sm)
    assert balanced.bounds == ((0, 3), (4, 7), (8, 11)) and step(balanced.bounds) > 1.1 * best
    got, priced = _cut_for_reduction(chain, sm, balanced, c, schedule, m, w, "replica")
    assert step(got.bounds) == pytest.approx(best, rel=1e-3)
    assert priced[0] == pytest.approx(step(got.bounds))  # the step it returns is the partition's
    assert got.bottleneck == pytest.approx(max(stage_time(chain, sm, s, *b) for s, b in enumerate(got.bounds)))
    # the caps themselves: at most 2e9 bytes a stage, compute then balanced as well as it can be
    capped = _Solver(chain, sm).capped([2e9] * 3).solve()
    fits = [b for b in every if all(sum(param[l:r + 1]) <= 2e9 for l, r in b)]
    assert capped.bottleneck == pytest.approx(min(max(stage_time(chain, sm, s, *x) for s, x in enumerate(b))
                                                  for b in fits))
    assert _Solver(chain, sm).capped([1e9] * 3).solve() is None  # six 1e9 tensors cannot fit three stages of 1e9
    # a tensor read at two positions counts on a stage only if the stage holds both (else it has
    # a ring of its own): a tied 1.5e9 read at 1 and 7, checked against every cut
    readers = tuple([i] for i in range(n)) + ([1, 7],)
    tied = Chain([1e-3] * n, [2e-3] * n, [1.0] * n, [1.0] * (n - 1), [1.0] * (n - 1), [True] * (n - 1),
                 [1.0] * (n + 1), readers, tensor_param_bytes=param + [1.5e9])

    def reduced(l, r):
        return sum(b for b, rd in zip(param + [1.5e9], readers) if l <= rd[0] and rd[-1] <= r)

    for cap in (2e9, 3e9, 4.5e9):
        got = _Solver(tied, sm).capped([cap] * 3).solve()
        fits = [b for b in every if all(reduced(l, r) <= cap for l, r in b)]
        assert got.bottleneck == pytest.approx(min(max(stage_time(tied, sm, s, *x) for s, x in enumerate(b))
                                                   for b in fits))
        assert all(reduced(l, r) <= cap for l, r in got.bounds)


@pytest.mark.parametrize("make, match", [
    (lambda: Cluster.preset("p3"), r"unknown cluster preset 'p3'; expected one of \['dgx-a100', 'dgx-h100', "
                                   r"'p3.16xlarge'\], or a path to a .json or .toml file"),
    (lambda: toy(nodes=0), r"nodes must be a positive integer, found 0; pass e.g. nodes=8"),
    (lambda: toy(efficiency=1.5), r"efficiency must be a fraction of the peak in \(0, 1\], found 1.5"),
    (lambda: toy(flops={"fp8": 1e15}), r"flops\['fp8'\] must be a positive FLOP/s for a dtype among"),
    (lambda: toy(inter=Link(0.0)), r"inter must be a Link\(bandwidth > 0 bytes/s, latency >= 0 s\), found"),
    (lambda: toy(reserved=50e9), r"reserved must be less than memory"),
    (lambda: Cluster.preset("p3.16xlarge").peak_flops("bf16"),
     r"has no FLOP/s for bf16: it lists \['fp16', 'fp32', 'fp64'\]; plan with precision in \['fp16', 'fp32'\]"),
    (lambda: toy().check_fits(9), r"has 8 accelerators \(2 nodes x 4\), found a request for 9; use world_size <= 8"),
])
def test_errors_say_what_was_expected_found_and_what_to_do(make, match):
    with pytest.raises(PlanError, match=match):
        make()


@pytest.mark.parametrize("text, ext, match", [
    (TOML.replace("memory_gb = 40\n", ""), ".toml", r"expected keys .*; missing \['memory_gb'\]; see the example"),
    ("colour = 'red'\n" + TOML, ".toml", r"unknown \['colour'\]"),
    (TOML.replace("nodes = 2", "nodes = 'two'"), ".toml", r"nodes must be a positive integer, found 'two'; write e\.g\. nodes = 8"),
    (TOML.replace("bandwidth_gbs = 25", "bandwidth = 25"), ".toml", r"inter must be a table with bandwidth_gbs"),
    ("nodes = [", ".toml", r"is not valid TOML: .*; fix the syntax"),
    ("{}", ".yaml", r"expected a .json or .toml file, found extension '.yaml'"),
    # values are checked in the file's keys and units, before the Cluster's checks (bytes, Python)
    (TOML.replace("bandwidth_gbs = 25", "bandwidth_gbs = -1"), ".toml",
     r"\[inter\] bandwidth_gbs must be a positive number, found -1; write e\.g\. \[inter\] bandwidth_gbs = "),
    (TOML.replace("bf16 = 312", "fp8 = 312"), ".toml", r"\[flops_tflops\] has \['fp8'\], expected dtypes among"),
    (TOML.replace("reserved_gb = 0.5", "reserved_gb = 50"), ".toml",
     r"reserved_gb must be less than memory_gb \(40\), found 50; .* write e\.g\. reserved_gb = 1"),
    (TOML.replace("nodes = 2", "nodes = 0"), ".toml", r"nodes must be a positive integer, found 0; write e\.g\. nodes = 8"),
    (TOML.replace("efficiency = 0.5", "efficiency = 52"), ".toml",
     r"efficiency must be a fraction of the peak in \(0, 1\], found 52; write e\.g\. efficiency = 0\.4"),
], ids=["missing", "unknown", "type", "link", "syntax", "extension", "negative", "dtype", "reserved", "zero",
        "efficiency"])
def test_file_errors(tmp_path, text, ext, match):
    path = tmp_path / f"c{ext}"
    path.write_text(text)
    with pytest.raises(PlanError, match=match):
        Cluster.from_file(path)
    with pytest.raises(PlanError, match=r"does not exist"):
        Cluster.from_file(tmp_path / "missing.toml")


def test_device_model_costs_operators_at_the_achievable_rate():
    c = toy()
    dm = c.device_model("bf16")
    assert dm.peak_flops == pytest.approx(0.5 * 312e12)
    assert dm.memory_bytes == c.usable_memory
    assert dm.mem_bandwidth == pytest.approx(2 * 1555e9)  # traced fp32 bytes, moved as 2-byte values
    assert c.device_model("fp32").mem_bandwidth == 1555e9
    assert math.isclose(c.with_efficiency(0.25).achievable_flops("fp32"), 0.25 * 19.5e12)
    assert np.isfinite(c.allreduce_time(1.0, [0, 7]))


def test_calibrate_replaces_the_efficiency_with_a_measured_one():
    import torch
    from torch import nn

    local = Cluster.local(1, "cpu")
    model = nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 256))
    measured = local.calibrate(model, (torch.randn(64, 256),), repeats=3)
    assert 0 < measured.efficiency <= 1 and measured.flops == local.flops
    assert measured.achievable_flops() == pytest.approx(measured.efficiency * local.peak_flops())
    with pytest.raises(PlanError, match=r"calibrate: the model has no operator with known FLOPs .*; calibrate with a "
                                        r"model of matrix products"):
        local.calibrate(nn.ReLU(), (torch.randn(4, 4),), repeats=1)


def test_calibrate_in_a_16_bit_precision_times_the_model_in_that_dtype(monkeypatch):
    # it timed the fp32 model and divided by the bf16 peak: on an H200 an efficiency of 0.0135
    # for bf16 (its fp32 speed) where a bf16 matrix product ran at 0.82 of the peak
    import torch
    from torch import nn

    import fxpipe.cost

    timed = []
    real = fxpipe.cost.annotate

    def annotate(gm, example_inputs, **kw):
        timed.append(({p.dtype for p in gm.parameters()}, example_inputs[0].dtype))
        return real(gm, example_inputs, **kw)

    monkeypatch.setattr(fxpipe.cost, "annotate", annotate)
    local = Cluster.local(1, "cpu")
    local = dataclasses.replace(local, flops={**local.flops, "bf16": local.peak_flops(), "fp16": local.peak_flops()})
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64))
    for precision, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16), ("fp16", torch.float16)):
        measured = local.calibrate(model, (torch.randn(16, 64),), precision=precision, repeats=1)
        assert timed[-1] == ({dtype}, dtype) and 0 < measured.efficiency <= 1
    assert {p.dtype for p in model.parameters()} == {torch.float32}  # timed a copy
    with pytest.raises(PlanError, match=r"has no FLOP/s for bf16"):  # said before timing anything
        Cluster.local(1, "cpu").calibrate(model, (torch.randn(16, 64),), precision="bf16", repeats=1)
    assert len(timed) == 3


def test_a_plan_for_a_cluster_counts_the_fused_kernels_scratch_gradient():
    # compile runs the fused kernels on a cluster's GPUs, which keep one more gradient per stage;
    # plan counted torch.optim's (the stores held 16.7% more than the plan priced on an H200)
    from tests.unit.test_planning import meta_gpt

    model, example = meta_gpt(4, width=64, seq=32)
    kw = dict(cluster="dgx-h100", global_batch=8, stages=2, world_size=2, top=1)
    default, fused, autograd = (fxpipe.plan(model, example, **kw, **extra) for extra in (
        {}, {"accumulation": "fused"}, {"accumulation": "autograd"}))
    memory = lambda p: [sp.memory for sp in p.stage_plans]  # noqa: E731
    assert memory(default) == memory(fused) and all(a < f for a, f in zip(memory(autograd), memory(fused)))
    local = fxpipe.plan(model, example, global_batch=8, stages=2, world_size=2, top=1)
    assert memory(local) == memory(fxpipe.plan(model, example, global_batch=8, stages=2, world_size=2, top=1,
                                               accumulation="autograd"))


def test_sends_overlap_compute_on_cluster_presets_not_on_this_machine():
    # NCCL's sends run beside compute on GPUs: a stage costs max(compute, link) per micro-batch;
    # the local machine (CPU ranks, gloo copying on the same cores) keeps the sum.
    from fxpipe.partition import Chain, stage_time

    assert Cluster.preset("dgx-a100", nodes=2).overlap_p2p and not Cluster.local().overlap_p2p
    chain = Chain([1.0, 1.0], [2.0, 2.0], [1.0, 1.0], [10.0], [10.0], [True], [], ())
    for overlap, expected in ((False, 3.0 + 0.5), (True, 3.0)):  # one cut: 10 B each way at 40 B/s
        model = bare_model(2, (2, 1), (False, False), 0.0, 40.0, overlap=overlap)
        assert stage_time(chain, model, 0, 0, 0) == expected


@pytest.mark.parametrize("overlap", [False, True])
def test_a_plan_reports_and_simulates_the_times_it_priced(overlap):
    # Two nodes of one accelerator, a slow network between them: the cut crosses it. The plan's
    # bottleneck was the sum of compute and link time even where sends overlap compute (the
    # search used the larger); the simulator's costs (fxpipe.simulate.Costs.of_plan, what inspect
    # draws) priced every transfer at the intra-node link.
    from fxpipe.schedule import generate
    from fxpipe.simulate import Costs, simulate

    import torch
    model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(4)])
    c = Cluster.preset("dgx-a100", nodes=2, per_node=1, nics=1, inter=Link(2e9, 50e-6), overlap_p2p=overlap)
    p = fxpipe.plan(model, (torch.randn(8, 256),), cluster=c, world_size=2, stages=2, global_batch=64)
    s0, s1 = p.stage_plans
    # the activation over and its gradient back, which carries one byte more: its reached flag
    assert s0.comm_out_time == pytest.approx(c.inter.time(s0.send_bytes) + c.inter.time(s0.send_bytes + 1))
    assert s1.comm_out_time == 0
    compute = [sp.forward_time + sp.backward_time for sp in p.stage_plans]
    priced = [max(x, sp.comm_time) if overlap else x + sp.comm_time for x, sp in zip(compute, p.stage_plans)]
    assert [sp.time for sp in p.stage_plans] == pytest.approx(priced)
    assert p.bottleneck == pytest.approx(max(priced))
    costs = Costs.of_plan(p)
    assert costs.p2p == pytest.approx([c.inter.time(s0.send_bytes)])  # the inter-node link, one way
    fast = Costs.of_plan(dataclasses.replace(p, cluster=dataclasses.replace(c, inter=c.intra)))
    lists = generate(p.schedule, 2, p.microbatches, 3, lookahead=p.lookahead)
    assert simulate(lists, costs).step_time > simulate(lists, fast).step_time


def test_a_configuration_that_does_not_fit_is_priced_on_its_best_layout():
    # The "does not fit" rows were priced on the replica-major layout only: here its all-reduce
    # crosses the slow network, and the rows read 5,052 and 7,596 samples/s where the same
    # configurations, fitting on a larger memory, give 211,820 and 187,056 stage-major.
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(512, 512) for _ in range(8)])
    plans = [fxpipe.plan(model, (torch.randn(4, 512),), cluster=toy(memory=mem, inter=Link(1e9, 10e-6)), world_size=8,
                         global_batch=64) for mem in (8e6, 1e12)]
    rows = [{(c.stages, c.width, c.microbatch_size, c.microbatches, c.recompute): c for c in p.configurations}
            for p in plans]
    missing = [key for key, c in rows[0].items() if not c.fits]
    assert {(d, w) for d, w, *_ in missing} == {(2, 4), (4, 2)} and plans[1].layout == "stage"
    for key in missing:
        assert rows[1][key].fits and rows[0][key].throughput == pytest.approx(rows[1][key].throughput)


def test_one_flow_across_nodes_gets_one_nic():
    # A DGX A100's 200 GB/s of network is eight 200 Gbit/s NICs, one beside each GPU: one
    # stage-to-stage flow was priced at all eight (200 GB/s, near NVLink's 300).
    c = Cluster.preset("dgx-a100", nodes=2)
    assert stage_links(c, 16, 1)[7] == (c.inter.latency, 25e9)  # ranks 7 -> 8: one flow each way
    # eight replicas crossing at once: eight flows leave each node, one per NIC; on a node of one
    # NIC they share it
    assert set(stage_links(c, 2, 8, layout="stage")) == {(c.inter.latency, 25e9)}
    assert set(stage_links(dataclasses.replace(c, nics=1), 2, 8, layout="stage")) == {(c.inter.latency, 25e9)}
    assert set(stage_links(dataclasses.replace(c, nics=1), 4, 4, layout="stage")) == {
        (c.intra.latency, c.intra.bandwidth), (c.inter.latency, 50e9)}
    # a file says how many NICs a node has; one (the default) gives a flow the whole interface
    assert Cluster.from_dict({**c.to_dict(), "nics": 1}).nics == 1
    assert stage_links(dataclasses.replace(c, nics=1), 16, 1)[7] == (c.inter.latency, 200e9)
    assert Cluster.from_dict(c.to_dict()) == c
    with pytest.raises(PlanError, match=r"nics must be a positive integer, found 0; write e\.g\. nics = 8"):
        Cluster.from_dict({**c.to_dict(), "nics": 0})
