"""A memory plan inside `torch.compile`: its decisions given to PyTorch as per-operation checkpoint policies.

    plan = ucudnn.torch.plan_memory(model, x, memory_limit="2GiB", compiled=True, loss=...)
    step = torch.compile(ucudnn.torch.with_plan(model, plan))
    loss(step(x)).backward()

`execute_plan` acts on a step through Python hooks that a compiled graph does not run. A compiled step keeps what
its partitioner decides, and PyTorch lets a program steer that decision per operation: selective activation
checkpointing (`torch.utils.checkpoint.create_selective_checkpoint_contexts`) tags each operation of a
checkpointed region `MUST_SAVE` or `MUST_RECOMPUTE`, and AOTAutograd's partitioner obeys the tags. So
`with_plan` runs the model's forward pass as one checkpointed region whose policy says, operation by operation,
what the plan does with the feature map it makes: kept maps are saved (`MUST_SAVE`), recomputed ones recomputed
(`MUST_RECOMPUTE`; where Inductor fuses a pointwise recomputation into its consumer, almost for free). An operation
that makes no map of the plan's (on parameters alone) or only maps the backward pass does not read is
`PREFER_RECOMPUTE`, which 2.13's partitioner treats as `MUST_RECOMPUTE`. Converted convolutions run within the plan's
workspace budgets: the budgets are the layers' from `with_plan` on (the compiled graph reads them when it runs,
the backward pass's kernels too, which run after the forward call has returned).

**Which operation is which.** The policy sees the forward pass's ATen operations in order, as the capture saw
them, but as the compiler traces them: batch-norm may be another overload (`_native_batch_norm_legit`), an
instance norm may add a copy. So operations are matched to the captured ones in order, by family
(`_family`), an unmatched one taking the action of the operation before it (its module's output, copied); a
trace that leaves captured operations unmatched is refused in one line. Views are not operations here, as in
the capture (`counted`).

**Called eagerly** (for a check) the region is PyTorch's eager selective checkpointing: the same decisions,
with PyTorch's eager recomputation, which replays the whole region at the first backward use (its memory is
not the compiled step's). An operation that updates state (batch-norm's running statistics) is saved there,
so that the replay does not update it twice; a compiled graph updates it once in any case.

**Not carried: offloading.** `CheckpointPolicy.MUST_CPU_OFFLOAD` names it, but PyTorch 2.13's partitioner does
not consume it: a plan that offloads is refused in one line (`plan_memory(..., compiled=True)` plans without).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from ucudnn.errors import InvalidInput, UnsupportedProblem
from ucudnn.memory.plan import MemoryPlan
from ucudnn.torch.capturing.capture import CapturedStep
from ucudnn.torch.capturing.operations import CONVOLUTIONS
from ucudnn.torch.converting.layer import ConvLayer
from ucudnn.torch.running.labels import watch_inductor_buffers
from ucudnn.torch.running.prepared_plan import _prepared

__all__ = ["PlannedModule", "with_plan"]

aten = torch.ops.aten
# One operation under the names eager PyTorch and a compiler's trace give it (batch-norm: an instance norm too).
_BATCH_NORMS = frozenset(
    {
        aten.native_batch_norm,
        aten._native_batch_norm_legit,
        aten._native_batch_norm_legit_functional,
        aten._native_batch_norm_legit_no_training,
        aten._batch_norm_with_update,
        aten._batch_norm_with_update_functional,
    }
)


def _family(func: Any) -> Any:
    """What an operation is, whatever overload or form ran it (`_BATCH_NORMS`, `CONVOLUTIONS`)."""
    if func in CONVOLUTIONS:
        return "convolution"
    packet = getattr(func, "overloadpacket", func)
    return "batch_norm" if packet in _BATCH_NORMS else packet


@functools.cache
def _counted(func: Any) -> bool:
    """`capturing.operations.counted` before the operation runs: not a view, and its schema returns a tensor."""
    schema = getattr(func, "_schema", None)
    if schema is None or getattr(func, "is_view", False):
        return False
    return any("Tensor" in str(r.type) for r in schema.returns)


@functools.cache
def _updates_state(func: Any) -> bool:
    """Whether an operation writes one of its arguments: an in-place add, batch-norm's running statistics (which
    `native_batch_norm` updates without saying so in its schema)."""
    schema = getattr(func, "_schema", None)
    return _family(func) == "batch_norm" or (schema is not None and schema.is_mutable)


class _Policy:
    """The policy of one trace (or one eager forward pass): the captured model operations in order, each with
    its policy, matched to the operations as they come (see the module docstring)."""

    def __init__(self, families: tuple, policies: tuple[CheckpointPolicy, ...], eager: bool) -> None:
        self.families, self.policies, self.eager = families, policies, eager
        self.position = {False: 0, True: 0}  # the forward pass's and the eager replay's
        self.last = {False: CheckpointPolicy.PREFER_RECOMPUTE, True: CheckpointPolicy.PREFER_RECOMPUTE}

    def __call__(self, ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        if not _counted(func):
            return CheckpointPolicy.PREFER_RECOMPUTE  # a view or a query: nothing of its own to keep
        replay = ctx.is_recompute
        i, family = self.position[replay], _family(func)
        for j in (i, i + 1):  # this operation, or the next one where the trace left this one out
            if j < len(self.families) and self.families[j] == family:
                self.position[replay] = j + 1
                self.last[replay] = self.policies[j]
                break
        policy = self.last[replay]
        if self.eager and _updates_state(func):  # eager replay would update the state twice
            return CheckpointPolicy.MUST_SAVE
        return policy

    def check(self, step: CapturedStep) -> None:
        """After the forward pass: every captured operation was matched, else the trace is not the plan's."""
        done = self.position[False]
        if done < len(self.families):
            op = step.ops[done]
            raise UnsupportedProblem(
                f"the compiled forward pass of {step.graph.network} ran {done} of the plan's {len(self.families)} "
                f"operations, then none like {op.func} ({op.module or 'the model'}): the model changed, or its "
                "control flow depends on its data; plan again with plan_memory(..., compiled=True)"
            )


