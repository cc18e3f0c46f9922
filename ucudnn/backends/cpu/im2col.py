"""`im2col_gemm`: unfold the padded input of the whole micro-batch into a (c taps) x (n P) column
matrix and run one GEMM per group, over 2 or 3 spatial axes. Its workspace layout is beside it;
workspace grows linearly with n."""

from __future__ import annotations

import math

import numpy as np

from ucudnn.backends.cpu.common import _blend, _gather, _scale_out, _scatter_add, _tap_moves
from ucudnn.backends.cpu.layout import _Layout
from ucudnn.problem import ConvProblem

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


def _im2col_fill(p: ConvProblem, col: np.ndarray, x: np.ndarray) -> None:
    xt = x.swapaxes(0, 1)  # (c, n, sizes...), matching the column layout
    for tap, moves in _tap_moves(p):
        _gather(col[(slice(None), *tap)], xt, *moves)


def _run_im2col(p: ConvProblem, ws: dict[str, np.ndarray], x, w, dy, out, alpha: float, beta: float) -> None:
    g, kg, cg = p.groups, p.k // p.groups, p.c // p.groups
    taps, outs = _shape(p)
    crs_g = cg * math.prod(taps)
    n_p = p.n * math.prod(outs)
    if p.kind in ("bwd_data", "bwd_filter"):
        np.copyto(ws["dyt"], dy.reshape(p.n, p.k, -1).transpose(1, 0, 2))
        dy_g = ws["dyt"].reshape(g, kg, n_p)
    if p.kind in ("fwd", "bwd_filter"):
        _im2col_fill(p, ws["col"], x)
        col_g = ws["col"].reshape(g, crs_g, n_p)
    if p.kind == "fwd":
        np.matmul(w.reshape(g, kg, crs_g), col_g, out=ws["yt"].reshape(g, kg, n_p))
        _blend(out.reshape(p.n, p.k, -1), ws["yt"].reshape(p.k, p.n, -1).transpose(1, 0, 2), alpha, beta)
    elif p.kind == "bwd_filter":
        np.matmul(dy_g, col_g.transpose(0, 2, 1), out=ws["dw"].reshape(g, kg, crs_g))
        _blend(out.reshape(p.k, -1), ws["dw"], alpha, beta)
    else:
        dcol = ws["dcol"]
        np.matmul(w.reshape(g, kg, crs_g).transpose(0, 2, 1), dy_g, out=dcol.reshape(g, crs_g, n_p))
        if alpha != 1.0:
            np.multiply(dcol, alpha, out=dcol)
        _scale_out(out, beta)
        # col2im: no NumPy/SciPy routine folds columns back with stride and dilation, so each
        # filter tap scatter-adds its (c, n, outs...) slab into the image.
        outt = out.swapaxes(0, 1)
        for tap, moves in _tap_moves(p):
            _scatter_add(outt, dcol[(slice(None), *tap)], *moves)
