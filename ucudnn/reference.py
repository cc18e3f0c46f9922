"""The float64 reference convolution that every algorithm is checked against.

Written in plain NumPy (or CuPy, where the operands are), by direct summation over the filter taps,
independently of every algorithm a backend offers: a backend verifies each candidate against it
before the candidate may be chosen (`Backend.trusted_result`), and `ucudnn selftest` checks every
algorithm against it. Errors are normwise (`relative_error`): one number per comparison, which does not
blow up where a single expected value happens to be near zero.
"""

from __future__ import annotations

import itertools
import math
from typing import Any

import numpy as np

from ucudnn.problem import ConvProblem

# A denominator floor for the normwise error of an all-zero expected output.
_TINY = 1e-30


def reference(problem: ConvProblem, *, x: Any = None, w: Any = None, dy: Any = None, xp: Any = np) -> Any:
    """The kernel's exact result in float64, by direct summation over the filter taps.

    With the spatial axes as a vector (i, j) = (d, h, w) or (h, w), stride S, dilation D and tap m:

    fwd:        y[n, k, i]  = sum_{c, m} x_pad[n, c, i*S + m*D] * w[k, c, m]
    bwd_data:   dx = the adjoint of fwd in x: each dy[n, k, i] * w[k, c, m] lands on the x_pad
                position fwd read it from, then the padding is cropped
    bwd_filter: dw[k, c, m] = sum_{n, i} dy[n, k, i] * x_pad[n, c, i*S + m*D]
    with c restricted to the group of k (c/groups channels per group). A transposed problem is the
    kernel of its `lowered` convolution, whose dy is the transposed x and whose x is the transposed
    dy. `xp` is the array module (NumPy, or CuPy to compute on the GPU where the operands are).
    """
    if problem.transposed:
        return reference(problem.lowered(), x=dy, w=w, dy=x, xp=xp)
    p = problem
    axes = p.axes
    groups, cg, kg = p.groups, p.c // p.groups, p.k // p.groups
    pads = ((0, 0), (0, 0), *((a.pad, a.pad) for a in axes))
    spatial = "dhw"[-len(axes) :]

    def taps():
        """Every filter tap m and the strided window of the padded input it reads."""
        for tap in itertools.product(*(range(a.filter) for a in axes)):
            yield (
                tap,
                (
                    slice(None),
                    slice(None),
                    *(
                        slice(m * a.dilation, m * a.dilation + a.stride * (a.out - 1) + 1, a.stride)
                        for m, a in zip(tap, axes)
                    ),
                ),
            )

    def group(g: int) -> tuple[slice, slice]:
        return slice(g * cg, (g + 1) * cg), slice(g * kg, (g + 1) * kg)

    if p.kind == "fwd":
        x_pad = xp.pad(xp.asarray(x, dtype=xp.float64), pads)
        w64 = xp.asarray(w, dtype=xp.float64)
        y = xp.zeros(p.y_shape)
        for tap, window in taps():
            patch = x_pad[window]
            for g in range(groups):
                cs, ks = group(g)
                y[:, ks] += xp.einsum(
                    f"nc{spatial},kc->nk{spatial}", patch[:, cs], w64[(ks, slice(None), *tap)], optimize=True
                )
        return y
    if p.kind == "bwd_data":
        dy64, w64 = xp.asarray(dy, dtype=xp.float64), xp.asarray(w, dtype=xp.float64)
        dx_pad = xp.zeros((p.n, p.c, *(a.size + 2 * a.pad for a in axes)))
        for tap, window in taps():
            view = dx_pad[window]  # a strided view: the += lands in dx_pad
            for g in range(groups):
                cs, ks = group(g)
                view[:, cs] += xp.einsum(
                    f"nk{spatial},kc->nc{spatial}", dy64[:, ks], w64[(ks, slice(None), *tap)], optimize=True
                )
        return dx_pad[(slice(None), slice(None), *(slice(a.pad, a.pad + a.size) for a in axes))]
    x_pad = xp.pad(xp.asarray(x, dtype=xp.float64), pads)
    dy64 = xp.asarray(dy, dtype=xp.float64)
    dw = xp.zeros(p.w_shape)
    summed = [0, *range(2, 2 + len(axes))]
    for tap, window in taps():
        patch = x_pad[window]
        for g in range(groups):
            cs, ks = group(g)
            dw[(ks, slice(None), *tap)] = xp.tensordot(dy64[:, ks], patch[:, cs], axes=(summed, summed))
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
