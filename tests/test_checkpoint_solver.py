"""Chen et al.'s segment search on a chain, against hand-computed cases and brute force."""

import itertools
import math
import random

import pytest
from ucudnn.solver import checkpoint

from ucudnn.errors import InvalidInput


def brute_force(sizes, costs):
    """Every checkpoint set (the last stage always kept): the smallest (peak, recompute cost)."""
    n = len(sizes)
    best = None
    for r in range(n):
        for kept in itertools.combinations(range(n - 1), r):
            plan = checkpoint.evaluate(sizes, kept, costs)
            if best is None or (plan.peak_bytes, plan.recompute_cost) < (best.peak_bytes, best.recompute_cost):
                best = plan
    return best


def test_evaluate_hand_computed():
    # stages 10 20 30 40 50, keep 1 (20) and 4 (50, always): segments {0}=10 and {2,3}=70
    plan = checkpoint.evaluate([10, 20, 30, 40, 50], [1], costs=[1, 2, 3, 4, 5])
    assert plan.checkpoints == (1, 4)
    assert plan.peak_bytes == 20 + 50 + 70
    assert plan.recompute_cost == 1  # stage 0; the segment after the last checkpoint, {2, 3}, is kept
    # keeping everything: the sum, nothing recomputed
    everything = checkpoint.evaluate([10, 20, 30], [0, 1, 2], costs=[1, 1, 1])
    assert (everything.peak_bytes, everything.recompute_cost) == (60, 0)


def test_sqrt_n_of_equal_stages_is_about_two_sqrt_n():
    n = 100
    kept = checkpoint.sqrt_n(n)
    assert kept == tuple(range(9, 100, 10))
    plan = checkpoint.evaluate([1] * n, kept)
    assert plan.peak_bytes == 10 + 9  # k = 10 outputs kept, 9 rebuilt in the largest segment
    assert plan.peak_bytes <= 2 * math.sqrt(n)
    assert checkpoint.sqrt_n(1) == (0,)


def test_greedy_follows_algorithm_3():
    # B = 25: temp 10, 30 > 25 -> keep 1 (x=20, y=30); 30 > 25 -> keep 2 (x=50); 40 -> keep 3; 50 -> keep 4
    kept, x, y = checkpoint.greedy([10, 20, 30, 40, 50], 25)
    assert kept == (1, 2, 3, 4) and x == 140 and y == 50
    # B = 60: temp 10, 30, 60 (not > 60), 100 -> keep 3 (x=40, y=100); then 50 -> last stage appended
    kept, x, y = checkpoint.greedy([10, 20, 30, 40, 50], 60)
    assert kept == (3, 4) and x == 40 and y == 100
    # candidates restrict the split points
    kept, _, _ = checkpoint.greedy([10, 20, 30, 40, 50], 0, candidates=[2])
    assert kept == (2, 4)


@pytest.mark.parametrize("seed", range(40))
def test_optimal_matches_brute_force(seed):
    rng = random.Random(seed)
    n = rng.randint(1, 11)
    sizes = [rng.choice([0, 1, 2, 3, 5, 8, 13, 40]) * rng.randint(1, 4) for _ in range(n)]
    costs = [rng.uniform(0, 3) for _ in range(n)]
    exact = checkpoint.optimal(sizes, costs)
    reference = brute_force(sizes, costs)
    assert exact.peak_bytes == reference.peak_bytes
    assert exact.recompute_cost == pytest.approx(reference.recompute_cost)
    assert checkpoint.evaluate(sizes, exact.checkpoints, costs) == exact
    # the paper's search is a heuristic: never below the optimum, and its reported cost is exact
    searched = checkpoint.budget_search(sizes, costs)
    assert searched.peak_bytes >= exact.peak_bytes
    assert checkpoint.evaluate(sizes, searched.checkpoints, costs) == searched


def test_candidates_restrict_the_optimum():
    sizes = [5, 5, 5, 5, 5, 5]
    free = checkpoint.optimal(sizes)
    only_2 = checkpoint.optimal(sizes, candidates=[2])
    assert set(only_2.checkpoints) <= {2, 5}
    assert only_2.peak_bytes >= free.peak_bytes
    assert only_2.peak_bytes == min(checkpoint.evaluate(sizes, k).peak_bytes for k in ([], [2]))


def test_budget_search_is_sublinear_on_a_long_chain():
    # 400 equal stages: keeping everything costs 400; the paper's search gets near 2 sqrt(n) = 40
    sizes = [1] * 400
    searched = checkpoint.budget_search(sizes, [1.0] * 400)
    assert searched.peak_bytes <= 45
    assert searched.recompute_cost <= 400  # at most one extra forward pass


