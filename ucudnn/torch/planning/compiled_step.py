"""Planning for a compiled step (`plan_memory(..., compiled=True)`): what `torch.compile` makes cheap, and the peak
of the step it compiles under a plan.

**Time.** Inductor fuses a pointwise operation (an activation, a batch-norm's normalisation, an addition) into
the kernel that consumes its result, so running or recomputing it costs almost nothing; a convolution or a
matrix product costs what it measures (`compiled_costs`).

**Memory.** A compiled step's memory is not the eager step's: the partitioner saves its own set of tensors for
the backward pass (the plan's tags steer it), and Inductor never materialises a pointwise result that only
other pointwise code reads. So the peak of a compiled plan is counted on the graphs Inductor itself would
compile (`compiled_peak`): the model is traced once under the plan (`with_plan`) through Inductor's own
decompositions and partitioner, stopping before code generation (the costly part of a compile), and its
forward and backward graphs are walked in order. A node's result is held from the node to its last reader where
Inductor materialises it (a kernel it does not generate itself, such as a convolution or a matrix product; a
reduction; what such a kernel reads; a graph output), and not at all where it fuses it. What the forward pass
saves stays until the backward pass ends (AOTAutograd frees it with the step's autograd node). The largest
workspace budget of the plan's converted convolutions is added, as it is held while its kernel runs.
"""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ucudnn.errors import UnsupportedProblem
from ucudnn.memory.graph import TrainingGraph
from ucudnn.memory.plan import MemoryPlan
from ucudnn.torch.capturing.capture import state_kept
from ucudnn.torch.converting.layer import ConvLayer
from ucudnn.torch.running.compiled import PlannedModule, with_plan

__all__ = ["compiled_costs", "compiled_peak", "fresh_call", "fused", "recompute_fused"]

# The operations Inductor calls as library kernels rather than generating: their inputs and outputs exist.
_EXTERN = frozenset({"convolution", "convolution_backward", "mm", "addmm", "bmm", "baddbmm"})


def fused(op: Any) -> bool:
    """Whether Inductor fuses a graph op into its neighbours: no convolution, no matrix product, nothing whose
    arithmetic is large beside the memory it moves."""
    return op.conv is None and op.type not in ("linear", "input", "loss") and op.flops <= 4 * max(op.bytes_moved, 1)


def compiled_costs(graph: TrainingGraph) -> TrainingGraph:
    """`graph` as a compiled step costs: each fused op's forward time (and so its recomputation's) is nothing."""
    ops = tuple(dataclasses.replace(op, measured_ms=0.0) if fused(op) else op for op in graph.ops)
    return dataclasses.replace(graph, ops=ops)


def recompute_fused(plan: MemoryPlan, graph: TrainingGraph) -> MemoryPlan:
    """`plan` with every kept map that fused ops alone make recomputed: compiled, recomputing it is free, and a
    map that must be saved (`MUST_SAVE`) would keep the partitioner from saving the smaller tensors it is
    recomputed from, as compile's own partitioning does."""
    tensors = tuple(
        dataclasses.replace(t, action="recompute")
        if t.action == "keep" and t.name in graph.op_index and all(fused(op) for op in graph.producers(t.name))
        else t
        for t in plan.tensors
    )
    return dataclasses.replace(plan, tensors=tensors)


def _name(node: Any) -> str:
    return getattr(node.target, "__name__", str(node.target)).split(".")[0]


def _bytes(node: Any, seen: set[int]) -> int:
    """The bytes of the storages a node makes, each storage once."""
    value = node.meta.get("val")
    total = 0
    for t in value if isinstance(value, (tuple, list)) else (value,):
        if isinstance(t, torch.Tensor):
            key = t.untyped_storage()._cdata
            if key not in seen:
                seen.add(key)
                total += t.untyped_storage().nbytes()
    return total


