"""Memory plans in PyTorch training: offload saved feature maps to the host, prefetch them ahead of the
backward pass, recompute dropped ones, and give converted convolutions their planned workspace.

    plan = ucudnn.torch.plan_memory(model, example_input, memory_limit="2GiB", policy="optimal")
    with ucudnn.torch.execute_plan(model, plan) as run:
        loss = criterion(model(x), y)
        loss.backward()
    optimizer.step()

This module runs a plan: `execute_plan`, the explicit block, and the executor that `with_plan`'s module
(`ucudnn.torch.running.compiled`) runs each eager training call through (`_Executor.run`: the same hooks, called
around the model's forward instead of registered on it). Making a plan is `ucudnn.torch.planning.planner`; the
offload and prefetch copies are `ucudnn.torch.running.offload`, recomputation `ucudnn.torch.running.recompute`.

**What lives how long.** Per forward pass: the scoped modules' hooks (registered as it starts, removed as it ends),
and, at the calls where the plan acts, the saved-tensor hooks and the dispatch mode (made and entered at the call,
left and dropped as it returns). Per backward pass: nothing installed; the saves hold the executor's handles and the
prefetch hook sits on the output's autograd node, so the graph, not the block, keeps what the backward pass needs
(the executor holds none of its own bound methods, so it goes with the graph). However a forward pass ends (an
exception, a KeyboardInterrupt or SystemExit, which the module hooks called for an `Exception` do not see),
`_Executor.unwind` takes off what it installed: at the end of the block (`execute_plan`) or of the call (`with_plan`).

**Following the captured step, at the tensors the plan acts on.** A plan names the feature maps of a
captured step (`ucudnn.torch.capturing.capture`), which also recorded, in order, every tensor autograd saved in
the model's forward pass (`CapturedStep.saves`). Inside the block the model's forward and backward passes
are PyTorch's own; `saved_tensors_hooks` see each save, and the k-th save of the forward pass is the
captured step's k-th: its feature map and action come from a table made once per plan (no lookup by
storage, no walk over modules). A kept save returns the tensor; an offloaded one is copied out, a dropped
one leaves a handle. Each save's shape and dtype must be the captured one's, and the forward pass must
save as many: else the step is refused in one line (`UnsupportedProblem`: its control flow depends on its
data, or the model changed). A dropped map's save must moreover be the storage its producer made.

Operations are seen only where a map is dropped: its program (`ucudnn.torch.running.recompute`) replays the
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

**Prepared once** (`ucudnn.torch.running.prepared_plan`). The plan's check against the model, the saves' actions,
the followed module calls, its recompute programs, the conv budgets and the host buffers belong to the
(model, plan) pair: made at its first `execute_plan` and reused by later blocks. A plan without its
captured step (read from JSON) captures the model at the first forward call and is checked against that
capture.

**Offload and prefetch**: see `ucudnn.torch.running.offload`. **Recompute**: see `ucudnn.torch.running.recompute`.

**Release** needs no action: PyTorch frees what the backward pass does not save. A tensor planned
``release`` that autograd does save is kept (it must be) and named in `ExecutionStats.kept_released`.

**Workspaces.** Each converted convolution (`ucudnn.torch.converting.layer.ConvLayer`) whose layer has
``conv_workspace`` entries in the plan runs each kernel, inside the block, with its own handle's fastest
configuration within that kernel's budget (`Handle.kernel(..., budget=...)`), its workspace held for that
run only, as the plan counts it; the workspace a handle keeps between runs outside a plan (its WR buffer,
its WD arena) is given back as the block starts, and taken again by the next run outside one.
`plan_memory` on a converted model takes each converted kernel's options from its handle (`Handle.front`),
so the budgets are ones those kernels can run within.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from ucudnn.errors import InvalidInput, UnsupportedProblem
from ucudnn.memory.plan import MemoryPlan
from ucudnn.torch.capturing.capture import CapturedStep, diverged
from ucudnn.torch.capturing.model_call import input_leaves, tensors_in
from ucudnn.torch.capturing.operations import counted, same_op
from ucudnn.torch.capturing.same_step import autocast_state, model_nodes
from ucudnn.torch.converting.layer import ConvLayer, through_operators
from ucudnn.torch.running.offload import _HostBuffers, _Offloaded, _OffloadHooks, _Pass, _PrefetchHook
from ucudnn.torch.running.prepared_plan import _Prepared, _prepared, _Scope
from ucudnn.torch.running.recompute import _Dropped, _Rebuilds, _Recompute
from ucudnn.torch.running.stats import ExecutionStats

__all__ = ["ExecutionStats", "execute_plan"]


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
            raise UnsupportedProblem(f"{diverged(step, i, func)}; {_remedy(step)}")
        if programs:
            for o in others:  # the arguments as the operation left them (a batch-norm moves its statistics)
                o.version = o.tensor._version
            made = ex.rebuilds.made
            for leaf, name in op.creates:  # what a save of a dropped map must be (`_Executor.pack`)
                if name in ex.rebuilds.programs:
                    made[name] = leaves[leaf].untyped_storage()._cdata
        ex.position = i + 1
        return out


def _autocast_words(state: tuple) -> str:
    return (
        "inside " + ", ".join(f"torch.autocast({d!r}, {str(dtype).removeprefix('torch.')})" for d, dtype in state)
        if state
        else "outside torch.autocast"
    )


def _remedy(step: CapturedStep) -> str:
    """What to do about a step that is not its plan's captured one."""
    fake = (
        (
            "; the plan was captured on fake tensors, on which some models take another path (plan_memory "
            "with fake=False captures the real step)"
        )
        if step.fake
        else ""
    )
    return (
        "the model changed since the plan was made (plan again), or its control flow depends on its input's "
        f"values and took another path (a plan follows one path: run this step without the plan){fake}"
    )


