"""ucudnn.Handle: the three kernels on NumPy arrays against a float64 reference, WR and WD
workspace handling, announcing layers, plans per batch and through the database."""

from __future__ import annotations

import copy
import itertools
import pickle
import subprocess
import sys
import warnings

import numpy as np
import pytest

from ucudnn import ConvProblem, Handle, InvalidInput, LateRegistrationWarning
from ucudnn.backends.cpu import CpuBackend

RTOL = ATOL = 2e-4  # float32 algorithms (FFT, Winograd) against a float64 reference


# ---- a float64 reference ---------------------------------------------------------------------


def _geometry(x_shape, w_shape, stride, padding, dilation):
    _n, _c, h, w = x_shape
    _k, _cg, r, s = w_shape
    oh = (h + 2 * padding[0] - dilation[0] * (r - 1) - 1) // stride[0] + 1
    ow = (w + 2 * padding[1] - dilation[1] * (s - 1) - 1) // stride[1] + 1
    return oh, ow


def _taps(i, j, oh, ow, stride, dilation):
    """Rows and columns of the padded input that filter tap (i, j) reads for every output."""
    rows = slice(i * dilation[0], i * dilation[0] + (oh - 1) * stride[0] + 1, stride[0])
    cols = slice(j * dilation[1], j * dilation[1] + (ow - 1) * stride[1] + 1, stride[1])
    return rows, cols


def ref_forward(x, w, stride, padding, dilation, groups):
    x, w = x.astype(np.float64), w.astype(np.float64)
    n, _c, _h, _wd = x.shape
    k, cg, r, s = w.shape
    oh, ow = _geometry(x.shape, w.shape, stride, padding, dilation)
    xp = np.pad(x, ((0, 0), (0, 0), (padding[0],) * 2, (padding[1],) * 2))
    y = np.zeros((n, k, oh, ow))
    kg = k // groups
    for g in range(groups):
        for i in range(r):
            for j in range(s):
                rows, cols = _taps(i, j, oh, ow, stride, dilation)
                patch = xp[:, g * cg : (g + 1) * cg, rows, cols]  # n, cg, oh, ow
                y[:, g * kg : (g + 1) * kg] += np.einsum("nchw,kc->nkhw", patch, w[g * kg : (g + 1) * kg, :, i, j])
    return y


def ref_backward_data(dy, w, x_shape, stride, padding, dilation, groups):
    dy, w = dy.astype(np.float64), w.astype(np.float64)
    n, c, h, wd = x_shape
    k, cg, r, s = w.shape
    oh, ow = dy.shape[2:]
    dxp = np.zeros((n, c, h + 2 * padding[0], wd + 2 * padding[1]))
    kg = k // groups
    for g in range(groups):
        for i in range(r):
            for j in range(s):
                rows, cols = _taps(i, j, oh, ow, stride, dilation)
                dxp[:, g * cg : (g + 1) * cg, rows, cols] += np.einsum(
                    "nkhw,kc->nchw", dy[:, g * kg : (g + 1) * kg], w[g * kg : (g + 1) * kg, :, i, j]
                )
    return dxp[:, :, padding[0] : padding[0] + h, padding[1] : padding[1] + wd]


def ref_backward_filter(x, dy, w_shape, stride, padding, dilation, groups):
    x, dy = x.astype(np.float64), dy.astype(np.float64)
    k, cg, r, s = w_shape
    oh, ow = dy.shape[2:]
    xp = np.pad(x, ((0, 0), (0, 0), (padding[0],) * 2, (padding[1],) * 2))
    dw = np.zeros(w_shape)
    kg = k // groups
    for g in range(groups):
        for i in range(r):
            for j in range(s):
                rows, cols = _taps(i, j, oh, ow, stride, dilation)
                dw[g * kg : (g + 1) * kg, :, i, j] = np.einsum(
                    "nchw,nkhw->kc", xp[:, g * cg : (g + 1) * cg, rows, cols], dy[:, g * kg : (g + 1) * kg]
                )
    return dw


def _close(actual, expected):
    scale = max(1.0, float(np.abs(expected).max()))
    np.testing.assert_allclose(actual, expected, rtol=RTOL, atol=ATOL * scale)


def _handle(**options):
    defaults = {"backend": "cpu", "policy": "undivided", "reps": 1, "db": "sqlite://"}
    return Handle(**{**defaults, **options})


