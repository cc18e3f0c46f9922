"""ucudnn's convolution kernels as PyTorch operators, so that torch.compile and torch.export carry a
converted convolution through a graph as one node per kernel or backward pass:

    torch.ops.ucudnn.convolution(x, weight, layer, stride, padding, dilation, transposed, output_padding, groups,
                                 layout, need_dx, need_dw, bias=None)
    torch.ops.ucudnn.convolution_backward_data(dy, weight, layer, x_shape, stride, padding, dilation, transposed,
                                               output_padding, groups, layout, need_dw)
    torch.ops.ucudnn.convolution_backward_filter(x, dy, weight, layer, stride, padding, dilation, transposed,
                                                 output_padding, groups, layout, need_dx)
    torch.ops.ucudnn.convolution_backward(dy, x, weight, layer, stride, padding, dilation, transposed,
                                          output_padding, groups, layout) -> (dx, dw)

Every form a converted layer has (1-D, 2-D, 3-D, transposed): the arguments are `aten.convolution`'s, one
value per spatial axis. Each returns a fresh tensor (no mutation, no aliasing). `layer` is the int key of a
live converted layer in this module's registry (weak references: the registry keeps no layer alive); every
other argument is a value a graph can hold. The key is a `SymInt`: Dynamo bakes a module's int attribute into
the graph and guards on it, so that repeated blocks of one shape with a graph break inside each compile one
frame per block (up to its recompile limit) where plain PyTorch's share one; with
`torch._dynamo.config.allow_unspec_int_on_nn_module = True` the key is the graph's input instead, and they
share. The Python state that decides how a kernel runs (the layer's
current handle, its routes, WD's learning pass) is read inside the real implementation when the graph runs,
never while it is traced: planning and measuring see real tensors only, and a handle that `execute_plan`
swaps in is the one the kernel runs with. `need_dx` and `need_dw` say which gradients the layer computes
(they key its route as in eager mode; the backward computes what autograd asks for either way). `layout` is
"NCHW" or "NHWC" (channels-last CUDA tensors): the kernels read the operands in that memory format (where
torch runs every kernel of the layer, they take them as they come); the output and `convolution_backward`'s
dx come back in the one torch's convolution would give (`launch._result_format`), the other gradients in
the layout's, each with the strides torch gives that format (`launch._in_format`: a map of both formats,
N x C x 1 x 1, keeps no other's strides, which would lead Inductor's layouts elsewhere than plain PyTorch's). A layer's backward pass is one operator where autograd asks for both gradients
(`convolution_backward`, as `aten.convolution_backward` is: where torch runs both kernels, one fused call),
else the one of the other two it asks for. On real tensors that need gradients, a layer whose route is
torch's own on every kind is `aten.convolution` with PyTorch's autograd (the autograd kernel, `_autograd`), and
any other planned layer, where no dispatch mode is active to see the operators, its eager autograd Function.

The bias is optional, its gradient the sum of dy over all but its channels: with it, a convolution is one
operation, as `aten.convolution` is (a captured step names each by that one op). The fake implementations
give shapes and strides with the kernels' own checks, so FakeTensorMode, Dynamo and export run nothing. A
graph or exported program runs only in the process, and while the model lives, whose layers it names; a
missing layer raises `InvalidInput`. Eager calls of a converted layer do not go through these operators: the
dispatcher and the operator's autograd wrapper would add host time per call (see `ucudnn.torch.converting.layer`).
"""

from __future__ import annotations

import functools
import itertools
import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

import torch

from ucudnn.errors import InvalidInput
from ucudnn.torch.converting.launch import (
    Geometry,
    _in_format,
    _memory_format,
    _result_format,
    geometry,
    run_backward,
    run_forward,
)

if TYPE_CHECKING:
    from ucudnn.torch.converting.route import _Route

__all__ = [
    "convolution",
    "convolution_backward",
    "convolution_backward_data",
    "convolution_backward_filter",
    "layer_key",
    "register_layer",
]


