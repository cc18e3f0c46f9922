"""PyTorch integration: `Conv2d`, a drop-in for `torch.nn.Conv2d`, and `convert(model)`.

    model = ucudnn.torch.convert(model, backend="cpu", workspace_limit="64MiB")

swaps every `torch.nn.Conv2d` of `model` for a `ucudnn.torch.Conv2d` that shares its parameters
(the same `Parameter` objects, so an optimizer built before the swap keeps working) and runs all
three kernels through one shared `ucudnn.Handle`: the forward pass with its `fwd` kernel, and the
backward pass with `bwd_data` (only when the input needs a gradient) and `bwd_filter`; the bias
gradient is ``dy.sum((0, 2, 3))``. Layer ids are the modules'
qualified names (``layer1.0.conv1``); a `Conv2d` built by hand uses ``conv@<id(self) in hex>``.

Each layer keeps a route per input signature (shape, dtype, device, layout, which gradients are
needed): the handle's prepared `Kernel` of each kind, planned together at the first call. Later
calls only launch: no lookup, operand check, planning or workspace allocation. Where every
needed kernel's plan is `native` on the whole batch, the layer is plain `F.conv2d` (PyTorch's own
autograd, no Python Function in between). Any other plan routes the layer through an autograd
Function and the handle, a host cost per kernel call that kernel measurements do not see: on the
CPU, the handles this module makes charge it when planning (`route_overhead_ms`, measured once
per process, as ``Handle(call_overhead=...)``), so a NumPy algorithm is chosen only where it beats
torch's own convolution by more than the route costs.

WD (``total_workspace=...``) divides one workspace among all kernels of the network, so the
handle must know the layers before it solves. `convert` arranges that: the model's first forward
pass registers every layer (PyTorch's convolution computes it) and a forward hook ends the
learning; the next convolution solves once. ``announce(model, example)`` does the same
explicitly with one recording forward pass in eval mode (batch-norm statistics untouched); use it
when the first forward pass runs under ``torch.no_grad()`` (it would register no backward kernels).

Under torch.compile and torch.export (``torch.compiler.is_compiling()``) a layer traces to the
operators of `ucudnn.torch.ops` instead: they look the layer up by an int key and plan, register
(WD's learning pass) and run when the graph runs, with the same route cache, so nothing is planned
on fake tensors and nothing about the handle is baked into a graph. So does a layer called on fake
tensors (`FakeTensorMode`: the operators' fake implementations give the shapes) and one inside
`through_operators` (a captured step and the executor of its plan see each convolution as one
dispatched operation). Other eager calls keep the autograd Function: going through the dispatcher
and the operators' autograd wrapper costs host time per call.

CPU tensors of float32 (or float64) go through ``.numpy()`` views without copies; CUDA tensors go
to a cudnn-backend handle through ``__cuda_array_interface__`` (``cupy.asarray``; bfloat16 as its
16-bit words), on torch's current stream, with CuPy's allocations taken from PyTorch's caching
allocator, so ``torch.cuda.max_memory_allocated`` sees every workspace and no CuPy pool holds
memory. A cudnn handle runs on the CUDA device current when it was made; a tensor on another
device is refused. Channels-last CUDA tensors run as NHWC problems. Under ``torch.autocast`` the convolution
is cast as autocast casts ``F.conv2d``; a dtype the backend cannot run (bfloat16 on the cpu
backend) is refused with `UnsupportedProblem` naming dtype and backend. An empty batch returns
what nn.Conv2d returns. Double backward (gradients of gradients) is not supported.

This module imports torch; ``import ucudnn`` does not import this module.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor
from torch.autograd.function import once_differentiable

from ucudnn.backends import get_backend
from ucudnn.backends.cpu import NATIVE, CpuBackend
from ucudnn.kernel.measure import interleaved_medians_ms
from ucudnn.errors import InvalidInput, UnsupportedProblem
from ucudnn.handle import Handle, Kernel, native_only
from ucudnn.problem import ConvProblem
from ucudnn.sizes import format_size
from ucudnn.solver.types import Infeasible
from ucudnn.torch import ops as _ops
from ucudnn.torch.launch import _dtype_name, _launch, _memory_format, _on_device, _out_size

__all__ = ["Conv2d", "announce", "as_torch", "convert", "through_operators"]

# Timed runs of each side in a kernel's in-step trial against torch's own convolution (CPU handles)
TRIAL_RUNS = 3

_OPERATORS: contextvars.ContextVar[bool] = contextvars.ContextVar("ucudnn_through_operators", default=False)
_AS_TORCH: contextvars.ContextVar[bool] = contextvars.ContextVar("ucudnn_as_torch", default=False)


@contextlib.contextmanager
def through_operators() -> Iterator[None]:
    """Inside this block a converted convolution runs as the operator `torch.ops.ucudnn.conv2d` (as under
    torch.compile), bias included: one dispatched operation, as `aten.convolution` is, which a dispatch
    mode (the capture of a training step, the executor of its plan) sees and names as one."""
    token = _OPERATORS.set(True)
    try:
        yield
    finally:
        _OPERATORS.reset(token)


@contextlib.contextmanager
def as_torch() -> Iterator[None]:
    """Inside this block a converted convolution is torch's own (`F.conv2d`): nothing is planned, measured
    or registered. Planning times the other operations in real steps this way (the convolutions' times
    come from their handles' measurements), without the handle solving anything before the plan exists."""
    token = _AS_TORCH.set(True)
    try:
        yield
    finally:
        _AS_TORCH.reset(token)


def _layout_name(t: torch.Tensor) -> str:
    """The layout the kernels read `t` in: channels-last CUDA tensors stay NHWC (the cudnn backend
    runs that layout), everything else is NCHW."""
    if t.device.type == "cuda" and not t.is_contiguous() and t.is_contiguous(memory_format=torch.channels_last):
        return "NHWC"
    return "NCHW"


def _layout(t: torch.Tensor) -> tuple[torch.Tensor, str]:
    """The tensor as the kernels read it (NCHW made contiguous) and its layout."""
    layout = _layout_name(t)
    return (t if layout == "NHWC" else t.contiguous()), layout


@dataclass(frozen=True, slots=True)
class _Route:
    """How one layer runs at one input: the handle's prepared kernel of each kind, or None where
    torch runs the kernel itself (the plan is `native` on the whole batch, or the kind is not
    needed). `direct`: every needed kind is torch's own, so the layer is plain F.conv2d."""

    handle: Handle  # the route belongs to this handle (a plan's executor may swap a layer's handle)
    generation: int
    backend: str
    layout: str
    fwd: Kernel | None
    bwd_data: Kernel | None
    bwd_filter: Kernel | None
    direct: bool
    budgets: dict | None = None  # the memory plan's workspace per kind it was planned under (execute_plan)


class _Routes(dict):
    """A layer's routes by input signature. Copies and pickles start empty: the kernels belong to
    the handle, and a copied model gets a fresh handle."""

    def __reduce__(self):
        return (_Routes, ())

    def __deepcopy__(self, memo):
        return _Routes()


class _Learning:
    """WD without `announce`: while active, converted layers register themselves with the handle
    and compute with torch's own convolution; the model's first forward pass that registers a layer
    ends it (a pass on fake tensors, or under `as_torch`, registers none)."""

    __slots__ = ("active", "registered")

    def __init__(self) -> None:
        self.active = True
        self.registered = False


class _EndLearning:
    """Forward hook on the converted model: its first registering forward pass has registered every layer."""

    def __init__(self, state: _Learning) -> None:
        self.state = state

    def __call__(self, module, args, output) -> None:
        if self.state.registered:
            self.state.active = False


def _autocast(t: torch.Tensor | None, low: torch.dtype) -> torch.Tensor | None:
    """`t` as autocast casts an operand: floating tensors go to `low`, except float64, which it leaves."""
    if t is None or not t.is_floating_point() or t.dtype == torch.float64:
        return t
    return t.to(low)


class _Conv2dFunction(torch.autograd.Function):
    """conv2d whose three kernels run as `route` says: through the handle's prepared kernels, or,
    where the plan is `native` on the whole batch, as that torch call itself made on the tensors
    (going through the handle would compute the same thing into a temporary and copy it)."""

    @staticmethod
    def forward(ctx, x, weight, bias, route: _Route, stride, padding, dilation, groups):
        # x comes in the route's layout; the filter is made to match it
        weight = weight.contiguous(memory_format=_memory_format(route.layout))
        ctx.save_for_backward(x, weight)
        ctx.route, ctx.conv, ctx.has_bias = route, (stride, padding, dilation, groups), bias is not None
        if route.fwd is None:
            return F.conv2d(x, weight, bias, stride, padding, dilation, groups)
        n, _, h, w = x.shape
        k, _, r, s = weight.shape
        shape = (n, k, _out_size(h, r, stride[0], padding[0], dilation[0]),
                 _out_size(w, s, stride[1], padding[1], dilation[1]))
        y = _launch(route.fwd, route.backend, torch.empty(shape, dtype=x.dtype, device=x.device,
                                                          memory_format=_memory_format(route.layout)), x=x, w=weight)
        if bias is not None:
            y.add_(bias.view(1, -1, 1, 1))
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        route = ctx.route
        stride, padding, dilation, groups = ctx.conv
        fmt = _memory_format(route.layout)
        dy = dy.contiguous(memory_format=fmt)
        need_dx, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        dx = dw = db = None
        native_dx = need_dx and route.bwd_data is None
        native_dw = need_dw and route.bwd_filter is None
        if native_dx or native_dw:
            dx, dw, _ = torch.ops.aten.convolution_backward(
                dy, x, weight, None, list(stride), list(padding), list(dilation), False, [0, 0], groups,
                [native_dx, native_dw, False])
        if need_dx and not native_dx:
            dx = _launch(route.bwd_data, route.backend, torch.empty_like(x, memory_format=fmt), dy=dy, w=weight)
        if need_dw and not native_dw:
            dw = _launch(route.bwd_filter, route.backend, torch.empty_like(weight, memory_format=fmt), x=x, dy=dy)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = dy.sum((0, 2, 3))
        return dx, dw, db, None, None, None, None, None


@functools.cache
def route_overhead_ms() -> float:
    """Host time (ms) that routing one kernel of a CPU convolution through ucudnn costs beyond
    torch running it itself, measured once per process on a tiny layer (forward and backward,
    the three contenders alternately, medians):

    - direct: plain F.conv2d;
    - function: the layer as ucudnn's autograd Function with torch running every kernel in it;
    - routed: the same with all three kernels `native` through the handle (NumPy views, output
      tensors, the handle's launch, the launcher's copy).

    A kernel routed through ucudnn takes its layer off F.conv2d onto the Function, so it is
    charged the Function's whole cost plus one kernel's share of routing: (function - direct) +
    (routed - function) / 3. That is its marginal cost where torch runs the layer's other kernels
    (a layer with several routed kernels pays the Function once, so there it is charged more than
    it pays: the charge errs towards torch's own convolution). Rounded to 10 us, so that plans
    keyed by it recur across processes. Handles made by this module charge it
    (`Handle(call_overhead=...)`)."""
    # the probe needs autograd in float32, whatever mode its caller is in (convert under no_grad, ...)
    with torch.inference_mode(False), torch.enable_grad(), torch.autocast("cpu", enabled=False):
        times = _probe_route()
    function = max(0.0, times["function"] - times["direct"])
    return round(function + max(0.0, times["routed"] - times["function"]) / 3, 2)


def _probe_route() -> dict[str, float]:
    """Median ms of `route_overhead_ms`'s three contenders (forward and backward, alternately)."""
    handle = Handle(backend="cpu", policy="undivided", algos=[NATIVE], reps=1, db=False)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 4, 6, 6, generator=g, requires_grad=True)
    w = torch.randn(4, 4, 3, 3, generator=g, requires_grad=True)
    dy = torch.randn(1, 4, 6, 6, generator=g)
    conv = {"stride": (1, 1), "padding": (1, 1), "dilation": (1, 1), "groups": 1, "dtype": "float32", "layer": "probe"}
    kernels = [handle.kernel(kind, tuple(x.shape), tuple(w.shape), **conv) for kind in ("fwd", "bwd_data", "bwd_filter")]
    routes = {"function": _Route(handle, handle.generation, "cpu", "NCHW", None, None, None, direct=False),
              "routed": _Route(handle, handle.generation, "cpu", "NCHW", *kernels, direct=False)}

    def through(route: _Route):
        return lambda: _Conv2dFunction.apply(x, w, None, route, (1, 1), (1, 1), (1, 1), 1).backward(dy)

    return interleaved_medians_ms({"direct": lambda: F.conv2d(x, w, None, 1, 1, 1, 1).backward(dy),
                                   **{name: through(route) for name, route in routes.items()}}, reps=51, warmup=5)


