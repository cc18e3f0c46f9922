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
    return (
        slice(top, top + (p.out_h - 1) * p.stride_h + 1, p.stride_h),
        slice(left, left + (p.out_w - 1) * p.stride_w + 1, p.stride_w),
    )


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
                    dxp[:, cs, rows, cols] += np.einsum(
                        "nkhw,kc->nchw", np.asarray(dy[:, ks], np.float64), w[ks, :, i, j]
                    )
        return dxp[:, :, p.pad_h : p.pad_h + p.h, p.pad_w : p.pad_w + p.w]
    xp = np.pad(np.asarray(x, np.float64), pads)
    dw = np.zeros(p.w_shape)
    for i in range(p.r):
        for j in range(p.s):
            rows, cols = _windows(p, i, j)
            for ks, cs in groups:
                dw[ks, :, i, j] = np.einsum("nkhw,nchw->kc", np.asarray(dy[:, ks], np.float64), xp[:, cs, rows, cols])
    return dw


# Every form a problem takes, small and odd-sized: 1-D (a 2-D problem of height 1), 2-D and 3-D;
# plain, grouped, dilated, strided, padded; transposed with output padding. Each is checked for all
# three kinds against torch's own functions (`torch_reference`) and by every CPU algorithm.
FORMS = {
    "1d": "n=3,c=4,h=1,w=11,k=6,r=1,s=3,pad_w=1",
    "1d_strided_dilated_grouped": "n=2,c=6,h=1,w=13,k=4,r=1,s=3,pad_w=2,stride_w=2,dilation_w=2,groups=2",
    "2d_mixed": "n=3,c=4,h=9,w=8,k=6,r=3,s=2,pad_h=1,stride_h=2,dilation_w=2",
    "3d": "n=2,c=3,d=5,h=6,w=5,k=4,t=3,r=3,s=3,pad=1",
    "3d_strided_grouped": "n=3,c=4,d=7,h=6,w=5,k=6,t=3,r=2,s=3,pad_d=1,pad_w=2,stride=2,groups=2",
    "3d_dilated": "n=2,c=2,d=7,h=7,w=6,k=3,t=2,r=3,s=2,dilation=2,pad_h=1,stride_w=2",
    "t1d": "n=2,c=4,h=1,w=7,k=6,r=1,s=3,pad_w=1,stride_w=2,transposed=1,output_padding_w=1",
    "t2d_grouped": "n=3,c=4,h=5,w=4,k=6,r=3,s=2,pad=1,stride=2,transposed=1,output_padding_h=1,groups=2",
    "t2d_dilated": "n=2,c=3,h=5,w=5,k=2,r=3,s=3,stride=3,dilation=2,transposed=1,output_padding=2",
    "t3d_unet_up": "n=2,c=4,d=3,h=4,w=3,k=4,t=2,r=2,s=2,stride=2,transposed=1",
    "t3d_padded_grouped": "n=2,c=4,d=4,h=3,w=4,k=6,t=3,r=3,s=3,pad=1,stride=2,transposed=1,output_padding=1,groups=2",
}


def is_1d(p: ConvProblem) -> bool:
    """A 2-D problem of height 1 that a 1-D convolution gives."""
    return not p.d and p.h == p.r == 1 and p.pad_h == 0 and p.stride_h == p.dilation_h == 1 and p.output_padding_h == 0


def torch_reference(p: ConvProblem, *, x=None, w=None, dy=None) -> np.ndarray:
    """y, dx or dw through torch's own conv1d/2d/3d or conv_transpose1d/2d/3d in float64, the
    gradients by autograd. A 1-D form (`is_1d`) runs as conv1d on the (n, c, l) views."""
    F = torch.nn.functional
    one_d = is_1d(p)
    axes = p.axes[1:] if one_d else p.axes
    dims = len(axes)
    fn = getattr(F, f"conv_transpose{dims}d" if p.transposed else f"conv{dims}d")
    args = {
        "stride": tuple(a.stride for a in axes),
        "padding": tuple(a.pad for a in axes),
        "dilation": tuple(a.dilation for a in axes),
        "groups": p.groups,
    }
    if p.transposed:
        args["output_padding"] = tuple(a.output_padding for a in axes)

    def tensor(a, shape, grad=False):
        values = np.zeros(shape) if a is None else np.asarray(a, np.float64)
        t = torch.from_numpy(values.reshape(values.shape[:2] + values.shape[3:]) if one_d else values)
        return t.requires_grad_(grad)

    tx = tensor(x, p.x_shape, grad=p.kind == "bwd_data")
    tw = tensor(w, p.w_shape, grad=p.kind == "bwd_filter")
    y = fn(tx, tw, **args)
    if p.kind == "fwd":
        result = y.detach()
    else:
        y.backward(tensor(dy, p.y_shape))
        result = tx.grad if p.kind == "bwd_data" else tw.grad
    return result.numpy().reshape(p.out_shape)


def reference(p: ConvProblem, *, x=None, w=None, dy=None) -> np.ndarray:
    fn = torch_reference if torch is not None else numpy_reference
    return fn(p, x=x, w=w, dy=dy)


def assert_close(actual: np.ndarray, expected: np.ndarray, dtype: str, what: str) -> None:
    """Within float32 (or float64) rounding, measured against the scale of the expected output."""
    rel = 1e-4 if dtype == "float32" else 1e-10
    scale = float(np.abs(expected).max()) or 1.0
    np.testing.assert_allclose(actual, expected, rtol=rel, atol=rel * scale, err_msg=what)
