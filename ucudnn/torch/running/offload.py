"""Offloading saved feature maps to the host and prefetching them back ahead of the backward pass: pooled host
buffers, the copy streams, and the saved-tensor hooks with which a plan's executor (`ucudnn.torch.running.executor`)
copies a tensor out and back.

**Offload.** `pack` copies the tensor into a pooled host buffer (pinned memory on CUDA; reused from
step to step, see `_HostBuffers`) on a dedicated device-to-host stream, records an event, and keeps
the device tensor referenced until the forward pass has run the last operation that reads its storage
(as captured; seen at the next save, or at the forward pass's end); then the compute stream waits for
the copy's event and the reference goes, so that the caching allocator gives the memory to the compute
stream's next allocations, ordered after the copy (nothing waits on the host; polling the event instead
would free nothing while the host runs ahead of the GPU, which it does by up to a whole forward pass).
One storage saved by several ops (a ReLU's output, saved by the ReLU and by the next conv) is copied once.
Each offloaded tensor's *use* is the last operation (in forward order) that saved it: the first to need
it in the backward pass. **Prefetch.** Just before the backward step of operation i (at the first prefetch
hook on the model output's node, and at each unpack of an offloaded or dropped tensor saved by operation i:
the only steps where what is issued can change) the executor issues the host-to-device copies of every
offloaded tensor used at i or later that is not issued yet, and of the `prefetch_ahead` tensors needed
next. `unpack` makes the compute stream wait for its copy's event (no host synchronisation); a tensor whose
prefetch was not issued yet is fetched on the spot and counted in `ExecutionStats.late_prefetches`. On the CPU
the same code runs with plain copies (no streams or events), so that the order can be tested; inside
`late_copies()`, with copies that run only when something waits for them (`_LateCopier`), so that the
executor holds every device tensor as long as on a GPU. A GPU's caching allocator counts a tensor from its
allocation to the host's release of it (`torch.cuda.max_memory_allocated`), whenever the device's streams
reach them: what a `StepTracker` counts in such a CPU run, a plan's prediction must (`simulate`'s
``prefetch="ahead"``).
"""

from __future__ import annotations

import contextlib
import contextvars
import weakref
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Protocol

import torch

from ucudnn.errors import UnsupportedProblem
from ucudnn.torch.running.labels import allocated_as

if TYPE_CHECKING:
    from ucudnn.torch.capturing.graph import CapturedStep
    from ucudnn.torch.running.stats import ExecutionStats


