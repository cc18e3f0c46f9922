"""Independent float64 convolution references for the backend tests.

`reference` uses PyTorch (torch.nn.functional.conv2d and torch.nn.grad) when it imports, else
`numpy_reference`, a direct loop over filter offsets written for clarity, not speed.
"""

from __future__ import annotations

import numpy as np

from ucudnn.problem import ConvProblem

try:
    import torch
except ImportError:  # the NumPy reference stands in
    torch = None


def _windows(p: ConvProblem, i: int, j: int) -> tuple[slice, slice]:
    """Rows and columns of the padded input that filter tap (i, j) reads for every output pixel."""
    top, left = i * p.dilation_h, j * p.dilation_w
    return (slice(top, top + (p.out_h - 1) * p.stride_h + 1, p.stride_h),
            slice(left, left + (p.out_w - 1) * p.stride_w + 1, p.stride_w))


def numpy_reference(p: ConvProblem, *, x=None, w=None, dy=None) -> np.ndarray:
    """y, dx or dw of `p` in float64 by summing one shifted product per filter tap."""
    g, kg, cg = p.groups, p.k // p.groups, p.c // p.groups
    pads = ((0, 0), (0, 0), (p.pad_h, p.pad_h), (p.pad_w, p.pad_w))
    groups = [(slice(gi * kg, (gi + 1) * kg), slice(gi * cg, (gi + 1) * cg)) for gi in range(g)]
    if p.kind == "fwd":
        xp = np.pad(np.asarray(x, np.float64), pads)
        y = np.zeros(p.y_shape)
        for i in range(p.r):
            for j in range(p.s):
                rows, cols = _windows(p, i, j)
                for ks, cs in groups:
                    y[:, ks] += np.einsum("nchw,kc->nkhw", xp[:, cs, rows, cols], w[ks, :, i, j])
        return y
    if p.kind == "bwd_data":
        dxp = np.zeros((p.n, p.c, p.h + 2 * p.pad_h, p.w + 2 * p.pad_w))
        for i in range(p.r):
            for j in range(p.s):
                rows, cols = _windows(p, i, j)
                for ks, cs in groups:
                    dxp[:, cs, rows, cols] += np.einsum("nkhw,kc->nchw", np.asarray(dy[:, ks], np.float64),
                                                        w[ks, :, i, j])
        return dxp[:, :, p.pad_h:p.pad_h + p.h, p.pad_w:p.pad_w + p.w]
    xp = np.pad(np.asarray(x, np.float64), pads)
    dw = np.zeros(p.w_shape)
    for i in range(p.r):
        for j in range(p.s):
            rows, cols = _windows(p, i, j)
            for ks, cs in groups:
                dw[ks, :, i, j] = np.einsum("nkhw,nchw->kc", np.asarray(dy[:, ks], np.float64), xp[:, cs, rows, cols])
    return dw


def torch_reference(p: ConvProblem, *, x=None, w=None, dy=None) -> np.ndarray:
    t = lambda a: torch.from_numpy(np.asarray(a, np.float64))  # noqa: E731
    conv = dict(stride=(p.stride_h, p.stride_w), padding=(p.pad_h, p.pad_w),
                dilation=(p.dilation_h, p.dilation_w), groups=p.groups)
    if p.kind == "fwd":
        return torch.nn.functional.conv2d(t(x), t(w), **conv).numpy()
    if p.kind == "bwd_data":
        return torch.nn.grad.conv2d_input(p.x_shape, t(w), t(dy), **conv).numpy()
    return torch.nn.grad.conv2d_weight(t(x), p.w_shape, t(dy), **conv).numpy()


def reference(p: ConvProblem, *, x=None, w=None, dy=None) -> np.ndarray:
    fn = torch_reference if torch is not None else numpy_reference
    return fn(p, x=x, w=w, dy=dy)


def assert_close(actual: np.ndarray, expected: np.ndarray, dtype: str, what: str) -> None:
    """Within float32 (or float64) rounding, measured against the scale of the expected output."""
    rel = 1e-4 if dtype == "float32" else 1e-10
    scale = float(np.abs(expected).max()) or 1.0
    np.testing.assert_allclose(actual, expected, rtol=rel, atol=rel * scale, err_msg=what)
