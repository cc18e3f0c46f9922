"""Every measured candidate is checked against a trusted result before it can be chosen (issue 9.3).

A CPU backend with two extra algorithms that are the fastest and wrong: one scales the result, one
reads workspace it never wrote (right on zeroed memory, NaN on the verified run's 0xFF fill).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from ucudnn.db import Cache
from ucudnn.solver import wr

from ucudnn.backends.base import reduction_length, verification_tolerance
from ucudnn.backends.cpu import CpuBackend
from ucudnn.kernel.measure import measure_table
from ucudnn.network.optimize import expand_kernels, optimize
from ucudnn.problem import KINDS, ConvProblem

SCALED, STALE = "fast_scaled", "fast_stale_workspace"
PROBLEM = ConvProblem.parse("n=4,c=3,h=9,w=8,k=4,r=3,s=3,pad=1,stride=2")


class WrongFast(CpuBackend):
    """The CPU backend plus two wrong algorithms that take no time at all (faster than any other)."""

    def algorithms(self, problem):
        return [*super().algorithms(problem), SCALED, STALE]

    def unsupported_reason(self, problem, algo):
        return None if algo in (SCALED, STALE) else super().unsupported_reason(problem, algo)

    def workspace_size(self, problem, algo):
        return 64 if algo in (SCALED, STALE) else super().workspace_size(problem, algo)

    def run(self, problem, algo, *, workspace, alpha=1.0, beta=0.0, **operands):
        if algo not in (SCALED, STALE):
            return super().run(problem, algo, workspace=workspace, alpha=alpha, beta=beta, **operands)
        out = operands["out"]
        super().run(
            problem,
            "im2col_gemm",
            alpha=alpha,
            beta=beta,
            **operands,
            workspace=np.zeros(super().workspace_size(problem, "im2col_gemm"), np.uint8),
        )
        if algo == SCALED:
            out *= 1.5
        else:  # adds 0 * (what the workspace held): right on zeros, NaN on 0xFF
            out += 0.0 * workspace[:4].view(np.float32)[0]

    def time_run_ms(self, problem, algo, operands, workspace, reps, beta=0.0):
        times = super().time_run_ms(problem, algo, operands, workspace, reps, beta)
        return [0.0] * reps if algo in (SCALED, STALE) else times


@pytest.mark.parametrize("kind", KINDS)
def test_wrong_algorithms_are_unusable_with_their_reason(kind):
    backend = WrongFast()
    problem = PROBLEM.with_kind(kind)
    results = {m.algo: m for m in backend.measure(problem, backend.algorithms(problem), reps=1)}
    for algo in (SCALED, STALE):
        assert not results[algo].usable and results[algo].reason.startswith("wrong result (rel. error ")
    assert float(results[SCALED].reason.split()[-1].rstrip(")")) == pytest.approx(0.5, rel=1e-3)
    assert results[STALE].reason == "wrong result (rel. error inf)"
    # every real algorithm passes verification
    assert all(
        m.usable
        for a, m in results.items()
        if a not in (SCALED, STALE) and backend.unsupported_reason(problem, a) is None
    )


def test_a_wrong_algorithm_is_never_chosen_and_stays_recorded(tmp_path):
    backend = WrongFast()
    cache = Cache(f"sqlite:///{tmp_path / 'cache.db'}")
    kernels = expand_kernels([("layer", PROBLEM)], PROBLEM.n)
    report = optimize(backend, kernels, policy="powerOfTwo", cache=cache, reps=1)
    for k in report.kernels:
        assert not {m.algo for m in k.config.micros} & {SCALED, STALE}
        assert k.baseline.algo not in (SCALED, STALE)
        assert {m.algo for m in k.excluded} == {SCALED, STALE}
    data = report.to_json()
    assert data["kernels"][0]["excluded"][0]["reason"].startswith("wrong result")
    # The verdict is in the cache: a later run reads it instead of measuring again.
    table, stats = measure_table(backend, PROBLEM, [1, 2, 4], cache=cache, reps=1)
    assert stats.measured == 0
    assert all(
        not m.usable and m.reason.startswith("wrong result")
        for row in table.values()
        for m in row
        if m.algo in (SCALED, STALE)
    )
    assert SCALED not in {m.algo for m in wr.solve(table, PROBLEM.n, None).micros}
    cache.close()


def test_the_trusted_result_is_computed_once_per_measure_call(monkeypatch):
    backend = WrongFast()
    calls = []
    original = CpuBackend.trusted_result
    monkeypatch.setattr(CpuBackend, "trusted_result", lambda self, p, i: calls.append(p) or original(self, p, i))
    backend.measure(PROBLEM, backend.algorithms(PROBLEM), reps=1)
    assert len(calls) == 1


def test_tolerance_scales_with_reduction_length_and_precision():
    big = ConvProblem.parse("n=16,c=64,h=224,w=224,k=64,r=3,s=3,pad=1,kind=bwd_filter")
    assert reduction_length(big) == 16 * 224 * 224
    tf32 = verification_tolerance(big, tf32=True)
    # correct H100 engines reached 5.7e-3 here under TF32; the wrong eng70 gave 1.54 (or NaN)
    assert 5.7e-3 * 3 < tf32 < 1.54 / 3
    assert verification_tolerance(big) < tf32  # true float32 arithmetic is tighter
    small = PROBLEM.with_kind("fwd")
    assert reduction_length(small) == 27 and verification_tolerance(small) < verification_tolerance(big)
    assert verification_tolerance(small.__class__.parse(small.spec + ",dtype=float64")) < 1e-12
    half = ConvProblem.parse("n=1,c=4,h=4,w=4,k=4,r=1,s=1,dtype=float16")
    assert verification_tolerance(half) > verification_tolerance(small)
    assert not math.isnan(verification_tolerance(half))


def test_bwd_filter_micro_batches_are_timed_as_they_run():
    # run_configuration accumulates every bwd_filter micro-batch after the first with beta = 1;
    # the measurement of a size below the batch charges that, the undivided one does not.
    seen = []

    class Spy(CpuBackend):
        def time_run_ms(self, problem, algo, operands, workspace, reps, beta=0.0):
            seen.append((problem.kind, problem.n, beta))
            return super().time_run_ms(problem, algo, operands, workspace, reps, beta)

    for kind in ("bwd_filter", "fwd"):
        measure_table(Spy(), PROBLEM.with_kind(kind), [1, 2, 4], algos=["im2col_gemm"], reps=1)
    assert seen == [
        ("bwd_filter", 1, 1.0),
        ("bwd_filter", 2, 1.0),
        ("bwd_filter", 4, 0.0),
        ("fwd", 1, 0.0),
        ("fwd", 2, 0.0),
        ("fwd", 4, 0.0),
    ]