class _Layer(Protocol):
    """What the operators ask of a converted convolution (`ucudnn.torch.converting.layer.ConvLayer`, named here by
    what it does: the layer module imports this one)."""

    _key: int
    _budgets: dict[str, int] | None

    def _learning_now(self) -> bool: ...

    def _announce(self, input: Any, weight: Any, g: Geometry, need_dx: bool, need_dw: bool) -> None: ...

    def _planned(self, input: Any, weight: Any, g: Geometry, layout: str, need_dx: bool, need_dw: bool) -> _Route: ...

    def _route_key(
        self, input: Any, weight: Any, g: Geometry, layout: str, need_dx: bool, need_dw: bool, budgets: dict | None
    ) -> tuple: ...

    def _known(self, key: tuple, budgets: dict | None) -> _Route | None: ...

    def _eager(self, input: Any, weight: Any, bias: Any, route: _Route, g: Geometry) -> torch.Tensor: ...


_LAYERS: dict[int, weakref.ref[_Layer]] = {}
_KEYS = itertools.count(1)


def register_layer(conv: _Layer) -> int:
    """A new key for `conv`, valid until the module is collected."""
    key = next(_KEYS)

    def forget(_: object) -> None:  # the layer was collected
        _LAYERS.pop(key, None)

    _LAYERS[key] = weakref.ref(conv, forget)
    return key


def layer_key(conv: _Layer) -> int:
    """The key the operators name `conv` by."""
    return conv._key


def _layer(key: int) -> _Layer:
    ref = _LAYERS.get(key)
    conv = ref() if ref is not None else None
    if conv is None:
        raise InvalidInput(
            f"ucudnn operators: no live converted convolution has key {key}; a compiled graph or "
            "exported program runs only in the process, and while the model lives, that made it"
        )
    return conv


def _geometry(stride, padding, dilation, transposed, output_padding, groups) -> Geometry:
    return geometry(tuple(stride), tuple(padding), tuple(dilation), bool(transposed), tuple(output_padding), groups)


def _check(x_shape: Sequence, w_shape: Sequence, g: Geometry, layout: str) -> tuple:
    """The rules the kernels enforce, for the real and the fake implementations alike; the output's shape."""
    dims = len(x_shape) - 2
    torch._check(
        1 <= dims <= 3 and len(w_shape) == len(x_shape),
        lambda: (
            f"ucudnn.convolution: x and weight must both be 3-D, 4-D or 5-D, got {len(x_shape)}-D and {len(w_shape)}-D"
        ),
    )
    torch._check(
        all(len(v) == dims for v in (g.stride, g.padding, g.dilation, g.output_padding)),
        lambda: f"ucudnn.convolution: stride, padding, dilation and output_padding need {dims} values each",
    )
    taken = w_shape[0] if g.transposed else w_shape[1] * g.groups
    made = w_shape[1] * g.groups if g.transposed else w_shape[0]
    torch._check(
        g.groups >= 1 and x_shape[1] == taken and (made % g.groups == 0),
        lambda: (
            f"ucudnn.convolution: x has {x_shape[1]} channels and weight {tuple(w_shape)} with groups="
            f"{g.groups}; its weight takes {taken}"
        ),
    )
    torch._check(layout in ("NCHW", "NHWC"), lambda: f"ucudnn.convolution: layout must be NCHW or NHWC, got {layout!r}")
    shape = g.out_shape(x_shape, w_shape)
    torch._check(
        all(s > 0 for s in shape[2:]),
        lambda: (
            f"ucudnn.convolution: the output would be {'x'.join(map(str, shape[2:]))}; the input is "
            "smaller than the dilated filter"
        ),
    )
    return shape


@functools.lru_cache(maxsize=4096)
def _checked(x_shape: tuple[int, ...], w_shape: tuple[int, ...], g: Geometry, layout: str) -> tuple:
    """`_check` of concrete shapes, made once per signature: a real call repeats its layer's few signatures
    (the fake implementations, on symbolic shapes, call `_check` itself). A failing check raises, and is
    not remembered."""
    return _check(x_shape, w_shape, g, layout)


