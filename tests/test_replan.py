"""A planned algorithm that cannot run never fails a convolution (issue 9.2).

A first process plans with `shift_gemm` made the fastest and stores the plan; in a later process
(a new library version) `shift_gemm` cannot be built (declared unsupported) or fails while
running. The Handle records it as unusable in the cache with the reason, re-plans, returns the
right result and warns once.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
from ucudnn.db import Cache

from ucudnn import Handle
from ucudnn.backends.cpu import CpuBackend
from ucudnn.errors import UnsupportedProblem
from ucudnn.handle import PlanFailureWarning
from ucudnn.kernel.measure import device_key
from ucudnn.problem import ConvProblem
from ucudnn.reference import reference

ALGOS = ("shift_gemm", "im2col_gemm")
PROBLEM = ConvProblem.parse("n=8,c=3,h=10,w=10,k=4,r=3,s=3,pad=1")


class ShiftFastest(CpuBackend):
    """Measurements say shift_gemm is by far the fastest."""

    def time_run_ms(self, problem, algo, operands, workspace, reps, beta=0.0):
        times = super().time_run_ms(problem, algo, operands, workspace, reps, beta)
        return [t / 1000 for t in times] if algo == "shift_gemm" else [t * 1000 for t in times]


class ShiftGone(CpuBackend):
    """A later version: shift_gemm no longer builds."""

    def unsupported_reason(self, problem, algo):
        return (
            "shift_gemm was removed in this version"
            if algo == "shift_gemm"
            else super().unsupported_reason(problem, algo)
        )


class ShiftCrashes(CpuBackend):
    """A later version: shift_gemm builds but fails while running, after writing garbage into out."""

    def run(self, problem, algo, *, out, **kwargs):
        if algo == "shift_gemm":
            out[...] = 12345.0
            raise UnsupportedProblem("shift_gemm: launch failed")
        super().run(problem, algo, out=out, **kwargs)


def _operands(rng):
    x = rng.standard_normal(PROBLEM.x_shape).astype(np.float32)
    w = rng.standard_normal(PROBLEM.w_shape).astype(np.float32)
    dy = rng.standard_normal(PROBLEM.y_shape).astype(np.float32)
    return x, w, dy


def _plan_with_shift(db):
    with Handle(backend=ShiftFastest(), db=db, algos=ALGOS) as first:
        x, w, dy = _operands(np.random.default_rng(0))
        first.conv_forward(x, w, padding=1)
        first.conv_backward_filter(x, dy, w_shape=w.shape, padding=1)
        assert {m.algo for c in first.choices() for m in c.config.micros} == {"shift_gemm"}


@pytest.mark.parametrize("later", [ShiftGone, ShiftCrashes])
def test_a_stored_plan_whose_algorithm_fails_is_replanned(tmp_path, later):
    db = str(tmp_path / "cache.db")
    _plan_with_shift(db)
    x, w, dy = _operands(np.random.default_rng(1))
    out = np.random.default_rng(2).standard_normal(PROBLEM.w_shape).astype(np.float32)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with Handle(backend=later(), db=db, algos=ALGOS) as handle:
            y = handle.conv_forward(x, w, padding=1)
            # beta != 0 reads out: a failure while running must not leave half a blend behind
            dw = handle.conv_backward_filter(x, dy, padding=1, out=out.copy(), alpha=0.5, beta=2.0)
            assert {m.algo for c in handle.choices() for m in c.config.micros} == {"im2col_gemm"}
            y_again = handle.conv_forward(x, w, padding=1)
    np.testing.assert_allclose(y, reference(PROBLEM, x=x, w=w), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(y_again, y)
    expected_dw = 0.5 * reference(PROBLEM.with_kind("bwd_filter"), x=x, dy=dy) + 2.0 * out
    np.testing.assert_allclose(dw, expected_dw, rtol=1e-4, atol=1e-3)
    assert [type(w.message) for w in caught] == [PlanFailureWarning]  # once, for two kernels
    assert "shift_gemm" in str(caught[0].message)

    # Recorded in the cache with its reason: a third process neither fails nor warns.
    cache = Cache(db)
    found = cache.lookup(problem_key=PROBLEM.key, batches=[8], algos=["shift_gemm"], **device_key(later()))
    cache.close()
    assert not found["shift_gemm", 8].usable
    assert ("removed in this version" if later is ShiftGone else "failed to run: ") in found["shift_gemm", 8].reason
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with Handle(backend=later(), db=db, algos=ALGOS) as third:
            np.testing.assert_allclose(third.conv_forward(x, w, padding=1), y)


def test_replanning_works_without_a_cache():
    with Handle(backend=ShiftGone(), db=False, algos=ALGOS) as handle:
        # Plan as if shift_gemm were fine (a stale in-memory plan), then run.
        x, w, _ = _operands(np.random.default_rng(3))
        handle._backend = ShiftFastest()
        handle.prepare("fwd", x.shape, w.shape, padding=1)
        handle._backend = ShiftGone()
        with pytest.warns(PlanFailureWarning):
            y = handle.conv_forward(x, w, padding=1)
    np.testing.assert_allclose(y, reference(PROBLEM, x=x, w=w), rtol=1e-4, atol=1e-4)
