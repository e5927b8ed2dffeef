"""What one rank finds, every rank acts on (gloo ranks): a load right after a save reads the
checkpoint just written on every rank; a checkpoint one stage cannot take, and an eval pass one
stage cannot run, are refused on every rank at once, not by one rank while the others wait."""

from __future__ import annotations

import re

import pytest

from tests.dist.harness import run_function

pytestmark = [pytest.mark.dist, pytest.mark.timeout(180)]


def save_then_load(rank: int, world: int):
    import tempfile
    import time

    import torch
    import torch.distributed as dist
    import torch.nn as nn
    import torch.nn.functional as F

    import fxpipe
    from fxpipe import checkpoint
    from fxpipe.errors import CheckpointError

    box = [tempfile.mkdtemp() if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    root = box[0]
    point = checkpoint._point_latest

    def late(*args):  # rank 0 points `latest` at a checkpoint once it is whole: here a second later
        time.sleep(1.0)
        point(*args)

    checkpoint._point_latest = late
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    pipe = fxpipe.compile(model, (torch.randn(2, 8),), loss_fn=F.mse_loss, microbatches=2, schedule="1f1b",
                          stages=world, verbose=False, timeout=60)
    x, y = torch.randn(4, 8), torch.randn(4, 1)
    pipe.step(x, y)
    pipe.save(root, extra={"after": 1})
    pipe.wait_for_checkpoint()
    dist.barrier()  # every rank's `latest` reads step 1 now
    pipe.step(x, y)
    pipe.save(root, extra={"after": 2})
    extra = pipe.load(root)  # rank 0 is still to point `latest` at step 2 when the others get here
    got = [extra["after"], pipe.steps]
    missing = f"{root}/nowhere"
    try:
        pipe.load(missing)
    except CheckpointError as e:
        got.append(str(e))
    # another model whose last layer (the last stage's) has another shape: only that rank's
    # check found it, and it raised alone while the others waited in the load's collectives
    wider = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    other = fxpipe.compile(wider, (torch.randn(2, 8),), loss_fn=F.mse_loss, microbatches=2, schedule="1f1b",
                           stages=world, verbose=False, timeout=60)
    other.step(x, torch.randn(4, 2))
    start = time.monotonic()
    try:
        other.load(root)
    except CheckpointError as e:
        got.append((str(e), time.monotonic() - start))
    dist.barrier()
    return got


def test_a_load_right_after_a_save_reads_the_new_checkpoint_on_every_rank():
    # Rank 0 points `latest` at a checkpoint once all of it is written; another rank's wait for
    # its own part returned before that, and its load read the checkpoint before (or none, and
    # raised while the others waited for it): ranks resumed from different steps, silently.
    results = run_function(2, "tests.dist.test_agreed_errors:save_then_load", timeout=150)
    assert [r["error"] for r in results] == [None, None], results
    (after0, steps0, err0, shape0), (after1, steps1, err1, shape1) = (r["value"] for r in results)
    assert (after0, steps0) == (after1, steps1) == (2, 2)
    assert err0.startswith("no checkpoint at") and err1.startswith("rank 0 found no checkpoint to load: no checkpoint at")
    assert shape0[0].startswith("rank 1 cannot load this checkpoint, so no rank does: load: ") and shape0[1] < 10
    assert "2 tensors of another shape or dtype" in shape1[0] and shape1[0].startswith("load: ")


def save_apart(rank: int, world: int):
    import tempfile

    import torch
    import torch.distributed as dist
    import torch.nn as nn
    import torch.nn.functional as F

    import fxpipe

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    pipe = fxpipe.compile(model, (torch.randn(2, 8),), loss_fn=F.mse_loss, microbatches=2, schedule="1f1b",
                          stages=world, verbose=False, timeout=60)
    pipe.step(torch.randn(4, 8), torch.randn(4, 1))
    try:
        pipe.save(tempfile.mkdtemp())  # a directory of each rank's own: no loadable checkpoint
        got = None
    except fxpipe.FxpipeError as e:
        got = str(e)
    pipe.step(torch.randn(4, 8), torch.randn(4, 1))  # nothing was posted: the ranks are still in step
    dist.barrier()
    return got


def test_ranks_that_save_into_different_directories_are_refused_on_every_rank():
    results = run_function(2, "tests.dist.test_agreed_errors:save_apart", timeout=150)
    assert [r["error"] for r in results] == [None, None], results
    msg0, msg1 = (r["value"] for r in results)
    assert msg0 == msg1 and msg0.startswith("save: the ranks save into different directories ('/"), msg0
    assert "on rank 0 and '/" in msg0 and "on rank 1); each writes its part of ONE checkpoint" in msg0


def build_fails_on_one_rank(rank: int, world: int):
    import time

    import torch
    import torch.distributed as dist
    import torch.nn as nn
    import torch.nn.functional as F

    import fxpipe
    from fxpipe import codegen

    split = codegen.split

    def failing(*args, **kwargs):  # rank 1 cannot fill its stage (a full disk, a torn file)
        if rank == 1:
            raise OSError("no space left on device")
        return split(*args, **kwargs)

    codegen.split = failing
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    start = time.monotonic()
    try:
        fxpipe.compile(model, (torch.randn(2, 8),), loss_fn=F.mse_loss, microbatches=2, schedule="1f1b", stages=world,
                       verbose=False, timeout=60, weights=model.state_dict())
        got = None
    except Exception as e:  # noqa: BLE001
        got = (type(e).__name__, str(e), time.monotonic() - start)
    dist.barrier()
    return got


def test_a_stage_one_rank_cannot_build_stops_every_rank_with_its_reason():
    results = run_function(2, "tests.dist.test_agreed_errors:build_fails_on_one_rank", timeout=150)
    assert [r["error"] for r in results] == [None, None], results
    (kind0, msg0, took0), (kind1, msg1, _) = (r["value"] for r in results)
    assert (kind1, msg1) == ("OSError", "no space left on device")  # its own exception, as raised
    assert kind0 == "FxpipeError" and took0 < 30, (kind0, took0)
    assert msg0 == "rank 1 could not build its stage, so no rank goes on: OSError: no space left on device"


def set_up_fails_on_one_rank(rank: int, world: int):
    import time

    import torch
    import torch.distributed as dist
    import torch.nn as nn
    import torch.nn.functional as F

    import fxpipe

    def by_name(named):  # "0.weight" is on stage 0: the factory raises on stage 1 alone
        return torch.optim.SGD([dict(named)["0.weight"]], lr=0.1)

    got = []
    for kwargs in (dict(optimizer=by_name), dict(example=torch.randn(2 if rank == 0 else 1, 8))):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
        example = kwargs.pop("example", torch.randn(2, 8))
        # a plan made for micro-batches of 2: rank 1's example of 1 does not fit it
        plan = fxpipe.plan(model, (torch.randn(2, 8),), stages=world, microbatches=2, schedule="1f1b")
        start = time.monotonic()
        try:
            fxpipe.compile(model, (example,), loss_fn=F.mse_loss, microbatches=2, schedule="1f1b", plan=plan,
                           verbose=False, timeout=60, **kwargs)
            got.append(None)
        except Exception as e:  # noqa: BLE001
            got.append((type(e).__name__, str(e), time.monotonic() - start))
    dist.barrier()
    return got


def test_a_stage_one_rank_cannot_set_up_stops_every_rank_with_its_reason():
    results = run_function(2, "tests.dist.test_agreed_errors:set_up_fails_on_one_rank", timeout=150)
    assert [r["error"] for r in results] == [None, None], results
    (factory0, example0), (factory1, example1) = (r["value"] for r in results)
    assert factory1[0] == "ConfigError" and "the optimizer factory raised KeyError: '0.weight'" in factory1[1]
    assert factory0[0] == "ConfigError" and factory0[2] < 30  # rank 1's class: `except ConfigError` holds on both
    assert factory0[1] == f"rank 1 could not set up its stage, so no rank goes on: ConfigError: {factory1[1]}"
    assert example1[0] == "ConfigError" and "but the example micro-batch has 1" in example1[1]
    assert example0[0] == "ConfigError" and example0[2] < 30
    assert example0[1] == f"rank 1 cannot run the plan, so no rank does: ConfigError: {example1[1]}"


def settings_differ(rank: int, world: int):
    import functools

    import torch
    import torch.distributed as dist
    import torch.nn as nn
    import torch.nn.functional as F

    import fxpipe

    got = []
    # alike on both ranks, though each process orders a set of strings by its own hash seed
    # (compile's tuple of it came out ('0', '2') on one rank and ('2', '0') on the other)
    # and the ranks exchange digests of the settings, not their texts: a loss that captures a long
    # list of class weights (its text 100 kB) is not sent to every rank
    weights = [0.5] * 20_000

    def weighted(out, target):
        return (torch.tensor(weights[:1]) * (out - target) ** 2).mean()

    sent = []
    gather = dist.all_gather_object

    def recording(out, obj, *args, **kwargs):
        sent.append(len(repr(obj)))
        return gather(out, obj, *args, **kwargs)

    dist.all_gather_object = recording
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    fxpipe.compile(model, (torch.randn(2, 8),), loss_fn=weighted, stages=world, verbose=False, timeout=60,
                   leaf_modules={"0", "2"})
    dist.all_gather_object = gather
    got.append(max(sent))

    def sgd(lr):
        return lambda params: torch.optim.SGD(params, lr=lr)

    # (every rank's, rank 1's own): bf16 on rank 1 (its messages half the size: gloo aborted the
    # process mid-step), a clipping norm or a learning-rate schedule (its stage trained otherwise,
    # silently), another schedule or m (rank 0's plan ran instead), a closure capturing another
    # learning rate or a loss module with another reduction (both compared by name alone before)
    for every, mine in (({}, dict(precision="bf16")), ({}, dict(max_grad_norm=0.01)),
                        ({}, dict(lr_scheduler=functools.partial(torch.optim.lr_scheduler.StepLR, step_size=1))),
                        ({}, dict(schedule="1f1b", microbatches=2)),
                        (dict(optimizer=sgd(0.1)), dict(optimizer=sgd(0.2))),
                        (dict(loss_fn=nn.MSELoss()), dict(loss_fn=nn.MSELoss(reduction="sum")))):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
        kwargs = {"loss_fn": F.mse_loss, "optimizer": functools.partial(torch.optim.SGD, lr=0.1), **every,
                  **(mine if rank == 1 else {})}
        try:
            fxpipe.compile(model, (torch.randn(2, 8),), stages=world, verbose=False, timeout=60, **kwargs)
            got.append(None)
        except Exception as e:  # noqa: BLE001
            got.append((type(e).__name__, str(e)))
    dist.barrier()
    return got


def test_settings_given_differently_on_one_rank_stop_every_rank_at_compile():
    results = run_function(2, "tests.dist.test_agreed_errors:settings_differ", timeout=150)
    assert [r["error"] for r in results] == [None, None], results
    mine, theirs = (r["value"] for r in results)
    assert mine == theirs  # the same error on every rank
    largest, *mine = mine
    assert largest < 5_000  # the loss's text alone is 100 kB: the settings went as digests
    kinds, messages = zip(*mine)
    assert set(kinds) == {"ConfigError"}
    start = "fxpipe.compile: every rank must be given the same settings (each runs its stage(s) of one plan), found "
    assert all(m.startswith(start) and m.endswith("Pass the same arguments on every rank (under torchrun, the same "
                                                  "script and command line)") for m in messages)
    assert "found precision is 'fp32' on rank(s) [0] but 'bf16' on rank(s) [1]." in messages[0]
    assert "found max_grad_norm is None on rank(s) [0] but 0.01 on rank(s) [1]." in messages[1]
    assert ("found lr_scheduler is None on rank(s) [0] but partial(torch.optim.lr_scheduler.StepLR, step_size=1) on "
            "rank(s) [1].") in messages[2]
    assert ("found schedule is '2bw' on rank(s) [0] but '1f1b' on rank(s) [1]; microbatches is None on rank(s) [0] "
            "but 2 on rank(s) [1].") in messages[3]
    closure = re.escape("tests.dist.test_agreed_errors.settings_differ.<locals>.sgd.<locals>.<lambda>[code ") + "[0-9a-f]{8}; "
    assert re.search(f"found optimizer is {closure}{re.escape('captures lr=0.1, torch=module torch] on rank(s) [0] but ')}{closure}"
                     f"{re.escape('captures lr=0.2, torch=module torch] on rank(s) [1].')}", messages[4]), messages[4]
    assert ("found loss_fn is a torch.nn.modules.loss.MSELoss(reduction='mean') on rank(s) [0] but a "
            "torch.nn.modules.loss.MSELoss(reduction='sum') on rank(s) [1].") in messages[5]


class EvalReadsMore:
    """Built in the ranks: in eval mode the last layer's output also reads ``l1.bias``, which
    the first stage holds in training."""

    @staticmethod
    def make():
        import torch.nn as nn

        class Net(nn.Module):
            def __init__(self):
                super().__init__()
                self.l1, self.l2, self.l3 = nn.Linear(16, 32), nn.Linear(32, 32), nn.Linear(32, 8)

            def forward(self, x):
                h = self.l3(self.l2(self.l1(x).relu()).relu())
                return h + self.l1.bias[:8] if not self.training else h

        return Net()


def eval_reads_more(rank: int, world: int):
    import time

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    import fxpipe

    torch.manual_seed(0)
    pipe = fxpipe.compile(EvalReadsMore.make(), (torch.randn(2, 16),), loss_fn=F.mse_loss, microbatches=2,
                          schedule="1f1b", stages=world, verbose=False, timeout=60)
    x, y = torch.randn(4, 16), torch.randn(4, 8)
    pipe.record = rank == 0  # on one rank only: dump gathered there alone, and waited
    pipe.step(x, y)
    import tempfile

    dumped = pipe.dump(tempfile.mkdtemp())
    start = time.monotonic()
    try:
        pipe.eval_step(x, y)
        got = None
    except fxpipe.FxpipeError as e:
        got = (str(e), time.monotonic() - start)
    pipe.step(x, y)  # the ranks are still in step
    dist.barrier()
    return got, len(dumped)


def test_an_eval_pass_one_stage_cannot_run_is_refused_on_every_rank():
    # Only stage 1's eval module reads l1.bias; rank 1 raised, rank 0 sent its eval activations
    # and waited until rank 1's process went away. And dump() with pipe.record set on one rank.
    results = run_function(2, "tests.dist.test_agreed_errors:eval_reads_more", timeout=150)
    assert [r["error"] for r in results] == [None, None], results
    ((msg0, took0), dumped0), ((msg1, _), dumped1) = (r["value"] for r in results)
    assert dumped0 > 0 and dumped1 == 0  # rank 0 wrote the dumps, with rank 0's recorded timeline
    assert msg1.startswith("eval stage 1 reads parameters ['l1.bias'] that training stage 1 does not hold")
    assert msg0 == f"rank 1: {msg1}" and took0 < 10


def lazy_too_few_microbatches(rank: int, world: int):
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    import fxpipe

    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    pipe = fxpipe.compile(model, loss_fn=F.mse_loss, microbatches=1, schedule="2bw", verbose=False, timeout=60)
    try:  # stages=None: one stage per rank, known at the first step
        pipe.step(torch.randn(4, 8), torch.randn(4, 1))
    except Exception as e:
        return f"{type(e).__name__}: {e}"


def test_a_lazy_pipeline_deeper_than_its_micro_batches_says_where_its_depth_came_from():
    for r, res in enumerate(run_function(2, "tests.dist.test_agreed_errors:lazy_too_few_microbatches", timeout=120)):
        assert res["error"] is None, res["error"]
        assert res["value"] == (
            "ConfigError: fxpipe.compile: microbatches=1 is fewer than the 2 stages a lazily compiled pipeline runs on "
            "2 ranks (stages=None: one stage per rank), and schedule='2bw' needs at least one micro-batch per stage. "
            "Pass microbatches >= 2, or stages= with a data-parallel width (world = stages x width), or "
            "schedule='1f1b' or 'zb', which take fewer"), (r, res["value"])


def models_built_apart(rank: int, world: int):
    """Each rank builds its model from a seed of its own (a script that forgot to seed)."""
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    import fxpipe

    class Tied(nn.Module):  # the output layer reads the embedding's weight, as GPT-2's does
        def __init__(self):
            super().__init__()
            self.emb, self.mid = nn.Embedding(32, 16), nn.Linear(16, 16)
            self.out = nn.Linear(16, 32, bias=False)
            self.out.weight = self.emb.weight

        def forward(self, ids):
            return self.out(torch.relu(self.mid(self.emb(ids))))

    class Grown(nn.Module):  # alike but for rows added at the end (resize_token_embeddings, unseeded)
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.emb = nn.Embedding(1000, 16)
            torch.manual_seed(rank)
            with torch.no_grad():
                self.emb.weight[-3:].normal_()

        def forward(self, ids):
            return self.emb(ids).sum(-1)

    def lm_loss(out, ids):
        return F.cross_entropy(out.flatten(0, 1), ids.flatten())

    def attempt(seed: int, make, batch, loss_fn, stages: int, load=None):
        torch.manual_seed(seed)
        try:
            b = len(batch[0]) // (2 * (world // stages))  # 8 samples a step: m = 2, w = world / stages
            pipe = fxpipe.compile(make(), (batch[0][:b],), loss_fn=loss_fn, microbatches=2,
                                  schedule="1f1b", stages=stages, verbose=False, timeout=60)
            if load is not None:
                pipe.load_state_dict(load)
            pipe.step(*batch)
        except Exception as e:
            return f"{type(e).__name__}: {e}"
        return pipe.plan.width, pipe.plan.stages

    mlp = lambda: nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))  # noqa: E731
    torch.manual_seed(100)
    dense, ids, sums = (torch.randn(8, 8), torch.randn(8, 1)), torch.randint(0, 32, (8, 6)), torch.randn(8, 6)
    torch.manual_seed(0)
    alike = mlp().state_dict()
    return {
        "replicas apart": attempt(rank, mlp, dense, F.mse_loss, stages=1),
        "replicas alike": attempt(0, mlp, dense, F.mse_loss, stages=1),
        "replicas loaded alike": attempt(rank, mlp, dense, F.mse_loss, stages=1, load=alike),
        "tied apart": attempt(rank, Tied, (ids, ids), lm_loss, stages=2),
        "stages apart": attempt(rank, mlp, dense, F.mse_loss, stages=2),  # no copies to differ
        "rows apart": attempt(0, Grown, (ids, sums), F.mse_loss, stages=1),
    }


