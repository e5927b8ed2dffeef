"""fxpipe.compile in ONE process: every stage here, interleaved by the driver.

The contract (docs/design.md, "Weight-update semantics"): 1f1b and gpipe give exactly the numbers of
plain gradient-accumulation training; 2bw gives exactly ``W(t+1) = W(t) - lr*grad f(W(t-1))``.
Both references live in tests/reference.py and do not import fxpipe.
"""

import copy
import dataclasses
import functools
import warnings
import re

import pytest
import torch
import torch.nn.functional as F

import fxpipe
from fxpipe.errors import ConfigError, FxpipeError, RuntimeMismatchError
from tests.cases import CASES, RANDOM, build, compare
from tests.models import BranchNet, TwoBranches, gpt2_tiny, rmsnorm_residual, t5_tiny
from tests.reference import train_2bw, train_flush

# the named cases (the drawn ones for ranks are tests/unit/test_combinations.py's kind in one process)
DRAWN = {c.name for cases in RANDOM.values() for c in cases}
SINGLE = [name for name, c in CASES.items() if c.width == 1 and not c.dropout and name not in DRAWN]


def _compile(case, **extra):
    model, example, batches, loss_fn, opt = build(case)
    pipe = fxpipe.compile(
        model, example, loss_fn=loss_fn, optimizer=opt, microbatches=case.microbatches,
        schedule=case.schedule, stages=case.stages, max_grad_norm=case.max_grad_norm,
        recompute=case.recompute or None, verbose=False, chunks=case.chunks, **extra,
    )
    return pipe, batches


@pytest.mark.parametrize("name", SINGLE)
def test_matches_reference(name):
    case = CASES[name]
    pipe, batches = _compile(case)
    losses = [pipe.step(x, y) for x, y in batches]
    mismatches = compare(case, losses, pipe.state_dict())
    assert not mismatches, "\n".join(mismatches)


def test_state_dict_loads_into_original_model_and_tied_copies_agree():
    case = CASES["gpt2_2bw"]
    pipe, batches = _compile(case)
    for x, y in batches[:3]:
        pipe.step(x, y)
    sd = pipe.state_dict()
    model, *_ = build(case)
    model.load_state_dict(sd)  # strict: every original key, aliases included
    assert torch.equal(sd["lm_head.weight"], sd["transformer.wte.weight"])
    w0 = pipe.workers[0].local_state()["transformer.wte.weight"]
    w1 = pipe.workers[1].local_state()["transformer.wte.weight"]
    assert torch.equal(w0, w1), "the tied copies on the first and last stage drifted apart"


def test_t5_with_its_default_cache_trains_and_its_state_dict_round_trips():
    # T5's decoder stack keeps its own copy of the config: use_cache stayed on there, and the
    # trace failed on the cache object it returned. Its trace lifts a tensor constant out of the
    # forward (export's lifted_tensor_0), which state_dict() returned as a key of the model's and
    # load_state_dict(model.state_dict()) asked for.
    model, example = t5_tiny(batch=2)
    model = model.double()
    g = torch.Generator().manual_seed(1)
    batches = [({"input_ids": ids, "labels": ids.clone()}, None)
                for ids in (torch.randint(2, 100, (4, 8), generator=g) for _ in range(2))]
    opt = functools.partial(torch.optim.SGD, lr=0.1)
    pipe = fxpipe.compile(model, example, microbatches=2, stages=2, schedule="1f1b", optimizer=opt, verbose=False)
    losses = [pipe.step(x) for x, _ in batches]
    ref_losses, ref = train_flush(model, batches, 2, None, opt)
    assert losses == pytest.approx(ref_losses, rel=1e-10)
    sd = pipe.state_dict()
    assert set(sd) == set(model.state_dict())
    for name, p in ref.named_parameters():
        assert torch.allclose(sd[name], p, rtol=1e-10, atol=1e-12), name
    model.load_state_dict(sd)  # strict
    pipe.load_state_dict(ref.state_dict())


class _Branchy(torch.nn.Module):
    """Data-dependent control flow: neither export nor symbolic_trace can capture it."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x):
        return self.lin(x) if x.sum() > 0 else -self.lin(x)


def test_a_leaf_module_with_data_dependent_control_flow_trains():
    # compile had no leaf_modules=, so the advice of its own TraceError (make the module a
    # leaf) could not be followed when training
    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b, self.c = torch.nn.Linear(8, 8), _Branchy(), torch.nn.Linear(8, 1)

        def forward(self, x):
            return self.c(self.b(self.a(x)))

    torch.manual_seed(0)
    net = Net().double()
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(8, 8, generator=g, dtype=torch.float64) * (1 if i % 2 else -3),
                torch.randn(8, 1, generator=g, dtype=torch.float64)) for i in range(4)]
    opt, loss = functools.partial(torch.optim.SGD, lr=0.1), torch.nn.functional.mse_loss
    with pytest.raises(fxpipe.TraceError, match=r"make the failing module a leaf \(fxpipe.compile or fxpipe.trace"):
        fxpipe.compile(net, (batches[0][0][:2],), loss_fn=loss, stages=2, verbose=False)
    with pytest.raises(ConfigError, match=r"leaf_modules must be module classes or qualified names"):
        fxpipe.compile(net, (batches[0][0][:2],), loss_fn=loss, leaf_modules=[_Branchy()], verbose=False)
    pipe = fxpipe.compile(net, (batches[0][0][:2],), loss_fn=loss, optimizer=opt, microbatches=4, stages=2,
                          schedule="1f1b", verbose=False, leaf_modules=_Branchy)
    assert "b" in {n.target for n in pipe.staged_graph.graph.nodes if n.op == "call_module"}
    losses = [pipe.step(x, y) for x, y in batches]
    ref_losses, ref = train_flush(net, batches, 4, loss, opt)
    assert losses == pytest.approx(ref_losses, rel=1e-12)
    sd = pipe.state_dict()
    assert all(torch.allclose(sd[n], t, rtol=1e-12, atol=1e-14) for n, t in ref.named_parameters())


def _branch_run(signs):
    """A :class:`BranchNet` whose ``a`` keeps each input's sign, and one batch of 4 micro-batches
    of 2 per entry of ``signs``: micro-batch k takes ``b.up`` where ``signs[k]`` is 1, else
    ``b.down``. With AdamW's weight decay and moments, any weight stepped in a batch that did
    not reach it (or not stepped in one that did) shows."""
    torch.manual_seed(0)
    net = BranchNet().double()
    g = torch.Generator().manual_seed(1)

    def sign(k):  # micro-batches' inputs far from 0, so their sums have these signs behind a
        return torch.full((2, 8), 10.0 if k else -10.0, dtype=torch.float64)

    batches = [(torch.cat([sign(k) for k in ks]) + 0.01 * torch.randn(8, 8, generator=g, dtype=torch.float64),
                torch.randn(8, 1, generator=g, dtype=torch.float64)) for ks in signs]
    net.a.weight.data = torch.eye(8, dtype=torch.float64)
    net.a.bias.data.zero_()
    return net, batches, functools.partial(torch.optim.AdamW, lr=0.05, weight_decay=0.5), torch.nn.functional.mse_loss


@pytest.mark.parametrize("schedule", ["1f1b", "zb", "2bw"])
def test_a_leaf_modules_weights_train_in_every_batch_that_reaches_them(schedule):
    # The weights a backward reaches were found once, on the first micro-batch: a branch of a
    # leaf module it did not take was skipped by every later update, in batches that took it
    # too. Eager skips a weight only in a batch none of whose micro-batches reached it.
    # batch 1: every micro-batch takes `down`; batch 2: both branches; batch 3: `up` only
    net, batches, opt, loss = _branch_run(((0, 0, 0, 0), (1, 0, 0, 1), (1, 1, 1, 1), (0, 1, 1, 0)))
    pipe = fxpipe.compile(net, (batches[0][0][:2],), loss_fn=loss, optimizer=opt, microbatches=4, stages=2,
                          schedule=schedule, verbose=False, leaf_modules=TwoBranches)
    losses = [pipe.step(x, y) for x, y in batches]
    pipe.flush()
    ref_losses, ref = (train_2bw if schedule == "2bw" else train_flush)(net, batches, 4, loss, opt)
    assert losses == pytest.approx(ref_losses, rel=1e-12)
    sd = pipe.state_dict()
    for name, p in ref.named_parameters():
        assert torch.allclose(sd[name], p, rtol=1e-12, atol=1e-14), name
    with pytest.raises(ConfigError, match=re.escape(
            "fxpipe.compile: accumulate='optimizer' (AdamA) folds each micro-batch's gradient into the moments as it "
            "comes, so every micro-batch must reach the same weights; the model runs leaf_modules")):
        fxpipe.compile(net, (batches[0][0][:2],), loss_fn=loss, microbatches=4, stages=2, accumulate="optimizer",
                       optimizer=functools.partial(torch.optim.Adam, lr=0.01), verbose=False,
                       leaf_modules=TwoBranches)


@pytest.mark.parametrize("schedule", ["1f1b", "zb", "2bw"])
def test_data_parallel_replicas_of_a_leaf_module_skip_the_weights_no_replica_reached(schedule):
    # Each replica gathered its own reached set: in a batch where replica 0's micro-batches all
    # took `down` and replica 1's all took `up`, replica 0 skipped `up` and replica 1 `down`,
    # though both got the summed gradient of both, so the replicas' weights drifted apart. The
    # sets are now summed over the replicas with the gradients: w = 2 trains as one replica of
    # all 4 micro-batches (as DDP does).
    net, batches, opt, loss = _branch_run(((0, 0, 1, 1), (1, 1, 0, 0), (1, 0, 1, 1)))
    example = (batches[0][0][:2],)
    plan = fxpipe.plan(fxpipe.trace(net, example, leaf_modules=[TwoBranches]), example, stages=2, microbatches=2,
                       schedule=schedule, world_size=4)
    assert plan.width == 2
    pipe = fxpipe.compile(net, example, loss_fn=loss, optimizer=opt, plan=plan, microbatches=2, schedule=schedule,
                          verbose=False, leaf_modules=TwoBranches)
    losses = [pipe.step(x, y) for x, y in batches]
    pipe.flush()
    ref_losses, ref = (train_2bw if schedule == "2bw" else train_flush)(net, batches, 4, loss, opt)
    assert losses == pytest.approx(ref_losses, rel=1e-12)
    expected = dict(ref.named_parameters())
    for rank, worker in pipe.workers.items():
        for name, got in worker.store.newest().items():
            assert torch.allclose(got, expected[name], rtol=1e-12, atol=1e-14), (rank, name)


def test_plan_takes_leaf_modules_and_traces_at_other_sizes_with_them():
    # fxpipe.plan had no leaf_modules=: a model that needs them had to be traced first; and a
    # plan searching the micro-batch size traced the model again without them (TraceError)
    net, batches, opt, loss = _branch_run(((0, 1, 0, 1),))
    example = (batches[0][0][:4],)
    with pytest.raises(fxpipe.TraceError):
        fxpipe.plan(net, example, stages=2, global_batch=8, world_size=2)
    plan = fxpipe.plan(net, example, stages=2, global_batch=8, world_size=2, schedule="1f1b",
                       leaf_modules=[TwoBranches])
    assert plan.microbatch_size * plan.microbatches == 8 and plan.microbatch_size != 4  # traced again at b
    b = plan.microbatch_size
    pipe = fxpipe.compile(net, (batches[0][0][:b],), loss_fn=loss, optimizer=opt, plan=plan, schedule="1f1b",
                          verbose=False, leaf_modules=TwoBranches)
    assert pipe.step(*batches[0]) == pytest.approx(train_flush(net, batches, plan.microbatches, loss, opt)[0][0],
                                                   rel=1e-12)
    with pytest.raises(fxpipe.PlanError, match=re.escape(
            "fxpipe.plan: leaf_modules= applies to a model traced here, but a GraphModule from fxpipe.trace was given")):
        fxpipe.plan(fxpipe.trace(net, example, leaf_modules=[TwoBranches]), example, stages=2, microbatches=2,
                    leaf_modules=[TwoBranches])


def _regression_batches(n: int, inputs: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``n`` float64 batches of 8 samples: ``inputs`` features in, 2 targets out."""
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, inputs, generator=g, dtype=torch.float64), torch.randn(8, 2, generator=g, dtype=torch.float64))
            for _ in range(n)]


