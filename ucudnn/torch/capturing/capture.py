"""One training step captured as PyTorch runs it: what the planner needs to know of any model that runs.

    step = ucudnn.torch.capture(model, example_input)            # forward, the loss, backward
    step.graph                                                 # a TrainingGraph for ucudnn.memory

The model's own forward runs (Python control flow, `ModelOutput`s, hooks, custom autograd Functions,
in-place ops: nothing is traced symbolically), then the loss (`loss=`, a callable from the model's
output to the scalar one backpropagates; by default the output's ``loss`` where it has one, else the
sum of its floating tensors), then the backward pass. Three of PyTorch's instruments watch it:

- a `TorchDispatchMode` sees every ATen operation with its tensors: which storages each reads, makes
  or writes in place (the storage, not the tensor, is what memory holds: views and in-place results
  share it), its flops (`torch.utils.flop_counter`) and, in the backward pass, every buffer made;
- saved-tensor hooks see what autograd saves for the backward pass and when a backward step reads it;
- module hooks give each operation the module it runs in (its name), and the model's own hooks
  separate its forward pass from the loss; each autograd node's pre-hook marks a backward step.

Storages are watched to their death (a weak reference per storage), so what the program itself holds
(a Python variable until its function returns, a tensor kept in an attribute, the model's input) is
known and not mistaken for what autograd holds. Converted convolutions run as ucudnn's operator
(`through_operators`), one operation each, as `aten.convolution` is for torch's own.

**Fake by default.** The step runs under `FakeTensorMode`: nothing is computed, any batch can be
captured on a laptop, and autograd's saved tensors are not held by the capture, so that the moment the
program drops a saved tensor is seen too. A model whose Python reads tensor values (data-dependent
control flow) cannot run on fake tensors; with real example inputs it is then captured with real ones
(``fake=False`` asks for that: the model's parameters' gradients, its buffers and the random-number
state are put back afterwards), as is a step whose example input is a tensor subclass (MONAI's MetaTensor: its
own code runs on real tensors alone). A reduction's result is counted in the storage its real kernel returns it in
(`ucudnn.torch.capturing.operations.reduction_bytes`). The recorder that does all this is
`ucudnn.torch.capturing.recorder`; the graph is built by `ucudnn.torch.capturing.graph`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensor,
    FakeTensorMode,
    UnsupportedOperatorException,
)
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from ucudnn.backends.base import one_line
from ucudnn.errors import InvalidInput, UnsupportedProblem
from ucudnn.memory.graph import WEIGHT_GRADS
from ucudnn.torch.capturing.graph import CapturedOp, CapturedStep, build_step
from ucudnn.torch.capturing.model_call import batched_call, default_loss, input_leaves
from ucudnn.torch.capturing.operations import storage_key
from ucudnn.torch.capturing.recorder import _Recorder
from ucudnn.torch.capturing.same_step import autocast_state
from ucudnn.torch.converting.layer import through_operators

__all__ = ["CapturedOp", "CapturedStep", "capture", "diverged", "hook_nodes", "structure"]

_FAKE_LIMITS = (DataDependentOutputException, DynamicOutputShapeException, UnsupportedOperatorException)


def structure(model: nn.Module) -> tuple:
    """The model's modules by qualified name and class name: what a captured step's names rest on (a
    converted model's is its plain model's)."""
    return tuple((name, type(m).__qualname__) for name, m in model.named_modules())


def hook_nodes(root: Any, hook: Callable[[int, Any], None]) -> list[Any]:
    """A pre-hook on every autograd node a backward pass from `root` can run, called with the node's
    sequence number (which places it against the forward operation that made it); the hooks' handles."""
    handles, seen, stack = [], set(), [root]
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        handles.append(node.register_prehook(functools.partial(hook, node._sequence_nr())))
        stack.extend(fn for fn, _ in node.next_functions)
    return handles


def diverged(step: CapturedStep, i: int, func: Any) -> str:
    """How a step whose operation `i` was `func` differs from the captured `step`, in a few words (None: it ran
    `i` operations where the captured one ran more); the caller says why and what to do."""
    if func is None:
        return f"the step ran {i} operations where the captured one ran {len(step.ops)}"
    if i >= len(step.ops):
        return f"the step ran more operations than the captured one ({len(step.ops)}; the next was {func})"
    op = step.ops[i]
    where = f" in {op.module}" if op.module else ""
    return f"the step diverged from the captured one at operation {i}{where}: captured {op.func}, ran {func}"


