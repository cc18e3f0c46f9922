"""Handle.kernel and Handle.prepare on every form of PyTorch's convolutions (what a framework
converting Conv1d, Conv3d and ConvTranspose1d/2d/3d calls): the problem each call builds, and the
kernels planned within a limit that forces micro-batches, against the float64 reference."""

from __future__ import annotations

import numpy as np
import pytest

from ucudnn import ConvProblem, Handle, InvalidInput
from ucudnn.backends.cpu import CpuBackend
from ucudnn.problem import KINDS
from ucudnn.reference import reference, relative_error

INPUTS = {"fwd": ("x", "w"), "bwd_data": ("dy", "w"), "bwd_filter": ("x", "dy")}
# Algorithms whose workspace grows with the batch (shift_gemm's does not), so that a limit can admit
# one sample and not four.
GROWING = ["im2col_gemm", "fft", "native"]

# (x shape, weight shape as the module holds it, keyword arguments as PyTorch takes them)
CALLS = {
    "conv1d": ((4, 6, 21), (8, 3, 5), {"stride": 2, "padding": 2, "groups": 2}),
    "conv3d": ((4, 3, 6, 7, 5), (4, 3, 3, 3, 3), {"padding": (1, 0, 1), "dilation": (1, 2, 1)}),
    "conv_transpose1d": ((4, 4, 9), (4, 6, 3), {"stride": 2, "padding": 1, "output_padding": 1, "transposed": True}),
    "conv_transpose2d": (
        (4, 4, 5, 6),
        (4, 3, 3, 3),
        {"stride": (2, 1), "padding": 1, "output_padding": (1, 0), "groups": 2, "transposed": True},
    ),
    "conv_transpose3d": ((4, 6, 3, 4, 3), (6, 4, 2, 2, 2), {"stride": 2, "transposed": True}),
}


@pytest.mark.parametrize("name", CALLS)
def test_kernel_builds_the_problem_of_the_pytorch_call(name):
    x_shape, w_shape, args = CALLS[name]
    with Handle(backend=CpuBackend(), db=False, reps=1, policy="undivided") as handle:
        problem = handle.kernel("fwd", x_shape, w_shape, **args).problem
    assert problem == ConvProblem.from_shapes(x_shape, w_shape, kind="fwd", **args)
    assert problem.transposed == args.get("transposed", False)
    assert problem.x_shape[:2] == x_shape[:2] and problem.w_shape == (
        w_shape if len(w_shape) > 3 else (*w_shape[:2], 1, w_shape[2])
    )


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name", CALLS)
def test_kernels_of_every_form_run_micro_batched_within_the_limit(name, kind):
    x_shape, w_shape, args = CALLS[name]
    backend = CpuBackend()
    probe = ConvProblem.from_shapes(x_shape, w_shape, kind=kind, **args)
    # A limit below every algorithm's undivided workspace but above one's at a single sample.
    need = {n: min(backend.workspace_size(probe.with_batch(n), a) for a in GROWING) for n in (1, 4)}
    assert need[1] < need[4]
    with Handle(backend=backend, db=False, reps=1, workspace_limit=need[1], algos=GROWING) as handle:
        kernel = handle.kernel(kind, x_shape, w_shape, **args)
        assert kernel.problem == probe and len(kernel.config.micros) > 1  # micro-batched
        assert kernel.config.workspace <= need[1]
        assert handle.prepare(kind, x_shape, w_shape, **args) == kernel.config  # the same plan, looked up
        rng = np.random.default_rng(7)
        shapes = {"x": probe.x_shape, "w": probe.w_shape, "dy": probe.y_shape}
        ops = {k: rng.standard_normal(shapes[k], dtype=np.float32) for k in INPUTS[kind]}
        out = np.full(probe.out_shape, np.nan, np.float32)
        for _ in range(2):  # the checked first run, then the prepared launch
            kernel.run(out=out, **ops)
            expected = reference(probe, **{k: v.astype(np.float64) for k, v in ops.items()})
            assert relative_error(out.astype(np.float64), expected) < 1e-4


@pytest.mark.parametrize(
    "call, words",
    [
        (
            {"x_shape": (2, 4, 5, 5), "w_shape": (4, 2, 3, 3), "groups": 2, "transposed": True, "output_padding": 1},
            "stride_h",
        ),
        (
            {
                "x_shape": (2, 4, 5, 5, 5),
                "w_shape": (4, 4, 3, 3),
            },
            "3, 4 or 5 dimensions",
        ),
        ({"x_shape": (2, 4, 5, 5, 5), "w_shape": (4, 4, 3, 3, 3), "stride": (1, 1)}, "one per spatial axis"),
        ({"x_shape": (2, 4), "w_shape": (4, 4)}, "3-D, 4-D or 5-D"),
        ({"x_shape": (2, 4, 9), "w_shape": (4, 4, 3), "transposed": "yes"}, "True or False"),
        ({"x_shape": (2, 4, 9), "w_shape": (4, 4, 3), "groups": 0}, "groups"),
    ],
)
def test_bad_calls_are_refused_in_one_line(call, words):
    with Handle(backend=CpuBackend(), db=False, reps=1) as handle, pytest.raises(InvalidInput, match=words) as info:
        handle.kernel("fwd", **call)
    assert "\n" not in str(info.value)