def _trains_as(pipe, batches, ref_losses, ref, stages: int) -> dict[str, torch.Tensor]:
    """Train ``pipe`` on the float64 regression ``batches``; check its losses and weights against
    the reference's (``ref_losses``, the trained ``ref``) to float64 rounding; its state dict."""
    losses = [pipe.step(x, y) for x, y in batches]
    pipe.flush()
    assert losses == pytest.approx(ref_losses, rel=1e-12)
    sd = pipe.state_dict()
    for name, p in ref.named_parameters():
        assert torch.allclose(sd[name], p, rtol=1e-12, atol=1e-14), (stages, name)
    return sd


class _Teacher(torch.nn.Module):
    """Distillation-style: the teacher branch is read only through ``.detach()``, the gate only
    by a comparison. Eager leaves their gradients None, so AdamW's weight decay never moves them."""

    def __init__(self):
        super().__init__()
        nn = torch.nn
        self.teacher = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8))
        self.gate = nn.Linear(8, 8)
        self.student = nn.Sequential(*[x for _ in range(3) for x in (nn.Linear(8, 8), nn.Tanh())])
        self.head = nn.Linear(8, 2)

    def forward(self, x):
        t, thr = self.teacher(x), self.gate(x)
        h = self.student(x)
        return self.head((h + t.detach()) * (h > thr).to(h.dtype))


@pytest.mark.parametrize("schedule", ["1f1b", "zb", "2bw"])
def test_a_weight_a_later_stage_reads_only_through_detach_or_a_comparison_is_not_stepped(schedule):
    # The next stage sent a zero gradient for a boundary value its backward never reached, and
    # this stage backpropagated it: the teacher's and the gate's weights counted as reached and
    # weight decay moved them. The gradient message now flags what was reached.
    torch.manual_seed(0)
    net = _Teacher().double()
    batches = _regression_batches(3, inputs=8)
    opt = functools.partial(torch.optim.AdamW, lr=0.05, weight_decay=0.5)
    loss = torch.nn.functional.mse_loss
    ref_losses, ref = (train_2bw if schedule == "2bw" else train_flush)(net, batches, 4, loss, opt)
    for stages in (2, 3, 4):
        pipe = fxpipe.compile(net, (batches[0][0][:2],), loss_fn=loss, optimizer=opt, microbatches=4, stages=stages,
                              schedule=schedule, verbose=False)
        crossing = {n.name for n in pipe.staged_graph.graph.nodes if n.target in (torch.ops.aten.detach.default,
                                                                                 torch.ops.aten.gt.Tensor)}
        assert {pipe.plan.assignment[n] for n in crossing} != {0}  # the reads lie past the first cut
        sd = _trains_as(pipe, batches, ref_losses, ref, stages)
        assert torch.equal(sd["teacher.2.weight"], net.teacher[2].weight)


class _ScaledHead(torch.nn.Module):
    """``self.scale.to(x.dtype)`` of a float64 weight and input returns the weight itself, made
    first and read last: the stage that holds it sends the weight as a boundary output."""

    def __init__(self):
        super().__init__()
        nn = torch.nn
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, 2))
        self.body = nn.Sequential(*[x for _ in range(4) for x in (nn.Linear(8, 8), nn.Tanh())])
        self.head = nn.Linear(8, 2)

    def forward(self, x):
        s = self.scale.to(x.dtype)
        return self.head(self.body(x)) * s


@pytest.mark.parametrize("schedule", ["1f1b", "zb", "2bw"])
def test_a_weight_sent_as_a_stage_output_trains(schedule):
    # A stage output with no grad_fn (the weight itself, as Hugging Face Mamba's no-op cast of its
    # D makes where a cut crosses its scan) was missed by the walk that finds the weights a
    # backward reaches: its gradient came back but the update skipped it, so it never trained.
    torch.manual_seed(0)
    net = _ScaledHead().double()
    batches = _regression_batches(3, inputs=8)
    opt = functools.partial(torch.optim.SGD, lr=0.1)
    loss = torch.nn.functional.mse_loss
    ref_losses, ref = (train_2bw if schedule == "2bw" else train_flush)(net, batches, 4, loss, opt)
    for stages in (2, 3):
        pipe = fxpipe.compile(net, (batches[0][0][:2],), loss_fn=loss, optimizer=opt, microbatches=4, stages=stages,
                              schedule=schedule, verbose=False)
        (cast,) = [n for n in pipe.staged_graph.graph.nodes if n.target is torch.ops.aten.to.dtype]
        assert {pipe.plan.assignment[u.name] for u in cast.users} != {pipe.plan.assignment[cast.name]}  # it crosses
        sd = _trains_as(pipe, batches, ref_losses, ref, stages)
        assert not torch.equal(sd["scale"], net.scale)


def test_compile_leaves_a_cumulative_batchnorm_where_it_was():
    # BatchNorm(momentum=None) averages its statistics over num_batches_tracked and so takes the
    # symbolic_trace path (export cannot capture float(num_batches_tracked)). The cost model ran
    # each leaf module under fake tensors but on its real buffers: compile counted one batch
    # that never came, and every running statistic after it was averaged with the wrong weight.
    nn = torch.nn
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8, momentum=None), nn.ReLU(), nn.Linear(8, 2)).double()
    batches = _regression_batches(3, inputs=4)
    opt, loss = functools.partial(torch.optim.SGD, lr=0.1), torch.nn.functional.mse_loss
    with pytest.warns(RuntimeWarning, match=r"fxpipe: torch.export could not capture Sequential \(\w+: .*\); it was "
                                            r"captured with torch.fx.symbolic_trace instead"):
        pipe = fxpipe.compile(net, (batches[0][0][:2],), loss_fn=loss, optimizer=opt, microbatches=4, stages=2,
                              schedule="1f1b", verbose=False)
    assert pipe.staged_graph.meta["fxpipe"].path == "symbolic_trace"
    assert int(net[1].num_batches_tracked) == 0
    losses = [pipe.step(x, y) for x, y in batches]
    ref_losses, ref = train_flush(net, batches, 4, loss, opt)
    assert losses == pytest.approx(ref_losses, rel=1e-12)
    sd = pipe.state_dict()
    assert int(sd["1.num_batches_tracked"]) == 12
    for name, t in ref.state_dict().items():
        assert torch.allclose(sd[name].double(), t.double(), rtol=1e-12, atol=1e-14), name


class _Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x):
        return self.lin(x)


