"""A converted layer's route at one input (`_Route`: the handle's prepared kernel of each kind, or torch's own
convolution), the trial of its backward pass against torch's fused one (`_BackwardTrial`), a layer's routes by
input signature (`_Routes`), and the autograd Function that runs a route (`_ConvFunction`)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch.autograd.function import once_differentiable

from ucudnn.handle import Handle, Kernel, Turns
from ucudnn.problem import ConvProblem
from ucudnn.torch.converting.launch import (
    Geometry,
    _in_format,
    _result_format,
    prepared_launch,
    run_backward,
    run_forward,
)


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
    # each kind's kernel launch (`prepared_launch`), made with the route: its calls only launch
    launches: tuple = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        kernels = (("fwd", self.fwd), ("bwd_data", self.bwd_data), ("bwd_filter", self.bwd_filter))
        object.__setattr__(self, "launches", tuple(prepared_launch(k, kind, self.backend) for kind, k in kernels))

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

    def run(self, route: _Route, dy, x, w, g: Geometry) -> tuple[torch.Tensor | None, torch.Tensor | None]:
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


class _Routes(dict[tuple, _Route]):
    """A layer's routes by input signature. Copies and pickles start empty: the kernels belong to the
    handle, and a copied model gets a fresh handle."""

    def __reduce__(self):
        return (_Routes, ())

    def __deepcopy__(self, memo):
        return _Routes()


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
