"""`with_plan`: a memory plan carried by a module, so that a trainer that calls the model, computes the loss and
runs the backward pass itself (Lightning, the Hugging Face Trainer, accelerate, DDP) trains under it, eagerly or
inside `torch.compile`.

    plan = ucudnn.torch.plan_memory(model, x, memory_limit="2GiB", loss=...)
    planned = ucudnn.torch.with_plan(model, plan)
    loss(planned(x)).backward()                            # eager: the whole plan (keep, offload, recompute)
    step = torch.compile(ucudnn.torch.with_plan(model, compiled_plan))  # compiled: plan_memory(..., compiled=True)

**Called eagerly** (not under Dynamo's trace: `torch.compiler.is_compiling()`), each training call runs through
`execute_plan`'s executor (`ucudnn.torch.running.executor._Executor.run`): one executor per forward call, whose
hooks (`execute_plan`'s model hooks, called around the model's forward instead of registered on it; the scoped
modules' hooks; the saved-tensor hooks and dispatch mode at the calls where the plan acts) are all gone when the
call returns or raises, whatever it raises. What the backward pass needs (offloaded and dropped saves, the prefetch
hook on the output's node) the graph's saves hold, so the backward pass runs whenever the caller runs it, and the
executor goes with the graph: after the backward pass has consumed it, or when the graph is dropped unused. Each
call is a step of the plan: one backward per forward (gradient accumulation) and several forwards before one
backward both work, each call with its own saves (and its own host buffers while they are in use). The counted peak
is then `execute_plan`'s, the plan's prediction. Under `torch.no_grad`, `torch.inference_mode` or in `eval()` mode
the model runs as it is (an evaluation is not a training step). `stats` is the last planned call's `ExecutionStats`.

**What the module shows a trainer.** Its `forward` has the model's signature (the HF Trainer keeps the dataset
columns it names and passes loss keywords where it has ``**kwargs``), and so has its class's, a `PlannedModule`
made per wrapped class (the Trainer reads the label names off the class: `_planned_class`); the model is `module` (where
`unwrap_model`-style helpers look) and its public attributes (``config``) read through.

**Compiled**, the plan's decisions reach PyTorch as per-operation checkpoint policies. A compiled step keeps what
its partitioner decides, and PyTorch lets a program steer that decision per operation: selective activation
checkpointing (`torch.utils.checkpoint.create_selective_checkpoint_contexts`) tags each operation of a
checkpointed region `MUST_SAVE` or `MUST_RECOMPUTE`, and AOTAutograd's partitioner obeys the tags. So
`with_plan` runs the model's forward pass as one checkpointed region whose policy says, operation by operation,
what the plan does with the feature map it makes: kept maps are saved (`MUST_SAVE`), recomputed ones recomputed
(`MUST_RECOMPUTE`; where Inductor fuses a pointwise recomputation into its consumer, almost for free). An operation
that makes no map of the plan's (on parameters alone) or only maps the backward pass does not read is
`PREFER_RECOMPUTE`, which 2.13's partitioner treats as `MUST_RECOMPUTE`. Converted convolutions run within the plan's
workspace budgets: the budgets are the layers' from `with_plan` on (the compiled graph reads them when it runs,
the backward pass's kernels too, which run after the forward call has returned; so do the eager module's).

**Which operation is which.** The policy sees the forward pass's ATen operations in order, as the capture saw
them, but as the compiler traces them: batch-norm may be another overload (`_native_batch_norm_legit`), an
instance norm may add a copy. So operations are matched to the captured ones in order, by family
(`_family`), an unmatched one taking the action of the operation before it (its module's output, copied); a
trace that leaves captured operations unmatched is refused in one line. Views are not operations here, as in
the capture (`counted`). An operation that updates state (batch-norm's running statistics) is saved where the
region runs eagerly (Dynamo falling back), so that a replay does not update it twice.

**Not carried compiled: offloading.** `CheckpointPolicy.MUST_CPU_OFFLOAD` names it, but PyTorch 2.13's partitioner
does not consume it: a compiled step of a plan that offloads is refused in one line where it runs
(`plan_memory(..., compiled=True)` plans without); eagerly the module offloads.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from ucudnn.errors import InvalidInput, UnsupportedProblem
from ucudnn.memory.plan import MemoryPlan
from ucudnn.torch.capturing.capture import CapturedStep
from ucudnn.torch.capturing.operations import CONVOLUTIONS
from ucudnn.torch.converting.layer import ConvLayer
from ucudnn.torch.running.executor import _Executor
from ucudnn.torch.running.labels import watch_inductor_buffers
from ucudnn.torch.running.prepared_plan import _prepared
from ucudnn.torch.running.stats import ExecutionStats

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
    """`model` whose forward pass runs under a memory plan's decisions, eagerly or compiled (`with_plan`). Its
    `forward` has the model class's signature (`_planned_class`); `module` is the model, whose public attributes (a Hugging Face
    model's ``config``) it reads through; `stats` the `ExecutionStats` of its last planned eager step."""

    def __init__(
        self, model: nn.Module, plan: MemoryPlan, step: CapturedStep, prefetch_ahead: int = 1, acting: bool = True
    ) -> None:
        super().__init__()
        self._acting = acting  # (the plan's: whether it offloads, recomputes or releases a map autograd saves)
        self.module = model
        self.plan = plan
        self.prefetch_ahead = prefetch_ahead
        self.stats: ExecutionStats | None = None
        self._step = step
        ops = step.ops[: step.model_ops]
        self._families = tuple(_family(op.func) for op in ops)
        self._policies = _policies(step, plan)
        self._offloads = [t.name for t in plan.tensors if t.action == "offload"]
        # (a partial, not a bound method: Dynamo keeps a context_fn as a constant, to call when AOTAutograd traces)
        self._context_fn = functools.partial(_contexts, self._families, self._policies, step)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name.startswith("_") or name == "module":  # (PyTorch's and the trainers' probes stay this module's)
                raise
            return getattr(self.module, name)

    def gradient_checkpointing_enable(self, *args: Any, **kwargs: Any) -> None:
        """Refused (the Hugging Face Trainer's ``gradient_checkpointing=True`` calls it): the plan decides."""
        raise UnsupportedProblem(
            "gradient checkpointing on a planned module: the plan decides what is recomputed; enable it on the "
            "model before plan_memory (the plan is then made for the checkpointed step), or leave it off"
        )

    activation_checkpointing_enable = gradient_checkpointing_enable

    def forward(self, *args: Any, **kwargs: Any) -> Any:  # (`_planned_class` gives it the model's signature)
        return self._forward(args, kwargs)

    def _forward(self, args: tuple, kwargs: dict) -> Any:
        if not torch.is_grad_enabled() or not self.training:
            return self.module(*args, **kwargs)  # evaluation: not a training step, nothing to plan
        if torch.compiler.is_compiling():
            if self._offloads:
                _refuse_compiled_offload(self._offloads)
            return checkpoint(self.module, *args, use_reentrant=False, context_fn=self._context_fn, **kwargs)
        if not self._acting:  # every map kept: the plain step, its budgets set (`with_plan`), costs nothing more
            return self.module(*args, **kwargs)
        executor = _Executor(self.module, _prepared(self.module, self.plan), self.prefetch_ahead)
        self.stats = executor.stats
        return executor.run(args, kwargs)


