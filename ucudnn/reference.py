"""The float64 reference convolution that every algorithm is checked against.

Written in plain NumPy (or CuPy, where the operands are), by direct summation over the filter taps,
independently of every algorithm a backend offers: a backend verifies each candidate against it
before the candidate may be chosen (`Backend.trusted_result`), and `ucudnn selftest` checks every
algorithm against it. Errors are normwise (`relative_error`): one number per comparison, which does not
blow up where a single expected value happens to be near zero.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from ucudnn.problem import ConvProblem

# A denominator floor for the normwise error of an all-zero expected output.
_TINY = 1e-30


def reference(problem: ConvProblem, *, x: Any = None, w: Any = None, dy: Any = None, xp: Any = np) -> Any:
    """The kernel's exact result in float64, by direct summation over the filter taps.

    fwd:        y[n, k, i, j]  = sum_{c, r, s} x_pad[n, c, i*sh + r*dh, j*sw + s*dw] * w[k, c, r, s]
    bwd_data:   dx = the adjoint of fwd in x: each dy[n, k, i, j] * w[k, c, r, s] lands on the
                x_pad position fwd read it from, then the padding is cropped
    bwd_filter: dw[k, c, r, s] = sum_{n, i, j} dy[n, k, i, j] * x_pad[n, c, i*sh + r*dh, j*sw + s*dw]
    with c restricted to the group of k (c/groups channels per group). `xp` is the array module
    (NumPy, or CuPy to compute on the GPU where the operands are).
    """
    p = problem
    groups, cg, kg = p.groups, p.c // p.groups, p.k // p.groups
    pads = ((0, 0), (0, 0), (p.pad_h, p.pad_h), (p.pad_w, p.pad_w))

    def taps():
        """Every filter tap (r, s) and the strided window of the padded input it reads."""
        for r in range(p.r):
            for s in range(p.s):
                top, left = r * p.dilation_h, s * p.dilation_w
                yield r, s, (slice(None), slice(None),
                             slice(top, top + p.stride_h * (p.out_h - 1) + 1, p.stride_h),
                             slice(left, left + p.stride_w * (p.out_w - 1) + 1, p.stride_w))

    def group(g: int) -> tuple[slice, slice]:
        return slice(g * cg, (g + 1) * cg), slice(g * kg, (g + 1) * kg)

    if p.kind == "fwd":
        x_pad = xp.pad(xp.asarray(x, dtype=xp.float64), pads)
        w64 = xp.asarray(w, dtype=xp.float64)
        y = xp.zeros(p.y_shape)
        for r, s, window in taps():
            patch = x_pad[window]
            for g in range(groups):
                cs, ks = group(g)
                y[:, ks] += xp.einsum("nchw,kc->nkhw", patch[:, cs], w64[ks, :, r, s], optimize=True)
        return y
    if p.kind == "bwd_data":
        dy64, w64 = xp.asarray(dy, dtype=xp.float64), xp.asarray(w, dtype=xp.float64)
        dx_pad = xp.zeros((p.n, p.c, p.h + 2 * p.pad_h, p.w + 2 * p.pad_w))
        for r, s, window in taps():
            view = dx_pad[window]  # a strided view: the += lands in dx_pad
            for g in range(groups):
                cs, ks = group(g)
                view[:, cs] += xp.einsum("nkhw,kc->nchw", dy64[:, ks], w64[ks, :, r, s], optimize=True)
        return dx_pad[:, :, p.pad_h:p.pad_h + p.h, p.pad_w:p.pad_w + p.w]
    x_pad = xp.pad(xp.asarray(x, dtype=xp.float64), pads)
    dy64 = xp.asarray(dy, dtype=xp.float64)
    dw = xp.zeros(p.w_shape)
    for r, s, window in taps():
        patch = x_pad[window]
        for g in range(groups):
            cs, ks = group(g)
            dw[ks, :, r, s] = xp.tensordot(dy64[:, ks], patch[:, cs], axes=([0, 2, 3], [0, 2, 3]))
    return dw


def to_host_float64(array: Any, dtype: str) -> np.ndarray:
    """A backend array (NumPy or CuPy) as float64 NumPy; bfloat16 held as uint16 bits is decoded."""
    host = array.get() if hasattr(array, "get") and not isinstance(array, np.ndarray) else np.asarray(array)
    if dtype == "bfloat16" and host.dtype == np.uint16:
        return (host.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    return host.astype(np.float64)


def relative_error(actual: np.ndarray, expected: np.ndarray) -> float:
    """max |actual - expected| / max |expected|; infinite when `actual` has a NaN or an infinity."""
    if not np.all(np.isfinite(actual)):
        return math.inf
    scale = max(float(np.max(np.abs(expected), initial=0.0)), _TINY)
    return float(np.max(np.abs(actual - expected), initial=0.0)) / scale
