"""The cpu backend on every form of problem (1-D, 2-D, 3-D; plain, grouped, dilated, strided,
padded; transposed with output padding), every kind and algorithm: against the float64 reference
(`ucudnn.reference`, itself checked against torch in test_reference.py) on fresh random data,
micro-batched against undivided, temporaries from the declared workspace only."""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest
from conv_reference import FORMS, is_1d
from test_cpu_backend import PYTHON_OBJECTS_ALLOWANCE_BYTES, ufunc_buffers_bytes
from ucudnn.solver.types import Configuration, MicroConfig

from ucudnn.backends.cpu import ALGORITHMS, CpuBackend
from ucudnn.errors import UnsupportedProblem
from ucudnn.kernel.run import run_configuration
from ucudnn.problem import KINDS, ConvProblem
from ucudnn.reference import reference, relative_error

BACKEND = CpuBackend()
ALL_ALGOS = BACKEND.algorithms(ConvProblem())
TOLERANCE = {"float32": 2e-5, "float64": 1e-12}


def fresh(problem: ConvProblem, seed: int) -> dict[str, np.ndarray]:
    ops = BACKEND.random_operands(problem, seed=seed)
    ops["out"] = np.full(problem.out_shape, np.nan, ops["out"].dtype)  # beta = 0 must not read it
    return ops


def nan_workspace(nbytes: int) -> np.ndarray:
    workspace = BACKEND.empty_workspace(nbytes)
    workspace.fill(0xFF)  # NaN bit patterns: reading memory before writing it shows
    return workspace


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("algo", ALL_ALGOS)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name", FORMS)
def test_every_form_matches_the_reference_undivided_and_micro_batched(name, kind, algo, dtype):
    problem = ConvProblem.parse(FORMS[name] + f",dtype={dtype}").with_kind(kind)
    reason = BACKEND.unsupported_reason(problem, algo)
    if reason is not None:
        # Only winograd lacks forms: 3-D, or a filter other than 3x3 at stride 1 (every 1-D one).
        assert algo == "winograd" and (
            problem.d
            or is_1d(problem)
            or problem.stride_h > 1
            or problem.dilation_w > 1
            or (problem.r, problem.s) != (3, 3)
        ), reason
        with pytest.raises(UnsupportedProblem, match="winograd"):
            BACKEND.workspace_size(problem, algo)
        return
    seed = hash((name, kind, algo, dtype)) % 2**32
    ops = fresh(problem, seed)
    inputs = {k: v for k, v in ops.items() if k != "out"}
    expected = reference(problem, **inputs)
    BACKEND.run(problem, algo, workspace=nan_workspace(BACKEND.workspace_size(problem, algo)), **ops)
    undivided = ops["out"].astype(np.float64)
    assert relative_error(undivided, expected) < TOLERANCE[dtype], (name, kind, algo)

    sizes = (problem.n - problem.n // 2, problem.n // 2)
    micros = tuple(MicroConfig(algo, b, 0.0, BACKEND.workspace_size(problem.with_batch(b), algo)) for b in sizes)
    out = np.full(problem.out_shape, np.nan, ops["out"].dtype)
    run_configuration(
        BACKEND,
        problem,
        Configuration(micros),
        out=out,
        workspace=nan_workspace(max(m.workspace for m in micros)),
        **inputs,
    )
    micro = out.astype(np.float64)
    assert relative_error(micro, expected) < TOLERANCE[dtype], (name, kind, algo, "micro-batched")
    assert relative_error(micro, undivided) < TOLERANCE[dtype], (name, kind, algo, "micro vs undivided")


@pytest.mark.parametrize("kind", KINDS)
def test_winograd_says_why_it_skips_3d(kind):
    problem = ConvProblem.parse("n=2,c=4,d=6,h=6,w=6,k=4,t=3,r=3,s=3,pad=1").with_kind(kind)
    reason = BACKEND.unsupported_reason(problem, "winograd")
    assert reason is not None and "has no 3-D form" in reason and "\n" not in reason
    assert all(BACKEND.unsupported_reason(problem, algo) is None for algo in ALL_ALGOS if algo != "winograd")
    two = ConvProblem.parse("n=2,c=4,h=6,w=6,k=4,r=3,s=3,pad=1").with_kind(kind)
    assert BACKEND.unsupported_reason(two, "winograd") is None


def test_winograd_runs_a_transposed_stride_1_layer():
    # The lowered convolution of a stride-1 transposed 3x3 is a 3x3 stride-1 convolution.
    problem = ConvProblem.parse("n=2,c=4,h=6,w=5,k=6,r=3,s=3,pad=1,transposed=1")
    assert BACKEND.unsupported_reason(problem, "winograd") is None
    ops = fresh(problem, 3)
    BACKEND.run(problem, "winograd", workspace=nan_workspace(BACKEND.workspace_size(problem, "winograd")), **ops)
    assert relative_error(ops["out"].astype(np.float64), reference(problem, x=ops["x"], w=ops["w"])) < 2e-5


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("algo", ALGORITHMS)
@pytest.mark.parametrize(
    "spec",
    [
        "n=3,c=8,d=9,h=10,w=11,k=12,t=3,r=3,s=3,pad=1,stride_w=2,groups=2",
        "n=3,c=12,h=9,w=10,k=8,r=3,s=3,pad=1,stride=2,transposed=1,output_padding=1",
        "n=2,c=12,d=5,h=6,w=5,k=8,t=2,r=2,s=2,stride=2,transposed=1",
        "n=4,c=16,h=1,w=300,k=16,r=1,s=9,pad_w=4,stride_w=2",
    ],
)
def test_new_forms_take_temporaries_from_the_workspace(spec, algo, kind):
    """The declared workspace is the truth for 3-D, transposed and 1-D problems too (native is
    exempt, as in test_cpu_backend: torch's allocator is invisible to tracemalloc)."""
    problem = ConvProblem.parse(spec).with_kind(kind)
    if BACKEND.unsupported_reason(problem, algo):
        pytest.skip(BACKEND.unsupported_reason(problem, algo))
    ops = BACKEND.random_operands(problem, seed=5)
    workspace = BACKEND.empty_workspace(BACKEND.workspace_size(problem, algo))
    BACKEND.run(problem, algo, workspace=workspace, **ops)  # warm caches (FFT plans, imports)
    allowance = PYTHON_OBJECTS_ALLOWANCE_BYTES + ufunc_buffers_bytes(problem.dtype)
    tracemalloc.start()
    try:
        BACKEND.run(problem, algo, workspace=workspace, alpha=0.5, beta=2.0, **ops)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak <= allowance, (
        f"{algo} {kind} allocated {peak} bytes outside its workspace "
        f"({workspace.nbytes} bytes declared; allowance {allowance})"
    )


def test_a_transposed_problem_sizes_its_workspace_as_its_convolution():
    problem = ConvProblem.parse("n=2,c=8,d=4,h=4,w=4,k=4,t=2,r=2,s=2,stride=2,transposed=1")
    for algo in ALGORITHMS:
        if algo != "winograd":
            assert BACKEND.workspace_size(problem, algo) == BACKEND.workspace_size(problem.lowered(), algo)
    # native's estimate: the result plus the unfolded columns of the equivalent convolution
    cols = 2 * 4 * 8 * 64  # n * (its input channels, k) * taps * (its output positions, x's)
    assert BACKEND.workspace_size(problem, "native") == (np.prod(problem.y_shape) + cols) * 4
