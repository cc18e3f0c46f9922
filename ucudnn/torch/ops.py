"""ucudnn's three convolution kernels as PyTorch operators, so that torch.compile and torch.export
carry a converted convolution through a graph as one node per kernel:

    torch.ops.ucudnn.conv2d(x, weight, layer, stride, padding, dilation, groups, layout, need_dx, need_dw,
                            bias=None)
    torch.ops.ucudnn.conv2d_backward_data(dy, weight, layer, x_shape, stride, padding, dilation, groups,
                                          layout, need_dw)
    torch.ops.ucudnn.conv2d_backward_filter(x, dy, weight, layer, stride, padding, dilation, groups,
                                            layout, need_dx)

Each returns a fresh tensor (no mutation, no aliasing). `layer` is the int key of a live
`ucudnn.torch.Conv2d` in this module's registry (weak references: the registry keeps no layer
alive); every other argument is a value a graph can hold. The Python state that decides how a
kernel runs (the layer's current handle, its routes, WD's learning pass) is read inside the real
implementation when the graph runs, never while it is traced: planning and measuring see real
tensors only, and a handle that `execute_plan` swaps in is the one the kernel runs with. `need_dx`
and `need_dw` say which gradients the layer computes (they key its route as in eager mode; the
backward computes what autograd asks for either way). `layout` is "NCHW" or "NHWC" (channels-last
CUDA tensors); the operands are read, and the result is returned, in that memory format.

The bias is optional, its gradient ``dy.sum((0, 2, 3))``: with it, a convolution is one operation,
as `aten.convolution` is (a captured step names each by that one op). The fake implementations give
shapes and strides with
the kernels' own checks, so FakeTensorMode, Dynamo and export run nothing. A graph or exported
program runs only in the process, and while the model lives, whose layers it names; a missing
layer raises `InvalidInput`. Eager calls of a Conv2d do not go through these operators: the
dispatcher and the operator's autograd wrapper would add host time per call (see conv.py).
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ucudnn.errors import InvalidInput
from ucudnn.torch.launch import _launch, _memory_format, _out_size

__all__ = ["conv2d", "conv2d_backward_data", "conv2d_backward_filter", "layer_key", "register_layer"]

# Layers are ucudnn.torch.Conv2d, named here by their base class: conv imports this module, not the reverse.
_LAYERS: dict[int, weakref.ref] = {}
_KEYS = itertools.count(1)


def register_layer(conv: nn.Conv2d) -> int:
    """A new key for `conv`, valid until the module is collected."""
    key = next(_KEYS)
    _LAYERS[key] = weakref.ref(conv, lambda _, key=key: _LAYERS.pop(key, None))
    return key


def layer_key(conv: nn.Conv2d) -> int:
    """The key the operators name `conv` by."""
    return conv._key


def _layer(key: int) -> nn.Conv2d:
    ref = _LAYERS.get(key)
    conv = ref() if ref is not None else None
    if conv is None:
        raise InvalidInput(f"ucudnn operators: no live ucudnn.torch.Conv2d has key {key}; a compiled graph or "
                           "exported program runs only in the process, and while the model lives, that made it")
    return conv


def _check_conv(x_shape: Sequence, w_shape: Sequence, stride, padding, dilation, groups: int, layout: str) -> None:
    """The rules the kernels enforce, for the real and the fake implementations alike."""
    torch._check(len(x_shape) == 4 and len(w_shape) == 4,
                 lambda: f"ucudnn.conv2d: x and weight must be 4-D, got {len(x_shape)}-D and {len(w_shape)}-D")
    torch._check(len(stride) == 2 and len(padding) == 2 and len(dilation) == 2,
                 lambda: "ucudnn.conv2d: stride, padding and dilation must have two values each")
    torch._check(groups >= 1 and x_shape[1] == w_shape[1] * groups and w_shape[0] % groups == 0,
                 lambda: f"ucudnn.conv2d: x has {x_shape[1]} channels and weight {tuple(w_shape)} with groups="
                         f"{groups}; need channels = weight.shape[1] * groups and groups dividing weight.shape[0]")
    torch._check(layout in ("NCHW", "NHWC"), lambda: f"ucudnn.conv2d: layout must be NCHW or NHWC, got {layout!r}")


def _y_shape(x_shape, w_shape, stride, padding, dilation) -> list:
    shape = [x_shape[0], w_shape[0], _out_size(x_shape[2], w_shape[2], stride[0], padding[0], dilation[0]),
             _out_size(x_shape[3], w_shape[3], stride[1], padding[1], dilation[1])]
    torch._check(shape[2] > 0 and shape[3] > 0,
                 lambda: f"ucudnn.conv2d: the output would be {shape[2]}x{shape[3]}; the input is smaller than the "
                         "dilated filter")
    return shape


def _route(conv: nn.Conv2d, x: torch.Tensor, weight: torch.Tensor, padding, layout: str, need_dx: bool,
           need_dw: bool):
    # the route cache is eager mode's: a shape planned in one mode runs prepared in the other
    return conv._planned(x, weight, tuple(padding), layout, need_dx, need_dw)


def _shaped(like: torch.Tensor, shape: Sequence[int]) -> torch.Tensor:
    """A tensor of `shape` with `like`'s dtype and device and no memory: what planning reads of an
    operand that the kernel does not take (the input, for bwd_data)."""
    return like.new_empty(()).expand(shape)


# Explicit schemas: the layer key and the geometry are `int` (a graph never makes them symbolic);
# only the input's shape of bwd_data may be SymInt under dynamic shapes.
_CONV = "int layer, int[2] stride, int[2] padding, int[2] dilation, int groups, str layout"


@torch.library.custom_op("ucudnn::conv2d", mutates_args=(),
                         schema=f"(Tensor x, Tensor weight, {_CONV}, bool need_dx, bool need_dw, Tensor? bias=None) "
                                "-> Tensor")
def conv2d(x: torch.Tensor, weight: torch.Tensor, layer: int, stride: Sequence[int], padding: Sequence[int],
           dilation: Sequence[int], groups: int, layout: str, need_dx: bool, need_dw: bool,
           bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = conv2d(x, weight) + bias as layer `layer` plans it."""
    _check_conv(x.shape, weight.shape, stride, padding, dilation, groups, layout)
    conv, fmt = _layer(layer), _memory_format(layout)
    x, weight = x.contiguous(memory_format=fmt), weight.contiguous(memory_format=fmt)
    stride, padding, dilation = tuple(stride), tuple(padding), tuple(dilation)
    if conv._learning_now():  # WD's learning pass, or announce: register, and torch computes
        conv._announce(x, weight, padding, need_dx, need_dw)
        return F.conv2d(x, weight, bias, stride, padding, dilation, groups).contiguous(memory_format=fmt)
    if x.shape[0] == 0:  # nothing to plan
        return F.conv2d(x, weight, bias, stride, padding, dilation, groups).contiguous(memory_format=fmt)
    route = _route(conv, x, weight, padding, layout, need_dx, need_dw)
    if route.fwd is None:  # torch runs the plan itself
        return F.conv2d(x, weight, bias, stride, padding, dilation, groups).contiguous(memory_format=fmt)
    y = torch.empty(_y_shape(x.shape, weight.shape, stride, padding, dilation), dtype=x.dtype, device=x.device,
                    memory_format=fmt)
    y = _launch(route.fwd, route.backend, y, x=x, w=weight)
    return y if bias is None else y.add_(bias.view(1, -1, 1, 1))


