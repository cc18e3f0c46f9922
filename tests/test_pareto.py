"""pareto.front against brute force: every division of small batches, enumerated."""

from __future__ import annotations

import itertools
import math
import random

import pytest
from ucudnn.solver import Configuration, Infeasible, MicroConfig, pareto, wr

REL_TOL = 1e-12


def _random_bench(rng: random.Random, batch: int, *, integer_times: bool) -> dict[int, list[MicroConfig]]:
    """2-3 algorithms per measured size; some infinite times, some zero or repeated workspaces."""
    policy = rng.choice(["all", "powerOfTwo", "subset"])
    if policy == "all":
        sizes = list(range(1, batch + 1))
    elif policy == "powerOfTwo":
        sizes = sorted({1 << i for i in range(batch.bit_length()) if 1 << i <= batch} | {batch})
    else:
        sizes = sorted(rng.sample(range(1, batch + 1), rng.randint(1, batch)))
    bench: dict[int, list[MicroConfig]] = {}
    for s in sizes:
        options = []
        for a in range(rng.randint(2, 3)):
            if integer_times:
                time = float(rng.randint(1, 6) * s + rng.randint(0, 4))
            else:
                time = rng.uniform(0.5, 2.0) * s + rng.uniform(0.0, 1.0)
            if rng.random() < 0.1:
                time = math.inf
            workspace = rng.choice([0, rng.randint(0, 5) * s, rng.randint(0, 40)])
            options.append(MicroConfig(f"a{a}", s, time, workspace))
        bench[s] = options
    return bench


def _divisions(bench: dict[int, list[MicroConfig]], batch: int, limit: int | None) -> list[tuple[MicroConfig, ...]]:
    """Every multiset of usable micro-configs whose sizes sum to `batch` (order does not matter)."""
    usable = [
        m
        for ms in bench.values()
        for m in ms
        if m.usable and m.batch <= batch and (limit is None or m.workspace <= limit)
    ]
    found: list[tuple[MicroConfig, ...]] = []

    def extend(start: int, left: int, chosen: list[MicroConfig]) -> None:
        if left == 0:
            found.append(tuple(chosen))
            return
        for i in range(start, len(usable)):
            if usable[i].batch <= left:
                chosen.append(usable[i])
                extend(i, left - usable[i].batch, chosen)
                chosen.pop()

    extend(0, batch, [])
    return found


def _non_dominated(points: list[tuple[float, int]]) -> list[tuple[float, int]]:
    """(time, workspace) points no other point dominates, ascending workspace."""
    kept: list[tuple[float, int]] = []
    for time, workspace in sorted(points, key=lambda p: (p[1], p[0])):
        if not kept or time < kept[-1][0]:
            kept.append((time, workspace))
    return kept


def _check_front(bench, batch, limit, result: list[Configuration]) -> None:
    assert result, "a front is never empty"
    for config in result:
        assert config.batch == batch
        for m in config.micros:
            assert m in bench[m.batch] and m.usable
            assert limit is None or m.workspace <= limit
    for before, after in itertools.pairwise(result):
        assert before.workspace < after.workspace
        assert before.time > after.time


@pytest.mark.parametrize("integer_times", [False, True])
def test_front_matches_brute_force(integer_times: bool) -> None:
    rng = random.Random(1234 + integer_times)
    checked = infeasible = 0
    for _ in range(250):
        batch = rng.randint(1, 8)
        bench = _random_bench(rng, batch, integer_times=integer_times)
        limit = rng.choice([None, 0, rng.randint(0, 40)])
        points = _non_dominated(
            [(sum(m.time for m in d), max(m.workspace for m in d)) for d in _divisions(bench, batch, limit)]
        )
        if not points:
            with pytest.raises(Infeasible):
                pareto.front(bench, batch, limit)
            infeasible += 1
            continue
        result = pareto.front(bench, batch, limit)
        _check_front(bench, batch, limit, result)
        got = [(c.time, c.workspace) for c in result]
        assert len(got) == len(points), (got, points)
        for (t_got, w_got), (t_want, w_want) in zip(got, points, strict=True):
            assert w_got == w_want
            assert t_got == pytest.approx(t_want, rel=REL_TOL)
        checked += 1
    assert checked > 150 and infeasible > 0