@torch.compiler.disable
def _refuse_compiled_offload(offloaded: list[str]) -> None:
    """Raised where the compiled step runs (outside Dynamo's trace, which would fall back to the eager step)."""
    raise UnsupportedProblem(
        f"the plan offloads {len(offloaded)} feature map(s) ({offloaded[0]}, ...), which a compiled step cannot do "
        "in this PyTorch (its partitioner does not consume CheckpointPolicy.MUST_CPU_OFFLOAD yet); plan with "
        "plan_memory(..., compiled=True), which keeps or recomputes, or run the module without torch.compile"
    )


def with_plan(model: nn.Module, plan: MemoryPlan, *, prefetch_ahead: int = 1) -> PlannedModule:
    """`model`, running `plan`'s decisions wherever it is called (see the module docstring): eagerly through
    `execute_plan`'s executor (keep, offload, recompute, the conv budgets), the backward pass whenever the caller
    runs it; inside `torch.compile` (``torch.compile(with_plan(model, plan))``) as checkpoint policies. Under
    `torch.no_grad` / `torch.inference_mode` or in `eval()` mode it runs `model` as it is. From here on the
    model's converted convolutions run within the plan's workspace budgets. `prefetch_ahead` as `execute_plan`'s.
    A plan made for another model or input size, or read from JSON (it holds no captured step: plan again),
    raises `InvalidInput`; a compiled step of a plan that offloads, `UnsupportedProblem`."""
    if not isinstance(model, nn.Module):
        raise InvalidInput(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if isinstance(model, PlannedModule):
        raise InvalidInput("model is a PlannedModule already: give with_plan its .module")
    if not isinstance(plan, MemoryPlan):
        raise InvalidInput(f"plan must be a ucudnn.memory.MemoryPlan, got {type(plan).__name__}")
    if isinstance(prefetch_ahead, bool) or not isinstance(prefetch_ahead, int) or prefetch_ahead < 0:
        raise InvalidInput(f"prefetch_ahead must be a non-negative integer, got {prefetch_ahead!r}")
    if plan.capture is None:
        raise InvalidInput(
            f"plan for {plan.network!r} holds no captured step (read from JSON?): with_plan needs plan_memory's "
            "plan of this model; plan again with plan_memory"
        )
    watch_inductor_buffers()  # so that a StepTracker counts the compiled step's buffers
    prep = _prepared(model, plan)
    assert prep.step is not None  # the plan's capture, adopted
    for conv in (m for m in model.modules() if isinstance(m, ConvLayer)):
        conv.handle.release_workspace()  # the plan counts the budgets' workspace, none kept between runs
    for conv, budgets in prep.budgets:
        conv._budgets = budgets
    planned = _planned_class(type(model))  # type: ignore[arg-type]  # (a class is hashable; mypy reads nn.Module's __hash__)
    return planned(model, plan, prep.step, prefetch_ahead, prep.acting)


@functools.cache
def _planned_class(cls: type) -> type[PlannedModule]:
    """`PlannedModule` named for the wrapped class (``PlannedMobileNetV2ForImageClassification``), its `forward`
    with that class's signature: a trainer reads it (the Hugging Face Trainer keeps the dataset columns
    ``model.forward`` names, and reads the label names and ``return_loss`` off the model's class,
    `transformers.utils.find_labels(model.__class__)`)."""

    def forward(self: PlannedModule, *args: Any, **kwargs: Any) -> Any:
        return self._forward(args, kwargs)

    try:
        method = cls.forward  # type: ignore[attr-defined]
        forward.__signature__ = inspect.signature(method)  # type: ignore[attr-defined]
        forward.__doc__ = method.__doc__
    except (TypeError, ValueError):  # none to give
        return PlannedModule
    namespace = {"forward": forward, "__module__": PlannedModule.__module__, "__doc__": PlannedModule.__doc__}
    return type(f"Planned{cls.__name__}", (PlannedModule,), namespace)
