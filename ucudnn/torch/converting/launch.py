"""How a planned kernel runs on torch tensors: which dtypes and layouts reach the handle, the tensors
viewed as the handle's arrays without copies (NumPy on the CPU, CuPy on CUDA), and on CUDA torch's
current stream and caching allocator. The layer's autograd Function (`ucudnn.torch.converting.conv`) and the
operators (`ucudnn.torch.converting.ops`) both launch through it, so neither imports the other to run a kernel.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor  # (named so inside `Geometry`, whose method `torch` hides the module there)
from torch._prims_common import (
    make_channels_last_strides_for,
    make_contiguous_strides_for,
    suggest_memory_format,  # eager's Tensor.suggest_memory_format
)
from torch._subclasses.fake_tensor import FakeTensor

from ucudnn.backends.base import one_line
from ucudnn.errors import BackendUnavailable, InvalidInput, UnsupportedProblem
from ucudnn.handle import Kernel

# dtypes that reach the handle, by device; others are refused with a message naming the dtype and
# the backend (the cpu backend computes in float32 and float64; on CUDA, bfloat16 tensors reach
# CuPy, which has no bfloat16, as their raw 16-bit words).
_DTYPES = {
    "cpu": {torch.float32: "float32", torch.float64: "float64"},
    "cuda": {torch.float32: "float32", torch.float64: "float64", torch.float16: "float16", torch.bfloat16: "bfloat16"},
}


def _dtype_name(t: torch.Tensor, backend_name: str) -> str:
    names = _DTYPES.get(t.device.type)
    if names is None:
        raise UnsupportedProblem(f"ucudnn.torch.Conv2d runs CPU or CUDA tensors, got a tensor on {t.device}")
    name = names.get(t.dtype)
    if name is None:
        allowed = ", ".join(str(d).removeprefix("torch.") for d in names)
        autocast = (
            " (torch.autocast casts convolutions to it; disable autocast around this model)"
            if t.dtype in (torch.float16, torch.bfloat16)
            else ""
        )
        raise UnsupportedProblem(
            f"ucudnn.torch.Conv2d: the {backend_name} backend cannot run "
            f"{str(t.dtype).removeprefix('torch.')} tensors on {t.device.type}{autocast}; it "
            f"runs {allowed} there. Convert the model with .float() or keep this layer a "
            "torch.nn.Conv2d"
        )
    return name


def _as_array(t: torch.Tensor, backend_name: str) -> Any:
    """A view of a tensor as the handle's array type (NumPy on the CPU, CuPy on CUDA), no copy. A subclass that
    holds its data (MONAI's MetaTensor) is viewed so; one that holds none (a fake tensor, a wrapper of others)
    is refused in one line (`_viewed`)."""
    t = t.detach()
    if t.device.type == "cpu":
        if backend_name != "cpu":
            raise InvalidInput(
                f"a CPU tensor reached a handle of backend {backend_name!r}; "
                "give the model a handle with backend='cpu' (or move the model to the GPU)"
            )
        return _viewed(Tensor.numpy, t)
    if t.device.type == "cuda":  # pragma: no cover - needs a GPU
        if backend_name != "cudnn":
            raise InvalidInput(
                f"a CUDA tensor reached a handle of backend {backend_name!r}; "
                "give the model a handle with backend='cudnn' or 'auto'"
            )
        try:
            import cupy
        except ImportError as exc:
            raise BackendUnavailable("CUDA tensors need CuPy: pip install 'ucudnn[cuda]'") from exc
        if t.dtype == torch.bfloat16:  # the backend stores bfloat16 as uint16 words
            return cupy.asarray(t.view(torch.int16)).view(cupy.uint16)
        return _viewed(cupy.asarray, t)  # zero-copy through __cuda_array_interface__
    raise UnsupportedProblem(f"ucudnn.torch.Conv2d runs CPU or CUDA tensors, got a tensor on {t.device}")


def _viewed(as_array: Any, t: torch.Tensor) -> Any:
    """``as_array(t)``; a subclass whose memory it cannot view (one that holds no data of its own: NumPy's
    "not supported for tensor subclasses") is refused in one line."""
    try:
        return as_array(t)
    except (RuntimeError, TypeError, AttributeError) as exc:
        if type(t) is Tensor:
            raise
        what = "a fake tensor (a capture's, outside it)" if isinstance(t, FakeTensor) else f"a {type(t).__qualname__}"
        raise UnsupportedProblem(
            f"ucudnn.torch.Conv2d: {what} reached a converted layer's kernel, which reads the tensor's memory; it "
            f"runs plain tensors and subclasses that hold their data (MONAI's MetaTensor) ({one_line(exc)})"
        ) from None


def _torch_allocator(device_index: int):  # pragma: no cover - needs a GPU
    """A CuPy allocator that takes its memory from PyTorch's caching allocator: workspaces and
    temporaries then show in torch.cuda.max_memory_allocated, and no second pool holds memory.
    A CuPy pointer owns the torch tensor it views, so the block returns to torch with it."""
    import cupy

    device = torch.device("cuda", device_index)

    def allocate(nbytes: int):
        try:
            block = torch.empty(nbytes, dtype=torch.uint8, device=device)
        except torch.OutOfMemoryError as exc:  # a RuntimeError: the handle would record the algorithm unusable for good
            raise MemoryError(f"torch's caching allocator: {one_line(exc)}") from exc
        return cupy.cuda.MemoryPointer(cupy.cuda.UnownedMemory(block.data_ptr(), nbytes, block, device_index), 0)

    return allocate


_ALLOCATORS: dict[int, Any] = {}


_NOTHING = contextlib.nullcontext()


def _on_device(t: torch.Tensor):
    """CUDA: CuPy work on torch's current stream (so that it orders with torch's kernels) and
    CuPy allocations from torch's caching allocator. CPU: nothing."""
    return _NOTHING if t.device.type != "cuda" else _on_cuda(t)


