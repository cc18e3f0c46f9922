import pytest

from ucudnn.benchmark import batch_sizes, measure_table, parse_policy
from ucudnn.errors import InvalidInput
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
    table, stats = measure_table(backend, problem, [1, 2, 4], algos=["im2col_gemm", "shift_gemm"], reps=1,
                                 workspace_limit=limit)
    assert sorted(table) == [1, 2, 4]
    assert stats.measured == 5 and stats.cached == 0  # im2col_gemm at 4 exceeds the limit: not run
    too_big = table[4][0]
    assert too_big.algo == "im2col_gemm" and not too_big.usable and "over the limit" in too_big.reason
    assert all(m.usable for size in (1, 2) for m in table[size])
