"""Candidates pruned before they are timed (issue 36): `measure_table`'s `benchmark_limit` (the backend's
ranking, the limit per size, losses at the next larger size and the smallest), the Handle's and the
CLI's settings, what a pruned run records, and that a second run finds everything in the cache."""

from __future__ import annotations

import json

import pytest
from ucudnn.cli.main import cli
from ucudnn.db import Cache

from ucudnn import Handle, InvalidInput
from ucudnn.backends.cpu import CpuBackend
from ucudnn.kernel.measure import PRUNED, _pruning_order, measure_table
from ucudnn.problem import ConvProblem

PROBLEM = ConvProblem.parse("n=8,c=3,h=6,w=6,k=4,r=3,s=3,pad=1")
ALGOS = ["native", "im2col_gemm", "winograd", "shift_gemm", "fft"]


class Scripted(CpuBackend):
    """The cpu backend whose timings are given per (algo, size) (a default for the rest): the kernels
    still run and are verified; it counts which candidates it was asked to time, and can flag a
    timing as noisy."""

    def __init__(self, times, default=1.0, noisy=()):
        super().__init__()
        self.times, self.default, self.noisy = times, default, set(noisy)
        self.timed: list[tuple[str, int]] = []

    def time_run_ms(self, problem, algo, operands, workspace, reps, beta=0.0):
        self.timed.append((algo, problem.n))
        t = self.times.get((algo, problem.n), self.default)
        if (algo, problem.n) in self.noisy:  # a spread of half the median
            return [t * 0.5, t, t * 1.5]
        return [t] * reps


def table_of(backend, limit, sizes=(1, 2, 4, 8), front=False, cache=None, algos=ALGOS, workspace_limit=None):
    return measure_table(
        backend,
        PROBLEM,
        list(sizes),
        algos=algos,
        reps=3,
        benchmark_limit=limit,
        front=front,
        cache=cache,
        workspace_limit=workspace_limit,
    )


def test_pruning_order_takes_the_largest_then_the_smallest_then_down():
    assert _pruning_order([1, 2, 4, 8, 16]) == [16, 1, 8, 4, 2]
    assert _pruning_order([4]) == [4] and _pruning_order([2, 4]) == [4, 2]


def test_without_a_limit_every_candidate_is_timed():
    backend = Scripted({})
    _table, stats = table_of(backend, 0)
    assert sorted(backend.timed) == sorted((a, s) for a in ALGOS for s in (1, 2, 4, 8))
    assert stats.pruned == 0 and stats.measured == stats.candidates == 20


def test_the_limit_times_the_backends_best_ranked_first():
    backend = Scripted({})
    table, stats = table_of(backend, 2)
    # the cpu ranking: native, im2col_gemm, winograd, shift_gemm, fft
    assert sorted(backend.timed) == sorted((a, s) for a in ("native", "im2col_gemm") for s in (1, 2, 4, 8))
    assert stats.pruned == 12 and stats.candidates == 20
    for row in table.values():
        assert [m.algo for m in row] == ALGOS  # the caller's order, every candidate present
        for m in row:
            if m.algo not in ("native", "im2col_gemm"):
                assert m.time == float("inf") and m.reason == f"{PRUNED}beyond the benchmark limit of 2 candidates"


def test_a_clear_loser_at_the_larger_size_and_the_smallest_is_not_timed_between():
    # fft loses 3x to native at 8 and at 1: not timed at 4 and 2; shift_gemm loses only at 8: still timed
    times = {("fft", 8): 3.0, ("fft", 1): 3.0, ("shift_gemm", 8): 3.0}
    backend = Scripted(times)
    table, stats = table_of(backend, 10)
    assert ("fft", 4) not in backend.timed and ("fft", 2) not in backend.timed
    assert ("shift_gemm", 4) in backend.timed and ("shift_gemm", 2) in backend.timed
    assert stats.pruned == 2
    reason = next(m.reason for m in table[4] if m.algo == "fft")
    assert reason.startswith(PRUNED) and "slower than" in reason and "micro-batch 1" in reason


def test_a_noisy_timing_prunes_nothing():
    times = {("fft", 8): 3.0, ("fft", 1): 3.0}
    backend = Scripted(times, noisy={("fft", 8)})
    _, stats = table_of(backend, 10)
    assert ("fft", 4) in backend.timed and stats.pruned == 0


def test_a_loser_is_timed_where_its_winners_do_not_fit():
    # fft loses 3x to im2col_gemm at 8 and at 1, but im2col_gemm's workspace (scripted) is over the limit at 4
    class Hungry(Scripted):
        def workspace_size(self, problem, algo):
            return 10**9 if (algo, problem.n) == ("im2col_gemm", 4) else super().workspace_size(problem, algo)

    backend = Hungry({("fft", 8): 3.0, ("fft", 1): 3.0})
    algos = ["im2col_gemm", "fft"]
    limit = 10**8
    table, stats = table_of(backend, 10, algos=algos, workspace_limit=limit)
    assert ("fft", 4) in backend.timed and table[4][0].reason.startswith("needs ")
    # at 2 its winner fits again, but fft did not lose at 4 (the next larger size, where it ran alone)
    assert ("fft", 2) in backend.timed and stats.pruned == 0


