"""`ConvLayer`: what makes a torch convolution module a ucudnn layer, for every form PyTorch has (Conv1d,
Conv2d, Conv3d and their transposed kinds). `ucudnn.torch.converting.conv` puts it in front of each torch class.

A layer keeps a route per input signature (shape, dtype, device, layout, geometry, which gradients are
needed): the handle's prepared `Kernel` of each kind, planned together at the first call. Later calls only
launch. Where every needed kernel's plan is `native` on the whole batch, the layer is torch's own
convolution (PyTorch's autograd, no Python Function in between); any other plan routes it through
`_ConvFunction` and the handle (`ucudnn.torch.converting.route`; the handle a layer makes for itself comes from
`ucudnn.torch.converting.route_cost`). Under torch.compile, in a dispatch mode's capture, on fake tensors and
inside `through_operators` it is the operator `torch.ops.ucudnn.convolution` (`ucudnn.torch.converting.ops`), which
plans when it runs on real tensors (and is torch's own convolution there where the layer's route is).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import warnings
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any, Literal

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensor

from ucudnn.errors import InvalidInput, UnsupportedProblem
from ucudnn.handle import Handle, Turns, native_only
from ucudnn.problem import ConvProblem
from ucudnn.sizes import format_size
from ucudnn.solver.types import Infeasible
from ucudnn.torch.converting import ops as _ops
from ucudnn.torch.converting.launch import Geometry, _dtype_name, _on_device, geometry
from ucudnn.torch.converting.route import _BackwardTrial, _ConvFunction, _Route, _Routes
from ucudnn.torch.converting.route_cost import _new_handle

__all__ = [
    "ConvLayer",
    "ConvTransposeLayer",
    "PlanBudgets",
    "as_torch",
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


class PlanBudgets(dict):
    """A memory plan's workspace budget per kernel kind of one converted layer (bytes; `execute_plan` sets it as
    the layer's `_budgets` for its block), and the kinds whose option in the plan is torch's own convolution
    (`ConvWorkspace.torch_own`), which the layer runs as torch's."""

    def __init__(self, budgets: dict[str, int], torch_kinds: frozenset[str] = frozenset()) -> None:
        super().__init__(budgets)
        self.torch_kinds = frozenset(torch_kinds)


if TYPE_CHECKING:  # every ConvLayer is one: its classes put it before a torch convolution module's
    _Module = torch.nn.Module
else:
    _Module = object


class ConvLayer(_Module):
    """The ucudnn part of a converted convolution module; the torch class after it in the bases gives the
    parameters, `state_dict`, `repr` and initialisation. Attributes: `handle` (the `ucudnn.Handle` that
    plans its kernels), `layer` (the id it plans under; None: ``conv@<id(self) in hex>``)."""

    # the torch class's (`torch.nn.modules.conv._ConvNd`), which this class uses
    kernel_size: tuple[int, ...]
    stride: tuple[int, ...]
    padding: str | tuple[int, ...]
    dilation: tuple[int, ...]
    transposed: bool
    groups: int
    padding_mode: Literal["zeros", "reflect", "replicate", "circular"]
    _reversed_padding_repeated_twice: list[int]
    weight: torch.Tensor
    bias: torch.Tensor | None

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
        layer_id = self.layer_id
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
        planned_torch: frozenset[str] = getattr(self._budgets, "torch_kinds", frozenset())
        asked = [kind for kind in kinds if kind not in planned_torch and (own is None or kind not in own.left_to_torch)]
        problem = self._problem(input, weight, g, dtype, layout)
        with _on_device(input):  # a WD solve allocates the arena: from torch's allocator on CUDA
            handle.register(self.layer_id, problem, kinds=kinds)
            budgets = self._budgets or {}
            try:
                kernels = {
                    kind: handle.kernel(
                        kind,
                        tuple(input.shape),
                        tuple(weight.shape),
                        stride=g.stride,
                        padding=g.padding,
                        dilation=g.dilation,
                        groups=g.groups,
                        transposed=g.transposed,
                        output_padding=g.output_padding,
                        dtype=dtype,
                        layout=layout,
                        layer=layer_id,
                        budget=budgets.get(kind),
                    )
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

    if TYPE_CHECKING:  # the torch class's (`torch.nn.modules.conv._ConvTransposeNd`)

        def _output_padding(
            self,
            input: torch.Tensor,
            output_size: list[int] | None,
            stride: Sequence[int],
            padding: Sequence[int] | str,
            kernel_size: Sequence[int],
            num_spatial_dims: int,
            dilation: Sequence[int] | None = None,
        ) -> list[int]: ...

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
