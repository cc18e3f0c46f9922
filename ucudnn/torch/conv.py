"""PyTorch integration: `Conv2d`, a drop-in for `torch.nn.Conv2d`, and `convert(model)`.

    model = ucudnn.torch.convert(model, backend="cpu", workspace_limit="64MiB")

swaps every `torch.nn.Conv2d` of `model` for a `ucudnn.torch.Conv2d` that shares its parameters
(the same `Parameter` objects, so an optimizer built before the swap keeps working) and runs all
three kernels through one shared `ucudnn.Handle`: the forward pass with `conv_forward`, and the
backward pass with `conv_backward_data` (only when the input needs a gradient) and
`conv_backward_filter`; the bias gradient is ``dy.sum((0, 2, 3))``. Layer ids are the modules'
qualified names (``layer1.0.conv1``); a `Conv2d` built by hand uses ``conv@<id(self) in hex>``.

WD (``total_workspace=...``) divides one workspace among all kernels of the network, so the
handle must know the layers before the first convolution: call ``announce(model, example)`` once
after `convert`. It runs one forward pass that only records (torch's own convolution computes,
nothing is benchmarked; eval mode, so batch-norm statistics are untouched).

CPU tensors of float32 (or float64) go through ``.numpy()`` views without copies; CUDA tensors go
to a cudnn-backend handle through ``__cuda_array_interface__`` (``cupy.asarray``), on torch's
current stream. Double backward (gradients of gradients) is not supported.

This module imports torch; ``import ucudnn`` does not import this module.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import once_differentiable

from ucudnn.backends.cpu import NATIVE
from ucudnn.errors import BackendUnavailable, InvalidInput, UnsupportedProblem
from ucudnn.handle import Handle
from ucudnn.problem import ConvProblem

__all__ = ["Conv2d", "announce", "convert"]

# dtypes that reach the handle, by device; others are refused with a message (the cpu backend
# computes in float32 and float64; NumPy and CuPy have no bfloat16).
_DTYPES = {"cpu": {torch.float32: "float32", torch.float64: "float64"},
           "cuda": {torch.float32: "float32", torch.float64: "float64", torch.float16: "float16"}}


def _dtype_name(t: torch.Tensor) -> str:
    names = _DTYPES.get(t.device.type)
    if names is None:
        raise UnsupportedProblem(f"ucudnn.torch.Conv2d runs CPU or CUDA tensors, got a tensor on {t.device}")
    name = names.get(t.dtype)
    if name is None:
        allowed = ", ".join(str(d).removeprefix("torch.") for d in names)
        raise UnsupportedProblem(f"ucudnn.torch.Conv2d runs {allowed} tensors on {t.device.type}, got {t.dtype}; "
                                 "convert the model with .float() or keep this layer a torch.nn.Conv2d")
    return name


def _as_array(t: torch.Tensor, backend_name: str) -> Any:
    """A view of a contiguous tensor as the handle's array type (NumPy on the CPU, CuPy on CUDA)."""
    t = t.detach()
    if t.device.type == "cpu":
        if backend_name != "cpu":
            raise InvalidInput(f"a CPU tensor reached a handle of backend {backend_name!r}; "
                               "give the model a handle with backend='cpu' (or move the model to the GPU)")
        return t.numpy()
    if t.device.type == "cuda":  # pragma: no cover - needs a GPU
        if backend_name != "cudnn":
            raise InvalidInput(f"a CUDA tensor reached a handle of backend {backend_name!r}; "
                               "give the model a handle with backend='cudnn' or 'auto'")
        try:
            import cupy
        except ImportError as exc:
            raise BackendUnavailable("CUDA tensors need CuPy: pip install 'ucudnn[cuda]'") from exc
        return cupy.asarray(t)  # zero-copy through __cuda_array_interface__
    raise UnsupportedProblem(f"ucudnn.torch.Conv2d runs CPU or CUDA tensors, got a tensor on {t.device}")


def _stream(t: torch.Tensor):
    """CuPy work on torch's current CUDA stream, so that it orders with torch's own kernels."""
    if t.device.type != "cuda":
        return contextlib.nullcontext()
    import cupy  # pragma: no cover - needs a GPU
    stream = torch.cuda.current_stream(t.device)  # pragma: no cover
    return cupy.cuda.ExternalStream(stream.cuda_stream, t.device.index)  # pragma: no cover


