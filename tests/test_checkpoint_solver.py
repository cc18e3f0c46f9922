"""Chen et al.'s segment search on a chain, against hand-computed cases and brute force."""

import itertools
import math
import random

import pytest

from ucudnn.errors import InvalidInput
from ucudnn.solver import checkpoint


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
    assert plan.recompute_cost == 1 + 3 + 4
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


@pytest.mark.parametrize("seed", range(20))
def test_optimal_with_candidates_matches_brute_force(seed):
    rng = random.Random(100 + seed)
    n = rng.randint(2, 10)
    sizes = [rng.randint(0, 30) for _ in range(n)]
    costs = [rng.uniform(0, 3) for _ in range(n)]
    candidates = sorted(rng.sample(range(n - 1), rng.randint(0, n - 1)))
    exact = checkpoint.optimal(sizes, costs, candidates=candidates)
    best = min((checkpoint.evaluate(sizes, kept, costs)
                for r in range(len(candidates) + 1) for kept in itertools.combinations(candidates, r)),
               key=lambda p: (p.peak_bytes, p.recompute_cost))
    assert set(exact.checkpoints) <= {*candidates, n - 1}
    assert exact.peak_bytes == best.peak_bytes
    assert exact.recompute_cost == pytest.approx(best.recompute_cost)


def test_even_segments_split_like_checkpoint_sequential():
    sizes = [4] * 12
    # 3 runs of 4 stages: keep stages 3, 7 and the last; 8 dropped stages recomputed, 12 bytes per run dropped
    three = checkpoint.even_segments(sizes, 3, [1.0] * 12)
    assert three.checkpoints == (3, 7, 11)
    assert three.peak_bytes == 3 * 4 + 3 * 4 and three.recompute_cost == 9.0
    assert checkpoint.even_segments(sizes, 1).checkpoints == (11,)
    assert checkpoint.even_segments(sizes, 12).checkpoints == tuple(range(12))
    # over candidates only, and uneven counts split as evenly as they go
    assert checkpoint.even_segments(sizes, 2, candidates=[1, 5, 9]).checkpoints == (1, 11)
    with pytest.raises(InvalidInput, match="segments"):
        checkpoint.even_segments(sizes, 13)
    with pytest.raises(InvalidInput, match="segments"):
        checkpoint.even_segments(sizes, 0)
