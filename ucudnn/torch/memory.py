"""Memory plans in PyTorch training: offload saved feature maps to the host, prefetch them ahead of the
backward pass, recompute dropped ones, and give converted convolutions their planned workspace.

    plan = ucudnn.torch.plan_memory(model, example_input, memory_limit="2GiB", policy="optimal")
    with ucudnn.torch.execute_plan(model, plan) as run:
        loss = criterion(model(x), y)
        loss.backward()
    optimizer.step()

This module runs a plan (`execute_plan`). Making one is `ucudnn.torch.planning` (`plan_memory` and
`measure_profile` stay importable from here); the offload and prefetch copies and their saved-tensor
hooks are `ucudnn.torch.offload`, recomputation `ucudnn.torch.recompute`.

**Running the model.** Inside the block, `model.forward` is replaced by a loop over the model's
`torch.fx` graph (the same trace the planner named its tensors after), so that the executor knows
which fx node is running. fx's own `Interpreter` runs a whole graph in one call; the loop here is
hand-written because the executor acts between nodes (tagging each output, saving what a
recomputation will read). It frees each value after its last use, as the Interpreter does. Inputs
bind to the graph's placeholders as Python binds a call's arguments: by position, by keyword, else
the parameter's default.

**Prepared once.** The fx graph, each value's last use, the plan's check per input shape (a traced,
shape-propagating forward pass) and the host buffers belong to the (model, plan) pair: they are made
at its first `execute_plan` and reused by later blocks (kept weakly with the model, for its latest
plans), so a training step under a plan does only the step's work. A model whose modules changed
since (a layer replaced) is prepared and checked again.

**Which plan tensor a saved tensor is.** `saved_tensors_hooks` see tensors, not names. A plan's
tensors are *storages* (an in-place op or a view writes into its input's memory: the planner names
that memory after the node that first made it). So every node's output is tagged by its storage:
the storage's address maps to the plan name and a weak reference to the storage object (the
reference dies with the storage, so an address that the allocator hands out again is not mistaken
for the old tensor). A node whose output lives in an already tagged, live storage (``relu_``,
``flatten``) leaves the tag as it is. A saved tensor is then attributed, in `pack`, to: nothing
(parameters and buffers: never moved); the tagged storage it lives in; else the node running at
that moment (its own result, saved before the node returns, and internals such as max-pool
indices follow that node's action).

**Offload and prefetch**: see `ucudnn.torch.offload`. **Recompute**: see `ucudnn.torch.recompute`.

**Release** needs no action: PyTorch frees what the backward pass does not save. A tensor planned
``release`` that autograd does save is kept (it must be) and named in `ExecutionStats.kept_released`.

**Workspaces.** Each `ucudnn.torch.Conv2d` whose layer has ``conv_workspace`` entries in the plan
runs each kernel, inside the block, with its own handle's fastest configuration within that
kernel's budget (`Handle.kernel(..., budget=...)`), its workspace held for that run only, as the
plan counts it. `plan_memory` on a converted model takes each converted kernel's options from its
handle (`Handle.front`), so the budgets are ones those kernels can run within.

**Checks.** The plan must come from this model at this batch: at the first forward call for an
input shape, the model is traced with its first input, the others at their defaults
(`ucudnn.memory.graph.trace`, in eval mode so that no running statistics move), and the plan's
tensors must be the traced graph's storages with the same bytes, and its batch the input's; conv
workspace layers must be convs of the model. Anything else is `InvalidInput` saying what differs.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx, nn

from ucudnn.errors import InvalidInput, UnsupportedProblem
from ucudnn.memory.plan import MemoryPlan
from ucudnn.torch.conv import Conv2d
from ucudnn.torch.offload import _copier_for, _HostBuffers, _Offloaded, _OffloadHooks, _Pass, _PrefetchHook
from ucudnn.torch.planning import _fingerprint, _trace_graph, _Tracer, measure_profile, plan_memory
from ucudnn.torch.recompute import _Dropped, _programs, _Programs, _Rebuilds, _Recompute

__all__ = ["ExecutionStats", "execute_plan", "measure_profile", "plan_memory"]


# ---- what a run did ------------------------------------------------------------------------------
@dataclass
class ExecutionStats:
    """What `execute_plan` did, summed over the forward and backward passes run in its block.
    `recomputed` counts the storages rebuilt in backward passes.

    `events` is the order of copies and uses: ``("offload", name)``, ``("prefetch", name)`` and
    ``("unpack", name)``.
    """

    offloaded: int = 0
    bytes_offloaded: int = 0
    prefetched: int = 0
    late_prefetches: int = 0
    recomputed: int = 0
    host_buffers_allocated: int = 0
    kept_released: set[str] = field(default_factory=set)
    events: list[tuple[str, str]] = field(default_factory=list)


# ---- the executor --------------------------------------------------------------------------------
class _Prepared:
    """What running a model under a plan needs that stays the same from step to step: the fx graph,
    each value's last use, the checked input shapes and their recompute programs, the conv budgets,
    and the copiers with their host buffers. Holds the model's modules, not the model (see `_prepared`)."""

    def __init__(self, model: nn.Module, plan: MemoryPlan) -> None:
        self.plan, self.fingerprint = plan, _fingerprint(model)
        try:
            self.gm = fx.GraphModule(model, _Tracer().trace(model))
        except Exception as exc:  # fx raises many kinds (TraceError, TypeError on data-dependent control flow)
            raise UnsupportedProblem(f"torch.fx cannot trace {type(model).__name__}: {exc}") from None
        self.nodes = list(self.gm.graph.nodes)
        self.index = {n.name: i for i, n in enumerate(self.nodes)}
        self.modules = dict(self.gm.named_modules())
        self.placeholders = [n for n in self.nodes if n.op == "placeholder"]
        self.actions = {t.name: t.action for t in plan.tensors}
        self._check_workspace_layers(type(model).__name__)
        self.shapes_checked: dict[tuple, _Programs] = {}  # input shape -> its recompute programs
        # last use of each value, as fx.Interpreter computes it: free a value after its last reader
        self.last_use: dict[int, list[fx.Node]] = {}
        seen: set[fx.Node] = set()
        for i in range(len(self.nodes) - 1, -1, -1):
            for arg in self.nodes[i].all_input_nodes:
                if arg not in seen:
                    seen.add(arg)
                    self.last_use.setdefault(i, []).append(arg)
        self.copies: dict[torch.device, tuple[Any, _HostBuffers]] = {}

    def _check_workspace_layers(self, model_name: str) -> None:
        convs = {n.name: self.modules[n.target] for n in self.nodes
                 if n.op == "call_module" and isinstance(self.modules[n.target], nn.Conv2d)}
        unknown = sorted({c.layer for c in self.plan.conv_workspace} - set(convs))
        if unknown:
            raise InvalidInput(f"plan for {self.plan.network!r} gives workspace to conv layer(s) "
                               f"{', '.join(unknown[:5])} that {model_name} does not have; "
                               "a plan made for another model?")
        self.conv_budgets: dict[str, dict[str, int]] = {}
        for c in self.plan.conv_workspace:
            self.conv_budgets.setdefault(c.layer, {})[c.kind] = c.bytes
        self.convs = convs

    def check_input(self, model: nn.Module, x: Any) -> _Programs:
        """The recompute programs for input `x` (by storage); traces `model` once per shape."""
        if not isinstance(x, torch.Tensor):
            raise InvalidInput(f"execute_plan runs models whose first input is a tensor, got {type(x).__name__}")
        key = (tuple(x.shape), x.dtype)
        if key in self.shapes_checked:
            return self.shapes_checked[key]
        plan, name = self.plan, type(model).__name__
        if x.shape[0] != plan.batch:
            raise InvalidInput(f"the plan was made for batch {plan.batch}, the input has batch {x.shape[0]}; "
                               "make a plan for this batch (plan_memory)")
        graph = _trace_graph(model, x)
        storages = {s: graph.bytes_of(s) for s in graph.storages}
        unknown = sorted(set(self.actions) - set(storages))
        if unknown:
            raise InvalidInput(f"plan for {plan.network!r} names tensor(s) {', '.join(unknown[:5])} that "
                               f"{name} does not produce; a plan made for another model?")
        wrong = [(t.name, t.bytes, storages[t.name]) for t in plan.tensors if storages[t.name] != t.bytes]
        if wrong:
            t, planned, actual = wrong[0]
            raise InvalidInput(f"plan for {plan.network!r}: tensor {t} has {planned} bytes in the plan but "
                               f"{actual} with input shape {tuple(x.shape)}; a plan made for another input size?")
        programs = _programs(graph, plan, self.nodes)
        self.shapes_checked[key] = programs
        return programs

    def copies_for(self, device: torch.device) -> tuple[Any, _HostBuffers]:
        """The copier for `device` and its host buffers, made at the first offload to the host."""
        if device not in self.copies:
            copier = _copier_for(device)
            self.copies[device] = copier, _HostBuffers(pin=copier.pin)
        return self.copies[device]