# Geometries: stride 2 with padding, dilation 2, groups (incl. depthwise), 1x1, rectangular 1x7.
CASES = [
    {"x": (3, 4, 9, 8), "w": (6, 4, 3, 3), "stride": (2, 2), "padding": (1, 1), "dilation": (1, 1), "groups": 1},
    {"x": (2, 4, 10, 10), "w": (4, 2, 3, 3), "stride": (1, 1), "padding": (2, 2), "dilation": (2, 2), "groups": 2},
    {"x": (2, 6, 7, 7), "w": (6, 1, 3, 3), "stride": (1, 1), "padding": (1, 1), "dilation": (1, 1), "groups": 6},
    {"x": (3, 5, 6, 6), "w": (7, 5, 1, 1), "stride": (2, 2), "padding": (0, 0), "dilation": (1, 1), "groups": 1},
    {"x": (2, 3, 5, 12), "w": (4, 3, 1, 7), "stride": (1, 2), "padding": (0, 3), "dilation": (1, 1), "groups": 1},
]


@pytest.fixture(scope="module")
def shared_handle():
    with _handle(policy="powerOfTwo") as handle:
        yield handle


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"x{c['x']}-w{c['w']}-g{c['groups']}")
@pytest.mark.parametrize("alpha,beta", [(1.0, 0.0), (0.5, 2.0), (-1.5, 1.0)])
def test_three_kernels_match_float64_reference_with_alpha_beta(shared_handle, case, alpha, beta):
    rng = np.random.default_rng(1)
    conv = {k: case[k] for k in ("stride", "padding", "dilation", "groups")}
    x = rng.standard_normal(case["x"], dtype=np.float32)
    w = rng.standard_normal(case["w"], dtype=np.float32)
    y_ref = ref_forward(x, w, **conv)
    dy = rng.standard_normal(y_ref.shape, dtype=np.float32)
    dx_ref = ref_backward_data(dy, w, x.shape, **conv)
    dw_ref = ref_backward_filter(x, dy, w.shape, **conv)

    for run, ref in [
        (lambda **kw: shared_handle.conv_forward(x, w, **conv, **kw), y_ref),
        (lambda **kw: shared_handle.conv_backward_data(dy, w, x_shape=x.shape, **conv, **kw), dx_ref),
        (lambda **kw: shared_handle.conv_backward_filter(x, dy, w_shape=w.shape, **conv, **kw), dw_ref),
    ]:
        if beta == 0.0:
            fresh = run(alpha=alpha)  # allocated and returned
            assert fresh.dtype == np.float32 and fresh.shape == ref.shape
            _close(fresh, alpha * ref)
        prior = rng.standard_normal(ref.shape, dtype=np.float32)
        out = prior.copy()
        returned = run(alpha=alpha, beta=beta, out=out)
        assert returned is out
        _close(out, alpha * ref + beta * prior.astype(np.float64))


def test_beta_zero_never_reads_out(shared_handle):
    rng = np.random.default_rng(2)
    x = rng.standard_normal((2, 3, 6, 6), dtype=np.float32)
    w = rng.standard_normal((4, 3, 3, 3), dtype=np.float32)
    out = np.full((2, 4, 6, 6), np.nan, np.float32)
    shared_handle.conv_forward(x, w, padding=1, out=out)
    _close(out, ref_forward(x, w, (1, 1), (1, 1), (1, 1), 1))


def test_shapes_are_inferred_at_stride_one_and_required_above(shared_handle):
    rng = np.random.default_rng(3)
    x = rng.standard_normal((2, 3, 8, 7), dtype=np.float32)
    w = rng.standard_normal((5, 3, 3, 2), dtype=np.float32)
    conv = {"padding": (1, 2), "dilation": (2, 1)}
    y = shared_handle.conv_forward(x, w, **conv)
    assert shared_handle.conv_backward_data(y, w, **conv).shape == x.shape
    assert shared_handle.conv_backward_filter(x, y, **conv).shape == w.shape
    y2 = shared_handle.conv_forward(x, w, stride=2, **conv)
    with pytest.raises(InvalidInput, match="x_shape"):
        shared_handle.conv_backward_data(y2, w, stride=2, **conv)
    with pytest.raises(InvalidInput, match="w_shape"):
        shared_handle.conv_backward_filter(x, y2, stride=2, **conv)