def _policies(step: CapturedStep, plan: MemoryPlan) -> tuple[CheckpointPolicy, ...]:
    """Each captured model operation's policy: recompute where the plan recomputes a map it makes (or writes in
    place), save where the plan keeps one, else `PREFER_RECOMPUTE` (see the module docstring)."""
    actions = {t.name: t.action for t in plan.tensors}
    graph = step.graph
    out = []
    for op in step.ops[: step.model_ops]:
        maps = [name for _, name in op.creates] + ([op.writes] if op.writes else [])
        kinds = {actions.get(_storage(graph, m), "keep") for m in maps}
        if "recompute" in kinds:
            out.append(CheckpointPolicy.MUST_RECOMPUTE)
        elif "keep" in kinds:
            out.append(CheckpointPolicy.MUST_SAVE)
        else:  # no map of the plan's, or only released ones (the backward pass reads none)
            out.append(CheckpointPolicy.PREFER_RECOMPUTE)
    return tuple(out)


def _storage(graph: Any, feature: str) -> str:
    """The storage a feature map lives in (its own, or the one it was written into in place); a map that is no
    graph op's (a batch-norm's saved statistics, ``<op>.<leaf>``) is its own."""
    try:
        return graph.storage_of(feature)
    except InvalidInput:
        return feature


@functools.cache
def _checked_mode(mode: Any) -> Any:
    """PyTorch's caching mode of selective checkpointing (a private class, whose instance `checkpoint` enters
    around the forward pass, eager or traced), which also checks the policy when the pass ends: the one place
    that sees the end of a compiler's trace."""

    class Checked(mode):
        def __exit__(self, *exc: object) -> None:
            super().__exit__(*exc)
            if exc[0] is None:
                self.ucudnn_check()

    return Checked


def _contexts(families: tuple, policies: tuple, step: CapturedStep) -> tuple[Any, Any]:
    """Selective checkpointing's two modes (the forward pass's, the eager replay's) under a fresh `_Policy`: each
    trace and each eager forward pass counts its operations from the first."""
    policy = _Policy(families, policies, eager=not torch.compiler.is_compiling())
    forward, replay = create_selective_checkpoint_contexts(policy, allow_cache_entry_mutation=True)
    forward.__class__ = _checked_mode(forward.__class__)
    forward.ucudnn_check = functools.partial(policy.check, step)
    return forward, replay


class PlannedModule(nn.Module):
    """`model` whose forward pass runs under a memory plan's decisions, compiled or not (`with_plan`)."""

    def __init__(self, model: nn.Module, plan: MemoryPlan, step: CapturedStep) -> None:
        super().__init__()
        self.module = model
        self.plan = plan
        self._step = step
        ops = step.ops[: step.model_ops]
        self._families = tuple(_family(op.func) for op in ops)
        self._policies = _policies(step, plan)
        # (a partial, not a bound method: Dynamo keeps a context_fn as a constant, to call when AOTAutograd traces)
        self._context_fn = functools.partial(_contexts, self._families, self._policies, step)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return self.module(*args, **kwargs)  # evaluation: nothing is saved, so nothing to plan
        return checkpoint(self.module, *args, use_reentrant=False, context_fn=self._context_fn, **kwargs)


def with_plan(model: nn.Module, plan: MemoryPlan) -> PlannedModule:
    """`model`, running `plan`'s decisions inside `torch.compile` (``torch.compile(with_plan(model, plan))``) or
    eagerly (for a check): see the module docstring. From here on the model's converted convolutions run within
    the plan's workspace budgets. A plan that offloads raises `UnsupportedProblem`; one made for another model or
    input size, or read from JSON (it holds no captured step: plan again), `InvalidInput`."""
    if not isinstance(model, nn.Module):
        raise InvalidInput(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(plan, MemoryPlan):
        raise InvalidInput(f"plan must be a ucudnn.memory.MemoryPlan, got {type(plan).__name__}")
    offloaded = [t.name for t in plan.tensors if t.action == "offload"]
    if offloaded:
        raise UnsupportedProblem(
            f"the plan offloads {len(offloaded)} feature map(s) ({offloaded[0]}, ...), which a compiled step cannot "
            "do in this PyTorch (its partitioner does not consume CheckpointPolicy.MUST_CPU_OFFLOAD yet); plan with "
            "plan_memory(..., compiled=True), which keeps or recomputes"
        )
    if plan.capture is None:
        raise InvalidInput(
            f"plan for {plan.network!r} holds no captured step (read from JSON?): with_plan needs plan_memory's "
            "plan of this model; plan again with plan_memory(..., compiled=True)"
        )
    watch_inductor_buffers()  # so that a StepTracker counts the compiled step's buffers
    prep = _prepared(model, plan)
    assert prep.step is not None  # the plan's capture, adopted
    for conv in (m for m in model.modules() if isinstance(m, ConvLayer)):
        conv.handle.release_workspace()  # the plan counts the budgets' workspace, none kept between runs
    for conv, budgets in prep.budgets:
        conv._budgets = budgets
    return PlannedModule(model, plan, prep.step)
