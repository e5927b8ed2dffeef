"""Every real post, recorded under gloo, obeys NCCL's rules (docs/design.md, "The NCCL contract").

gloo matches point-to-point messages per direction and tag and runs collectives on their own
threads, so a green gloo run proves nothing about NCCL. Here each rank records every
``torch.distributed`` call fxpipe makes -- ``isend``/``irecv`` and every collective -- across
``step, step, flush, step, eval_step, state_dict``, and the parent checks on the recordings:

(a) the n-th operation rank a posts towards rank b is the counterpart (send vs receive, same
    size and dtype) of the n-th operation b posts towards a;
(b) all ranks' posts fit one global order: the graph whose nodes are matched operations (a p2p
    pair, or one collective across its members) and whose edges are each rank's post order has
    no cycle.
"""

from __future__ import annotations

import functools
from collections import defaultdict

import pytest
import torch
import torch.distributed as dist

from tests.dist.harness import run_function

pytestmark = [pytest.mark.dist, pytest.mark.timeout(600)]

# (model, schedule, stages, clip, recompute[, lookahead[, chunks]]); the width is world / (stages /
# chunks), and a step has stages + lookahead micro-batches (so 2bw's planner gives lookahead 0 where
# none is given). With chunks > 1 (interleaved 1F1B) a rank holds several stages, whose channels to
# the same peer share one queue
# "branch": a leaf module whose backward reaches data-dependent weights (the reached flags in
# each gradient message; with w = 2 the reached counts summed with the gradients)
CONFIGS = {
    2: [("gpt2", s, 2, True, r) for s in ("2bw", "1f1b", "gpipe", "zb") for r in (False, True)]
    + [("rms", "2bw", 2, False, False), ("branch", "2bw", 2, True, False)]
    + [("gpt2", "2bw", 2, True, False, 1), ("gpt2", "1f1b", 2, True, True, 1), ("rms", "2bw", 2, False, False, 2)]
    + [("gpt2", "1f1b", 4, True, False, 0, 2), ("gpt2", "1f1b", 6, True, True, 0, 3)],
    3: [("gpt2", s, 3, True, True) for s in ("2bw", "1f1b", "gpipe", "zb")] + [("rms", "2bw", 3, True, False)]
    + [("gpt2", "2bw", 3, True, True, 1), ("gpt2", "1f1b", 6, True, False, 0, 2)],
    4: [("gpt2", s, d, True, True) for s in ("2bw", "1f1b", "gpipe", "zb") for d in (2, 4)]
    + [("rms", "2bw", 2, True, False)]
    + [("branch", s, 2, True, False) for s in ("2bw", "1f1b", "zb")] + [("gpt2", "2bw", 2, True, True, 1)]
    + [("gpt2", "1f1b", 4, True, False, 0, 2), ("gpt2", "1f1b", 8, True, True, 0, 2)],
    6: [("gpt2", s, 3, True, True) for s in ("2bw", "1f1b", "gpipe", "zb")],
}

_COLLECTIVES = ("all_reduce", "all_gather", "all_gather_object", "broadcast", "broadcast_object_list", "barrier")


def _record_posts(log: list) -> None:
    """Wrap torch.distributed's entry points so each top-level call appends one record."""
    depth = [0]

    def wrap(name, fn):
        @functools.wraps(fn)
        def recorded(*args, **kwargs):
            if depth[0] == 0:
                if name in ("isend", "irecv"):
                    tensor, peer = args[0], args[1]
                    log.append((name, peer, tensor.numel(), str(tensor.dtype)))
                else:
                    group = kwargs.get("group") or dist.group.WORLD
                    # a group by its members and its name (every rank names its groups alike, in
                    # creation order): a checkpoint group and the default one of the same ranks differ
                    ranks = (*dist.get_process_group_ranks(group), group.group_name)
                    first = args[0] if args else None
                    size = first.numel() if isinstance(first, torch.Tensor) else None
                    log.append((name, ranks, size, str(first.dtype) if isinstance(first, torch.Tensor) else None))
            depth[0] += 1
            try:
                return fn(*args, **kwargs)
            finally:
                depth[0] -= 1

        return recorded

    for name in ("isend", "irecv") + _COLLECTIVES:
        setattr(dist, name, wrap(name, getattr(dist, name)))


