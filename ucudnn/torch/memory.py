"""Memory plans in PyTorch training: offload saved feature maps to the host, prefetch them ahead of the
backward pass, recompute dropped ones, and give converted convolutions their planned workspace.

    plan = ucudnn.torch.plan_memory(model, example_input, memory_limit="2GiB", policy="optimal")
    with ucudnn.torch.execute_plan(model, plan) as run:
        loss = criterion(model(x), y)
        loss.backward()
    optimizer.step()

This module runs a plan (`execute_plan`). Making one is `ucudnn.torch.planning` (`plan_memory` and
`measure_profile` stay importable from here); the offload and prefetch copies are `ucudnn.torch.offload`,
recomputation `ucudnn.torch.recompute`.

**Following the captured step, at the tensors the plan acts on.** A plan names the feature maps of a
captured step (`ucudnn.torch.capturing`), which also recorded, in order, every tensor autograd saved in
the model's forward pass (`CapturedStep.saves`). Inside the block the model's forward and backward passes
are PyTorch's own; `saved_tensors_hooks` see each save, and the k-th save of the forward pass is the
captured step's k-th: its feature map and action come from a table made once per plan (no lookup by
storage, no walk over modules). A kept save returns the tensor; an offloaded one is copied out, a dropped
one leaves a handle. Each save's shape and dtype must be the captured one's, and the forward pass must
save as many: else the step is refused in one line (`UnsupportedProblem`: its control flow depends on its
data, or the model changed). A dropped map's save must moreover be the storage its producer made.

Operations are seen only where a map is dropped: its program (`ucudnn.torch.recompute`) replays the
captured operations that made it with the arguments they ran with, so the module calls that run those
operations (as captured: `CapturedStep.calls`) are followed by a dispatch mode, op by op against the
captured ones (a convolution may be torch's or a converted layer's), from the call's start up to the last
such operation (a hook on the next module call stops the mode); where such an operation runs in the
model's own forward (outside every submodule), the forward pass is, from its start. Converted convolutions run
as ucudnn's operator (`through_operators`) only inside the followed calls, as the mode saw them captured;
elsewhere they run their own eager routes (the operator's dispatch costs host time per call). The loss runs
outside the model's forward pass: what it saves is kept. What a step cost in Python is counted in
`ExecutionStats` (`hook_calls`, `acting_calls`, `followed_ops`).

**Acting on nothing costs nothing.** A plan that keeps every map autograd saves (its actions are keep
and release) needs no mode and no hooks: the block checks the inputs and gives the convolutions their
budgets, and the step is the plain step.

**Prepared once.** The plan's check against the model, the saves' actions, the followed module calls,
its recompute programs, the conv budgets and the host buffers belong to the (model, plan) pair: made at
its first `execute_plan` and reused by later blocks (kept weakly with the model, for its latest plans;
a module replaced since is seen by comparing each module's children, not by walking names). A plan
without its captured step (read from JSON) captures the model at the first forward call and is checked
against that capture.

**Offload and prefetch**: see `ucudnn.torch.offload`. **Recompute**: see `ucudnn.torch.recompute`.

**Release** needs no action: PyTorch frees what the backward pass does not save. A tensor planned
``release`` that autograd does save is kept (it must be) and named in `ExecutionStats.kept_released`.

**Workspaces.** Each converted convolution (`ucudnn.torch.layer.ConvLayer`) whose layer has
``conv_workspace`` entries in the plan runs each kernel, inside the block, with its own handle's fastest
configuration within that kernel's budget (`Handle.kernel(..., budget=...)`), its workspace held for that
run only, as the plan counts it. `plan_memory` on a converted model takes each converted kernel's options
from its handle (`Handle.front`), so the budgets are ones those kernels can run within.
"""

from __future__ import annotations