# model -> {plan: _Prepared}, the latest plans last. Weak on the model: its prepared runs (graphs, host
# buffers) go with it. Preparing costs an fx trace and, per input shape, a shape-propagating forward
# pass (the plan's check): once per (model, plan), not once per step.
_PREPARED: weakref.WeakKeyDictionary[nn.Module, dict[MemoryPlan, _Prepared]] = weakref.WeakKeyDictionary()
_PLANS_PER_MODEL = 2


def _prepared(model: nn.Module, plan: MemoryPlan) -> _Prepared:
    """The prepared run of `model` under `plan`: the cached one while the model's modules are the same."""
    plans = _PREPARED.setdefault(model, {})
    prep = plans.pop(plan, None)
    if prep is None or prep.fingerprint != _fingerprint(model):
        prep = _Prepared(model, plan)
    plans[plan] = prep
    while len(plans) > _PLANS_PER_MODEL:
        del plans[next(iter(plans))]
    return prep


class _Executor(_OffloadHooks, _Recompute):
    """One `execute_plan` block: runs the prepared graph, names saved tensors and keeps, offloads or
    drops each as the plan says."""

    def __init__(self, model: nn.Module, prep: _Prepared, prefetch_ahead: int) -> None:
        self.model, self.prep, self.prefetch_ahead = model, prep, prefetch_ahead
        self.stats = ExecutionStats()
        self.params = {p.untyped_storage().data_ptr() for p in list(model.parameters()) + list(model.buffers())}
        self.tags: dict[int, tuple[str, weakref.ref]] = {}
        self.current: int | None = None  # the node (or segment's last node) running in the forward pass
        self.forward_running = False
        self.copier: Any = None
        self.buffers: _HostBuffers | None = None
        self.pending: list[tuple[Any, torch.Tensor]] = []  # device tensors whose host copy may be in flight
        self.pass_: _Pass | None = None

    # -- the forward pass ---------------------------------------------------------------------------
    def _bind(self, args: tuple, kwargs: dict) -> dict[fx.Node, Any]:
        """The value of each input (fx placeholder) as Python binds the call's arguments."""
        holders, name = self.prep.placeholders, type(self.model).__name__
        if len(args) > len(holders):
            raise InvalidInput(f"{name}.forward takes {len(holders)} input(s), {len(args)} were given")
        values = dict(zip(holders, args))
        by_name = {n.target: n for n in holders}
        for key, value in kwargs.items():
            node = by_name.get(key)
            if node is None:
                raise InvalidInput(f"{name}.forward has no input named {key!r}; its inputs: "
                                   f"{', '.join(n.target for n in holders)}")
            if node in values:
                raise InvalidInput(f"{name}.forward got input {key!r} twice (by position and by keyword)")
            values[node] = value
        for node in holders:
            if node not in values:
                if not node.args:
                    raise InvalidInput(f"{name}.forward is missing input {node.target!r}")
                values[node] = node.args[0]  # the parameter's default
        return values

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        inputs = self._bind(args, kwargs)
        prep = self.prep
        programs = prep.check_input(self.model, inputs[prep.placeholders[0]] if prep.placeholders else None)
        self.pass_, self.rebuilds = _Pass(), _Rebuilds(programs)
        self.forward_running = True
        try:
            env: dict[fx.Node, Any] = {}
            for i, node in enumerate(prep.nodes):
                if node.op == "placeholder":
                    env[node] = inputs[node]
                    self._tag(node, env[node], i)
                elif node.op == "output":
                    self._release(None)
                    return fx.node.map_arg(node.args[0], env.__getitem__)
                else:
                    self.current = i
                    self._before_node(node)
                    env[node] = self._run_node(node, env, recomputing=False)
                    self._tag(node, env[node], i)
                    self._after_node(node, env)
                for dead in prep.last_use.get(i, ()):
                    env.pop(dead, None)
                self._release(env)
            return None
        finally:
            self.forward_running = False
            self.current = None

    def _run_node(self, node: fx.Node, env: dict, recomputing: bool) -> Any:
        args = fx.node.map_arg(node.args, env.__getitem__)
        kwargs = fx.node.map_arg(node.kwargs, env.__getitem__)
        if node.op == "call_module":
            module = self.prep.modules[node.target]
            if recomputing and isinstance(module, nn.modules.batchnorm._BatchNorm) and module.training:
                # The forward pass has updated the running statistics: run the layer as it ran then
                # (normalising with the batch's statistics) and put the statistics back afterwards.
                before = [b.clone() for b in module.buffers(recurse=False)]
                try:
                    return module(*args, **kwargs)
                finally:
                    with torch.no_grad():
                        for b, old in zip(module.buffers(recurse=False), before):
                            b.copy_(old)
            return module(*args, **kwargs)
        if node.op == "call_function":
            return node.target(*args, **kwargs)
        if node.op == "call_method":
            return getattr(args[0], node.target)(*args[1:], **kwargs)
        if node.op == "get_attr":
            return _fetch_attr(self.prep.gm, node.target)
        raise UnsupportedProblem(f"fx node {node.name}: op {node.op!r} is not supported")

    # -- saved-tensor hooks ---------------------------------------------------------------------------
    def pack(self, t: torch.Tensor) -> Any:
        if not self.forward_running or t.numel() == 0:
            return t
        name, tagged = self._name_of(t)
        action = self.prep.actions.get(name, "keep") if name is not None else "keep"
        if action == "offload":
            return self._offload(name, t)
        if action == "recompute" and name in self.rebuilds.programs.by_storage:
            return self._drop(name, t, tagged)
        if action == "release":
            self.stats.kept_released.add(name)
        # detached: autograd would hold the tensor object, and through its grad_fn (an op saving its
        # own output) itself, a cycle the garbage collector cannot see into when no backward frees it
        return t.detach()

    def unpack(self, saved: Any) -> torch.Tensor:
        if isinstance(saved, _Offloaded):
            return self._fetch(saved)
        if isinstance(saved, _Dropped):
            return self._unpack_dropped(saved)
        return saved

    # -- naming saved tensors ------------------------------------------------------------------------
    def _tag(self, node: fx.Node, value: Any, i: int) -> None:
        if not isinstance(value, torch.Tensor):
            return
        storage = value.untyped_storage()
        ptr = storage.data_ptr()
        known = self.tags.get(ptr)
        if known is None or known[1]() is not storage:  # a new storage (not an in-place result or a view)
            self.tags[ptr] = (node.name, weakref.ref(storage))
        if value.requires_grad:
            value.register_hook(_PrefetchHook(self, self.pass_, i))

    def _name_of(self, t: torch.Tensor) -> tuple[str | None, bool]:
        """The plan name `t` is saved under, and whether that is its tagged storage's: the tagged
        storage's name, else the running node's (its own result, or an internal); None: a parameter."""
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr in self.params:
            return None, False
        known = self.tags.get(ptr)
        if known is not None and known[1]() is storage:
            return known[0], True
        if self.forward_running and self.current is not None:
            return self.prep.nodes[self.current].name, False
        return None, False

    # -- workspaces ---------------------------------------------------------------------------------
    @contextlib.contextmanager
    def workspaces(self) -> Iterator[None]:
        """Each converted conv runs its kernels within the plan's budgets (its handle's fastest
        configuration within each; the same dict object each step, so its routes are kept)."""
        saved: list[tuple[Conv2d, dict | None]] = []
        try:
            for layer, budgets in self.prep.conv_budgets.items():
                conv = self.prep.convs[layer]
                if not isinstance(conv, Conv2d):
                    continue  # torch's own conv: its workspace is torch's business
                saved.append((conv, conv._budgets))
                conv._budgets = budgets
            yield
        finally:
            for conv, budgets in saved:
                conv._budgets = budgets