def record(rank: int, world: int) -> list:
    """Run every configuration of this world size; return the posts of each."""
    import fxpipe
    from tests.cases import lm_loss
    from tests.models import BranchNet, TwoBranches, gpt2_tiny, rmsnorm_residual

    out = []
    for model_name, schedule, d, clip, recompute, *more in CONFIGS[world]:
        lookahead, chunks = (more + [0])[0], (more[1:] + [1])[0]
        w = world // (d // chunks)
        m = d + lookahead
        leaves = ()
        if model_name == "branch":  # the first half of the batch takes b.down, the second b.up: with w = 2
            # replica 0 reaches only b.down, replica 1 only b.up
            torch.manual_seed(0)
            model, leaves, loss_fn = BranchNet(), (TwoBranches,), torch.nn.functional.mse_loss
            with torch.no_grad():
                model.a.weight.copy_(torch.eye(8))
                model.a.bias.zero_()
            batch = torch.stack([torch.full((8,), 1.0 if 2 * k >= m * w else -1.0) for k in range(m * w)])
            target, example = torch.zeros(m * w, 1), (batch[:1],)
        elif model_name == "gpt2":
            model, example = gpt2_tiny(batch=1, seq=4, labels=True)
            ids = torch.randint(0, 100, (m * w, 4), generator=torch.Generator().manual_seed(0))
            batch, target, loss_fn = {"input_ids": ids, "labels": ids}, None, None
        else:
            model, example = rmsnorm_residual(batch=1)
            x = torch.randint(0, 50, (m * w, 8), generator=torch.Generator().manual_seed(0))
            batch, target, loss_fn = x, x, lm_loss
        pipe = fxpipe.compile(model, example, loss_fn=loss_fn, microbatches=m, schedule=schedule, stages=d,
                              max_grad_norm=1.0 if clip else None, recompute=recompute or None, verbose=False,
                              optimizer=functools.partial(torch.optim.SGD, lr=1e-3), leaf_modules=leaves,
                              lookahead=lookahead, chunks=chunks)
        assert pipe.plan.lookahead == lookahead and pipe.plan.chunks == chunks
        log: list = []
        saved = {name: getattr(dist, name) for name in ("isend", "irecv") + _COLLECTIVES}
        _record_posts(log)
        try:
            pipe.step(batch, target)
            pipe.step(batch, target)
            pipe.flush()
            pipe.step(batch, target)
            pipe.eval_step(batch, target)
            pipe.state_dict()
        finally:
            for name, fn in saved.items():
                setattr(dist, name, fn)
        out.append(((model_name, schedule, d, w, clip, recompute, lookahead, chunks), log))
        dist.barrier()
    return out


