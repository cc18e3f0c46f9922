"""The cudnn backend on a real GPU. Every test skips, saying why, where CuPy, a GPU or libcudnn is missing."""

from __future__ import annotations

import logging
import math

import numpy as np
import pytest
from ucudnn.solver.types import Configuration, MicroConfig

from ucudnn.errors import BackendUnavailable
from ucudnn.kernel.run import run_configuration
from ucudnn.kernel.selftest import DEFAULT_PROBLEMS, TOLERANCE, run_selftest
from ucudnn.problem import KINDS, ConvProblem
from ucudnn.reference import reference, relative_error, to_host_float64

pytestmark = pytest.mark.gpu

# A layer big enough that engines differ in speed and workspace, small enough to time in seconds.
TIMED = ConvProblem.parse("n=8,c=32,h=28,w=28,k=64,r=3,s=3,pad=1")


@pytest.fixture(scope="module")
def backend():
    from ucudnn.backends.cudnn import CudnnBackend

    try:
        return CudnnBackend()
    except BackendUnavailable as exc:
        pytest.skip(f"the cudnn backend cannot run here: {exc}")


@pytest.mark.parametrize("kind", KINDS)
def test_each_kind_matches_the_float64_reference(backend, kind):
    # Every algorithm offered, undivided, alpha/beta and micro-batched, on every default problem.
    report = run_selftest(backend, kinds=[kind])
    assert report.passed, report.format()
    assert report.count("pass") >= len(DEFAULT_PROBLEMS)


def test_micro_batched_matches_undivided(backend):
    report = run_selftest(backend, problems=DEFAULT_PROBLEMS[:2])
    # An engine wrong micro-batched (eng70's bwd_filter accumulating, on an H200) is excluded: measurement
    # rejects it at that size, so no plan runs it; every engine a plan may run must match.
    assert all(c.reason.endswith("measurement rejects it") for c in report.checks if c.status == "excluded")
    compared = [c for c in report.checks if c.error_micro_undivided is not None and c.status != "excluded"]
    assert compared, report.format()
    assert all(c.error_micro_undivided <= c.tolerance for c in compared), report.format()
    assert {c.kind for c in compared} == set(KINDS)  # bwd_filter accumulated over two micro-batches


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_precision_offers_and_passes_float32_compute(backend, dtype):
    problem = ConvProblem.parse(f"{DEFAULT_PROBLEMS[0]},dtype={dtype}")
    algos = backend.algorithms(problem)
    assert any(a.endswith("+fp32acc") for a in algos), algos
    report = run_selftest(backend, problems=DEFAULT_PROBLEMS[:1], dtype=dtype)
    assert report.passed, report.format()
    assert any(c.algo.endswith("+fp32acc") and c.status == "pass" for c in report.checks), report.format()


def test_measure_returns_finite_times(backend):
    algos = backend.algorithms(TIMED)
    assert algos, "cuDNN offered no engine config for a plain 3x3 convolution"
    results = backend.measure(TIMED, algos, reps=3)
    assert [m.algo for m in results] == algos
    usable = [m for m in results if m.usable]
    assert usable, [m.reason for m in results]
    assert all(m.time > 0 and math.isfinite(m.time) and m.workspace >= 0 and m.batch == TIMED.n for m in usable)
    assert all(m.reason for m in results if not m.usable)


def test_rebuild_from_name_round_trip(backend):
    from ucudnn.backends.cudnn import CudnnBackend

    best = min((m for m in backend.measure(TIMED, backend.algorithms(TIMED), reps=2) if m.usable), key=lambda m: m.time)
    fresh = CudnnBackend()  # empty caches: the name is all it gets, as from the measurement cache
    for problem in (TIMED, TIMED.with_batch(3)):
        assert fresh.unsupported_reason(problem, best.algo) is None
        if problem is TIMED:
            assert fresh.workspace_size(problem, best.algo) == best.workspace
        operands = fresh.random_operands(problem, seed=5)
        workspace = fresh.empty_workspace(fresh.workspace_size(problem, best.algo))
        fresh.run(problem, best.algo, workspace=workspace, **operands)
        expected = reference(
            problem, x=to_host_float64(operands["x"], "float32"), w=to_host_float64(operands["w"], "float32")
        )
        assert relative_error(to_host_float64(operands["out"], "float32"), expected) <= TOLERANCE["float32"]


def test_runs_on_the_current_cupy_stream(backend):
    import cupy

    problem = TIMED.with_kind("bwd_filter")
    algo = next(a for a in backend.algorithms(problem) if backend.unsupported_reason(problem, a) is None)
    operands = backend.random_operands(problem, seed=2)
    parts = (5, 3)
    micros = tuple(MicroConfig(algo, b, 0.0, backend.workspace_size(problem.with_batch(b), algo)) for b in parts)
    stream = cupy.cuda.Stream(non_blocking=True)
    cupy.cuda.get_current_stream().synchronize()  # the operands were made on the null stream, which it skips
    with stream:
        run_configuration(backend, problem, Configuration(micros), **operands)
    stream.synchronize()
    expected = reference(
        problem, x=to_host_float64(operands["x"], "float32"), dy=to_host_float64(operands["dy"], "float32")
    )
    assert relative_error(to_host_float64(operands["out"], "float32"), expected) <= TOLERANCE["float32"]


def test_auto_picks_cudnn_and_says_why(backend, caplog):
    from ucudnn.backends import get_backend

    with caplog.at_level(logging.INFO, logger="ucudnn.backends"):
        chosen = get_backend("auto")
    assert chosen.name == "cudnn"
    (line,) = [r.getMessage() for r in caplog.records if "backend auto" in r.getMessage()]
    assert "chose cudnn" in line and backend.device.model in line


def test_device_description(backend):
    versions = dict(backend.device.versions)
    assert {"cudnn", "cudnn-frontend", "cupy", "cuda-runtime"} <= set(versions)
    assert backend.device.memory_bytes > 0 and "sm_" in backend.device.model
    assert np.all([v for v in versions.values()])
