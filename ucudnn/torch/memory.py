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

**Following the captured step.** A plan names the feature maps of a captured step
(`ucudnn.torch.capturing`). Inside the block, the model's forward pass runs as it always does, under a
dispatch mode that follows it operation by operation against the captured one: each operation must be
the captured one with the same outputs (a convolution may be torch's or a converted layer's), else
the step is refused in one line (`UnsupportedProblem`: its control flow depends on its data, or the
model changed). Each storage an operation makes is tagged with its feature map's name, so that
`saved_tensors_hooks`, which see tensors, know which feature map autograd saves: a parameter or an
untagged tensor is kept; a tagged one is kept, offloaded or dropped as the plan says. Converted
convolutions run as ucudnn's operator inside the block (`through_operators`), as they did when
captured. The loss runs outside the model's forward pass: what it saves is kept.

**Acting on nothing costs nothing.** A plan that keeps every map autograd saves (its actions are keep
and release) needs no mode and no hooks: the block checks the inputs and gives the convolutions their
budgets, and the step is the plain step.

**Prepared once.** The plan's check against the model, its recompute programs, the conv budgets and
the host buffers belong to the (model, plan) pair: made at its first `execute_plan` and reused by later
blocks (kept weakly with the model, for its latest plans). A plan without its captured step (read
from JSON) captures the model at the first forward call and is checked against that capture.

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

import contextlib
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
from ucudnn.torch.capturing import CapturedStep, capture, diverged, input_leaves, structure
from ucudnn.torch.operations import counted, same_op
from ucudnn.torch.layer import ConvLayer, through_operators
from ucudnn.torch.offload import _copier_for, _HostBuffers, _Offloaded, _OffloadHooks, _Pass, _PrefetchHook
from ucudnn.torch.planning import _fingerprint, measure_profile, plan_memory
from ucudnn.torch.recompute import _Dropped, _Rebuilds, _Recompute, programs_for

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


# ---- the (model, plan) pair, prepared ----------------------------------------------------------------
class _Prepared:
    """What running a model under a plan needs that stays the same from step to step: the captured step
    and the plan checked against it, the recompute programs, the conv budgets, and the copiers with
    their host buffers. Holds no reference to the model (see `_prepared`)."""

    def __init__(self, model: nn.Module, plan: MemoryPlan) -> None:
        self.plan, self.fingerprint = plan, _fingerprint(model)
        self.structure = structure(model)
        self.actions = {t.name: t.action for t in plan.tensors}
        self.step: CapturedStep | None = None
        self.copies: dict[torch.device, tuple[Any, _HostBuffers]] = {}
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
        backward = {r for s in graph.steps if s.phase == "bwd" for r in s.reads}
        self.acting = any(a in ("offload", "recompute") or (a == "release" and t in backward)
                          for t, a in self.actions.items())
        self.programs = programs_for(step, self.actions)
        self.programs_at: dict[int, tuple[str, ...]] = {}  # op -> the storages whose programs it is in
        for p in self.programs.values():
            for i in p.ops:
                self.programs_at[i] = (*self.programs_at.get(i, ()), p.storage)
        self.offloading = "offload" in self.actions.values()
        self.step = step

    def copies_for(self, device: torch.device) -> tuple[Any, _HostBuffers]:
        """The copier for `device` and its host buffers, made at the first offload to the host."""
        if device not in self.copies:
            copier = _copier_for(device)
            self.copies[device] = copier, _HostBuffers(pin=copier.pin)
        return self.copies[device]


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
    prep = plans.pop(plan, None)
    if prep is None or prep.fingerprint != _fingerprint(model):
        prep = _Prepared(model, plan)
    plans[plan] = prep
    while len(plans) > _PLANS_PER_MODEL:
        del plans[next(iter(plans))]
    return prep


# ---- the executor --------------------------------------------------------------------------------
class _Follow(TorchDispatchMode):
    """Follows the model's forward pass against the captured step (see the module docstring)."""

    def __init__(self, executor: _Executor) -> None:
        super().__init__()
        self.executor = executor

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        ex = self.executor
        if ex.quiet:
            return func(*args, **kwargs)
        step, i = ex.step, ex.position
        programs = ex.prep.programs_at.get(i) if i < step.model_ops and same_op(func, step.ops[i].func) else None
        others = ex._record(programs, i, func, args, kwargs, step.ops[i].random) if programs else ()
        out = func(*args, **kwargs)
        leaves = tree_leaves(out)
        if not counted(func, leaves):
            return out
        if i >= step.model_ops or not same_op(func, step.ops[i].func) or not _same_outputs(leaves, step.ops[i]):
            ex.diverged = True
            raise UnsupportedProblem(diverged(step, i, func))
        for o in others:  # the arguments as the operation left them (a batch-norm moves its statistics)
            o.version = o.tensor._version
        ex.ran(i, leaves)
        return out


def _same_outputs(leaves: list, op: Any) -> bool:
    return len(leaves) == len(op.outputs) and all(
        (t is None if meta is None else isinstance(t, torch.Tensor) and tuple(t.shape) == meta[0] and t.dtype == meta[1])
        for t, meta in zip(leaves, op.outputs))