class _InPlace(torch.nn.Module):
    """Torch-level in-place writes, as the symbolic_trace path records them: a Tensor method, an
    augmented assignment, torch.relu_, F.relu(inplace=True) by position and an inplace module."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c, self.d = _Block(), _Block(), _Block(), torch.nn.Linear(8, 2)
        self.act = torch.nn.ReLU(inplace=True)

    def forward(self, x):
        x = x.mul_(2)
        h = self.a(x)
        h += 1
        h = self.b(self.act(h))
        h[:, :4].mul_(0.5)
        h = torch.relu_(h)
        return self.d(torch.nn.functional.relu(self.c(h), True))


@pytest.mark.parametrize("recompute", [False, True])
def test_in_place_writes_on_the_symbolic_trace_path_are_found(recompute):
    # Torch-level calls have no schema, so no write in place was found on this path: a stage's
    # argument written in place was not copied, and a stage that recomputed read its input as
    # the forward had left it (wrong gradients), or a write right after a cut failed mid-step
    # ("a leaf Variable that requires grad is being used in an in-place operation").
    torch.manual_seed(0)
    net = _InPlace().double()
    batches = _regression_batches(2, inputs=8)
    opt, loss = functools.partial(torch.optim.SGD, lr=0.1), torch.nn.functional.mse_loss
    ref_losses, ref = train_flush(net, [(x.clone(), y) for x, y in batches], 4, loss, opt)
    for stages in (2, 3, 4):
        pipe = fxpipe.compile(net, (batches[0][0][:2].clone(),), loss_fn=loss, optimizer=opt, microbatches=4,
                              stages=stages, schedule="1f1b", recompute=recompute, verbose=False, leaf_modules=[_Block])
        losses = [pipe.step(x.clone(), y) for x, y in batches]
        assert losses == pytest.approx(ref_losses, rel=1e-12), stages
        sd = pipe.state_dict()
        for name, p in ref.named_parameters():
            assert torch.allclose(sd[name], p, rtol=1e-12, atol=1e-14), (stages, name)


class _Counted(torch.nn.Module):
    """Counts its calls in a buffer, first or last thing in forward."""

    def __init__(self, last: bool):
        super().__init__()
        self.last = last
        self.a, self.b, self.c = torch.nn.Linear(8, 16), torch.nn.Linear(16, 16), torch.nn.Linear(16, 4)
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x):
        if not self.last:
            self.calls += 1
        out = self.c(torch.tanh(self.b(torch.tanh(self.a(x)))))
        if self.last:
            self.calls += 1
        return out


@pytest.mark.parametrize("last", [False, True])
@pytest.mark.parametrize("stages", [2, 3])
def test_a_buffer_the_model_updates_in_place_trains_on_any_number_of_stages(last, stages):
    # export writes the buffer back (a copy onto itself) at the graph's end: that read tied the
    # counter to the last stage, and the plan was refused with "also read on stage(s) [...]"
    torch.manual_seed(0)
    net = _Counted(last).double()
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(8, 8, generator=g, dtype=torch.float64), torch.randn(8, 4, generator=g,
                                                                                   dtype=torch.float64))
               for _ in range(2)]
    opt, loss = functools.partial(torch.optim.SGD, lr=0.1), torch.nn.functional.mse_loss
    pipe = fxpipe.compile(net, (batches[0][0][:2],), loss_fn=loss, optimizer=opt, microbatches=4, stages=stages,
                          schedule="1f1b", verbose=False)
    losses = [pipe.step(x, y) for x, y in batches]
    ref_losses, ref = train_flush(net, batches, 4, loss, opt)
    assert losses == pytest.approx(ref_losses, rel=1e-12)
    sd = pipe.state_dict()
    assert float(sd["calls"]) == float(ref.calls) == 8.0
    for name, p in ref.named_parameters():
        assert torch.allclose(sd[name], p, rtol=1e-12, atol=1e-14), name


def test_load_state_dict_round_trip_and_continue_after_flush():
    case = CASES["2bw_sgd"]
    pipe, batches = _compile(case)
    for x, y in batches[:4]:
        pipe.step(x, y)
    sd = pipe.state_dict()  # flushes mid-run
    other, _ = _compile(case)
    other.load_state_dict(sd)
    for k, v in other.state_dict().items():
        assert torch.equal(v, sd[k]), k
    # training continues after the flush and still follows the 2bw rule (checked loss by loss)
    losses = [pipe.step(x, y) for x, y in batches[4:]]
    assert all(isinstance(v, float) for v in losses)


def test_lazy_compile_model_alone_uses_model_loss():
    """fxpipe.compile(model): trace and plan on the first step; the model's .loss is the loss."""
    model, _ = gpt2_tiny(batch=2, seq=8, labels=True)
    pipe = fxpipe.compile(model, microbatches=2, stages=2, verbose=False)
    assert pipe.plan is None
    ids = torch.randint(0, 100, (4, 8), generator=torch.Generator().manual_seed(0))
    loss = pipe.step({"input_ids": ids, "labels": ids})
    assert pipe.plan is not None and pipe.plan.stages == 2
    assert isinstance(loss, float) and loss > 0
    with torch.no_grad():
        expected = sum(float(model(input_ids=c, labels=c).loss) for c in ids.chunk(2)) / 2
    assert loss == pytest.approx(expected, rel=1e-5)


def test_lr_scheduler_is_stepped_once_per_step():
    model, example = rmsnorm_residual(batch=2)
    pipe = fxpipe.compile(
        model, example, loss_fn=lambda o, y: o.float().pow(2).mean(), stages=2, microbatches=2,
        optimizer=functools.partial(torch.optim.SGD, lr=0.1),
        lr_scheduler=lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5), verbose=False,
    )
    x = torch.randint(0, 50, (4, 8))
    for _ in range(3):
        pipe.step(x, torch.zeros(4))  # a loss_fn always gets a target, read or not
    pipe.flush()
    for wk in pipe.workers.values():
        assert wk.store.optimizer.param_groups[0]["lr"] == pytest.approx(0.1 * 0.5**3)


def test_batch_that_does_not_split_says_how():
    case = CASES["1f1b_sgd"]
    pipe, batches = _compile(case)
    x, y = batches[0]
    with pytest.raises(ValueError, match=r"has 7 samples, which does not split into 4 equal micro-batches"):
        pipe.step(x[:7], y[:7])


def test_state_dict_before_any_step_explains():
    model, _ = rmsnorm_residual()
    pipe = fxpipe.compile(model, stages=2, verbose=False)
    with pytest.raises(FxpipeError, match="pass example_inputs to fxpipe.compile or call step"):
        pipe.state_dict()
    with pytest.raises(FxpipeError, match=re.escape(
            "describe() before the pipeline was built: pass example_inputs to fxpipe.compile or call step() first")):
        pipe.describe()
    with pytest.raises(FxpipeError, match=re.escape(  # "call step() first" would train on the weights it has now
            "load_state_dict() before the pipeline was built: load the weights into the model before "
            "fxpipe.compile(model, ...), or pass weights=state_dict to compile")):
        pipe.load_state_dict(model.state_dict())


def test_a_pipeline_prints_what_it_runs():
    model, _ = rmsnorm_residual()
    lazy = fxpipe.compile(model, stages=2, schedule="1f1b", verbose=False)
    assert repr(lazy) == "<fxpipe.Pipeline of RMSResidual: schedule=1f1b, one process, planned at its first step>"
    case = CASES["1f1b_sgd"]
    pipe, batches = _compile(case)
    pipe.step(*batches[0])
    pipe.step(*batches[1])
    p = pipe.plan
    assert repr(pipe) == (f"<fxpipe.Pipeline of {type(pipe.model).__name__}: schedule=1f1b d=2 w=1 "
                          f"b={p.microbatch_size} m={case.microbatches} precision=fp32, one process on cpu, 2 step(s)>")
    # without autocast a model trains in its own dtype, and repr says which
    model, example = rmsnorm_residual()
    wide = fxpipe.compile(model.double(), example, loss_fn=lambda out, y: out.pow(2).mean(), stages=2,
                          schedule="1f1b", microbatches=2, verbose=False)
    assert "precision=fp64 (no autocast), one process" in repr(wide)


def test_saved_plan_for_another_model_is_rejected():
    case = CASES["1f1b_sgd"]
    pipe, _ = _compile(case)
    model, example = gpt2_tiny(batch=2, seq=8, labels=True)
    with pytest.raises(RuntimeMismatchError, match=r"rank 0: this rank's trace of GPT2LMHeadModel \(fingerprint "
                                                   r"\w+, of an example micro-batch of \(2, 8\) int64, \(2, 8\) int64\) "
                                                   r"differs from the plan's"):
        fxpipe.compile(model, example, plan=pipe.plan, stages=2, schedule="1f1b", microbatches=4, verbose=False)


def test_dump_writes_every_phase(tmp_path):
    case = CASES["2bw_sgd"]
    pipe, batches = _compile(case)
    pipe.record = True
    for x, y in batches[:2]:
        pipe.step(x, y)
    pipe.flush()
    names = {p.rsplit("/", 1)[-1] for p in pipe.dump(str(tmp_path))}
    for expected in ("nodes.txt", "nodes.json", "graph.dot", "plan.txt", "plan.json", "stage_0.py", "stage_1.py",
                     "schedule.txt", "schedule.json", "schedule.svg", "timeline.svg", "timeline.json"):
        assert expected in names, expected
    assert "stage" in (tmp_path / "nodes.txt").read_text()
    assert "<svg" in (tmp_path / "timeline.svg").read_text()