import bisect
import contextlib
import functools
import importlib
import inspect
import operator
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from ucudnn.errors import InvalidInput, UnsupportedProblem
from ucudnn.memory.plan import MemoryPlan
from ucudnn.torch.capturing import CapturedStep, _tensors, capture, diverged, input_leaves, structure
from ucudnn.torch.operations import counted, same_op
from ucudnn.torch.layer import ConvLayer, through_operators
from ucudnn.torch.offload import _copier_for, _HostBuffers, _Offloaded, _OffloadHooks, _Pass, _PrefetchHook, copier_kind
from ucudnn.torch.recompute import _Dropped, _Rebuilds, _Recompute, programs_for

__all__ = ["ExecutionStats", "execute_plan", "measure_profile", "plan_memory"]


def __getattr__(name: str) -> Any:
    """`plan_memory` and `measure_profile`, importable from here as they were, resolved on first use: planning
    measures what this executor costs (`ucudnn.torch.replay_cost`), so this module does not import it."""
    if name in ("measure_profile", "plan_memory"):
        return getattr(importlib.import_module("ucudnn.torch.planning"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# ---- what a run did ------------------------------------------------------------------------------
@dataclass
class ExecutionStats:
    """What `execute_plan` did, summed over the forward and backward passes run in its block.
    `recomputed` counts the storages rebuilt in backward passes.

    `events` is the order of copies and uses: ``("offload", name)``, ``("prefetch", name)`` and
    ``("unpack", name)``.

    What the executor's Python cost: `hook_calls` counts every call of its hooks (each tensor autograd
    saves or unpacks in the model's forward and backward passes, the model's forward hooks, the module hooks
    where a recomputed map is made, the backward pass's first prefetch), `acting_calls` those that did
    something (offload, drop, fetch, rebuild, follow a module call), `followed_ops` the operations the
    dispatch mode saw inside the module calls it followed.
    """

    offloaded: int = 0
    bytes_offloaded: int = 0
    prefetched: int = 0
    late_prefetches: int = 0
    recomputed: int = 0
    host_buffers_allocated: int = 0
    kept_released: set[str] = field(default_factory=set)
    events: list[tuple[str, str]] = field(default_factory=list)
    hook_calls: int = 0
    acting_calls: int = 0
    followed_ops: int = 0


# ---- the (model, plan) pair, prepared ----------------------------------------------------------------
class _Prepared:
    """What running a model under a plan needs that stays the same from step to step: the captured step
    and the plan checked against it, each save's action, the modules where recomputed maps are made, the
    recompute programs, the conv budgets, and the copiers with their host buffers. Holds no reference to
    the model itself (see `_prepared`)."""

    def __init__(self, model: nn.Module, plan: MemoryPlan) -> None:
        self.plan, self.tree = plan, _tree(model)
        self.structure = structure(model)
        self.actions = {t.name: t.action for t in plan.tensors}
        self.step: CapturedStep | None = None
        self.copies: dict[tuple[torch.device, str], tuple[Any, _HostBuffers]] = {}
        self.forward: Any = None  # the model's forward function and its signature (`signature_of`)
        self.signature: inspect.Signature | None = None
        if plan.capture is not None:
            if plan.capture.structure != self.structure:
                raise InvalidInput(f"plan for {plan.network!r} was captured from another model ("
                                   f"{type(model).__name__} has other modules); plan this model (plan_memory)")
            self._adopt(model, plan.capture)

    def ready(self, model: nn.Module, args: tuple, kwargs: dict) -> CapturedStep:
        """The captured step, captured now (on fake tensors) where the plan came without one."""
        if self.step is None:
            self._adopt(model, capture(model, _example(args, kwargs), name=self.plan.network), check=True)
        return self.step

    def _adopt(self, model: nn.Module, step: CapturedStep, check: bool = False) -> None:
        plan, graph, name = self.plan, step.graph, type(model).__name__
        if check:  # a plan read back: its maps must be this model's (the loss's may differ)
            storages = {s: graph.bytes_of(s) for s in graph.storages}
            unknown = sorted(t for t in self.actions if t not in storages and not t.startswith("loss:"))
            if unknown:
                raise InvalidInput(f"plan for {plan.network!r} names tensor(s) {', '.join(unknown[:5])} that {name} "
                                   "does not produce; a plan made for another model?")
            wrong = [(t.name, t.bytes, storages[t.name]) for t in plan.tensors
                     if t.name in storages and storages[t.name] != t.bytes]
            if wrong:
                t, planned, actual = wrong[0]
                raise InvalidInput(f"plan for {plan.network!r}: tensor {t} has {planned} bytes in the plan but "
                                   f"{actual} in this step; a plan made for another input size?")
        modules = dict(model.named_modules())
        ops = {op.name: op for op in graph.conv_ops}
        unknown = sorted({c.layer for c in plan.conv_workspace} - set(ops))
        if unknown:
            raise InvalidInput(f"plan for {plan.network!r} gives workspace to conv layer(s) {', '.join(unknown[:5])} "
                               f"that {name} does not have; a plan made for another model?")
        self.budgets: list[tuple[ConvLayer, dict[str, int]]] = []
        by_module: dict[str, dict[str, int]] = {}
        for c in plan.conv_workspace:
            kinds = by_module.setdefault(ops[c.layer].module, {})
            kinds[c.kind] = min(kinds.get(c.kind, c.bytes), c.bytes)  # a module called twice: both budgets hold
        for module, kinds in by_module.items():
            conv = modules.get(module)
            if isinstance(conv, ConvLayer):  # torch's own conv: its workspace is torch's business
                self.budgets.append((conv, kinds))
        self.convs = [m for m in modules.values() if isinstance(m, ConvLayer)]
        self.params = {p.untyped_storage()._cdata for p in model.parameters()}  # passed as they are to a replay
        backward = {r for s in graph.steps if s.phase == "bwd" for r in s.reads}
        self.acting = any(a in ("offload", "recompute") or (a == "release" and t in backward)
                          for t, a in self.actions.items())
        self.programs = programs_for(step, self.actions)
        self.programs_at: dict[int, tuple[str, ...]] = {}  # op -> the storages whose programs it is in
        for p in self.programs.values():
            for i in p.ops:
                self.programs_at[i] = (*self.programs_at.get(i, ()), p.storage)
        self.offloading = "offload" in self.actions.values()
        self.saves = tuple((name, torch.Size(shape), dtype, op, self._action(name))
                           for name, shape, dtype, op in step.saves)
        # autograd saves these maps: kept (it must), and named in the stats
        self.kept_released = {name for name, *_ in step.saves if self.actions.get(name) == "release"}
        offloaded = {name for name, *_, action in self.saves if action == "offload"}
        last_reads = [step.last_read[name] for name in offloaded if name in step.last_read]
        self.root, self.scopes = _scopes(step, self.saves, self.programs_at, last_reads)
        self.scoped = [(name, modules[name]) for name in self.scopes]  # hooked in each block
        stops = [scope.stop for scope in (self.root, *(s for calls in self.scopes.values() for s in calls.values()))
                 if scope is not None and scope.stop is not None]
        self.stops = {name: modules[name] for name in stops}  # hooked while a call is followed
        self.step = step

    def _action(self, name: str | None) -> str | None:
        """What a save of feature map `name` does (None: it is kept as it is)."""
        action = self.actions.get(name, "keep") if name is not None else "keep"
        if action == "recompute" and name not in self.programs:
            return None
        return None if action == "keep" else action

    def signature_of(self, model: nn.Module) -> inspect.Signature | None:
        """The signature of the model's forward, made once per forward function (None: it has none)."""
        forward = model.forward
        function = getattr(forward, "__func__", forward)
        if function is not self.forward:
            self.forward = function
            try:
                self.signature = inspect.signature(forward)
            except (TypeError, ValueError):
                self.signature = None
        return self.signature

    def copies_for(self, device: torch.device) -> tuple[Any, _HostBuffers]:
        """The copier for `device` (`late_copies` may choose another on the CPU) and its host buffers, made at
        the first offload to the host."""
        key = device, copier_kind(device)
        if key not in self.copies:
            copier = _copier_for(device)
            self.copies[key] = copier, _HostBuffers(pin=copier.pin)
        return self.copies[key]


@dataclass(frozen=True, slots=True)
class _Scope:
    """A module call where the executor acts: its saves go through the saved-tensor hooks (the `save`-th
    of the forward pass first), and, where a recompute program replays one of its operations, its operations
    through the dispatch mode (`follow`; the `op`-th first, up to the `last`-th, the last a program replays
    that runs in it outside its submodules, and until `stop`, the module whose call is the first after
    that one, where there is one). `end`: the operations run when it returns."""

    op: int
    save: int
    end: int
    follow: bool
    last: int = -1
    stop: str | None = None


def _scopes(step: CapturedStep, saves: tuple, programs_at: dict[int, tuple[str, ...]], last_reads: list[int]
            ) -> tuple[_Scope | None, dict[str, dict[int, _Scope]]]:
    """Where the executor acts (see `_Scope`): the module calls that save a tensor the plan offloads or drops,
    run an operation a recompute program replays, or read an offloaded map last (its device copy goes once
    the call returns), as {module: {call number: scope}}; and the model's own call, where one of those
    operations runs outside every submodule (then the whole forward pass is a scope; else None)."""
    calls: dict[str, list[tuple[str, int, int, int]]] = {}
    for call in step.calls:
        calls.setdefault(call[0], []).append(call)
    wanted: dict[tuple[str, int] | None, bool] = {}  # (module, call number), None for the model's -> follow
    last: dict[tuple[str, int] | None, int] = {}     # -> the last operation a program replays there

    def want(op: int, follow: bool) -> None:
        module = step.ops[op].module
        starts = [c[1] for c in calls.get(module, ())]
        k = bisect.bisect_right(starts, op) - 1
        key = None if k < 0 or calls[module][k][3] <= op else (module, k)  # None: the model's own forward runs it
        wanted[key] = wanted.get(key, False) or follow
        if follow:
            last[key] = max(last.get(key, -1), op)

    for i in programs_at:
        want(i, True)
    for name, _, _, op, action in saves:
        if action in ("offload", "recompute"):
            want(op, False)
    for op in last_reads:
        want(op, False)
    starts = [call[1] for call in step.calls]  # (in call order: by first operation)

    def stop(op: int, end: int) -> str | None:
        """The module of the first call after operation `op` that starts before `end`."""
        i = bisect.bisect_right(starts, op)
        return step.calls[i][0] if op >= 0 and i < len(starts) and starts[i] < end else None

    scopes: dict[str, dict[int, _Scope]] = {}
    for key, follow in wanted.items():
        if key is not None:
            _, start, saved, end = calls[key[0]][key[1]]
            op = last.get(key, -1)
            scopes.setdefault(key[0], {})[key[1]] = _Scope(start, saved, end, follow, op, stop(op, end))
    op = last.get(None, -1)
    root = None if None not in wanted else _Scope(0, 0, step.model_ops, wanted[None], op, stop(op, step.model_ops))
    return root, scopes


def _tree(model: nn.Module) -> tuple:
    """What a prepared run rests on: the model's modules, each with its children (by name and identity)
    and class. Checked in two list comparisons per step, without walking the model (and without a list per
    module, which would wake the garbage collector): where every module kept has the same children as
    when prepared, the tree is the same."""
    modules = list(model.modules())[1:]  # (not the model: the prepared run would keep it alive)
    return type(model), dict(model._modules), modules, list(map(type, modules)), [dict(m._modules) for m in modules]


_CHILDREN = operator.attrgetter("_modules")


def _same_tree(model: nn.Module, tree: tuple) -> bool:
    root_type, root, modules, types, children = tree
    return (type(model) is root_type and model._modules == root and list(map(type, modules)) == types
            and list(map(_CHILDREN, modules)) == children)


def _example(args: tuple, kwargs: dict) -> Any:
    """A call's arguments as `capture` takes an example."""
    if kwargs and args:
        raise InvalidInput("a plan without its captured step (read from JSON) is captured at the first call, "
                           "which must pass its inputs all by position or all by keyword")
    return kwargs if kwargs else args


# model -> {plan: _Prepared}, the latest plans last. Weak on the model: its prepared runs (host buffers)
# go with it. Preparing costs the plan's check: once per (model, plan), not once per step.
_PREPARED: weakref.WeakKeyDictionary[nn.Module, dict[MemoryPlan, _Prepared]] = weakref.WeakKeyDictionary()
_PLANS_PER_MODEL = 2


def _prepared(model: nn.Module, plan: MemoryPlan) -> _Prepared:
    """The prepared run of `model` under `plan`: the cached one while the model's modules are the same."""
    plans = _PREPARED.setdefault(model, {})
    if plans:  # the plan of the last block, the same object: no hash of the plan (its every tensor) per step
        last = next(reversed(plans.values()))
        if last.plan is plan and _same_tree(model, last.tree):
            return last
    prep = plans.pop(plan, None)
    if prep is None or not _same_tree(model, prep.tree):
        prep = _Prepared(model, plan)
    plans[plan] = prep
    while len(plans) > _PLANS_PER_MODEL:
        del plans[next(iter(plans))]
    return prep


# ---- the executor --------------------------------------------------------------------------------
class _Follow(TorchDispatchMode):
    """Follows the model's operations against the captured step inside a module call where a recomputed
    map is made (see the module docstring): records what its program will replay, and refuses a step that
    runs other operations there."""

    def __init__(self, executor: _Executor) -> None:
        super().__init__()
        self.executor = executor

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        ex = self.executor
        if ex.quiet:
            return func(*args, **kwargs)
        ex.stats.followed_ops += 1
        step, i = ex.step, ex.position
        op = step.ops[i] if i < step.model_ops else None
        programs = ex.prep.programs_at.get(i) if op is not None and same_op(func, op.func) else None
        if programs:
            ex.current = i
            others = ex._record(programs, i, func, args, kwargs, op.random)
        out = func(*args, **kwargs)
        leaves = _leaves(out)
        if not counted(func, leaves):
            return out
        if op is None or not same_op(func, op.func) or not _same_outputs(leaves, op):
            ex.diverged = True
            raise UnsupportedProblem(diverged(step, i, func))
        if programs:
            for o in others:  # the arguments as the operation left them (a batch-norm moves its statistics)
                o.version = o.tensor._version
            made = ex.rebuilds.made
            for leaf, name in op.creates:  # what a save of a dropped map must be (`_Executor.pack`)
                if name in ex.rebuilds.programs:
                    made[name] = leaves[leaf].untyped_storage()._cdata
        ex.position = i + 1
        return out


def _leaves(out: Any) -> list:
    """An operation's outputs, flat (`tree_leaves`, without walking a pytree for the usual flat ones)."""
    if isinstance(out, torch.Tensor):
        return [out]
    if type(out) in (tuple, list) and not any(type(o) in (tuple, list, dict) for o in out):
        return list(out)
    return tree_leaves(out)


def _same_outputs(leaves: list, op: Any) -> bool:
    return len(leaves) == len(op.outputs) and all(
        (t is None if meta is None else isinstance(t, torch.Tensor) and tuple(t.shape) == meta[0] and t.dtype == meta[1])
        for t, meta in zip(leaves, op.outputs))


class _Executor(_OffloadHooks, _Recompute):
    """One `execute_plan` block: names each save by its place in the captured step's saves and keeps,
    offloads or drops it as the plan says; follows operations only where a dropped map is made."""

    def __init__(self, model: nn.Module, prep: _Prepared, prefetch_ahead: int) -> None:
        self.model, self.prep, self.prefetch_ahead = model, prep, prefetch_ahead
        self.stats = ExecutionStats()
        self.step: CapturedStep | None = None
        self.saved = 0                 # saves packed in the forward pass so far
        self.position = 0              # the captured op the next followed operation is
        self.current = 0               # what an offloaded tensor's use is counted against (offload.py)
        self.forward_running = False
        self.preparing = False         # capturing the model for a plan read back
        self.diverged = False          # the step was refused: the checks at its end stand down
        self.quiet = 0                 # inside the executor's own hooks: their operations are not the step's
        self.mode = _Follow(self)
        # entered and left at the calls where the plan acts (`_enter`, `_leave`), not around the whole step
        self.hooks = torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)
        self.hooked: nn.Module | None = None     # the module whose call pushed the saved-tensor hooks
        self.following: nn.Module | None = None  # the module whose call the mode follows
        self.operators: Any = None               # `through_operators` while it does
        self.last = -1                           # the last operation it follows
        self.stopper: Any = None                 # the module hook that stops following after that operation
        self.calls: dict[str, int] = {}          # per scoped module: its calls in this forward pass
        self.nodes = 0                           # the autograd sequence number when the forward pass began
        self.handles: list[Any] = []
        self.copier: Any = None
        self.buffers: _HostBuffers | None = None
        self.pending: list[tuple[Any, torch.Tensor, int]] = []  # device tensors whose host copy may be in flight
        self.pass_: _Pass | None = None

    # -- the model's forward pass ------------------------------------------------------------------------
    def model_starts(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if self.preparing:
            return  # the capture of a plan read back runs the model: not a step
        self.stats.hook_calls += 1
        prep = self.prep
        self.preparing = True
        try:
            step = self.step = prep.ready(self.model, args, kwargs)
        finally:
            self.preparing = False
        self._check_inputs(args, kwargs)
        for conv, budgets in prep.budgets:
            conv._budgets = budgets
        if not prep.acting:
            return
        self.pass_ = _Pass()
        self.rebuilds = _Rebuilds(prep.programs, self.pass_)
        self.saved = self.position = self.current = 0
        if not self.handles and prep.scopes:
            for name, m in prep.scoped:
                self.handles += [m.register_forward_pre_hook(functools.partial(self._scope_starts, name)),
                                 m.register_forward_hook(functools.partial(self._scope_ends, name), always_call=True)]
        self.calls = dict.fromkeys(prep.scopes, 0)
        self.forward_running = True
        self.nodes = torch._C._autograd._get_sequence_nr()
        if prep.root is not None:
            self._enter(self.model, prep.root)

    def model_ends(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        self.stats.hook_calls += 1
        if not self.forward_running:
            return
        self.forward_running = False
        self._leave(self.model, None)
        self._settle_sources()
        self._release(None)
        if self.diverged:
            return  # (that error is on its way)
        nodes = torch._C._autograd._get_sequence_nr() - self.nodes
        if nodes != self.step.model_nodes:
            self.diverged = True
            raise UnsupportedProblem(f"the step diverged from the captured one: its forward pass made {nodes} autograd "
                                     f"nodes where the captured one made {self.step.model_nodes}; its control flow "
                                     "depends on its data, or the model changed; plan again")
        self.stats.kept_released |= self.prep.kept_released
        if self.prep.offloading and self.pass_.entries:  # the backward pass's first step prefetches ahead
            hook, seen = _PrefetchHook(self, self.pass_, self.step.model_ops), set()
            for t in _tensors(output):
                if t.grad_fn is not None and id(t.grad_fn) not in seen:
                    seen.add(id(t.grad_fn))
                    t.grad_fn.register_prehook(hook)

    def _scope_starts(self, name: str, module: nn.Module, args: tuple) -> None:
        self.stats.hook_calls += 1
        k = self.calls[name]
        self.calls[name] = k + 1
        if self.forward_running:
            scope = self.prep.scopes[name].get(k)
            if scope is not None:
                self._enter(module, scope)

    def _scope_ends(self, name: str, module: nn.Module, args: tuple, output: Any) -> None:
        self.stats.hook_calls += 1
        self._leave(module, self.prep.scopes[name].get(self.calls[name] - 1))

    def _enter(self, module: nn.Module, scope: _Scope) -> None:
        """A call where the plan acts begins: its saves go through the hooks (unless an outer call's do), its
        operations through the mode where a program replays one (unless an outer call's do)."""
        self.stats.acting_calls += 1
        if self.hooked is None:
            self.hooked, self.saved = module, scope.save
            self.hooks.__enter__()
        if scope.follow and self.following is None:
            self.following, self.position, self.last = module, scope.op, scope.last
            self.operators = through_operators()  # its converted convolutions as the mode sees them captured
            self.operators.__enter__()
            self.mode.__enter__()
            if scope.stop is not None:  # following stops at the module call after its last replayed operation
                # (outside the dispatcher, where the mode may go; first, so that where that call is followed
                # itself, its own hook starts following it after this one)
                self.stopper = self.prep.stops[scope.stop].register_forward_pre_hook(self._maybe_stop, prepend=True)

    def _maybe_stop(self, module: nn.Module, args: tuple) -> None:
        self.stats.hook_calls += 1
        if self.following is not None and self.position > self.last:
            self._stop_following()

    def _stop_following(self) -> None:
        self.following = None
        self.mode.__exit__(None, None, None)
        self.operators.__exit__(None, None, None)
        if self.stopper is not None:
            self.stopper.remove()
            self.stopper = None

    def _leave(self, module: nn.Module, scope: _Scope | None) -> None:
        if self.following is module:
            self._stop_following()
        if self.hooked is module:
            self.hooked = None
            self.hooks.__exit__(None, None, None)
        if self.pending and scope is not None:  # (on a GPU) offloaded maps this call read last go
            self._release(scope.end)

    def _check_inputs(self, args: tuple, kwargs: dict) -> None:
        step, plan = self.step, self.prep.plan
        leaves = input_leaves(self.model, args, kwargs, self.prep.signature_of(self.model))
        given = {path: t for path, t in leaves if isinstance(t, torch.Tensor)}
        if set(given) != set(step.inputs):
            raise InvalidInput(f"the plan was made for inputs {', '.join(sorted(step.inputs))}, the model was given "
                               f"{', '.join(sorted(given)) or 'none'}")
        for path, t in given.items():
            _, shape, dtype = step.inputs[path]
            if tuple(t.shape) != shape or t.dtype != dtype:
                if t.dim() and shape and t.shape[0] != shape[0] and tuple(t.shape[1:]) == shape[1:]:
                    raise InvalidInput(f"the plan was made for batch {plan.batch}, the input has batch {t.shape[0]}; "
                                       "make a plan for this batch (plan_memory)")
                raise InvalidInput(f"the plan was made for input {path} of shape {shape} ({dtype}), the model was "
                                   f"given {tuple(t.shape)} ({t.dtype}); a plan made for another input size?")

    # -- saved-tensor hooks ---------------------------------------------------------------------------
    def pack(self, t: torch.Tensor) -> Any:
        self.stats.hook_calls += 1
        if not self.forward_running:
            return t.detach()  # (why detached: below)
        k = self.saved
        self.saved = k + 1
        saves = self.prep.saves
        if k >= len(saves) or t.shape != saves[k][1] or t.dtype != saves[k][2]:
            self._refuse(k, t)
        name, _, _, op, action = saves[k]
        if self.pending:  # (on a GPU) device tensors whose forward readers have run go after their copies
            self._release(op)
        if action is None or t.numel() == 0:
            # detached: autograd would hold the tensor object, and through its grad_fn (an op saving its
            # own output) itself, a cycle the garbage collector cannot see into when no backward frees it
            return t.detach()
        if action == "release":  # autograd saves it: kept (named in the stats at the forward pass's end)
            return t.detach()
        self.stats.acting_calls += 1
        self.quiet += 1
        try:
            self.current = op
            if action == "offload":
                return self.pass_, self._offload(name, t), op
            # recompute: the storage its producer made in this pass (a same-shaped stranger would be rebuilt wrong)
            if self.rebuilds.made.get(name) != t.untyped_storage()._cdata:
                self._refuse(k, t)
            return self._drop(name, t, at=op)
        finally:
            self.quiet -= 1

    def unpack(self, saved: Any) -> torch.Tensor:
        self.stats.hook_calls += 1
        if type(saved) is tuple:  # offloaded, unpacked by the backward step of op `at`
            p, entry, at = saved
            self.stats.acting_calls += 1
            self.reached(p, at)
            return self._fetch(entry)
        if isinstance(saved, _Offloaded):  # a source of a rebuild
            return self._fetch(saved)
        if isinstance(saved, _Dropped):
            self.stats.acting_calls += 1
            return self._unpack_dropped(saved)
        return saved

    def _refuse(self, k: int, t: torch.Tensor) -> None:
        """The forward pass's save `k` is not the captured one's: the step is refused, in one line."""
        self.diverged = True
        saves = self.prep.saves
        if k >= len(saves):
            raise UnsupportedProblem(f"the step's forward pass saved more tensors for backward than the captured one "
                                     f"({len(saves)}): its control flow depends on its data, or the model changed; "
                                     "plan again")
        name, shape, dtype, op, _ = saves[k]
        where = f" in {self.step.ops[op].module}" if self.step.ops[op].module else ""
        raise UnsupportedProblem(
            f"the step diverged from the captured one at operation {op}{where}: it saved a {tuple(t.shape)} "
            f"{t.dtype} tensor{'' if name is None else ' of another storage'} where the captured one saved "
            f"{tuple(shape)} {dtype}{'' if name is None else f' ({name})'}; its control flow depends on its data, "
            "or the model changed; plan again")

    # -- workspaces ---------------------------------------------------------------------------------
    @contextlib.contextmanager
    def workspaces(self) -> Iterator[None]:
        """Each converted conv runs its kernels within the plan's budgets (set at the forward pass's start;
        the same dict object each step, so its routes are kept); as they were afterwards."""
        convs = self.prep.convs if self.prep.step is not None else [
            m for m in self.model.modules() if isinstance(m, ConvLayer)]
        saved = [(conv, conv._budgets) for conv in convs]
        try:
            yield
        finally:
            for conv, budgets in saved:
                conv._budgets = budgets


@contextlib.contextmanager
def execute_plan(model: nn.Module, plan: MemoryPlan, *, prefetch_ahead: int = 1) -> Iterator[ExecutionStats]:
    """Run the forward and backward passes in this block under `plan`; yields the `ExecutionStats`.

    Call the model (positional and keyword inputs) and `backward()` inside the block (see the module
    docstring for what happens); a training loop enters one block per step, and only the first block
    of a (model, plan) pair checks the plan against the model. `prefetch_ahead`: how many offloaded
    tensors beyond those the current backward step needs are fetched ahead. A plan made for another
    model, batch or input size raises `InvalidInput`; a step that runs other operations than the
    captured one raises `UnsupportedProblem`.
    """
    if not isinstance(model, nn.Module):
        raise InvalidInput(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(plan, MemoryPlan):
        raise InvalidInput(f"plan must be a ucudnn.memory.MemoryPlan, got {type(plan).__name__}")
    if isinstance(prefetch_ahead, bool) or not isinstance(prefetch_ahead, int) or prefetch_ahead < 0:
        raise InvalidInput(f"prefetch_ahead must be a non-negative integer, got {prefetch_ahead!r}")
    executor = _Executor(model, _prepared(model, plan), prefetch_ahead)
    handles = [model.register_forward_pre_hook(executor.model_starts, prepend=True, with_kwargs=True),
               model.register_forward_hook(executor.model_ends, with_kwargs=True, always_call=True)]
    try:
        with executor.workspaces():
            yield executor.stats
    finally:
        for h in handles + executor.handles + ([executor.stopper] if executor.stopper is not None else []):
            h.remove()

