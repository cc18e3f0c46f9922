"""Planning memory for a PyTorch model: capture its training step, profile the device, take each conv's
kernel options from its handle (and the other ops' times from real steps on this machine where planning
for it), and call the planner. Running a plan (`ucudnn.torch.running.executor`) follows the same captured step.

`plan_memory(model, example_input, ...)` captures one training step (`ucudnn.torch.capturing.capture`: forward,
loss, backward, on fake tensors where the model runs on them) and calls the planner
(`ucudnn.memory.planner.make_executed_plan`: the policy's plan, with the figures of its step as
`execute_plan` times the copies back). With ``device=None`` the device is the example input's: a built-in
profile when a CUDA device's name matches one (an H100 is ``h100``), else a profile measured on the
spot (`measure_profile`: the host's memory and its copy and matmul throughput on the CPU; the
GPU's memory, pinned copy bandwidth and matmul throughput on CUDA). Planning for the machine the
example input is on (``device=None``, real inputs), the ops are timed in real training steps there
and the convolutions' kernels measured through the cache; otherwise the profile's figures serve.

A capture on fake tensors is checked against the real step where the example inputs are real and `fake` is
None: the timed steps follow it operation by operation (`_Timer`), or, where none run (a `device` profile
given), one real forward pass and loss do (`_follow`). A model can run otherwise on fake tensors than on real
ones (transformers' ``is_tracing()`` takes a FakeTensor for tracing: HF ConvBERT skips a padding check); its
step is then captured on the real inputs, as ``fake=False`` asks, and planned from that capture.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
import platform
import statistics
import time
import weakref
from collections.abc import Callable
from functools import cache, partial
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from ucudnn.backends.base import one_line
from ucudnn.backends.cpu import NATIVE, CpuBackend
from ucudnn.devices import PROFILES, DeviceProfile, load_profile
from ucudnn.errors import InvalidInput, UnsupportedProblem
from ucudnn.handle import Handle, native_only
from ucudnn.memory.graph import TrainingGraph
from ucudnn.memory.plan import MemoryPlan
from ucudnn.memory.reuse import PlanCache
from ucudnn.memory.timing import KernelOption, front_of
from ucudnn.sizes import parse_size
from ucudnn.torch.capturing.capture import CapturedStep, capture, diverged, hook_nodes, state_kept
from ucudnn.torch.capturing.model_call import batched_call, call_args, default_loss
from ucudnn.torch.capturing.operations import counted, same_op
from ucudnn.torch.converting.launch import held_with_copies
from ucudnn.torch.converting.layer import ConvLayer, as_torch
from ucudnn.torch.planning.compiled_step import compiled_costs, compiled_plan, modelled_peak, traced_peak
from ucudnn.torch.planning.replay_cost import replay_host_ms

__all__ = ["measure_profile", "plan_memory"]

log = logging.getLogger("ucudnn.torch.planning.planner")


def _best_ms(fn, reps: int = 3) -> float:
    best = math.inf
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best * 1e3


@cache
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
        return DeviceProfile(
            "host",
            f"host CPU ({model}, {os.cpu_count()} threads)",
            os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"),
            h2d_gbps=gbps,
            d2h_gbps=gbps,
            duplex_gbps=gbps,
            devices_per_link=1,
            fp32_tflops=2 * 1024**3 / mm_ms / 1e9,
            memory_gbps=2 * gbps,
            source="measured by ucudnn.torch.measure_profile",
            shares_host_memory=True,
        )
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

        def run() -> None:
            fn()
            torch.cuda.synchronize(dev)

        return _best_ms(run)

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
    return DeviceProfile(
        f"cuda{dev.index or 0}",
        props.name,
        int(props.total_memory),
        h2d_gbps=h2d,
        d2h_gbps=d2h,
        duplex_gbps=duplex,
        devices_per_link=1,
        fp32_tflops=tflops,
        memory_gbps=mem,
        source="measured by ucudnn.torch.measure_profile",
    )


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


@contextlib.contextmanager
def _autocast_uncached():
    """Autocast's cast cache off: each step planning runs casts the weights, as a training step's first forward
    pass in its own autocast block does (a step captured reading an earlier run's cached casts is not that step)."""
    before = torch.is_autocast_cache_enabled()
    torch.set_autocast_cache_enabled(False)
    try:
        yield
    finally:
        torch.set_autocast_cache_enabled(before)


@_autocast_uncached()
def plan_memory(
    model: nn.Module,
    example_input: Any,
    memory_limit: int | str | None = None,
    policy: str = "optimal",
    device: DeviceProfile | str | None = None,
    *,
    devices: int = 1,
    db: Any = None,
    weight_grads: str = "backward",
    loss: Callable[[Any], torch.Tensor] | None = None,
    fake: bool | None = None,
    compiled: bool = False,
) -> MemoryPlan:
    """The planner's `MemoryPlan` for training `model` on batches shaped like `example_input`.

    `example_input`: a tensor, a tuple of positional arguments or a dict of keyword arguments (its
    first tensor's first dimension is the batch). `loss`: a callable from the model's output (a tensor,
    a tuple, a dict, a `ModelOutput`) to the scalar the training loop backpropagates; its memory is
    counted. By default the output's ``loss`` where it has one, else the sum of its floating tensors.
    `fake`: capture on fake tensors (True), on the real inputs (False), or fake where the model runs on
    them as on real ones (None: with real inputs, a real step checks it; see the module docstring). `device`
    is a profile name (``"h100"``), a profile JSON path, a `DeviceProfile`, or None for the example input's
    device (see the module docstring). `memory_limit` (bytes or ``"2GiB"``) defaults to the device's memory;
    a limit below every plan (``1``) gives the policy's plan of least peak, and ``optimal``'s is the smallest
    plan there is. Unknown policies raise `InvalidInput` naming the available ones.
    `compiled`: plan for the step `torch.compile` makes of ``with_plan(model, plan)`` (see
    `ucudnn.torch.planning.compiled_step`): maps kept or recomputed, never offloaded, the recomputation of what
    Inductor fuses almost free, and the peak the compiled step's; the example inputs must be real ones on this
    machine (the step is traced once per distinct plan tried).
    `weight_grads` is ``"backward"`` where the training loop frees the weight gradients between steps
    (PyTorch's `optimizer.zero_grad()` does by default), ``"step"`` where they persist
    (`zero_grad(set_to_none=False)`, gradient accumulation): see `TrainingGraph`. The plan carries its
    captured step (`MemoryPlan.capture`), which `execute_plan` follows.
    """
    if not isinstance(model, nn.Module):
        raise InvalidInput(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if isinstance(model, nn.parallel.DistributedDataParallel):  # (its first forward pass is not its later ones)
        raise InvalidInput(
            "model is a DistributedDataParallel: plan the module it wraps (plan_memory(ddp.module, ...)) and train "
            "DDP(with_plan(module, plan))"
        )
    if fake is None and any(torch.is_autocast_enabled(d) for d in ("cpu", "cuda")):
        fake = False  # under autocast, batch-norm on fake tensors saves its statistics in another dtype than real
    key, step = _captured(model, example_input, loss, fake, weight_grads)
    args, kwargs, tensors = batched_call(example_input)
    first = tensors[0]
    profile = _profile_for(device, first)
    limit = profile.memory_bytes if memory_limit is None else parse_size(memory_limit)
    from ucudnn.memory.planner import make_executed_plan

    graph, fronts = step.graph, None
    real = not any(isinstance(t, FakeTensor) for t in tensors)
    loss_of = loss or default_loss
    if real and device is not None and fake is None and step.fake and key not in _FOLLOWED.get(model, ()):
        # no real step runs below: one real forward pass and loss check the capture on fake tensors
        step = _checked(model, example_input, key, step, lambda s: _follow(model, s, args, kwargs, loss_of))
    if real and device is None:  # planning for the machine the inputs are on: time the ops there, measure the kernels
        holder = []
        step = _checked(
            model,
            example_input,
            key,
            step,
            lambda s: holder.append(_timed_ops(model, s, args, kwargs, loss_of, replayed=not compiled)),
        )
        graph = holder[-1]
        fronts = _fronts_for(model, step, graph, db, first.device.type == "cpu")
    if not compiled:
        # planned from the capture itself (no database: it may learn more), the plans share a PlanCache at every limit
        held = graph is step.graph and db is None
        cache = _PLAN_CACHES.setdefault(model, {}).setdefault(key, PlanCache()) if held else None
        plan = make_executed_plan(graph, profile, limit, policy, devices=devices, db=db, fronts=fronts, cache=cache)
        return dataclasses.replace(plan, capture=step)
    if not real:
        raise InvalidInput("compiled=True plans from a compiled step on real example inputs, got fake tensors")
    costs, host = compiled_costs(graph), dataclasses.replace(profile, shares_host_memory=True)
    return compiled_plan(
        step,
        costs,
        limit,
        lambda target: make_executed_plan(costs, host, target, policy, devices=devices, db=db, fronts=fronts),
        lambda plan: modelled_peak(costs, host, plan),
        lambda plan: traced_peak(model, key, plan, args, kwargs, loss_of),
    )


# model -> {(its modules, the inputs' shapes, the loss, fake, weight_grads): its captured step}, weak on the
# model: plans at several limits (a search for the smallest peak, a sweep) capture the model once
_CAPTURES: weakref.WeakKeyDictionary[nn.Module, dict[tuple, CapturedStep]] = weakref.WeakKeyDictionary()


# model -> the keys of `_CAPTURES` whose step a real step on this machine followed (the timed steps, `_follow`)
_FOLLOWED: weakref.WeakKeyDictionary[nn.Module, set[tuple]] = weakref.WeakKeyDictionary()

# model -> {the keys of `_CAPTURES`: what the plans of that step computed}, weak on the model (a sweep of limits)
_PLAN_CACHES: weakref.WeakKeyDictionary[nn.Module, dict[tuple, PlanCache]] = weakref.WeakKeyDictionary()


def _captured(
    model: nn.Module, example_input: Any, loss: Callable | None, fake: bool | None, weight_grads: str
) -> tuple[tuple, CapturedStep]:
    """The key of `_CAPTURES` for this capture and its step, captured where it is not held."""
    args, kwargs = call_args(example_input)
    inputs = tuple(
        (t.shape, t.dtype, t.device, type(t)) if isinstance(t, torch.Tensor) else repr(t)
        for t in tree_leaves((args, sorted(kwargs.items())))
    )
    key = (_fingerprint(model), inputs, loss, fake, weight_grads)
    steps = _CAPTURES.setdefault(model, {})
    if key not in steps:
        steps[key] = capture(model, example_input, loss=loss, fake=fake, weight_grads=weight_grads)
    return key, steps[key]


class _Diverged(UnsupportedProblem):
    """A real step did not run the captured step's operations (`_Timer`): the `i`-th was `func` (None: the step
    ran `i` operations where the captured one ran more)."""

    def __init__(self, step: CapturedStep, i: int, func: Any) -> None:
        self.step, self.i, self.func = step, i, func
        super().__init__(self.why("its control flow depends on its data, or the model changed"))

    def why(self, reason: str) -> str:
        """The divergence and `reason`, in one line."""
        return f"{diverged(self.step, self.i, self.func)}; {reason}"


def _checked(
    model: nn.Module, example_input: Any, key: tuple, step: CapturedStep, follow: Callable[[CapturedStep], Any]
) -> CapturedStep:
    """`step` where a real step follows it (`follow(step)` raises `_Diverged` where not, returns False where no
    real step can run). Else the step is captured
    again, on the real inputs unless the caller asked for fake tensors (``fake=True``, the key's), held in
    `_CAPTURES` in its place and followed in turn: a capture on fake tensors that the real step does not run (the
    model takes its fake tensors for a trace), or one the model has moved on from. Where that one diverges too, the
    refusal says why, in one line: what a plan cannot follow, or that ``fake=False`` captures what runs."""
    _, _, loss, fake, weight_grads = key
    followed = _FOLLOWED.setdefault(model, set())
    for attempt in range(2):
        try:
            if follow(step) is False:
                return step  # (not checked: no real step runs here)
        except _Diverged as exc:
            followed.discard(key)
            if attempt or fake:  # (fake=True: captured again on fake tensors, it would run as this one)
                if exc.step.fake:
                    raise UnsupportedProblem(
                        exc.why(
                            "the step captured on fake tensors differs from the real "
                            "step (the model runs otherwise on fake tensors); pass "
                            "fake=False to capture it on the real inputs"
                        )
                    ) from None
                raise UnsupportedProblem(
                    exc.why(
                        "captured on the same inputs, the real step runs otherwise from one "
                        "step to the next (its control flow follows random draws or state "
                        "it keeps outside its parameters and buffers), which no plan "
                        "can follow"
                    )
                ) from None
            step = capture(model, example_input, loss=loss, fake=bool(fake), weight_grads=weight_grads)
            _CAPTURES.setdefault(model, {})[key] = step
            continue
        followed.add(key)
        return step
    raise AssertionError("unreachable")


def _follow(model: nn.Module, step: CapturedStep, args: tuple, kwargs: dict, loss: Callable) -> bool:
    """One real forward pass and loss of `model` (no backward pass), each operation checked against `step`'s as
    the timed steps check them (`_Timer`); `_Diverged` where they differ, False where the pass cannot run here
    (out of memory: the inputs are a batch for another device), True where it follows the step. The model's
    parameters' gradients, its buffers and the random-number state are as they were."""
    timer = _Timer(step)
    with state_kept(model), as_torch(), torch.enable_grad():
        try:
            with timer:
                value = loss(model(*args, **kwargs))
        except _Diverged:
            raise
        except Exception as exc:  # noqa: BLE001 - it cannot run here (a batch for a larger device): unchecked
            log.info(
                "the capture of %s on fake tensors is not checked: its real step failed here: %s",
                step.graph.network,
                one_line(exc),
            )
            return False
        del value
    if timer.position != len(step.ops):
        raise _Diverged(step, timer.position, None)
    return True


# model -> {(captured step, db, its converted layers' handles): (step, handles, the kernels' options)}, weak on
# the model: the plans of a sweep read each kernel's options once (each read queries the measurement database)
_FRONTS: weakref.WeakKeyDictionary[nn.Module, dict[tuple, tuple]] = weakref.WeakKeyDictionary()


def _fronts_for(model: nn.Module, step: CapturedStep, graph: TrainingGraph, db: Any, cpu: bool) -> dict:
    """`_conv_fronts` of the timed `graph` of `step`, where planning for this machine: on the CPU, torch's own
    convolutions measured by a handle of PyTorch's kernel. Made once per (model, step, db, handles): a converted
    layer's handle that is replaced or re-planned since (its generation) reads its options again."""
    native = partial(Handle, backend=CpuBackend(numpy_threads=1), policy="undivided", algos=[NATIVE], db=db)
    if db is not None and not isinstance(db, (str, bool, os.PathLike)):  # a database object: not a key
        return _conv_fronts(model, graph, native() if cpu else None)
    handles = {id(m.handle): m.handle for m in model.modules() if isinstance(m, ConvLayer)}
    key = (id(step), db, cpu, tuple(sorted((i, h.generation) for i, h in handles.items())))
    cached = _FRONTS.setdefault(model, {})
    held = cached.get(key)
    # (what the key names by id is held with it, so that no other object has taken that id)
    if held is None or held[0] is not step or any(held[1].get(i) is not h for i, h in handles.items()):
        held = cached[key] = step, handles, _conv_fronts(model, graph, native() if cpu else None)
    return held[2]


# (the kernels are measured in their problems' dtypes: not recast by an autocast block around plan_memory)
@torch.autocast("cpu", enabled=False)
def _conv_fronts(model: nn.Module, graph: TrainingGraph, native: Handle | None) -> dict:
    """The options of each conv's kernels: a converted conv's as its own handle measures them (so
    that the plan's workspace budgets are ones its kernels run within), and where `native` is given
    (planning for this CPU), a torch conv's as that handle measures torch's own convolution. Through
    the measurement cache: what is measured here, a converted layer's first step does not measure again."""
    modules = dict(model.named_modules())
    convs = {op.name: op for op in graph.conv_ops}
    fronts = {}
    for step in graph.steps:
        op = convs.get(step.op)
        if op is None:
            continue
        conv = modules.get(op.module)
        converted = isinstance(conv, ConvLayer)
        handle = (
            conv.handle
            if isinstance(conv, ConvLayer)
            else native
            if isinstance(conv, nn.modules.conv._ConvNd)
            else None
        )
        if handle is None:
            continue
        assert op.conv is not None  # a conv op holds its problem
        torch_kinds = conv._torch_kinds(op.conv) if isinstance(conv, ConvLayer) else set()
        copies = {kind: (copied, converted) for kind, copied, converted in op.layout_copies}
        for kind in step.kernels:
            problem = op.conv.with_kind(kind)
            if not converted and problem.dtype in ("float16", "bfloat16"):
                # torch's conv under autocast: the CPU backend's handle runs float32 only, and the plan holds no
                # workspace for torch's conv, so the float32 kernel's time stands in for its time
                problem = dataclasses.replace(problem, dtype="float32", compute_type="")
            # a kind the layer's own route leaves to torch stays torch's under a plan (`ConvLayer._route`):
            # torch's option alone, or the plan would charge a workspace option that nothing holds
            torch_own = handle.native(problem) if kind in torch_kinds else None
            # torch's own convolution run by torch (a torch layer, or a converted layer whose plan is
            # native on the whole batch) allocates its temporaries inside its kernels, out of the
            # plan's reach: the step holds no workspace for it, whatever its budget
            fronts[(step.op, kind)] = tuple(
                KernelOption(
                    c.time,
                    c.workspace if converted else 0,
                    c.describe(),
                    "measured",
                    held=0 if native_only(c) else held_with_copies(c.workspace, copies.get(kind)),
                )
                for c in ([torch_own] if torch_own is not None else handle.front(problem))
            )
        if set(step.kernels) == {"bwd_data", "bwd_filter"}:
            _fuse_native_backward(fronts, step.op, op.conv, op.measured_bwd_ms)
    return fronts


def _fuse_native_backward(fronts: dict, layer: str, problem, fused_ms: float | None) -> None:
    """Where torch runs both backward kernels of a layer, it runs them as one call, which costs less
    than the two measured apart (shared work and one launch: about 0.6x on ResNet-18's CPU layers).
    So the native options of the two fronts are scaled by the fused call's time, as the timed training
    steps measured the layer's backward step (`fused_ms`), over their sum."""
    options = [
        next((o for o in fronts[(layer, kind)] if o.config == f"1x{problem.n}:{NATIVE}"), None)
        for kind in ("bwd_data", "bwd_filter")
    ]
    found = [o for o in options if o is not None]
    if len(found) < len(options) or fused_ms is None:
        return
    scale = fused_ms / sum(o.time_ms for o in found)
    if scale >= 1:
        return
    for kind in ("bwd_data", "bwd_filter"):  # a cheaper native option may now dominate others
        fronts[(layer, kind)] = front_of(
            dataclasses.replace(o, time_ms=o.time_ms * scale) if o in options else o for o in fronts[(layer, kind)]
        )


def _fingerprint(model: nn.Module) -> tuple:
    """What a model's captured step depends on: its modules, by identity and class."""
    return tuple((name, id(m), type(m)) for name, m in model.named_modules())


# model -> {(input shapes, fingerprint, fake): {op: (forward ms, backward ms)}, (..., "replay"): replay host ms},
# weak on the model: measured once per input shape, so that every plan made for it rests on the same figures
_OP_TIMES: weakref.WeakKeyDictionary[nn.Module, dict[tuple, Any]] = weakref.WeakKeyDictionary()


def _timed_ops(
    model: nn.Module, step: CapturedStep, args: tuple, kwargs: dict, loss: Callable, replayed: bool = True
) -> TrainingGraph:
    """The captured graph with each op's forward and backward times on this machine (`_op_times`) and, where
    `replayed` (the eager executor recomputes; a compiled step does not replay), the host time a recomputation
    costs per replayed op (`replay_host_ms`), each measured once per model and input shapes."""
    shapes = tuple((tuple(t.shape), t.dtype) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor))
    key = (shapes, _fingerprint(model), step.fake)  # (a capture on fake tensors is followed by real steps: timed)
    times, replay = _OP_TIMES.setdefault(model, {}), (*key, "replay")
    if key not in times:
        times[key] = _op_times(model, step, args, kwargs, loss)
    graph = _with_times(step.graph, times[key])
    if replayed and replay not in times:
        times[replay] = replay_host_ms(model, step, graph, args, kwargs, loss)
    return dataclasses.replace(graph, replay_host_ms=times[replay]) if replayed else graph


def _with_times(graph: TrainingGraph, measured: dict[str, tuple[float, float | None]]) -> TrainingGraph:
    ops = tuple(
        dataclasses.replace(op, measured_ms=measured[op.name][0], measured_bwd_ms=measured[op.name][1])
        if op.name in measured
        else op
        for op in graph.ops
    )
    return dataclasses.replace(graph, ops=ops)


class _Timer(TorchDispatchMode):
    """Times each operation of the forward pass and the loss, by its place in the captured step; an
    operation that is not a graph op (a view) adds to the graph op before it."""

    def __init__(self, step: CapturedStep) -> None:
        super().__init__()
        self.step, self.position, self.ms = step, 0, [0.0] * len(step.ops)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        start = time.perf_counter()
        out = func(*args, **(kwargs or {}))
        ms = (time.perf_counter() - start) * 1e3
        if counted(func, tree_leaves(out)):
            ops = self.step.ops
            i = self.position
            if i >= len(ops) or not same_op(func, ops[i].func):
                raise _Diverged(self.step, i, func)
            self.ms[i] += ms
            self.position += 1
        elif self.position:
            self.ms[self.position - 1] += ms
        return out


def _op_times(
    model: nn.Module, step: CapturedStep, args: tuple, kwargs: dict, loss: Callable, reps: int = 5
) -> dict[str, tuple[float, float | None]]:
    """Each graph op's forward and backward ms (None: no backward step) measured on this machine inside
    real training steps (the median of `reps`, after an untimed step). A roofline is far from what
    PyTorch's CPU kernels take (4x on ResNet-18), and an op timed alone misses what a step adds: batch-norm
    computes the batch's statistics, and a backward step also sums the gradients of a tensor that
    several ops read and allocates fresh memory.

    Forward: each operation timed by a dispatch mode (`_Timer`); converted convolutions run as torch's own
    (`as_torch`: their times are their handles' measurements, and a WD handle must not solve yet). Backward: a pre-hook on every autograd
    node; the engine runs a CPU backward pass on one thread, node after node, so each node's time runs
    from its start to the next node's start, and a node is the step of the op that made it (by its
    sequence number's offset from the step's first, as captured). The model's parameters, their
    gradients, its buffers and the random-number state are as they were."""
    by_node = {op.node: i for i, op in enumerate(step.ops) if op.node is not None}
    graph_ops = [op.name for op in step.ops]
    forward: dict[str, list[float]] = {}
    backward: dict[str, list[float]] = {}
    with state_kept(model), as_torch(), torch.enable_grad():
        for rep in range(reps + 1):
            for p in model.parameters():
                p.grad = None
            timer = _Timer(step)
            starts: list[tuple[float, int | None]] = []

            def began(first: int, seq: int, grads: Any) -> None:
                starts.append((time.perf_counter(), by_node.get(seq - first)))  # noqa: B023 - this iteration's

            first = torch._C._autograd._get_sequence_nr()
            with timer:
                value = loss(model(*args, **kwargs))
            handles = hook_nodes(value.grad_fn, partial(began, first))
            try:
                value.backward()
            finally:
                for h in handles:
                    h.remove()
            end = time.perf_counter()
            del value
            if timer.position != len(step.ops):
                raise _Diverged(step, timer.position, None)
            if rep == 0:  # untimed: a first step sets up kernels and memory
                continue
            fwd: dict[str, float] = {}
            name = ""
            for i, ms in enumerate(timer.ms):
                name = graph_ops[i] or name
                if name:
                    fwd[name] = fwd.get(name, 0.0) + ms
            bwd: dict[str, float] = {}
            name = ""
            for (start, op), (stop, _) in zip(starts, [*starts[1:], (end, None)]):
                name = (graph_ops[op] if op is not None else "") or name
                if name:
                    bwd[name] = bwd.get(name, 0.0) + (stop - start) * 1e3
            for n, ms in fwd.items():
                forward.setdefault(n, []).append(ms)
            for n, ms in bwd.items():
                backward.setdefault(n, []).append(ms)
    return {
        n: (statistics.median(ms), statistics.median(backward[n]) if n in backward else None)
        for n, ms in forward.items()
    }
