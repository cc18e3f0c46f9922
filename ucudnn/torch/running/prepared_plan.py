"""A memory plan prepared for one model, once: what `ucudnn.torch.running.executor.execute_plan` needs that stays the same
from step to step (the plan checked against the model's captured step, each save's action, the module calls
where the executor acts, the recompute programs, the conv budgets, the copiers and their host buffers), and
the cache of them, kept weakly with the model for its latest plans. A module replaced since is seen by
comparing each module's children, not by walking names."""

from __future__ import annotations

import bisect
import inspect
import operator
import weakref
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ucudnn.errors import InvalidInput, UnsupportedProblem
from ucudnn.memory.plan import MemoryPlan
from ucudnn.torch.capturing.capture import CapturedStep, capture, structure
from ucudnn.torch.converting.layer import ConvLayer, PlanBudgets
from ucudnn.torch.running.offload import _copier_for, _HostBuffers, copier_kind
from ucudnn.torch.running.recompute import programs_for


# ---- the (model, plan) pair, prepared ----------------------------------------------------------------
class _Prepared:
    """What running a model under a plan needs that stays the same from step to step: the captured step
    and the plan checked against it, each save's action, the modules where recomputed maps are made, the
    recompute programs, the conv budgets, and the copiers with their host buffers. Holds no reference to
    the model itself (see `_prepared`)."""

    def __init__(self, model: nn.Module, plan: MemoryPlan) -> None:
        self.plan, self.tree = plan, _tree(model)
        self.structure = structure(model)
        self.kinds = {name: _kind(p) for name, p in model.named_parameters()}  # (`_check_parameters`)
        self.actions = {t.name: t.action for t in plan.tensors}
        self.step: CapturedStep | None = None
        self.copies: dict[tuple[torch.device, str], tuple[Any, _HostBuffers]] = {}
        self.forward: Any = None  # the model's forward function and its signature (`signature_of`)
        self.signature: inspect.Signature | None = None
        if plan.capture is not None:
            if plan.capture.structure != self.structure:
                raise InvalidInput(
                    f"plan for {plan.network!r} was captured from another model ("
                    f"{type(model).__name__} has other modules); plan this model (plan_memory)"
                )
            self._adopt(model, plan.capture)

    def ready(self, model: nn.Module, args: tuple, kwargs: dict) -> CapturedStep:
        """The captured step, captured now (on fake tensors) where the plan came without one."""
        if self.step is None:
            self._adopt(model, capture(model, _example(args, kwargs), name=self.plan.network), check=True)
        assert self.step is not None  # _adopt sets it
        return self.step

    def _adopt(self, model: nn.Module, step: CapturedStep, check: bool = False) -> None:
        plan, graph, name = self.plan, step.graph, type(model).__name__
        if check:  # a plan read back: its maps must be this model's (the loss's may differ)
            storages = {s: graph.bytes_of(s) for s in graph.storages}
            unknown = sorted(t for t in self.actions if t not in storages and not t.startswith("loss:"))
            if unknown:
                raise InvalidInput(
                    f"plan for {plan.network!r} names tensor(s) {', '.join(unknown[:5])} that {name} "
                    "does not produce; a plan made for another model?"
                )
            wrong = [
                (t.name, t.bytes, storages[t.name])
                for t in plan.tensors
                if t.name in storages and storages[t.name] != t.bytes
            ]
            if wrong:
                t, planned, actual = wrong[0]
                raise InvalidInput(
                    f"plan for {plan.network!r}: tensor {t} has {planned} bytes in the plan but "
                    f"{actual} in this step; a plan made for another input size?"
                )
        modules = dict(model.named_modules())
        ops = {op.name: op for op in graph.conv_ops}
        unknown = sorted({c.layer for c in plan.conv_workspace} - set(ops))
        if unknown:
            raise InvalidInput(
                f"plan for {plan.network!r} gives workspace to conv layer(s) {', '.join(unknown[:5])} "
                f"that {name} does not have; a plan made for another model?"
            )
        self.budgets: list[tuple[ConvLayer, PlanBudgets]] = []
        by_module: dict[str, dict[str, int]] = {}
        torch_own: dict[str, set[str]] = {}
        for c in plan.conv_workspace:
            module = ops[c.layer].module
            kinds = by_module.setdefault(module, {})
            kinds[c.kind] = min(kinds.get(c.kind, c.bytes), c.bytes)  # a module called twice: both budgets hold
            if c.torch_own:  # (called twice: torch's where either call's is, which holds less than the plan counts)
                torch_own.setdefault(module, set()).add(c.kind)
        for module, kinds in by_module.items():
            conv = modules.get(module)
            if isinstance(conv, ConvLayer):  # torch's own conv: its workspace is torch's business
                self.budgets.append((conv, PlanBudgets(kinds, frozenset(torch_own.get(module, ())))))
        self.convs = [m for m in modules.values() if isinstance(m, ConvLayer)]
        self.params = {p.untyped_storage()._cdata for p in model.parameters()}  # passed as they are to a replay
        backward = {r for s in graph.steps if s.phase == "bwd" for r in s.reads}
        self.acting = any(
            a in ("offload", "recompute") or (a == "release" and t in backward) for t, a in self.actions.items()
        )
        self.programs = programs_for(step, self.actions)
        self.programs_at: dict[int, tuple[str, ...]] = {}  # op -> the storages whose programs it is in
        for p in self.programs.values():
            for i in p.ops:
                self.programs_at[i] = (*self.programs_at.get(i, ()), p.storage)
        self.offloading = "offload" in self.actions.values()
        self.saves = tuple(
            (name, torch.Size(shape), dtype, op, self._action(name)) for name, shape, dtype, op in step.saves
        )
        self.unread = step.unread
        # autograd saves these maps: kept (it must), and named in the stats
        self.kept_released = {
            name for name, *_ in step.saves if name is not None and self.actions.get(name) == "release"
        }
        offloaded = {name for name, *_, action in self.saves if name is not None and action == "offload"}
        last_reads = [step.last_read[name] for name in offloaded if name in step.last_read]
        self.root, self.scopes = _scopes(step, self.saves, self.programs_at, last_reads)
        self.scoped = [(name, modules[name]) for name in self.scopes]  # hooked in each block
        stops = [
            scope.stop
            for scope in (self.root, *(s for calls in self.scopes.values() for s in calls.values()))
            if scope is not None and scope.stop is not None
        ]
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