def _new_handle(**options: Any) -> Handle:
    """A Handle for torch layers. On the CPU its NumPy algorithms run on one thread (they run
    between torch's operations, whose thread pool owns the cores: `CpuBackend`'s docstring says
    why), each kernel planned as one of them is confirmed against torch's own convolution inside
    the first training steps (`Handle`'s ``trial_runs``), and it charges the measured
    `route_overhead_ms` unless the options give a `call_overhead` themselves."""
    backend = options.get("backend", "auto")
    if isinstance(backend, str):
        backend = get_backend(backend)
        if backend.name == "cpu":
            backend = CpuBackend(numpy_threads=1)
        options = {**options, "backend": backend}
    if backend.name != "cpu":
        return Handle(**options)
    # kernels measured alone are confirmed in the step: see Handle's trial_runs
    options = {"trial_runs": TRIAL_RUNS, **options}
    if "call_overhead" not in options:
        options["call_overhead"] = route_overhead_ms()
    return Handle(**options)


class Conv2d(nn.Conv2d):
    """`torch.nn.Conv2d` whose convolutions run through a ucudnn `Handle`.

    Takes exactly `torch.nn.Conv2d`'s arguments (its parameters, `state_dict`, `repr` and
    initialisation are nn.Conv2d's own), plus keyword-only `handle` (default: a new
    ``Handle()`` with the default options, charging `route_overhead_ms` on the CPU) and `layer` (the id under which the handle plans this
    layer; default ``conv@<id>``). Every `padding_mode` and string padding ("same", "valid") is
    supported: non-zero modes and asymmetric "same" padding pad the input with `F.pad` first, as
    nn.Conv2d itself does, and run the convolution unpadded.
    """

    def __init__(self, in_channels: int, out_channels: int, kernel_size, stride=1, padding=0, dilation=1,
                 groups: int = 1, bias: bool = True, padding_mode: str = "zeros", device=None, dtype=None, *,
                 handle: Handle | None = None, layer: str | None = None) -> None:
        super().__init__(in_channels, out_channels, kernel_size, stride=stride, padding=padding, dilation=dilation,
                         groups=groups, bias=bias, padding_mode=padding_mode, device=device, dtype=dtype)
        self._init_ucudnn(handle if handle is not None else _new_handle(), layer)

    def _init_ucudnn(self, handle: Handle, layer: str | None) -> None:
        if not isinstance(handle, Handle):
            raise InvalidInput(f"handle must be a ucudnn.Handle, got {type(handle).__name__}")
        if layer is not None and (not isinstance(layer, str) or not layer):
            raise InvalidInput(f"layer must be a non-empty string or None, got {layer!r}")
        self.handle = handle
        self.layer = layer
        if "_key" not in self.__dict__:  # the name torch.ops.ucudnn's operators know this layer by
            self._key = _ops.register_layer(self)
        self._recording = False
        self._learning: _Learning | None = None  # set by convert for WD without announce
        self._routes = _Routes()
        # kind -> workspace bytes, set by ucudnn.torch.execute_plan for the span of its block
        self._budgets: dict[str, int] | None = None

    def __setstate__(self, state) -> None:
        # a copy or an unpickled layer is another layer: the operators must not find the original by its key
        super().__setstate__({name: value for name, value in state.items() if name != "_key"})
        self._key = _ops.register_layer(self)

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
                             for name, value in conv.__dict__.items() if name != "_key"})
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
        device = input.device.type
        if torch.is_autocast_enabled(device):
            # What autocast does to F.conv2d: compute in its lower precision (the backend may refuse it).
            low = torch.get_autocast_dtype(device)
            input, weight, bias = (_autocast(t, low) for t in (input, weight, bias))
            with torch.autocast(device, enabled=False):
                out = self._convolve(input, weight, bias, padding)
        else:
            out = self._convolve(input, weight, bias, padding)
        return out.squeeze(0) if unbatched else out

    def _convolve(self, input, weight, bias, padding) -> torch.Tensor:
        stride, dilation = tuple(self.stride), tuple(self.dilation)
        # compiling, capturing, fake tensors: the operators, which read the learning state and plan when
        # they run on real tensors (never while traced, nor on fake tensors: their fake implementation runs).
        # (Compiling first: Dynamo cannot trace a ContextVar's get.)
        compiling = torch.compiler.is_compiling()
        if not compiling and _AS_TORCH.get():
            return F.conv2d(input, weight, bias, stride, padding, dilation, self.groups)
        operators = compiling or _OPERATORS.get() or isinstance(input, FakeTensor)
        if not operators and self._learning_now():
            return self._record(input, weight, bias, padding)
        if input.shape[0] == 0:  # an empty batch: nothing to plan; torch returns the empty result
            return F.conv2d(input, weight, bias, stride, padding, dilation, self.groups)
        input, layout = _layout(input)
        grad = torch.is_grad_enabled()
        need_dx, need_dw = grad and input.requires_grad, grad and weight.requires_grad
        if operators:
            return self._traced(input, weight, bias, padding, layout, need_dx, need_dw)
        route = self._planned(input, weight, padding, layout, need_dx, need_dw)
        if route.direct:
            return F.conv2d(input, weight, bias, stride, padding, dilation, self.groups)
        return _Conv2dFunction.apply(input, weight, bias, route, stride, padding, dilation, self.groups)

    def _planned(self, input, weight, padding, layout: str, need_dx: bool, need_dw: bool) -> _Route:
        """This layer's route at this input with its current handle, planned on first use."""
        key = (input.shape, weight.shape, input.dtype, weight.dtype, input.device, weight.device, layout, padding,
               need_dx, need_dw)
        route = self._routes.get(key)
        handle = self.handle
        if route is None or route.handle is not handle or route.generation != handle.generation \
                or route.budgets is not self._budgets:
            route = self._routes[key] = self._route(input, weight, padding, layout, need_dx, need_dw)
        return route

    def _traced(self, input, weight, bias, padding, layout: str, need_dx: bool, need_dw: bool) -> torch.Tensor:
        """The layer as torch.compile, torch.export and dispatch modes see it: ucudnn's operator, which
        plans and runs when it runs on real tensors (with the layer's handle at that time)."""
        return torch.ops.ucudnn.conv2d.default(input, weight, self._key, self.stride, padding, self.dilation,
                                               self.groups, layout, need_dx, need_dw, bias)

    def _learning_now(self) -> bool:
        """Whether this layer registers itself (announce, or WD's learning pass) instead of planning."""
        return self._recording or (self._learning is not None and self._learning.active)

    def _problem(self, input, weight, padding, dtype: str, layout: str = "NCHW") -> ConvProblem:
        n, c, h, w = input.shape
        k, _, r, s = weight.shape
        return ConvProblem(n=n, c=c, h=h, w=w, k=k, r=r, s=s, pad_h=padding[0], pad_w=padding[1],
                           stride_h=self.stride[0], stride_w=self.stride[1], dilation_h=self.dilation[0],
                           dilation_w=self.dilation[1], groups=self.groups, dtype=dtype, layout=layout)

    def _route(self, input, weight, padding, layout: str, need_dx: bool, need_dw: bool) -> _Route:
        """Plan the kernels this layer needs at this input (all at once, so that a WD handle learns
        the layer's kinds together) and prepare them."""
        handle, backend = self.handle, self.handle.backend.name
        if input.device.type == "cuda" and backend == "cudnn" and input.device.index != handle.backend.device_id:
            # planning would measure one device's engines on the other's memory
            raise InvalidInput(f"ucudnn.torch.Conv2d: the input is on {input.device}, but the handle's cudnn backend "
                               f"runs on cuda:{handle.backend.device_id} (the device current when it was made); make "
                               f"the handle (or convert the model) after torch.cuda.set_device({input.device.index})")
        if input.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            # planning times kernels and synchronises, which a capture forbids: every candidate would
            # fail and be recorded as unusable
            raise UnsupportedProblem(f"ucudnn.torch.Conv2d {self.layer_id!r} meets input shape {tuple(input.shape)} "
                                     "for the first time inside CUDA graph capture; run the step once before "
                                     "capturing it (a warm-up plans every layer)")
        dtype = _dtype_name(input, backend)
        kinds = ("fwd",) + (("bwd_data",) if need_dx else ()) + (("bwd_filter",) if need_dw else ())
        conv = {"stride": tuple(self.stride), "padding": padding, "dilation": tuple(self.dilation),
                "groups": self.groups, "dtype": dtype, "layout": layout, "layer": self.layer_id}
        with _on_device(input):  # a WD solve allocates the arena: from torch's allocator on CUDA
            handle.register(self.layer_id, self._problem(input, weight, padding, dtype, layout), kinds=kinds)
            budgets = self._budgets or {}
            try:
                kernels = {kind: handle.kernel(kind, tuple(input.shape), tuple(weight.shape),
                                               budget=budgets.get(kind), **conv) for kind in kinds}
            except Infeasible as exc:
                if not budgets:
                    raise
                given = ", ".join(f"{kind} {format_size(b)}" for kind, b in budgets.items())
                raise Infeasible(f"{self.layer_id}: the memory plan's workspace budgets ({given}) fit none of this "
                                 f"layer's configurations ({exc}); make the plan with plan_memory on the converted "
                                 "model, whose budgets come from its layers' own measurements") from exc
        # torch runs a native undivided plan itself (on CPU tensors; the cudnn backend has no native)
        torch_runs = {kind: input.device.type == "cpu" and native_only(k.config) for kind, k in kernels.items()}
        routed = {kind: None if torch_runs[kind] else k for kind, k in kernels.items()}
        return _Route(handle, handle.generation, backend, layout, routed["fwd"], routed.get("bwd_data"),
                      routed.get("bwd_filter"), direct=all(torch_runs.values()), budgets=self._budgets)

    def _record(self, input, weight, bias, padding) -> torch.Tensor:
        """Announce this layer to the handle and compute with torch's own convolution."""
        self._announce(input, weight, padding, input.requires_grad, weight.requires_grad)
        return F.conv2d(input, weight, bias, self.stride, padding, self.dilation, self.groups)

    def _announce(self, input, weight, padding, need_dx: bool, need_dw: bool) -> None:
        # in the layout its route will run, or the first real call re-registers the layer (WD re-solves)
        problem = self._problem(input, weight, padding, _dtype_name(input, self.handle.backend.name),
                                _layout_name(input))
        kinds = {"fwd"} | ({"bwd_data"} if need_dx else set()) | ({"bwd_filter"} if need_dw else set())
        self.handle.register(self.layer_id, problem, kinds=kinds)
        if self._learning is not None:
            self._learning.registered = True