def test_eval_step_uses_newest_weights_with_dropout_off():
    model, example = gpt2_tiny(batch=2, seq=8, labels=True, dropout=0.3)
    pipe = fxpipe.compile(model, example, stages=2, microbatches=2,
                          optimizer=functools.partial(torch.optim.SGD, lr=0.1), verbose=False)
    g = torch.Generator().manual_seed(0)
    for _ in range(3):
        ids = torch.randint(0, 100, (4, 8), generator=g)
        pipe.step({"input_ids": ids, "labels": ids})
    ids = torch.randint(0, 100, (4, 8), generator=g)
    got = pipe.eval_step({"input_ids": ids, "labels": ids})
    fresh, _ = gpt2_tiny(batch=2, seq=8, labels=True, dropout=0.3)
    fresh.load_state_dict(pipe.state_dict())
    fresh.eval()
    with torch.no_grad():
        expected = sum(float(fresh(input_ids=c, labels=c).loss) for c in ids.chunk(2)) / 2
    assert got == pytest.approx(expected, rel=1e-6)
    assert pipe.eval_step({"input_ids": ids, "labels": ids}) == got  # deterministic: no dropout
    # The eval stages read the training stages' weights: they hold no copy of their own (they
    # held one, a whole second copy of the stages' weights from the first eval_step on).
    for stage in pipe._eval.stages:
        assert stage.param_names and all(p.is_meta for p in stage.module.parameters())
        assert all(b.is_meta for b in stage.flat.buffers.values())
        assert not any(b.is_meta for b in stage.module.buffers())


def eval_matches_eager_with_a_buffer_counted_upstream(schedule: str, stages: int) -> list[tuple[float, float]]:
    """(eval_step, eager eval of the pipeline's state_dict) after training, and again after
    load_state_dict with another count: the later stages' eval reads the counted buffer, which
    their training stages only ever received across a cut (tests.models.CountedScale)."""
    from tests.models import CountedScale

    torch.manual_seed(0)
    model = CountedScale().double()
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(4, 4, generator=g, dtype=torch.float64), torch.randn(4, 2, generator=g, dtype=torch.float64)
    pipe = fxpipe.compile(model, (x[:2],), loss_fn=F.mse_loss, microbatches=2, schedule=schedule, stages=stages,
                          optimizer=functools.partial(torch.optim.SGD, lr=0.05), verbose=False)
    for _ in range(3):
        pipe.step(x, y)
    out = []
    for count in (None, 3.0):
        sd = pipe.state_dict()
        if count is not None:
            sd["scale"] = torch.tensor(count, dtype=torch.float64)
            pipe.load_state_dict(sd)
        eager = copy.deepcopy(model)
        eager.load_state_dict(sd)
        eager.eval()
        with torch.no_grad():
            expected = sum(float(F.mse_loss(eager(a), b)) for a, b in zip(x.chunk(2), y.chunk(2))) / 2
        out.append((pipe.eval_step(x, y), expected))
    assert float(pipe.state_dict()["scale"]) == 3.0
    return out


@pytest.mark.parametrize("schedule,stages", [("1f1b", 2), ("2bw", 2), ("zb", 3)])
def test_eval_reads_a_buffer_training_counts_on_an_earlier_stage(schedule, stages):
    # eval stage 1 read its own copy of the buffer, the value at compile time: a wrong loss, silently
    for got, expected in eval_matches_eager_with_a_buffer_counted_upstream(schedule, stages):
        assert got == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("case", ["gpt2", "t5", "data_dependent_leaf"])
def test_the_pipeline_holds_none_of_the_models_weights(case):
    # The pipeline kept the model (for eval_step's second trace) and its training trace, which
    # shares the model's parameters: `del model` freed nothing, and a rank held the whole model
    # beside its stage's copy. It now keeps both with their parameters on the meta device; the
    # model itself is left as it was, and eval_step traces the copy (export's meta path, or the
    # symbolic path, whose shape pass runs a data-dependent leaf on zeros in place of weights).
    # compile froze the heap (gc.freeze), the model in it, so a cyclic model deleted after compile
    # stayed until exit; the freeze now waits for the first step, after a collection.
    import gc
    import weakref

    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    if case == "data_dependent_leaf":
        nn = torch.nn
        model = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.3), _Branchy(), nn.Linear(8, 1))
        x, y = torch.randn(8, 8, generator=g), torch.randn(8, 1, generator=g)
        batch, example, kw = (x, y), (x[:2],), {"loss_fn": F.mse_loss, "leaf_modules": _Branchy}
    else:
        model, example = (gpt2_tiny(batch=2, seq=8, labels=True, dropout=0.3) if case == "gpt2"
                          else t5_tiny(batch=2))
        ids = torch.randint(2, 100, (8, 8), generator=g)
        batch, kw = ({"input_ids": ids, "labels": ids.clone()},), {}
    before = {k: t.clone() for k, t in model.state_dict().items()}
    reference = copy.deepcopy(model)
    weights = [weakref.ref(p) for p in model.parameters()]
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        pipe = fxpipe.compile(model, example, stages=2, microbatches=4, schedule="1f1b",
                              optimizer=functools.partial(torch.optim.SGD, lr=0.1), verbose=False, **kw)
    # copying the trace's pytree specs made torch warn that LeafSpec is deprecated
    assert not [w for w in said if "LeafSpec" in str(w.message)]
    assert all(torch.equal(t, before[k]) for k, t in model.state_dict().items())  # the model as it was
    assert not any(p.is_meta for p in model.parameters())
    model_ref = weakref.ref(model)
    del model
    pipe.step(*batch)  # its garbage collection (before gc.freeze) frees a cyclic model such as HF's
    assert model_ref() is None and [w() for w in weights if w() is not None] == []
    got = pipe.eval_step(*batch)
    assert pipe.eval_step(*batch) == got  # dropout off
    reference.load_state_dict(pipe.state_dict())
    reference.eval()
    with torch.no_grad():
        if case == "data_dependent_leaf":
            expected = sum(float(F.mse_loss(reference(a), b)) for a, b in zip(x.chunk(4), y.chunk(4))) / 4
        else:
            expected = sum(float(reference(input_ids=c, labels=c).loss) for c in ids.chunk(4)) / 4
    assert got == pytest.approx(expected, rel=1e-6)
    assert pipe.trace_info.path == ("symbolic_trace" if case == "data_dependent_leaf" else "export")


def test_a_model_that_cannot_be_copied_is_kept_and_evaluates():
    # A model deepcopy refuses (here: it holds a lock) is kept as it is, weights and all, and
    # eval_step traces it as before.
    import threading

    nn = torch.nn
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.3), nn.ReLU(), nn.Linear(8, 1))
    model.lock = threading.Lock()
    with pytest.raises(TypeError, match="pickle"):
        copy.deepcopy(model)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, 8, generator=g), torch.randn(8, 1, generator=g)
    pipe = fxpipe.compile(model, (x[:2],), loss_fn=F.mse_loss, stages=2, microbatches=4, schedule="1f1b",
                          optimizer=functools.partial(torch.optim.SGD, lr=0.1), verbose=False)
    assert pipe.model is model
    pipe.step(x, y)
    got = pipe.eval_step(x, y)
    lockless = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.3), nn.ReLU(), nn.Linear(8, 1))
    assert got == pytest.approx(_eager_eval_loss(lockless, pipe.state_dict(), F.mse_loss, x, y), rel=1e-6)


def test_a_model_compiled_in_eval_mode_trains_so_with_a_warning():
    # as Hugging Face's from_pretrained returns it: dropout silently off in training
    nn = torch.nn
    model = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5), nn.Linear(8, 1)).eval()
    with pytest.warns(RuntimeWarning, match=r"fxpipe.compile: Sequential is in eval mode \(model.eval\(\), the mode a "
                                            r"Hugging Face from_pretrained returns it in\), so the pipeline trains it "
                                            r"in eval mode: dropout off"):
        pipe = fxpipe.compile(model, (torch.randn(2, 8),), loss_fn=F.mse_loss, stages=2, microbatches=2,
                              schedule="1f1b", verbose=False)
    dropouts = [n for n in pipe.staged_graph.graph.nodes if n.target == torch.ops.aten.dropout.default]
    assert dropouts and not any(n.args[2] for n in dropouts)  # traced with train=False


def test_optimizers_give_the_learning_rate_a_scheduler_set():
    nn = torch.nn
    pipe = fxpipe.compile(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)), (torch.randn(2, 4),), loss_fn=F.mse_loss,
                          microbatches=2, stages=2, schedule="1f1b", verbose=False,
                          optimizer=functools.partial(torch.optim.AdamW, lr=1e-2),
                          lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda t: (t + 1) / 4))
    lrs = lambda: {s: opt.param_groups[0]["lr"] for s, opt in pipe.optimizers.items()}  # noqa: E731
    assert lrs() == {0: 0.0025, 1: 0.0025}
    pipe.step(torch.randn(4, 4), torch.randn(4, 2))
    assert lrs() == {0: 0.0025, 1: 0.0025}  # step 1's update runs in step 2, once its norm is known
    pipe.flush()
    assert lrs() == {0: 0.005, 1: 0.005}


def _eager_eval_loss(model, state, loss_fn, x, y, m: int = 4) -> float:
    """``model`` with ``state`` loaded, in eval mode: its mean loss over ``m`` micro-batches."""
    model.load_state_dict(state)
    model.eval()
    with torch.no_grad():
        return sum(float(loss_fn(model(a), b)) for a, b in zip(x.chunk(m), y.chunk(m))) / m