def _out_size(size: int, r: int, stride: int, pad: int, dilation: int) -> int:
    return (size + 2 * pad - dilation * (r - 1) - 1) // stride + 1


def _native_undivided(config) -> bool:
    """A plan that is torch's own convolution on the whole batch: torch can run it in place."""
    return len(config.micros) == 1 and config.micros[0].algo == NATIVE


class _Conv2dFunction(torch.autograd.Function):
    """conv2d whose three kernels run through a `Handle`.

    When the handle's plan for a kernel is `native` on the whole batch (PyTorch's own convolution,
    undivided), the kernel is that torch call itself, made here on the tensors: going through
    the handle would compute the same thing into a temporary and copy it into the output.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, handle: Handle, layer: str, stride, padding, dilation, groups):
        x = x.contiguous()
        weight = weight.contiguous()
        dtype = _dtype_name(x)
        backend = handle.backend.name
        conv = {"stride": stride, "padding": padding, "dilation": dilation, "groups": groups, "layer": layer}
        ctx.save_for_backward(x, weight)
        ctx.handle, ctx.conv, ctx.dtype, ctx.has_bias = handle, conv, dtype, bias is not None
        n, _, h, w = x.shape
        k, _, r, s = weight.shape
        oh = _out_size(h, r, stride[0], padding[0], dilation[0])
        ow = _out_size(w, s, stride[1], padding[1], dilation[1])
        with _stream(x):
            if oh < 1 or ow < 1:  # let the handle say what is wrong with the shapes
                handle.conv_forward(_as_array(x, backend), _as_array(weight, backend), **conv)
            if x.device.type == "cpu" and backend == "cpu" and _native_undivided(
                    handle.prepare("fwd", x.shape, weight.shape, dtype=dtype, **conv)):
                return F.conv2d(x, weight, bias, stride, padding, dilation, groups)
            y = torch.empty((n, k, oh, ow), dtype=x.dtype, device=x.device)
            handle.conv_forward(_as_array(x, backend), _as_array(weight, backend), out=_as_array(y, backend), **conv)
        if bias is not None:
            y.add_(bias.view(1, -1, 1, 1))
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        handle, conv = ctx.handle, ctx.conv
        backend = handle.backend.name
        dy = dy.contiguous()
        need_dx, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        dx = dw = db = None
        native_dx = native_dw = False
        if dy.device.type == "cpu" and backend == "cpu":
            native_dx = need_dx and _native_undivided(
                handle.prepare("bwd_data", x.shape, weight.shape, dtype=ctx.dtype, **conv))
            native_dw = need_dw and _native_undivided(
                handle.prepare("bwd_filter", x.shape, weight.shape, dtype=ctx.dtype, **conv))
        if native_dx or native_dw:
            dx, dw, _ = torch.ops.aten.convolution_backward(
                dy, x, weight, None, list(conv["stride"]), list(conv["padding"]), list(conv["dilation"]), False,
                [0, 0], conv["groups"], [native_dx, native_dw, False])
        with _stream(dy):
            if need_dx and not native_dx:
                dx = torch.empty_like(x, memory_format=torch.contiguous_format)
                handle.conv_backward_data(_as_array(dy, backend), _as_array(weight, backend),
                                          out=_as_array(dx, backend), **conv)
            if need_dw and not native_dw:
                dw = torch.empty_like(weight, memory_format=torch.contiguous_format)
                handle.conv_backward_filter(_as_array(x, backend), _as_array(dy, backend),
                                            out=_as_array(dw, backend), **conv)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = dy.sum((0, 2, 3))
        return dx, dw, db, None, None, None, None, None, None


class Conv2d(nn.Conv2d):
    """`torch.nn.Conv2d` whose convolutions run through a ucudnn `Handle`.

    Takes exactly `torch.nn.Conv2d`'s arguments (its parameters, `state_dict`, `repr` and
    initialisation are nn.Conv2d's own), plus keyword-only `handle` (default: a new
    ``Handle()`` with the default options) and `layer` (the id under which the handle plans this
    layer; default ``conv@<id>``). Every `padding_mode` and string padding ("same", "valid") is
    supported: non-zero modes and asymmetric "same" padding pad the input with `F.pad` first, as
    nn.Conv2d itself does, and run the convolution unpadded.
    """

    def __init__(self, in_channels: int, out_channels: int, kernel_size, stride=1, padding=0, dilation=1,
                 groups: int = 1, bias: bool = True, padding_mode: str = "zeros", device=None, dtype=None, *,
                 handle: Handle | None = None, layer: str | None = None) -> None:
        super().__init__(in_channels, out_channels, kernel_size, stride=stride, padding=padding, dilation=dilation,
                         groups=groups, bias=bias, padding_mode=padding_mode, device=device, dtype=dtype)
        self._init_ucudnn(handle if handle is not None else Handle(), layer)

    def _init_ucudnn(self, handle: Handle, layer: str | None) -> None:
        if not isinstance(handle, Handle):
            raise InvalidInput(f"handle must be a ucudnn.Handle, got {type(handle).__name__}")
        if layer is not None and (not isinstance(layer, str) or not layer):
            raise InvalidInput(f"layer must be a non-empty string or None, got {layer!r}")
        self.handle = handle
        self.layer = layer
        self._recording = False

    @classmethod
    def from_conv(cls, conv: nn.Conv2d, *, handle: Handle, layer: str | None = None) -> Conv2d:
        """A ucudnn Conv2d that takes over `conv`'s state: the same parameter objects, hooks,
        training flag, device and dtype (nothing is copied or re-initialised)."""
        if not isinstance(conv, nn.Conv2d):
            raise InvalidInput(f"from_conv needs a torch.nn.Conv2d, got {type(conv).__name__}")
        new = cls.__new__(cls)
        # A shallow copy of the module's state; its dicts (parameters, hooks, ...) are copied so
        # that the two modules do not share containers, while the tensors in them are shared.
        new.__dict__.update({name: (value.copy() if isinstance(value, dict) else value)
                             for name, value in conv.__dict__.items()})
        new._init_ucudnn(handle, layer)
        return new

    @property
    def layer_id(self) -> str:
        """The id the handle plans this layer under: `layer`, or ``conv@<id(self) in hex>``."""
        return self.layer if self.layer is not None else f"conv@{id(self):x}"

    def _explicit_padding(self, input: torch.Tensor) -> tuple[torch.Tensor, tuple[int, int]]:
        """The input to convolve and the symmetric (pad_h, pad_w) that the kernels apply."""
        if self.padding_mode == "zeros" and not isinstance(self.padding, str):
            return input, tuple(self.padding)
        # F.pad order: (left, right, top, bottom)
        left, right, top, bottom = self._reversed_padding_repeated_twice
        if self.padding_mode == "zeros" and left == right and top == bottom:
            return input, (top, left)
        mode = "constant" if self.padding_mode == "zeros" else self.padding_mode
        return F.pad(input, self._reversed_padding_repeated_twice, mode=mode), (0, 0)

    def _conv_forward(self, input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        unbatched = input.dim() == 3
        if unbatched:
            input = input.unsqueeze(0)
        if input.dim() != 4:
            raise InvalidInput(f"Conv2d expects a 3-D (C, H, W) or 4-D (N, C, H, W) input, got shape "
                               f"{tuple(input.shape)}")
        input, padding = self._explicit_padding(input)
        if self._recording:
            out = self._record(input, weight, bias, padding)
        else:
            out = _Conv2dFunction.apply(input, weight, bias, self.handle, self.layer_id, tuple(self.stride),
                                        padding, tuple(self.dilation), self.groups)
        return out.squeeze(0) if unbatched else out

    def _record(self, input, weight, bias, padding) -> torch.Tensor:
        """Announce this layer to the handle and compute with torch's own convolution."""
        n, c, h, w = input.shape
        k, _, r, s = weight.shape
        problem = ConvProblem(n=n, c=c, h=h, w=w, k=k, r=r, s=s, pad_h=padding[0], pad_w=padding[1],
                              stride_h=self.stride[0], stride_w=self.stride[1], dilation_h=self.dilation[0],
                              dilation_w=self.dilation[1], groups=self.groups, dtype=_dtype_name(input))
        kinds = {"fwd"} | ({"bwd_data"} if input.requires_grad else set()) \
            | ({"bwd_filter"} if weight.requires_grad else set())
        self.handle.register(self.layer_id, problem, kinds=kinds)
        return F.conv2d(input, weight, bias, self.stride, padding, self.dilation, self.groups)