def _fetch_attr(module: nn.Module, target: str) -> Any:
    value: Any = module
    for part in target.split("."):
        value = getattr(value, part)
    return value


@contextlib.contextmanager
def execute_plan(model: nn.Module, plan: MemoryPlan, *, prefetch_ahead: int = 1) -> Iterator[ExecutionStats]:
    """Run the forward and backward passes in this block under `plan`; yields the `ExecutionStats`.

    Call the model (positional and keyword inputs) and `backward()` inside the block (see the module
    docstring for what happens); a training loop enters one block per step, and only the first block
    of a (model, plan) pair traces and checks the model. `prefetch_ahead`: how many offloaded tensors
    beyond those the current backward step needs are fetched ahead. A plan made for another model,
    batch or input size raises `InvalidInput` (the model at enter, the batch and sizes at the first
    forward call).
    """
    if not isinstance(model, nn.Module):
        raise InvalidInput(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(plan, MemoryPlan):
        raise InvalidInput(f"plan must be a ucudnn.memory.MemoryPlan, got {type(plan).__name__}")
    if isinstance(prefetch_ahead, bool) or not isinstance(prefetch_ahead, int) or prefetch_ahead < 0:
        raise InvalidInput(f"prefetch_ahead must be a non-negative integer, got {prefetch_ahead!r}")
    executor = _Executor(model, _prepared(model, plan), prefetch_ahead)
    had_forward = "forward" in model.__dict__
    previous = model.__dict__.get("forward")
    model.forward = executor.forward
    try:
        with executor.workspaces(), torch.autograd.graph.saved_tensors_hooks(executor.pack, executor.unpack):
            yield executor.stats
    finally:
        if had_forward:
            model.forward = previous
        else:
            del model.forward