def test_eval_step_runs_where_a_training_stage_holds_only_nodes_eval_lacks():
    # The planner may give a stage nothing but a BatchNorm's num_batches_tracked += 1, which the
    # eval-mode trace does not have: eval_step then refused the plan ("stage(s) [1] have none").
    # That stage now passes a copy of what crosses it on.
    nn = torch.nn
    torch.manual_seed(0)
    model = nn.Sequential(*[m for c in (3, 8, 8) for m in (nn.Conv2d(c, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU())],
                          nn.Flatten(), nn.Linear(8 * 36, 5))
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, 3, 6, 6, generator=g), torch.randint(0, 5, (8,), generator=g)
    pipe = fxpipe.compile(model, (x[:2],), loss_fn=torch.nn.functional.cross_entropy, microbatches=4, stages=3,
                          schedule="1f1b", optimizer=functools.partial(torch.optim.SGD, lr=0.1), verbose=False)
    nodes = {n.name: n for n in pipe.staged_graph.graph.nodes}
    assert [n for n, s in pipe.plan.assignment.items() if s == 1 and nodes[n].op == "call_function"] == ["add__1"]
    pipe.step(x, y)
    got = pipe.eval_step(x, y)
    expected = _eager_eval_loss(model, pipe.state_dict(), torch.nn.functional.cross_entropy, x, y)
    assert got == pytest.approx(expected, rel=1e-6)


@pytest.mark.parametrize("how", ["leaf_modules", "export_fails"])
def test_eval_step_on_the_symbolic_trace_path_runs_its_modules_in_eval_mode(how):
    # On the symbolic_trace path modules are calls of copies of the model's modules. The eval
    # stages copied them after the model was put back in training mode: eval_step ran BatchNorm
    # on batch statistics (moving the training running statistics) and kept dropout on. Where
    # export failed only in training mode (BatchNorm(momentum=None)), the eval trace took the
    # export path and its node names matched no training node: eval_step refused the plan.
    nn = torch.nn
    torch.manual_seed(0)

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin, self.norm, self.drop = nn.Linear(16, 16), nn.BatchNorm1d(16, momentum=None), nn.Dropout(0.5)

        def forward(self, x):
            return self.drop(torch.relu(self.norm(self.lin(x))))

    model = nn.Sequential(nn.Linear(8, 16), Block(), Block(), nn.Linear(16, 4))
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(16, 8, generator=g), torch.randn(16, 4, generator=g)
    kw = {"leaf_modules": [Block]} if how == "leaf_modules" else {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # export's failure, said at compile
        pipe = fxpipe.compile(model, (x[:4],), loss_fn=nn.functional.mse_loss, microbatches=4, stages=2,
                              schedule="1f1b", optimizer=functools.partial(torch.optim.SGD, lr=0.1), verbose=False,
                              **kw)
    assert pipe.trace_info.path == "symbolic_trace"
    pipe.step(x, y)
    trained = pipe.state_dict()
    got = pipe.eval_step(x, y)
    assert pipe.eval_step(x, y) == got  # no dropout
    after = pipe.state_dict()
    assert all(torch.equal(after[k], t) for k, t in trained.items())  # no running statistics moved
    expected = _eager_eval_loss(model, trained, nn.functional.mse_loss, x, y)
    assert got == pytest.approx(expected, rel=1e-6)


class _TrainingOnlyFirst(torch.nn.Module):
    """In training mode an extra call of ``l[0]`` comes first: every later node of the training
    trace is named one call further on than its eval-mode counterpart (``linear_1`` for ``linear``)."""

    def __init__(self):
        super().__init__()
        self.l = torch.nn.ModuleList([torch.nn.Linear(8, 8) for _ in range(5)])
        self.head = torch.nn.Linear(8, 1)

    def forward(self, x):
        if self.training:
            x = x + 0.5 * torch.tanh(self.l[0](x))
        for layer in self.l:
            x = torch.tanh(layer(x))
        return self.head(x)


@pytest.mark.parametrize("stages", [2, 3])
def test_eval_step_where_training_runs_an_operator_first_that_eval_lacks(stages):
    # Eval nodes took the stage of the training node of the same name: the shifted names put
    # l.2's linear on the stage of training's `linear_2` (l.1's), and eval_step refused the plan
    # ("reads parameters ['l.2.weight', ...] that training stage 0 does not hold").
    torch.manual_seed(0)
    net = _TrainingOnlyFirst().double()
    x, y = _regression_batches(1, 8)[0]
    y = y[:, :1]
    pipe = fxpipe.compile(net, (x[:2],), loss_fn=torch.nn.functional.mse_loss, microbatches=4, stages=stages,
                          schedule="1f1b", optimizer=functools.partial(torch.optim.SGD, lr=0.1), verbose=False)
    pipe.step(x, y)
    got = pipe.eval_step(x, y)
    expected = _eager_eval_loss(net, pipe.state_dict(), torch.nn.functional.mse_loss, x, y)
    assert got == pytest.approx(expected, rel=1e-12)


def test_step_without_sync_returns_the_same_loss_as_a_device_tensor():
    case = CASES["2bw_sgd"]
    synced, batches = _compile(case)
    lazy, _ = _compile(case)
    for x, y in batches[:3]:
        a = synced.step(x, y)
        b = lazy.step(x, y, sync=False)
        assert isinstance(a, float)
        assert isinstance(b, torch.Tensor) and b.dim() == 0 and b.device == lazy.device
        assert float(b) == a


def test_device_is_chosen_and_placed():
    case = CASES["1f1b_sgd"]
    pipe, _ = _compile(case, device="cpu")
    assert pipe.device == torch.device("cpu")
    for wk in pipe.workers.values():
        assert all(t.device.type == "cpu" for t in wk.store.slots[0].values())
    with pytest.raises(ValueError, match="device must be 'auto', 'cpu' or 'cuda"):
        _compile(case, device="mps")
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="asks for CUDA, but torch.cuda.is_available\\(\\) is False"):
            _compile(case, device="cuda")


_FAULTS_PER_PASS = """
import ctypes, resource, sys
# Count 4 KiB pages: transparent huge pages (any size, where the host turns them on) would fault
# a pass's 16 MiB in as a few large folios, and how many depends on the kernel, not on glibc.
if ctypes.CDLL(None, use_errno=True).prctl(41, 1, 0, 0, 0) != 0:  # PR_SET_THP_DISABLE
    sys.exit("prctl(PR_SET_THP_DISABLE) failed: errno " + str(ctypes.get_errno()))
import torch
from fxpipe.device import choose
if sys.argv[1] == "cpu":
    choose("cpu", distributed=False)  # what compile does on a CPU rank

def micro_batch():  # 16 MiB of activations kept through a pass, then freed
    kept = [torch.randn(64, 1024, 8) for _ in range(8)]
    return sum(float(x.sum()) for x in kept)

for _ in range(3):
    micro_batch()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(10):
    micro_batch()
print((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 10)
"""


def test_a_cpu_rank_reuses_its_heap_instead_of_faulting_pages_in_every_pass():
    """Choosing the CPU settles glibc's adaptive thresholds (``device.settle_heap``): a fresh
    process whose passes allocate and free 16 MiB faults every page of it in again each pass
    with glibc's starting thresholds, and none once the rank's device is chosen."""
    import os
    import subprocess
    import sys

    try:
        glibc = os.confstr("CS_GNU_LIBC_VERSION") or ""
    except (ValueError, OSError, AttributeError):
        glibc = ""
    if not glibc.startswith("glibc") or any(k.startswith("MALLOC_") for k in os.environ):
        pytest.skip("glibc's adaptive thresholds are not in force here")

    def faults(device: str) -> float:
        out = subprocess.run([sys.executable, "-c", _FAULTS_PER_PASS, device], capture_output=True, text=True,
                             timeout=120, check=True)
        return float(out.stdout.split()[-1])

    fresh, settled = faults("none"), faults("cpu")
    # the unsettled heap faults its pages in again every pass: up to 4,096 of 4 KiB, fewer where the
    # frees of torch's import already raised glibc's thresholds part-way, which varies from one fresh
    # process to the next (12 here, OMP_NUM_THREADS=1: 1,677 twice, 3,251 twice, 4,064-4,065 eight times)
    assert fresh > 1000, fresh
    assert settled < 0.05 * fresh, (settled, fresh)


_RSS_AFTER_A_BURST = """
import torch
from fxpipe.device import release_heap, settle_heap

def rss():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) / 1024 for line in f if line.startswith("VmRSS"))

settle_heap()
burst, kept = [], []
for _ in range(200):  # 1 MiB pieces with 64 KiB live ones between them: free() cannot return them
    burst.append(torch.ones(1 << 18))
    kept.append(torch.ones(1 << 14))
del burst
before = rss()
release_heap()
print(before, rss())
"""


def test_a_cpu_rank_hands_back_what_a_burst_freed(monkeypatch):
    """``device.release_heap`` (glibc's ``malloc_trim``) returns to the system the memory a burst
    freed between allocations still alive, which ``free`` keeps resident: 200 MiB here. A
    calibration on the CPU, which holds every node's output at once, ends with it."""
    import os
    import subprocess
    import sys

    import fxpipe.calibrate as cost  # the timing of fxpipe.cost's DeviceModel

    try:
        glibc = os.confstr("CS_GNU_LIBC_VERSION") or ""
    except (ValueError, OSError, AttributeError):
        glibc = ""
    if not glibc.startswith("glibc"):
        pytest.skip("release_heap trims glibc's heap; this C library is another")
    out = subprocess.run([sys.executable, "-c", _RSS_AFTER_A_BURST], capture_output=True, text=True, timeout=120,
                         check=True)
    before, after = map(float, out.stdout.split())
    assert before - after > 150, (before, after)  # MiB

    calls = []
    gm = fxpipe.trace(torch.nn.Linear(8, 8), (torch.randn(4, 8),))
    monkeypatch.setattr(cost, "release_heap", lambda: calls.append(1))
    cost.DeviceModel.cpu().calibrate(gm, repeats=1)
    assert calls == [1]


