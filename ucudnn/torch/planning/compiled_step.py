"""Planning for a compiled step (`plan_memory(..., compiled=True)`): what `torch.compile` makes cheap, the peak
of the step it compiles under a plan, and which plan to take.

**Time.** Inductor fuses a pointwise operation (an activation, a batch-norm's normalisation, an addition) into
the kernel that consumes its result, so running or recomputing it costs almost nothing; a convolution or a
matrix product costs what it measures (`compiled_costs`).

**Memory.** A compiled step's memory is not the eager step's: the partitioner saves its own set of tensors for
the backward pass (the plan's tags steer it), and Inductor fuses pointwise results away and reuses buffers. So the
peak of a compiled plan is Inductor's own (`compiled_peak`): the model is traced once under the plan
(`with_plan`) through Inductor's decompositions, partitioner, lowering and scheduler, stopping before code
generation (the costly part of a compile), and each graph's peak is the estimate Inductor's scheduler makes of
its own buffers (`torch._inductor.memory.estimate_peak_memory`, which its peak-memory reordering uses). The
backward graph's estimate holds the activations the forward graph saved for it until their last use: AOTAutograd
hands them over (`steal_args`) and the generated code frees each after its last reader, so they count from the
start, each until then. The step's peak adds what lives beside the graphs: the parameters, buffers and inputs,
and what the loss reads beside the model's output (its target). A converted layer's kernel adds the workspace
its prepared configuration holds under the plan's budget (not the budget: often torch's kernel, holding none of
ours, or a smaller configuration), at the node that runs it, to what the estimate has live there. The graphs
themselves run uncompiled for the one traced step. Counted against this, the compiled steps of four library models
lay within 0.91-1.07 of it (benchmarks/pytorch/bench_compiled_plans.py), MONAI's 2-D UNet converted at 1.07; on
the test suite's small CNN one or two feature maps off either way (0.90-1.18, by plan). The 2-D UNet's 7% is
Inductor's CPU code: it runs each stretch of nodes between two extern kernels as one C++ kernel, allocating all of
its buffers before the call, where the scheduler's estimate frees between the nodes; its buffer reuse and its
concatenations written in place, which the estimate counts apart, pull the other way (benchmarks/BENCHMARKS.md).

**Which plan** (`compiled_plan`): the fastest first, then plans at lowered targets while their compiled peaks
fall, each traced once per model and decisions (`traced_peak`), and only where the eager model, taking the
decisions as the compiled step does, does not find them larger.
"""

from __future__ import annotations

import dataclasses
import types
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from ucudnn.errors import UnsupportedProblem
from ucudnn.handle import native_only
from ucudnn.memory.graph import TrainingGraph
from ucudnn.memory.plan import MemoryPlan
from ucudnn.torch.capturing.capture import CapturedStep, state_kept
from ucudnn.torch.converting.layer import ConvLayer
from ucudnn.torch.running.compiled import PlannedModule, with_plan

__all__ = ["compiled_costs", "compiled_peak", "compiled_plan", "fresh_call", "fused", "recompute_fused", "traced_peak"]


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


class _Estimated(Exception):
    """Raised in place of Inductor's code generation, with what its scheduler says of the graph's memory."""


def _estimate_instead_of_codegen(graph: Any, freeable: dict[str, int]) -> Any:
    """`GraphLowering.codegen` stood in for: the peak of the buffers the scheduler Inductor would generate code from
    allocates, and of its inputs named in `freeable` (name: bytes), which the generated code frees after their last
    use (a backward graph's saved activations: AOTAutograd hands them over, `steal_args`); the other inputs are
    the caller's, not counted. Raised with the peak and, per graph output, whether the graph made it (not one of
    its inputs)."""
    from torch._inductor.dependencies import WeakDep
    from torch._inductor.memory import FreeableInputBuffer, MemoryPlanningInfoForBuffer, estimate_peak_memory
    from torch.utils._ordered_set import OrderedSet

    graph.init_wrapper_code()
    graph._update_scheduler()
    nodes = graph.scheduler.nodes
    # (Inductor's own `get_freeable_input_buf` leaves out inputs named like parameters, ``primals_*``, which under
    # its layout optimisation are the forward graph's channels-last copies of them, and sizes an input by the
    # bytes its nodes read, less than the whole where an extern kernel reads it)
    readers: dict[str, OrderedSet[Any]] = {name: OrderedSet() for name in freeable}
    for node in nodes:
        for dep in node.read_writes.reads:
            if dep.name in readers and not (isinstance(dep, WeakDep) and dep.is_fake):
                readers[dep.name].add(node)
    inputs = {
        name: FreeableInputBuffer(name, MemoryPlanningInfoForBuffer(freeable[name], freeable[name], users, users))
        for name, users in readers.items()
        if users
    }
    outputs = graph.get_output_names()
    peak, during = estimate_peak_memory(nodes, inputs, OrderedSet(outputs))
    calls = [(int(during[i]), _kernels_of(node)) for i, node in enumerate(nodes)]
    raise _Estimated(int(peak), [name not in graph.graph_inputs for name in outputs], [c for c in calls if c[1]])