@contextlib.contextmanager
def _on_cuda(t: torch.Tensor) -> Iterator[None]:  # pragma: no cover - needs a GPU
    import cupy

    index = t.device.index if t.device.index is not None else torch.cuda.current_device()
    allocator = _ALLOCATORS.get(index) or _ALLOCATORS.setdefault(index, _torch_allocator(index))
    stream = torch.cuda.current_stream(t.device)
    with (
        cupy.cuda.Device(index),
        cupy.cuda.ExternalStream(stream.cuda_stream, index),
        cupy.cuda.using_allocator(allocator),
    ):
        yield


@dataclass(frozen=True, slots=True)
class Geometry:
    """A convolution's arguments beside its operands, one value per spatial axis, as `torch.convolution`
    takes them (a 1-D convolution has one axis: its kernels see it as 2-D of height 1, `_planar`)."""

    stride: tuple[int, ...]
    padding: tuple[int, ...]
    dilation: tuple[int, ...]
    transposed: bool
    output_padding: tuple[int, ...]
    groups: int

    def out_shape(self, x_shape: Sequence[int], w_shape: Sequence[int]) -> tuple[int, ...]:
        """The output's shape for an input and a weight of these shapes (as torch computes it)."""
        sizes = []
        for size, k, s, p, d, op in zip(
            x_shape[2:], w_shape[2:], self.stride, self.padding, self.dilation, self.output_padding
        ):
            span = d * (k - 1)
            if self.transposed:
                sizes.append((size - 1) * s - 2 * p + span + op + 1)
            else:
                sizes.append((size + 2 * p - span - 1) // s + 1)
        channels = w_shape[1] * self.groups if self.transposed else w_shape[0]
        return (x_shape[0], channels, *sizes)

    def torch(self, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """PyTorch's own convolution of this geometry, as its modules call it (F.conv2d and the like take
        less host time per call than torch.convolution; both reach aten.convolution)."""
        if self.transposed:
            return _TRANSPOSED[x.dim()](
                x, w, bias, self.stride, self.padding, self.output_padding, self.groups, self.dilation
            )
        return _PLAIN[x.dim()](x, w, bias, self.stride, self.padding, self.dilation, self.groups)

    def torch_backward(self, dy: Tensor, x: Tensor, w: Tensor, dx: bool, dw: bool) -> tuple:
        """PyTorch's own backward call of this geometry: (dx, dw), each None where not asked for."""
        out = torch.ops.aten.convolution_backward(
            dy,
            x,
            w,
            None,
            list(self.stride),
            list(self.padding),
            list(self.dilation),
            self.transposed,
            list(self.output_padding),
            self.groups,
            [dx, dw, False],
        )
        return out[0], out[1]


# torch's functional convolutions by the operand's dimensions
_PLAIN = {3: F.conv1d, 4: F.conv2d, 5: F.conv3d}
_TRANSPOSED = {3: F.conv_transpose1d, 4: F.conv_transpose2d, 5: F.conv_transpose3d}


@functools.cache
def geometry(
    stride: tuple[int, ...],
    padding: tuple[int, ...],
    dilation: tuple[int, ...],
    transposed: bool,
    output_padding: tuple[int, ...],
    groups: int,
) -> Geometry:
    """The `Geometry` of these arguments (tuples), made once: a layer's call reuses it."""
    return Geometry(stride, padding, dilation, transposed, output_padding, groups)


def _planar(t: torch.Tensor) -> torch.Tensor:
    """A 1-D convolution's operand as its kernels take it: (n, c, 1, l), a view."""
    return t.unsqueeze(2) if t.dim() == 3 else t


def _result_format(x: torch.Tensor, weight: torch.Tensor, layout: str) -> torch.memory_format:
    """The memory format a converted layer gives its output and input gradient, on every route (torch's, the
    handle's, the operator's, the fake one), so that the operations after it are the same whichever route ran
    (a captured step and its plan rely on it): torch's own convolution's, channels-last where the input's or
    the filter's strides are channels-last-like (`Tensor.suggest_memory_format`, as PyTorch's CPU and cuDNN
    convolutions choose), else contiguous; an NHWC problem's, channels-last (its input is channels-last).

    A tensor whose dims of size 1 make it both contiguous and channels-last-contiguous (an N x C x 1 x 1 map,
    a pooled one; a 1x1 filter; a single channel) is either by its strides, as torch reads them: a pooled
    channels-last map (strides C, 1, C, C) is channels-last-like, and torch's convolution of it is
    channels-last. Where each operand is contiguous and nothing else, no strides are read."""
    if layout == "NHWC":
        return _memory_format(layout, x.dim())
    cl = _CHANNELS_LAST.get(x.dim())
    if (
        x.is_contiguous()
        and weight.is_contiguous()
        and (cl is None or not (x.is_contiguous(memory_format=cl) or weight.is_contiguous(memory_format=cl)))
    ):
        return torch.contiguous_format  # (contiguous and nothing else, the common case: no stride walk)
    formats = (_suggested_format(x), _suggested_format(weight))
    return next((f for f in formats if f != torch.contiguous_format), torch.contiguous_format)


_CHANNELS_LAST = {4: torch.channels_last, 5: torch.channels_last_3d}
_WALKS = {4: (1, 3, 2, 0), 5: (1, 4, 3, 2, 0)}  # c10's order: C, then W, H (D), then N


def _suggested_format(t: torch.Tensor) -> torch.memory_format:
    """`Tensor.suggest_memory_format()`: channels-last where the strides are channels-last-like. Int sizes and
    strides by `_strides_format`, remembered (under 1 us; `torch._prims_common`'s walk takes about 7), symbolic
    ones by torch's."""
    if t.dim() not in _CHANNELS_LAST:
        return torch.contiguous_format
    try:
        return _strides_format(t.shape, t.stride())
    except TypeError:  # a symbolic size or stride (SymInts do not hash)
        return suggest_memory_format(t)


@functools.lru_cache(maxsize=4096)
def _strides_format(shape: tuple[int, ...], strides: tuple[int, ...]) -> torch.memory_format:
    """c10's `is_channels_last_strides_2d`/`_3d` (as `torch._prims_common.suggest_memory_format` writes it)."""
    if strides[1] == 0:
        return torch.contiguous_format
    low = 0
    for d in _WALKS[len(shape)]:
        if shape[d] == 0 or strides[d] < low or (d == 0 and low == strides[1]):
            return torch.contiguous_format
        low = strides[d] * shape[d]
    return _CHANNELS_LAST[len(shape)]


def _in_format(t: torch.Tensor, fmt: torch.memory_format) -> torch.Tensor:
    """`t` in memory format `fmt` with the strides torch gives a result of that format (`torch.empty`'s, as
    its convolutions' results have). `Tensor.contiguous` leaves a tensor of both formats (`_result_format`)
    as it is: a contiguous N x C x 1 x 1 output, asked for channels-last, would keep contiguous strides, and
    the operations after it (a concatenation, the next convolution, Inductor's layouts) would choose
    otherwise than after torch's convolution. Such a tensor is copied (it is small, or a single channel)."""
    out = t.contiguous(memory_format=fmt)
    if out is not t:  # a copy, made so
        return out
    if fmt == torch.contiguous_format:
        cl = _CHANNELS_LAST.get(t.dim())
        if cl is None or not t.is_contiguous(memory_format=cl):  # in `fmt` alone
            return t
    elif not t.is_contiguous():
        return t
    exact = (
        make_contiguous_strides_for(t.shape)
        if fmt == torch.contiguous_format
        else make_channels_last_strides_for(t.shape)
    )
    return t if tuple(t.stride()) == tuple(exact) else t.clone(memory_format=fmt)


def _memory_format(layout: str, dims: int = 4) -> torch.memory_format:
    if layout != "NHWC":
        return torch.contiguous_format
    return torch.channels_last_3d if dims == 5 else torch.channels_last


def _launch(kernel: Kernel, backend: str, out: torch.Tensor, **operands: torch.Tensor) -> torch.Tensor:
    """Run a planned kernel on tensors (viewed as the handle's arrays; a 1-D convolution's as 2-D of height
    1) into `out`; returns `out`."""
    with _on_device(out):
        kernel.run(
            out=_as_array(_planar(out), backend),
            **{name: _as_array(_planar(t), backend) for name, t in operands.items()},
        )
    return out


# each kind's operands, as `Kernel.run` names them (the result is `out`)
_OPERANDS = {"fwd": ("x", "w"), "bwd_data": ("dy", "w"), "bwd_filter": ("x", "dy")}


def prepared_launch(kernel: Kernel | None, kind: str, backend: str) -> Any:
    """`_launch` of one route's `kernel` made once: ``launch(out, first, second)`` with the kind's operands in
    `_OPERANDS` order. On the CPU backend the tensors are viewed as NumPy arrays without `_launch`'s checks (a
    route runs the devices and dtypes it was planned for: its key holds them); a tensor NumPy cannot view
    (another device, a subclass that holds no data) goes through `_launch`, which says why. None: no kernel."""
    if kernel is None:
        return None
    a, b = _OPERANDS[kind]
    if backend != "cpu":
        return lambda out, first, second: _launch(kernel, backend, out, **{a: first, b: second})

    def launch(out: torch.Tensor, first: torch.Tensor, second: torch.Tensor) -> torch.Tensor:
        try:
            arrays: dict[str, Any] = {
                "out": _planar(out).numpy(),
                a: _planar(first).detach().numpy(),
                b: _planar(second).detach().numpy(),
            }
        except (RuntimeError, TypeError):
            return _launch(kernel, backend, out, **{a: first, b: second})
        kernel.run(**arrays)
        return out

    return launch


def _copy_bytes(t: torch.Tensor, fmt: torch.memory_format) -> int:
    """The bytes ``t.contiguous(memory_format=fmt)`` allocates: none where `t` is in `fmt` already."""
    return 0 if t.is_contiguous(memory_format=fmt) else t.numel() * t.element_size()


def run_forward(
    route: Any, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, geometry: Geometry
) -> torch.Tensor:
    """y = conv(x, w) + bias as `route` runs it: torch's own call on the operands as they come, or its planned
    `fwd` kernel on them in the route's layout (copied where they are not: `forward_copies`), y in that layout
    (the caller gives it torch's format: `_in_format`, after the copies have gone)."""
    if route.fwd is None:
        return geometry.torch(x, w, bias)
    fmt = _memory_format(route.layout, x.dim())
    y = torch.empty(geometry.out_shape(x.shape, w.shape), dtype=x.dtype, device=x.device, memory_format=fmt)
    route.launches[0](y, x.contiguous(memory_format=fmt), w.contiguous(memory_format=fmt))
    return y if bias is None else y.add_(bias.view(_BIAS_SHAPES[y.dim()]))


_BIAS_SHAPES = {3: (1, -1, 1), 4: (1, -1, 1, 1), 5: (1, -1, 1, 1, 1)}  # a bias broadcast over a result's map


def run_backward(
    route: Any, dy: torch.Tensor, x: torch.Tensor, w: torch.Tensor, geometry: Geometry, need_dx: bool, need_dw: bool
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(dx, dw) as `route` runs them: where both are torch's own, one fused call (as PyTorch makes it), on the
    operands as they come; else each by its planned kernel, on them in the route's layout (`backward_copies`:
    dy copied once for both, x for bwd_filter after bwd_data ran), or torch's. `x` gives dx's shape (its values
    are read for dw only). A planned kernel's result is in the route's layout (the caller gives dx torch's
    format, after the copies have gone)."""
    fmt = _memory_format(route.layout, dy.dim())
    native_dx = need_dx and route.bwd_data is None
    native_dw = need_dw and route.bwd_filter is None
    dx = dw = None
    if native_dx or native_dw:
        dx, dw = geometry.torch_backward(dy, x, w, native_dx, native_dw)
    if not (need_dx and not native_dx or need_dw and not native_dw):
        return dx, dw
    # both results made before either kernel runs, as a plan holds them beside the larger of the two workspaces
    dx_out = (
        torch.empty(x.shape, dtype=dy.dtype, device=dy.device, memory_format=fmt) if need_dx and not native_dx else None
    )
    dw_out = torch.empty_like(w, memory_format=fmt) if need_dw and not native_dw else None
    dy = dy.contiguous(memory_format=fmt)
    if dx_out is not None:
        dx = route.launches[1](dx_out, dy, w.contiguous(memory_format=fmt))
    if dw_out is not None:
        dw = route.launches[2](dw_out, x.contiguous(memory_format=fmt), dy)
    return dx, dw


def forward_copies(x: torch.Tensor, w: torch.Tensor, layout: str) -> tuple[int, bool]:
    """What a layer's planned `fwd` kernel holds beside its workspace and its output (`run_forward`, its caller's
    `_in_format`): the bytes of its operands' copies into the layout (an operand in another memory format: a
    channels-last map where the kernels run NCHW), held while it runs, and whether its output is then copied into
    torch's format (`_result_format`), beside the output in the layout. Real or fake tensors (a capture's)."""
    fmt = _memory_format(layout, x.dim())
    return _copy_bytes(x, fmt) + _copy_bytes(w, fmt), _result_format(x, w, layout) != fmt


def backward_copies(
    dy: torch.Tensor, x: torch.Tensor | None, w: torch.Tensor, layout: str, kinds: Sequence[str], fused: bool
) -> tuple[tuple[str, int, int], ...]:
    """What a layer's planned backward kernels hold beside their workspaces and results (`run_backward`): per kind
    in `kinds`, (kind, bytes of operand copies held while it runs, bytes of its result's copy into torch's format
    made after it). bwd_data holds the copies of dy and the filter, bwd_filter those of dy and x; dx is copied
    into torch's format where `fused` (one operation returns both gradients, dx in that format: its copy is
    inside it; where dx alone is asked for, the copy is an operation of the step of its own). `x` None: dx's
    shape only (bwd_data alone)."""
    fmt = _memory_format(layout, dy.dim())
    out = []
    if "bwd_data" in kinds:
        converted = (
            x.numel() * dy.element_size() if fused and x is not None and _result_format(x, w, layout) != fmt else 0
        )
        out.append(("bwd_data", _copy_bytes(dy, fmt) + _copy_bytes(w, fmt), converted))
    if "bwd_filter" in kinds:
        assert x is not None  # bwd_filter reads x (None: bwd_data alone)
        out.append(("bwd_filter", _copy_bytes(dy, fmt) + _copy_bytes(x, fmt), 0))
    return tuple(out)


def held_with_copies(workspace: int, copies: tuple[int, int] | None) -> int | None:
    """What a step holds beside a planned kernel's result for a kernel of `workspace` bytes whose operands and
    result are copied as `copies` says ((bytes copied in, bytes of the result's copy out): `forward_copies`,
    `backward_copies`): its workspace and the operands' copies while it runs, or the result's copy after it,
    the larger. None where nothing is copied (its workspace alone)."""
    if not copies or not any(copies):
        return None
    return max(workspace + copies[0], copies[1])
