"""Planning memory for a PyTorch model: trace it as the planner sees it, profile the device, take each conv's
kernel options from its handle (and the other ops' times from this CPU where planning for it), and call the
planner. Running a plan (`ucudnn.torch.memory`) checks it against the model with this same trace.

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
from functools import lru_cache
from typing import Any

import torch
from torch import fx, nn

from ucudnn.backends.cpu import NATIVE, CpuBackend
from ucudnn.kernel.measure import interleaved_medians_ms
from ucudnn.devices import PROFILES, DeviceProfile, load_profile
from ucudnn.errors import InvalidInput
from ucudnn.handle import Handle, native_only
from ucudnn.memory.graph import TrainingGraph, trace
from ucudnn.memory.plan import MemoryPlan
from ucudnn.memory.timing import KernelOption, front_of
from ucudnn.sizes import parse_size
from ucudnn.torch.conv import Conv2d

__all__ = ["measure_profile", "plan_memory"]


def _trace_graph(model: nn.Module, example_input: torch.Tensor, weight_grads: str = "backward") -> TrainingGraph:
    """The planner's graph of `model` at `example_input`, traced in eval mode (its shape pass must not
    move batch-norm running statistics); every module's training flag is restored."""
    if not isinstance(example_input, torch.Tensor) or example_input.dim() < 1:
        raise InvalidInput(f"example_input must be a batched tensor, got {type(example_input).__name__}")
    with _eval_mode(model):
        return trace(model, example_input, weight_grads=weight_grads)


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
                db: Any = None, weight_grads: str = "backward") -> MemoryPlan:
    """The planner's `MemoryPlan` for training `model` on batches shaped like `example_input`.

    The model is traced with torch.fx (feature maps named after their fx nodes). `device` is a
    profile name (``"h100"``), a profile JSON path, a `DeviceProfile`, or None for the example
    input's device (see the module docstring). `memory_limit` (bytes or ``"2GiB"``) defaults to
    the device's memory. Operation times come from the measurement cache `db` and the measurements
    shipped for the profile where they exist, else from the profile's roofline
    (`ucudnn.memory.timing`). Unknown policies raise `InvalidInput` naming the available ones.
    `weight_grads` is ``"backward"`` where the training loop frees the weight gradients between steps
    (PyTorch's `optimizer.zero_grad()` does by default), ``"step"`` where they persist
    (`zero_grad(set_to_none=False)`, gradient accumulation): see `TrainingGraph`.
    """
    if not isinstance(model, nn.Module):
        raise InvalidInput(f"model must be a torch.nn.Module, got {type(model).__name__}")
    graph = _trace_graph(model, example_input, weight_grads)
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


def _fingerprint(model: nn.Module) -> tuple:
    """What a model's trace depends on: its modules, by identity and class."""
    return tuple((name, id(m), type(m)) for name, m in model.named_modules())


# model -> {(input shape, dtype, fingerprint): {op: (forward ms, backward ms)}}, weak on the model: its
# ops are timed once per input shape, so that every plan made for it rests on the same figures
_OP_TIMES: weakref.WeakKeyDictionary[nn.Module, dict[tuple, dict]] = weakref.WeakKeyDictionary()


def _timed_ops(model: nn.Module, graph: TrainingGraph, example_input: torch.Tensor) -> TrainingGraph:
    """`graph` with each non-conv op's forward and backward times on this CPU (`_op_times`, measured
    once per model and input shape)."""
    key = (tuple(example_input.shape), example_input.dtype, _fingerprint(model))
    times = _OP_TIMES.setdefault(model, {})
    if key not in times:
        times[key] = _op_times(model, graph, example_input)
    ops = tuple(dataclasses.replace(op, measured_ms=times[key][op.name][0], measured_bwd_ms=times[key][op.name][1])
                if op.name in times[key] else op for op in graph.ops)
    return dataclasses.replace(graph, ops=ops)


def _op_times(model: nn.Module, graph: TrainingGraph, example_input: torch.Tensor, reps: int = 5) -> dict:
    """Each non-conv op's forward and backward ms (None: no backward) measured on this CPU inside real
    training steps (forward and backward; the median of `reps`, after an untimed step). A roofline is
    far from what PyTorch's CPU kernels take (4x on ResNet-18), and an op timed alone misses what a
    step adds: batch-norm computes the batch's statistics, and a backward step also sums the gradients
    of a tensor that several ops read (a residual block's input) and allocates fresh memory.

    Forward: each fx node run by an `fx.Interpreter`, timed. Backward: hooks on the autograd node
    that made each fx node's output; the autograd engine runs a CPU backward pass on one thread, node
    after node, so each node's time runs from its start to the next node's start (its gradient sums
    and its weights' gradients included). The steps are plain training steps: measuring needs the
    memory of one. The model's parameters, their gradients, its buffers (running statistics) and the
    random-number state are as they were."""
    from ucudnn.memory.fx import plain_convs

    gm = fx.GraphModule(model, _Tracer().trace(model))
    names = {op.name for op in graph.ops if op.type not in ("conv", "input", "loss")}
    forward: dict[str, list[float]] = {}
    backward: dict[str, list[float]] = {}
    starts: list[tuple[float, str]] = []  # (time, fx node) of each hooked autograd node's start, in order
    hooked: set[int] = set()

    class Timed(fx.Interpreter):
        def run_node(self, n):
            start = time.perf_counter()
            out = super().run_node(n)
            forward.setdefault(n.name, []).append((time.perf_counter() - start) * 1e3)
            node = getattr(out, "grad_fn", None)
            if node is not None and id(node) not in hooked:  # an in-place op's or a view's own node
                hooked.add(id(node))
                node.register_prehook(lambda grads, name=n.name: starts.append((time.perf_counter(), name)))
            return out

    saved = [(p, p.grad) for p in model.parameters()]
    buffers = [(b, b.clone()) for b in model.buffers()]
    with plain_convs(gm), torch.random.fork_rng(devices=[]):
        try:
            for rep in range(reps + 1):
                hooked.clear()
                starts.clear()
                out = Timed(gm).run(example_input)
                loss = sum(t.float().sum() for t in _tensors(out) if t.requires_grad)
                if isinstance(loss, torch.Tensor):
                    loss.backward()
                    end = time.perf_counter()
                    for (start, name), (stop, _) in zip(starts, [*starts[1:], (end, "")]):
                        backward.setdefault(name, []).append((stop - start) * 1e3)
                if rep == 0:  # untimed: a first step sets up kernels and memory
                    forward.clear()
                    backward.clear()
                del out, loss
        finally:
            with torch.no_grad():
                for p, grad in saved:
                    p.grad = grad
                for b, old in buffers:
                    b.copy_(old)
    return {name: (statistics.median(forward[name]),
                   statistics.median(backward[name]) if name in backward else None)
            for name in names if forward.get(name)}


def _tensors(value: Any) -> list[torch.Tensor]:
    """The tensors in a model's output (a tensor, or tuples, lists and dicts of them)."""
    found: list[torch.Tensor] = []
    fx.node.map_aggregate(value, lambda v: found.append(v) if isinstance(v, torch.Tensor) else None)
    return found


class _Tracer(fx.Tracer):
    """fx's tracer, with ucudnn's Conv2d a leaf like torch.nn's own layers (the plan names it as one)."""

    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        return isinstance(m, Conv2d) or super().is_leaf_module(m, qualname)