def test_backend_and_device_must_agree():
    from fxpipe.device import backend_for, check_backend

    assert backend_for(torch.device("cpu")) == "gloo"
    assert backend_for(torch.device("cuda", 0)) == "nccl"
    check_backend("gloo", torch.device("cpu"))
    with pytest.raises(ValueError, match="NCCL, which only moves CUDA tensors"):
        check_backend("nccl", torch.device("cpu"))
    with pytest.raises(ValueError, match="gloo, whose point-to-point operations move CPU tensors"):
        check_backend("gloo", torch.device("cuda", 0))


def test_auto_device_picks_the_local_rank_gpu_under_torchrun(monkeypatch):
    # The CUDA branch of the seam, without a GPU: availability, count and set_device faked.
    from fxpipe import device as seam

    chosen = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: chosen.append(d))
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert seam.choose(None, distributed=True) == torch.device("cuda", 3)
    assert seam.choose("cuda", distributed=True) == torch.device("cuda", 3)
    assert seam.choose("cuda:1", distributed=True) == torch.device("cuda", 1)
    assert seam.choose("auto", distributed=False) == torch.device("cuda", 0)
    assert chosen == [torch.device("cuda", 3), torch.device("cuda", 3), torch.device("cuda", 1), torch.device("cuda", 0)]
    assert seam.choose("cpu", distributed=True) == torch.device("cpu")
    assert seam.backend_for(seam.choose(None, distributed=True)) == "nccl"


def test_dropout_masks_do_not_depend_on_recomputation():
    # R k replays F k's dropout masks (seeded per (seed, micro-batch, stage)): recomputing gives
    # the very numbers of not recomputing, and dropout is really on.
    import dataclasses

    from tests.cases import single_process

    case = CASES["dropout_2bw"]
    assert case.recompute and case.dropout > 0
    model, example, *_ = build(case)
    # one cut for both runs: masks are per stage, so moving a node to another stage redraws them
    plan = fxpipe.plan(model, example, stages=case.stages, microbatches=case.microbatches, recompute=True)
    assert plan.recompute[0]  # (the last stage, one micro-batch in flight, never recomputes)
    with_r = single_process(case, plan=plan)
    without_r = single_process(dataclasses.replace(case, recompute=False),  # the plan says: none recomputes
                               plan=dataclasses.replace(plan, recompute=(False,) * plan.stages))
    no_dropout = single_process(dataclasses.replace(case, dropout=0.0))
    assert with_r[0] == without_r[0]
    assert all(torch.equal(with_r[1][k], without_r[1][k]) for k in with_r[1])
    assert with_r[0] != no_dropout[0]


@pytest.mark.parametrize("schedule", ["1f1b", "zb"])
def test_recomputing_gives_the_numbers_of_not_recomputing_where_kernels_follow_autograd(schedule):
    # The first forward of a recomputing stage ran under no_grad, where the CPU's
    # scaled_dot_product_attention takes another backend for a mask that takes a gradient (a
    # learned bias, as Swin's and T5's): its outputs and loss differed from the recomputed
    # forward's, and training's, in the last bits (Swin: 9e-9 in fp32, 2e-3 in bf16 weights
    # after three AdamW steps). It now records with autograd, saving nothing.
    import dataclasses

    from tests.models import learned_bias_attention

    model, example = learned_bias_attention(batch=2)
    g = torch.Generator().manual_seed(3)
    batches = [(torch.randn(4, 16, 8, generator=g), torch.randint(0, 4, (4,), generator=g)) for _ in range(3)]
    # m = d: zb splits every backward of the last stage whether it recomputes or not
    # (zb_split), so both runs add the micro-batches' gradients in one order; at m = 4 the stage
    # that does not recompute defers W1 past B2 and B3, which rounding alone tells apart
    plan = fxpipe.plan(model, example, stages=2, microbatches=2, schedule=schedule, recompute=True)
    # the cut right before the bias lookup: stage 1 computes the mask it passes to the kernel
    names = [n for n, _ in plan.assignment_pairs]
    cut = next(i for i, n in enumerate(names) if n.startswith("index"))
    plan = dataclasses.replace(plan, assignment_pairs=tuple((n, int(i >= cut)) for i, n in enumerate(names)))
    runs = {}
    for recompute in [(True, True), (False, False)]:
        pipe = fxpipe.compile(copy.deepcopy(model), example, loss_fn=F.cross_entropy, plan=dataclasses.replace(
            plan, recompute=recompute), schedule=schedule, optimizer=functools.partial(torch.optim.AdamW, lr=1e-2),
            verbose=False)
        runs[recompute] = [pipe.step(*b) for b in batches], pipe.state_dict()
    (with_r, sd_r), (without_r, sd) = runs.values()
    assert with_r == without_r
    assert all(torch.equal(sd_r[k], sd[k]) for k in sd)
    q, k, v = (torch.randn(2, 2, 16, 4) for _ in range(3))
    bias = torch.randn(1, 2, 16, 16)
    with torch.no_grad():  # the kernels this test needs to tell apart still differ
        plain = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=0.5)
    assert not torch.equal(plain, F.scaled_dot_product_attention(q, k, v, attn_mask=bias.requires_grad_(), scale=0.5))


def test_data_parallel_ranges_leave_out_tied_weights():
    # The DP all-reduce must not touch a tied weight's gradient, which its own all-reduce sums at
    # the same time (both in place: they would race).
    pipe, _ = _compile(CASES["gpt2_2bw"])
    wk = pipe.workers[0]
    tied = {s.name: s for s in wk.layout.slots if s.name in wk.cfg.tied_groups}
    assert list(tied) == ["transformer.wte.weight"]
    runs = wk._dp_ranges()
    covered = sum(hi - lo for _, lo, hi in runs)
    assert covered == sum(n for _, n in wk.layout.sizes) - sum(s.numel for s in tied.values())
    for s in tied.values():
        assert all(hi <= s.offset or lo >= s.offset + s.numel for dt, lo, hi in runs if dt == s.dtype)


@pytest.mark.parametrize("kwargs,message", [
    (dict(schedule="zb1"), "fxpipe.compile: schedule must be '2bw', '1f1b', 'gpipe' or 'zb', found 'zb1'"),
    (dict(microbatches=0), "fxpipe.compile: microbatches must be an int >= 1 (or None), found 0"),
    (dict(stages=2.0), "fxpipe.compile: stages must be an int >= 1 (or None), found 2.0"),
    (dict(max_grad_norm=-1.0), "fxpipe.compile: max_grad_norm must be a number > 0 (or None for no clipping), found -1.0"),
    (dict(kernels="cuda"), "fxpipe.compile: kernels must be 'auto', 'triton', 'torch' or 'off', found 'cuda'; 'auto' "
                           "runs the fused Triton update on a GPU and torch.optim on the CPU"),
    (dict(cost_mode="fast"), "fxpipe.compile: cost_mode must be 'analytic', 'measured' or 'calibrated', found 'fast'; "
                             "'analytic' prices operators by FLOPs and bytes (the default)"),
    (dict(seed=1.5), "fxpipe.compile: seed must be an int, found 1.5; pass e.g. seed=0"),
    (dict(check_batch="no"), "fxpipe.compile: check_batch must be True or False, found 'no'"),
    (dict(optimizer=torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)),
     "fxpipe.compile: optimizer must be a callable taking [(name, parameter), ...]"),
])
def test_compile_checks_its_arguments_before_anything_runs(kwargs, message):
    model, example = rmsnorm_residual()
    with pytest.raises(ValueError, match=re.escape(message)):
        fxpipe.compile(model, example, verbose=False, **kwargs)


def test_topology_names_every_group_once():
    from fxpipe.pipeline import Topology

    topo = Topology(3, 2, (("wte", (0, 2)),))
    groups = topo.groups()
    assert groups["dp:2"] == [2, 5] and groups["all"] == list(range(6))  # NORM and LOSS span every rank
    assert sorted(groups) == ["all", "dp:0", "dp:1", "dp:2", "tied:0-2"]
    assert groups["tied:0-2"] == [0, 2, 3, 5]  # every copy of every replica, one all-reduce
    assert topo.tied_groups_of(1) == {} and topo.tied_owner_of(2) == {"wte": False}


def test_eval_stages_are_built_on_the_pipelines_device(monkeypatch):
    # The eval-mode trace's stages (buffers, constants) go where the training stages are: on
    # CUDA they would otherwise stay on the CPU. The device seam records what split was given.
    from fxpipe import codegen

    model, example = rmsnorm_residual(batch=2)
    pipe = fxpipe.compile(model, example, loss_fn=lambda out, y: out.pow(2).mean(), microbatches=2, stages=2,
                          verbose=False)
    devices = []
    real = codegen.split
    monkeypatch.setattr(codegen, "split", lambda *a, **k: devices.append(k.get("device")) or real(*a, **k))
    x = torch.randint(0, 50, (4, 8))
    pipe.eval_step(x, x)
    assert devices == [pipe.device]