# ---- running the step ----------------------------------------------------------------------------------------
@contextlib.contextmanager
def module_hooks(
    model: nn.Module,
    starts: Callable,
    ends: Callable,
    model_starts: Callable | None = None,
    model_ends: Callable | None = None,
) -> Iterator[None]:
    """Global module hooks (every module's forward: `starts`, `ends`) and, given, the model's own (its
    pre-hook first of all, its post-hook always called), removed on leaving."""
    handles = [
        nn.modules.module.register_module_forward_pre_hook(starts),
        nn.modules.module.register_module_forward_hook(ends, always_call=True),
    ]
    if model_starts is not None:
        handles.append(model.register_forward_pre_hook(model_starts, prepend=True))
    if model_ends is not None:
        handles.append(model.register_forward_hook(model_ends, always_call=True))
    try:
        yield
    finally:
        for h in handles:
            h.remove()


@contextlib.contextmanager
def state_kept(model: nn.Module) -> Iterator[None]:
    """The model's parameters' gradients (None inside, so that a backward pass makes them as a training
    step after `zero_grad()` does), its buffers and the random-number state, as they were afterwards."""
    params = list(model.parameters())
    grads = [p.grad for p in params]
    buffers = [(b, b.detach().clone()) for b in model.buffers()]
    try:
        for p in params:
            p.grad = None
        with torch.random.fork_rng(devices=[]):
            yield
    finally:
        with torch.no_grad():
            for p, g in zip(params, grads):
                p.grad = g
            for b, old in buffers:
                b.copy_(old)


def _run(
    model: nn.Module, args: tuple, kwargs: dict, loss: Callable, fake_mode: FakeTensorMode | None
) -> tuple[_Recorder, list]:
    """Run the step under a recorder; (recorder, (name, feature map) of each input tensor)."""
    names = {id(m): name for name, m in reversed(list(model.named_modules(remove_duplicate=False)))}
    state = _slots(model)
    if fake_mode is not None:
        with fake_mode:
            state = {name: fake_mode.from_tensor(t) for name, t in state.items()}
            for t in state.values():
                t.grad = None  # (a copy carries the parameter's gradient: the step makes its own, as after zero_grad())
            args, kwargs = _as_fake(fake_mode, (args, kwargs))
    persistent = {storage_key(t): t.untyped_storage().nbytes() for t in _held(state.values())}
    recorder = _Recorder(persistent, fake_mode is not None, names)
    inputs = [(name, recorder.input(t)) for name, t in input_leaves(model, args, kwargs) if isinstance(t, torch.Tensor)]

    def call() -> Any:
        if fake_mode is None:
            return model(*args, **kwargs)
        return torch.func.functional_call(model, state, args, kwargs, tie_weights=False, strict=False)

    # a module that the model's forward makes and calls on the spot (transformers' ConvBERT head calls
    # ``ACT2FN[...](x)``) is none of its modules: its operations are its caller's, as a function's are
    def starts(module: nn.Module, args: Any) -> None:
        if id(module) in names or recorder.phase != "model":
            recorder.module_starts(module, args)

    def ends(module: nn.Module, args: Any, output: Any) -> None:
        if id(module) in names or recorder.phase != "model":
            recorder.module_ends(module, args, output)

    with contextlib.ExitStack() as stack:
        if fake_mode is not None:
            stack.enter_context(fake_mode)
        stack.enter_context(recorder)
        stack.enter_context(torch.autograd.graph.saved_tensors_hooks(recorder.pack, recorder.unpack))
        stack.enter_context(module_hooks(model, starts, ends, recorder.model_starts, recorder.model_ends))
        stack.enter_context(through_operators())
        stack.enter_context(torch.enable_grad())
        output = call()
        value = loss(output)
        del output  # as a training loop drops it once the loss is computed
        if not isinstance(value, torch.Tensor) or value.numel() != 1 or not value.requires_grad:
            got = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
            raise InvalidInput(f"the loss must be a one-element tensor that requires grad, got {got}")
        recorder.phase = "backward"
        handles = hook_nodes(value.grad_fn, recorder._node_starts)
        try:
            value.backward()
        finally:
            for h in handles:
                h.remove()
            recorder.phase, recorder.done = "idle", True
        del value
        grads = [t.grad for t in state.values() if isinstance(t, torch.Tensor) and t.grad is not None]
        recorder.grads = {storage_key(g): g.untyped_storage().nbytes() for g in grads}
    return recorder, inputs


