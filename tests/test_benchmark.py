import pytest

from ucudnn.errors import InvalidInput
from ucudnn.kernel.measure import batch_sizes, measure_table, parse_policy
from ucudnn.problem import ConvProblem


def test_policies():
    assert batch_sizes("all", 5) == [1, 2, 3, 4, 5]
    assert batch_sizes("powerOfTwo", 48) == [1, 2, 4, 8, 16, 32, 48]
    assert batch_sizes("powerOfTwo", 32) == [1, 2, 4, 8, 16, 32]
    assert batch_sizes("undivided", 7) == [7]
    assert batch_sizes(parse_policy("8,2,64"), 32) == [2, 8]
    with pytest.raises(InvalidInput):
        parse_policy("some")
    with pytest.raises(InvalidInput):
        parse_policy("0,4")
    with pytest.raises(InvalidInput):
        batch_sizes("all", 0)


def test_measure_table_skips_what_exceeds_the_limit_and_records_why():
    from ucudnn.backends.cpu import CpuBackend

    backend = CpuBackend()
    problem = ConvProblem.parse("n=4,c=4,h=10,w=10,k=8,r=3,s=3,pad=1")
    limit = backend.workspace_size(problem.with_batch(2), "im2col_gemm")
    table, stats = measure_table(
        backend, problem, [1, 2, 4], algos=["im2col_gemm", "shift_gemm"], reps=1, workspace_limit=limit
    )
    assert sorted(table) == [1, 2, 4]
    assert stats.measured == 5 and stats.cached == 0  # im2col_gemm at 4 exceeds the limit: not run
    too_big = table[4][0]
    assert too_big.algo == "im2col_gemm" and not too_big.usable and "over the limit" in too_big.reason
    assert all(m.usable for size in (1, 2) for m in table[size])


def test_confirm_faster_keeps_the_configuration_that_runs_faster(monkeypatch):
    from ucudnn.solver.types import Configuration, MicroConfig

    from ucudnn.backends.cpu import CpuBackend
    from ucudnn.kernel import measure
    from ucudnn.kernel.measure import confirm_faster

    class SlowShift(CpuBackend):
        """shift_gemm really takes 30 ms longer per call, whatever a table claims; every run also takes
        0.1 ms per sample. The runs compute; their time passes on a stand-in clock that confirm_faster
        reads (`measure.run_clock`), not on the wall clock of a loaded machine."""

        seconds = 0.0

        def run(self, problem, algo, **kwargs):
            super().run(problem, algo, **kwargs)
            self.seconds += (0.030 if algo == "shift_gemm" else 0.0) + 1e-4 * problem.n

    backend = SlowShift()
    monkeypatch.setattr(measure, "run_clock", lambda: backend.seconds)
    problem = ConvProblem.parse("n=8,c=8,h=16,w=16,k=8,r=3,s=3,pad=1")
    baseline = MicroConfig("im2col_gemm", 8, 1.0, backend.workspace_size(problem, "im2col_gemm"))
    one = backend.workspace_size(problem.with_batch(1), "shift_gemm")
    claimed_fast = Configuration((MicroConfig("shift_gemm", 1, 0.01, one),) * 8)
    assert confirm_faster(backend, problem, claimed_fast, baseline, reps=3) == Configuration((baseline,))
    # And the other way round: a micro-batched im2col plan beats an undivided shift_gemm run.
    slow_baseline = MicroConfig("shift_gemm", 8, 0.01, backend.workspace_size(problem, "shift_gemm"))
    split = Configuration(
        (MicroConfig("im2col_gemm", 4, 1.0, backend.workspace_size(problem.with_batch(4), "im2col_gemm")),) * 2
    )
    assert confirm_faster(backend, problem, split, slow_baseline, reps=3) is split
    same = Configuration((baseline,))
    assert confirm_faster(backend, problem, same, baseline) is same
    assert confirm_faster(backend, problem, claimed_fast, None) is claimed_fast
