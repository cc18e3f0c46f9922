"""Memory plans in PyTorch training: offload saved feature maps to the host, prefetch them ahead of the
backward pass, recompute checkpoint segments, and give converted convolutions their planned workspace.

    plan = ucudnn.torch.plan_memory(model, example_input, memory_limit="2GiB", policy="optimal")
    with ucudnn.torch.execute_plan(model, plan) as run:
        loss = criterion(model(x), y)
        loss.backward()
    optimizer.step()

**Running the model.** Inside the block, `model.forward` is replaced by a loop over the model's
`torch.fx` graph (the same trace the planner named its tensors after), so that the executor knows
which fx node is running. fx's own `Interpreter` runs a whole graph in one call; the loop here is
hand-written because recompute segments must run a range of nodes inside one checkpoint call. It
frees each value after its last use, as the Interpreter does. Inputs bind to the graph's placeholders
as Python binds a call's arguments: by position, by keyword, else the parameter's default.

**Prepared once.** The fx graph, each value's last use, the plan's check per input shape (a traced,
shape-propagating forward pass) and the host buffers belong to the (model, plan) pair: they are made
at its first `execute_plan` and reused by later blocks (kept weakly with the model, for its latest
plans), so a training step under a plan does only the step's work. A model whose modules changed
since (a layer replaced) is prepared and checked again.

**Which plan tensor a saved tensor is.** `saved_tensors_hooks` see tensors, not names. A plan's
tensors are *storages* (an in-place op or a view writes into its input's memory: the planner names
that memory after the node that first made it). So every node's output is tagged by its storage:
the storage's address maps to the plan name and a weak reference to the storage object (the
reference dies with the storage, so an address that the allocator hands out again is not mistaken
for the old tensor). A node whose output lives in an already tagged, live storage (``relu_``,
``flatten``) leaves the tag as it is. A saved tensor is then attributed, in `pack`, to: nothing
(parameters and buffers: never moved); the tagged storage it lives in; else the node running at
that moment (its own result, saved before the node returns, and internals such as max-pool
indices follow that node's action).

**Offload.** `pack` copies the tensor into a pooled host buffer (pinned memory on CUDA; reused from
step to step, see `_HostBuffers`) on a dedicated device-to-host stream, records an event, and keeps
the device tensor referenced until the forward pass has run the last node that reads its storage;
then the compute stream waits for the copy's event and the reference goes, so that the caching
allocator gives the memory to the compute stream's next allocations, ordered after the copy (nothing
waits on the host; polling the event instead would free nothing while the host runs ahead of the
GPU, which it does by up to a whole forward pass). One storage saved by several ops (a ReLU's
output, saved by the ReLU and by the next conv) is copied once.
Each offloaded tensor's *use* is the last node (in forward order) that saved it: the first to need it
in the backward pass. **Prefetch.** A backward hook on every node's output fires just before that
node's backward step; at node i it issues the host-to-device copies of every offloaded tensor used at
i or later that is not issued yet, and of the `prefetch_ahead` tensors needed next. `unpack` makes
the compute stream wait for its copy's event (no host synchronisation); a tensor whose prefetch was
not issued yet is fetched on the spot and counted in `ExecutionStats.late_prefetches`. On the CPU
the same code runs with plain copies (no streams or events), so that the order can be tested.

**Recompute.** A storage planned ``recompute`` makes a segment of the nodes from its producer to its
last forward reader; overlapping segments merge; each segment runs under non-reentrant
`torch.utils.checkpoint.checkpoint`, which keeps only the segment's inputs (kept or offloaded as the
plan says) and reruns the segment when its backward needs what it saved. A tensor planned ``keep``
whose every use lies inside such a segment is recomputed too (a checkpoint keeps only its inputs).
While recomputing, batch-norm layers normalise with the batch statistics without updating their
running statistics a second time, so the buffers equal those of plain training.

**Release** needs no action: PyTorch frees what the backward pass does not save. A tensor planned
``release`` that autograd does save is kept (it must be) and named in `ExecutionStats.kept_released`.

**Workspaces.** Each `ucudnn.torch.Conv2d` whose layer has ``conv_workspace`` entries in the plan
runs each kernel, inside the block, with its own handle's fastest configuration within that
kernel's budget (`Handle.kernel(..., budget=...)`), its workspace held for that run only, as the
plan counts it. `plan_memory` on a converted model takes each converted kernel's options from its
handle (`Handle.front`), so the budgets are ones those kernels can run within.

**Checks.** The plan must come from this model at this batch: at the first forward call for an
input shape, the model is traced with its first input, the others at their defaults
(`ucudnn.memory.graph.trace`, in eval mode so that no running statistics move), and the plan's
tensors must be the traced graph's storages with the same bytes, and its batch the input's; conv
workspace layers must be convs of the model. Anything else is `InvalidInput` saying what differs.

`plan_memory(model, example_input, ...)` traces the model and calls the planner
(`ucudnn.memory.make_plan`). With ``device=None`` the device is the example input's: a built-in
profile when a CUDA device's name matches one (an H100 is ``h100``), else a profile measured on the
spot (`measure_profile`: the host's memory and its copy and matmul throughput on the CPU; the
GPU's memory, pinned copy bandwidth and matmul throughput on CUDA).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import platform
import statistics
import time
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

import torch
from torch import fx, nn
from torch.utils.checkpoint import checkpoint

from ucudnn.backends.cpu import NATIVE, CpuBackend
from ucudnn.kernel.measure import interleaved_medians_ms
from ucudnn.devices import PROFILES, DeviceProfile, load_profile
from ucudnn.errors import InvalidInput, UnsupportedProblem
from ucudnn.handle import Handle, native_only
from ucudnn.memory.graph import TrainingGraph, trace
from ucudnn.memory.plan import MemoryPlan
from ucudnn.memory.timing import KernelOption, front_of
from ucudnn.sizes import parse_size
from ucudnn.torch.conv import Conv2d
from ucudnn.torch.tracker import allocated_as

__all__ = ["ExecutionStats", "execute_plan", "measure_profile", "plan_memory"]


# ---- planning ------------------------------------------------------------------------------------
def _trace_graph(model: nn.Module, example_input: torch.Tensor) -> TrainingGraph:
    """The planner's graph of `model` at `example_input`, traced in eval mode (its shape pass must not
    move batch-norm running statistics); every module's training flag is restored."""
    if not isinstance(example_input, torch.Tensor) or example_input.dim() < 1:
        raise InvalidInput(f"example_input must be a batched tensor, got {type(example_input).__name__}")
    with _eval_mode(model):
        return trace(model, example_input)


