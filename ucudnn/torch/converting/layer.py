"""`ConvLayer`: what makes a torch convolution module a ucudnn layer, for every form PyTorch has (Conv1d,
Conv2d, Conv3d and their transposed kinds). `ucudnn.torch.converting.conv` puts it in front of each torch class.

A layer keeps a route per input signature (shape, dtype, device, layout, geometry, which gradients are
needed): the handle's prepared `Kernel` of each kind, planned together at the first call. Later calls only
launch. Where every needed kernel's plan is `native` on the whole batch, the layer is torch's own
convolution (PyTorch's autograd, no Python Function in between); any other plan routes it through
`_ConvFunction` and the handle. Under torch.compile, in a dispatch mode's capture, on fake tensors and
inside `through_operators` it is the operator `torch.ops.ucudnn.convolution` (`ucudnn.torch.converting.ops`), which
plans when it runs on real tensors (and is torch's own convolution there where the layer's route is).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensor
from torch.autograd.function import once_differentiable

from ucudnn.backends import get_backend
from ucudnn.backends.cpu import NATIVE, CpuBackend
from ucudnn.errors import InvalidInput, UnsupportedProblem
from ucudnn.handle import Handle, Kernel, Turns, native_only
from ucudnn.kernel.measure import interleaved_medians_ms
from ucudnn.problem import ConvProblem
from ucudnn.sizes import format_size
from ucudnn.solver.types import Infeasible
from ucudnn.torch.converting import ops as _ops
from ucudnn.torch.converting.launch import (
    Geometry,
    _dtype_name,
    _in_format,
    _on_device,
    _result_format,
    geometry,
    run_backward,
    run_forward,
)

__all__ = [
    "TRIAL_RUNS",
    "TRIAL_STEPS",
    "ConvLayer",
    "ConvTransposeLayer",
    "PlanBudgets",
    "as_torch",
    "route_overhead_ms",
    "through_operators",
]

_OPERATORS: contextvars.ContextVar[bool] = contextvars.ContextVar("ucudnn_through_operators", default=False)
_AS_TORCH: contextvars.ContextVar[bool] = contextvars.ContextVar("ucudnn_as_torch", default=False)


@contextlib.contextmanager
def through_operators() -> Iterator[None]:
    """Inside this block a converted convolution runs as the operator `torch.ops.ucudnn.convolution` (as under
    torch.compile), bias included: one dispatched operation, as `aten.convolution` is, which a dispatch mode
    (the capture of a training step, the executor of its plan) sees and names as one."""
    token = _OPERATORS.set(True)
    try:
        yield
    finally:
        _OPERATORS.reset(token)


@contextlib.contextmanager
def as_torch() -> Iterator[None]:
    """Inside this block a converted convolution is torch's own: nothing is planned, measured or registered.
    Planning times the other operations in real steps this way (the convolutions' times come from their
    handles' measurements), without the handle solving anything before the plan exists."""
    token = _AS_TORCH.set(True)
    try:
        yield
    finally:
        _AS_TORCH.reset(token)


def _layout_name(t: torch.Tensor) -> str:
    """The layout the kernels read `t` in: channels-last 4-D CUDA tensors stay NHWC (the cudnn backend runs
    that layout), everything else is NCHW (1-D and 3-D included)."""
    if t.is_cuda and t.dim() == 4 and not t.is_contiguous() and t.is_contiguous(memory_format=torch.channels_last):
        return "NHWC"
    return "NCHW"


@dataclass(frozen=True, slots=True)
class _Route:
    """How one layer runs at one input: the handle's prepared kernel of each kind, or None where torch runs
    the kernel itself (the plan is `native` on the whole batch, or the kind is not needed). `direct`: every
    needed kind is torch's own, so the layer is torch's convolution."""

    handle: Handle  # the route belongs to this handle (a plan's executor may swap a layer's handle)
    generation: int
    backend: str
    layout: str
    fwd: Kernel | None
    bwd_data: Kernel | None
    bwd_filter: Kernel | None
    direct: bool
    budgets: dict | None = None  # the memory plan's workspace per kind it was planned under (execute_plan)
    trial: _BackwardTrial | None = None  # its backward against torch's fused one, for its first backward passes
    problem: ConvProblem | None = None  # the forward problem it runs (None: a geometry only torch expresses)
    asked: tuple[str, ...] = ()  # the kinds it was planned for (the others are not needed)

    @property
    def left_to_torch(self) -> set[str]:
        """The kinds it was planned for that torch's own convolution runs."""
        return {kind for kind in self.asked if getattr(self, kind) is None}

    def backward(self, dy, x, w, g: Geometry, need_dx: bool, need_dw: bool) -> tuple:
        """(dx, dw) of this route, each None where not needed; the backward trial's turn while it is open."""
        if self.trial is not None and self.trial.open and need_dx and need_dw:
            return self.trial.run(self, dy, x, w, g)
        return run_backward(self, dy, x, w, g, need_dx, need_dw)


@dataclass(slots=True)
class _BackwardTrial:
    """A route's backward pass against torch's own, timed in the step, for routes that run a planned backward
    kernel where torch would compute dx and dw in one fused call. The kernels' own trials (`Handle`'s
    trial_runs) time a planned kernel against torch's kernel of that kind alone, which costs more than its
    share of the fused call: a kernel that wins its trial can lose the layer's backward pass (on the CPU,
    ResNet-18's last stage's weight gradients). The two take turns once the kernels' trials have closed (the
    first run of each untimed); then, unless the route won by more than the handle's call overhead per
    routed kernel, the layer's route becomes torch's for the backward pass."""

    routes: dict  # the layer's routes, and this route's key in them: the verdict replaces it there
    key: tuple
    overhead_ms: float  # charged to the route
    turns: Turns  # first the route's backward, second torch's fused call

    @property
    def open(self) -> bool:
        return self.turns.open

    def run(self, route: _Route, dy, x, w, g: Geometry) -> tuple[torch.Tensor, torch.Tensor]:
        if any(k is not None and k.trying for k in (route.bwd_data, route.bwd_filter)):
            return run_backward(route, dy, x, w, g, True, True)
        dx, dw = self.turns.take(
            lambda: run_backward(route, dy, x, w, g, True, True), lambda: g.torch_backward(dy, x, w, True, True)
        )
        if not self.open and self.routes.get(self.key) is route and not self.turns.first_won_by(self.overhead_ms):
            self.routes[self.key] = dataclasses.replace(
                route, bwd_data=None, bwd_filter=None, direct=route.fwd is None, trial=None
            )
        return dx, dw


class _Routes(dict):
    """A layer's routes by input signature. Copies and pickles start empty: the kernels belong to the
    handle, and a copied model gets a fresh handle."""

    def __reduce__(self):
        return (_Routes, ())

    def __deepcopy__(self, memo):
        return _Routes()


class _Learning:
    """WD without `announce`: while active, converted layers register themselves with the handle and compute
    with torch's own convolution; the model's first forward pass that registers a layer ends it (a pass on
    fake tensors, or under `as_torch`, registers none)."""

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


class _ConvFunction(torch.autograd.Function):
    """A convolution whose three kernels run as `route` says: through the handle's prepared kernels, or,
    where the plan is `native` on the whole batch, as torch's own call on the tensors (going through the
    handle would compute the same thing into a temporary and copy it)."""

    @staticmethod
    def forward(ctx, x, weight, bias, route: _Route, geometry: Geometry):
        # the operands are made the route's layout by the kernels that need it, not before (`run_forward`,
        # `run_backward`): a copy made outside would be an operation of the step (an autograd node) that the
        # operator path, which copies inside, does not have; one made for torch's own kernel would be memory
        # no plan holds; and each planned kernel's copies are gone before its result is made torch's format,
        # as a plan holds them (`launch.forward_copies`, `launch.backward_copies`)
        ctx.result_format = _result_format(x, weight, route.layout)
        ctx.save_for_backward(x, weight)  # as they came: the storage its producer made (a plan may drop it)
        ctx.route, ctx.geometry, ctx.has_bias = route, geometry, bias is not None
        return _in_format(run_forward(route, x, weight, bias, geometry), ctx.result_format)

    @staticmethod
    @once_differentiable
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        # the bias's gradient first: a plan holds it through the step's kernels (aten's fused call makes it with them)
        db = dy.sum((0, *range(2, dy.dim()))) if ctx.has_bias and ctx.needs_input_grad[2] else None
        dx, dw = ctx.route.backward(dy, x, weight, ctx.geometry, ctx.needs_input_grad[0], ctx.needs_input_grad[1])
        return (None if dx is None else _in_format(dx, ctx.result_format)), dw, db, None, None


# Timed runs of each side in a kernel's in-step trial against torch's own convolution (CPU handles)
TRIAL_RUNS = 3
# Training steps until every trial of a converted model has closed: the kernels' (each side's first run
# untimed), then the layers' backward passes (`_BackwardTrial`) as many again
TRIAL_STEPS = 4 * (TRIAL_RUNS + 1)


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
    kernels = [
        handle.kernel(kind, tuple(x.shape), tuple(w.shape), **conv) for kind in ("fwd", "bwd_data", "bwd_filter")
    ]
    routes = {
        "function": _Route(handle, handle.generation, "cpu", "NCHW", None, None, None, direct=False),
        "routed": _Route(handle, handle.generation, "cpu", "NCHW", *kernels, direct=False),
    }
    geometry = Geometry((1, 1), (1, 1), (1, 1), False, (0, 0), 1)

    def through(route: _Route):
        return lambda: _ConvFunction.apply(x, w, None, route, geometry).backward(dy)

    return interleaved_medians_ms(
        {
            "direct": lambda: F.conv2d(x, w, None, 1, 1, 1, 1).backward(dy),
            **{name: through(route) for name, route in routes.items()},
        },
        reps=51,
        warmup=5,
    )


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


class PlanBudgets(dict):
    """A memory plan's workspace budget per kernel kind of one converted layer (bytes; `execute_plan` sets it as
    the layer's `_budgets` for its block), and the kinds whose option in the plan is torch's own convolution
    (`ConvWorkspace.torch_own`), which the layer runs as torch's."""

    def __init__(self, budgets: dict[str, int], torch_kinds: frozenset[str] = frozenset()) -> None:
        super().__init__(budgets)
        self.torch_kinds = frozenset(torch_kinds)


class ConvLayer:
    """The ucudnn part of a converted convolution module; the torch class after it in the bases gives the
    parameters, `state_dict`, `repr` and initialisation. Attributes: `handle` (the `ucudnn.Handle` that
    plans its kernels), `layer` (the id it plans under; None: ``conv@<id(self) in hex>``)."""

    def __init__(self, *args: Any, handle: Handle | None = None, layer: str | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)  # the torch class's own arguments
        self._init_ucudnn(handle if handle is not None else _new_handle(), layer)

    @classmethod
    def from_conv(cls, conv: torch.nn.Module, *, handle: Handle, layer: str | None = None) -> ConvLayer:
        """A layer of this class that takes over `conv`'s state: the same parameter objects (parametrizations
        included), hooks, training flag, device and dtype (nothing is copied or re-initialised)."""
        torch_class = next(base for base in cls.__mro__ if base.__module__ == "torch.nn.modules.conv")
        if not isinstance(conv, torch_class):
            raise InvalidInput(
                f"{cls.__name__}.from_conv needs a torch.nn.{torch_class.__name__}, got {type(conv).__name__}"
            )
        new = cls.__new__(cls)
        # A shallow copy of the module's state; its dicts (parameters, hooks, ...) are copied so that the two
        # modules do not share containers, while the tensors in them are shared.
        new.__dict__.update(
            {
                name: (value.copy() if isinstance(value, dict) else value)
                for name, value in conv.__dict__.items()
                if name != "_key"
            }
        )
        new._init_ucudnn(handle, layer)
        return new

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

    @property
    def layer_id(self) -> str:
        """The id the handle plans this layer under: `layer`, or ``conv@<id(self) in hex>``."""
        return self.layer if self.layer is not None else f"conv@{id(self):x}"

    def _geometry(self, padding, output_padding=None, compiling: bool = False) -> Geometry:
        args = (
            tuple(self.stride),
            tuple(padding),
            tuple(self.dilation),
            self.transposed,
            tuple(output_padding) if output_padding is not None else (0,) * len(self.kernel_size),
            self.groups,
        )
        # (Dynamo traces through a cache and warns: compiling, the geometry is made, once per trace)
        return Geometry(*args) if compiling else geometry(*args)

    def _explicit_padding(self, input: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...]]:
        """The input to convolve and the symmetric padding per axis that the kernels apply: non-zero padding
        modes and asymmetric "same" padding are applied with F.pad first, as torch's own modules do."""
        if self.padding_mode == "zeros" and not isinstance(self.padding, str):
            return input, tuple(self.padding)
        pads = self._reversed_padding_repeated_twice  # F.pad's order: the last axis first, (before, after) each
        before, after = pads[0::2], pads[1::2]
        if self.padding_mode == "zeros" and before == after:
            return input, tuple(reversed(before))
        mode = "constant" if self.padding_mode == "zeros" else self.padding_mode
        return F.pad(input, pads, mode=mode), (0,) * len(self.kernel_size)

    def _conv_forward(self, input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        input, padding = self._explicit_padding(input)
        compiling = torch.compiler.is_compiling()  # asked once a call, passed down
        return self._convolution(input, weight, bias, self._geometry(padding, None, compiling), compiling)

    def _convolution(self, input, weight, bias, g: Geometry, compiling: bool) -> torch.Tensor:
        """The layer's convolution of a batched or unbatched input, under autocast as torch's own is."""
        dims = len(self.kernel_size)
        unbatched = input.dim() == dims + 1
        if unbatched:
            input = input.unsqueeze(0)
        if input.dim() != dims + 2:
            raise InvalidInput(
                f"{type(self).__name__} expects a {dims + 1}-D (unbatched) or {dims + 2}-D (batched) "
                f"input, got shape {tuple(input.shape)}"
            )
        device = input.device.type
        if torch.is_autocast_enabled(device):
            # What autocast does to torch's convolution: compute in its lower precision (the backend may refuse it).
            low = torch.get_autocast_dtype(device)
            input, weight, bias = (_autocast(t, low) for t in (input, weight, bias))
            with torch.autocast(device, enabled=False):
                out = self._convolve(input, weight, bias, g, compiling)
        else:
            out = self._convolve(input, weight, bias, g, compiling)
        return out.squeeze(0) if unbatched else out

    def _convolve(self, input, weight, bias, g: Geometry, compiling: bool) -> torch.Tensor:
        # compiling, capturing, fake tensors: the operators, which read the learning state and plan when they
        # run on real tensors (never while traced, nor on fake tensors: their fake implementation runs).
        # (Compiling first: Dynamo cannot trace a ContextVar's get.)
        if not compiling and _AS_TORCH.get():  # the same operation as the captured step's: one convolution
            return g.torch(input, weight, bias)
        operators = compiling or _OPERATORS.get() or isinstance(input, FakeTensor)
        if not operators and self._learning_now():
            self._announce(input, weight, g, input.requires_grad, weight.requires_grad)
            return g.torch(input, weight, bias)
        if input.shape[0] == 0:  # an empty batch: nothing to plan; torch returns the empty result
            return g.torch(input, weight, bias)
        grad = torch.is_grad_enabled()
        need_dx, need_dw = grad and input.requires_grad, grad and weight.requires_grad
        layout = _layout_name(input)  # (the kernels' copy to it is made where they run, not here: see _ConvFunction)
        if operators:
            return torch.ops.ucudnn.convolution.default(
                input,
                weight,
                self._key,
                g.stride,
                g.padding,
                g.dilation,
                g.transposed,
                g.output_padding,
                g.groups,
                layout,
                need_dx,
                need_dw,
                bias,
            )
        route = self._planned(input, weight, g, layout, need_dx, need_dw)
        if route.direct:  # torch's own convolution takes the input as it comes: a channels-last map stays one (made
            return g.torch(input, weight, bias)  # contiguous, it cost a copy and torch's slower NCHW kernels after it)
        return _ConvFunction.apply(input, weight, bias, route, g)

    @staticmethod
    def _eager(input, weight, bias, route: _Route, g: Geometry) -> torch.Tensor:
        """The eager route's autograd Function (for the operators' autograd kernel, which cannot import it)."""
        return _ConvFunction.apply(input, weight, bias, route, g)

    def _route_key(
        self, input, weight, g: Geometry, layout: str, need_dx: bool, need_dw: bool, budgets: dict | None
    ) -> tuple:
        # (per memory plan's budgets too, so that steps in and out of execute_plan do not re-plan each other's:
        # a route holds its budgets, so their id is not reused while it lives)
        return (
            input.shape,
            weight.shape,
            input.dtype,
            weight.dtype,
            input.device,
            weight.device,
            layout,
            g,
            need_dx,
            need_dw,
            id(budgets),
        )

    def _known(self, key: tuple, budgets: dict | None) -> _Route | None:
        """The route planned at `key` under `budgets` with the layer's current handle, if there is one."""
        route = self._routes.get(key)
        if (
            route is None
            or route.handle is not self.handle
            or route.generation != self.handle.generation
            or route.budgets is not budgets
        ):
            return None
        return route

    def _planned(self, input, weight, g: Geometry, layout: str, need_dx: bool, need_dw: bool) -> _Route:
        """This layer's route at this input with its current handle, planned on first use."""
        key = self._route_key(input, weight, g, layout, need_dx, need_dw, self._budgets)
        route = self._known(key, self._budgets)
        if route is None:
            handle = self.handle
            route = self._route(input, weight, g, layout, need_dx, need_dw)
            routed = [k for k in (route.bwd_data, route.bwd_filter) if k is not None]
            if need_dx and need_dw and routed and all(k.against_native for k in routed):
                route = dataclasses.replace(
                    route,
                    trial=_BackwardTrial(
                        self._routes, key, handle.call_overhead * len(routed), Turns(handle.trial_runs)
                    ),
                )
            self._routes[key] = route
        return route

    def _learning_now(self) -> bool:
        """Whether this layer registers itself (announce, or WD's learning pass) instead of planning."""
        return self._recording or (self._learning is not None and self._learning.active)

    def _problem(self, input, weight, g: Geometry, dtype: str, layout: str) -> ConvProblem:
        return ConvProblem.from_shapes(
            input.shape,
            weight.shape,
            stride=g.stride,
            padding=g.padding,
            dilation=g.dilation,
            groups=g.groups,
            transposed=g.transposed,
            output_padding=g.output_padding,
            dtype=dtype,
            layout=layout,
        )

    def _expressible(self, g: Geometry) -> bool:
        """Whether ucudnn's kernels express this geometry. A transposed convolution runs as a convolution's
        backward kernels, which cannot add an output padding as large as the stride (torch allows it where
        the dilation is larger): torch runs such a layer itself, with one warning."""
        if all(op < s for op, s in zip(g.output_padding, g.stride)):
            return True
        if not getattr(self, "_warned_inexpressible", False):
            self._warned_inexpressible = True
            warnings.warn(
                f"ucudnn.torch: {self.layer_id} ({type(self).__name__}) has an output_padding "
                f"{g.output_padding} not below its stride {g.stride}, which ucudnn's kernels cannot "
                "express; PyTorch's own convolution runs it",
                stacklevel=4,
            )
        return False

    def _route(self, input, weight, g: Geometry, layout: str, need_dx: bool, need_dw: bool) -> _Route:
        """Plan the kernels this layer needs at this input (all at once, so that a WD handle learns the
        layer's kinds together) and prepare them."""
        handle, backend = self.handle, self.handle.backend.name
        if not self._expressible(g):
            return _Route(
                handle, handle.generation, backend, layout, None, None, None, direct=True, budgets=self._budgets
            )
        if input.device.type == "cuda" and backend == "cudnn" and input.device.index != handle.backend.device_id:
            # planning would measure one device's engines on the other's memory
            raise InvalidInput(
                f"ucudnn.torch: {self.layer_id}'s input is on {input.device}, but the handle's cudnn "
                f"backend runs on cuda:{handle.backend.device_id} (the device current when it was "
                f"made); make the handle (or convert the model) after "
                f"torch.cuda.set_device({input.device.index})"
            )
        if input.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            # planning times kernels and synchronises, which a capture forbids: every candidate would fail and
            # be recorded as unusable
            raise UnsupportedProblem(
                f"ucudnn.torch: {self.layer_id} meets input shape {tuple(input.shape)} for the "
                "first time inside CUDA graph capture; run the step once before capturing it "
                "(a warm-up plans every layer)"
            )
        dtype = _dtype_name(input, backend)
        kinds = ("fwd",) + (("bwd_data",) if need_dx else ()) + (("bwd_filter",) if need_dw else ())
        conv = {
            "stride": g.stride,
            "padding": g.padding,
            "dilation": g.dilation,
            "groups": g.groups,
            "transposed": g.transposed,
            "output_padding": g.output_padding,
            "dtype": dtype,
            "layout": layout,
            "layer": self.layer_id,
        }
        # Under a memory plan's budgets, a kind that the layer's own route leaves to torch stays torch's: its
        # in-step trials settled on torch's convolution on the whole batch, which holds no workspace the plan
        # counts (its options hold none), so it is within every budget; the handle, asked within a budget,
        # would pick by measurements alone, and a budget below torch's own workspace leaves no trial to
        # correct it (HF MobileNetV2 ran 1.10x its converted step under a plan that acts on nothing).
        # So does a kind whose option in the plan is torch's own (`PlanBudgets.torch_kinds`): its budget, torch's
        # measured workspace, could hold another configuration of the handle's, which the plan does not count.
        own = (
            None
            if self._budgets is None
            else self._known(self._route_key(input, weight, g, layout, need_dx, need_dw, None), None)
        )
        planned_torch = getattr(self._budgets, "torch_kinds", frozenset())
        asked = [kind for kind in kinds if kind not in planned_torch and (own is None or kind not in own.left_to_torch)]
        problem = self._problem(input, weight, g, dtype, layout)
        with _on_device(input):  # a WD solve allocates the arena: from torch's allocator on CUDA
            handle.register(self.layer_id, problem, kinds=kinds)
            budgets = self._budgets or {}
            try:
                kernels = {
                    kind: handle.kernel(kind, tuple(input.shape), tuple(weight.shape), budget=budgets.get(kind), **conv)
                    for kind in asked
                }
            except Infeasible as exc:
                if not budgets:
                    raise
                given = ", ".join(f"{kind} {format_size(b)}" for kind, b in budgets.items())
                raise Infeasible(
                    f"{self.layer_id}: the memory plan's workspace budgets ({given}) fit none of this "
                    f"layer's configurations ({exc}); make the plan with plan_memory on the converted "
                    "model, whose budgets come from its layers' own measurements"
                ) from exc
        # torch runs a native undivided plan itself (on CPU tensors; the cudnn backend has no native)
        routed = {kind: k for kind, k in kernels.items() if not (input.device.type == "cpu" and native_only(k.config))}
        return _Route(
            handle,
            handle.generation,
            backend,
            layout,
            routed.get("fwd"),
            routed.get("bwd_data"),
            routed.get("bwd_filter"),
            direct=not routed,
            budgets=self._budgets,
            problem=problem,
            asked=kinds,
        )

    def _torch_kinds(self, problem: ConvProblem) -> set[str]:
        """The kinds that this layer's own routes at `problem` (outside any memory plan) leave to torch's
        convolution, where its trials settled: under a plan's budgets they stay torch's (`_route`)."""
        return {
            kind
            for key, route in self._routes.items()
            if route.problem == problem and self._known(key, None) is route
            for kind in route.left_to_torch
        }

    def _announce(self, input, weight, g: Geometry, need_dx: bool, need_dw: bool) -> None:
        """Register this layer with its handle (announce, WD's learning pass); torch computes the pass."""
        if not self._expressible(g):
            return
        # in the layout its route will run, or the first real call re-registers the layer (WD re-solves)
        problem = self._problem(input, weight, g, _dtype_name(input, self.handle.backend.name), _layout_name(input))
        kinds = {"fwd"} | ({"bwd_data"} if need_dx else set()) | ({"bwd_filter"} if need_dw else set())
        self.handle.register(self.layer_id, problem, kinds=kinds)
        if self._learning is not None:
            self._learning.registered = True


class ConvTransposeLayer(ConvLayer):
    """`ConvLayer` for the transposed kinds, whose torch forward takes an `output_size`."""

    def forward(self, input: torch.Tensor, output_size: list[int] | None = None) -> torch.Tensor:
        if self.padding_mode != "zeros":  # as torch's own modules refuse it
            raise ValueError(f"Only `zeros` padding mode is supported for {type(self).__name__}")
        output_padding = self._output_padding(
            input, output_size, self.stride, self.padding, self.kernel_size, len(self.kernel_size), self.dilation
        )
        compiling = torch.compiler.is_compiling()
        return self._convolution(
            input, self.weight, self.bias, self._geometry(self.padding, output_padding, compiling), compiling
        )