def check(world: int, per_rank: list[list]) -> list[str]:
    """Rules (a) and (b) on the recordings of every configuration, and (c): the members of a
    collective post it with the same size and dtype; returns the violations."""
    problems = []
    for i, (config, _) in enumerate(per_rank[0]):
        logs = {r: per_rank[r][i][1] for r in range(world)}
        # (a) per ordered pair, then the matched nodes of the global graph
        node_of: dict[tuple[int, int], tuple] = {}  # (rank, position) -> node
        for a in range(world):
            for b in range(a + 1, world):
                mine = [(p, op) for p, op in enumerate(logs[a]) if op[0] in ("isend", "irecv") and op[1] == b]
                theirs = [(p, op) for p, op in enumerate(logs[b]) if op[0] in ("isend", "irecv") and op[1] == a]
                if len(mine) != len(theirs):
                    problems.append(f"{config}: rank {a} posts {len(mine)} ops towards {b}, rank {b} {len(theirs)} back")
                for n, ((pa, x), (pb, y)) in enumerate(zip(mine, theirs)):
                    if {x[0], y[0]} != {"isend", "irecv"} or x[2:] != y[2:]:
                        problems.append(f"{config}: op {n} between ranks {a} and {b} is {x} on {a} but {y} on {b}")
                    node_of[a, pa] = node_of[b, pb] = ("p2p", a, b, n)
        seen: dict[tuple, int] = defaultdict(int)
        shapes: dict[tuple, set] = defaultdict(set)
        for r in range(world):
            for p, op in enumerate(logs[r]):
                if op[0] in _COLLECTIVES:
                    key = (op[0], op[1])
                    node_of[r, p] = ("coll", key, seen[r, key])
                    shapes[node_of[r, p]].add(op[2:])
                    seen[r, key] += 1
        # (c) a collective's members agree on what they reduce
        problems += [f"{config}: collective {node} is posted with different (size, dtype) {sorted(map(str, s))}"
                     for node, s in shapes.items() if len(s) > 1]
        # (b) one global order: Kahn's algorithm over program-order edges between nodes (a p2p
        # op without a counterpart, reported under (a), is a node of its own)
        edges: dict[tuple, set] = defaultdict(set)
        for r in range(world):
            for p in range(len(logs[r])):
                node_of.setdefault((r, p), ("unmatched", r, p))
        nodes = set(node_of.values())
        for r in range(world):
            seq = [node_of[r, p] for p in range(len(logs[r]))]
            for u, v in zip(seq, seq[1:]):
                edges[u].add(v)
        indeg = {n: 0 for n in nodes}
        for u in edges:
            for v in edges[u]:
                indeg[v] += 1
        ready = [n for n, k in indeg.items() if k == 0]
        done = 0
        while ready:
            u = ready.pop()
            done += 1
            for v in edges[u]:
                indeg[v] -= 1
                if indeg[v] == 0:
                    ready.append(v)
        if done != len(nodes):
            stuck = sorted((str(n) for n, k in indeg.items() if k > 0))[:6]
            problems.append(f"{config}: the posts form a cycle (no global order); nodes on or after it: {stuck}")
        if not any(op[0] in ("isend", "irecv") for log in logs.values() for op in log):
            problems.append(f"{config}: nothing was recorded")
    return problems


def _run(world: int, timeout: float) -> None:
    results = run_function(world, "tests.dist.test_post_order:record", timeout=timeout)
    errors = [f"rank {r}:\n{res['error']}" for r, res in enumerate(results) if res["error"]]
    assert not errors, "\n".join(errors)
    per_rank = [res["value"] for res in results]
    assert len(per_rank[0]) == len(CONFIGS[world])
    problems = check(world, per_rank)
    assert not problems, "\n".join(problems)


# 3 and 4 ranks (w = 2 among them) and more are slow tests (CI runs them): the default suite's
# time budget. The single-process tests enforce the same rules on every world size by default.
@pytest.mark.parametrize("world", [2, pytest.param(3, marks=pytest.mark.slow), pytest.param(4, marks=pytest.mark.slow)])
def test_posts_pair_up_and_fit_one_global_order(world):
    _run(world, 240)


@pytest.mark.slow
def test_posts_pair_up_and_fit_one_global_order_six_ranks():
    _run(6, 480)


def test_the_checker_sees_a_send_against_a_send_and_a_cycle():
    # The 2bw recording on the landed code: op 7 was a send on both ranks.
    bad = [[("cfg", [("isend", 1, 4, "f"), ("irecv", 1, 4, "f")])], [("cfg", [("isend", 0, 4, "f"), ("irecv", 0, 4, "f")])]]
    assert "op 0 between ranks 0 and 1" in check(2, bad)[0]
    # A collective before a p2p op on one rank and after it on the other: a cycle.
    cyc = [[("cfg", [("all_reduce", (0, 1), 1, "f"), ("isend", 1, 4, "f")])],
           [("cfg", [("irecv", 0, 4, "f"), ("all_reduce", (0, 1), 1, "f")])]]
    assert "cycle" in check(2, cyc)[0]


