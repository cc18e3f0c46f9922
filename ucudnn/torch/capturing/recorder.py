"""The recorder of a captured training step (`_Recorder`, see `ucudnn.torch.capturing.capture`): the dispatch
mode that sees every ATen operation, the saved-tensor hooks, the module and autograd-node hooks' callbacks, and
what it keeps of the step (`_Act` feature maps, `_Raw` forward operations, `_Buffer` backward storages, and
the `_Token` a saved feature map leaves with autograd), which `ucudnn.torch.capturing.graph` builds the step from."""

from __future__ import annotations

import functools
import time
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from ucudnn.torch.capturing.model_call import tensors_in
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
from ucudnn.torch.capturing.same_step import model_nodes


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

    def _watch(self, storage: Any, on_death: Callable[[], object]) -> None:
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
