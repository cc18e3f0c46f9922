"""Exact memory accounting of a training step: the bytes of every live tensor storage, by category, over time.

    with StepTracker(model) as tracker:
        loss = criterion(model(x), y)
        loss.backward()
    tracker.report().peak_bytes          # what the simulator's peak counts, exact

A `StepTracker` is a `TorchDispatchMode`: it sees every tensor an operation returns and keys it by its
storage (`untyped_storage()`), with a weak reference whose callback files the storage's bytes as freed
when the storage dies. So a view or an in-place result (the same storage) counts once, and memory is
counted from what is live, never read from RSS (which keeps what the C allocator freed). This is how
PyTorch's own `torch.distributed._tools.mem_tracker.MemTracker` counts; it is not used itself because
its categories are fixed (parameter, buffer, gradient, activation, temporary, optimizer state) and it
keeps peaks, not a timeline, where checking a plan needs the executor's host copies and the handles'
workspaces as categories of their own and memory over the step as the simulator draws it.

Categories (`ucudnn.torch.running.labels.CATEGORIES`):

- ``weight``: the model's parameters and buffers; ``weight_grad``: their gradients (a gradient made
  in the step is refiled from ``tensor`` when autograd accumulates it, by a post-accumulate hook).
- ``tensor``: every other storage on the tracked device: feature maps, their gradients, what
  autograd saves, what an operation returns. A tensor alive before the tracker started counts from
  the first operation that reads it (or from `track`).
- ``host``: the executor's host copies of offloaded tensors (allocated inside `allocated_as("host")`,
  which `ucudnn.torch.running.executor` does, and those its model's prepared plans pool between steps), and,
  when the tracked device is a GPU, anything in host memory.
- ``workspace``: the workspace buffers of the ucudnn handles of the model's converted convolutions
  (the handles `execute_plan` swaps in included). They are NumPy or CuPy memory, outside PyTorch's
  dispatch, so they are read from the handles (`Handle.workspace_bytes`, the buffers a handle keeps)
  at every event, and a workspace held for one run only (a plan's budget) is reported by the handle
  itself as it is taken and given back (`Handle.workspace_listener`). The handle names the arrays each
  run writes and reads too: a result ucudnn's operator allocated below this mode's dispatch, and its
  operands' copies into the kernel's layout (a channels-last map where the kernels run NCHW), count as
  ``tensor``s from the kernel's start, as the simulator holds them beside its workspace.

The device's bytes are every category but ``host``: what a `MemoryPlan`'s ``peak_bytes`` counts
(weights, weight gradients, feature maps, gradients and workspaces). `TrackerReport.memory` is
``(time_ms, bytes)`` at every change, as `ucudnn.memory.simulate.DeviceResult.memory`.

A wrapper subclass holds no memory of its own: a DTensor (FSDP2's sharded parameter) counts as its local
shard. A storage resized outside dispatch (`UntypedStorage.resize_`: FSDP2 frees a gathered parameter by
resizing it to 0 bytes and gathers into it again) holds its new bytes from then.

Not counted, as in MemTracker: memory an operator allocates and frees inside its own kernel (an
im2col buffer of PyTorch's CPU convolution), and tensors made under ``no_dispatch``. Unlike it, a storage
that wraps memory a live storage holds (`torch.from_numpy` of a NumPy view of a tensor, as a converted
conv's micro-batches are passed to PyTorch's own kernel) is an alias of no bytes of its own. On CUDA the caching
allocator's own peak (`torch.cuda.max_memory_allocated`, which sees those too) is reported beside
the count as a second witness (`TrackerReport.allocator_peak_bytes`).
"""

from __future__ import annotations

import contextlib
import time
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Self

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_leaves

from ucudnn.errors import InvalidInput
from ucudnn.torch.running.labels import (
    CATEGORIES,
    check_category,
    current_label,
    watch_inductor_buffers,
    watching,
)

if TYPE_CHECKING:
    from ucudnn.torch.converting.layer import ConvLayer

__all__ = ["DEVICE_CATEGORIES", "StepTracker", "TrackerReport"]

DEVICE_CATEGORIES = ("weight", "weight_grad", "tensor", "workspace")

# What is told of each storage resized outside dispatch (`_watching_resizes`), innermost last.
_RESIZE_WATCHERS: list[Any] = []
_STORAGE_RESIZE = torch._C.StorageBase.resize_  # type: ignore[attr-defined]


def _resize(storage: Any, size: int) -> Any:
    out = _STORAGE_RESIZE(storage, size)
    for watcher in _RESIZE_WATCHERS:
        watcher(storage)
    return out


