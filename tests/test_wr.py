import itertools
import math

import numpy as np
import pytest
from ucudnn.solver import Configuration, Infeasible, MicroConfig, wr


def random_bench(rng, batch, n_algos, sizes=None, inf_fraction=0.15):
    sizes = sizes or list(range(1, batch + 1))
    bench = {}
    for size in sizes:
        options = []
        for a in range(n_algos):
            time = math.inf if rng.random() < inf_fraction else float(rng.uniform(0.2, 1.0) * size + rng.uniform(0, 2))
            options.append(MicroConfig(f"a{a}", size, time, int(rng.integers(0, 100) * size)))
        bench[size] = options
    return bench


def compositions(n):
    """Every ordered way to write n as a sum of positive parts."""
    if n == 0:
        yield ()
        return
    for first in range(1, n + 1):
        for rest in compositions(n - first):
            yield (first, *rest)


def brute_force(bench, batch, limit):
    best = math.inf
    for parts in compositions(batch):
        if any(p not in bench for p in parts):
            continue
        choices = [[m for m in bench[p] if m.usable and (limit is None or m.workspace <= limit)] for p in parts]
        for combo in itertools.product(*choices):
            best = min(best, sum(m.time for m in combo))
    return best


@pytest.mark.parametrize("seed", range(25))
def test_wr_matches_brute_force(seed):
    rng = np.random.default_rng(seed)
    batch = int(rng.integers(1, 8))
    sizes = sorted(set(rng.integers(1, batch + 1, size=batch).tolist()) | {1})
    bench = random_bench(rng, batch, int(rng.integers(1, 4)), sizes)
    limit = None if seed % 5 == 0 else int(rng.integers(0, 400))
    expected = brute_force(bench, batch, limit)
    if math.isinf(expected):
        with pytest.raises(Infeasible):
            wr.solve(bench, batch, limit)
        return
    config = wr.solve(bench, batch, limit)
    assert config.time == pytest.approx(expected)
    assert config.batch == batch
    assert limit is None or config.workspace <= limit
    for m in config.micros:
        assert m in bench[m.batch]


def test_wr_divides_when_the_fast_algorithm_only_fits_small():
    bench = {
        1: [MicroConfig("slow", 1, 10.0, 0), MicroConfig("fast", 1, 1.5, 100)],
        2: [MicroConfig("slow", 2, 20.0, 0), MicroConfig("fast", 2, 2.0, 200)],
        4: [MicroConfig("slow", 4, 40.0, 0), MicroConfig("fast", 4, 3.8, 400)],
    }
    config = wr.solve(bench, 4, workspace_limit=250)
    assert config == Configuration((MicroConfig("fast", 2, 2.0, 200),) * 2)
    assert (config.time, config.workspace, config.batch) == (4.0, 200, 4)
    assert wr.solve(bench, 4, workspace_limit=None).micros == (MicroConfig("fast", 4, 3.8, 400),)
    assert wr.solve(bench, 4, workspace_limit=0).describe() == "1x4:slow"


def test_infeasible_says_why():
    bench = {2: [MicroConfig("a", 2, 1.0, 10)], 4: [MicroConfig("a", 4, 1.0, 50)]}
    with pytest.raises(Infeasible, match="batch 3"):
        wr.solve(bench, 3, None)
    with pytest.raises(Infeasible, match="limit 5"):
        wr.solve(bench, 4, 5)
    with pytest.raises(ValueError):
        wr.solve(bench, 0, None)
