"""The CPU backend's prepared launchers (`CpuBackend.prepare_run`, issue 36): made once per problem, they
carve the handle's workspace once per buffer and take every index of im2col's copies from tables made at
preparation. Checked here on fresh random operands at every run against the float64 reference, with
the workspace dirtied between runs (the handle's buffer is shared by every kernel), swapped for another
buffer, and with the BLAS thread setting given back after each launch."""

from __future__ import annotations

import numpy as np
import pytest

from ucudnn.backends.cpu import CpuBackend, im2col
from ucudnn.problem import KINDS, ConvProblem
from ucudnn.reference import reference, relative_error

FORMS = {
    "2-D strided, dilated, grouped": {
        "x_shape": (3, 4, 9, 8),
        "w_shape": (6, 2, 3, 3),
        "stride": 2,
        "padding": (1, 2),
        "dilation": (2, 1),
        "groups": 2,
    },
    "2-D 1x1": {"x_shape": (2, 5, 6, 6), "w_shape": (3, 5, 1, 1)},
    "1-D": {"x_shape": (2, 3, 11), "w_shape": (4, 3, 5), "padding": 2},
    "3-D": {"x_shape": (2, 2, 5, 4, 6), "w_shape": (3, 2, 3, 2, 3), "padding": 1, "stride": (1, 2, 1)},
    "transposed": {
        "x_shape": (2, 4, 5, 5),
        "w_shape": (4, 3, 3, 3),
        "stride": 2,
        "padding": 1,
        "output_padding": 1,
        "transposed": True,
    },
    "padding beyond the filter": {"x_shape": (2, 3, 4, 4), "w_shape": (2, 3, 2, 2), "padding": 3},
}
ALGOS = ("im2col_gemm", "shift_gemm", "fft", "winograd")


def _operands(problem: ConvProblem, rng) -> dict[str, np.ndarray]:
    names = {"fwd": ("x", "w"), "bwd_data": ("dy", "w"), "bwd_filter": ("x", "dy")}[problem.kind]
    shapes = {"x": problem.x_shape, "w": problem.w_shape, "dy": problem.y_shape}
    return {name: rng.standard_normal(shapes[name]).astype(np.float32) for name in names}


@pytest.mark.parametrize("threads, clear_whole", [(None, True), (1, False)])
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("kind", KINDS)
def test_prepared_launches_match_the_reference_run_after_run(form, kind, threads, clear_whole, monkeypatch):
    # im2col's columns cleared whole (small ones) or border by border (the larger ones)
    monkeypatch.setattr(im2col, "CLEAR_WHOLE_BYTES", im2col.CLEAR_WHOLE_BYTES if clear_whole else 0)
    backend = CpuBackend(numpy_threads=threads)
    problem = ConvProblem.from_shapes(kind=kind, **FORMS[form])
    rng = np.random.default_rng(abs(hash((form, kind))) % 2**32)
    for algo in ALGOS:
        if backend.unsupported_reason(problem, algo) is not None:
            continue
        need = backend.workspace_size(problem, algo)
        buffers = [np.empty(need + 1000, np.uint8) for _ in range(2)]
        slices = [b[: need + 3] for b in buffers]  # a handle's run slice: the same object every run
        launch = backend.prepare_run(problem, algo)
        for run, (alpha, beta) in enumerate([(1.0, 0.0), (1.0, 0.0), (0.5, 2.0), (1.0, 1.0), (1.0, 0.0)]):
            ops = _operands(problem, rng)
            out = rng.standard_normal(problem.out_shape).astype(np.float32)
            expected = alpha * reference(
                problem, **{k: v.astype(np.float64) for k, v in ops.items()}
            ) + beta * out.astype(np.float64)
            workspace = slices[run // 3]  # the last two runs on another buffer
            buffers[run // 3].fill(0xFF)  # another kernel used the shared buffer since: NaN everywhere
            launch(ops.get("x"), ops.get("w"), ops.get("dy"), out, workspace, alpha, beta)
            error = relative_error(out.astype(np.float64), expected)
            assert error < 1e-4, f"{algo} {form} {kind} run {run}: relative error {error:.2e}"


def test_a_launch_gives_the_blas_thread_setting_back():
    from ucudnn.backends.cpu.backend import _blas_pools

    pools = _blas_pools().lib_controllers
    if not pools:
        pytest.skip("no BLAS thread pool found by threadpoolctl")
    backend = CpuBackend(numpy_threads=1)
    problem = ConvProblem.from_shapes((2, 3, 6, 6), (4, 3, 3, 3), padding=1)
    launch = backend.prepare_run(problem, "im2col_gemm")
    workspace = np.empty(backend.workspace_size(problem, "im2col_gemm"), np.uint8)
    rng = np.random.default_rng(0)
    ops = _operands(problem, rng)
    before = [pool.get_num_threads() for pool in pools]
    try:
        for pool in pools:
            pool.set_num_threads(2)
        launch(ops["x"], ops["w"], None, np.empty(problem.out_shape, np.float32), workspace, 1.0, 0.0)
        assert [pool.get_num_threads() for pool in pools] == [2] * len(pools)
    finally:
        for pool, count in zip(pools, before):
            pool.set_num_threads(count)