def test_replicas_and_tied_copies_built_from_different_weights_are_refused_on_every_rank():
    results = run_function(2, "tests.dist.test_agreed_errors:models_built_apart", timeout=120)
    assert [r["error"] for r in results] == [None, None], results
    for r, got in enumerate(r["value"] for r in results):
        assert got["replicas alike"] == got["replicas loaded alike"] == (2, 1), (r, got)
        assert got["stages apart"] == (1, 2), (r, got)
        assert re.fullmatch(
            r"ConfigError: fxpipe: at the first step, the ranks' copies of parameters that several ranks hold \(a "
            r"stage's data-parallel replicas, or a tied weight's copy on each stage reading it\) differ: 0\.bias "
            r"\(rank\(s\) \[0\] against \[1\]\), 0\.weight \(rank\(s\) \[0\] against \[1\]\), 2\.bias \(rank\(s\) "
            r"\[0\] against \[1\]\) and 1 more\. Those copies must start equal, or they train apart\. Build the model "
            r"alike on every rank: call torch\.manual_seed\(\.\.\.\) before constructing it, load the same weights on "
            r"every rank \(from_pretrained, load_state_dict, pipe\.load\), or pass weights= to fxpipe\.compile",
            got["replicas apart"]), (r, got["replicas apart"])
        for case, key in (("tied apart", "emb\\.weight"), ("rows apart", "emb\\.weight")):
            assert re.fullmatch(rf"ConfigError: fxpipe: at the first step, the ranks' copies .* differ: {key} "
                                rf"\(rank\(s\) \[0\] against \[1\]\)\. Those copies must start equal.*", got[case]), \
                (r, case, got[case])