def _leaves(out: Any) -> list:
    """An operation's outputs, flat (`tree_leaves`, without walking a pytree for the usual flat ones)."""
    if isinstance(out, torch.Tensor):
        return [out]
    if type(out) in (tuple, list) and not any(type(o) in (tuple, list, dict) for o in out):
        return list(out)
    return tree_leaves(out)


def _same_outputs(leaves: list, op: Any) -> bool:
    return len(leaves) == len(op.outputs) and all(
        (
            t is None
            if meta is None
            else isinstance(t, torch.Tensor) and tuple(t.shape) == meta[0] and t.dtype == meta[1]
        )
        for t, meta in zip(leaves, op.outputs)
    )


class _Executor(_OffloadHooks, _Recompute):
    """One `execute_plan` block: names each save by its place in the captured step's saves and keeps,
    offloads or drops it as the plan says; follows operations only where a dropped map is made."""

    def __init__(self, model: nn.Module, prep: _Prepared, prefetch_ahead: int) -> None:
        self.model, self.prefetch_ahead = model, prefetch_ahead
        self.prep: _Prepared = prep
        self.stats = ExecutionStats()
        self.step: CapturedStep | None = None
        self.saved = 0  # saves packed in the forward pass so far
        self.position = 0  # the captured op the next followed operation is
        self.current = 0  # what an offloaded tensor's use is counted against (offload.py)
        self.forward_running = False
        self.preparing = False  # capturing the model for a plan read back
        self.diverged = False  # the step was refused: the checks at its end stand down
        self.quiet = 0  # inside the executor's own hooks: their operations are not the step's
        # the saved-tensor hooks and the mode, entered and left at the calls where the plan acts (`_enter`,
        # `_leave`), not around the whole step; made there and dropped on leaving, so that the executor holds
        # none of its own bound methods: what the graph's saves hold of it goes with the graph
        self.hooks: Any = None
        self.mode: _Follow | None = None
        self.hooked: nn.Module | None = None  # the module whose call pushed the saved-tensor hooks
        self.following: nn.Module | None = None  # the module whose call the mode follows
        self.operators: Any = None  # `through_operators` while it does
        self.last = -1  # the last operation it follows
        self.stopper: Any = None  # the module hook that stops following after that operation
        self.calls: dict[str, int] = {}  # per scoped module: its calls in this forward pass
        self.nodes = 0  # the autograd sequence number when the forward pass began
        self.handles: list[Any] = []  # the scoped modules' hooks, for one forward pass
        self.copier: Any = None
        self.buffers: _HostBuffers | None = None
        self.pending: list[tuple[Any, torch.Tensor, int]] = []  # device tensors whose host copy may be in flight
        self.pass_: _Pass | None = None

    # -- the model's forward pass ------------------------------------------------------------------------
    def model_starts(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if self.preparing or not torch.is_grad_enabled():
            return  # the capture of a plan read back runs the model, or an evaluation (no_grad): not a step
        self.stats.hook_calls += 1
        prep = self.prep
        self.preparing = True
        try:
            step = self.step = prep.ready(self.model, args, kwargs)
        finally:
            self.preparing = False
        self._check_inputs(step, args, kwargs)
        if autocast_state() != step.autocast:
            raise UnsupportedProblem(
                f"the plan was made {_autocast_words(step.autocast)}, the step runs "
                f"{_autocast_words(autocast_state())}: make the plan as the step runs (plan_memory "
                "inside the same torch.autocast block, or both outside one)"
            )
        for conv, budgets in prep.budgets:
            conv._budgets = budgets
        if not prep.acting:
            return
        self.pass_ = _Pass()
        self.rebuilds = _Rebuilds(prep.programs, self.pass_)
        self.saved = self.position = self.current = 0
        self._unhook()  # (a forward pass interrupted inside an `execute_plan` block left its hooks)
        for name, m in prep.scoped:
            self.handles += [
                m.register_forward_pre_hook(functools.partial(self._scope_starts, name)),
                m.register_forward_hook(functools.partial(self._scope_ends, name), always_call=True),
            ]
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
        self._unhook()
        self._settle_sources()
        self._release(None)
        if self.diverged:
            return  # (that error is on its way)
        step, pass_ = self.step, self.pass_
        assert step is not None and pass_ is not None  # set where the forward pass started running
        if torch._C._autograd._get_sequence_nr() - self.nodes != step.model_nodes:
            self._check_nodes(step, (args, kwargs), output)
        self.stats.kept_released |= self.prep.kept_released
        if self.prep.offloading and pass_.entries:  # the backward pass's first step prefetches ahead
            hook, seen = _PrefetchHook(self, pass_, step.model_ops), set()
            for t in tensors_in(output):
                if t.grad_fn is not None and id(t.grad_fn) not in seen:
                    seen.add(id(t.grad_fn))
                    t.grad_fn.register_prehook(hook)

    def _check_nodes(self, step: CapturedStep, inputs: Any, output: Any) -> None:
        """The forward pass made another number of autograd nodes than the captured one. A watcher's (a module's
        full backward hook; MemTracker) are not the model's, nor are those its output does not reach or that lead to
        its inputs alone (an input that requires grad): the step is refused where the model made another number
        of its own, in one line naming the first that differs. (The number, not their kinds: a watcher's view of a
        module's output turns a view's node made after an in-place change into an AsStridedBackward.)"""
        ran = [kind for _, kind in model_nodes(tensors_in(output), self.nodes, tensors_in(inputs))]
        captured = step.node_kinds
        if len(ran) == len(captured):
            return
        self.diverged = True
        i = next((i for i, (a, (b, _)) in enumerate(zip(ran, captured)) if a != b), min(len(ran), len(captured)))
        where = f" (in {captured[i][1]})" if i < len(captured) and captured[i][1] else ""
        what = (
            f"made {ran[i] if i < len(ran) else 'no more'} as its autograd node {i} where the captured one made "
            f"{captured[i][0] if i < len(captured) else 'no more'}{where}"
        )
        raise UnsupportedProblem(f"the step diverged from the captured one: its forward pass {what}; {_remedy(step)}")

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
            self.hooks = torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)
            self.hooks.__enter__()
        if scope.follow and self.following is None:
            self.following, self.position, self.last = module, scope.op, scope.last
            self.operators = through_operators()  # its converted convolutions as the mode sees them captured
            self.operators.__enter__()
            self.mode = _Follow(self)
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
        mode, self.mode = self.mode, None
        assert mode is not None  # entered with `following`
        mode.__exit__(None, None, None)
        self.operators.__exit__(None, None, None)
        self.operators = None
        if self.stopper is not None:
            self.stopper.remove()
            self.stopper = None

    def _stop_hooking(self) -> None:
        self.hooked = None
        hooks, self.hooks = self.hooks, None
        hooks.__exit__(None, None, None)

    def _leave(self, module: nn.Module, scope: _Scope | None) -> None:
        if self.following is module:
            self._stop_following()
        if self.hooked is module:
            self._stop_hooking()
        if self.pending and scope is not None:  # (on a GPU) offloaded maps this call read last go
            self._release(scope.end)

    def _unhook(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []

    def unwind(self) -> None:
        """Whatever this forward pass installed goes, however it ended: the module hooks that run for an
        `Exception` do not run for a KeyboardInterrupt or SystemExit, which would leave the saved-tensor
        hooks and the mode on for everything after. Idempotent; the step's graph, if any, is the caller's."""
        self.forward_running = False
        try:
            if self.following is not None:
                self._stop_following()
            if self.hooked is not None:
                self._stop_hooking()
        finally:
            self._unhook()
            if self.stopper is not None:
                self.stopper.remove()
                self.stopper = None
            self.pending = []  # (the interrupted pass's device tensors: nothing will read their copies)

    def run(self, args: tuple, kwargs: dict) -> Any:
        """One call of the model under the plan (`with_plan`'s eager forward): the hooks of `execute_plan`'s
        block, called around the model's forward instead of registered on it, and nothing left installed once
        the call returns or raises. The backward pass may run later: what it needs, its graph's saves hold."""
        try:
            self.model_starts(self.model, args, kwargs)
            output = self.model(*args, **kwargs)
            self.model_ends(self.model, args, kwargs, output)
        except BaseException:
            self.unwind()
            raise
        return output

    def _check_inputs(self, step: CapturedStep, args: tuple, kwargs: dict) -> None:
        plan = self.prep.plan
        leaves = input_leaves(self.model, args, kwargs, self.prep.signature_of(self.model))
        given = {path: t for path, t in leaves if isinstance(t, torch.Tensor)}
        if set(given) != set(step.inputs):
            raise InvalidInput(
                f"the plan was made for inputs {', '.join(sorted(step.inputs))}, the model was given "
                f"{', '.join(sorted(given)) or 'none'}: make the plan with the arguments the step passes (a "
                "trainer may add some: the HF Trainer passes num_items_in_batch to a forward taking **kwargs)"
            )
        for path, t in given.items():
            _, shape, dtype = step.inputs[path]
            if tuple(t.shape) != shape or t.dtype != dtype:
                if t.dim() and shape and t.shape[0] != shape[0] and tuple(t.shape[1:]) == shape[1:]:
                    raise InvalidInput(
                        f"the plan was made for batch {plan.batch}, the input has batch {t.shape[0]}; "
                        "make a plan for this batch (plan_memory)"
                    )
                raise InvalidInput(
                    f"the plan was made for input {path} of shape {shape} ({dtype}), the model was "
                    f"given {tuple(t.shape)} ({t.dtype}); a plan made for another input size?"
                )

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
        assert name is not None  # the plan acts on feature maps only (`_Prepared._action`)
        self.stats.acting_calls += 1
        self.quiet += 1
        try:
            self.current = op
            if action == "offload":
                return self.pass_, self._offload(name, t), op
            # recompute: the storage its producer made in this pass (a same-shaped stranger would be rebuilt wrong)
            if self.rebuilds.made.get(name) != t.untyped_storage()._cdata:
                self._refuse(k, t)
            # a save no backward step unpacks (its node is beyond the loss's reach) holds no rebuilt storage
            return self._drop(name, t, 0 if k in self.prep.unread else 1, at=op)
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
        step, saves = self.step, self.prep.saves
        assert step is not None  # a save in the forward pass: the step is the captured one
        if k >= len(saves):
            raise UnsupportedProblem(
                f"the step diverged from the captured one: its forward pass saved more tensors "
                f"for backward than the captured one ({len(saves)}); {_remedy(step)}"
            )
        name, shape, dtype, op, _ = saves[k]
        where = f" in {step.ops[op].module}" if step.ops[op].module else ""
        raise UnsupportedProblem(
            f"the step diverged from the captured one at operation {op}{where}: it saved a {tuple(t.shape)} "
            f"{t.dtype} tensor{'' if name is None else ' of another storage'} where the captured one saved "
            f"{tuple(shape)} {dtype}{'' if name is None else f' ({name})'}; {_remedy(step)}"
        )

    # -- workspaces ---------------------------------------------------------------------------------
    @contextlib.contextmanager
    def workspaces(self) -> Iterator[None]:
        """Each converted conv runs its kernels within the plan's budgets (set at the forward pass's start;
        the same dict object each step, so its routes are kept); as they were afterwards. The workspace its
        handle kept from runs outside a plan is given back: the plan counts none but the budgets'."""
        convs = (
            self.prep.convs
            if self.prep.step is not None
            else [m for m in self.model.modules() if isinstance(m, ConvLayer)]
        )
        saved = [(conv, conv._budgets) for conv in convs]
        for handle in {id(conv.handle): conv.handle for conv in convs}.values():
            handle.release_workspace()
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
    of a (model, plan) pair checks the plan against the model. Where the loop is a trainer's, `with_plan`'s
    module runs the same executor per call. Leaving the block, however, leaves nothing installed. `prefetch_ahead`: how many offloaded
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
    handles = [
        model.register_forward_pre_hook(executor.model_starts, prepend=True, with_kwargs=True),
        model.register_forward_hook(executor.model_ends, with_kwargs=True, always_call=True),
    ]
    try:
        with executor.workspaces():
            yield executor.stats
    finally:
        for h in handles:
            h.remove()
        executor.unwind()