# the converted layers' operators (`ucudnn.torch.converting.ops`), by name: the kernel kinds each runs, one at a time
_KINDS = {
    "convolution": ("fwd",),
    "convolution_backward_data": ("bwd_data",),
    "convolution_backward_filter": ("bwd_filter",),
    "convolution_backward": ("bwd_data", "bwd_filter"),
}


def _kernels_of(node: Any) -> tuple[tuple[int, str], ...]:
    """The (layer key, kernel kind) pairs a scheduler node runs: a converted layer's operator, from the graph
    nodes it was lowered from (each operator's ``layer`` argument is its layer's key)."""
    found = []
    for snode in node.get_nodes():
        for origin in getattr(snode.node, "origins", ()):
            target = origin.target
            if getattr(target, "namespace", None) != "ucudnn" or target._opname not in _KINDS:
                continue
            names = [a.name for a in target._schema.arguments]
            layer = origin.args[names.index("layer")] if "layer" in names[: len(origin.args)] else None
            if isinstance(layer, int):
                found += [(layer, kind) for kind in _KINDS[target._opname]]
    return tuple(dict.fromkeys(found))


def _estimated(exc: BaseException) -> tuple[int, list[bool], list] | None:
    """What an exception carries, where Inductor's wrappers raised it from `_Estimated`."""
    while exc is not None:
        if isinstance(exc, _Estimated):
            return exc.args[0], exc.args[1], exc.args[2]
        exc = exc.__cause__ or exc.__context__  # type: ignore[assignment]
    return None


def _freeable(gm: Any, example_inputs: Any, made: list[bool]) -> dict[str, int]:
    """A backward graph's inputs that it frees as it goes, with their bytes: the tensors the forward graph made and
    saved (`made`: per forward output, the saved ones last), and the incoming gradients."""
    placeholders = [n.name for n in gm.graph.find_nodes(op="placeholder")]
    saved = [name for name in placeholders if not name.startswith("tangents")]
    made_here = dict(zip(saved, made[len(made) - len(saved) :], strict=True))  # (the user's outputs come first)
    return {
        name: int(t.untyped_storage().nbytes())  # (int: a symbolic size, where the fake tensor's storage has one)
        for name, t in zip(placeholders, example_inputs, strict=True)
        if isinstance(t, torch.Tensor) and made_here.get(name, True)
    }


def fresh_call(module: nn.Module) -> Callable[..., Any]:
    """A function calling `module`, under a code object of its own: Dynamo keeps compiled graphs per code object
    and shares them between instances of one structure (their parameters are the graph's inputs), so that a
    `torch.compile` of it compiles anew, and its graphs go with it."""

    def call(*args: Any, **kwargs: Any) -> Any:
        return module(*args, **kwargs)

    return types.FunctionType(call.__code__.replace(), call.__globals__, closure=call.__closure__)