def test_the_check_finds_what_nccl_cannot_pair():
    # the checker itself, on hand-made recordings of 2 ranks: a pair posting different numbers
    # of ops, a collective of two sizes, a group told apart from another of the same members
    send, recv = ("isend", 1, 8, "torch.float32"), ("irecv", 0, 8, "torch.float32")
    norm = lambda n, g="0": ("all_reduce", (0, 1, g), n, "torch.float32")  # noqa: E731
    good = [[("cfg", [send, norm(3)])], [("cfg", [recv, norm(3)])]]
    assert check(2, good) == []
    extra = [[("cfg", [send, send, norm(3)])], [("cfg", [recv, norm(3)])]]
    assert check(2, extra)[0] == "cfg: rank 0 posts 2 ops towards 1, rank 1 1 back"
    sizes = [[("cfg", [send, norm(3)])], [("cfg", [recv, norm(4)])]]
    assert any("posted with different (size, dtype)" in p for p in check(2, sizes))
    groups = [[("cfg", [norm(3, "0"), norm(3, "1")])], [("cfg", [norm(3, "1"), norm(3, "0")])]]
    assert any("cycle" in p for p in check(2, groups))


def _message_tensors() -> list:
    g = torch.Generator().manual_seed(3)
    return [torch.randn(3, 4, generator=g), torch.tensor([1, 0, 1], dtype=torch.uint8),
            torch.randn(5, generator=g).to(torch.bfloat16), torch.tensor(2.5, dtype=torch.float64)]


def one_message(rank: int, world: int) -> dict:
    """Rank 0 sends a gradient-like message of four tensors (mixed dtypes, a scalar among them)
    and then a lone tensor through DistComm; rank 1 receives both. Returns what rank 1 received
    and every torch.distributed post of each rank."""
    from fxpipe.comm import EVERY_RANK, DistComm

    comm = DistComm({EVERY_RANK: list(range(world))}, timeout=60)
    log: list = []
    saved = {name: getattr(dist, name) for name in ("isend", "irecv") + _COLLECTIVES}
    _record_posts(log)
    try:
        if rank == 0:
            for h in (comm.isend(_message_tensors(), 1, "SEND_GRAD1"), comm.isend([torch.ones(6)], 1, "SEND_ACT2")):
                h.wait()
            return {"log": log}
        got = [torch.empty(t.shape, dtype=t.dtype) for t in _message_tensors()]
        alone = [torch.empty(6)]
        for h in (comm.irecv(got, 0, "RECV_GRAD1"), comm.irecv(alone, 0, "RECV_ACT2")):
            h.wait()
        return {"log": log, "got": got, "alone": alone}
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)


def test_an_action_of_several_tensors_is_one_message():
    # A gradient and its reached flags were two messages, so two posts on each side; on gloo a
    # receive posted after its send can cost milliseconds. Now each action is one message.
    sender, receiver = run_function(2, "tests.dist.test_post_order:one_message", timeout=120)
    assert sender["error"] is None and receiver["error"] is None, (sender["error"], receiver["error"])
    packed = sum(t.nbytes for t in _message_tensors())  # 48 + 3 + 10 + 8 bytes
    assert sender["value"]["log"] == [("isend", 1, packed, "torch.uint8"), ("isend", 1, 6, "torch.float32")]
    assert receiver["value"]["log"] == [("irecv", 0, packed, "torch.uint8"), ("irecv", 0, 6, "torch.float32")]
    for got, sent in zip(receiver["value"]["got"], _message_tensors()):
        assert got.dtype == sent.dtype and torch.equal(got, sent)
    assert torch.equal(receiver["value"]["alone"][0], torch.ones(6))