@contextlib.contextmanager
def _watching_resizes(callback: Any) -> Any:
    """Inside this block, `callback(storage)` after each `UntypedStorage.resize_`: FSDP2 frees a gathered parameter
    by resizing its storage to 0 bytes and gathers it again into the same storage resized back, no operation of
    PyTorch's dispatch (which a tensor's ``resize_`` is). The method is wrapped while a tracker counts, only."""
    if not _RESIZE_WATCHERS:
        torch.UntypedStorage.resize_ = _resize  # type: ignore[method-assign,assignment]
    _RESIZE_WATCHERS.append(callback)
    try:
        yield
    finally:
        _RESIZE_WATCHERS.remove(callback)
        if not _RESIZE_WATCHERS:
            del torch.UntypedStorage.resize_  # (StorageBase's again)


@dataclass(frozen=True, slots=True)
class TrackerReport:
    """What one tracked block held: peaks, the categories at the device's peak, and memory over time."""

    device: str
    peak_bytes: int  # the device's (every category but host) at its highest
    peak_by_category: dict[str, int]  # each category at the moment of the device's peak
    max_by_category: dict[str, int]  # each category at its own highest
    host_peak_bytes: int
    total_peak_bytes: int  # every category, host copies included (on a CPU, one memory)
    memory: tuple[tuple[float, int], ...]  # (ms since the start, device bytes) at every change
    host_memory: tuple[tuple[float, int], ...]
    end_by_category: dict[str, int]  # what was still live when the block ended
    allocator_peak_bytes: int | None = None  # CUDA: torch.cuda.max_memory_allocated in the block

    def to_json(self) -> dict:
        return {
            "device": self.device,
            "peak_bytes": self.peak_bytes,
            "peak_by_category": self.peak_by_category,
            "max_by_category": self.max_by_category,
            "host_peak_bytes": self.host_peak_bytes,
            "total_peak_bytes": self.total_peak_bytes,
            "end_by_category": self.end_by_category,
            "allocator_peak_bytes": self.allocator_peak_bytes,
            "memory": [list(m) for m in self.memory],
        }


class _Entry:
    __slots__ = ("alias", "category", "nbytes", "ptr", "ref")

    def __init__(self, category: str, nbytes: int, ref: weakref.ref, ptr: int, alias: bool) -> None:
        self.category, self.nbytes, self.ref, self.ptr, self.alias = category, nbytes, ref, ptr, alias


