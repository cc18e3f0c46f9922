"""Dymem's GTBM pool and best-fit on hand-computed allocation traces."""

import random

import pytest

from ucudnn.errors import InvalidInput
from ucudnn.memory.gtbm import Alloc, BestFitPool, Free, GTBMPool, compare, minimal_capacity, replay, unusable_free

MB = 1


def test_unusable_free_is_equation_1():
    # holes of 512 and 1024 (the paper's Figure 6 after freeing t0 and t2), a request of 1024
    assert unusable_free([512, 1024], 1024) == pytest.approx(512 / 1536)
    assert unusable_free([512, 1024], 512) == 0.0
    assert unusable_free([200, 300], 400) == 1.0
    assert unusable_free([], 1) == 1.0


def test_best_fit_coalesces_neighbours_only():
    # Figure 6: t0 512, t1 512, t2 1024 in a 2048 pool; free t0 and t2: t0's hole stays apart
    trace = [Alloc("t0", 512), Alloc("t1", 512), Alloc("t2", 1024), Free("t0"), Free("t2"), Alloc("x", 1024)]
    pool = BestFitPool(2048)
    report = replay(trace, pool)
    assert report.fits
    assert pool.main.holes == [(0, 512)]  # x took the coalesced [1024, 2048)
    # U_f before each request: empty pool 0, 0, 0; then holes 512 + 1024 for a 1024 request: 1/3
    assert report.max_unusable == pytest.approx(1 / 3)
    assert report.mean_unusable == pytest.approx((1 / 3) / 4)
    # freeing t1 now joins [0, 512) and [512, 1024) into one hole
    pool.release("main", 512, 512)
    assert pool.main.holes == [(0, 1024)]


def figure7_trace():
    """Figure 7's nonlinear case: a fork tensor lives between two short-lived ones; then 400 MB."""
    return [
        Alloc("a", 200 * MB),
        Alloc("fork", 500 * MB, "temporary"),
        Alloc("b", 300 * MB),
        Free("a"),
        Free("b"),
        Alloc("c", 400 * MB),
        Free("c"),
        Free("fork"),
    ]


def test_figure7_best_fit_fails_gtbm_serves():
    best_fit = replay(figure7_trace(), BestFitPool(1000 * MB))
    assert not best_fit.fits and best_fit.failed == 1
    assert best_fit.max_unusable == 1.0  # 200 + 300 free, neither hole holds 400
    pool = GTBMPool(1000 * MB)
    gtbm = replay(figure7_trace(), pool)
    assert gtbm.fits and gtbm.max_unusable == 0.0
    assert pool.main.holes == [(0, 1000 * MB)]


def test_gtbm_places_temporary_high_movable_low_reclaimed_outside():
    pool = GTBMPool(1000)
    assert pool.place(Alloc("t", 100, "temporary")) == ("main", 900)
    assert pool.place(Alloc("m", 100, "movable")) == ("main", 0)
    assert pool.place(Alloc("t2", 50, "temporary")) == ("main", 850)
    assert pool.place(Alloc("r", 10**9, "reclaimed")) == ("incremental", 0)
    assert pool.main.holes == [(100, 850)]


def test_minimal_capacity_and_compare_on_figure7():
    trace = figure7_trace()
    assert minimal_capacity(trace, GTBMPool) == 1000 * MB  # the peak of live bytes
    # best-fit needs 100 more: b's freed hole [700, 1000) joins the tail [1000, 1100) to hold c
    assert minimal_capacity(trace, BestFitPool) == 1100 * MB
    result = compare(trace)
    assert (result.peak_live_bytes, result.best_fit_bytes, result.gtbm_bytes) == (1000, 1100, 1000)
    assert result.capacity == 1100
    assert result.gtbm.mean_unusable < result.best_fit.mean_unusable


def test_reclaimed_tensors_count_in_gtbm_incremental_space():
    trace = [Alloc("fc", 30, "reclaimed"), Alloc("x", 70), Free("x"), Alloc("y", 70), Free("fc"), Free("y")]
    assert minimal_capacity(trace, GTBMPool) == 70
    result = compare(trace)
    assert result.gtbm_bytes == 100 and result.best_fit_bytes == 100
    assert result.gtbm.incremental_peak_bytes == 30


@pytest.mark.parametrize("seed", range(10))
def test_replay_never_overlaps_and_minimal_capacity_fits(seed):
    rng = random.Random(seed)
    trace, live = [], []
    for k in range(60):
        if live and rng.random() < 0.45:
            trace.append(Free(live.pop(rng.randrange(len(live)))))
        else:
            name = f"t{k}"
            trace.append(Alloc(name, rng.randint(1, 50), rng.choice(["movable", "temporary", "reclaimed"])))
            live.append(name)
    for pool_type in (BestFitPool, GTBMPool):
        capacity = minimal_capacity(trace, pool_type)
        pool = pool_type(capacity)
        assert replay(trace, pool).fits
        # after everything is freed, the main space is one hole again
        trace_all_freed = trace + [Free(name) for name in live]
        pool = pool_type(capacity)
        replay(trace_all_freed, pool)
        assert pool.main.holes == ([(0, capacity)] if capacity else [])


def test_bad_traces():
    with pytest.raises(InvalidInput, match="freed but not allocated"):
        replay([Free("x")], BestFitPool(10))
    with pytest.raises(InvalidInput, match="allocated twice"):
        replay([Alloc("x", 1), Alloc("x", 1)], BestFitPool(10))
    with pytest.raises(InvalidInput, match="mobility"):
        Alloc("x", 1, "pinned")
    with pytest.raises(InvalidInput, match="bytes"):
        Alloc("x", 0)


def test_gtbm_temporary_takes_the_smallest_fitting_hole_at_its_high_end():
    pool = GTBMPool(1000)
    replay([Alloc("a", 100), Alloc("b", 200), Alloc("c", 100), Alloc("d", 300), Free("b")], pool)
    assert pool.main.holes == [(100, 300), (700, 1000)]
    # holes of 200 and 300: a temporary of 150 goes to the 200 one, at its top
    assert pool.place(Alloc("t", 150, "temporary")) == ("main", 150)