def _ucudnn_convs(model: nn.Module) -> Iterator[Conv2d]:
    return (m for m in model.modules() if isinstance(m, Conv2d))


def convert(model: nn.Module, *, handle: Handle | None = None, **handle_options) -> nn.Module:
    """Swap every `torch.nn.Conv2d` of `model`, in place, for a `ucudnn.torch.Conv2d`; return `model`.

    The new modules share the old ones' parameters (same objects: weights, bias, device, dtype
    and any optimizer state stay valid), hooks and training flag. All of them share one handle:
    `handle`, or a new ``Handle(**handle_options)`` (backend, policy, workspace_limit,
    total_workspace, db, reps, algos, call_overhead; on the CPU, call_overhead defaults to the
    measured `route_overhead_ms`, while a given `handle` keeps its own). Layer ids are qualified module names. ucudnn Conv2d
    modules already in the model join the shared handle. Subclasses of nn.Conv2d other than
    ucudnn's are left alone with a warning (they may override `forward`). When `model` itself is
    an nn.Conv2d, the converted module is returned (there is no parent to swap it in).
    """
    if not isinstance(model, nn.Module):
        raise InvalidInput(f"convert needs a torch.nn.Module, got {type(model).__name__}")
    if handle is None:
        handle = _new_handle(**handle_options)
    elif handle_options:
        raise InvalidInput(f"give a handle or handle options, not both (got handle and {', '.join(handle_options)})")
    if type(model) is nn.Conv2d:
        return _learn_first_forward(Conv2d.from_conv(model, handle=handle, layer="conv"), handle)
    names = {id(m): name for name, m in model.named_modules()}  # the first qualified name of each module
    if isinstance(model, Conv2d):
        model._init_ucudnn(handle, model.layer or "conv")
        return _learn_first_forward(model, handle)
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
    return _learn_first_forward(model, handle)


def _learn_first_forward(model: nn.Module, handle: Handle) -> nn.Module:
    """WD, nothing announced yet: the model's first forward pass registers every layer (computing
    with torch's own convolution) and ends with a hook; the next convolution solves once."""
    if handle.mode != "WD" or handle.layers or handle.wd_solved:
        return model
    state = _Learning()
    for conv in _ucudnn_convs(model):
        conv._learning = state
    model.register_forward_hook(_EndLearning(state))
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
            if conv._learning is not None:  # announced: the first real forward pass runs through the handle
                conv._learning.active = False
        for module, flag in training.items():
            module.training = flag