@pytest.mark.parametrize(
    "call,match",
    [
        (lambda h, x, w: h.conv_forward(x, w, beta=1.0), "give out"),
        (lambda h, x, w: h.conv_forward(x, w, out=np.zeros((2, 4, 5, 5), np.float32)), "shape"),
        (lambda h, x, w: h.conv_forward(x, w, out=np.zeros((2, 4, 4, 4), np.float64)), "dtype"),
        (lambda h, x, w: h.conv_forward(x, w, groups=2), "groups"),
        (lambda h, x, w: h.conv_forward(x, w, stride=0), "stride"),
        (lambda h, x, w: h.conv_forward(x, w, padding=(1, 2, 3)), "padding"),
        (lambda h, x, w: h.conv_forward(x[0], w), "4-D"),
        (lambda h, x, w: h.conv_forward(x, w.astype(np.float64)), "dtype"),
        (lambda h, x, w: h.conv_forward(x, w, layer=""), "layer"),
        (lambda h, x, w: h.conv_backward_data(np.zeros((2, 4, 3, 3), np.float32), w, x_shape=x.shape), "dy has shape"),
    ],
)
def test_bad_calls_raise_invalid_input_naming_the_rule(shared_handle, call, match):
    x = np.zeros((2, 3, 6, 6), np.float32)
    w = np.zeros((4, 3, 3, 3), np.float32)
    with pytest.raises(InvalidInput, match=match):
        call(shared_handle, x, w)


@pytest.mark.parametrize(
    "options,match",
    [
        ({"workspace_limit": 1, "total_workspace": 1}, "not both"),
        ({"policy": "halves"}, "policy"),
        ({"reps": 0}, "reps"),
        ({"db": True}, "db"),
        ({"backend": 3}, "backend"),
        ({"workspace_limit": "lots"}, "size"),
    ],
)
def test_bad_options_raise_invalid_input(options, match):
    with pytest.raises(InvalidInput, match=match):
        _handle(**options)


# ---- WR ----------------------------------------------------------------------------------------


def test_wr_small_limit_micro_batches_in_one_reused_buffer():
    rng = np.random.default_rng(4)
    problem = ConvProblem(n=8, c=4, h=10, w=10, k=6, r=3, s=3, pad_h=1, pad_w=1)
    cpu = CpuBackend()
    # im2col's workspace grows with the batch: a limit that admits 2 samples forces micro-batches.
    limit = cpu.workspace_size(problem.with_batch(2), "im2col_gemm")
    assert cpu.workspace_size(problem, "im2col_gemm") > limit
    x = rng.standard_normal(problem.x_shape, dtype=np.float32)
    w = rng.standard_normal(problem.w_shape, dtype=np.float32)
    with _handle(policy="powerOfTwo", workspace_limit=limit, algos=["im2col_gemm"]) as handle:
        y = handle.conv_forward(x, w, padding=1, layer="a")
        dy = rng.standard_normal(y.shape, dtype=np.float32)
        dx = handle.conv_backward_data(dy, w, padding=1, layer="a")
        dw = handle.conv_backward_filter(x, dy, padding=1, layer="a", alpha=2.0)
        choices = handle.choices()
        assert {(c.layer, c.kind, c.batch) for c in choices} == {("a", k, 8) for k in ("fwd", "bwd_data", "bwd_filter")}
        for choice in choices:
            assert choice.micro_batched, choice.config.describe()
            assert choice.config.batch == 8 and choice.offset is None
            assert choice.config.workspace <= limit
            assert choice.baseline is None  # im2col undivided does not fit
        assert 0 < handle.peak_workspace <= limit
        assert handle.peak_workspace == max(c.config.workspace for c in choices)
        assert handle.arena is None and handle.mode == "WR"
    conv = ((1, 1), (1, 1), (1, 1), 1)
    _close(y, ref_forward(x, w, *conv))
    _close(dx, ref_backward_data(dy, w, x.shape, *conv))
    _close(dw, 2.0 * ref_backward_filter(x, dy, w.shape, *conv))


def test_wr_plans_are_per_batch_and_shared_by_equal_shapes():
    rng = np.random.default_rng(5)
    w = rng.standard_normal((4, 3, 3, 3), dtype=np.float32)
    with _handle(policy="powerOfTwo") as handle:
        handle.conv_forward(rng.standard_normal((4, 3, 8, 8), dtype=np.float32), w, layer="a")
        measured = handle.stats.measured
        handle.conv_forward(rng.standard_normal((4, 3, 8, 8), dtype=np.float32), w, layer="b")
        assert handle.stats.measured == measured  # same shape: nothing new to measure
        handle.conv_forward(rng.standard_normal((3, 3, 8, 8), dtype=np.float32), w, layer="a")
        assert handle.stats.measured > measured  # the smaller last batch gets its own plan
        assert sorted((c.layer, c.batch) for c in handle.choices()) == [("a", 3), ("a", 4), ("b", 4)]