@pytest.mark.parametrize("name", ["w2_gpt2_2bw"])
def test_the_runtime_places_ranks_by_the_plans_layout(name):
    # Stage-major (rank = stage * w + replica): a stage's replicas on neighbouring ranks (one
    # node), the pipeline across them. The runtime takes peers and groups from the plan; the
    # strict one-process hub checks every post, and the numbers are the reference's.
    import dataclasses

    case = CASES[name]
    model, example, batches, loss_fn, opt = build(case)
    plan = fxpipe.plan(model, example, stages=2, world_size=4, microbatches=case.microbatches, schedule=case.schedule)
    plan = dataclasses.replace(plan, layout="stage")
    pipe = fxpipe.compile(model, example, loss_fn=loss_fn, optimizer=opt, microbatches=case.microbatches,
                          schedule=case.schedule, max_grad_norm=case.max_grad_norm, plan=plan, verbose=False)
    topo = pipe.topology
    assert [topo.locate(r) for r in range(4)] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert topo.groups()["dp:0"] == [0, 1] and topo.groups()["dp:1"] == [2, 3]
    assert (pipe.workers[1].next, pipe.workers[3].prev) == (3, 1)
    assert "rank = stage x 2 + replica (stage-major" in str(pipe.plan)
    losses = [pipe.step(x, y) for x, y in batches]
    mismatches = compare(case, losses, pipe.state_dict())
    assert not mismatches, "\n".join(mismatches)


@pytest.mark.parametrize("schedule", ["2bw", "1f1b"])
def test_after_a_step_that_failed_midway_every_later_call_says_to_rebuild(schedule):
    # one process: a loss function that raises in step 2 leaves the stages part-way through it
    calls = [0]

    def loss_fn(out, y):
        calls[0] += 1
        if calls[0] == 5:  # step 2's first micro-batch
            raise ValueError("a bug in the user's loss")
        return torch.nn.functional.mse_loss(out, y)

    torch.manual_seed(0)
    nn = torch.nn
    net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))
    x, y = torch.randn(8, 8), torch.randn(8, 8)
    pipe = fxpipe.compile(net, (x[:2],), loss_fn=loss_fn, microbatches=4, stages=2, schedule=schedule, verbose=False)
    pipe.step(x, y)
    # the user's error as it is (except ValueError catches it), where it happened in a note, the grid after
    with pytest.raises(ValueError, match=r"^a bug in the user's loss\nfxpipe: rank 1 failed running action 1F5v\d\n"):
        pipe.step(x, y)
    expected = (r"after step 2 \(rank 1, action 1F\d+v\d+: ValueError: a bug in the user's loss\) failed: this "
                r"pipeline's "
                r"ranks stopped part-way through it.*Compile a new pipeline and load the last checkpoint")
    for call in (lambda: pipe.step(x, y), pipe.flush, pipe.state_dict):
        with pytest.raises(FxpipeError, match=expected):
            call()


def test_an_action_whose_communication_failed_quotes_what_the_peers_reported_and_reports_nothing_itself(monkeypatch):
    # Under NCCL a peer's failure reaches a rank as a DistError from its own action (the watchdog
    # aborted the communication): the action's error quotes what the other ranks left in the
    # store (DistComm.reports), and the rank reports nothing of its own. An error of the action
    # itself is reported (rank 1 here), for its peers to quote.
    import torch.distributed as dist

    torch.manual_seed(0)
    nn = torch.nn
    net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))
    x, y = torch.randn(8, 8), torch.randn(8, 8)

    def trained_once(failing_rank: int, error: Exception):
        """A pipeline after one step whose next action on ``failing_rank`` raises ``error``, and
        what each rank reports."""
        pipe = fxpipe.compile(net, (x[:2],), loss_fn=torch.nn.functional.mse_loss, microbatches=4, stages=2,
                              schedule="1f1b", verbose=False)
        pipe.step(x, y)
        told = {0: [], 1: []}
        for r, wk in pipe.workers.items():
            monkeypatch.setattr(wk.comm, "report", told[r].append)
            monkeypatch.setattr(wk.comm, "reports", lambda: {1: "ValueError in action 1F5v1: a bug in the user's loss"})

        def run(a):
            raise error

        monkeypatch.setattr(pipe.workers[failing_rank], "run", run)
        return pipe, told

    pipe, told = trained_once(0, dist.DistBackendError("NCCL communicator was aborted"))
    with pytest.raises(dist.DistBackendError, match=r"NCCL communicator was aborted\nfxpipe: rank 0 failed running "
                                                    r"action 0\S+; rank\(s\) \[1\] failed first \(rank 1: ValueError "
                                                    r"in action 1F5v1: a bug in the user's loss\)"):
        pipe.step(x, y)
    assert told == {0: [], 1: []}

    pipe, told = trained_once(1, ValueError("a bug in the user's model"))
    with pytest.raises(ValueError, match="a bug in the user's model\nfxpipe: rank 1 failed running action 1"):
        pipe.step(x, y)
    assert told[0] == [] and len(told[1]) == 1 and re.fullmatch(
        r"ValueError in action 1\S+: a bug in the user's model", told[1][0]), told


def test_a_batch_refused_on_one_rank_leaves_its_reason_for_the_peers(monkeypatch):
    # step() and eval_step() check a batch before communicating; where only this rank's batch is
    # wrong, its peers go on and wait for it, so it leaves them the reason (DistComm.report)
    torch.manual_seed(0)
    nn = torch.nn
    net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))
    x, y = torch.randn(8, 8), torch.randn(8, 8)
    pipe = fxpipe.compile(net, (x[:2],), loss_fn=torch.nn.functional.mse_loss, microbatches=4, stages=2,
                          schedule="1f1b", verbose=False)
    pipe.step(x, y)
    told = []
    for wk in pipe.workers.values():
        monkeypatch.setattr(wk.comm, "report", told.append)
    for call, what in ((pipe.step, "step"), (pipe.eval_step, "eval_step")):
        told.clear()
        with pytest.raises(fxpipe.errors.InputError):
            call(x.double(), y)
        assert len(told) == 2 and all(re.match(rf"InputError: {what}\(\): input .*expected torch.float32 as traced, "
                                               rf"got torch.float64", t) for t in told), told
    # until a step runs, the refusal stands: were the script to end now (having caught it), this
    # rank would not wait at exit for peers that wait for it; a step takes its report back
    from fxpipe import pipeline

    withdrawn = []
    for wk in pipe.workers.values():
        monkeypatch.setattr(wk.comm, "withdraw", lambda: withdrawn.append(1))
    assert id(pipe) in pipeline._REFUSED_HERE and not withdrawn
    assert pipe.step(x, y) is not None  # a refused batch leaves the pipeline as it was
    assert id(pipe) not in pipeline._REFUSED_HERE and len(withdrawn) == 2


def test_a_post_to_a_peer_whose_connection_closed_is_a_peer_error(monkeypatch):
    # gloo refuses a send or receive posted to a peer that died; it is the peer's failure, as a
    # failed wait is, not an error of the action that posted it
    import torch.distributed as dist

    from fxpipe.comm import DistComm
    from fxpipe.errors import PeerError

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        comm = DistComm({})

        def closed(*args, **kwargs):
            raise RuntimeError("[../gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:4242")

        monkeypatch.setattr(dist, "isend", closed)
        monkeypatch.setattr(dist, "irecv", closed)
        for post, label, peer in ((comm.isend, "0SEND_ACT3", "to rank 1"), (comm.irecv, "0RECV_GRAD3", "from rank 1")):
            with pytest.raises(PeerError, match=re.escape(f"rank 0 posted {label} {peer}, and the connection failed "
                                                          f"([../gloo/transport/tcp/pair.cc:553] Connection closed by "
                                                          f"peer [127.0.0.1]:4242). The peer died")):
                post([torch.zeros(2)], 1, label)

        def out_of_memory(*args, **kwargs):  # this rank's own failure, not its peer's: left as it is
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

        monkeypatch.setattr(dist, "isend", out_of_memory)
        with pytest.raises(torch.OutOfMemoryError, match="Tried to allocate"):
            comm.isend([torch.zeros(2)], 1, "0SEND_ACT3")
    finally:
        dist.destroy_process_group()


def test_replicas_draw_their_own_dropout_masks_as_one_replica_would():
    # Micro-batches are counted over the global batch for the random streams: two replicas of
    # m = 2 draw what one replica of m = 4 draws for the same samples (before, both replicas drew
    # micro-batch j's masks), so the two layouts train alike with dropout on.
    import dataclasses

    from fxpipe.demo import lm_loss
    from tests import resume

    net = resume.model(dropout=0.3).double()
    example = (resume.batch(0)[0][:2],)
    wide = fxpipe.plan(net, example, stages=2, microbatches=2, schedule="1f1b", world_size=4, clip=True)
    assert wide.width == 2
    one = dataclasses.replace(wide, width=1, microbatches=4)
    runs = []
    for plan in (wide, one):
        pipe = fxpipe.compile(net, example, loss_fn=lm_loss, plan=plan, schedule="1f1b", microbatches=plan.microbatches,
                              max_grad_norm=1.0, verbose=False, optimizer=functools.partial(torch.optim.SGD, lr=0.1))
        losses = [pipe.step(*resume.batch(t)) for t in range(1, 4)]
        runs.append((losses, pipe.state_dict()))
    (wide_losses, wide_sd), (one_losses, one_sd) = runs
    assert wide_losses == pytest.approx(one_losses, rel=1e-12)
    assert all(torch.allclose(wide_sd[k], one_sd[k], rtol=1e-10, atol=1e-12) for k in one_sd)


