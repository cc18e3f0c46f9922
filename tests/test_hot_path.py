"""The prepared hot path (issue 10): plan and check once per layer and shape, then only launch.

Handle level: repeated calls equal the reference and reach the backend's checked `run` only on
the first call of each kernel; a prepared micro-batch sequence equals the one-shot run; outputs
overlapping inputs are refused; a non-finite value spreads as each algorithm documents it.
"""

from __future__ import annotations

import numpy as np
import pytest
from conv_reference import assert_close, reference
from ucudnn.solver.types import Configuration, MicroConfig

from ucudnn import Handle, InvalidInput
from ucudnn.backends.cpu import ALGORITHMS, CpuBackend
from ucudnn.kernel.run import PreparedConfiguration, run_configuration
from ucudnn.problem import KINDS, ConvProblem

BACKEND = CpuBackend()
PROBLEM = ConvProblem.parse("n=5,c=4,h=7,w=6,k=6,r=3,s=3,pad=1,groups=2")


class CountingCpu(CpuBackend):
    """The cpu backend, counting its checked runs, prepared launchers and workspace allocations."""

    def __init__(self) -> None:
        self.runs = self.prepared = self.allocations = 0

    def run(self, *args, **kwargs):
        self.runs += 1
        return super().run(*args, **kwargs)

    def prepare_run(self, problem, algo):
        self.prepared += 1
        return super().prepare_run(problem, algo)

    def empty_workspace(self, nbytes):
        self.allocations += 1
        return super().empty_workspace(nbytes)


def _operands(kind: str, seed: int) -> dict[str, np.ndarray]:
    ops = BACKEND.random_operands(PROBLEM.with_kind(kind), seed=seed)
    return {name: ops[name] for name in ("x", "w", "dy") if name in ops}


@pytest.mark.parametrize("scale", [(0.5, 2.0), (1.0, 0.0)], ids=["alpha-beta", "plain"])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("algo", [*ALGORITHMS, "native"])
def test_prepared_sequence_equals_the_checked_run_every_time(kind, algo, scale):
    problem = PROBLEM.with_kind(kind)
    if BACKEND.unsupported_reason(problem, algo):
        pytest.skip(BACKEND.unsupported_reason(problem, algo))
    split = (2, 2, 1)
    config = Configuration(
        tuple(MicroConfig(algo, b, 1.0, BACKEND.workspace_size(problem.with_batch(b), algo)) for b in split)
    )
    backend = CountingCpu()
    prepared = PreparedConfiguration(backend, problem, config)
    workspace = backend.empty_workspace(config.workspace)
    for call in range(3):  # the first run is checked, the later ones only launch
        ops = _operands(kind, seed=call)
        before = np.random.default_rng(call).standard_normal(problem.out_shape, dtype=np.float32)
        out = before.copy()
        alpha, beta = scale
        prepared.run(out=out, alpha=alpha, beta=beta, workspace=workspace, **ops)
        assert_close(out, alpha * reference(problem, **ops) + beta * before, "float32", f"call {call}")
        checked = np.full(problem.out_shape, np.nan, np.float32)
        run_configuration(BACKEND, problem, config, out=checked, **ops)
        assert_close(out, alpha * checked + beta * before, "float32", f"prepared vs checked, call {call}")
    assert backend.runs == len(split)  # the checked path ran once per micro-batch, on the first call
    assert backend.prepared == len(split)


def test_handle_checks_and_prepares_once_per_kernel():
    backend = CountingCpu()
    # policy (1,): every kernel runs as five micro-batches of one sample
    handle = Handle(backend=backend, policy=(1,), algos=["im2col_gemm"], reps=1, db=False)
    for call in range(4):
        x, w, dy = (_operands("fwd", call)["x"], _operands("fwd", call)["w"], _operands("bwd_data", call)["dy"])
        conv = {"padding": 1, "groups": 2, "layer": "l"}
        y = handle.conv_forward(x, w, **conv)
        dx = handle.conv_backward_data(dy, w, **conv)
        dw = handle.conv_backward_filter(x, dy, w_shape=w.shape, **conv)
        assert_close(y, reference(PROBLEM, x=x, w=w), "float32", "fwd")
        assert_close(dx, reference(PROBLEM.with_kind("bwd_data"), dy=dy, w=w), "float32", "bwd_data")
        assert_close(dw, reference(PROBLEM.with_kind("bwd_filter"), x=x, dy=dy), "float32", "bwd_filter")
        if call == 0:
            runs, allocations, prepared = backend.runs, backend.allocations, backend.prepared
    assert all(len(c.config.micros) == 5 for c in handle.choices())
    # after the first call of each kernel: no checked run, no launcher built, no workspace taken
    assert (backend.runs, backend.allocations, backend.prepared) == (runs, allocations, prepared)


def test_output_overlapping_an_input_is_refused():
    handle = Handle(backend="cpu", policy="undivided", algos=["shift_gemm"], reps=1, db=False)
    x = np.random.default_rng(0).standard_normal((2, 4, 6, 6), dtype=np.float32)
    w = np.random.default_rng(1).standard_normal((4, 4, 3, 3), dtype=np.float32)
    expected = reference(ConvProblem(n=2, c=4, h=6, w=6, k=4, r=3, s=3, pad_h=1, pad_w=1), x=x, w=w)
    for out in (x, x[:, :]):  # the array itself, or a view of its memory
        with pytest.raises(InvalidInput, match="out overlaps x"):
            handle.conv_forward(x, w, padding=1, out=out)
    with pytest.raises(InvalidInput, match="out overlaps dy"):
        handle.conv_backward_data(x, w, padding=1, out=x)
    assert_close(handle.conv_forward(x, w, padding=1, out=np.empty_like(x)), expected, "float32", "separate out")


@pytest.mark.parametrize("kind", ["fwd", "bwd_data"])
def test_non_finite_values_spread_as_documented(kind):
    """fft spreads one NaN over the whole sample; the other algorithms keep it local, and
    `algos=` keeps fft out of a handle's plans."""
    problem = ConvProblem(kind=kind, n=2, c=3, h=12, w=12, k=4, r=3, s=3, pad_h=1, pad_w=1)
    ops = BACKEND.random_operands(problem, seed=5)
    source = "x" if kind == "fwd" else "dy"
    ops[source][0, 0, 5, 5] = np.nan
    inputs = {k: v for k, v in ops.items() if k != "out"}
    for algos, whole_sample in ((["fft"], True), ([a for a in ALGORITHMS if a != "fft"], False)):
        handle = Handle(backend="cpu", policy="undivided", algos=algos, reps=1, db=False)
        if kind == "fwd":
            out = handle.conv_forward(inputs["x"], inputs["w"], padding=1)
        else:
            out = handle.conv_backward_data(inputs["dy"], inputs["w"], padding=1)
        assert not np.isnan(out[1]).any()  # never into another sample
        nan = np.isnan(out[0])
        assert nan.all() == whole_sample, algos
        if not whole_sample:  # the 3x3 neighbourhood, or winograd's 2x2-output tiles around it
            assert nan[:, 4:7, 4:7].all()
            assert not (nan[:, :4].any() or nan[:, 8:].any() or nan[:, :, :4].any() or nan[:, :, 8:].any())