def test_plans_come_back_from_the_database(tmp_path):
    url = tmp_path / "cache.db"
    rng = np.random.default_rng(6)
    x = rng.standard_normal((4, 3, 8, 8), dtype=np.float32)
    w = rng.standard_normal((4, 3, 3, 3), dtype=np.float32)
    for options in ({}, {"total_workspace": "4MiB"}):
        with _handle(db=url, policy="powerOfTwo", **options) as first:
            first.register("a", ConvProblem(n=4, c=3, h=8, w=8, k=4, r=3, s=3, pad_h=1, pad_w=1))
            y1 = first.conv_forward(x, w, padding=1, layer="a")
            assert first.stats.measured > 0
        with _handle(db=str(url), policy="powerOfTwo", **options) as second:
            second.register("a", ConvProblem(n=4, c=3, h=8, w=8, k=4, r=3, s=3, pad_h=1, pad_w=1))
            y2 = second.conv_forward(x, w, padding=1, layer="a")
            assert second.stats.measured == 0 and second.stats.cached == 0  # the plan itself was stored
            assert [c.config for c in second.choices()] == [c.config for c in first.choices()]
        np.testing.assert_array_equal(y1, y2)


def test_without_a_database_nothing_is_kept():
    rng = np.random.default_rng(7)
    x = rng.standard_normal((2, 3, 6, 6), dtype=np.float32)
    w = rng.standard_normal((4, 3, 3, 3), dtype=np.float32)
    for _ in range(2):
        with _handle(db=False) as handle:
            _close(handle.conv_forward(x, w), ref_forward(x, w, (1, 1), (0, 0), (1, 1), 1))
            assert handle.stats.measured > 0


# ---- WD ----------------------------------------------------------------------------------------

LAYERS = {
    "conv1": ConvProblem(n=8, c=3, h=12, w=12, k=8, r=3, s=3, pad_h=1, pad_w=1),
    "conv2": ConvProblem(n=8, c=8, h=12, w=12, k=8, r=3, s=3, pad_h=1, pad_w=1, groups=2),
    "conv3": ConvProblem(n=8, c=8, h=12, w=12, k=16, r=1, s=7, pad_h=0, pad_w=3, stride_h=2, stride_w=2),
}


def _run_layer(handle, name, problem, rng, batch=None):
    p = problem.with_batch(batch or problem.n)
    conv = {
        "stride": (p.stride_h, p.stride_w),
        "padding": (p.pad_h, p.pad_w),
        "dilation": (p.dilation_h, p.dilation_w),
        "groups": p.groups,
        "layer": name,
    }
    x = rng.standard_normal(p.x_shape, dtype=np.float32)
    w = rng.standard_normal(p.w_shape, dtype=np.float32)
    y = handle.conv_forward(x, w, **conv)
    dy = rng.standard_normal(y.shape, dtype=np.float32)
    dx = handle.conv_backward_data(dy, w, x_shape=x.shape, **conv)
    dw = handle.conv_backward_filter(x, dy, w_shape=w.shape, **conv)
    args = ((p.stride_h, p.stride_w), (p.pad_h, p.pad_w), (p.dilation_h, p.dilation_w), p.groups)
    _close(y, ref_forward(x, w, *args))
    _close(dx, ref_backward_data(dy, w, x.shape, *args))
    _close(dw, ref_backward_filter(x, dy, w.shape, *args))


def _check_segments(handle):
    total = handle.total_workspace
    arena = handle.arena
    assert isinstance(arena, np.ndarray) and arena.nbytes == total  # one buffer of the whole budget
    for batch in {c.batch for c in handle.choices()}:
        spans = sorted(
            (c.offset, c.offset + c.config.workspace)
            for c in handle.choices()
            if c.batch == batch and c.config.workspace
        )
        for (_, end), (start, _) in itertools.pairwise(spans):
            assert end <= start  # disjoint segments
        assert all(0 <= s and e <= total for s, e in spans)
        assert sum(e - s for s, e in spans) <= handle.peak_workspace
    assert handle.peak_workspace <= total


