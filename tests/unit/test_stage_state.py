"""What a stage writes in place (buffers a forward updates, boundary inputs written through a
view) and what it leaves alone (a parameter its backward never reaches). Each model trains in float64 as the eager references do (tests/reference.py), at cuts
chosen where the problem shows: a buffer that leaves its stage, a buffer autograd saved, an
in-place write into a view of a received activation."""

import copy
import dataclasses
import functools

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fxpipe
from tests.reference import train_2bw, train_flush

M = 4
SGD = functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9)


def _batches(n_in: int, steps: int = 4):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(M * 2, n_in, generator=g, dtype=torch.float64), torch.randint(0, 4, (M * 2,), generator=g))
            for _ in range(steps)]


def _check(model, batches, schedule: str, first_of_stage: list[str], recompute: bool = False, optimizer=SGD,
           kernels: str = "off"):
    """Train ``model`` with stage i+1 starting at node ``first_of_stage[i]``, against the reference."""
    example = (batches[0][0][:2],)
    plan = fxpipe.plan(model, example, stages=len(first_of_stage) + 1, microbatches=M, schedule=schedule,
                       recompute=recompute)
    stage, pairs = 0, []
    for name, _ in plan.assignment_pairs:
        stage = first_of_stage.index(name) + 1 if name in first_of_stage else stage
        pairs.append((name, stage))
    plan = dataclasses.replace(plan, assignment_pairs=tuple(pairs), recompute=(recompute,) * plan.stages)
    pipe = fxpipe.compile(copy.deepcopy(model), example, loss_fn=F.cross_entropy, optimizer=optimizer, microbatches=M,
                          schedule=schedule, plan=plan, kernels=kernels, verbose=False)
    assert [s.nodes[0] for s in pipe.staged.stages[1:]] == first_of_stage
    losses = [pipe.step(*b) for b in batches]
    pipe.flush()
    ref_losses, ref = (train_2bw if schedule == "2bw" else train_flush)(model, batches, M, F.cross_entropy, optimizer)
    assert losses == pytest.approx(ref_losses, rel=1e-12)
    got, want = pipe.state_dict(), ref.state_dict()
    assert all(torch.allclose(got[k], want[k], rtol=1e-10, atol=1e-12) for k in want)


class RunningMean(nn.Module):
    """A running mean of the hidden state, updated in place every forward and read by a later
    stage: the stage's output is the buffer itself."""

    def __init__(self):
        super().__init__()
        self.l1, self.l2, self.l3, self.l4 = nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 4)
        self.register_buffer("ema", torch.zeros(16))

    def forward(self, x):
        h = torch.relu(self.l1(x))
        with torch.no_grad():
            self.ema.mul_(0.9).add_(0.1 * h.mean(0))
        h = torch.relu(self.l3(torch.relu(self.l2(h))))
        return self.l4(h + self.ema)


@pytest.mark.parametrize("schedule", ["1f1b", "2bw", "zb"])
@pytest.mark.parametrize("recompute", [False, True])
def test_a_buffer_sent_to_the_next_stage_keeps_its_micro_batchs_value(schedule, recompute):
    # sent by reference, the next forward's update reached it before the receive copied it
    torch.manual_seed(0)
    _check(RunningMean().double(), _batches(8), schedule, ["linear_1"], recompute)


class RunningScale(nn.Module):
    """Divides by a running RMS updated in place in the same forward: autograd saves the buffer."""

    def __init__(self):
        super().__init__()
        self.ls = nn.ModuleList([nn.Linear(16, 16) for _ in range(4)])
        for i in range(4):
            self.register_buffer(f"rms{i}", torch.ones(16))
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        for i, layer in enumerate(self.ls):
            h, rms = layer(x), getattr(self, f"rms{i}")
            with torch.no_grad():
                rms.mul_(0.9).add_(0.1 * h.pow(2).mean(0).sqrt())
            x = torch.tanh(h / rms)
        return self.head(x)


