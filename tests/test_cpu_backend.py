"""The cpu backend: every algorithm and kind against an independent float64 reference."""

from __future__ import annotations

import math
import tracemalloc

import numpy as np
import pytest
from conv_reference import assert_close, numpy_reference, reference, torch

from ucudnn.backends.base import DeviceInfo
from ucudnn.backends.cpu import ALGORITHMS, NATIVE, CpuBackend
from ucudnn.errors import InvalidInput, UnsupportedProblem
from ucudnn.problem import KINDS, ConvProblem

BACKEND = CpuBackend()
ALL_ALGOS = BACKEND.algorithms(ConvProblem())

# Varied shapes: each exercises a different corner of the index arithmetic.
PROBLEMS = {
    "plain": "n=1,c=3,h=8,w=9,k=4,r=3,s=3",
    "pad": "n=3,c=4,h=9,w=8,k=6,r=3,s=3,pad=1",
    "stride2": "n=3,c=4,h=11,w=10,k=6,r=3,s=3,pad=1,stride=2",
    "dilation2": "n=1,c=3,h=12,w=11,k=4,r=3,s=3,pad=2,dilation=2",
    "groups2": "n=3,c=4,h=9,w=10,k=6,r=3,s=3,pad=1,groups=2",
    "depthwise": "n=1,c=4,h=9,w=10,k=4,r=3,s=3,pad=1,groups=4",
    "kernel20x5": "n=1,c=2,h=28,w=12,k=3,r=20,s=5,pad_h=3,pad_w=2",
    "pad_beyond_kernel": "n=3,c=2,h=6,w=7,k=3,r=3,s=3,pad=4",
    "mixed_axes": "n=1,c=3,h=12,w=13,k=5,r=5,s=4,pad_h=2,pad_w=1,stride_h=2,stride_w=3,dilation_w=2",
    "pointwise": "n=3,c=5,h=6,w=7,k=4,r=1,s=1",
    "image700x161": "n=1,c=1,h=700,w=161,k=2,r=7,s=5,pad_h=3,pad_w=2,stride=2",
    "image700x161_3x3": "n=1,c=1,h=700,w=161,k=2,r=3,s=3,pad=1",
}

# tracemalloc sees every NumPy data allocation. During `run` the only ones allowed are small and
# independent of the problem size:
#  - Python objects (array views, slices, tuples) and SciPy's BLAS wrapper bookkeeping: 32 KiB;
#  - NumPy's ufunc iterator buffers: when operand strides do not line up (transposed or strided
#    views), a ufunc call buffers up to `np.getbufsize()` elements for each of its (at most 3)
#    operands, however large the arrays are.
# Anything an algorithm allocated instead of carving it from its workspace scales with the problem
# and breaks this bound on the problems below, whose workspaces are far larger.
PYTHON_OBJECTS_ALLOWANCE_BYTES = 32 * 1024


def ufunc_buffers_bytes(dtype: str) -> int:
    return 3 * np.getbufsize() * np.dtype(dtype).itemsize


def operands(problem: ConvProblem, seed: int) -> dict[str, np.ndarray]:
    ops = BACKEND.random_operands(problem, seed=seed)
    ops["out"] = np.full(problem.out_shape, np.nan, ops["out"].dtype)  # beta = 0 must not read it
    return ops


def nan_workspace(nbytes: int) -> np.ndarray:
    """A workspace full of NaN bit patterns, so that reading memory before writing it shows."""
    workspace = BACKEND.empty_workspace(nbytes)
    workspace.fill(0xFF)
    return workspace