@conv2d.register_fake
def _conv2d_fake(x, weight, layer, stride, padding, dilation, groups, layout, need_dx, need_dw, bias=None):
    _check_conv(x.shape, weight.shape, stride, padding, dilation, groups, layout)
    return torch.empty(_y_shape(x.shape, weight.shape, stride, padding, dilation), dtype=x.dtype, device=x.device,
                       memory_format=_memory_format(layout))


@torch.library.custom_op("ucudnn::conv2d_backward_data", mutates_args=(),
                         schema="(Tensor dy, Tensor weight, int layer, SymInt[4] x_shape, int[2] stride, "
                                "int[2] padding, int[2] dilation, int groups, str layout, bool need_dw) -> Tensor")
def conv2d_backward_data(dy: torch.Tensor, weight: torch.Tensor, layer: int, x_shape: Sequence[int],
                         stride: Sequence[int], padding: Sequence[int], dilation: Sequence[int], groups: int,
                         layout: str, need_dw: bool) -> torch.Tensor:
    """dx of layer `layer` for an input of `x_shape`, as the layer plans it."""
    _check_conv(x_shape, weight.shape, stride, padding, dilation, groups, layout)
    conv, fmt = _layer(layer), _memory_format(layout)
    dy, weight = dy.contiguous(memory_format=fmt), weight.contiguous(memory_format=fmt)
    x = _shaped(dy, x_shape)
    route = _route(conv, x, weight, padding, layout, True, need_dw)
    if route.bwd_data is None:
        dx, _, _ = torch.ops.aten.convolution_backward(dy, x, weight, None, list(stride), list(padding), list(dilation),
                                                       False, [0, 0], groups, [True, False, False])
        return dx.contiguous(memory_format=fmt)
    dx = torch.empty(tuple(x_shape), dtype=dy.dtype, device=dy.device, memory_format=fmt)
    return _launch(route.bwd_data, route.backend, dx, dy=dy, w=weight)


