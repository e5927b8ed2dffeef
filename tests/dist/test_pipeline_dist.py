"""fxpipe.compile under real process groups: gloo ranks on loopback, 2, 3 and 4 of them.

Each test spawns its ranks once and runs several cases inside that one process group (rank
start-up costs seconds); every case must equal the single-device reference of its schedule
(tests/reference.py), the same check the single-process tests make.
"""

import pytest

import torch

from tests.cases import CASES, RANDOM, compare, eval_loss, single_process
from tests.dist.harness import run_ranks

pytestmark = [pytest.mark.dist, pytest.mark.timeout(600)]  # the harness kills ranks at 300 s


def check_cases(world, names, timeout, backend="gloo"):
    """Run ``names`` on ``world`` ranks and compare every case with its reference (trained on the
    GPU for NCCL runs)."""
    device = "cuda" if backend == "nccl" else "cpu"
    results = run_ranks(world, names, timeout=timeout, backend=backend)
    failures = []
    for name in names:
        per_rank = results[name]
        errors = [f"rank {r}:\n{res['error']}" for r, res in enumerate(per_rank) if res["error"]]
        if errors:
            failures.append(f"{name} raised:\n" + "\n".join(errors))
            continue
        case = CASES[name]
        if case.lookahead is not None:  # the case's own order, not the planner's
            ran = [res["lookahead"] for res in per_rank]
            assert ran == [case.lookahead] * world, (name, ran)
        d = case.lanes  # ranks per replica: the last stage is on each replica's last
        last_ranks = [r for r in range(world) if r % d == d - 1]
        others = [r for r in range(world) if r % d != d - 1]
        assert all(per_rank[r]["losses"] and None not in per_rank[r]["losses"] for r in last_ranks), name
        # every rank gets the loss (a Loss handle off the last stage), the same bits everywhere
        assert all(per_rank[r]["losses"] == per_rank[last_ranks[0]]["losses"] for r in others), name
        assert all(per_rank[r]["eval"] == per_rank[last_ranks[0]]["eval"] for r in range(world)), name
        # state_dict(local=True): each rank's own stage (none where the stage holds no weight),
        # equal to the whole state there; a stage's replicas give the same keys (replicas > 0 gave
        # none), and the stages cover the whole
        local = [per_rank[r]["local_state"] for r in range(world)]
        assert all(ok for _, ok in local), (name, local)
        assert all(local[r][0] == local[r % d][0] for r in range(world)), (name, local)
        assert set().union(*(keys for keys, _ in local)) == set(per_rank[0]["state"]), name
        # every rank reduced the last step's gradient norm, to the same value
        norms = [per_rank[r]["grad_norm"] for r in range(world)]
        assert all(n[0] == case.steps and n[1] == pytest.approx(norms[0][1], rel=1e-12) for n in norms), (name, norms)
        if case.dropout:
            # the same masks as all ranks in one process, so the same numbers
            losses, state = single_process(case)
            got = per_rank[last_ranks[0]]["losses"]
            if any(abs(a - b) > 1e-6 * abs(b) for a, b in zip(got, losses)):
                failures.append(f"{name}: losses {got} differ from the single-process run's {losses}")
            for key, ref in state.items():
                if ref.is_floating_point() and not torch.allclose(per_rank[0]["state"][key], ref, rtol=1e-6, atol=1e-9):
                    failures.append(f"{name}: {key} differs from the single-process run")
        else:
            failures += compare(case, per_rank[last_ranks[0]]["losses"], per_rank[0]["state"], device=device)
        expected = eval_loss(case, per_rank[0]["state"])
        got = per_rank[last_ranks[0]]["eval"]
        if abs(got - expected) > 1e-5 * abs(expected):
            failures.append(f"{name}: eval_step gave {got!r}, the trained weights in eval mode give {expected!r}")
    assert not failures, "\n".join(failures)


