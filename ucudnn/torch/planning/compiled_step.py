"""Planning for a compiled step (`plan_memory(..., compiled=True)`): what `torch.compile` makes cheap, the peak
of the step it compiles under a plan, and which plan to take.

**Time.** Inductor fuses a pointwise operation (an activation, a batch-norm's normalisation, an addition) into
the kernel that consumes its result, so running or recomputing it costs almost nothing; a convolution or a
matrix product costs what it measures, and no recomputation costs the host the eager executor's replay
(`compiled_costs`).

**Memory.** A compiled step's memory is not the eager step's: the partitioner saves its own set of tensors for
the backward pass (the plan's tags steer it), and Inductor fuses pointwise results away and reuses buffers. So the
peak of a compiled plan is Inductor's own (`compiled_peak`): the model is traced once under the plan
(`with_plan`) through Inductor's decompositions, partitioner, lowering and scheduler to the wrapper code it
generates (its kernels' source written, scalar, and not compiled: compiling them is the costly part of a
compile), and each graph's peak is that code's own memory lines walked (`wrapper_walk`). The backward graph is
traced with the saved activations laid out as the forward graph's code lays them out (channels-last maps, where
Inductor chooses them), as a compile reports them to AOTAutograd; and its walk holds those activations from the
start until the code drops each after its last use (AOTAutograd hands them over, `steal_args`). The step's peak
adds what lives beside the graphs: the parameters, buffers and inputs, and what the loss reads beside the model's
output (its target). A converted layer's kernel adds the workspace its prepared configuration holds under the
plan's budget (not the budget: often torch's kernel, holding none of ours, or a smaller configuration), at the line
that runs it, to what the walk has live there. The graphs themselves run uncompiled for the one traced step. A
compiled step of the test suite's small CNN counts its prediction to 8 bytes (the loss's value and its gradient's
seed); HF MobileNetV2's two plans, which Inductor's scheduler estimate (`torch._inductor.memory`) put 6% off
either way and in the wrong order, to 8 bytes too (benchmarks/BENCHMARKS.md, issue 52).

**Which plan** (`compiled_plan`): the fastest first, then plans at lowered targets while their compiled peaks
fall, each traced once per model and decisions (`traced_peak`), and only where the eager model, taking the
decisions as the compiled step does, finds them smaller than the last traced.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import types
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from ucudnn.devices import DeviceProfile
from ucudnn.errors import UnsupportedProblem
from ucudnn.handle import native_only
from ucudnn.memory.graph import TrainingGraph
from ucudnn.memory.plan import MemoryPlan
from ucudnn.memory.simulate import simulate
from ucudnn.torch.capturing.capture import CapturedStep, state_kept
from ucudnn.torch.converting.layer import ConvLayer
from ucudnn.torch.planning.wrapper_walk import walk_call
from ucudnn.torch.running.compiled import PlannedModule, with_plan

__all__ = [
    "compiled_costs",
    "compiled_peak",
    "compiled_plan",
    "fresh_call",
    "fused",
    "modelled_peak",
    "recompute_fused",
    "traced_peak",
]


def fused(op: Any) -> bool:
    """Whether Inductor fuses a graph op into its neighbours: no convolution, no matrix product, nothing whose
    arithmetic is large beside the memory it moves."""
    return op.conv is None and op.type not in ("linear", "input", "loss") and op.flops <= 4 * max(op.bytes_moved, 1)


def compiled_costs(graph: TrainingGraph) -> TrainingGraph:
    """`graph` as a compiled step costs: each fused op's forward time (and so its recomputation's) is nothing,
    and a recomputation costs the host nothing beyond its ops (no `replay_host_ms`: the compiled backward graph
    runs it as its own code, where the eager executor replays each op from Python, 0.2-0.5 ms on this CPU)."""
    ops = tuple(dataclasses.replace(op, measured_ms=0.0) if fused(op) else op for op in graph.ops)
    return dataclasses.replace(graph, ops=ops, replay_host_ms=0.0)


def recompute_fused(plan: MemoryPlan, graph: TrainingGraph, rerunning_convs: bool = False) -> MemoryPlan:
    """`plan` with every kept map that fused ops make from what the plan keeps (or from maps so made) recomputed:
    compiled, recomputing it is free, and a map that must be saved (`MUST_SAVE`) would keep the partitioner from
    saving the smaller tensors it is recomputed from, as compile's own partitioning does. A map made from one that
    the plan drops and a convolution makes stays kept: recomputing it would run that convolution again (MONAI's
    UNet: a residual unit's sum, whose strided convolution's output nothing else reads). `rerunning_convs`: every
    kept map fused ops make recomputed, convolutions rerun where they must be (a smaller, slower plan)."""
    actions = {t.name: t.action for t in plan.tensors}
    free: dict[str, bool] = {}

    def made_free(storage: str) -> bool:
        if storage not in free:  # (its sources looked at only where fused ops make it: no walk past a convolution)
            ops = graph.producers(storage) if storage in graph.op_index else ()
            sources = {graph.storage_of(i) for op in ops for i in op.inputs} - {storage}
            free[storage] = (
                bool(ops)
                and all(fused(op) for op in ops)
                and (rerunning_convs or all(actions.get(s, "keep") == "keep" or made_free(s) for s in sources))
            )
        return free[storage]

    return _recomputing(plan, {t.name for t in plan.tensors if t.action == "keep" and made_free(t.name)})


def modelled_peak(graph: TrainingGraph, device: DeviceProfile, plan: MemoryPlan) -> int:
    """The eager model's peak of a compiled plan's decisions, as its compiled step takes them (the maps fused ops
    make recomputed: `recompute_fused`), where the eager model can take them (what every plan keeps,
    `TrainingGraph.must_keep`, such as a batch-norm's statistics, kept)."""
    actions = {t.name: t.action for t in plan.tensors if t.name not in graph.must_keep}
    return simulate(graph, device, plan.simulation.costs, actions).peak_bytes


class _Walked(Exception):
    """Raised in place of Inductor's compiling of its generated code, with what the code holds as it runs."""


def _walked_instead_of_codegen(graph: Any, freeable: dict[str, int], codegen: Callable[[Any], Any]) -> Any:
    """`GraphLowering.codegen` stood in for: the wrapper code Inductor generates for the graph (`codegen`, its
    kernels' source written, not compiled) walked for the bytes it holds as it runs (`wrapper_walk`), with its
    inputs named in `freeable` (name: bytes), which the generated code frees after their last use (a backward
    graph's saved activations: AOTAutograd hands them over, `steal_args`); the other inputs are the caller's,
    not counted. Raised with the peak, per graph output whether the graph made it (not one of its inputs), and
    per node running converted layers' kernels the bytes live as it runs and its (layer key, kind) pairs."""
    from torch._inductor.ir import Layout, MutationLayoutSHOULDREMOVE, NonOwningLayout

    # scalar kernels: their source is written in half the vectorised kernels' time, around the same memory lines
    # (HF ResNet-50 at 128 px: 9.1 s against 18.8 s for its two graphs, the same peak)
    with torch._inductor.config.patch({"cpp.simdlen": 1}):
        source = codegen(graph)[0].value
    sizes = {}
    for name, buffer in graph.name_to_buffer.items():
        layout = buffer.get_output_spec()
        if isinstance(layout, Layout) and not isinstance(layout, (NonOwningLayout, MutationLayoutSHOULDREMOVE)):
            sizes[name] = int(layout.storage_size()) * layout.dtype.itemsize  # (static shapes)
    walk = walk_call(source, sizes, freeable)
    outputs = graph.get_output_names()
    calls = [
        (
            max(
                (walk.live_at[b.get_name()] for b in node.get_outputs() if b.get_name() in walk.live_at),
                default=walk.peak,
            ),
            pairs,
        )
        for node in graph.scheduler.nodes
        if (pairs := _kernels_of(node))
    ]
    raise _Walked(walk.peak, [name not in graph.graph_inputs for name in outputs], calls, _strides(graph))


def _strides(graph: Any) -> list[tuple[int, ...] | None]:
    """The strides of the graph's outputs as its generated code lays them out (static sizes), None where not a
    tensor's: what a compile reports to AOTAutograd (`TracingContext.output_strides`), which lays out the backward
    graph's saved inputs so (Inductor's channels-last layout of a convolutional network's maps)."""
    strides: list[tuple[int, ...] | None] = []
    for out in graph.graph_outputs:
        try:
            strides.append(tuple(int(s) for s in out.get_layout().stride))
        except (AttributeError, TypeError, NotImplementedError):  # (not a tensor, or a size not static)
            strides.append(None)
    return strides


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


def _walked(exc: BaseException) -> tuple[int, list[bool], list, list] | None:
    """What an exception carries, where Inductor's wrappers raised it from `_Walked`."""
    while exc is not None:
        if isinstance(exc, _Walked):
            return exc.args[0], exc.args[1], exc.args[2], exc.args[3]
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
    """The forward (False) and backward (True) graphs Inductor would compile for `module`, each with the peak
    of its generated code and, per node running converted layers' kernels, the bytes live while it runs and
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
        GraphLowering.codegen = lambda lowering: _walked_instead_of_codegen(lowering, freeable, codegen)  # type: ignore[method-assign, assignment]
        try:
            compile_fx_inner(gm, example_inputs, **kwargs)
        except Exception as exc:  # (the walk, raised through Inductor's wrappers)
            walked = _walked(exc)
            if walked is None:
                raise
        else:
            raise AssertionError("Inductor compiled its code: the walk did not stand in for its codegen")
        finally:
            GraphLowering.codegen = codegen  # type: ignore[method-assign]
        if not backward:
            made[:] = walked[1]
            context = torch._guards.TracingContext.try_get()
            if context is not None and context.output_strides is not None:  # (as a compile reports them)
                context.output_strides[:] = walked[3]
        graphs[backward] = graph, walked[0], walked[2]
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
    the peaks of its graphs' generated code. The model's state is as it was."""
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
        with state_kept(model), _collecting_only_new_objects():
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


@contextlib.contextmanager
def _collecting_only_new_objects() -> Iterator[None]:
    """The garbage collector's passes during a trace skip the objects alive before it (`gc.freeze`): a trace
    allocates enough to run many full passes, and each walks every object the process holds (one that compiled
    other graphs holds hundreds of thousands). MONAI's 2-D UNet beside 800k objects: 5.3-5.9 s a trace, against
    6.0-6.5. Where the caller froze objects itself, left as it is (unfreezing would undo theirs)."""
    if gc.get_freeze_count():
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


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


def _decisions(plan: MemoryPlan) -> tuple:
    """What a compiled step takes of `plan`: each map's action and each convolution's workspace."""
    return tuple((t.name, t.action) for t in plan.tensors), plan.conv_workspace


def traced_peak(model: nn.Module, key: tuple, plan: MemoryPlan, args: tuple, kwargs: dict, loss: Callable) -> int:
    """`compiled_peak` of `plan`, traced once per model, capture (`key`) and decisions."""
    decisions = (key, *_decisions(plan))
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
    Each eager plan is taken whole two ways (`recompute_fused`): with the maps recomputed that fused ops make from
    what it keeps, then, smaller and slower, with every map fused ops make recomputed, convolutions rerun where they
    must be (MONAI's 2-D UNet: 7.72 MiB, then 7.34 with four strided convolutions rerun). Between the two lie the
    partial ways (`_partial_ways`), which recompute the convolution-rerunning maps one more at a time, tried where
    the first way was traced and misses (`partway`): one that fits is the plan (fewer convolutions rerun: the 2-D
    UNet at compile(0.75)'s 7.67 MiB, 7.41 MiB rerunning one).

    Where neither fits, the next target is the eager model's peak of the plan just traced, lowered by its
    compiled overflow: what the eager model must save for the compiled step to save as much (the limit itself
    would be a poor first guess: the compiled step's peak lies far below the eager model's). A trace costs most of
    a compile, so a plan is traced only where the eager model's peak of its decisions as the compiled step takes
    them (`modelled_peak`: the maps fused ops make recomputed) is below the last traced plan's. Otherwise (the plan
    differs only in maps the compiled step recomputes anyway, or recomputes a convolution whose inputs then live
    longer) the target goes on down by the last traced plan's overflow, a solve each, until the eager planner can
    go no lower. HF MobileNetV2 at compile(0.25)'s 25.13 MiB goes past the fastest's 26.87 to a plan of 23.86 MiB;
    HF ResNet-50 (4, 128) at compile(0.5)'s 231.93 MiB past a plan the eager model finds as large as the fastest
    to one of 231.43 MiB (benchmarks/BENCHMARKS.md, issue 52). The search stops at the first plan that fits, or
    at the first whose compiled peak is no lower than the plan's traced before it: a compiled step's peak does not
    always fall as the plan recomputes more (a recomputed chain can live from the backward graph's start), so
    lowering the target further costs traces and finds nothing. The first that fits, else the one of least peak."""
    from ucudnn.memory.planner import EXECUTED_ROUNDS

    made: list[MemoryPlan] = []  # the plans traced that the search follows: each eager plan taken one whole way
    tried: dict[tuple, MemoryPlan] = {}  # the partial ways traced (`_partial_ways`), by decisions
    target = None  # (None: no limit)
    asked: set[int | None] = set()
    last_taken = 0  # the eager model's peak of the last traced plan's decisions, as its compiled step takes them

    def traced(plan: MemoryPlan) -> MemoryPlan:
        peak = peak_of(plan)
        return dataclasses.replace(plan, peak_bytes=peak, fits=peak <= limit)

    def spent() -> bool:
        return len(made) + len(tried) > EXECUTED_ROUNDS  # (each trace most of a compile)

    def last() -> bool:
        """Whether the plans traced end the search: the last fits, or recomputing more did not lower the compiled
        peak (nor will lowering the target), or the traces are spent."""
        fell = len(made) == 1 or made[-1].peak_bytes < made[-2].peak_bytes
        return made[-1].fits or not fell or spent()

    def follow(plan: MemoryPlan) -> bool:
        """Trace a whole way of an eager plan where the eager model finds it below the last traced: whether traced."""
        nonlocal last_taken
        taken = modelled_peak(plan)  # (the eager model's peak of its decisions as the compiled step takes them)
        if made and taken >= last_taken:
            return False
        last_taken = taken
        made.append(traced(plan))
        return True

    def partway(free: MemoryPlan, rerunning: MemoryPlan) -> MemoryPlan | None:
        """The first partial way between an eager plan's two whole ways that fits, where `free`, just traced,
        missed. A way is traced only where `free`'s traced peak, lowered by the eager model's difference between
        the two, fits; one that misses leaves the search as it was."""
        for plan in _partial_ways(free, rerunning, modelled_peak):
            lowered = made[-1].peak_bytes - (last_taken - modelled_peak(plan))
            if lowered > limit or _decisions(plan) in tried:
                continue
            tried[_decisions(plan)] = way = traced(plan)
            if way.fits:
                return way
            if spent():
                break
        return None

    # plans asked of the eager planner, a solve each, traced or not: a lowered target often changes only what the
    # compiled step recomputes anyway
    for _ in range(4 * (EXECUTED_ROUNDS + 1)):
        if target in asked:
            break  # (the eager planner can go no lower: its plan at the last target was the one before)
        asked.add(target)
        eager = make(_NO_LIMIT if target is None else target)
        eager = dataclasses.replace(eager, capture=step, memory_limit=limit, compiled=True)
        free, rerunning = recompute_fused(eager, graph), recompute_fused(eager, graph, rerunning_convs=True)
        if follow(free):
            if last():
                break
            if (partial := partway(free, rerunning)) is not None:
                return partial
            if spent():
                break
        if _decisions(rerunning) != _decisions(free) and follow(rerunning) and last():
            break
        target = max(1, eager.peak_bytes - (made[-1].peak_bytes - limit))  # lower the target on, a solve each
    return next((p for p in made if p.fits), min([*made, *tried.values()], key=lambda p: p.peak_bytes))


def _partial_ways(
    free: MemoryPlan, rerunning: MemoryPlan, modelled_peak: Callable[[MemoryPlan], int]
) -> list[MemoryPlan]:
    """The ways a compiled step may take an eager plan between its two whole ways (`recompute_fused`): `free`,
    rerunning no convolution, with the maps that `rerunning` recomputes, each rerunning a convolution, recomputed
    one more at a time, the map the eager model finds lowest alone first. MONAI's 2-D UNet at compile(0.75)'s
    7.67 MiB: 7.72 MiB rerunning none, 7.41 rerunning one (the map its eager model finds lowest), 7.34 rerunning
    four, every one."""
    maps = [t.name for t, r in zip(free.tensors, rerunning.tensors, strict=True) if t.action != r.action]
    if len(maps) < 2:
        return []  # (of one map, the one way is `rerunning`)
    maps.sort(key=lambda name: modelled_peak(_recomputing(free, {name})))
    return [_recomputing(free, set(maps[:n])) for n in range(1, len(maps))]


def _recomputing(plan: MemoryPlan, names: set[str]) -> MemoryPlan:
    """`plan` with the maps `names` recomputed."""
    tensors = tuple(dataclasses.replace(t, action="recompute") if t.name in names else t for t in plan.tensors)
    return dataclasses.replace(plan, tensors=tensors)