@contextlib.contextmanager
def _eval_mode(model: nn.Module) -> Iterator[None]:
    """`model` in eval mode (a pass that must not move batch-norm statistics); every module's own
    training flag comes back afterwards."""
    flags = {m: m.training for m in model.modules()}
    try:
        model.eval()
        yield
    finally:
        for module, flag in flags.items():
            module.training = flag


def _best_ms(fn, reps: int = 3) -> float:
    best = math.inf
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best * 1e3


@lru_cache(maxsize=None)
def measure_profile(device: str = "cpu") -> DeviceProfile:
    """A `DeviceProfile` of this machine's `device` ("cpu" or "cuda[:i]"), measured once per process.

    CPU: the host's physical memory; "host link" and memory bandwidth are a 64 MiB copy's (the
    offloaded copies of a CPU run are such copies); throughput is a 1024^3 float32 matmul's. CUDA:
    the device's memory, pinned 64 MiB copies each way and both at once, a device-to-device copy
    and a 4096^3 matmul. Best of three runs each.
    """
    dev = torch.device(device)
    nbytes = 64 * 2**20
    if dev.type == "cpu":
        a, b = torch.empty(nbytes // 4), torch.empty(nbytes // 4)
        copy_ms = _best_ms(lambda: b.copy_(a))
        m = torch.randn(1024, 1024)
        mm_ms = _best_ms(lambda: m @ m)
        gbps = nbytes / copy_ms / 1e6
        model = platform.processor() or platform.machine()
        return DeviceProfile("host", f"host CPU ({model}, {os.cpu_count()} threads)",
                             os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), h2d_gbps=gbps, d2h_gbps=gbps,
                             duplex_gbps=gbps, devices_per_link=1, fp32_tflops=2 * 1024**3 / mm_ms / 1e9,
                             memory_gbps=2 * gbps, source="measured by ucudnn.torch.measure_profile",
                             shares_host_memory=True)
    if dev.type != "cuda":
        raise InvalidInput(f"device must be 'cpu' or a CUDA device, got {device!r}")
    return _measure_cuda(dev)  # pragma: no cover - needs a GPU