class _Executor(_OffloadHooks, _Recompute):
    """One `execute_plan` block: follows the forward pass, names saved tensors and keeps, offloads or
    drops each as the plan says."""

    def __init__(self, model: nn.Module, prep: _Prepared, prefetch_ahead: int) -> None:
        self.model, self.prep, self.prefetch_ahead = model, prep, prefetch_ahead
        self.stats = ExecutionStats()
        self.params = {p.untyped_storage()._cdata for p in model.parameters()}
        self.tags: dict[int, tuple[str, weakref.ref]] = {}  # storage -> (its feature map, the storage)
        self.step: CapturedStep | None = None
        self.position = 0              # operations of the forward pass done
        self.current = 0               # what an offloaded tensor's use is counted against (offload.py)
        self.forward_running = False
        self.preparing = False         # capturing the model for a plan read back
        self.diverged = False          # the forward pass stopped at an operation the captured step did not run
        self.quiet = 0                 # inside the executor's own hooks: their operations are not the step's
        self.mode = _Follow(self)
        self.hooked: set[int] = set()
        self.to_hook: list[tuple[int, torch.Tensor]] = []
        self.copier: Any = None
        self.buffers: _HostBuffers | None = None
        self.pending: list[tuple[Any, torch.Tensor, int]] = []  # device tensors whose host copy may be in flight
        self.pass_: _Pass | None = None

    # -- the model's forward pass ------------------------------------------------------------------------
    def model_starts(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if self.preparing:
            return  # the capture of a plan read back runs the model: not a step
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
        self.pass_, self.rebuilds = _Pass(), _Rebuilds(prep.programs)
        self.tags.clear()
        self.position = self.current = 0
        self.hooked.clear()
        for path, t in input_leaves(self.model, args, kwargs):
            if isinstance(t, torch.Tensor) and path in step.inputs:
                self._tag(t, step.inputs[path][0])
        self.forward_running = True
        self.mode.__enter__()

    def model_ends(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        if not self.forward_running:
            return
        self.forward_running = False
        self.mode.__exit__(None, None, None)
        self._settle_sources()
        self._hook_ready()
        self._release(None)
        if self.position != self.step.model_ops and not self.diverged:  # (else that error is on its way)
            raise UnsupportedProblem(f"the step's forward pass ran {self.position} operations where the captured one "
                                     f"ran {self.step.model_ops}: its control flow depends on its data, or the model "
                                     "changed; plan again")

    def _check_inputs(self, args: tuple, kwargs: dict) -> None:
        step, plan = self.step, self.prep.plan
        given = {path: t for path, t in input_leaves(self.model, args, kwargs) if isinstance(t, torch.Tensor)}
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

    def ran(self, i: int, leaves: list) -> None:
        """Operation `i` ran and returned `leaves`: tag what it made, hook the nodes it will need."""
        self._hook_ready()
        op = self.step.ops[i]
        for leaf, name in op.creates:
            self._tag(leaves[leaf], name)
        self.position = self.current = i + 1
        if self.prep.offloading:
            self.to_hook = [(i, t) for t in leaves if isinstance(t, torch.Tensor)]
            self._release(self.position)

    def _tag(self, t: torch.Tensor, name: str) -> None:
        storage = t.untyped_storage()
        self.tags[storage._cdata] = (name, weakref.ref(storage))

    def _hook_ready(self) -> None:
        """The autograd nodes of the last operation's outputs (set once it returned) get a pre-hook that
        prefetches ahead of their backward step."""
        for i, t in self.to_hook:
            node = t.grad_fn
            if node is not None and id(node) not in self.hooked:
                self.hooked.add(id(node))
                node.register_prehook(_PrefetchHook(self, self.pass_, i))
        self.to_hook = []

    # -- saved-tensor hooks ---------------------------------------------------------------------------
    def pack(self, t: torch.Tensor) -> Any:
        if not self.forward_running or t.numel() == 0:
            return t.detach()  # (why detached: below)
        self.quiet += 1
        try:
            name = self._name_of(t)
            action = self.prep.actions.get(name, "keep") if name is not None else "keep"
            if action == "offload":
                return self._offload(name, t)
            if action == "recompute" and name in self.rebuilds.programs:
                return self._drop(name, t)
            if action == "release":
                self.stats.kept_released.add(name)
            # detached: autograd would hold the tensor object, and through its grad_fn (an op saving its
            # own output) itself, a cycle the garbage collector cannot see into when no backward frees it
            return t.detach()
        finally:
            self.quiet -= 1

    def unpack(self, saved: Any) -> torch.Tensor:
        if isinstance(saved, _Offloaded):
            return self._fetch(saved)
        if isinstance(saved, _Dropped):
            return self._unpack_dropped(saved)
        return saved

    def _name_of(self, t: torch.Tensor) -> str | None:
        """The feature map `t`'s storage is (None: a parameter, or a tensor the step did not make)."""
        storage = t.untyped_storage()
        known = self.tags.get(storage._cdata)
        return known[0] if known is not None and known[1]() is storage else None

    # -- workspaces ---------------------------------------------------------------------------------
    @contextlib.contextmanager
    def workspaces(self) -> Iterator[None]:
        """Each converted conv runs its kernels within the plan's budgets (set at the forward pass's start;
        the same dict object each step, so its routes are kept); as they were afterwards."""
        saved = [(conv, conv._budgets) for conv in self.model.modules() if isinstance(conv, ConvLayer)]
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
        with contextlib.ExitStack() as stack:
            stack.enter_context(executor.workspaces())
            if executor.prep.step is None or executor.prep.acting:
                stack.enter_context(through_operators())
                stack.enter_context(torch.autograd.graph.saved_tensors_hooks(executor.pack, executor.unpack))
            yield executor.stats
    finally:
        for h in handles:
            h.remove()

