"""Planning for a compiled step (`plan_memory(..., compiled=True)`): what `torch.compile` makes cheap, and the peak
of the step it compiles under a plan.

**Time.** Inductor fuses a pointwise operation (an activation, a batch-norm's normalisation, an addition) into
the kernel that consumes its result, so running or recomputing it costs almost nothing; a convolution or a
matrix product costs what it measures (`compiled_costs`).

**Memory.** A compiled step's memory is not the eager step's: the partitioner saves its own set of tensors for
the backward pass (the plan's tags steer it), and Inductor fuses pointwise results away and reuses buffers. So the
peak of a compiled plan is Inductor's own (`compiled_peak`): the model is traced once under the plan
(`with_plan`) through Inductor's decompositions, partitioner, lowering and scheduler, stopping before code
generation (the costly part of a compile), and each graph's peak is the estimate Inductor's scheduler makes of
its own buffers (`torch._inductor.memory.estimate_peak_memory`, which its peak-memory reordering uses). The step's
peak adds what lives beside them: the parameters, buffers and inputs, and during the backward graph what the
forward graph saved for it, held to its end (AOTAutograd releases them with the step's autograd node; a bound
that errs on the side of fitting). The largest workspace budget of the plan's converted convolutions is added,
as it is held while its kernel runs. The graphs themselves run uncompiled for the one traced step.
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


def _saved_bytes(forward: Any) -> int:
    """The bytes of the activations a forward graph saves for the backward pass (its outputs that are not its
    inputs, each storage once)."""
    sizes = {}
    for node in forward.graph.find_nodes(op="output")[0].all_input_nodes:
        if node.op == "placeholder":  # a parameter or input saved as it is: resident anyway
            continue
        value = node.meta.get("val")
        for t in value if isinstance(value, (tuple, list)) else (value,):
            if isinstance(t, torch.Tensor):
                sizes[t.untyped_storage()._cdata] = t.untyped_storage().nbytes()
    return sum(sizes.values())


class _Estimated(Exception):
    """Raised in place of Inductor's code generation, with its scheduler's peak estimate of the graph."""


def _estimate_instead_of_codegen(graph: Any) -> Any:
    """`GraphLowering.codegen` stood in for: the scheduler Inductor would generate code from, and the peak of the
    buffers it allocates (the graph's inputs are the caller's, not counted)."""
    from torch._inductor.memory import estimate_peak_memory
    from torch.utils._ordered_set import OrderedSet

    graph.init_wrapper_code()
    graph._update_scheduler()
    peak, _ = estimate_peak_memory(graph.scheduler.nodes, {}, OrderedSet(graph.get_output_names()))
    raise _Estimated(peak)


def _estimated(exc: BaseException) -> int | None:
    """The estimate an exception carries, where Inductor's wrappers raised it from `_Estimated`."""
    while exc is not None:
        if isinstance(exc, _Estimated):
            return exc.args[0]
        exc = exc.__cause__ or exc.__context__  # type: ignore[assignment]
    return None


def fresh_call(module: nn.Module) -> Callable[..., Any]:
    """A function calling `module`, under a code object of its own: Dynamo keeps compiled graphs per code object
    and shares them between instances of one structure (their parameters are the graph's inputs), so that a
    `torch.compile` of it compiles anew, and its graphs go with it."""

    def call(*args: Any, **kwargs: Any) -> Any:
        return module(*args, **kwargs)

    return types.FunctionType(call.__code__.replace(), call.__globals__, closure=call.__closure__)


def _graphs(module: PlannedModule, call: Callable[[Any], Any]) -> dict[bool, tuple[Any, int]]:
    """The forward (False) and backward (True) graphs Inductor would compile for `module`, each with its
    scheduler's peak estimate, traced by one step (`call`) that runs them as they are, uncompiled."""
    import copy

    from torch._functorch.aot_autograd import make_boxed_func
    from torch._inductor.compile_fx import compile_fx, compile_fx_inner
    from torch._inductor.graph import GraphLowering

    graphs: dict[bool, tuple[Any, int]] = {}

    def record(gm: Any, example_inputs: Any, **kwargs: Any) -> Any:
        graph = copy.deepcopy(gm)  # (Inductor's passes rewrite `gm`: this one runs)
        codegen = GraphLowering.codegen
        GraphLowering.codegen = _estimate_instead_of_codegen  # type: ignore[method-assign, assignment]
        try:
            compile_fx_inner(gm, example_inputs, **kwargs)
        except Exception as exc:  # (the estimate, raised through Inductor's wrappers)
            peak = _estimated(exc)
            if peak is None:
                raise
        else:
            raise AssertionError("Inductor generated code: the estimate did not stand in for its codegen")
        finally:
            GraphLowering.codegen = codegen  # type: ignore[method-assign]
        graphs[bool(kwargs.get("is_backward"))] = graph, peak
        return make_boxed_func(graph.forward)

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
    return graphs


def compiled_peak(model: nn.Module, plan: MemoryPlan, args: tuple, kwargs: dict, loss: Callable) -> int:
    """The peak bytes of `model`'s training step compiled under `plan` (see the module docstring): its
    parameters and buffers, the inputs, and Inductor's estimates of its graphs. The model's state is as it was."""
    convs = [m for m in model.modules() if isinstance(m, ConvLayer)]
    budgets = [(c, c._budgets) for c in convs]
    inputs = [t for t in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]

    def step(compiled: Callable[..., Any]) -> None:
        loss(compiled(*args, **kwargs)).backward()

    try:
        with state_kept(model):
            graphs = _graphs(with_plan(model, plan), step)
    finally:  # (with_plan gave the model's converted layers the plan's budgets)
        for conv, before in budgets:
            conv._budgets = before
    storages = {
        t.untyped_storage()._cdata: t.untyped_storage().nbytes()
        for t in (*model.parameters(), *model.buffers(), *inputs)
    }
    resident = sum(storages.values())
    (forward, forward_peak), (_, backward_peak) = graphs[False], graphs[True]
    workspace = max((c.bytes for c in plan.conv_workspace if not c.torch_own), default=0)
    return resident + max(forward_peak, _saved_bytes(forward) + backward_peak) + workspace