def _shaped(like: torch.Tensor, shape: Sequence[int]) -> torch.Tensor:
    """A tensor of `shape` with `like`'s dtype and device and no memory: what planning reads of an
    operand that the kernel does not take (the input, for bwd_data)."""
    return like.new_empty(()).expand(shape)


_CONV = (
    "SymInt layer, int[] stride, int[] padding, int[] dilation, bool transposed, int[] output_padding, "
    "int groups, str layout"
)


# The three kernels are operators of a `torch.library.Library`, one implementation for every device
# (CompositeExplicitAutograd) and, for the forward one, an autograd kernel of its own (`_Convolution`), not
# `custom_op`s: measured on the CPU (one thread, a tiny layer), a `custom_op` with `register_autograd` costs
# about 70 us more than torch's own convolution per forward and backward, the same operator defined here
# about 30: host time paid per layer in every compiled step.
_LIBRARY = torch.library.Library("ucudnn", "DEF")
_LIBRARY.define(
    f"convolution(Tensor x, Tensor weight, {_CONV}, bool need_dx, bool need_dw, Tensor? bias=None) -> Tensor"
)
_LIBRARY.define(
    "convolution_backward_data(Tensor dy, Tensor weight, SymInt layer, SymInt[] x_shape, int[] stride, "
    "int[] padding, int[] dilation, bool transposed, int[] output_padding, int groups, str layout, "
    "bool need_dw) -> Tensor"
)
_LIBRARY.define(f"convolution_backward_filter(Tensor x, Tensor dy, Tensor weight, {_CONV}, bool need_dx) -> Tensor")
_LIBRARY.define(f"convolution_backward(Tensor dy, Tensor x, Tensor weight, {_CONV}) -> (Tensor, Tensor)")