@pytest.mark.parametrize("bad", [[], [1, -1], [1.5], [True]])
def test_bad_sizes(bad):
    with pytest.raises(InvalidInput, match="sizes"):
        checkpoint.optimal(bad)


def test_bad_checkpoint_and_costs():
    with pytest.raises(InvalidInput, match="checkpoint 7"):
        checkpoint.evaluate([1, 2], [7])
    with pytest.raises(InvalidInput, match="costs must have one entry per stage"):
        checkpoint.evaluate([1, 2], [], costs=[1.0])
    with pytest.raises(InvalidInput, match="budget"):
        checkpoint.greedy([1, 2], -1)


def _random_chain(seed: int) -> tuple[int, list[int], list[float], list[int], list[int], list]:
    """A chain of 2-10 stages with random sizes (some weighing more kept than dropped), costs and
    candidates, and every checkpoint set's figures."""
    rng = random.Random(seed)
    n = rng.randint(2, 10)
    sizes = [rng.randint(0, 30) for _ in range(n)]
    kept = [s + rng.choice((0, 0, rng.randint(1, 30))) for s in sizes]
    costs = [rng.uniform(0, 3) for _ in range(n)]
    candidates = sorted(rng.sample(range(n - 1), rng.randint(0, n - 1)))
    every = [
        checkpoint.evaluate(sizes, ks, costs, kept)
        for r in range(len(candidates) + 1)
        for ks in itertools.combinations(candidates, r)
    ]
    return n, sizes, costs, candidates, kept, every


@pytest.mark.parametrize("seed", range(20))
def test_optimal_with_candidates_matches_brute_force(seed):
    n, sizes, costs, candidates, kept, every = _random_chain(100 + seed)
    exact = checkpoint.optimal(sizes, costs, candidates=candidates, kept_sizes=kept)
    best = min(every, key=lambda p: (p.peak_bytes, p.recompute_cost))
    assert set(exact.checkpoints) <= {*candidates, n - 1}
    assert exact.peak_bytes == best.peak_bytes
    assert exact.recompute_cost == pytest.approx(best.recompute_cost)


@pytest.mark.parametrize("seed", range(20))
def test_frontier_spans_the_smallest_peak_to_no_recompute_and_beats_equal_splits(seed):
    n, sizes, costs, candidates, kept, every = _random_chain(300 + seed)
    front = checkpoint.frontier(sizes, costs, candidates=candidates, kept_sizes=kept)
    # ascending peak, descending recompute, each point exact and on the candidates
    assert [p.peak_bytes for p in front] == sorted({p.peak_bytes for p in front})
    assert all(a.recompute_cost > b.recompute_cost for a, b in itertools.pairwise(front))
    for p in front:
        assert set(p.checkpoints) <= {*candidates, n - 1}
        assert p == checkpoint.evaluate(sizes, p.checkpoints, costs, kept)
    # its ends: the smallest peak there is, and nothing recomputed (everything kept)
    assert front[0].peak_bytes == min(p.peak_bytes for p in every)
    assert front[-1].recompute_cost == 0
    # at every limit, no more recompute than checkpoint_sequential's split (k equal runs) within it
    evens = [
        checkpoint.evaluate(sizes, [candidates[j * len(candidates) // k - 1] for j in range(1, k)], costs, kept)
        for k in range(1, len(candidates) + 1)
    ]
    for e in evens:
        assert min(p.recompute_cost for p in front if p.peak_bytes <= e.peak_bytes) <= e.recompute_cost + 1e-9


def test_a_checkpoint_weighs_its_kept_size():
    # stage 1 is read by no backward step (dropped: 0 bytes) but held when kept (8 bytes)
    sizes, kept = [10, 0, 10, 10], [10, 8, 10, 10]
    plan = checkpoint.evaluate(sizes, [1], kept_sizes=kept)
    assert plan.peak_bytes == 8 + 10 + 10  # kept 1 and 3, largest dropped segment {2} (or {0})
    assert checkpoint.evaluate(sizes, [1]).peak_bytes == 0 + 10 + 10
    with pytest.raises(InvalidInput, match="kept_sizes must have one entry per stage"):
        checkpoint.evaluate(sizes, [1], kept_sizes=[1])


def test_frontier_keeps_the_last_segment_as_checkpoint_sequential_does():
    sizes, costs = [4] * 12, [1.0] * 12
    # keep stage 5: stages 0-4 are recomputed, 6-10 (the last segment) are kept
    plan = checkpoint.evaluate(sizes, [5], costs)
    assert plan.peak_bytes == 4 + 4 + 5 * 4 and plan.recompute_cost == 5.0
    front = checkpoint.frontier(sizes, costs)
    assert plan.peak_bytes in {p.peak_bytes for p in front}
    assert min(p.recompute_cost for p in front if p.peak_bytes <= plan.peak_bytes) <= 5.0
