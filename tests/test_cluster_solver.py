"""The cluster batch-size solver against brute force, and its two exact methods against each other."""

import itertools
import math
import random

import pytest
from ucudnn.solver import Infeasible
from ucudnn.solver.cluster import _runs, best_batch_sizes, makespan

from ucudnn.errors import InvalidInput


def brute_force(times, batch):
    """The optimal makespan by enumerating every choice (0 or one size) per device; None if none sums to B."""
    devices = list(times)
    options = [[0] + [b for b, t in times[g].items() if math.isfinite(t)] for g in devices]
    best = None
    for choice in itertools.product(*options):
        if sum(choice) == batch:
            span = makespan(times, dict(zip(devices, choice)))
            best = span if best is None else min(best, span)
    return best


def random_table(rng, devices, max_size, sizes_per_device, monotone):
    times = {}
    for g in range(devices):
        sizes = rng.sample(range(1, max_size + 1), sizes_per_device)
        speed = rng.uniform(0.5, 4.0)
        row = {}
        for b in sizes:
            # Integer-ish times give ties, which the search must handle; non-monotone rows are allowed.
            t = b * speed if monotone else rng.uniform(0.1, 20.0)
            row[b] = round(t, 1) if rng.random() < 0.5 else t
        if rng.random() < 0.2:
            row[rng.choice(sizes)] = math.inf  # a size that cannot run
        times[f"gpu{g}"] = row
    return times


def check_assignment(times, batch, out, expected_span):
    assert list(out) == list(times)
    assert sum(out.values()) == batch
    for g, b in out.items():
        assert b == 0 or (b in times[g] and math.isfinite(times[g][b]))
    assert makespan(times, out) == pytest.approx(expected_span, rel=1e-9, abs=1e-12)


@pytest.mark.parametrize("seed", range(60))
def test_both_methods_match_brute_force(seed):
    rng = random.Random(seed)
    devices = rng.randint(1, 4)
    times = random_table(rng, devices, max_size=9, sizes_per_device=rng.randint(1, 5), monotone=seed % 2 == 0)
    batch = rng.randint(1, 20)
    expected = brute_force(times, batch)
    for method in ("search", "milp"):
        if expected is None:
            with pytest.raises(Infeasible):
                best_batch_sizes(times, batch, method=method)
        else:
            check_assignment(times, batch, best_batch_sizes(times, batch, method=method), expected)


@pytest.mark.parametrize("seed", range(5))
def test_methods_agree_on_larger_clusters(seed):
    rng = random.Random(100 + seed)
    times = random_table(rng, 12, max_size=40, sizes_per_device=12, monotone=seed % 2 == 0)
    batch = rng.randint(40, 150)
    try:
        search = best_batch_sizes(times, batch)
    except Infeasible:
        with pytest.raises(Infeasible):
            best_batch_sizes(times, batch, method="milp")
        return
    milp = best_batch_sizes(times, batch, method="milp")
    assert sum(milp.values()) == sum(search.values()) == batch
    assert makespan(times, milp) == pytest.approx(makespan(times, search), rel=1e-9)


def test_paper_shape_unequal_devices_get_uneven_batches():
    # Two devices 1.5x faster per sample than the third: B = 32 splits 12, 12, 8 (the paper's K80 + K20Xm).
    times = {
        "a": {b: b / 1.5 for b in range(1, 33)},
        "b": {b: b / 1.5 for b in range(1, 33)},
        "c": {b: float(b) for b in range(1, 33)},
    }
    out = best_batch_sizes(times, 32)
    assert sorted(out.values()) == [8, 12, 12]
    assert out["c"] == 8
    assert makespan(times, out) == pytest.approx(8.0)


def test_a_device_too_slow_to_help_sits_out():
    times = {"fast": {1: 1.0, 2: 2.0, 3: 3.0, 4: 4.0}, "slow": {1: 50.0, 2: 100.0}}
    assert best_batch_sizes(times, 4) == {"fast": 4, "slow": 0}
    assert best_batch_sizes(times, 4, method="milp") == {"fast": 4, "slow": 0}


def test_gaps_in_sizes_are_respected():
    # Only even sizes: an odd batch cannot be covered, and the message says why.
    times = {"a": {2: 1.0, 4: 2.0}, "b": {2: 1.0, 6: 3.0}}
    assert best_batch_sizes(times, 8) in ({"a": 2, "b": 6}, {"a": 4, "b": 4})
    with pytest.raises(Infeasible, match="no choice of one usable size per device sums to batch 7"):
        best_batch_sizes(times, 7)
    with pytest.raises(Infeasible, match="at most 10 samples together"):
        best_batch_sizes(times, 11)
    with pytest.raises(Infeasible):
        best_batch_sizes(times, 7, method="milp")


def test_infinite_times_are_never_chosen():
    times = {"a": {1: 1.0, 2: math.inf}, "b": {1: 5.0, 2: 6.0}}
    out = best_batch_sizes(times, 3)
    assert out == {"a": 1, "b": 2}


def test_runs_split_sorted_sizes_into_arithmetic_progressions():
    assert _runs([1, 2, 3, 4, 8, 12]) == [(1, 1, 4), (8, 4, 2)]
    assert _runs([5]) == [(5, 1, 1)]
    assert _runs([]) == []
    assert _runs([2, 4, 6, 7]) == [(2, 2, 3), (7, 1, 1)]


@pytest.mark.parametrize(
    "times, batch, match",
    [
        ({}, 4, "at least one device"),
        ({"a": {1: 1.0}}, 0, "batch must be a positive integer"),
        ({"a": {1: 1.0}}, 2.0, "batch must be a positive integer"),
        ({"a": {0: 1.0}}, 1, "batch sizes must be positive integers"),
        ({"a": {1: -1.0}}, 1, "non-negative number of ms"),
        ({"a": {1: float("nan")}}, 1, "non-negative number of ms"),
        ({"a": [1.0]}, 1, "must map batch sizes to times"),
    ],
)
def test_bad_input_is_named(times, batch, match):
    with pytest.raises(InvalidInput, match=match):
        best_batch_sizes(times, batch)


def test_unknown_method():
    with pytest.raises(InvalidInput, match="method must be one of"):
        best_batch_sizes({"a": {1: 1.0}}, 1, method="greedy")