def convolution(
    x: torch.Tensor,
    weight: torch.Tensor,
    layer: int,
    stride: Sequence[int],
    padding: Sequence[int],
    dilation: Sequence[int],
    transposed: bool,
    output_padding: Sequence[int],
    groups: int,
    layout: str,
    need_dx: bool,
    need_dw: bool,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """y = convolution(x, weight) + bias as layer `layer` plans it."""
    g = _geometry(stride, padding, dilation, transposed, output_padding, groups)
    _checked(x.shape, weight.shape, g, layout)
    conv = _layer(layer)
    if conv._learning_now():  # WD's learning pass, or announce: register, and torch computes
        conv._announce(x, weight, g, need_dx, need_dw)
        return g.torch(x, weight, bias)
    if x.shape[0] == 0:  # nothing to plan
        return g.torch(x, weight, bias)
    route = conv._planned(x, weight, g, layout, need_dx, need_dw)
    if route.direct:  # torch's own convolution takes the operands as they come, as on the eager route
        return g.torch(x, weight, bias)
    # (the planned kernel's operands in the layout: `run_forward` copies them where they are not)
    return _in_format(run_forward(route, x, weight, bias, g), _result_format(x, weight, layout))


_LIBRARY.impl("convolution", convolution, "CompositeExplicitAutograd")


@torch.library.register_fake("ucudnn::convolution")
def _convolution_fake(
    x, weight, layer, stride, padding, dilation, transposed, output_padding, groups, layout, need_dx, need_dw, bias=None
):
    g = _geometry(stride, padding, dilation, transposed, output_padding, groups)
    return torch.empty(
        _check(x.shape, weight.shape, g, layout),
        dtype=x.dtype,
        device=x.device,
        memory_format=_result_format(x, weight, layout),
    )


def convolution_backward_data(
    dy: torch.Tensor,
    weight: torch.Tensor,
    layer: int,
    x_shape: Sequence[int],
    stride: Sequence[int],
    padding: Sequence[int],
    dilation: Sequence[int],
    transposed: bool,
    output_padding: Sequence[int],
    groups: int,
    layout: str,
    need_dw: bool,
) -> torch.Tensor:
    """dx of layer `layer` for an input of `x_shape`, as the layer plans it."""
    g = _geometry(stride, padding, dilation, transposed, output_padding, groups)
    _checked(tuple(x_shape), weight.shape, g, layout)
    conv, fmt = _layer(layer), _memory_format(layout, dy.dim())
    x = _shaped(dy, x_shape)  # (the planned kernel's operands in the layout: `run_backward` copies them)
    route = conv._planned(x, weight, g, layout, True, need_dw)
    dx, _ = run_backward(route, dy, x, weight, g, True, False)
    assert dx is not None  # (asked for)
    return _in_format(dx, fmt)


_LIBRARY.impl("convolution_backward_data", convolution_backward_data, "CompositeExplicitAutograd")


@torch.library.register_fake("ucudnn::convolution_backward_data")
def _convolution_backward_data_fake(
    dy, weight, layer, x_shape, stride, padding, dilation, transposed, output_padding, groups, layout, need_dw
):
    _check(x_shape, weight.shape, _geometry(stride, padding, dilation, transposed, output_padding, groups), layout)
    return torch.empty(
        tuple(x_shape), dtype=dy.dtype, device=dy.device, memory_format=_memory_format(layout, len(x_shape))
    )


def convolution_backward_filter(
    x: torch.Tensor,
    dy: torch.Tensor,
    weight: torch.Tensor,
    layer: int,
    stride: Sequence[int],
    padding: Sequence[int],
    dilation: Sequence[int],
    transposed: bool,
    output_padding: Sequence[int],
    groups: int,
    layout: str,
    need_dx: bool,
) -> torch.Tensor:
    """dw of layer `layer` (`weight` gives its shape, dtype and the route's key), as the layer plans it."""
    g = _geometry(stride, padding, dilation, transposed, output_padding, groups)
    _checked(x.shape, weight.shape, g, layout)
    conv, fmt = _layer(layer), _memory_format(layout, x.dim())
    route = conv._planned(x, weight, g, layout, need_dx, True)  # (`run_backward` copies the planned kernel's operands)
    _, dw = run_backward(route, dy, x, weight, g, False, True)
    assert dw is not None  # (asked for)
    return _in_format(dw, fmt)


_LIBRARY.impl("convolution_backward_filter", convolution_backward_filter, "CompositeExplicitAutograd")


@torch.library.register_fake("ucudnn::convolution_backward_filter")
def _convolution_backward_filter_fake(
    x, dy, weight, layer, stride, padding, dilation, transposed, output_padding, groups, layout, need_dx
):
    _check(x.shape, weight.shape, _geometry(stride, padding, dilation, transposed, output_padding, groups), layout)
    return torch.empty(
        weight.shape, dtype=weight.dtype, device=weight.device, memory_format=_memory_format(layout, weight.dim())
    )


def convolution_backward(
    dy: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    layer: int,
    stride: Sequence[int],
    padding: Sequence[int],
    dilation: Sequence[int],
    transposed: bool,
    output_padding: Sequence[int],
    groups: int,
    layout: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx, dw) of layer `layer`, as the layer plans its backward pass where both are asked for."""
    g = _geometry(stride, padding, dilation, transposed, output_padding, groups)
    _checked(x.shape, weight.shape, g, layout)
    route = _layer(layer)._planned(x, weight, g, layout, True, True)
    fmt, out = _memory_format(layout, x.dim()), _result_format(x, weight, layout)
    # (torch's own kernels take the operands as they come, the planned ones in the layout: `run_backward`)
    dx, dw = route.backward(dy, x, weight, g, True, True)
    return _in_format(dx, out), _in_format(dw, fmt)


_LIBRARY.impl("convolution_backward", convolution_backward, "CompositeExplicitAutograd")


@torch.library.register_fake("ucudnn::convolution_backward")
def _convolution_backward_fake(
    dy, x, weight, layer, stride, padding, dilation, transposed, output_padding, groups, layout
):
    _check(x.shape, weight.shape, _geometry(stride, padding, dilation, transposed, output_padding, groups), layout)
    return (
        torch.empty(x.shape, dtype=dy.dtype, device=dy.device, memory_format=_result_format(x, weight, layout)),
        torch.empty(
            weight.shape, dtype=weight.dtype, device=weight.device, memory_format=_memory_format(layout, weight.dim())
        ),
    )


class _Convolution(torch.autograd.Function):
    """`ucudnn::convolution`'s autograd kernel: the forward operator below autograd, its gradients by the
    backward operators (both by one; the bias's: dy summed over all but its channels)."""

    @staticmethod
    def forward(
        ctx,
        x,
        weight,
        layer,
        stride,
        padding,
        dilation,
        transposed,
        output_padding,
        groups,
        layout,
        need_dx,
        need_dw,
        bias,
    ):
        with torch._C._AutoDispatchBelowAutograd():
            y = torch.ops.ucudnn.convolution.default(
                x,
                weight,
                layer,
                stride,
                padding,
                dilation,
                transposed,
                output_padding,
                groups,
                layout,
                need_dx,
                need_dw,
                bias,
            )
        ctx.save_for_backward(x, weight)
        ctx.conv = (layer, stride, padding, dilation, transposed, output_padding, groups, layout, need_dx, need_dw)
        ctx.bias_grad = bias is not None and bias.requires_grad
        return y

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        layer, stride, padding, dilation, transposed, output_padding, groups, layout, need_dx, need_dw = ctx.conv
        conv = (stride, padding, dilation, transposed, output_padding, groups, layout)
        # the bias's gradient first: a plan holds it through the step's kernels (aten's fused call makes it with them)
        db = dy.sum((0, *range(2, dy.dim()))) if ctx.bias_grad else None
        dx = dw = None
        if ctx.needs_input_grad[0] and ctx.needs_input_grad[1]:
            dx, dw = torch.ops.ucudnn.convolution_backward.default(dy, x, weight, layer, *conv)
        elif ctx.needs_input_grad[0]:
            dx = torch.ops.ucudnn.convolution_backward_data.default(dy, weight, layer, list(x.shape), *conv, need_dw)
            dx = _in_format(dx, _result_format(x, weight, layout))
        elif ctx.needs_input_grad[1]:
            dw = torch.ops.ucudnn.convolution_backward_filter.default(x, dy, weight, layer, *conv, need_dx)
        return dx, dw, None, None, None, None, None, None, None, None, None, None, db


def _autograd(
    x, weight, layer, stride, padding, dilation, transposed, output_padding, groups, layout, need_dx, need_dw, bias=None
):
    args = (
        x,
        weight,
        layer,
        stride,
        padding,
        dilation,
        transposed,
        output_padding,
        groups,
        layout,
        need_dx,
        need_dw,
        bias,
    )  # (the dispatcher leaves out a defaulted bias: `_Convolution` returns a gradient for each argument)
    if torch.is_grad_enabled() and (
        x.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)
    ):
        if type(x) is torch.Tensor:  # real (not fake, not functional): the layer's eager route, once planned
            g = _geometry(stride, padding, dilation, transposed, output_padding, groups)
            conv = _layer(layer)
            route = conv._known(conv._route_key(x, weight, g, layout, need_dx, need_dw, conv._budgets), conv._budgets)
            if route is not None and not conv._learning_now():
                if route.direct:  # torch's convolution, with torch's autograd: its backward is one fused call in C++
                    return g.torch(x, weight, bias)
                if not torch._C._len_torch_dispatch_stack():  # (a mode, a capture's or a plan's, sees the operators)
                    return conv._eager(x, weight, bias, route, g)  # no operator below: 2 dispatches fewer a call
        return _Convolution.apply(*args)
    # nothing to differentiate (a compiled graph's forward runs so): the operator itself, without the Function;
    # on real tensors where no mode is to see it, its implementation (a dispatch to Python fewer)
    if type(x) is torch.Tensor and not torch._C._len_torch_dispatch_stack():
        return convolution(*args)
    with torch._C._AutoDispatchBelowAutograd():
        return torch.ops.ucudnn.convolution.default(*args)


_LIBRARY.impl("convolution", _autograd, "Autograd")