def _scopes(
    step: CapturedStep, saves: tuple, programs_at: dict[int, tuple[str, ...]], last_reads: list[int]
) -> tuple[_Scope | None, dict[str, dict[int, _Scope]]]:
    """Where the executor acts (see `_Scope`): the module calls that save a tensor the plan offloads or drops,
    run an operation a recompute program replays, or read an offloaded map last (its device copy goes once
    the call returns), as {module: {call number: scope}}; and the model's own call, where one of those
    operations runs outside every submodule (then the whole forward pass is a scope; else None)."""
    calls: dict[str, list[tuple[str, int, int, int]]] = {}
    for call in step.calls:
        calls.setdefault(call[0], []).append(call)
    wanted: dict[tuple[str, int] | None, bool] = {}  # (module, call number), None for the model's -> follow
    last: dict[tuple[str, int] | None, int] = {}  # -> the last operation a program replays there

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
    and class, and its parameters (by identity). Checked in a few list comparisons per step, without walking
    the model (and without a list per module, which would wake the garbage collector): where every module kept
    has the same children and parameters as when prepared, the tree is the same."""
    modules = list(model.modules())[1:]  # (not the model: the prepared run would keep it alive)
    return (
        type(model),
        dict(model._modules),
        modules,
        list(map(type, modules)),
        [dict(m._modules) for m in modules],
        _parameters(model, modules),
    )


_CHILDREN = operator.attrgetter("_modules")


def _parameters(model: nn.Module, modules: list[nn.Module]) -> list[Any]:
    """The parameters of the model and of `modules`, in module order (None where a slot holds none)."""
    return [*model._parameters.values(), *(p for m in modules for p in m._parameters.values())]


def _same_tree(model: nn.Module, tree: tuple) -> bool:
    return _same_modules(model, tree) and _same_parameters(model, tree)


def _same_modules(model: nn.Module, tree: tuple) -> bool:
    root_type, root, modules, types, children, _ = tree
    return (
        type(model) is root_type
        and model._modules == root
        and list(map(type, modules)) == types
        and list(map(_CHILDREN, modules)) == children
    )


def _same_parameters(model: nn.Module, tree: tuple) -> bool:
    modules, params = tree[2], tree[5]
    now = _parameters(model, modules)
    return len(now) == len(params) and all(map(operator.is_, now, params))


def _check_parameters(model: nn.Module, before: _Prepared) -> None:
    """Parameters replaced since `before` was prepared: the same kinds, shapes and dtypes (a state dict loaded with
    ``assign=True``) prepare again; others (a sharding wrapper's DTensors, another dtype) are refused."""
    old = before.kinds
    for name, p in model.named_parameters():
        if name in old and old[name] != _kind(p):
            raise UnsupportedProblem(
                f"the model's parameter {name} was replaced since the plan was prepared for it: now "
                f"{_words(_kind(p))}, then {_words(old[name])} (a wrapper that shards or converts parameters?); "
                "plan the model as it is now (plan_memory), after wrapping it"
            )


def _kind(p: torch.Tensor) -> tuple:
    return type(p).__name__, tuple(p.shape), p.dtype


def _words(kind: tuple) -> str:
    return f"a {kind[0]} of shape {kind[1]} ({str(kind[2]).removeprefix('torch.')})"


def _example(args: tuple, kwargs: dict) -> Any:
    """A call's arguments as `capture` takes an example."""
    if kwargs and args:
        raise InvalidInput(
            "a plan without its captured step (read from JSON) is captured at the first call, "
            "which must pass its inputs all by position or all by keyword"
        )
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
        if prep is not None and _same_modules(model, prep.tree):  # the same modules, other parameters
            try:
                _check_parameters(model, prep)
            except UnsupportedProblem:
                plans[plan] = prep  # (refused again at the next call, against the same parameters)
                raise
        prep = _Prepared(model, plan)
    plans[plan] = prep
    while len(plans) > _PLANS_PER_MODEL:
        del plans[next(iter(plans))]
    return prep


def held_host_buffers(model: nn.Module) -> list[torch.Tensor]:
    """The host buffers `model`'s prepared plans keep for their next steps' offloads (a memory tracker's host
    copies, taken again when the step offloads)."""
    return [
        host for prep in _PREPARED.get(model, {}).values() for _, pool in prep.copies.values() for host in pool.held()
    ]