def test_wd_divides_one_arena_among_announced_kernels():
    rng = np.random.default_rng(8)
    total = 3 * 2**20
    with _handle(policy="powerOfTwo", total_workspace=total) as handle:
        for name, problem in LAYERS.items():
            handle.register(name, problem)
        with warnings.catch_warnings():
            warnings.simplefilter("error", LateRegistrationWarning)
            for name, problem in LAYERS.items():
                _run_layer(handle, name, problem, rng)
        choices = handle.choices()
        assert {(c.layer, c.kind) for c in choices} == {
            (n, k) for n in LAYERS for k in ("fwd", "bwd_data", "bwd_filter")
        }
        assert all(c.batch == 8 and c.config.batch == 8 for c in choices)
        _check_segments(handle)
        assert handle.peak_workspace > 0
        arena = handle.arena
        _run_layer(handle, "conv2", LAYERS["conv2"], rng, batch=5)  # a smaller last batch: its own plan
        assert {c.batch for c in handle.choices()} == {5, 8}
        assert handle.arena is arena  # still the one buffer
        _check_segments(handle)


def test_wd_tight_total_keeps_peak_within_it():
    rng = np.random.default_rng(9)
    cpu = CpuBackend()
    # room for little more than the cheapest algorithm of each kernel: the division must micro-batch
    # or fall back, and the segments still fit
    total = (
        sum(
            min(cpu.workspace_size(p.with_batch(1).with_kind(k), a) for a in ("shift_gemm", "im2col_gemm"))
            for p in LAYERS.values()
            for k in ("fwd", "bwd_data", "bwd_filter")
        )
        + 64 * 1024
    )
    with _handle(policy="powerOfTwo", total_workspace=total, algos=["im2col_gemm", "shift_gemm"]) as handle:
        for name, problem in LAYERS.items():
            handle.register(name, problem)
        for name, problem in LAYERS.items():
            _run_layer(handle, name, problem, rng)
        _check_segments(handle)
        assert sum(c.config.workspace for c in handle.choices()) <= total


def test_wd_late_layer_warns_and_resolves():
    rng = np.random.default_rng(10)
    with _handle(total_workspace="8MiB") as handle:
        handle.register("conv1", LAYERS["conv1"])
        handle.register("conv2", LAYERS["conv2"])
        _run_layer(handle, "conv1", LAYERS["conv1"], rng)
        assert {c.layer for c in handle.choices()} == {"conv1", "conv2"}
        with pytest.warns(LateRegistrationWarning, match="conv3"):
            _run_layer(handle, "conv3", LAYERS["conv3"], rng)
        assert {c.layer for c in handle.choices()} == {"conv1", "conv2", "conv3"}
        _check_segments(handle)
        with pytest.warns(LateRegistrationWarning, match="new shape"):
            handle.register("conv1", ConvProblem(n=8, c=3, h=10, w=10, k=8, r=3, s=3))
        with warnings.catch_warnings():
            warnings.simplefilter("error", LateRegistrationWarning)
            handle.register("conv2", LAYERS["conv2"].with_batch(3))  # same shape, other batch: nothing new
            _run_layer(handle, "conv2", LAYERS["conv2"], rng)


def test_register_checks_its_arguments():
    with _handle(total_workspace="1MiB") as handle:
        with pytest.raises(InvalidInput, match="layer"):
            handle.register("", LAYERS["conv1"])
        with pytest.raises(InvalidInput, match="ConvProblem"):
            handle.register("a", "n=1,c=1")
        with pytest.raises(InvalidInput, match="kinds"):
            handle.register("a", LAYERS["conv1"], kinds=["sideways"])


# ---- lifetime ----------------------------------------------------------------------------------


def test_copies_are_fresh_handles_with_the_same_options():
    with _handle(workspace_limit="1MiB", policy="powerOfTwo") as handle:
        for clone in (copy.deepcopy(handle), pickle.loads(pickle.dumps(handle))):
            assert clone is not handle
            assert (clone.mode, clone.workspace_limit, clone.policy, clone.backend.name) == (
                "WR",
                2**20,
                "powerOfTwo",
                "cpu",
            )
            assert clone.peak_workspace == 0 and clone.choices() == []


def test_import_ucudnn_needs_neither_torch_nor_sqlalchemy():
    code = "import sys, ucudnn; ucudnn.Handle; print(sorted(m for m in ('torch', 'sqlalchemy', 'cupy') if m in sys.modules))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"
