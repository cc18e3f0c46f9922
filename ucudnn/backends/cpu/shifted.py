"""`shift_gemm`: one GEMM per filter tap, accumulating in BLAS (beta = 1), one sample at a time, over
2 or 3 spatial axes. Its workspace layout is beside it: one shifted input slab and a filter copy,
independent of n."""

from __future__ import annotations

import math

import numpy as np
from scipy.linalg import blas as scipy_blas

from ucudnn.backends.cpu.common import _blend, _gather, _scale_out, _scatter_add, _tap_moves
from ucudnn.backends.cpu.layout import _Layout
from ucudnn.problem import ConvProblem

# One sample at a time; per filter tap (i, j) (or (i, j, l) in 3-D) a GEMM against the (c, outs...)
# slab of the input shifted by that tap. BLAS gemm with beta = 1 accumulates in place
# (numpy.matmul cannot), so SciPy's BLAS wrappers are called on Fortran-ordered views (the
# transposes of our C-ordered arrays), which they use without copying.


def _shift_layout(p: ConvProblem) -> _Layout:
    dt = np.dtype(p.dtype)
    lay = _Layout()
    # filter per tap; the dW accumulator for bwd_filter
    lay.add("wt", (*(a.filter for a in p.axes), p.k, p.c // p.groups), dt)
    lay.add("slab", (p.c, *(a.out for a in p.axes)), dt)
    return lay


def _gemm(dtype: np.dtype):
    return scipy_blas.sgemm if dtype == np.float32 else scipy_blas.dgemm


def _run_shift(p: ConvProblem, ws: dict[str, np.ndarray], x, w, dy, out, alpha: float, beta: float) -> None:
    g, kg, cg = p.groups, p.k // p.groups, p.c // p.groups
    n_p = math.prod(a.out for a in p.axes)
    gemm = _gemm(np.dtype(p.dtype))
    wt, slab = ws["wt"], ws["slab"]
    slab_g = slab.reshape(g, cg, n_p)
    offsets = [(wt[tap], moves) for tap, moves in _tap_moves(p)]
    if p.kind != "bwd_filter":
        np.copyto(wt, np.moveaxis(w, (0, 1), (-2, -1)))
    for n in range(p.n):
        if p.kind == "fwd":
            y_g = out[n].reshape(g, kg, n_p)
            for t, (w_tap, moves) in enumerate(offsets):
                _gather(slab, x[n], *moves)
                for gi in range(g):
                    # y_g^T (P, kg) = slab_g^T (P, cg) @ W_tap_g^T (cg, kg), accumulated
                    gemm(
                        alpha,
                        slab_g[gi].T,
                        w_tap[gi * kg : (gi + 1) * kg].T,
                        beta=beta if t == 0 else 1.0,
                        c=y_g[gi].T,
                        overwrite_c=1,
                    )
        elif p.kind == "bwd_data":
            dy_g = dy[n].reshape(g, kg, n_p)
            _scale_out(out[n], beta)
            for w_tap, moves in offsets:
                for gi in range(g):
                    # slab_g^T (P, cg) = dy_g^T (P, kg) @ W_tap_g (kg, cg)
                    gemm(
                        alpha,
                        dy_g[gi].T,
                        w_tap[gi * kg : (gi + 1) * kg].T,
                        trans_b=1,
                        beta=0.0,
                        c=slab_g[gi].T,
                        overwrite_c=1,
                    )
                _scatter_add(out[n], slab, *moves)
        else:
            dy_g = dy[n].reshape(g, kg, n_p)
            for w_tap, moves in offsets:
                _gather(slab, x[n], *moves)
                for gi in range(g):
                    # dW_tap_g^T (cg, kg) += slab_g (cg, P) @ dy_g^T (P, kg)
                    gemm(
                        1.0,
                        slab_g[gi].T,
                        dy_g[gi].T,
                        trans_a=1,
                        beta=0.0 if n == 0 else 1.0,
                        c=w_tap[gi * kg : (gi + 1) * kg].T,
                        overwrite_c=1,
                    )
    if p.kind == "bwd_filter":
        _blend(out, np.moveaxis(wt, (-2, -1), (0, 1)), alpha, beta)