def test_fastest_member_is_the_wr_optimum() -> None:
    rng = random.Random(7)
    for _ in range(60):
        batch = rng.randint(1, 40)
        bench = _random_bench(rng, batch, integer_times=False)
        limit = rng.choice([None, rng.randint(0, 100)])
        try:
            expected = wr.solve(bench, batch, limit)
        except Infeasible:
            with pytest.raises(Infeasible):
                pareto.front(bench, batch, limit)
            continue
        result = pareto.front(bench, batch, limit)
        _check_front(bench, batch, limit, result)
        assert result[-1].time == pytest.approx(expected.time, rel=REL_TOL)
        # Every member is also the WR optimum under its own workspace as the limit.
        for config in result:
            assert wr.solve(bench, batch, config.workspace).time == pytest.approx(config.time, rel=REL_TOL)


def test_single_undivided_option() -> None:
    bench = {4: [MicroConfig("gemm", 4, 3.0, 0), MicroConfig("fft", 4, 1.0, 100)]}
    result = pareto.front(bench, 4, None)
    assert [c.micros for c in result] == [(bench[4][0],), (bench[4][1],)]
    assert [c.micros for c in pareto.front(bench, 4, 99)] == [(bench[4][0],)]


def test_micro_batching_reaches_a_faster_point_under_a_small_limit() -> None:
    bench = {
        1: [MicroConfig("fft", 1, 1.0, 10)],
        2: [MicroConfig("gemm", 2, 5.0, 0), MicroConfig("fft", 2, 1.5, 20)],
    }
    result = pareto.front(bench, 2, None)
    assert [(c.time, c.workspace) for c in result] == [(5.0, 0), (2.0, 10), (1.5, 20)]
    assert result[1].micros == (bench[1][0], bench[1][0])
    assert [(c.time, c.workspace) for c in pareto.front(bench, 2, 15)] == [(5.0, 0), (2.0, 10)]
    assert [(c.time, c.workspace) for c in pareto.front(bench, 2, 5)] == [(5.0, 0)]


def test_ignores_sizes_above_the_batch_and_empty_sizes() -> None:
    bench = {
        1: [MicroConfig("a", 1, 1.0, 5)],
        3: [],
        4: [MicroConfig("big", 4, 0.1, 0)],
    }
    result = pareto.front(bench, 3, None)
    assert [c.micros for c in result] == [(bench[1][0],) * 3]


def test_infeasible_names_the_limit() -> None:
    bench = {2: [MicroConfig("fft", 2, 1.0, 50), MicroConfig("bad", 2, math.inf, 0)]}
    with pytest.raises(Infeasible, match="workspace limit 10"):
        pareto.front(bench, 2, 10)
    with pytest.raises(Infeasible, match="batch 3"):
        pareto.front(bench, 3, None)


def test_rejects_bad_arguments() -> None:
    bench = {1: [MicroConfig("a", 1, 1.0, 0)]}
    with pytest.raises(ValueError, match="batch"):
        pareto.front(bench, 0, None)
    with pytest.raises(ValueError, match="workspace_limit"):
        pareto.front(bench, 1, -1)
    with pytest.raises(ValueError, match="bench\\[2\\]"):
        pareto.front({2: [MicroConfig("a", 1, 1.0, 0)]}, 2, None)


def test_does_not_mutate_bench() -> None:
    rng = random.Random(3)
    bench = _random_bench(rng, 8, integer_times=False)
    copy = {s: list(ms) for s, ms in bench.items()}
    pareto.front(bench, 8, None)
    assert bench == copy