def _graphs(module: PlannedModule, call: Callable[[Any], Any]) -> dict[bool, tuple[Any, int, list]]:
    """The forward (False) and backward (True) graphs Inductor would compile for `module`, each with its
    scheduler's peak estimate and, per node running converted layers' kernels, the bytes live while it runs and
    its (layer key, kind) pairs; traced by one step (`call`) that runs them as they are, uncompiled."""
    import copy

    from torch._functorch.aot_autograd import make_boxed_func
    from torch._inductor.compile_fx import compile_fx, compile_fx_inner
    from torch._inductor.graph import GraphLowering

    graphs: dict[bool, tuple[Any, int, list]] = {}
    made: list[bool] = []  # per forward output, whether the forward graph made it

    def record(gm: Any, example_inputs: Any, **kwargs: Any) -> Any:
        backward = bool(kwargs.get("is_backward"))
        graph = copy.deepcopy(gm)  # (Inductor's passes rewrite `gm`: this one runs)
        freeable = _freeable(gm, example_inputs, made) if backward else {}
        codegen = GraphLowering.codegen
        GraphLowering.codegen = lambda lowering: _estimate_instead_of_codegen(lowering, freeable)  # type: ignore[method-assign, assignment]
        try:
            compile_fx_inner(gm, example_inputs, **kwargs)
        except Exception as exc:  # (the estimate, raised through Inductor's wrappers)
            estimate = _estimated(exc)
            if estimate is None:
                raise
        else:
            raise AssertionError("Inductor generated code: the estimate did not stand in for its codegen")
        finally:
            GraphLowering.codegen = codegen  # type: ignore[method-assign]
        if not backward:
            made[:] = estimate[1]
        graphs[backward] = graph, estimate[0], estimate[2]
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


class _ReadBefore(TorchDispatchMode):
    """The storages a block's operations read that none of them made, with their bytes: what the block found
    alive (a loss's target)."""

    def __init__(self) -> None:
        super().__init__()
        self.read: dict[int, int] = {}
        self.made: set[int] = set()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves((args, kwargs)):
            if isinstance(t, torch.Tensor) and t.untyped_storage()._cdata not in self.made:
                self.read[t.untyped_storage()._cdata] = t.untyped_storage().nbytes()
        self.made.update(t.untyped_storage()._cdata for t in tree_leaves(out) if isinstance(t, torch.Tensor))
        return out


def compiled_peak(model: nn.Module, plan: MemoryPlan, args: tuple, kwargs: dict, loss: Callable) -> int:
    """The peak bytes of `model`'s training step compiled under `plan` (see the module docstring): its
    parameters and buffers, the inputs, what the loss reads beside the model's output (its target), and
    Inductor's estimates of its graphs. The model's state is as it was."""
    convs = [m for m in model.modules() if isinstance(m, ConvLayer)]
    budgets = [(c, c._budgets) for c in convs]
    inputs = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
    storages: dict[int, int] = {}

    def step(compiled: Callable[..., Any]) -> None:
        out = compiled(*args, **kwargs)
        with _ReadBefore() as found:
            value = loss(out)
        outputs = {t.untyped_storage()._cdata for t in tree_leaves(out) if isinstance(t, torch.Tensor)}
        storages.update((k, nbytes) for k, nbytes in found.read.items() if k not in outputs)
        value.backward()

    held: dict[tuple[int, str], int] = {}
    try:
        with state_kept(model):
            graphs = _graphs(with_plan(model, plan), step)
        for conv in convs:
            held.update(_held(conv))
    finally:  # (with_plan gave the model's converted layers the plan's budgets)
        for conv, before in budgets:
            conv._budgets = before
    storages.update(
        (t.untyped_storage()._cdata, t.untyped_storage().nbytes())
        for t in (*model.parameters(), *model.buffers(), *inputs)
    )
    resident = sum(storages.values())
    # a kernel no graph's node names (not expected: each operator's node carries its layer) counts at the peak
    placed = {pair for _, _, calls in graphs.values() for _, pairs in calls for pair in pairs}
    unplaced = max((b for pair, b in held.items() if pair not in placed), default=0)
    return resident + unplaced + max(_with_workspace(peak, calls, held) for _, peak, calls in graphs.values())


def _held(conv: ConvLayer) -> dict[tuple[int, str], int]:
    """(layer key, kind): the workspace `conv`'s kernel holds as it runs under the plan's budgets (its `_budgets`
    now): its prepared configuration's (`Handle._run_kernels` takes that much), none where torch's own kernel runs
    (a route left to torch, or a native configuration, which torch runs). A budget is only a ceiling: converted
    layers often run torch's kernel or a smaller configuration under it (MONAI's 2-D UNet: a 2.5 MiB budget, at most
    1.25 MiB held)."""
    held: dict[tuple[int, str], int] = {}
    for route in conv._routes.values():
        if route.budgets is not conv._budgets or conv._budgets is None:
            continue
        for kind in ("fwd", "bwd_data", "bwd_filter"):
            kernel = getattr(route, kind)
            if kernel is not None and not native_only(kernel.config):
                held[conv._key, kind] = max(held.get((conv._key, kind), 0), kernel.config.workspace)
    return held


