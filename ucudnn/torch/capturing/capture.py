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
state are put back afterwards). A reduction's result is counted in the storage its real kernel returns it in
(`ucudnn.torch.capturing.operations.reduction_bytes`). The graph is built by `ucudnn.torch.capturing.graph`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import time
import weakref
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
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
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from ucudnn.backends.base import one_line
from ucudnn.errors import InvalidInput, UnsupportedProblem
from ucudnn.memory.graph import WEIGHT_GRADS
from ucudnn.torch.capturing.graph import CapturedOp, CapturedStep, build_step
from ucudnn.torch.capturing.model_call import batched_call, default_loss, input_leaves, tensors_in
from ucudnn.torch.capturing.operations import (
    conv_backward_copies,
    conv_backward_kinds,
    conv_spec,
    counted,
    flops,
    reduction_bytes,
    storage_key,
    written_keys,
)
from ucudnn.torch.capturing.same_step import autocast_state, model_nodes
from ucudnn.torch.converting.layer import through_operators

__all__ = ["CapturedOp", "CapturedStep", "capture", "diverged", "hook_nodes", "structure"]

_FAKE_LIMITS = (DataDependentOutputException, DynamicOutputShapeException, UnsupportedOperatorException)


def structure(model: nn.Module) -> tuple:
    """The model's modules by qualified name and class name: what a captured step's names rest on (a
    converted model's is its plain model's)."""
    return tuple((name, type(m).__qualname__) for name, m in model.named_modules())


# ---- what the recorder keeps ---------------------------------------------------------------------------
@dataclass(eq=False, slots=True)
class _Act:
    """A storage made in the step (an op's new output, or a model input): a feature map."""

    index: int  # in creation order
    nbytes: int
    owner: int  # the raw op making it (-1: a model input)
    leaf: int  # which of the owner's outputs
    shape: tuple[int, ...]
    dtype: torch.dtype
    writers: list[int] = field(default_factory=list)
    last_read: int = -1  # the last forward raw op reading it
    saved: bool = False
    died: tuple | None = None  # ("fwd", ops done) or ("bwd", step) when it died
    name: str = ""


@dataclass(eq=False, slots=True)
class _Raw:
    """One recorded forward operation."""

    func: Any
    module: str
    loss: bool
    node: int | None
    reads: list[_Act]
    weights: list[int]
    outputs: tuple
    made: list[_Act]
    writes: _Act | None
    flops: float
    bytes_moved: float
    ms: float
    conv: tuple | None = None  # a convolution's (x shape, w shape, stride, padding, dilation, transposed, groups)
    args: tuple = ()  # per tensor argument (flattened): its feature map, None for any other tensor


@dataclass(eq=False, slots=True)
class _Buffer:
    """A storage made by the backward pass."""

    key: int
    nbytes: int
    born: int
    died: int | None = None


class _Token:
    """What a saved tensor of a feature map leaves with autograd during the capture."""

    __slots__ = ("__weakref__", "act", "device", "dtype", "held", "offset", "save", "size", "stride")

    def __init__(self, act: _Act, t: torch.Tensor, held: torch.Tensor | None, save: int | None) -> None:
        self.act, self.size, self.stride, self.offset = act, t.size(), t.stride(), t.storage_offset()
        self.dtype, self.device, self.held, self.save = t.dtype, t.device, held, save


