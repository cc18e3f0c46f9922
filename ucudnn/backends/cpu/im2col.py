"""`im2col_gemm`: unfold the padded input of the whole micro-batch into a (c taps) x (n P) column
matrix and run one GEMM per group, over 2 or 3 spatial axes. Its workspace layout is beside it;
workspace grows linearly with n."""

from __future__ import annotations

import math

import numpy as np

from ucudnn.backends.cpu.common import _blend, _gather_plan, _run_gather, _scale_out, _scatter_plan, _tap_moves
from ucudnn.backends.cpu.layout import _Layout
from ucudnn.problem import ConvProblem

# Columns up to this size are cleared whole before the gathers (one call) rather than border by border
# (a call per border of each filter tap): below it the calls cost more than the bytes; above it, clearing
# the whole matrix would write it twice (it is filter-size times the input).
CLEAR_WHOLE_BYTES = 256 * 1024

# Columns are laid out (c, taps..., n, outs...): the rows of one group are one contiguous
# (c/g * taps) x (n * P) block, so each group is a single large GEMM against the filter viewed as
# (k/g) x (c/g * taps), and numpy.matmul over a leading group axis runs all groups in one call.


def _shape(p: ConvProblem) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The filter's taps and y's extents, one per spatial axis."""
    axes = p.axes
    return tuple(a.filter for a in axes), tuple(a.out for a in axes)


def _im2col_layout(p: ConvProblem) -> _Layout:
    dt = np.dtype(p.dtype)
    taps, outs = _shape(p)
    n_p = p.n * math.prod(outs)
    lay = _Layout()
    if p.kind in ("fwd", "bwd_filter"):
        lay.add("col", (p.c, *taps, p.n, *outs), dt)
    if p.kind in ("bwd_data", "bwd_filter"):
        lay.add("dyt", (p.k, p.n, math.prod(outs)), dt)
    if p.kind == "fwd":
        lay.add("yt", (p.k, n_p), dt)
    elif p.kind == "bwd_data":
        lay.add("dcol", (p.c, *taps, p.n, *outs), dt)
    else:
        lay.add("dw", (p.k, (p.c // p.groups) * math.prod(taps)), dt)
    return lay


def _prepare_im2col(p: ConvProblem):
    """`_run_im2col` with what depends on the problem alone made once: its shapes, and each filter tap's
    gather (fwd, bwd_filter) or scatter-add (bwd_data) as index tuples (`_gather_plan`, `_scatter_plan`).

    Returns (views, run): `views(ws)` shapes the carved workspace's arrays as the GEMMs read them (once
    per buffer), `run(views, x, w, dy, out, alpha, beta)` computes and only computes.
    """
    g, kg, cg, n, k = p.groups, p.k // p.groups, p.c // p.groups, p.n, p.k
    taps, outs = _shape(p)
    crs_g = cg * math.prod(taps)
    n_p = n * math.prod(outs)
    kind = p.kind
    image = (p.c, n, *p.x_shape[2:])  # x (or dx) with its first two axes swapped, as the columns are laid out
    tap_shape = (p.c, n, *outs)
    moves = _tap_moves(p)
    if kind == "bwd_data":
        scatters = [
            plan for tap, mv in moves if (plan := _scatter_plan(image, tap_shape, mv, (slice(None), *tap))) is not None
        ]
    else:
        gathers = [_gather_plan(tap_shape, image, mv, (slice(None), *tap)) for tap, mv in moves]
        col_bytes = math.prod(tap_shape) * math.prod(taps) * np.dtype(p.dtype).itemsize
        clear = col_bytes <= CLEAR_WHOLE_BYTES and sum(len(zeros) for zeros, _, _ in gathers) > 1
        if clear:  # one clear, then each tap writes its inside only
            gathers = [([], inside, reads) for _, inside, reads in gathers]

    def views(ws: dict[str, np.ndarray]) -> tuple:
        if kind == "fwd":
            col, yt = ws["col"], ws["yt"]
            return col, col.reshape(g, crs_g, n_p), yt.reshape(g, kg, n_p), yt.reshape(k, n, -1).transpose(1, 0, 2)
        dyt = ws["dyt"]
        if kind == "bwd_filter":
            col, dw = ws["col"], ws["dw"]
            return (
                dyt,
                dyt.reshape(g, kg, n_p),
                col,
                col.reshape(g, crs_g, n_p).transpose(0, 2, 1),
                dw,
                dw.reshape(g, kg, crs_g),
            )
        dcol = ws["dcol"]
        return dyt, dyt.reshape(g, kg, n_p), dcol, dcol.reshape(g, crs_g, n_p)

    if kind == "fwd":

        def run(v, x, w, dy, out, alpha, beta) -> None:
            col, col_g, yt_g, yt_t = v
            xt = x.swapaxes(0, 1)
            if clear:
                col.fill(0)
            for plan in gathers:
                _run_gather(col, xt, plan)
            np.matmul(w.reshape(g, kg, crs_g), col_g, out=yt_g)
            _blend(out.reshape(n, k, -1), yt_t, alpha, beta)
    elif kind == "bwd_filter":

        def run(v, x, w, dy, out, alpha, beta) -> None:
            dyt, dy_g, col, col_t, dw, dw_g = v
            np.copyto(dyt, dy.reshape(n, k, -1).transpose(1, 0, 2))
            xt = x.swapaxes(0, 1)
            if clear:
                col.fill(0)
            for plan in gathers:
                _run_gather(col, xt, plan)
            np.matmul(dy_g, col_t, out=dw_g)
            _blend(out.reshape(k, -1), dw, alpha, beta)
    else:

        def run(v, x, w, dy, out, alpha, beta) -> None:
            dyt, dy_g, dcol, dcol_g = v
            np.copyto(dyt, dy.reshape(n, k, -1).transpose(1, 0, 2))
            np.matmul(w.reshape(g, kg, crs_g).transpose(0, 2, 1), dy_g, out=dcol_g)
            if alpha != 1.0:
                np.multiply(dcol, alpha, out=dcol)
            _scale_out(out, beta)
            # col2im: no NumPy/SciPy routine folds columns back with stride and dilation, so each
            # filter tap scatter-adds its (c, n, outs...) slab into the image.
            outt = out.swapaxes(0, 1)
            for into, read in scatters:
                target = outt[into]
                np.add(target, dcol[read], out=target)

    return views, run


def _run_im2col(p: ConvProblem, ws: dict[str, np.ndarray], x, w, dy, out, alpha: float, beta: float) -> None:
    views, run = _prepare_im2col(p)
    run(views(ws), x, w, dy, out, alpha, beta)
