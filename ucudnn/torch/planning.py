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


def _timed_ops(model: nn.Module, graph: TrainingGraph, example_input: torch.Tensor, reps: int = 5) -> TrainingGraph:
    """`graph` with each non-conv op's forward and backward times measured on this CPU: each op alone,
    in training mode, on the values it reads in a forward pass (the median of `reps` rounds over all
    ops, after an untimed one). The roofline
    of a host profile is far from what PyTorch's CPU kernels take (4x on ResNet-18), and an op trains
    differently from inference: batch-norm computes the batch's statistics, and a backward step is
    not twice its forward (an addition's only passes its gradient on). The model's parameters,
    buffers (running statistics) and random-number state are as they were."""
    from ucudnn.memory.fx import plain_convs

    gm = fx.GraphModule(model, _Tracer().trace(model))
    names = {op.name for op in graph.ops if op.type not in ("conv", "input", "loss")}
    modules = dict(gm.named_modules())
    values: dict[fx.Node, Any] = {}

    class Recorded(fx.Interpreter):
        def run_node(self, n):
            values[n] = super().run_node(n)
            return values[n]

    forward: dict[str, list[float]] = {}
    backward: dict[str, list[float]] = {}
    buffers = [(b, b.clone()) for b in model.buffers()]
    with plain_convs(gm), torch.random.fork_rng(devices=[]):
        try:
            with torch.no_grad():
                Recorded(gm).run(example_input)
            nodes = [(n, list(modules[n.target].parameters()) if n.op == "call_module" else [])
                     for n in gm.graph.nodes if n.name in names]
            for rep in range(reps + 1):  # interleaved, so that the machine's ups and downs spread over all ops
                for node, params in nodes:
                    fwd, bwd = _time_node(gm, node, values, params)
                    if rep == 0:
                        continue  # untimed: a first call sets up kernels and memory
                    forward.setdefault(node.name, []).append(fwd)
                    if bwd is not None:
                        backward.setdefault(node.name, []).append(bwd)
        finally:
            with torch.no_grad():
                for b, old in buffers:
                    b.copy_(old)
    ops = tuple(dataclasses.replace(op, measured_ms=statistics.median(forward[op.name]),
                                    measured_bwd_ms=statistics.median(backward[op.name])
                                    if op.name in backward else None)
                if op.name in forward else op for op in graph.ops)
    return dataclasses.replace(graph, ops=ops)


def _time_node(gm: fx.GraphModule, node: fx.Node, values: dict, params: list) -> tuple[float, float | None]:
    """One forward and backward run of fx `node` on the recorded `values`, in ms (backward None: the
    node's output has no gradient). Each float tensor it reads becomes a new leaf, and the node reads a
    copy of it made before the clock starts (an in-place op may not write into a leaf)."""
    leaves: list[torch.Tensor] = []

    def fresh(v: Any) -> Any:
        if isinstance(v, torch.Tensor) and v.is_floating_point():
            leaves.append(v.detach().clone().requires_grad_())
            return leaves[-1].clone()
        return v

    args = fx.node.map_arg(node.args, lambda a: fx.node.map_aggregate(values[a], fresh))
    kwargs = fx.node.map_arg(node.kwargs, lambda a: fx.node.map_aggregate(values[a], fresh))
    interpreter = fx.Interpreter(gm)
    start = time.perf_counter()
    out = getattr(interpreter, node.op)(node.target, args, kwargs)
    fwd = (time.perf_counter() - start) * 1e3
    wrt = [t for t in leaves + params if t.requires_grad]
    if not isinstance(out, torch.Tensor) or out.grad_fn is None or not wrt:
        return fwd, None
    grad = torch.ones_like(out)
    start = time.perf_counter()
    torch.autograd.grad(out, wrt, grad, allow_unused=True)
    return fwd, (time.perf_counter() - start) * 1e3


class _Tracer(fx.Tracer):
    """fx's tracer, with ucudnn's Conv2d a leaf like torch.nn's own layers (the plan names it as one)."""

    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        return isinstance(m, Conv2d) or super().is_leaf_module(m, qualname)