class _Recorder(TorchDispatchMode):
    """The dispatch mode, saved-tensor hooks and node hooks of one capture (see the module docstring)."""

    def __init__(self, persistent: Mapping[int, int], fake: bool, names: Mapping[int, str]) -> None:
        super().__init__()
        self.persistent = dict(persistent)  # storage -> bytes: parameters and buffers
        self.constants: dict[int, int] = {}  # other storages older than the step that it reads: id -> bytes
        self.live_constants: dict[int, int] = {}  # storage -> its id in `constants`, while it lives
        self.fake = fake
        self.real_bytes: dict[tuple, dict[int, int]] = {}  # `reduction_bytes`' cache
        self.names = names  # module id -> qualified name
        self.phase = "idle"  # model, loss, backward
        self.quiet = 0  # inside the recorder's own hooks: their operations are not the step's
        self.raw: list[_Raw] = []
        self.acts: list[_Act] = []
        self.live: dict[int, _Act] = {}  # storage -> its feature map, while it lives
        self.buffers: list[_Buffer] = []
        self.live_buffers: dict[int, _Buffer] = {}
        self.modules: list[str] = []
        self.model_ops = 0
        self.seq = torch._C._autograd._get_sequence_nr()
        self.first_seq = self.seq
        self.node_op: dict[int, int] = {}  # autograd node sequence number -> raw op
        self.bsteps: list[int | None] = []  # per backward step: the raw op whose node it runs (None: none)
        # the backward pass in order: (step, kind, what): a buffer's "birth" and "death", a saved feature
        # map's "read" (unpacked) and "release" (autograd let go of one of its saves)
        self.events: list[tuple[int, str, Any]] = []
        self.bkernels: dict[int, set[str]] = {}
        self.bcopies: dict[int, list[tuple[str, int, int]]] = {}  # per step: `conv_backward_copies` of its kernels
        self.step = -1
        self.done = False  # the backward pass is over
        self.grads: dict[int, int] = {}  # the parameters' gradients made: storage -> bytes
        # what the model's forward pass saved, in order: (feature map or None, shape, dtype, node, raw ops so far)
        self.saves: list[tuple] = []
        self.unpacked: set[int] = set()  # the saves a backward step unpacked (by index)
        # the model's module calls in order: [name, raw ops before, saves before, raw ops at its end]
        self.calls: list[list] = []
        self.open_calls: list[int] = []  # per module on the stack: its call's place in `calls` (-1: none)
        self.model_nodes = 0  # autograd nodes the model's forward pass made
        self.node_kinds: list[tuple[int, str]] = []  # the model's own of them (`model_nodes`)
        self.inputs: list[torch.Tensor] = []  # the model's input tensors
        self._refs: list[weakref.ref] = []

    # -- positions --------------------------------------------------------------------------------------
    def _position(self) -> tuple | None:
        if self.done:
            return None  # alive to the step's end
        return ("bwd", max(self.step, 0)) if self.phase == "backward" else ("fwd", len(self.raw))

    def _watch(self, storage: Any, on_death: Callable[[], None]) -> None:
        self._refs.append(weakref.ref(storage, lambda _: on_death()))

    def input(self, t: torch.Tensor) -> _Act:
        """Register a model input as a feature map."""
        self.inputs.append(t)
        return self._new_act(t, -1, 0)

    def _new_act(self, t: torch.Tensor, owner: int, leaf: int, nbytes: int = 0) -> _Act:
        storage = t.untyped_storage()
        act = _Act(len(self.acts), max(nbytes, storage.nbytes()), owner, leaf, tuple(t.shape), t.dtype)
        self.acts.append(act)
        self.live[storage._cdata] = act
        self._watch(storage, functools.partial(self._act_died, act, storage._cdata))
        return act

    def _constant(self, t: torch.Tensor, key: int) -> int:
        """The id in `constants` of a storage older than the step that it reads (a scalar lifted to a tensor, a
        tensor kept in an attribute), new while it lives. Watched to its death: its key, a StorageImpl's address, is
        another storage's once it died (a temporary's, read once), which would otherwise pass for it, never
        becoming a feature map (Whisper's shifted labels, then a gelu feeding its second convolution)."""
        mine = self.live_constants.get(key)
        if mine is None:
            storage = t.untyped_storage()
            mine = self.live_constants[key] = -1 - len(self.constants)  # (keys are addresses: never negative)
            self.constants[mine] = storage.nbytes()
            self._watch(storage, functools.partial(self.live_constants.pop, key, None))
        return mine

    def _act_died(self, act: _Act, key: int) -> None:
        self.live.pop(key, None)
        act.died = self._position()

    # -- the forward pass and the loss --------------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.quiet or self.phase == "idle":
            return func(*args, **kwargs)
        if self.phase == "backward":
            return self._backward_op(func, args, kwargs)
        return self._forward_op(func, args, kwargs)

    def _forward_op(self, func, args, kwargs):
        index = len(self.raw)
        seq = torch._C._autograd._get_sequence_nr()
        written = written_keys(func, args, kwargs)
        reads: list[_Act] = []
        weights: list[int] = []
        writes: _Act | None = None
        in_bytes = 0
        roles: list[_Act | None] = []
        for t in tree_leaves((args, kwargs)):
            if not isinstance(t, torch.Tensor):
                continue
            key = storage_key(t)
            in_bytes += t.numel() * t.element_size()
            act = self.live.get(key)
            roles.append(act)
            if act is not None:
                if key in written and writes is None:
                    writes = act
                elif act not in reads:
                    reads.append(act)
                act.last_read = index
            else:
                weights.append(key if key in self.persistent else self._constant(t, key))
        start = time.perf_counter()
        out = func(*args, **kwargs)
        ms = (time.perf_counter() - start) * 1e3
        leaves = tree_leaves(out)
        if not counted(func, leaves):
            return out
        node = seq - 1 if seq != self.seq else None  # autograd made this op's node just before dispatching it
        self.seq = seq
        outputs, new, out_bytes = [], [], 0
        for leaf, t in enumerate(leaves):
            if not isinstance(t, torch.Tensor):
                outputs.append(None)
                continue
            outputs.append((tuple(t.shape), t.dtype))
            out_bytes += t.numel() * t.element_size()
            key = storage_key(t)
            if (
                key not in self.live
                and key not in self.persistent
                and key not in self.live_constants
                and t.untyped_storage().nbytes() > 0
                and key not in {storage_key(m) for _, m in new}
            ):
                new.append((leaf, t))
        real = reduction_bytes(func, args, kwargs, [t for _, t in new], self.real_bytes) if self.fake and new else {}
        made = [self._new_act(t, index, leaf, real.get(leaf, 0)) for leaf, t in new]
        self.raw.append(
            _Raw(
                func,
                self.modules[-1] if self.modules else "",
                self.phase == "loss",
                node,
                reads,
                weights,
                tuple(outputs),
                made,
                None if made else writes,
                flops(func, args, kwargs, out, out_bytes),
                float(in_bytes + out_bytes),
                ms,
                conv_spec(func, args),
                tuple(roles),
            )
        )
        if node is not None:
            self.node_op[node] = index
        if writes is not None and not made:
            writes.writers.append(index)
        return out

    # -- saved tensors ---------------------------------------------------------------------------------------
    def pack(self, t: torch.Tensor) -> Any:
        if self.phase not in ("model", "loss"):
            return t
        self.quiet += 1
        try:
            act = self.live.get(storage_key(t))
            if self.phase == "model":  # autograd made the node that saves it just before (see `_forward_op`)
                self.saves.append(
                    (act, tuple(t.shape), t.dtype, torch._C._autograd._get_sequence_nr() - 1, len(self.raw))
                )
            if act is None:
                return t  # a parameter, a buffer: never planned
            act.saved = True
            save = len(self.saves) - 1 if self.phase == "model" else None
            token = _Token(act, t, None if self.fake else t.detach(), save)
            self._refs.append(weakref.ref(token, functools.partial(self._released, act)))
            return token
        finally:
            self.quiet -= 1

    def unpack(self, saved: Any) -> torch.Tensor:
        if not isinstance(saved, _Token):
            return saved
        self._event("read", saved.act)
        if saved.save is not None:
            self.unpacked.add(saved.save)
        if saved.held is not None:
            return saved.held
        self.quiet += 1  # a stand-in of the right geometry: on fake tensors the values are never read
        try:
            span = 1 + sum((s - 1) * st for s, st in zip(saved.size, saved.stride)) if all(saved.size) else 0
            base = torch.empty(saved.offset + span, dtype=saved.dtype, device=saved.device)
            return base.as_strided(saved.size, saved.stride, saved.offset)
        finally:
            self.quiet -= 1

    # -- the backward pass -----------------------------------------------------------------------------------
    def _node_starts(self, seq: int, grads: Any) -> None:
        self.step += 1
        self.bsteps.append(self.node_op.get(seq))

    def _backward_op(self, func, args, kwargs):
        out = func(*args, **kwargs)
        if getattr(func, "is_view", False):
            return out
        step = max(self.step, 0)
        kinds = conv_backward_kinds(func, args, kwargs)
        if kinds:
            self.bkernels.setdefault(step, set()).update(kinds)
            self.bcopies.setdefault(step, []).extend(conv_backward_copies(func, args, kwargs))
        read = {storage_key(t) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor):
                continue
            storage = t.untyped_storage()
            key = storage._cdata
            if (
                key in read
                or key in self.live
                or key in self.live_buffers
                or key in self.persistent
                or storage.nbytes() == 0
            ):
                continue  # a view or an in-place result
            buffer = _Buffer(key, storage.nbytes(), step)
            self.buffers.append(buffer)
            self.live_buffers[key] = buffer
            self._event("birth", buffer)
            self._watch(storage, functools.partial(self._buffer_died, buffer))
        return out

    def _buffer_died(self, buffer: _Buffer) -> None:
        self.live_buffers.pop(buffer.key, None)
        if not self.done:
            buffer.died = max(self.step, 0)
            self._event("death", buffer)

    def _released(self, act: _Act, _: Any) -> None:
        if self.phase == "backward":
            self._event("release", act)

    def _event(self, kind: str, what: Any) -> None:
        self.events.append((max(self.step, 0), kind, what))

    # -- module names and the model's forward pass -------------------------------------------------------
    def module_starts(self, module: nn.Module, args: Any) -> None:
        self.modules.append(self.names.get(id(module), type(module).__name__))
        self.open_calls.append(len(self.calls) if self.phase == "model" else -1)
        if self.phase == "model":
            self.calls.append([self.modules[-1], len(self.raw), len(self.saves), None])

    def module_ends(self, module: nn.Module, args: Any, output: Any) -> None:
        if self.modules:
            self.modules.pop()
            call = self.open_calls.pop()
            if call >= 0:
                self.calls[call][3] = len(self.raw)

    def model_starts(self, module: nn.Module, args: Any) -> None:
        if self.phase == "idle":
            self.phase = "model"
            self.model_nodes = -torch._C._autograd._get_sequence_nr()

    def model_ends(self, module: nn.Module, args: Any, output: Any) -> None:
        if self.phase == "model":
            self.phase = "loss"
            self.model_ops = len(self.raw)
            first = -self.model_nodes
            self.model_nodes += torch._C._autograd._get_sequence_nr()
            self.node_kinds = model_nodes(tensors_in(output), first, self.inputs)


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
    state = dict(model.named_parameters(remove_duplicate=False)) | dict(model.named_buffers(remove_duplicate=False))
    if fake_mode is not None:
        with fake_mode:
            state = {name: fake_mode.from_tensor(t) for name, t in state.items()}
            for t in state.values():
                t.grad = None  # (a copy carries the parameter's gradient: the step makes its own, as after zero_grad())
            args, kwargs = _as_fake(fake_mode, (args, kwargs))
    persistent = {storage_key(t): t.untyped_storage().nbytes() for t in state.values()}
    recorder = _Recorder(persistent, fake_mode is not None, names)
    inputs = [(name, recorder.input(t)) for name, t in input_leaves(model, args, kwargs) if isinstance(t, torch.Tensor)]

    def call() -> Any:
        if fake_mode is None:
            return model(*args, **kwargs)
        return torch.func.functional_call(model, state, args, kwargs, tie_weights=True, strict=False)

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
    attempts = [True] if fake else [False] if fake is False else [True, False] if given is None else [True]
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