def _walk(graph: torch.fx.Graph, start: int) -> tuple[int, int]:
    """(peak, bytes at the end) of running `graph` from `start` bytes (see the module docstring): its inputs (the
    saved tensors of a backward graph among them) are held throughout, its outputs from where they are made."""
    nodes = list(graph.nodes)
    outputs = set(nodes[-1].all_input_nodes)
    last: dict[Any, int] = {}
    for i, n in enumerate(nodes):
        for a in n.all_input_nodes:
            last[a] = i

    def materialised(n: Any) -> bool:
        if n.op != "call_function" or _name(n) == "getitem":
            return False
        if _name(n) in _EXTERN or n in outputs or any(_name(u) in _EXTERN for u in n.users):
            return True
        return torch.Tag.pointwise not in getattr(n.target, "tags", ())

    now = peak = start
    alive: dict[Any, int] = {}
    seen: set[int] = set()
    for i, n in enumerate(nodes):
        if materialised(n):
            alive[n] = _bytes(n, seen)
            now += alive[n]
            peak = max(peak, now)
        for a in n.all_input_nodes:
            if last.get(a) == i and a in alive and a not in outputs:
                now -= alive.pop(a)
    return peak, now


def fresh_call(module: nn.Module) -> Callable[..., Any]:
    """A function calling `module`, under a code object of its own: Dynamo keeps compiled graphs per code object
    and shares them between instances of one structure (their parameters are the graph's inputs), so that a
    `torch.compile` of it compiles anew, and its graphs go with it."""

    def call(*args: Any, **kwargs: Any) -> Any:
        return module(*args, **kwargs)

    return types.FunctionType(call.__code__.replace(), call.__globals__, closure=call.__closure__)


def _graphs(module: PlannedModule, call: Callable[[Any], Any]) -> tuple[Any, Any]:
    """The forward and backward graphs Inductor would compile for `module`, traced by one step (`call`) that
    runs them as they are, uncompiled."""
    from torch._functorch.aot_autograd import make_boxed_func
    from torch._inductor.compile_fx import compile_fx

    graphs: dict[bool, Any] = {}

    def record(gm: Any, example_inputs: Any, **kwargs: Any) -> Any:
        graphs[bool(kwargs.get("is_backward"))] = gm
        return make_boxed_func(gm.forward)

    def backend(gm: Any, example_inputs: Any) -> Any:
        return compile_fx(gm, example_inputs, inner_compile=record)

    # (the caches would hand back a compiled graph without calling `record`)
    with (
        torch._functorch.config.patch(enable_autograd_cache=False),
        torch._inductor.config.patch(fx_graph_cache=False),
    ):
        call(torch.compile(fresh_call(module), backend=backend, dynamic=False))  # (static: sizes are counted)
    if set(graphs) != {False, True}:  # Dynamo ran the checkpointed region eagerly
        raise UnsupportedProblem(
            f"torch.compile does not trace {module.plan.network}'s forward pass whole (a graph break: see "
            "torch._dynamo.explain), so its plan would run eagerly; mend the break, or run the plan eagerly "
            "(execute_plan)"
        )
    return graphs[False], graphs[True]


def compiled_peak(model: nn.Module, plan: MemoryPlan, args: tuple, kwargs: dict, loss: Callable) -> int:
    """The peak bytes of `model`'s training step compiled under `plan` (see the module docstring): its
    parameters and buffers, the inputs, and the graphs' walk. The model's state is as it was."""
    convs = [m for m in model.modules() if isinstance(m, ConvLayer)]
    budgets = [(c, c._budgets) for c in convs]
    inputs = [t for t in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]

    def step(compiled: Callable[..., Any]) -> None:
        loss(compiled(*args, **kwargs)).backward()

    try:
        with state_kept(model):
            forward, backward = _graphs(with_plan(model, plan), step)
    finally:  # (with_plan gave the model's converted layers the plan's budgets)
        for conv, before in budgets:
            conv._budgets = before
    storages = {
        t.untyped_storage()._cdata: t.untyped_storage().nbytes()
        for t in (*model.parameters(), *model.buffers(), *inputs)
    }
    resident = sum(storages.values())
    fwd_peak, after = _walk(forward.graph, resident)
    bwd_peak, _ = _walk(backward.graph, after)
    workspace = max((c.bytes for c in plan.conv_workspace if not c.torch_own), default=0)
    return max(fwd_peak, bwd_peak) + workspace