def test_two_ranks():
    # one of each kind: clipping, another schedule, tied weights, a mask input, dropout
    # (2bw's with m > d run one forward ahead: the planner's lookahead; 1f1b's on request)
    check_cases(2, ["2bw_adamw_clip", "1f1b_adamw", "gpt2_2bw_adamw", "bert_2bw", "dropout_2bw",
                    "1f1b_adamw_lookahead1"], 300)


def test_two_ranks_zb():
    # zb's split backward across processes: clipping, tied weights (GPT-2), recomputation
    check_cases(2, ["zb_adamw_clip", "gpt2_zb", "zb_recompute"], 300)


@pytest.mark.slow  # time budget: d = 4 runs by default in one process
def test_four_ranks_zb():
    check_cases(4, ["d4_gpt2_zb", "d4_llama_zb_recompute"], 300)


@pytest.mark.slow  # the default suite's time budget: these cases run by default in one process
def test_two_ranks_more_cases():
    check_cases(2, ["2bw_sgd", "2bw_groups", "2bw_recompute", "gpipe_sgd", "gpt2_2bw", "llama_2bw_adamw",
                    "2bw_adamw_lookahead0"], 300)


@pytest.mark.slow  # time budget: d = 3 runs by default in one process (tests/unit/test_pipeline.py)
def test_three_ranks():
    check_cases(3, ["d3_2bw_sgd", "d3_2bw_adamw", "d3_gpt2_2bw", "d3_gpt2_2bw_adamw", "d3_llama_2bw_adamw", "d3_dropout_1f1b",
                    "d3_m6_gpt2_2bw_lookahead2"], 300)


@pytest.mark.slow  # the default suite's time budget holds 2-rank worlds
def test_four_ranks_two_replicas_or_four_stages():
    check_cases(4, ["w2_2bw_adamw", "w2_1f1b_sgd", "w2_gpt2_2bw", "w2_gpipe_recompute", "d4_gpt2_2bw"], 300)


def test_interleaved_on_two_ranks():
    # interleaved 1F1B, two stages per rank: tied weights and clipping; dropout, whose streams are
    # per (seed, micro-batch, stage) however many stages a rank holds
    check_cases(2, ["i2_gpt2_1f1b", "i2_dropout_1f1b"], 300)


@pytest.mark.slow  # time budget: these run by default in one process
def test_interleaved_more_cases_and_ranks():
    check_cases(2, ["i2_adamw_clip", "i2_llama_recompute", "i3_gpt2_1f1b"], 300)
    check_cases(3, ["i2_d3_m6_1f1b"], 300)
    check_cases(4, ["i2_w2_gpt2_1f1b"], 300)


def test_random_combinations_on_two_ranks():
    # tests/cases.py's seeded draws: model, schedule, micro-batches, optimizer, clipping,
    # recomputation and lookahead together, as tests/unit/test_combinations.py does in one process
    check_cases(2, [c.name for c in RANDOM[2]], 300)


@pytest.mark.slow  # the default suite's time budget holds 2-rank worlds
def test_random_combinations_on_four_ranks():
    # d = 4, or d = 2 with w = 2 replicas
    check_cases(4, [c.name for c in RANDOM[4]], 300)


def eval_with_a_buffer_counted_upstream(rank: int, world: int) -> list[tuple[float, float]]:
    from tests.unit.test_pipeline import eval_matches_eager_with_a_buffer_counted_upstream

    return eval_matches_eager_with_a_buffer_counted_upstream("1f1b", world)


def test_eval_reads_a_buffer_training_counts_on_another_rank():
    # rank 1's eval stage reads the buffer that only rank 0's training stage holds: it comes across
    from tests.dist.harness import run_function

    results = run_function(2, "tests.dist.test_pipeline_dist:eval_with_a_buffer_counted_upstream", timeout=150)
    assert [r["error"] for r in results] == [None, None], results
    for r in results:
        for got, expected in r["value"]:
            assert got == pytest.approx(expected, rel=1e-12)