def inputs_of(ops: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {name: ops[name] for name in ("x", "w", "dy") if name in ops}


def run_and_check(problem: ConvProblem, algo: str, seed: int) -> None:
    ops = operands(problem, seed)
    expected = reference(problem, **inputs_of(ops))
    BACKEND.run(problem, algo, workspace=nan_workspace(BACKEND.workspace_size(problem, algo)), **ops)
    assert_close(ops["out"], expected, problem.dtype, f"{algo} {problem.kind} {problem.spec}")


@pytest.mark.parametrize("algo", ALL_ALGOS)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name", PROBLEMS)
def test_matches_reference(name: str, kind: str, algo: str) -> None:
    problem = ConvProblem.parse(PROBLEMS[name]).with_kind(kind)
    reason = BACKEND.unsupported_reason(problem, algo)
    if reason is not None:
        assert algo == "winograd", f"only winograd may refuse these problems; {algo}: {reason}"
        assert "winograd" in reason
        with pytest.raises(UnsupportedProblem, match="winograd"):
            BACKEND.run(problem, algo, workspace=BACKEND.empty_workspace(0), **operands(problem, 0))
        with pytest.raises(UnsupportedProblem):
            BACKEND.workspace_size(problem, algo)
        return
    run_and_check(problem, algo, seed=hash((name, kind, algo)) % 2**32)


@pytest.mark.parametrize("algo", ALL_ALGOS)
@pytest.mark.parametrize("kind", KINDS)
def test_float64_is_exact_to_float64_rounding(kind: str, algo: str) -> None:
    problem = ConvProblem.parse("n=2,c=4,h=9,w=10,k=6,r=3,s=3,pad=1,groups=2,dtype=float64").with_kind(kind)
    run_and_check(problem, algo, seed=7)


@pytest.mark.parametrize("algo", ALL_ALGOS)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("spec", [PROBLEMS["groups2"], "n=2,c=3,h=10,w=9,k=4,r=3,s=3,pad=2,stride=2"])
def test_alpha_beta(spec: str, kind: str, algo: str) -> None:
    problem = ConvProblem.parse(spec).with_kind(kind)
    if BACKEND.unsupported_reason(problem, algo):
        pytest.skip(BACKEND.unsupported_reason(problem, algo))
    ops = BACKEND.random_operands(problem, seed=3)
    ops["out"] = np.random.default_rng(4).standard_normal(problem.out_shape, dtype=np.float32)
    before = ops["out"].copy()
    expected = 0.5 * reference(problem, **inputs_of(ops)) + 2.0 * before
    workspace = nan_workspace(BACKEND.workspace_size(problem, algo))
    BACKEND.run(problem, algo, workspace=workspace, alpha=0.5, beta=2.0, **ops)
    assert_close(ops["out"], expected, "float32", f"{algo} {kind} alpha=0.5 beta=2")
    # beta = 1 accumulates; alpha = 0 with beta = 0 clears whatever was there, NaN included
    ops["out"][...] = before
    BACKEND.run(problem, algo, workspace=workspace, alpha=1.0, beta=1.0, **ops)
    assert_close(ops["out"], reference(problem, **inputs_of(ops)) + before, "float32", f"{algo} {kind} beta=1")
    ops["out"][...] = np.nan
    BACKEND.run(problem, algo, workspace=workspace, alpha=0.0, beta=0.0, **ops)
    assert not np.isnan(ops["out"]).any() and not ops["out"].any()


@pytest.mark.parametrize("algo", ALGORITHMS)
def test_workspace_at_any_address_and_in_a_slice_of_out(algo: str) -> None:
    """A workspace that starts off a 64-byte boundary still suffices; out may be a view."""
    problem = ConvProblem.parse(PROBLEMS["pad"])
    ops = operands(problem, 11)
    nbytes = BACKEND.workspace_size(problem, algo)
    workspace = nan_workspace(nbytes + 3)[3:]
    assert workspace.nbytes == nbytes
    big = np.full((problem.n + 2, *problem.out_shape[1:]), np.nan, np.float32)
    ops["out"] = big[1 : 1 + problem.n]
    BACKEND.run(problem, algo, workspace=workspace, **ops)
    assert_close(ops["out"], reference(problem, **inputs_of(ops)), "float32", algo)
    assert np.isnan(big[0]).all() and np.isnan(big[-1]).all(), "wrote outside its slice of out"


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("algo", ALGORITHMS)
@pytest.mark.parametrize(
    "spec",
    ["n=4,c=64,h=24,w=24,k=32,r=3,s=3,pad=1", "n=4,c=8,h=21,w=19,k=12,r=5,s=3,pad=2,stride=2,dilation_w=2,groups=2"],
)
def test_temporaries_come_from_the_workspace(spec: str, algo: str, kind: str) -> None:
    """No algorithm allocates array memory outside its workspace (native is exempt: torch's own
    allocator is invisible to tracemalloc, and it cannot use our buffer anyway)."""
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
    # Stricter than "workspace + out + allowance": operands and workspace exist before tracing
    # starts, so every byte traced here is a temporary the workspace should have held.
    assert peak <= allowance, (
        f"{algo} {kind} allocated {peak} bytes outside its workspace "
        f"({workspace.nbytes} bytes declared; allowance {allowance})"
    )


def test_workspace_growth_with_batch() -> None:
    """im2col, fft and winograd grow with the batch (the point of micro-batching); shift_gemm does not."""
    for kind in KINDS:
        problem = ConvProblem.parse("c=8,h=12,w=12,k=8,r=3,s=3,pad=1").with_kind(kind)
        sizes = {
            algo: [BACKEND.workspace_size(problem.with_batch(n), algo) for n in (1, 2, 4, 8)] for algo in ALGORITHMS
        }
        assert len(set(sizes["shift_gemm"])) == 1, sizes
        for algo in ("im2col_gemm", "fft", "winograd"):
            steps = np.diff(sizes[algo])
            assert (steps > 0).all(), (algo, kind, sizes[algo])


def test_unsupported_cases_report_reasons() -> None:
    base = ConvProblem.parse(PROBLEMS["pad"])
    cases = {
        "float16": ConvProblem.parse(PROBLEMS["pad"] + ",dtype=float16"),
        "compute_type": ConvProblem.parse(PROBLEMS["pad"] + ",compute_type=float64"),
        "NHWC": ConvProblem.parse(PROBLEMS["pad"] + ",layout=NHWC"),
    }
    for what, problem in cases.items():
        for algo in ALL_ALGOS:
            reason = BACKEND.unsupported_reason(problem, algo)
            assert reason and (what in reason or what.lower() in reason), (what, algo, reason)
            with pytest.raises(UnsupportedProblem):
                BACKEND.workspace_size(problem, algo)
    assert "unknown algorithm" in BACKEND.unsupported_reason(base, "direct")
    five = ConvProblem.parse("n=1,c=2,h=9,w=9,k=2,r=5,s=5")
    assert "3x3" in BACKEND.unsupported_reason(five, "winograd")
    assert "stride" in BACKEND.unsupported_reason(ConvProblem.parse(PROBLEMS["stride2"]), "winograd")
    assert "dilation" in BACKEND.unsupported_reason(ConvProblem.parse(PROBLEMS["dilation2"]), "winograd")


def test_bad_operands_are_rejected() -> None:
    problem = ConvProblem.parse(PROBLEMS["pad"])
    ops = BACKEND.random_operands(problem)
    nbytes = BACKEND.workspace_size(problem, "im2col_gemm")
    with pytest.raises(InvalidInput, match="needs"):
        BACKEND.run(problem, "im2col_gemm", workspace=BACKEND.empty_workspace(nbytes - 1), **ops)
    with pytest.raises(InvalidInput, match="'x'"):
        BACKEND.run(
            problem, "im2col_gemm", workspace=BACKEND.empty_workspace(nbytes), **{**ops, "x": ops["x"][:, :, :, :-1]}
        )
    with pytest.raises(InvalidInput, match="float32"):
        BACKEND.run(
            problem,
            "im2col_gemm",
            workspace=BACKEND.empty_workspace(nbytes),
            **{**ops, "w": ops["w"].astype(np.float64)},
        )
    with pytest.raises(InvalidInput, match="'dy'"):
        BACKEND.run(
            problem.with_kind("bwd_data"),
            "im2col_gemm",
            workspace=BACKEND.empty_workspace(10**6),
            w=ops["w"],
            out=np.empty(problem.x_shape, np.float32),
        )


def test_numpy_reference_agrees_with_torch() -> None:
    """The fallback reference used when torch is missing is itself right."""
    if torch is None:
        pytest.skip("torch is not importable here; the NumPy reference is the only one")
    from conv_reference import torch_reference

    for spec in (PROBLEMS["mixed_axes"], PROBLEMS["groups2"], PROBLEMS["pad_beyond_kernel"]):
        for kind in KINDS:
            problem = ConvProblem.parse(spec).with_kind(kind)
            ops = inputs_of(BACKEND.random_operands(problem, seed=1))
            np.testing.assert_allclose(
                numpy_reference(problem, **ops), torch_reference(problem, **ops), rtol=1e-10, atol=1e-10
            )


def test_algorithms_device_and_operands() -> None:
    problem = ConvProblem.parse(PROBLEMS["pad"])
    assert BACKEND.name == "cpu"
    assert BACKEND.algorithms(problem)[:4] == list(ALGORITHMS)
    assert (NATIVE in BACKEND.algorithms(problem)) == (torch is not None)
    device = BACKEND.device
    assert isinstance(device, DeviceInfo)
    assert device.model and "cores" in device.model
    assert device.memory_bytes > 0
    libraries = dict(device.versions)
    assert libraries["numpy"] == np.__version__ and "scipy" in libraries and "numpy-blas" in libraries
    assert [lib for lib, _ in device.versions] == sorted(libraries)
    if torch is not None:
        assert libraries["torch"] == torch.__version__
    for kind, names in {"fwd": {"x", "w"}, "bwd_data": {"dy", "w"}, "bwd_filter": {"x", "dy"}}.items():
        p = problem.with_kind(kind)
        ops = BACKEND.random_operands(p, seed=2)
        assert set(ops) == names | {"out"}
        assert ops["out"].shape == p.out_shape
        for name in names:
            assert ops[name].dtype == np.float32 and ops[name].flags.c_contiguous
            assert ops[name].shape == {"x": p.x_shape, "w": p.w_shape, "dy": p.y_shape}[name]
            np.testing.assert_array_equal(ops[name], BACKEND.random_operands(p, seed=2)[name])
            assert not np.array_equal(ops[name], BACKEND.random_operands(p, seed=3)[name])
    assert BACKEND.random_operands(ConvProblem.parse(PROBLEMS["pad"] + ",dtype=float64"))["x"].dtype == np.float64
    assert BACKEND.empty_workspace(100).dtype == np.uint8 and BACKEND.empty_workspace(100).shape == (100,)


@pytest.mark.filterwarnings("ignore:noisy timing")
def test_measure() -> None:
    problem = ConvProblem.parse("n=2,c=3,h=10,w=9,k=4,r=5,s=5,pad=1").with_kind("bwd_data")
    algos = [*ALL_ALGOS, "direct"]
    results = BACKEND.measure(problem, algos, reps=2)
    assert [m.algo for m in results] == algos
    for micro in results:
        assert micro.batch == problem.n
        reason = BACKEND.unsupported_reason(problem, micro.algo)
        if reason is None:
            assert math.isfinite(micro.time) and micro.time > 0, micro
            assert micro.workspace == BACKEND.workspace_size(problem, micro.algo)
            assert micro.reason == ""
        else:
            assert micro.algo in ("winograd", "direct")
            assert micro.time == math.inf and micro.reason == reason and not micro.usable
    times = BACKEND.time_run_ms(
        problem,
        "shift_gemm",
        BACKEND.random_operands(problem),
        BACKEND.empty_workspace(BACKEND.workspace_size(problem, "shift_gemm")),
        3,
    )
    assert len(times) == 3 and all(t > 0 for t in times)


def test_measure_unsupported_dtype_reports_every_algorithm() -> None:
    problem = ConvProblem.parse("n=1,c=2,h=6,w=6,k=2,r=3,s=3,dtype=float16")
    results = BACKEND.measure(problem, ALL_ALGOS, reps=1)
    assert all(m.time == math.inf and "float16" in m.reason for m in results)


ALEXNET = {
    "conv1": "c=3,h=227,w=227,k=96,r=11,s=11,stride=4",
    "conv2": "c=96,h=27,w=27,k=256,r=5,s=5,pad=2",
    "conv3": "c=256,h=13,w=13,k=384,r=3,s=3,pad=1",
    "conv5": "c=384,h=13,w=13,k=256,r=3,s=3,pad=1,groups=2",
}


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("layer", ALEXNET)
def test_alexnet_layers_match_reference(layer: str, kind: str) -> None:
    """Full-size layers at batch 2: float32 error stays within tolerance over long sums."""
    problem = ConvProblem.parse(f"n=2,{ALEXNET[layer]}").with_kind(kind)
    for algo in ALL_ALGOS:
        if BACKEND.unsupported_reason(problem, algo) is None:
            run_and_check(problem, algo, seed=13)


@pytest.mark.parametrize("numpy_threads, waits", [(None, 1), (1, 0)])
def test_native_is_timed_once_a_spinning_blas_pool_is_quiet(monkeypatch, numpy_threads, waits) -> None:
    """After NumPy algorithms on several BLAS threads, OpenBLAS's idle threads spin for about 0.1 s:
    `native` is timed only after they stop (on one BLAS thread nothing spins, and nothing waits), and its
    measurements carry their own protocol in the cache key."""
    if torch is None:
        pytest.skip("native needs torch")
    import ucudnn.backends.cpu.backend as cpu_backend

    waited = []
    monkeypatch.setattr(cpu_backend, "_wait_for_idle_threads", lambda: waited.append(1) or 0.0)
    monkeypatch.setattr(cpu_backend, "_blas_pool_may_spin", False)
    backend = CpuBackend(numpy_threads=numpy_threads)
    problem = ConvProblem.parse("n=2,c=4,h=8,w=8,k=4,r=3,s=3,pad=1")
    results = backend.measure(problem, ["native", "im2col_gemm", "shift_gemm", "native"], reps=1)
    assert all(m.usable for m in results)
    assert len(waited) == waits  # the first native follows nothing; the second follows shift_gemm
    assert backend.versions_for(NATIVE).endswith(",protocol=3")
    assert ",protocol=2" in backend.versions_for("im2col_gemm")


def test_waiting_for_idle_threads_ends_when_they_are_idle() -> None:
    from ucudnn.backends.cpu.backend import _wait_for_idle_threads

    assert _wait_for_idle_threads(limit_s=0.5) < 0.5  # nothing else runs in this process