def _measure_cuda(dev: torch.device) -> DeviceProfile:  # pragma: no cover - needs a GPU
    nbytes = 64 * 2**20
    props = torch.cuda.get_device_properties(dev)
    host = torch.empty(nbytes // 4, pin_memory=True)
    host2 = torch.empty(nbytes // 4, pin_memory=True)
    d, d2 = torch.empty(nbytes // 4, device=dev), torch.empty(nbytes // 4, device=dev)
    side = torch.cuda.Stream(dev)

    def timed(fn) -> float:
        torch.cuda.synchronize(dev)  # measuring, not training: waiting on the host is the point
        return _best_ms(lambda: (fn(), torch.cuda.synchronize(dev)))

    def both() -> None:
        d.copy_(host, non_blocking=True)
        with torch.cuda.stream(side):
            host2.copy_(d2, non_blocking=True)

    h2d = nbytes / timed(lambda: d.copy_(host, non_blocking=True)) / 1e6
    d2h = nbytes / timed(lambda: host.copy_(d, non_blocking=True)) / 1e6
    duplex = 2 * nbytes / timed(both) / 1e6
    mem = 2 * nbytes / timed(lambda: d2.copy_(d)) / 1e6
    m = torch.randn(4096, 4096, device=dev)
    tflops = 2 * 4096**3 / timed(lambda: m @ m) / 1e9
    return DeviceProfile(f"cuda{dev.index or 0}", props.name, int(props.total_memory), h2d_gbps=h2d, d2h_gbps=d2h,
                         duplex_gbps=duplex, devices_per_link=1, fp32_tflops=tflops, memory_gbps=mem,
                         source="measured by ucudnn.torch.measure_profile")


def _profile_for(device: DeviceProfile | str | None, example_input: torch.Tensor) -> DeviceProfile:
    if isinstance(device, DeviceProfile):
        return device
    if device is not None:
        return load_profile(device)
    if example_input.device.type == "cuda":  # pragma: no cover - needs a GPU
        words = torch.cuda.get_device_name(example_input.device).lower().replace("-", " ").split()
        for profile in PROFILES.values():
            if profile.name in words:  # "NVIDIA H100 80GB HBM3" -> h100
                return profile
        return measure_profile(str(example_input.device))
    return measure_profile("cpu")


def plan_memory(model: nn.Module, example_input: torch.Tensor, memory_limit: int | str | None = None,
                policy: str = "optimal", device: DeviceProfile | str | None = None, *, devices: int = 1,
                db: Any = None) -> MemoryPlan:
    """The planner's `MemoryPlan` for training `model` on batches shaped like `example_input`.

    The model is traced with torch.fx (feature maps named after their fx nodes). `device` is a
    profile name (``"h100"``), a profile JSON path, a `DeviceProfile`, or None for the example
    input's device (see the module docstring). `memory_limit` (bytes or ``"2GiB"``) defaults to
    the device's memory. Operation times come from the measurement cache `db` and the measurements
    shipped for the profile where they exist, else from the profile's roofline
    (`ucudnn.memory.timing`). Unknown policies raise `InvalidInput` naming the available ones.
    """
    if not isinstance(model, nn.Module):
        raise InvalidInput(f"model must be a torch.nn.Module, got {type(model).__name__}")
    graph = _trace_graph(model, example_input)
    profile = _profile_for(device, example_input)
    limit = profile.memory_bytes if memory_limit is None else parse_size(memory_limit)
    from ucudnn.memory.planner import make_plan

    native = None
    if example_input.device.type == "cpu" and profile.shares_host_memory:  # planning for this very CPU
        graph = _timed_ops(model, graph, example_input)
        native = Handle(backend=CpuBackend(numpy_threads=1), policy="undivided", algos=[NATIVE], db=db)
    return make_plan(graph, profile, limit, policy, devices=devices, db=db,
                     fronts=_conv_fronts(model, graph, example_input, native))


def _conv_fronts(model: nn.Module, graph: TrainingGraph, example_input: torch.Tensor, native: Handle | None) -> dict:
    """The options of each conv's kernels: a converted conv's as its own handle measures them (so
    that the plan's workspace budgets are ones its kernels run within), and where `native` is given
    (planning for this CPU), a torch conv's as that handle measures torch's own convolution. Through
    the measurement cache: what is measured here, a converted layer's first step does not measure again."""
    modules = dict(model.named_modules())
    convs = {op.name: op for op in graph.conv_ops}
    dtype = str(example_input.dtype).removeprefix("torch.")
    fronts = {}
    for step in graph.steps:
        op = convs.get(step.op)
        conv = modules.get(op.module) if op is not None else None
        converted = isinstance(conv, Conv2d)
        handle = conv.handle if converted else native if isinstance(conv, nn.Conv2d) else None
        if handle is None:
            continue
        for kind in step.kernels:
            problem = dataclasses.replace(op.conv, kind=kind, dtype=dtype)
            # torch's own convolution run by torch (a torch layer, or a converted layer whose plan is
            # native on the whole batch) allocates its temporaries inside its kernels, out of the
            # plan's reach: the step holds no workspace for it, whatever its budget
            fronts[(step.op, kind)] = tuple(
                KernelOption(c.time, c.workspace if converted else 0, c.describe(), "measured",
                             held=0 if native_only(c) else None) for c in handle.front(problem))
        if set(step.kernels) == {"bwd_data", "bwd_filter"}:
            _fuse_native_backward(fronts, step.op, dataclasses.replace(op.conv, dtype=dtype), example_input.device)
    return fronts


def _fuse_native_backward(fronts: dict, layer: str, problem, device: torch.device) -> None:
    """Where torch runs both backward kernels of a layer, it runs them as one call, which costs less
    than the two measured apart (shared work and one launch: about 0.6x on ResNet-18's CPU layers).
    So the native options of the two fronts are scaled by the fused call's time over their sum."""
    options = [next((o for o in fronts[(layer, kind)] if o.config == f"1x{problem.n}:{NATIVE}"), None)
               for kind in ("bwd_data", "bwd_filter")]
    if None in options:
        return
    x = torch.randn(problem.x_shape, device=device)
    w = torch.randn(problem.w_shape, device=device)
    dy = torch.randn(problem.y_shape, device=device)
    stride, padding, dilation = [problem.stride_h, problem.stride_w], [problem.pad_h, problem.pad_w], \
        [problem.dilation_h, problem.dilation_w]
    def fused() -> None:
        torch.ops.aten.convolution_backward(dy, x, w, None, stride, padding, dilation, False, [0, 0], problem.groups,
                                            [True, True, False])

    scale = interleaved_medians_ms({"fused": fused}, reps=5)["fused"] / sum(o.time_ms for o in options)
    if scale >= 1:
        return
    for kind in ("bwd_data", "bwd_filter"):  # a cheaper native option may now dominate others
        fronts[(layer, kind)] = front_of(dataclasses.replace(o, time_ms=o.time_ms * scale) if o in options else o
                                         for o in fronts[(layer, kind)])


def _timed_ops(model: nn.Module, graph: TrainingGraph, example_input: torch.Tensor, reps: int = 3) -> TrainingGraph:
    """`graph` with each non-conv op's forward time measured on this CPU (the median of `reps`
    forward passes, node by node, in eval mode so that no running statistics move): the roofline of
    a host profile is far from what PyTorch's CPU kernels take (4x on ResNet-18)."""
    from ucudnn.memory.fx import plain_convs

    gm = fx.GraphModule(model, _Tracer().trace(model))
    samples: dict[str, list[float]] = {}

    class Timed(fx.Interpreter):
        def run_node(self, n):
            start = time.perf_counter()
            result = super().run_node(n)
            samples.setdefault(n.name, []).append((time.perf_counter() - start) * 1e3)
            return result

    with _eval_mode(model), plain_convs(gm), torch.no_grad():
        for _ in range(reps):
            Timed(gm).run(example_input)
    ops = tuple(dataclasses.replace(op, measured_ms=statistics.median(samples[op.name]))
                if op.type not in ("conv", "input", "loss") and op.name in samples else op for op in graph.ops)
    return dataclasses.replace(graph, ops=ops)


# ---- copies ---------------------------------------------------------------------------------------
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


def _copier_for(device: torch.device):
    return _CudaCopier(device) if device.type == "cuda" else _HostCopier()


# ---- what a run did ------------------------------------------------------------------------------
@dataclass
class ExecutionStats:
    """What `execute_plan` did, summed over the forward and backward passes run in its block.

    `events` is the order of copies and uses: ``("offload", name)``, ``("prefetch", name)`` and
    ``("unpack", name)``.
    """

    offloaded: int = 0
    bytes_offloaded: int = 0
    prefetched: int = 0
    late_prefetches: int = 0
    segments: int = 0
    host_buffers_allocated: int = 0
    kept_released: set[str] = field(default_factory=set)
    events: list[tuple[str, str]] = field(default_factory=list)


class _Offloaded:
    """One storage view copied to the host: shared by every save of it in one forward pass."""

    __slots__ = ("name", "key", "host", "d2h", "device", "use", "saves", "dev", "ready", "issued", "storage")

    def __init__(self, name: str, key: tuple, host: torch.Tensor, d2h: Any, device: torch.device, use: int,
                 storage) -> None:
        self.name, self.key, self.host, self.d2h, self.device, self.use = name, key, host, d2h, device, use
        self.storage = storage    # weak reference: the dedup key is valid while the storage lives
        self.saves = 0            # packed handles not yet unpacked
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


# ---- the executor --------------------------------------------------------------------------------
def _segments(graph: TrainingGraph, plan: MemoryPlan, index: dict[str, int]) -> list[tuple[int, int]]:
    """Node ranges [first, last] (fx node indices) to run as checkpoint segments."""
    ranges = []
    for t in plan.tensors:
        if t.action != "recompute":
            continue
        producers = [op.name for op in graph.producers(t.name)]
        readers = [op.name for op in graph.ops
                   if op.type != "loss" and any(graph.storage_of(i) == t.name for i in op.inputs)]
        nodes = [index[n] for n in producers + readers if n in index]
        if producers and graph.op(producers[0]).type != "input" and nodes:
            ranges.append((min(nodes), max(nodes)))
    merged: list[tuple[int, int]] = []
    for a, b in sorted(ranges):
        if merged and a <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(b, merged[-1][1]))
        else:
            merged.append((a, b))
    return merged


def _fingerprint(model: nn.Module) -> tuple:
    """What a prepared run of `model` depends on: its modules, by identity and class."""
    return tuple((name, id(m), type(m)) for name, m in model.named_modules())


class _Prepared:
    """What running a model under a plan needs that stays the same from step to step: the fx graph,
    each value's last use, the checked input shapes and their segments, the conv budgets, and the
    copiers with their host buffers. Holds the model's modules, not the model (see `_prepared`)."""

    def __init__(self, model: nn.Module, plan: MemoryPlan) -> None:
        self.plan, self.fingerprint = plan, _fingerprint(model)
        try:
            self.gm = fx.GraphModule(model, _Tracer().trace(model))
        except Exception as exc:  # fx raises many kinds (TraceError, TypeError on data-dependent control flow)
            raise UnsupportedProblem(f"torch.fx cannot trace {type(model).__name__}: {exc}") from None
        self.nodes = list(self.gm.graph.nodes)
        self.index = {n.name: i for i, n in enumerate(self.nodes)}
        self.modules = dict(self.gm.named_modules())
        self.placeholders = [n for n in self.nodes if n.op == "placeholder"]
        self.actions = {t.name: t.action for t in plan.tensors}
        self._check_workspace_layers(type(model).__name__)
        self.shapes_checked: dict[tuple, dict[int, int]] = {}  # input shape -> its segments, first -> last node
        # last use of each value, as fx.Interpreter computes it: free a value after its last reader
        self.last_use: dict[int, list[fx.Node]] = {}
        seen: set[fx.Node] = set()
        for i in range(len(self.nodes) - 1, -1, -1):
            for arg in self.nodes[i].all_input_nodes:
                if arg not in seen:
                    seen.add(arg)
                    self.last_use.setdefault(i, []).append(arg)
        self.copies: dict[torch.device, tuple[Any, _HostBuffers]] = {}

    def _check_workspace_layers(self, model_name: str) -> None:
        convs = {n.name: self.modules[n.target] for n in self.nodes
                 if n.op == "call_module" and isinstance(self.modules[n.target], nn.Conv2d)}
        unknown = sorted({c.layer for c in self.plan.conv_workspace} - set(convs))
        if unknown:
            raise InvalidInput(f"plan for {self.plan.network!r} gives workspace to conv layer(s) "
                               f"{', '.join(unknown[:5])} that {model_name} does not have; "
                               "a plan made for another model?")
        self.conv_budgets: dict[str, dict[str, int]] = {}
        for c in self.plan.conv_workspace:
            self.conv_budgets.setdefault(c.layer, {})[c.kind] = c.bytes
        self.convs = convs

    def check_input(self, model: nn.Module, x: Any) -> dict[int, int]:
        """The checkpoint segments for input `x` (first node -> last node); traces `model` once per shape."""
        if not isinstance(x, torch.Tensor):
            raise InvalidInput(f"execute_plan runs models whose first input is a tensor, got {type(x).__name__}")
        key = (tuple(x.shape), x.dtype)
        if key in self.shapes_checked:
            return self.shapes_checked[key]
        plan, name = self.plan, type(model).__name__
        if x.shape[0] != plan.batch:
            raise InvalidInput(f"the plan was made for batch {plan.batch}, the input has batch {x.shape[0]}; "
                               "make a plan for this batch (plan_memory)")
        graph = _trace_graph(model, x)
        storages = {s: graph.bytes_of(s) for s in graph.storages}
        unknown = sorted(set(self.actions) - set(storages))
        if unknown:
            raise InvalidInput(f"plan for {plan.network!r} names tensor(s) {', '.join(unknown[:5])} that "
                               f"{name} does not produce; a plan made for another model?")
        wrong = [(t.name, t.bytes, storages[t.name]) for t in plan.tensors if storages[t.name] != t.bytes]
        if wrong:
            t, planned, actual = wrong[0]
            raise InvalidInput(f"plan for {plan.network!r}: tensor {t} has {planned} bytes in the plan but "
                               f"{actual} with input shape {tuple(x.shape)}; a plan made for another input size?")
        segments = dict(_segments(graph, plan, self.index))
        self.shapes_checked[key] = segments
        return segments

    def copies_for(self, device: torch.device) -> tuple[Any, _HostBuffers]:
        """The copier for `device` and its host buffers, made at the first offload to the host."""
        if device not in self.copies:
            copier = _copier_for(device)
            self.copies[device] = copier, _HostBuffers(pin=copier.pin)
        return self.copies[device]


# model -> {plan: _Prepared}, the latest plans last. Weak on the model: its prepared runs (graphs, host
# buffers) go with it. Preparing costs an fx trace and, per input shape, a shape-propagating forward
# pass (the plan's check): once per (model, plan), not once per step.
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


class _Executor:
    """One `execute_plan` block: runs the prepared graph and names, offloads and prefetches saved tensors."""

    def __init__(self, model: nn.Module, prep: _Prepared, prefetch_ahead: int) -> None:
        self.model, self.prep, self.prefetch_ahead = model, prep, prefetch_ahead
        self.stats = ExecutionStats()
        self.params = {p.untyped_storage().data_ptr() for p in list(model.parameters()) + list(model.buffers())}
        self.tags: dict[int, tuple[str, weakref.ref]] = {}
        self.current: int | None = None  # the node (or segment's last node) running in the forward pass
        self.forward_running = False
        self.copier: Any = None
        self.buffers: _HostBuffers | None = None
        self.pending: list[tuple[Any, torch.Tensor]] = []  # device tensors whose host copy may be in flight
        self.pass_: _Pass | None = None

    # -- the forward pass ---------------------------------------------------------------------------
    def _bind(self, args: tuple, kwargs: dict) -> dict[fx.Node, Any]:
        """The value of each input (fx placeholder) as Python binds the call's arguments."""
        holders, name = self.prep.placeholders, type(self.model).__name__
        if len(args) > len(holders):
            raise InvalidInput(f"{name}.forward takes {len(holders)} input(s), {len(args)} were given")
        values = dict(zip(holders, args))
        by_name = {n.target: n for n in holders}
        for key, value in kwargs.items():
            node = by_name.get(key)
            if node is None:
                raise InvalidInput(f"{name}.forward has no input named {key!r}; its inputs: "
                                   f"{', '.join(n.target for n in holders)}")
            if node in values:
                raise InvalidInput(f"{name}.forward got input {key!r} twice (by position and by keyword)")
            values[node] = value
        for node in holders:
            if node not in values:
                if not node.args:
                    raise InvalidInput(f"{name}.forward is missing input {node.target!r}")
                values[node] = node.args[0]  # the parameter's default
        return values

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        inputs = self._bind(args, kwargs)
        prep = self.prep
        segments = prep.check_input(self.model, inputs[prep.placeholders[0]] if prep.placeholders else None)
        self.pass_ = _Pass()
        self.forward_running = True
        try:
            env: dict[fx.Node, Any] = {}
            i = 0
            while i < len(prep.nodes):
                node = prep.nodes[i]
                if node.op == "placeholder":
                    env[node] = inputs[node]
                    self._tag(node, env[node], i)
                elif node.op == "output":
                    self._release(None)
                    return fx.node.map_arg(node.args[0], env.__getitem__)
                elif i in segments:
                    self._run_segment(i, segments[i], env)
                    i = segments[i]
                else:
                    self.current = i
                    env[node] = self._run_node(node, env, recomputing=False)
                    self._tag(node, env[node], i)
                for dead in prep.last_use.get(i, ()):
                    env.pop(dead, None)
                self._release(env)
                i += 1
            return None
        finally:
            self.forward_running = False
            self.current = None

    def _run_node(self, node: fx.Node, env: dict, recomputing: bool) -> Any:
        args = fx.node.map_arg(node.args, env.__getitem__)
        kwargs = fx.node.map_arg(node.kwargs, env.__getitem__)
        if node.op == "call_module":
            module = self.prep.modules[node.target]
            if recomputing and isinstance(module, nn.modules.batchnorm._BatchNorm) and module.training:
                # The forward pass has updated the running statistics: run the layer as it ran then (the
                # checkpoint compares what it saves) and put the statistics back afterwards, also when
                # the checkpoint stops the recomputation early by raising from inside the layer.
                before = [b.clone() for b in module.buffers(recurse=False)]
                try:
                    return module(*args, **kwargs)
                finally:
                    with torch.no_grad():
                        for b, old in zip(module.buffers(recurse=False), before):
                            b.copy_(old)
            return module(*args, **kwargs)
        if node.op == "call_function":
            return node.target(*args, **kwargs)
        if node.op == "call_method":
            return getattr(args[0], node.target)(*args[1:], **kwargs)
        if node.op == "get_attr":
            return _fetch_attr(self.prep.gm, node.target)
        raise UnsupportedProblem(f"fx node {node.name}: op {node.op!r} is not supported")

    def _run_segment(self, first: int, last: int, env: dict) -> None:
        inside = self.prep.nodes[first:last + 1]
        members = set(inside)
        inputs = list(dict.fromkeys(a for n in inside for a in n.all_input_nodes if a not in members))
        outputs = [n for n in inside if any(u not in members for u in n.users)]
        calls = [0]

        def run(*values: Any) -> tuple:
            local = dict(zip(inputs, values))
            recomputing = calls[0] > 0
            calls[0] += 1
            for i, node in enumerate(inside, first):
                local[node] = self._run_node(node, local, recomputing)
                for dead in self.prep.last_use.get(i, ()):  # free as the main loop does: the segment may be long
                    local.pop(dead, None)
            return tuple(local[n] for n in outputs)

        self.current = last  # the segment's inputs are needed when its last node's backward recomputes it
        results = checkpoint(run, *(env[a] for a in inputs), use_reentrant=False)
        self.stats.segments += 1
        for node, value in zip(outputs, results):
            env[node] = value
            self._tag(node, value, self.prep.index[node.name])

    # -- naming saved tensors ------------------------------------------------------------------------
    def _tag(self, node: fx.Node, value: Any, i: int) -> None:
        if not isinstance(value, torch.Tensor):
            return
        storage = value.untyped_storage()
        ptr = storage.data_ptr()
        known = self.tags.get(ptr)
        if known is None or known[1]() is not storage:  # a new storage (not an in-place result or a view)
            self.tags[ptr] = (node.name, weakref.ref(storage))
        if value.requires_grad:
            value.register_hook(_PrefetchHook(self, self.pass_, i))

    def _name_of(self, t: torch.Tensor) -> str | None:
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr in self.params:
            return None
        known = self.tags.get(ptr)
        if known is not None and known[1]() is storage:
            return known[0]
        if self.forward_running and self.current is not None:
            return self.prep.nodes[self.current].name
        return None

    # -- saved-tensor hooks ---------------------------------------------------------------------------
    def pack(self, t: torch.Tensor) -> Any:
        if not self.forward_running or t.numel() == 0:
            return t
        name = self._name_of(t)
        action = self.prep.actions.get(name, "keep") if name is not None else "keep"
        if action == "release":
            self.stats.kept_released.add(name)
        if action != "offload":
            # detached: autograd would hold the tensor object, and through its grad_fn (an op saving its
            # own output) itself, a cycle the garbage collector cannot see into when no backward frees it
            return t.detach()
        p = self.pass_
        storage = t.untyped_storage()
        key = (storage.data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)
        entry = p.by_key.get(key)
        if entry is None or entry.storage() is not storage:
            if self.copier is None:
                self.copier, self.buffers = self.prep.copies_for(t.device)
            allocated = self.buffers.allocated
            host, free_after = self.buffers.take(t)
            self.stats.host_buffers_allocated += self.buffers.allocated - allocated
            event = self.copier.to_host(t, host, free_after)
            entry = _Offloaded(name, _HostBuffers.key(t), host, event, t.device, self.current, weakref.ref(storage))
            if event is not None:
                self.pending.append((event, t))  # the copy reads it: see _release
            p.by_key[key] = entry
            p.entries.append(entry)
            self.stats.offloaded += 1
            self.stats.bytes_offloaded += t.numel() * t.element_size()
            self.stats.events.append(("offload", name))
        entry.use = max(entry.use, self.current)
        entry.saves += 1
        return entry

    def unpack(self, saved: Any) -> torch.Tensor:
        if not isinstance(saved, _Offloaded):
            return saved
        if saved.host is None:  # every save was unpacked once: its host buffer went back to the pool
            raise UnsupportedProblem(f"the offloaded tensor {saved.name!r} was already used by a backward pass; "
                                     "under execute_plan run backward once per forward (no retain_graph=True "
                                     "for a second backward through offloaded tensors)")
        if not saved.issued:
            self.stats.late_prefetches += 1
            self._prefetch(saved)
        self.copier.wait(saved.ready, saved.device)
        self.stats.events.append(("unpack", saved.name))
        t = saved.dev
        saved.saves -= 1
        if saved.saves == 0:  # the last save is unpacked: autograd holds the tensor, the host buffer is free
            self.buffers.give(saved.key, saved.host, saved.ready)
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

    def _release(self, env: dict | None) -> None:
        """Drop the offloaded device tensors whose storages no value in `env` (None: the forward pass is
        over) lives in, after making the compute stream wait for their copies: the allocator hands
        their memory to later work of the compute stream, which now runs after the copy."""
        if not self.pending:
            return
        live = _storages(tuple(env.values())) if env is not None else set()
        still = []
        for event, t in self.pending:
            if t.untyped_storage().data_ptr() in live:
                still.append((event, t))
            else:
                self.copier.wait(event, t.device)
        self.pending = still

    # -- workspaces ---------------------------------------------------------------------------------
    @contextlib.contextmanager
    def workspaces(self) -> Iterator[None]:
        """Each converted conv runs its kernels within the plan's budgets (its handle's fastest
        configuration within each; the same dict object each step, so its routes are kept)."""
        saved: list[tuple[Conv2d, dict | None]] = []
        try:
            for layer, budgets in self.prep.conv_budgets.items():
                conv = self.prep.convs[layer]
                if not isinstance(conv, Conv2d):
                    continue  # torch's own conv: its workspace is torch's business
                saved.append((conv, conv._budgets))
                conv._budgets = budgets
            yield
        finally:
            for conv, budgets in saved:
                conv._budgets = budgets


class _Tracer(fx.Tracer):
    """fx's tracer, with ucudnn's Conv2d a leaf like torch.nn's own layers (the plan names it as one)."""

    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        return isinstance(m, Conv2d) or super().is_leaf_module(m, qualname)


class _PrefetchHook:
    """A gradient hook on a node's output: fires just before that node's backward step."""

    __slots__ = ("executor", "pass_", "index")

    def __init__(self, executor: _Executor, pass_: _Pass, index: int) -> None:
        self.executor, self.pass_, self.index = executor, pass_, index

    def __call__(self, grad: torch.Tensor) -> None:
        self.executor.reached(self.pass_, self.index)


def _storages(values: Any) -> set[int]:
    """The addresses of the storages of the tensors in `values` (nested tuples, lists and dicts)."""
    found: set[int] = set()
    fx.node.map_aggregate(values, lambda v: found.add(v.untyped_storage().data_ptr())
                          if isinstance(v, torch.Tensor) else None)
    return found


def _fetch_attr(module: nn.Module, target: str) -> Any:
    value: Any = module
    for part in target.split("."):
        value = getattr(value, part)
    return value


@contextlib.contextmanager
def execute_plan(model: nn.Module, plan: MemoryPlan, *, prefetch_ahead: int = 1) -> Iterator[ExecutionStats]:
    """Run the forward and backward passes in this block under `plan`; yields the `ExecutionStats`.

    Call the model (positional and keyword inputs) and `backward()` inside the block (see the module
    docstring for what happens); a training loop enters one block per step, and only the first block
    of a (model, plan) pair traces and checks the model. `prefetch_ahead`: how many offloaded tensors
    beyond those the current backward step needs are fetched ahead. A plan made for another model,
    batch or input size raises `InvalidInput` (the model at enter, the batch and sizes at the first
    forward call).
    """
    if not isinstance(model, nn.Module):
        raise InvalidInput(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(plan, MemoryPlan):
        raise InvalidInput(f"plan must be a ucudnn.memory.MemoryPlan, got {type(plan).__name__}")
    if isinstance(prefetch_ahead, bool) or not isinstance(prefetch_ahead, int) or prefetch_ahead < 0:
        raise InvalidInput(f"prefetch_ahead must be a non-negative integer, got {prefetch_ahead!r}")
    executor = _Executor(model, _prepared(model, plan), prefetch_ahead)
    had_forward = "forward" in model.__dict__
    previous = model.__dict__.get("forward")
    model.forward = executor.forward
    try:
        with executor.workspaces(), torch.autograd.graph.saved_tensors_hooks(executor.pack, executor.unpack):
            yield executor.stats
    finally:
        if had_forward:
            model.forward = previous
        else:
            del model.forward