def _ucudnn_convs(model: nn.Module) -> Iterator[Conv2d]:
    return (m for m in model.modules() if isinstance(m, Conv2d))


def convert(model: nn.Module, *, handle: Handle | None = None, **handle_options) -> nn.Module:
    """Swap every `torch.nn.Conv2d` of `model`, in place, for a `ucudnn.torch.Conv2d`; return `model`.

    The new modules share the old ones' parameters (same objects: weights, bias, device, dtype
    and any optimizer state stay valid), hooks and training flag. All of them share one handle:
    `handle`, or a new ``Handle(**handle_options)`` (backend, policy, workspace_limit,
    total_workspace, db, reps, algos). Layer ids are qualified module names. ucudnn Conv2d
    modules already in the model join the shared handle. Subclasses of nn.Conv2d other than
    ucudnn's are left alone with a warning (they may override `forward`). When `model` itself is
    an nn.Conv2d, the converted module is returned (there is no parent to swap it in).
    """
    if not isinstance(model, nn.Module):
        raise InvalidInput(f"convert needs a torch.nn.Module, got {type(model).__name__}")
    if handle is None:
        handle = Handle(**handle_options)
    elif handle_options:
        raise InvalidInput(f"give a handle or handle options, not both (got handle and {', '.join(handle_options)})")
    if type(model) is nn.Conv2d:
        return Conv2d.from_conv(model, handle=handle, layer="conv")
    names = {id(m): name for name, m in model.named_modules()}  # the first qualified name of each module
    if isinstance(model, Conv2d):
        model._init_ucudnn(handle, model.layer or "conv")
        return model
    converted: dict[int, Conv2d] = {}
    for parent in list(model.modules()):
        for child_name, child in list(parent._modules.items()):
            if child is None:
                continue
            if type(child) is nn.Conv2d:
                if id(child) not in converted:
                    converted[id(child)] = Conv2d.from_conv(child, handle=handle, layer=names[id(child)])
                setattr(parent, child_name, converted[id(child)])
            elif isinstance(child, Conv2d):
                child._init_ucudnn(handle, names.get(id(child), child.layer))
            elif isinstance(child, nn.Conv2d):
                warnings.warn(f"ucudnn.torch.convert: {names.get(id(child), child_name)} is a "
                              f"{type(child).__qualname__}, a subclass of nn.Conv2d that may override forward; "
                              "left unchanged", stacklevel=2)
    return model


def announce(model: nn.Module, *inputs: Any, **kwargs: Any) -> None:
    """Announce every ucudnn Conv2d of `model` to its handle with one recording forward pass.

    Runs ``model(*inputs, **kwargs)`` once in eval mode (batch-norm statistics and dropout are
    left alone; every module's training flag is restored afterwards) with gradients enabled, so
    that each layer registers the kernels training will run: ``fwd``; ``bwd_data`` when its
    input requires a gradient; ``bwd_filter`` when its weight does. Torch's own convolution
    computes this pass and nothing is measured; the output is discarded. Needed in WD mode, where
    the first real convolution divides the workspace among the announced layers; harmless in WR.
    Call it with the training batch size (other batch sizes get their own plans later anyway).
    """
    convs = list(_ucudnn_convs(model))
    if not convs:
        raise InvalidInput("announce found no ucudnn.torch.Conv2d in the model; call ucudnn.torch.convert first")
    training = {m: m.training for m in model.modules()}
    try:
        model.eval()
        for conv in convs:
            conv._recording = True
        with torch.enable_grad():
            model(*inputs, **kwargs)
    finally:
        for conv in convs:
            conv._recording = False
        for module, flag in training.items():
            module.training = flag