def test_with_a_front_only_a_winner_needing_no_more_workspace_prunes():
    # native is 3x faster than shift_gemm but declares more workspace: on a Pareto front shift_gemm stays
    backend = Scripted({("shift_gemm", 8): 3.0, ("shift_gemm", 1): 3.0}, default=1.0)
    algos = ["native", "shift_gemm"]
    _, wr_stats = table_of(backend, 10, algos=algos)
    assert wr_stats.pruned == 2
    backend = Scripted({("shift_gemm", 8): 3.0, ("shift_gemm", 1): 3.0}, default=1.0)
    _, front_stats = table_of(backend, 10, algos=algos, front=True)
    assert front_stats.pruned == 0 and ("shift_gemm", 4) in backend.timed


def test_a_second_run_on_the_cache_times_nothing_and_prunes_the_same(tmp_path):
    times = {("fft", 8): 3.0, ("fft", 1): 3.0, ("winograd", 8): 2.0, ("winograd", 1): 2.0}
    cache = Cache(f"sqlite:///{tmp_path}/c.db")
    first_backend = Scripted(times)
    first, s1 = table_of(first_backend, 10, cache=cache)
    again_backend = Scripted(times)
    again, s2 = table_of(again_backend, 10, cache=cache)
    cache.close()
    assert again_backend.timed == [] and s2.measured == 0
    assert s2.cached == s1.measured and s2.pruned == s1.pruned == 4
    assert again == first


def test_bad_benchmark_limits_are_refused():
    with pytest.raises(InvalidInput, match="benchmark_limit"):
        table_of(Scripted({}), -1)
    with pytest.raises(InvalidInput, match="benchmark_limit"):
        Handle(backend="cpu", db=False, benchmark_limit=-3)
    with pytest.raises(InvalidInput, match="benchmark_limit"):
        Handle(backend="cpu", db=False, benchmark_limit=2.5)


def test_the_handle_prunes_records_it_in_the_stored_plan_and_a_second_handle_measures_nothing(tmp_path):
    times = {("fft", 8): 3.0, ("fft", 1): 3.0}
    db = f"sqlite:///{tmp_path}/c.db"
    handle = Handle(backend=Scripted(times), db=db, algos=ALGOS, reps=1, benchmark_limit=10)
    assert handle.benchmark_limit == 10
    config = handle.prepare("fwd", PROBLEM.x_shape, PROBLEM.w_shape, padding=1)
    assert handle.stats.pruned == 2 and "fft" not in {m.algo for m in config.micros}
    handle.close()
    cache = Cache(db)
    plans = [json.loads(record.plan_json) for record in cache.plan_records()]
    cache.close()
    assert [sorted((a, s) for a, s, _ in p["pruned"]) for p in plans] == [[("fft", 2), ("fft", 4)]]
    second = Handle(backend=Scripted(times), db=db, algos=ALGOS, reps=1)
    assert second.prepare("fwd", PROBLEM.x_shape, PROBLEM.w_shape, padding=1) == config
    assert second.stats.measured == 0
    # an exhaustive handle has its own plan: it times what the pruned one did not
    full = Handle(backend=Scripted(times), db=db, algos=ALGOS, reps=1, benchmark_limit=0)
    full.prepare("fwd", PROBLEM.x_shape, PROBLEM.w_shape, padding=1)
    assert full.stats.measured == 2 and full.stats.pruned == 0


def test_the_cli_prunes_by_default_and_exhaustive_times_everything(tmp_path, capsys):
    from click.testing import CliRunner

    layer = "n=4,c=3,h=8,w=8,k=4,r=3,s=3,pad=1"
    reports = {}
    for flag in ([], ["--exhaustive"], ["--benchmark-limit", "1"]):
        result = CliRunner().invoke(
            cli,
            [
                "bench",
                "--layer",
                layer,
                "--backend",
                "cpu",
                "--reps",
                "1",
                "--json",
                "--kinds",
                "fwd",
                "--db",
                str(tmp_path / f"{len(flag)}.db"),
                *flag,
            ],
        )
        assert result.exit_code == 0, result.output
        reports[" ".join(flag)] = json.loads(result.stdout)["benchmark"]
    assert reports["--exhaustive"]["pruned"] == 0
    assert reports["--exhaustive"]["measured"] == reports["--exhaustive"]["candidates"] == 15
    one = reports["--benchmark-limit 1"]
    assert one["measured"] == 3 and one["pruned"] == 12  # one candidate at each of the sizes 1, 2 and 4
    result = CliRunner().invoke(cli, ["bench", "--layer", layer, "--benchmark-limit", "-1"])
    assert result.exit_code == 2