class StepTracker(TorchDispatchMode):
    """Counts the live storages of a block, by category (see the module docstring).

    `model`: its parameters and buffers are ``weight``, their gradients ``weight_grad``, and its
    ucudnn convolutions' handles give ``workspace``. `device`: the device whose memory is counted
    (default: the model's parameters', else the CPU). One use per tracker.
    """

    # a compiled step's higher-order operators (`run_and_save_rng_state`, around an operation that draws random
    # numbers, such as attention's with dropout: diffusers' UNet) reach `__torch_dispatch__` as one operation each,
    # their outputs counted as any operation's (else PyTorch refuses them under the tracker)
    supports_higher_order_operators = True

    def __init__(self, model: nn.Module | None = None, *, device: torch.device | str | None = None) -> None:
        super().__init__()
        if model is not None and not isinstance(model, nn.Module):
            raise InvalidInput(f"model must be a torch.nn.Module, got {type(model).__name__}")
        if device is None:
            first = next(iter(model.parameters()), None) if model is not None else None
            device = first.device if first is not None else torch.device("cpu")
        self.device = torch.device(device)
        self.model = model
        self._live: dict[int, _Entry] = {}  # StorageImpl address -> entry, while the storage lives
        self._bytes = dict.fromkeys(CATEGORIES, 0)
        self._max = dict.fromkeys(CATEGORIES, 0)
        self._peak = 0
        self._peak_by = dict.fromkeys(CATEGORIES, 0)
        self._host_peak = 0
        self._total_peak = 0
        self._memory: list[tuple[float, int]] = []
        self._host_memory: list[tuple[float, int]] = []
        self._start = 0.0
        self._convs: list[ConvLayer] = []
        self._hooks: list[Any] = []
        self._listening: list[Any] = []  # handles whose per-run workspaces report to this tracker
        self._transient = 0  # bytes of those workspaces held now
        self._unseen: dict[int, int] = {}  # results a running operator's kernels wrote: address -> bytes
        self._params: set[int] = set()
        self._report: TrackerReport | None = None
        self._used = False
        self._watches = contextlib.ExitStack()  # the watches of memory allocated outside dispatch
        watch_inductor_buffers()  # (before the code to count is compiled, where the tracker is made first)

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        """Let `torch.compile`d code run compiled while tracked (by default Dynamo falls back to eager
        under a dispatch mode): its aten calls are counted, and the buffers its generated CPU kernels allocate
        themselves (Inductor's ``empty_strided_cpu``, outside dispatch) where that code was compiled after
        the first tracker was made or `with_plan` called (`running.labels.watch_inductor_buffers`)."""
        return True

    # ---- entering and leaving ------------------------------------------------------------------
    def __enter__(self) -> Self:
        if self._used:
            raise InvalidInput("a StepTracker counts one block; make a new one for the next")
        self._used = True
        self._start = time.perf_counter()
        if self.device.type == "cuda":  # pragma: no cover - needs a GPU
            torch.cuda.synchronize(self.device)  # measuring: the witness below starts from here
            torch.cuda.reset_peak_memory_stats(self.device)
        try:  # whatever stops the installing (a KeyboardInterrupt too), nothing installed stays: `with` calls no __exit__
            self._install()
            return super().__enter__()
        except BaseException:
            self._uninstall()
            raise

    def _install(self) -> None:
        if self.model is not None:
            from ucudnn.torch.converting.layer import ConvLayer
            from ucudnn.torch.running.prepared_plan import held_host_buffers

            self._convs = [m for m in self.model.modules() if isinstance(m, ConvLayer)]
            for handle in {id(c.handle): c.handle for c in self._convs}.values():
                handle.workspace_listener = self._workspace_event
                self._listening.append(handle)
            for p in self.model.parameters():
                self.track(p, "weight")
                self._params.add(id(p))
                if p.grad is not None:
                    self.track(p.grad, "weight_grad")
                if p.requires_grad:
                    self._hooks.append(p.register_post_accumulate_grad_hook(self._grad_accumulated))
            for b in self.model.buffers():
                self.track(b, "weight")
            for host in held_host_buffers(self.model):  # a plan's pooled host copies, kept between its steps
                self.track(host, "host")
        self._sample()
        self._watches.enter_context(_watching_resizes(self._resized))
        self._watches.enter_context(watching(self.track))

    def _uninstall(self) -> None:
        """Take back every hook, listener and watch the tracker installed, each even where another fails."""
        try:
            self._watches.close()  # (each watch's exit, even where another's fails)
        finally:
            for h in self._hooks:
                h.remove()
            self._hooks = []
            for handle in self._listening:
                handle.workspace_listener = None
            self._listening = []

    def __exit__(self, *exc: object) -> None:
        try:
            super().__exit__(*exc)
        finally:
            self._uninstall()
        witness = None
        if self.device.type == "cuda":  # pragma: no cover - needs a GPU
            torch.cuda.synchronize(self.device)
            witness = int(torch.cuda.max_memory_allocated(self.device))
        self._sample()
        self._report = TrackerReport(
            str(self.device),
            self._peak,
            dict(self._peak_by),
            dict(self._max),
            self._host_peak,
            self._total_peak,
            tuple(self._memory),
            tuple(self._host_memory),
            dict(self._bytes),
            witness,
        )
        # stop counting: the callbacks of storages that die later find nothing to change
        self._live = {}

    def report(self) -> TrackerReport:
        """The counts of the block (after it ended)."""
        if self._report is None:
            raise InvalidInput("the tracker's block has not ended yet: call report() after the with block")
        return self._report

    # ---- counting --------------------------------------------------------------------------------
    def track(self, t: torch.Tensor, category: str | None = None) -> None:
        """Count `t`'s storage (a tensor alive before the block) under `category` (default: by its device)."""
        if category is not None:
            check_category(category)
        self._see(t, category)
        self._sample()

    def _category_for(self, device: torch.device, labelled: bool) -> str:
        label = current_label() if labelled else None
        if label is not None:
            return label
        if device != self.device and device.type == "cpu":
            return "host"
        return "tensor"

    def _see(self, t: torch.Tensor, category: str | None, labelled: bool = True) -> None:
        """Count `t`'s storage if new (under `category`, else by `allocated_as` when `labelled`, else by
        device), refile it under `category` if given, and follow a change of its size. A wrapper subclass (FSDP2's
        DTensor parameters) holds no memory of its own: its inner tensors (a DTensor's local shard) are counted."""
        if t.device.type == "meta" or t.layout != torch.strided:
            return
        if is_traceable_wrapper_subclass(t):
            for name in t.__tensor_flatten__()[0]:
                inner = getattr(t, name)
                if isinstance(inner, torch.Tensor):
                    self._see(inner, category, labelled)
            return
        try:
            storage = t.untyped_storage()
        except (RuntimeError, NotImplementedError):  # a tensor subclass without storage of its own (fake, functional)
            return
        self._see_storage(storage, t.device, category, labelled)

    def _resized(self, storage: Any) -> None:
        """A storage was resized outside dispatch (`_watching_resizes`): a counted one now holds its new bytes (0
        when freed, FSDP2's gathered parameters between uses); an uncounted one grown counts from now."""
        if storage._cdata in self._live or storage.nbytes() > 0:
            self._see_storage(storage, storage.device, None, True)
            self._sample()

    def _see_storage(self, storage: Any, device: torch.device, category: str | None, labelled: bool) -> None:
        key = storage._cdata
        entry = self._live.get(key)
        nbytes = storage.nbytes()
        if entry is None:
            if device != self.device and device.type != "cpu":
                return  # another accelerator's memory: not this device's, not host memory
            category = category or self._category_for(device, labelled)
            ref = weakref.ref(storage, self._freed_callback(key))
            ptr = storage.data_ptr()
            # memory a live storage holds, wrapped anew (torch.from_numpy of a view of it): no bytes of its own
            alias = not storage.resizable() and self._aliases(ptr, nbytes)
            self._live[key] = _Entry(category, 0 if alias else nbytes, ref, ptr, alias)
            self._bytes[category] += 0 if alias else nbytes
        else:
            if category is not None and category != entry.category:
                self._bytes[entry.category] -= entry.nbytes
                self._bytes[category] += entry.nbytes
                entry.category = category
            if nbytes != entry.nbytes and not entry.alias:  # resized in place (an out= operation, resize_)
                self._bytes[entry.category] += nbytes - entry.nbytes
                entry.nbytes, entry.ptr = nbytes, storage.data_ptr()

    def _aliases(self, ptr: int, nbytes: int) -> bool:
        """Whether [ptr, ptr + nbytes) lies inside a live storage. Only storages PyTorch did not allocate
        (not resizable: wrapped NumPy or DLPack memory) are checked, so the scan is rare."""
        return any(not e.alias and e.ptr <= ptr and ptr + nbytes <= e.ptr + e.nbytes for e in self._live.values())

    def _freed_callback(self, key: int):
        tracker = weakref.ref(self)  # the storages' callbacks must not keep the tracker alive

        def freed(_: Any) -> None:
            me = tracker()
            if me is None:
                return
            entry = me._live.pop(key, None)
            if entry is not None:
                me._bytes[entry.category] -= entry.nbytes
                me._sample()

        return freed

    def _grad_accumulated(self, p: torch.Tensor) -> None:
        if p.grad is not None:
            self._see(p.grad, "weight_grad")
            self._sample()

    def _workspace_event(self, delta: int, out: Any = None, reads: tuple = ()) -> None:
        self._transient += delta
        if out is not None:
            for array in (out, *reads):
                self._kernel_writes(array)
        self._sample()

    def _kernel_writes(self, out: Any) -> None:
        """A converted conv's kernel writes `out` (a NumPy or CuPy array), or reads it. Where no counted storage
        holds it, an operator allocated it below this mode's dispatch (ucudnn's operator, as a plan's followed
        calls run converted convs): its result, or its operands' copies into the kernel's layout
        (`ucudnn.torch.converting.launch.forward_copies`); counted as a ``tensor`` from now until that operator returns
        (`__torch_dispatch__`), as the workspace beside it is."""
        face = getattr(out, "__cuda_array_interface__", None) or out.__array_interface__
        ptr, nbytes = face["data"][0], out.nbytes
        if ptr in self._unseen or any(
            not e.alias and e.ptr <= ptr and ptr + nbytes <= e.ptr + e.nbytes for e in self._live.values()
        ):
            return
        self._unseen[ptr] = nbytes
        self._bytes["tensor"] += nbytes

    def _workspace_bytes(self) -> int:
        handles = {id(c.handle): c.handle for c in self._convs}
        return self._transient + sum(h.workspace_bytes for h in handles.values())

    def _sample(self) -> None:
        """Record the current bytes (after a change) and move the peaks."""
        if self._convs:
            self._bytes["workspace"] = self._workspace_bytes()
        device = sum(self._bytes[c] for c in DEVICE_CATEGORIES)
        host = self._bytes["host"]
        now = (time.perf_counter() - self._start) * 1e3
        if not self._memory or self._memory[-1][1] != device:
            self._memory.append((now, device))
        if not self._host_memory or self._host_memory[-1][1] != host:
            self._host_memory.append((now, host))
        for c, b in self._bytes.items():
            self._max[c] = max(self._max[c], b)
        if device > self._peak:
            self._peak = device
            self._peak_by = dict(self._bytes)
        self._host_peak = max(self._host_peak, host)
        self._total_peak = max(self._total_peak, device + host)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        inputs = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        for t in inputs:  # a tensor alive before the block counts from its first read (unlabelled: made before)
            self._see(t, None, labelled=False)
        out = func(*args, **kwargs)
        if self._unseen:  # counted from their kernels' start (`_kernel_writes`): now as the storages they are
            self._bytes["tensor"] -= sum(self._unseen.values())
            self._unseen.clear()
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._see(t, None)
        schema = getattr(func, "_schema", None)  # (a higher-order operator has none)
        if schema is not None and schema.is_mutable:  # an in-place or out= operation may have resized its argument
            for t in inputs:
                self._see(t, None, labelled=False)
        self._sample()
        return out