def test_a_2bw_step_keeps_no_view_of_the_callers_batch():
    # batch t's last backwards run in step t+1: a loop that refills one batch buffer in place
    # (here behind autograd's back, through numpy) must train as fresh batches do
    import numpy as np

    nn = torch.nn
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4)).double()
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(8, 8, generator=g, dtype=torch.float64), torch.randint(0, 4, (8,), generator=g))
               for _ in range(4)]

    def train(refill: bool):
        pipe = fxpipe.compile(net, (batches[0][0][:2],), loss_fn=torch.nn.functional.cross_entropy, microbatches=4,
                              stages=2, schedule="2bw", verbose=False, optimizer=functools.partial(torch.optim.SGD, lr=0.1))
        xs, ys = np.empty((8, 8)), np.empty(8, dtype=np.int64)
        losses = []
        for x, y in batches:
            if refill:
                xs[:], ys[:] = x.numpy(), y.numpy()
                x, y = torch.from_numpy(xs), torch.from_numpy(ys)
            losses.append(float(pipe.step(x, y)))
        return losses, pipe.state_dict()

    (fresh_losses, fresh), (refilled_losses, refilled) = train(False), train(True)
    assert refilled_losses == fresh_losses
    assert all(torch.equal(fresh[k], refilled[k]) for k in fresh)


def test_eval_step_reads_each_replicas_own_batchnorm_statistics():
    # In one process the replicas of a stage share one eval module: each must evaluate its part
    # of the batch with its own statistics, as its own rank would (before, every replica read the
    # last replica's). The expected loss: each replica's micro-batches through the plain model
    # holding the newest weights and that replica's buffers.
    import copy

    nn = torch.nn

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.l1, self.bn, self.l2, self.bn2, self.l3 = (nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Linear(16, 16),
                                                             nn.BatchNorm1d(16), nn.Linear(16, 4))

        def forward(self, x):
            return self.l3(torch.relu(self.bn2(self.l2(torch.relu(self.bn(self.l1(x)))))))

    torch.manual_seed(0)
    net = Net().double()
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(16, 8, generator=g, dtype=torch.float64), torch.randint(0, 4, (16,), generator=g))
               for _ in range(3)]
    example, m, w = (batches[0][0][:2],), 4, 2
    plan = fxpipe.plan(net, example, stages=2, microbatches=m, schedule="1f1b", world_size=4, clip=True)
    pipe = fxpipe.compile(net, example, loss_fn=torch.nn.functional.cross_entropy, plan=plan, schedule="1f1b",
                          microbatches=m, verbose=False, optimizer=functools.partial(torch.optim.SGD, lr=0.1))
    for b in batches:
        pipe.step(*b)
    weights = pipe.state_dict()
    x, y = batches[0]
    xs, ys = x.chunk(m * w), y.chunk(m * w)
    expected = 0.0
    for r in range(w):
        own = dict(weights)
        for wk in pipe.workers.values():
            if wk.replica == r:
                own.update({k: b for n, b in wk.buffers.items() for k in pipe.staged.originals[n]})
        ref = copy.deepcopy(net)
        ref.load_state_dict(own)
        ref.eval()
        with torch.no_grad():
            expected += sum(float(torch.nn.functional.cross_entropy(ref(xs[j]), ys[j])) for j in range(r * m, (r + 1) * m))
    assert any(not torch.equal(a.buffers[n], b.buffers[n]) for a in pipe.workers.values() for b in pipe.workers.values()
               if a.index == b.index and a.replica != b.replica for n in a.buffers)  # the replicas' statistics differ
    assert pipe.eval_step(x, y) == pytest.approx(expected / (m * w), rel=1e-12)


def test_a_recorded_action_is_drawn_from_the_end_of_its_wait():
    # the time an action spent blocked (a receive whose sender had not sent yet) is the rank's
    # idle time: the recorded block starts when the wait ended, so the picture hatches it
    import time

    from fxpipe.runtime import StageWorker

    nn = torch.nn
    torch.manual_seed(0)
    pipe = fxpipe.compile(nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8)), (torch.randn(2, 8),),
                          loss_fn=torch.nn.functional.mse_loss, microbatches=2, stages=2, schedule="1f1b",
                          verbose=False)
    real = StageWorker.run

    def blocked_forward(self, a):  # as if F waited 50 ms for its activation
        if a.kind.value == "F" and self.index == 1:
            time.sleep(0.05)
            self.comm.waited += 0.05
        return real(self, a)

    pipe.record = True
    StageWorker.run = blocked_forward
    try:
        started = time.perf_counter() - pipe._t0
        pipe.step(torch.randn(4, 8), torch.randn(4, 8))
    finally:
        StageWorker.run = real
    forwards = [(s, e) for r, a, s, e in pipe.recorded_timeline() if a.startswith("1F")]
    assert len(forwards) == 2 and all(e - s < 0.04 for s, e in forwards) and forwards[0][0] - started >= 0.05


_SCRIPT = '''
import torch

def sgd(lr, momentum=0.0):
    return lambda params: torch.optim.SGD(params, lr=lr, momentum=momentum)

def walk(n):
    return walk(n - 1) if n else 0

def scaled(out, y, scale=2.0):
    return torch.nn.functional.mse_loss(out, y) * scale

one = lambda params: torch.optim.SGD(params, lr=0.1)
other = lambda params: torch.optim.SGD(params, lr=0.2)
'''


def _script():
    """The functions of ``_SCRIPT`` as one process running it as ``__main__`` defines them."""
    names = {"__name__": "__main__"}
    exec(compile(_SCRIPT, "train.py", "exec"), names)
    return names


def test_the_settings_ranks_compare_tell_functions_apart_by_code_defaults_and_captures():
    # compile compares these across ranks (PipelineConfig.agreed_settings). Functions were
    # compared by name alone: a closure capturing another learning rate on one rank, a lambda
    # with another constant, a loss module with another reduction all passed.
    from fxpipe.pipeline import PipelineConfig

    def settings(optimizer=functools.partial(torch.optim.SGD, lr=0.1), loss_fn=None):
        return PipelineConfig(optimizer=optimizer, loss_fn=loss_fn).agreed_settings()

    a, b = _script(), _script()  # two processes running one script
    assert settings(a["sgd"](0.1)) == settings(b["sgd"](0.1))
    assert settings(a["one"]) == settings(b["one"])
    assert settings(loss_fn=a["scaled"]) == settings(loss_fn=b["scaled"])
    assert settings(loss_fn=a["walk"]) == settings(loss_fn=b["walk"])
    ce = torch.nn.CrossEntropyLoss
    assert settings(loss_fn=ce(label_smoothing=0.1)) == settings(loss_fn=ce(label_smoothing=0.1))
    assert settings(loss_fn=ce(label_smoothing=0.1)) != settings(loss_fn=ce())
    opt = settings(a["sgd"](0.1))["optimizer"]
    assert opt.startswith("__main__.sgd.<locals>.<lambda>[code ") and opt.endswith(
        "captures lr=0.1, momentum=0.0]")
    assert settings(a["sgd"](0.1)) != settings(b["sgd"](0.2))
    assert settings(a["sgd"](0.1)) != settings(b["sgd"](0.1, momentum=0.9))
    assert settings(a["one"])["optimizer"].split("[")[0] == settings(a["other"])["optimizer"].split("[")[0]
    assert settings(a["one"]) != settings(a["other"])  # same name, another constant
    b["scaled"].__defaults__ = (3.0,)
    assert settings(loss_fn=a["scaled"]) != settings(loss_fn=b["scaled"])
    assert settings(loss_fn=ce(label_smoothing=0.1))["loss_fn"] == (
        "a torch.nn.modules.loss.CrossEntropyLoss(ignore_index=-100, label_smoothing=0.1, reduction='mean')")


@pytest.mark.parametrize("schedule", ["1f1b", "2bw", "zb", "gpipe"])
def test_grad_norm_is_the_whole_batchs_before_clipping(schedule, tmp_path):
    case = dataclasses.replace(CASES["gpt2_2bw"], schedule=schedule, optimizer="adamw")  # tied weights
    model, example, batches, loss_fn, opt = build(case)
    ref = copy.deepcopy(model).double()
    (x, y), second = batches[0], batches[1]
    out = ref(**x) if isinstance(x, dict) else ref(x)
    (out.loss if loss_fn is None else loss_fn(out, y)).backward()
    expected = float(torch.nn.utils.clip_grad_norm_(ref.parameters(), float("inf")))  # a tied weight once
    # clipped to a quarter: a norm read after clipping would not pass
    pipe, _ = _compile(dataclasses.replace(case, max_grad_norm=expected / 4))
    assert pipe.grad_norm is None
    pipe.step(x, y)
    pipe.flush()
    step, norm = pipe.grad_norm
    assert step == 1 and norm == pytest.approx(expected, rel=1e-5)
    pipe.step(*second)
    # a step's norm is reduced in the next step's segment (the flush schedules at its start: step
    # returns after the last backward), or by a flush
    assert pipe.grad_norm[0] == 1
    pipe.flush()
    assert pipe.grad_norm[0] == 2
    if schedule == "1f1b":
        pipe.save(str(tmp_path))
        pipe.load(str(tmp_path))
        assert pipe.grad_norm is None  # nothing of the steps before a load is kept


def test_adama_has_no_grad_norm():
    case = dataclasses.replace(CASES["1f1b_sgd"], optimizer="adamw")
    pipe, batches = _compile(case, accumulate="optimizer")
    pipe.step(*batches[0])
    pipe.flush()
    assert pipe.grad_norm is None