@conv2d_backward_data.register_fake
def _conv2d_backward_data_fake(dy, weight, layer, x_shape, stride, padding, dilation, groups, layout, need_dw):
    _check_conv(x_shape, weight.shape, stride, padding, dilation, groups, layout)
    return torch.empty(tuple(x_shape), dtype=dy.dtype, device=dy.device, memory_format=_memory_format(layout))


@torch.library.custom_op("ucudnn::conv2d_backward_filter", mutates_args=(),
                         schema=f"(Tensor x, Tensor dy, Tensor weight, {_CONV}, bool need_dx) -> Tensor")
def conv2d_backward_filter(x: torch.Tensor, dy: torch.Tensor, weight: torch.Tensor, layer: int,
                           stride: Sequence[int], padding: Sequence[int], dilation: Sequence[int], groups: int,
                           layout: str, need_dx: bool) -> torch.Tensor:
    """dw of layer `layer` (`weight` gives its shape, dtype and the route's key), as the layer plans it."""
    _check_conv(x.shape, weight.shape, stride, padding, dilation, groups, layout)
    conv, fmt = _layer(layer), _memory_format(layout)
    x, dy = x.contiguous(memory_format=fmt), dy.contiguous(memory_format=fmt)
    weight = weight.contiguous(memory_format=fmt)
    route = _route(conv, x, weight, padding, layout, need_dx, True)
    if route.bwd_filter is None:
        _, dw, _ = torch.ops.aten.convolution_backward(dy, x, weight, None, list(stride), list(padding), list(dilation),
                                                       False, [0, 0], groups, [False, True, False])
        return dw.contiguous(memory_format=fmt)
    dw = torch.empty(weight.shape, dtype=weight.dtype, device=weight.device, memory_format=fmt)
    return _launch(route.bwd_filter, route.backend, dw, x=x, dy=dy)


@conv2d_backward_filter.register_fake
def _conv2d_backward_filter_fake(x, dy, weight, layer, stride, padding, dilation, groups, layout, need_dx):
    _check_conv(x.shape, weight.shape, stride, padding, dilation, groups, layout)
    return torch.empty(weight.shape, dtype=weight.dtype, device=weight.device, memory_format=_memory_format(layout))


def _setup_context(ctx, inputs, output) -> None:
    x, weight, layer, stride, padding, dilation, groups, layout, need_dx, need_dw, bias = inputs
    ctx.save_for_backward(x, weight)
    ctx.conv = (layer, stride, padding, dilation, groups, layout, need_dx, need_dw)
    ctx.bias_grad = bias is not None and bias.requires_grad


def _backward(ctx, dy):
    x, weight = ctx.saved_tensors
    layer, stride, padding, dilation, groups, layout, need_dx, need_dw = ctx.conv
    dx = dw = db = None
    if ctx.needs_input_grad[0]:
        dx = torch.ops.ucudnn.conv2d_backward_data.default(dy, weight, layer, list(x.shape), stride, padding,
                                                           dilation, groups, layout, need_dw)
    if ctx.needs_input_grad[1]:
        dw = torch.ops.ucudnn.conv2d_backward_filter.default(x, dy, weight, layer, stride, padding, dilation,
                                                             groups, layout, need_dx)
    if ctx.bias_grad:
        db = dy.sum((0, 2, 3))
    return dx, dw, None, None, None, None, None, None, None, None, db


conv2d.register_autograd(_backward, setup_context=_setup_context)
