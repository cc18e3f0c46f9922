"""`native`: PyTorch's own convolution as a launcher, offered only when torch is installed. It runs
every form as PyTorch does (2-D and 3-D, plain and transposed; 1-D is PyTorch's own 2-D path of
height 1). torch allocates its own temporaries, so it has no workspace layout."""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util

from ucudnn.backends.cpu.common import _blend
from ucudnn.problem import ConvProblem


@functools.cache
def _torch_version() -> str | None:
    """PyTorch's version when it is installed, found without importing it (that takes seconds,
    which a run served entirely from the cache should not pay)."""
    if importlib.util.find_spec("torch") is None:
        return None
    try:
        return importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return None


def _forward(torch, p: ConvProblem):
    """The C++ entry point that F.conv2d, F.conv3d or F.conv_transpose2d/3d call for this form (each
    reaches aten's convolution with its arguments already fixed)."""
    dims = p.spatial_dims
    if p.transposed:
        transpose = torch.conv_transpose2d if dims == 2 else torch.conv_transpose3d
        padding = [a.output_padding for a in p.axes]
        return lambda x, w, stride, pad, dilation, groups: transpose(x, w, None, stride, pad, padding, groups, dilation)
    conv = torch.conv2d if dims == 2 else torch.conv3d
    return lambda x, w, stride, pad, dilation, groups: conv(x, w, None, stride, pad, dilation, groups)


def _native_launcher(p: ConvProblem):
    """`native` as a launcher, its torch call fixed once: the forward's C++ entry point and aten's
    convolution_backward directly (torch.nn.grad's wrappers re-derive their arguments per call),
    and the result copied into `out` by torch when no scaling is asked for. Operands from NumPy
    need no gradient, so no autograd graph is built."""
    import torch

    axes = p.axes
    stride, padding, dilation = [a.stride for a in axes], [a.pad for a in axes], [a.dilation for a in axes]
    output_padding = [a.output_padding for a in axes]
    mask = [p.kind == "bwd_data", p.kind == "bwd_filter", False]
    backward = torch.ops.aten.convolution_backward
    forward = _forward(torch, p)
    x_shape, w_shape, transposed = list(p.x_shape), list(p.w_shape), p.transposed

    def launch(x, w, dy, out, workspace, alpha, beta):
        if p.kind == "fwd":
            result = forward(torch.from_numpy(x), torch.from_numpy(w), stride, padding, dilation, p.groups)
        elif p.kind == "bwd_data":
            tdy = torch.from_numpy(dy)
            result = backward(
                tdy,
                _shaped(tdy, x_shape),
                torch.from_numpy(w),
                None,
                stride,
                padding,
                dilation,
                transposed,
                output_padding,
                p.groups,
                mask,
            )[0]
        else:
            tdy = torch.from_numpy(dy)
            result = backward(
                tdy,
                torch.from_numpy(x),
                _shaped(tdy, w_shape),
                None,
                stride,
                padding,
                dilation,
                transposed,
                output_padding,
                p.groups,
                mask,
            )[1]
        if alpha == 1.0 and beta == 0.0:
            torch.from_numpy(out).copy_(result)
        else:
            _blend(out, result.contiguous().numpy(), alpha, beta)

    return launch


def _shaped(like, shape):
    """A tensor of `shape` holding one element (a stride-0 view), as torch.nn.grad passes the operand
    whose gradient is not asked for: convolution_backward reads only its shape."""
    return like.new_empty(1).expand(shape)
