"""`shift_gemm`: one GEMM per filter offset (i, j), accumulating in BLAS (beta = 1), one sample at
a time. Its workspace layout is beside it: one shifted input slab and a filter copy, independent of n."""

from __future__ import annotations

import numpy as np
from scipy.linalg import blas as scipy_blas

from ucudnn.backends.cpu.common import _blend, _gather, _scale_out, _scatter_add
from ucudnn.backends.cpu.layout import _Layout
from ucudnn.problem import ConvProblem

# One sample at a time; per filter offset (i, j) a GEMM against the (c, oh, ow) slab of the input
# shifted by that offset. BLAS gemm with beta = 1 accumulates in place (numpy.matmul cannot), so
# SciPy's BLAS wrappers are called on Fortran-ordered views (the transposes of our C-ordered
# arrays), which they use without copying.

def _shift_layout(p: ConvProblem) -> _Layout:
    dt = np.dtype(p.dtype)
    lay = _Layout()
    lay.add("wt", (p.r, p.s, p.k, p.c // p.groups), dt)  # filter per offset; dW accumulator for bwd_filter
    lay.add("slab", (p.c, p.out_h, p.out_w), dt)
    return lay


def _gemm(dtype: np.dtype):
    return scipy_blas.sgemm if dtype == np.float32 else scipy_blas.dgemm


def _run_shift(p: ConvProblem, ws: dict[str, np.ndarray], x, w, dy, out, alpha: float, beta: float) -> None:
    g, kg, cg = p.groups, p.k // p.groups, p.c // p.groups
    n_p = p.out_h * p.out_w
    gemm = _gemm(np.dtype(p.dtype))
    wt, slab = ws["wt"], ws["slab"]
    slab_g = slab.reshape(g, cg, n_p)
    offsets = [(i, j, (p.stride_h, i * p.dilation_h - p.pad_h), (p.stride_w, j * p.dilation_w - p.pad_w))
               for i in range(p.r) for j in range(p.s)]
    if p.kind != "bwd_filter":
        np.copyto(wt, w.transpose(2, 3, 0, 1))
    for n in range(p.n):
        if p.kind == "fwd":
            y_g = out[n].reshape(g, kg, n_p)
            for t, (i, j, rows, cols) in enumerate(offsets):
                _gather(slab, x[n], rows, cols)
                for gi in range(g):
                    # y_g^T (P, kg) = slab_g^T (P, cg) @ W_ij_g^T (cg, kg), accumulated
                    gemm(alpha, slab_g[gi].T, wt[i, j, gi * kg:(gi + 1) * kg].T,
                         beta=beta if t == 0 else 1.0, c=y_g[gi].T, overwrite_c=1)
        elif p.kind == "bwd_data":
            dy_g = dy[n].reshape(g, kg, n_p)
            _scale_out(out[n], beta)
            for i, j, rows, cols in offsets:
                for gi in range(g):
                    # slab_g^T (P, cg) = dy_g^T (P, kg) @ W_ij_g (kg, cg)
                    gemm(alpha, dy_g[gi].T, wt[i, j, gi * kg:(gi + 1) * kg].T, trans_b=1,
                         beta=0.0, c=slab_g[gi].T, overwrite_c=1)
                _scatter_add(out[n], slab, rows, cols)
        else:
            dy_g = dy[n].reshape(g, kg, n_p)
            for i, j, rows, cols in offsets:
                _gather(slab, x[n], rows, cols)
                for gi in range(g):
                    # dW_ij_g^T (cg, kg) += slab_g (cg, P) @ dy_g^T (P, kg)
                    gemm(1.0, slab_g[gi].T, dy_g[gi].T, trans_a=1, beta=0.0 if n == 0 else 1.0,
                         c=wt[i, j, gi * kg:(gi + 1) * kg].T, overwrite_c=1)
    if p.kind == "bwd_filter":
        _blend(out, wt.transpose(2, 3, 0, 1), alpha, beta)