def _held(tensors: Any) -> Iterator[torch.Tensor]:
    """The tensors whose storages hold `tensors`' memory: a wrapper subclass's inner ones (FSDP2's DTensor
    parameter: its local shard; the wrapper's own storage is none, and reports the whole parameter's bytes)."""
    for t in tensors:
        if is_traceable_wrapper_subclass(t):
            yield from _held(getattr(t, name) for name in t.__tensor_flatten__()[0])
        elif isinstance(t, torch.Tensor):
            yield t


def _slots(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer of `model` by one name per place that holds it (a module's attribute), for
    `functional_call` to swap each place once. A module reached by two paths (MONAI's DynUNet holds its blocks
    in its skip layers too) is one place: named under both, torch swaps it twice and puts the first swap's fake
    tensor back. A tensor two modules hold (tied embeddings) is named in each, the same fake tensor in both."""
    return {
        f"{prefix}{'.' if prefix else ''}{leaf}": t
        for prefix, module in model.named_modules()
        for leaf, t in (*module._parameters.items(), *module._buffers.items())
        if t is not None
    }


@contextlib.contextmanager
def _quiet_fake_tensors() -> Iterator[None]:
    """FakeTensorMode logs a traceback for every operation its meta kernel refuses; the capture reports the
    failure itself, in one line, or captures on real tensors instead."""
    logger = logging.getLogger("torch._subclasses.fake_tensor")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)


def _as_fake(mode: FakeTensorMode, value: Any) -> Any:
    return torch.utils._pytree.tree_map(
        lambda t: mode.from_tensor(t) if isinstance(t, torch.Tensor) and not isinstance(t, FakeTensor) else t, value
    )


def capture(
    model: nn.Module,
    example_input: Any,
    *,
    loss: Callable[[Any], torch.Tensor] | None = None,
    fake: bool | None = None,
    weight_grads: str = "backward",
    name: str | None = None,
) -> CapturedStep:
    """Capture one training step of `model` on `example_input` (see the module docstring).

    `example_input`: a tensor, a tuple of positional arguments or a dict of keyword arguments; its batch
    (the first dimension of its first tensor) is the graph's. `loss`: the model's output to the scalar
    to backpropagate (`default_loss` when None). `fake`: True on fake tensors, False on real ones, None
    (default) fake where the model runs on fake tensors. `weight_grads` as `TrainingGraph` says.
    `name`: the graph's network name (the model's class name by default)."""
    if not isinstance(model, nn.Module):
        raise InvalidInput(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if weight_grads not in WEIGHT_GRADS:
        raise InvalidInput(f"weight_grads must be one of {', '.join(WEIGHT_GRADS)}, got {weight_grads!r}")
    if loss is not None and not callable(loss):
        raise InvalidInput(f"loss must be a callable from the model's output to a scalar, got {type(loss).__name__}")
    args, kwargs, leaves = batched_call(example_input)
    given = next((t.fake_mode for t in leaves if isinstance(t, FakeTensor)), None)
    if fake is False and given is not None:
        raise InvalidInput("fake=False needs real example inputs; these are fake tensors")
    loss = loss or default_loss
    title = name or type(model).__name__
    if fake is not None:
        attempts = [fake]
    elif given is not None:
        attempts = [True]
    elif any(type(t) not in (torch.Tensor, nn.Parameter) for t in leaves):
        # a subclass's own code (MONAI's MetaTensor's __torch_function__) runs on the real step alone: its fake
        # copy is a plain tensor, whose step makes other autograd nodes
        attempts = [False]
    else:
        attempts = [True, False]
    for use_fake in attempts:
        mode = (given or FakeTensorMode(allow_non_fake_inputs=True)) if use_fake else None
        try:
            with _quiet_fake_tensors() if use_fake else state_kept(model):
                recorder, inputs = _run(model, args, kwargs, loss, mode)
        except _FAKE_LIMITS as exc:
            if use_fake and len(attempts) > 1:
                continue  # the model reads tensor values: capture it on the real inputs
            raise UnsupportedProblem(
                f"{title} cannot run on fake tensors ({one_line(exc)}); capture it with real inputs (fake=False)"
            ) from None
        except (InvalidInput, UnsupportedProblem):
            raise
        except Exception as exc:  # noqa: BLE001 - the model's own error, in one line
            raise UnsupportedProblem(f"capturing a training step of {title} failed: {one_line(exc)}") from None
        step = build_step(recorder, inputs, title, int(leaves[0].shape[0]), weight_grads, use_fake)
        return dataclasses.replace(step, structure=structure(model), autocast=autocast_state())
    raise AssertionError("unreachable")