class _HostBuffers:
    """Host buffers for offloaded tensors, reused from step to step.

    A step's offloaded tensors have the same shapes every step, so the first step allocates one buffer
    per offloaded tensor (the plan's offloaded bytes in all) and later steps take them back: steady
    training allocates no host memory. A buffer comes back when the backward pass has unpacked the
    last save of its tensor, with the event of the host-to-device copy still reading it; the next
    device-to-host copy into it waits for that event on its stream (the host never waits). Pinned
    (page-locked) memory where the copies go to and from a CUDA device, so that they run
    asynchronously; pageable memory on the CPU, where the same code runs with plain copies.
    """

    def __init__(self, pin: bool) -> None:
        self.pin = pin
        self.free: dict[tuple, list[tuple[torch.Tensor, Any]]] = {}
        self.allocated = 0

    @staticmethod
    def key(t: torch.Tensor) -> tuple:
        return tuple(t.shape), t.stride(), t.dtype

    def take(self, t: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """A host buffer shaped like `t` and the event after which it may be written (None: at once)."""
        free = self.free.get(self.key(t))
        if free:
            return free.pop()
        self.allocated += 1
        with allocated_as("host"):  # a memory tracker files it as a host copy, also on the CPU
            return torch.empty_like(t, device="cpu", pin_memory=self.pin), None

    def held(self) -> list[torch.Tensor]:
        """The buffers in the pool now (taken ones are the executor's until they come back)."""
        return [host for free in self.free.values() for host, _ in free]

    def give(self, key: tuple, host: torch.Tensor, reads: Any) -> None:
        """Take back `host` (taken for a tensor with `key`) once the copy that event `reads` marks is done."""
        self.free.setdefault(key, []).append((host, reads))


class _HostCopier:
    """Offload on the CPU: the "device" is the host, a copy is a plain copy and is done when it returns."""

    pin = False

    def to_host(self, t: torch.Tensor, host: torch.Tensor, free_after: Any) -> None:
        host.copy_(t)

    def to_device(self, host: torch.Tensor, device: torch.device, after: Any) -> tuple[torch.Tensor, None]:
        return host.clone(), None  # a copy as on a GPU: the host buffer goes back to the pool

    def wait(self, event: Any, device: torch.device) -> None:
        pass


class _CudaCopier:  # pragma: no cover - needs a GPU
    """Copies on two dedicated streams (device-to-host, host-to-device) ordered by events; no host waits."""

    pin = True

    def __init__(self, device: torch.device) -> None:
        self.d2h = torch.cuda.Stream(device)
        self.h2d = torch.cuda.Stream(device)

    def to_host(self, t: torch.Tensor, host: torch.Tensor, free_after: Any) -> Any:
        self.d2h.wait_stream(torch.cuda.current_stream(t.device))  # t is computed
        if free_after is not None:
            self.d2h.wait_event(free_after)  # the last step's host-to-device copy has read the buffer
        with torch.cuda.stream(self.d2h):
            host.copy_(t, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.d2h)
        return event

    def to_device(self, host: torch.Tensor, device: torch.device, after: Any) -> tuple[torch.Tensor, Any]:
        # Allocated on the compute stream, which reads it after waiting for the copy's event, so the
        # caching allocator cannot hand the block to anyone before the compute stream is done with it.
        dev = torch.empty_like(host, device=device)
        self.h2d.wait_stream(torch.cuda.current_stream(device))
        if after is not None:
            self.h2d.wait_event(after)  # the device-to-host copy has landed
        with torch.cuda.stream(self.h2d):
            dev.copy_(host, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.h2d)
        return dev, event

    def wait(self, event: Any, device: torch.device) -> None:
        """The compute stream of `device` waits for `event` (the host does not)."""
        if event is not None:
            torch.cuda.current_stream(device).wait_event(event)


class _Copy:
    """An event of `_LateCopier`'s stand-in streams: the copy it marks runs when something first waits for it."""

    __slots__ = ("run",)

    def __init__(self, run) -> None:
        self.run = run

    def wait(self) -> None:
        if self.run is not None:
            run, self.run = self.run, None  # (the closure, and the tensors it holds, go once run)
            run()


class _LateCopier:
    """Offload on the CPU with copies that finish as late as a GPU's copy streams may finish them: a copy
    runs only when something waits for its event (the compute stream before the offloaded tensor goes, the
    copy back before it reads the host buffer, the next copy out before it writes the buffer again). The
    executor then keeps every tensor as long as it does on a GPU (`_CudaCopier`: an offloaded device tensor
    until its storage's last forward reader has run, a prefetched one from its issue), so that a memory
    tracker on the CPU counts what the GPU's allocator counts; and a missing wait reads a buffer not yet
    written, which a comparison with plain training finds."""

    pin = False

    def to_host(self, t: torch.Tensor, host: torch.Tensor, free_after: Any) -> _Copy:
        if free_after is not None:
            free_after.wait()  # the last step's copy back has read the buffer
        t = t.detach()  # (the copy may run where autograd records: not an operation of the model's)
        return _Copy(lambda: host.copy_(t))

    def to_device(self, host: torch.Tensor, device: torch.device, after: Any) -> tuple[torch.Tensor, _Copy]:
        dev = torch.empty_like(host)  # allocated at issue, as on a GPU

        def run() -> None:
            if after is not None:
                after.wait()  # the copy out has landed
            dev.copy_(host)

        return dev, _Copy(run)

    def wait(self, event: Any, device: torch.device) -> None:
        if event is not None:
            event.wait()


_LATE = contextvars.ContextVar("ucudnn_late_copies", default=False)


@contextlib.contextmanager
def late_copies() -> Iterator[None]:
    """Plans executed on CPU tensors inside this block copy with `_LateCopier`: their memory over the step is
    what a GPU's allocator counts (`StepTracker` sees it; for tests and benchmarks of a plan made for a GPU)."""
    token = _LATE.set(True)
    try:
        yield
    finally:
        _LATE.reset(token)


def copier_kind(device: torch.device) -> str:
    """Which copier offloads from `device` now: ``"cuda"``, ``"late"`` or ``"host"``."""
    return "cuda" if device.type == "cuda" else "late" if _LATE.get() else "host"


def _copier_for(device: torch.device):
    kind = copier_kind(device)
    return _CudaCopier(device) if kind == "cuda" else _LateCopier() if kind == "late" else _HostCopier()


class _Offloaded:
    """One storage view copied to the host: shared by every save of it in one forward pass."""

    __slots__ = ("d2h", "dev", "device", "host", "issued", "key", "name", "ready", "saves", "storage", "use")

    def __init__(
        self, name: str, key: tuple, host: torch.Tensor, d2h: Any, device: torch.device, use: int, storage
    ) -> None:
        self.name, self.key, self.d2h, self.device, self.use = name, key, d2h, device, use
        self.host: torch.Tensor | None = host  # None once every save was unpacked (the buffer went back)
        self.storage = storage  # weak reference: the dedup key is valid while the storage lives
        self.saves = 0  # packed handles not yet unpacked
        self.dev: torch.Tensor | None = None
        self.ready: Any = None
        self.issued = False


class _Pass:
    """Book-keeping of one forward pass and its backward: offloaded tensors and the prefetch cursor."""

    def __init__(self) -> None:
        self.entries: list[_Offloaded] = []
        self.by_key: dict[tuple, _Offloaded] = {}
        self.order: list[_Offloaded] | None = None  # entries by descending use, built at the first backward hook
        self.cursor = 0


class _Copies(Protocol):
    """What the offloads ask of the executor's prepared plan (`ucudnn.torch.running.prepared_plan._Prepared`,
    whose module imports this one)."""

    def copies_for(self, device: torch.device) -> tuple[Any, _HostBuffers]: ...


class _OffloadHooks:
    """The executor's offloads (`_offload`, `_fetch`, called from its saved-tensor hooks) and prefetches.
    A base of `ucudnn.torch.running.executor._Executor`, whose state they share (as annotated here)."""

    prep: _Copies
    stats: ExecutionStats
    step: CapturedStep | None
    pass_: _Pass | None
    current: int  # what an offloaded tensor's use is counted against
    prefetch_ahead: int
    copier: Any
    buffers: _HostBuffers | None
    pending: list[tuple[Any, torch.Tensor, int]]  # device tensors whose host copy may be in flight
    quiet: int  # inside the executor's own hooks

    # -- what the saved-tensor hooks do with a tensor planned offload -------------------------------
    def _offload(self, name: str, t: torch.Tensor, uses: int = 1) -> _Offloaded:
        """Copy `t` out (once per storage view and forward pass); its handle, to be unpacked `uses` times."""
        p = self.pass_
        assert p is not None  # set where the forward pass started, before any save
        storage = t.untyped_storage()
        key = (storage.data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)
        entry = p.by_key.get(key)
        if entry is None or entry.storage() is not storage:
            if self.copier is None:
                self.copier, self.buffers = self.prep.copies_for(t.device)
            buffers = self.buffers
            assert buffers is not None  # taken with the copier
            allocated = buffers.allocated
            host, free_after = buffers.take(t)
            self.stats.host_buffers_allocated += buffers.allocated - allocated
            event = self.copier.to_host(t, host, free_after)
            entry = _Offloaded(name, _HostBuffers.key(t), host, event, t.device, self.current, weakref.ref(storage))
            if event is not None:  # the copy reads it until its storage's last forward reader: see _release
                assert self.step is not None  # (the step is running)
                self.pending.append((event, t, self.step.last_read.get(name, self.current)))
            p.by_key[key] = entry
            p.entries.append(entry)
            self.stats.offloaded += 1
            self.stats.bytes_offloaded += t.numel() * t.element_size()
            self.stats.events.append(("offload", name))
        entry.use = max(entry.use, self.current)
        entry.saves += uses
        return entry

    def _fetch(self, saved: _Offloaded) -> torch.Tensor:
        """The device copy of an offloaded tensor, for a backward step that unpacks it."""
        if saved.host is None:  # every save was unpacked once: its host buffer went back to the pool
            raise UnsupportedProblem(
                f"the offloaded tensor {saved.name!r} was already used by a backward pass; "
                "under execute_plan run backward once per forward (no retain_graph=True "
                "for a second backward through offloaded tensors)"
            )
        if not saved.issued:
            self.stats.late_prefetches += 1
            self._prefetch(saved)
        self.copier.wait(saved.ready, saved.device)
        self.stats.events.append(("unpack", saved.name))
        t, buffers = saved.dev, self.buffers
        assert t is not None and buffers is not None  # prefetched above, into a buffer taken at the offload
        saved.saves -= 1
        if saved.saves == 0:  # the last save is unpacked: autograd holds the tensor, the host buffer is free
            buffers.give(saved.key, saved.host, saved.ready)
            saved.dev = saved.host = None
        return t

    def _prefetch(self, entry: _Offloaded) -> None:
        entry.dev, entry.ready = self.copier.to_device(entry.host, entry.device, entry.d2h)
        entry.issued = True
        self.stats.prefetched += 1
        self.stats.events.append(("prefetch", entry.name))

    def reached(self, p: _Pass, i: int) -> None:
        """Backward is about to run node `i`: prefetch what it and the next nodes need."""
        if p.order is None:
            p.order = sorted(p.entries, key=lambda e: -e.use)
            torch.autograd.Variable._execution_engine.queue_callback(lambda: self._settle(p))
        # tensors issued at earlier nodes for later ones count against the lookahead too: without them,
        # every node (those that read nothing offloaded included) would issue one more, and the copies
        # back would run ahead of their use by as many nodes, holding their memory (a step tracker saw it)
        ahead = 0
        back = p.cursor - 1
        while back >= 0 and p.order[back].use < i:
            ahead += 1
            back -= 1
        while p.cursor < len(p.order):
            entry = p.order[p.cursor]
            if entry.use < i:
                if ahead >= self.prefetch_ahead:
                    break
                ahead += 1
            if not entry.issued:
                self._prefetch(entry)
            p.cursor += 1

    def _settle(self, p: _Pass) -> None:
        """At the end of a backward pass: the compute stream waits for every prefetch no unpack waited
        for (a tensor saved for a value the loss does not read), so that its device copy, freed later
        to the compute stream, is never handed out while the copy still writes it."""
        for entry in p.entries:
            if entry.issued and entry.dev is not None:
                self.copier.wait(entry.ready, entry.device)

    def _release(self, position: int | None) -> None:
        """Drop the offloaded device tensors whose storages the forward pass no longer reads once
        `position` operations have run (None: the forward pass is over), after making the compute stream
        wait for their copies: the allocator hands their memory to later work of the compute stream,
        which now runs after the copy (the simulator's "the step after its last forward reader waits")."""
        if not self.pending:
            return
        still = []
        self.quiet += 1  # (a stand-in stream's copy may run now: not an operation of the step)
        try:
            for event, t, last in self.pending:
                if position is not None and last >= position:
                    still.append((event, t, last))
                else:
                    self.copier.wait(event, t.device)
        finally:
            self.quiet -= 1
        self.pending = still


class _PrefetchHook:
    """A pre-hook on the autograd node of an operation's output: fires just before its backward step."""

    __slots__ = ("executor", "index", "pass_")

    def __init__(self, executor: _OffloadHooks, pass_: _Pass, index: int) -> None:
        self.executor, self.pass_, self.index = executor, pass_, index

    def __call__(self, grads: Any) -> None:
        self.executor.stats.hook_calls += 1
        self.executor.reached(self.pass_, self.index)
