"""`im2col_gemm`: unfold the padded input of the whole micro-batch into a (c r s) x (n P) column
matrix and run one GEMM per group. Its workspace layout is beside it; workspace grows linearly with n."""

from __future__ import annotations

import numpy as np

from ucudnn.backends.cpu.common import _blend, _gather, _scale_out, _scatter_add
from ucudnn.backends.cpu.layout import _Layout
from ucudnn.problem import ConvProblem

# Columns are laid out (c, r, s, n, oh, ow): the rows of one group are one contiguous
# (c/g * r * s) x (n * P) block, so each group is a single large GEMM against the filter viewed as
# (k/g) x (c/g * r * s), and numpy.matmul over a leading group axis runs all groups in one call.

def _im2col_layout(p: ConvProblem) -> _Layout:
    dt = np.dtype(p.dtype)
    n_p = p.n * p.out_h * p.out_w
    lay = _Layout()
    if p.kind in ("fwd", "bwd_filter"):
        lay.add("col", (p.c, p.r, p.s, p.n, p.out_h, p.out_w), dt)
    if p.kind in ("bwd_data", "bwd_filter"):
        lay.add("dyt", (p.k, p.n, p.out_h * p.out_w), dt)
    if p.kind == "fwd":
        lay.add("yt", (p.k, n_p), dt)
    elif p.kind == "bwd_data":
        lay.add("dcol", (p.c, p.r, p.s, p.n, p.out_h, p.out_w), dt)
    else:
        lay.add("dw", (p.k, (p.c // p.groups) * p.r * p.s), dt)
    return lay


def _im2col_fill(p: ConvProblem, col: np.ndarray, x: np.ndarray) -> None:
    xt = x.transpose(1, 0, 2, 3)  # (c, n, h, w), matching the column layout
    for i in range(p.r):
        for j in range(p.s):
            _gather(col[:, i, j], xt, (p.stride_h, i * p.dilation_h - p.pad_h),
                    (p.stride_w, j * p.dilation_w - p.pad_w))


def _run_im2col(p: ConvProblem, ws: dict[str, np.ndarray], x, w, dy, out, alpha: float, beta: float) -> None:
    g, kg, cg = p.groups, p.k // p.groups, p.c // p.groups
    crs_g = cg * p.r * p.s
    n_p = p.n * p.out_h * p.out_w
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
        # filter offset scatter-adds its (c, n, oh, ow) slab into the image.
        outt = out.transpose(1, 0, 2, 3)
        for i in range(p.r):
            for j in range(p.s):
                _scatter_add(outt, dcol[:, i, j], (p.stride_h, i * p.dilation_h - p.pad_h),
                             (p.stride_w, j * p.dilation_w - p.pad_w))