def _with_workspace(peak: int, calls: list, held: dict[tuple[int, str], int]) -> int:
    """A graph's peak with its converted kernels' workspace (`held`), each where its node runs (`calls`: the bytes
    live then, and its kernels, which run one at a time): a workspace held away from the peak adds nothing."""
    return max([peak, *(live + max(held.get(pair, 0) for pair in pairs) for live, pairs in calls)])


# model -> {(its capture's key, a compiled plan's decisions): its compiled step's peak}: plans at several limits
# often decide alike, and each peak is a trace through Inductor
_PEAKS: weakref.WeakKeyDictionary[nn.Module, dict[tuple, int]] = weakref.WeakKeyDictionary()


def traced_peak(model: nn.Module, key: tuple, plan: MemoryPlan, args: tuple, kwargs: dict, loss: Callable) -> int:
    """`compiled_peak` of `plan`, traced once per model, capture (`key`) and decisions."""
    decisions = (key, tuple((t.name, t.action) for t in plan.tensors), plan.conv_workspace)
    peaks = _PEAKS.setdefault(model, {})
    if decisions not in peaks:
        peaks[decisions] = compiled_peak(model, plan, args, kwargs, loss)
    return peaks[decisions]


_NO_LIMIT = 2**62  # bytes: a limit no plan reaches


def compiled_plan(
    step: CapturedStep,
    graph: TrainingGraph,
    limit: int,
    make: Callable[[int], MemoryPlan],
    modelled_peak: Callable[[MemoryPlan], int],
    peak_of: Callable[[MemoryPlan], int],
) -> MemoryPlan:
    """The plan for a compiled step within `limit`: made (`make(target)`) as an eager one is on the compiled step's
    costs (`graph`) and on a profile that offloads nothing (a device whose memory is the host's has nowhere to copy
    to), then its compiled step's peak counted (`peak_of`, a trace). First the plan that keeps what it may: the
    fastest, so where it fits nothing is better (a compiled step often fits where its eager plan would not).

    Where it does not fit, the next target is the eager model's peak of the plan just traced, lowered by its
    compiled overflow: what the eager model must save for the compiled step to save as much (the limit itself
    would be a poor first guess: the compiled step's peak lies far below the eager model's). The search stops at
    the first plan that fits, or at the first whose compiled peak is no lower than an earlier plan's: a compiled
    step's peak does not always fall as the plan recomputes more (a recomputed chain can live from the backward
    graph's start), and on the library models benchmarked it never fell below the fastest plan's (HF
    MobileNetV2 and ResNet-50, MONAI's 2-D and 3-D UNet; benchmarks/BENCHMARKS.md, issue 52), so lowering the
    target further costs traces and finds nothing. A plan is not traced at all where the eager model's peak of its
    decisions as the compiled step takes them (`modelled_peak`: what fused ops make recomputed) is above the last
    traced plan's: the eager model finds them larger too (HF ResNet-50's second plan, one more convolution
    recomputed: 0.1 MiB larger so, 12.4 MiB compiled), and a trace costs most of a compile. The first that fits,
    else the one of least peak."""
    from ucudnn.memory.planner import EXECUTED_ROUNDS

    made: list[MemoryPlan] = []
    target = None  # (None: no limit)
    last_taken = 0  # the eager model's peak of the last traced plan's decisions, as its compiled step takes them
    for _ in range(EXECUTED_ROUNDS + 1):
        plan = make(_NO_LIMIT if target is None else target)
        modelled = plan.peak_bytes  # (the eager model's peak of it)
        plan = recompute_fused(dataclasses.replace(plan, capture=step, memory_limit=limit, compiled=True), graph)
        taken = modelled_peak(plan)  # (of its decisions as the compiled step takes them)
        if made and taken > last_taken:
            break  # (not traced: as the compiled step takes them, even the eager model finds these decisions larger)
        last_taken = taken
        peak = peak_of(plan)
        plan = dataclasses.replace(plan, peak_bytes=peak, fits=peak <= limit)
        made.append(plan)
        if plan.fits or target == 1 or (len(made) > 1 and peak >= made[-2].peak_bytes):  # (the peaks so far fell)
            break  # (the last: recomputing more did not lower the compiled peak, nor will lowering the target)
        target = max(1, modelled - (peak - limit))
    return next((p for p in made if p.fits), min(made, key=lambda p: p.peak_bytes))