@pytest.mark.parametrize("schedule", ["1f1b", "zb"])
def test_a_buffer_autograd_saved_is_not_overwritten_by_the_next_forward(schedule):
    # the next micro-batch's forward updated it in place before this one's backward read it
    torch.manual_seed(0)
    _check(RunningScale().double(), _batches(16), schedule, ["linear_2"])


class ViewWrite(nn.Module):
    def __init__(self):
        super().__init__()
        self.ls = nn.ModuleList([nn.Linear(16, 16) for _ in range(3)])
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        for layer in self.ls:
            h = layer(x)
            h[:, :8] += 1.0  # in place through a view: slice, then copy_
            x = torch.relu(h)
        return self.head(x)


def test_a_received_activation_written_through_a_view_is_copied_first():
    # the cut lies between a linear and the slice of its output that is written in place
    torch.manual_seed(0)
    model = ViewWrite().double()
    gm = fxpipe.trace(model, (torch.zeros(2, 16, dtype=torch.float64),))
    first_slice = next(n.name for n in gm.graph.nodes if n.name.startswith("slice"))
    _check(model, _batches(16), "1f1b", [first_slice])


class Gate(nn.Module):
    """``gate`` is trainable but only compared against: eager leaves its ``.grad`` None."""

    def __init__(self):
        super().__init__()
        self.l1, self.l2, self.l3 = nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 4)
        self.gate = nn.Parameter(torch.full((16,), 0.1))

    def forward(self, x):
        h = torch.relu(self.l1(x))
        h = h * (h > self.gate).to(h.dtype)
        return self.l3(torch.relu(self.l2(h)))


@pytest.mark.parametrize("schedule,kernels", [("1f1b", "off"), ("2bw", "off"), ("2bw", "torch"), ("zb", "torch")])
@pytest.mark.parametrize("optimizer", [functools.partial(torch.optim.AdamW, lr=1e-2, weight_decay=0.1),
                                       functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9, weight_decay=0.1)],
                         ids=["adamw", "sgd"])
def test_a_parameter_the_backward_never_reaches_is_not_stepped(schedule, kernels, optimizer):
    # with a zero gradient, weight decay and momentum moved it
    torch.manual_seed(0)
    model = Gate().double()
    _check(model, _batches(8), schedule, ["linear_1"], optimizer=optimizer, kernels=kernels)


class LateViewWrite(nn.Module):
    """Writes in place through a view of ``h`` made early, late in the graph, and then reads ``h``:
    a cut between the view and the write would send view and base as two tensors."""

    def __init__(self):
        super().__init__()
        self.l0, self.out = nn.Linear(16, 16), nn.Linear(24, 4)
        self.ls = nn.ModuleList([nn.Linear(16, 16) for _ in range(6)])

    def forward(self, x):
        h = self.l0(x)
        v = h[:, :8]
        a, z = torch.relu(h).chunk(2, -1)
        for layer in self.ls:
            z = torch.tanh(layer(torch.cat([z, z], -1)[:, :16]))
        v.mul_(torch.sigmoid(z[:, :8]))
        return self.out(torch.cat([h, a], -1))


@pytest.mark.parametrize("stages", [2, 3])
def test_the_planner_keeps_a_view_on_the_stage_that_writes_through_it(stages):
    torch.manual_seed(0)
    model = LateViewWrite().double()
    batches = _batches(16, steps=2)
    example = (batches[0][0][:2],)
    pipe = fxpipe.compile(copy.deepcopy(model), example, loss_fn=F.cross_entropy, optimizer=SGD, microbatches=M,
                          schedule="1f1b", stages=stages, verbose=False)
    writer = next(s for s in pipe.staged.stages if any(n.startswith("mul_") for n in s.nodes))
    assert any(n.startswith("slice") for n in writer.nodes)  # the view is made where it is written
    losses = [pipe.step(*b) for b in batches]
    ref_losses, ref = train_flush(model, batches, M, F.cross_entropy, SGD)
    assert losses == pytest.approx(ref_losses, rel=1e-12)
    got, want = pipe.state_dict(), ref.state_dict()
    assert all(torch.allclose(got[k], want[k], rtol=1e-10, atol=1e-12) for k in want)
