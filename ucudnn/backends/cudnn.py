"""The `cudnn` backend: cuDNN engine configs through the cuDNN Frontend Python API, on CuPy memory.

Three modules call the frontend, one idea each: `cudnn_graph` declares a kernel's graph (N-d
tensors and convolution descriptors), `cudnn_engines` names, enumerates and builds engine configs,
and this one is the backend: the device, its caches of enumerations and built plans, operands,
running and timing. Every problem form runs: 2-D, 3-D and 1-D (2-D of height 1) directly, and a
transposed convolution as its `lowered` convolution's kernel (its forward is that convolution's
dgrad with x in dy's place, its dgrad a forward, its wgrad the convolution's with x and dy
swapped), so no transposed graph is ever declared.

API followed (nvidia-cudnn-frontend 1.32, read from its installed sources and NVIDIA/cudnn-frontend):
`execute_plan_at_index` addresses a built plan (cudnn/_pygraph.py); `cudnn.create_handle()` and
`cudnn.set_stream(handle, stream)`: cudnn/__init__.py; a variant pack keyed by graph tensors, or
a tuple of buffers with their `tensor_uids` (`pygraph.execute`'s docstring), of raw device pointers
(CuPy's `.data.ptr`), which borrow the graph's declared geometry: cudnn/_pygraph.py
(`pygraph._describe`).

Code conventions that tests/test_cudnn_api.py relies on, in every module of `FRONTEND_MODULES`: the
frontend module is always the local name `cudnn`, a graph is always `graph`, and graph tensors are
names ending in `_t`. The test reads those modules' syntax trees and checks every `cudnn.X`,
`graph.X` and `*_t.X` against `CUDNN_API_USED` and against the installed frontend, so it runs
without a GPU.

Memory beyond the workspace: cuDNN's graph API fixes alpha = 1 and beta = 0, so a call with other
values (and every bwd_filter micro-batch after the first, which accumulates with beta = 1) computes
into a temporary of the output's size and blends `out = alpha * tmp + beta * out` in ONE fused
elementwise kernel, in float32 (float64 for float64 data). bfloat16, which CuPy stores as uint16
bits, blends through float32 arrays with several CuPy operations. Measurements of bwd_filter
micro-batches are taken with beta = 1 (`Backend.measure(accumulate=True)`), so this blend is
charged where it runs. An operand whose device pointer is not 16-byte aligned (a micro-batch slice
of an odd-sized tensor) is copied to an aligned buffer first.

Timing: one sample is several launches back to back between two CUDA events, queued behind a
short spin kernel that holds the stream while the host enqueues them, so the ~50 us of Python per
launch never sits between kernels (`time_run_ms`; the launch count and the spin kernel are in
`cuda_timing`, the CuPy dtype handling and blend kernels in `cupy_arrays`).
"""

from __future__ import annotations

import logging
import math
import weakref
from collections.abc import Mapping, Sequence
from typing import Any

from ucudnn.backends.base import Backend, DeviceInfo, one_line
from ucudnn.backends.cuda_timing import HOST_MS_PER_LAUNCH, MAX_HOLD_MS, _hold_kernel, launches_per_sample
from ucudnn.backends.cudnn_engines import (
    PROMOTED_SUFFIX,
    EngineConfig,
    Enumeration,
    Lru,
    Plan,
    build_plan,
    enumerate_engines,
    promotions,
    static_reason,
)
from ucudnn.backends.cudnn_graph import DeclaredGraph, declare_graph, layout_strides
from ucudnn.backends.cupy_arrays import _narrow, _storage_dtype, _widen, blend
from ucudnn.errors import BackendUnavailable, InvalidInput, UnsupportedProblem
from ucudnn.problem import ConvProblem

__all__ = [
    "ALIGNMENT_BYTES",
    "CUDNN_API_USED",
    "ENUMERATION_CACHE_ENTRIES",
    "FRONTEND_MODULES",
    "HOST_MS_PER_LAUNCH",
    "MAX_HOLD_MS",
    "PLAN_CACHE_ENTRIES",
    "PROMOTED_SUFFIX",
    "CudnnBackend",
    "DeclaredGraph",
    "EngineConfig",
    "declare_graph",
    "layout_strides",
]

log = logging.getLogger(__name__)

# The modules that call the cuDNN frontend; tests/test_cudnn_api.py reads each of them.
FRONTEND_MODULES = ("ucudnn.backends.cudnn_graph", "ucudnn.backends.cudnn_engines", "ucudnn.backends.cudnn")
# Every attribute of the frontend those modules touch, by the object it is read from. Kept exact
# (tests/test_cudnn_api.py fails on an unlisted use and on an unused entry) and checked against the
# installed `cudnn` module, `cudnn.pygraph` and `cudnn.Tensor`.
CUDNN_API_USED: dict[str, tuple[str, ...]] = {
    "cudnn": (
        "__version__",
        "backend_version",
        "backend_version_string",
        "create_handle",
        "cudnnGraphNotSupportedError",
        "data_type",
        "destroy_handle",
        "heur_mode",
        "knob_type",
        "pygraph",
        "set_stream",
    ),
    "cudnn.data_type": ("BFLOAT16", "DOUBLE", "FLOAT", "HALF"),
    "cudnn.heur_mode": ("A", "FALLBACK"),
    "graph": (
        "build_operation_graph",
        "build_plan_at_index",
        "check_support",
        "conv_dgrad",
        "conv_fprop",
        "conv_wgrad",
        "create_execution_plan",
        "create_execution_plans",
        "execute_plan_at_index",
        "get_engine_and_knobs_at_index",
        "get_execution_plan_count",
        "get_workspace_size_plan_at_index",
        "tensor",
        "validate",
    ),
    "tensor": ("set_data_type", "set_dim", "set_output", "set_stride", "uid"),
}

# Built plans kept per (problem, batch, algorithm). A plan holds host descriptors and, for
# runtime-compiled engines, a loaded kernel: a few hundred cover every kernel of a large network
# at the micro-batch sizes of the powerOfTwo policy for the algorithms that win.
PLAN_CACHE_ENTRIES = 256
# Enumerated graphs (one per problem, batch and compute type), each holding every plan it built.
ENUMERATION_CACHE_ENTRIES = 64
# What a cached cuDNN measurement's verification covered, part of its cache key: 2 verifies against
# a NaN output and, for accumulating micro-batches, with beta = 1 (2026-11-26). Rows verified before
# (a zeroed output, beta = 0 only) may hold an engine that is wrong when accumulating: not served.
VERIFICATION = "2"
# The frontend declares its tensors 16-byte aligned (CUDNN_ATTR_TENSOR_BYTE_ALIGNMENT); a pointer
# off that alignment is refused or misread by vectorised kernels, so such operands are copied.
ALIGNMENT_BYTES = 16
# What each kind reads, by the names the caller passes them.
_INPUTS = {"fwd": ("x", "w"), "bwd_data": ("dy", "w"), "bwd_filter": ("x", "dy")}


def _caller_name(problem: ConvProblem, graph_name: str) -> str:
    """The caller's name of an operand the lowered graph calls `graph_name`: a transposed
    problem's x is its convolution's dy, and its dy that convolution's x (ConvProblem.lowered)."""
    if problem.transposed:
        return {"x": "dy", "dy": "x"}.get(graph_name, graph_name)
    return graph_name


def _probe() -> tuple[Any, Any, int]:
    """CuPy, the frontend and the current device, or BackendUnavailable saying what is missing."""
    try:
        import cupy
    except ImportError as exc:
        raise BackendUnavailable(
            f"cupy is not installed or does not import ({one_line(exc)}); "
            f"install cupy-cuda12x (cupy-cuda13x on CUDA 13)"
        ) from None
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:  # noqa: BLE001 - CUDARuntimeError without a driver; anything else CuPy raises is the same answer
        raise BackendUnavailable(f"no CUDA device: CuPy cannot reach one ({one_line(exc)})") from None
    if count < 1:
        raise BackendUnavailable("no CUDA device: CuPy sees 0 devices")
    try:
        import cudnn
    except ImportError as exc:
        raise BackendUnavailable(
            f"the cuDNN frontend is not installed ({one_line(exc)}); install nvidia-cudnn-frontend"
        ) from None
    try:
        cudnn.backend_version()
    except Exception as exc:  # noqa: BLE001 - the binding raises RuntimeError("Unable to find symbol cudnnGetVersion")
        raise BackendUnavailable(
            f"libcudnn is not loadable ({one_line(exc)}); install nvidia-cudnn-cu12 "
            f"(nvidia-cudnn-cu13 on CUDA 13) "
            f"or put libcudnn.so.9 on LD_LIBRARY_PATH"
        ) from None
    return cupy, cudnn, int(cupy.cuda.runtime.getDevice())


def _release(caches: Sequence[Lru], cudnn: Any, handle: Any) -> None:
    # Graphs first: they were lowered with this handle.
    for cache in caches:
        cache.clear()
    cudnn.destroy_handle(handle)


class CudnnBackend(Backend):
    """cuDNN through the frontend's graph API. Arrays are CuPy, on the device current at creation."""

    name = "cudnn"
    # The first run of a plan pays lazy module loading and clock ramp-up.
    warmup_runs = 2
    # float32 graphs may run on TF32 tensor cores (cuDNN's default math mode on sm_80 and later).
    tf32 = True
    # Device memory comes from a caching allocator (PyTorch's under ucudnn.torch, else CuPy's pool), which
    # hands the same block back run after run, as for PyTorch's own cuDNN convolutions. Held between runs,
    # a buffer first taken while torch.compile's CUDA graphs warm up would sit in their private pool,
    # where every live block must be a graph's output (cudagraph_trees.check_memory_pool).
    workspace_per_run = True

    def __init__(self) -> None:
        cupy, cudnn, device_id = _probe()
        self._device_id = device_id
        with cupy.cuda.Device(device_id):
            try:
                self._handle = cudnn.create_handle()
            except RuntimeError as exc:
                raise BackendUnavailable(
                    f"cuDNN could not create a handle on CUDA device {device_id} ({one_line(exc)})"
                ) from None
        self._device = self._describe_device(cupy, cudnn, device_id)
        # kHz, for the spin kernel of back-to-back timing. CUDA 13 dropped clockRate from the
        # properties; 2 GHz, above current parts' boost clocks, then errs on a longer hold.
        self._clock_khz = int(cupy.cuda.runtime.getDeviceProperties(device_id).get("clockRate", 2_000_000))
        self._plans = Lru(PLAN_CACHE_ENTRIES)  # (lowered problem incl. its batch n, algo) -> Plan | reason
        self._enumerations = Lru(ENUMERATION_CACHE_ENTRIES)  # (lowered problem, promoted) -> Enumeration
        self._finalizer = weakref.finalize(self, _release, (self._plans, self._enumerations), cudnn, self._handle)

    @staticmethod
    def _describe_device(cupy: Any, cudnn: Any, device_id: int) -> DeviceInfo:
        props = cupy.cuda.runtime.getDeviceProperties(device_id)
        name = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
        runtime = cupy.cuda.runtime.runtimeGetVersion()
        driver = cupy.cuda.runtime.driverGetVersion()
        versions = {
            "cudnn": cudnn.backend_version_string(),
            "cudnn-frontend": cudnn.__version__,
            "cupy": cupy.__version__,
            "cuda-runtime": f"{runtime // 1000}.{runtime % 1000 // 10}",
            "cuda-driver": f"{driver // 1000}.{driver % 1000 // 10}",
            "ucudnn-verification": VERIFICATION,
        }
        return DeviceInfo(
            model=f"{name} (sm_{props['major']}{props['minor']})",
            memory_bytes=int(props["totalGlobalMem"]),
            versions=tuple(sorted(versions.items())),
        )

    @property
    def device(self) -> DeviceInfo:
        return self._device

    @property
    def device_id(self) -> int:
        """The CUDA device it runs on: the one current when it was made. Operands must live there."""
        return self._device_id

    # ---- algorithms and plans (of the convolution that computes the kernel: problem.lowered()) --
    def _enumerate(self, conv: ConvProblem, promoted: bool) -> Enumeration:
        import cudnn

        key = (conv, promoted)
        found = self._enumerations.get(key)
        if found is None:
            found = enumerate_engines(cudnn, conv, promoted, self._handle)
            self._enumerations.put(key, found)
        return found

    def algorithms(self, problem: ConvProblem) -> list[str]:
        """Every engine config cuDNN's heuristics (modes A and FALLBACK) offer, best ranked first."""
        conv = problem.lowered()
        names: list[str] = []
        for promoted in promotions(conv):
            names.extend(self._enumerate(conv, promoted).indices)
        return names

    def _plan(self, conv: ConvProblem, algo: str) -> Plan | str:
        """The built plan of `algo` at `conv.n`, or why it cannot be built (both cached)."""
        import cudnn

        key = (conv, algo)
        found = self._plans.get(key)
        if found is not None:
            return found
        config, reason = static_reason(conv, algo)
        if config is None:
            assert reason is not None  # static_reason gives the config, or why there is none
            return reason
        plan = build_plan(cudnn, conv, algo, config, self._enumerations.get((conv, config.promoted)), self._handle)
        self._plans.put(key, plan)
        return plan

    def _require_plan(self, problem: ConvProblem, algo: str) -> Plan:
        plan = self._plan(problem.lowered(), algo)
        if isinstance(plan, str):
            raise UnsupportedProblem(plan)
        return plan

    def unsupported_reason(self, problem: ConvProblem, algo: str) -> str | None:
        plan = self._plan(problem.lowered(), algo)
        return plan if isinstance(plan, str) else None

    def workspace_size(self, problem: ConvProblem, algo: str) -> int:
        return self._require_plan(problem, algo).workspace_bytes

    # ---- memory -------------------------------------------------------------------------
    def empty_workspace(self, nbytes: int) -> Any:
        import cupy

        if nbytes < 0:
            raise InvalidInput(f"workspace size must be non-negative, got {nbytes}")
        with cupy.cuda.Device(self._device_id):
            return cupy.empty(nbytes, dtype=cupy.uint8)

    def random_operands(self, problem: ConvProblem, seed: int = 0) -> dict[str, Any]:
        """Standard-normal inputs and a zero output, in the problem's dtype and layout."""
        import cupy

        wide = cupy.float64 if problem.dtype == "float64" else cupy.float32

        def make(shape: tuple[int, ...], zero: bool = False) -> Any:
            # Allocated in physical order, then viewed as (N, C, spatial...).
            last = len(shape) - 1
            physical = shape if problem.layout == "NCHW" else (shape[0], *shape[2:], shape[1])
            values = cupy.zeros(physical, dtype=wide) if zero else rng.standard_normal(physical, dtype=wide)
            array = _narrow(cupy, values, problem.dtype)
            return array if problem.layout == "NCHW" else array.transpose(0, last, *range(1, last))

        with cupy.cuda.Device(self._device_id):
            rng = cupy.random.default_rng(seed)
            shapes = {"x": problem.x_shape, "w": problem.w_shape, "dy": problem.y_shape}
            result = {name: make(shapes[name]) for name in _INPUTS[problem.kind]}
            result["out"] = make(problem.out_shape, zero=True)
        return result

    def _check_operand(self, problem: ConvProblem, name: str, array: Any, shape: tuple[int, ...]) -> None:
        import cupy

        if not isinstance(array, cupy.ndarray):
            raise InvalidInput(f"cudnn backend: operand {name!r} must be a CuPy array, got {type(array).__name__}")
        if tuple(array.shape) != tuple(shape):
            raise InvalidInput(
                f"cudnn backend: operand {name!r} has shape {tuple(array.shape)}, the problem needs "
                f"{tuple(shape)} ({problem.spec}, {problem.kind})"
            )
        storage = cupy.dtype(_storage_dtype(cupy, problem.dtype))
        if array.dtype != storage:
            raise InvalidInput(
                f"cudnn backend: operand {name!r} has dtype {array.dtype}, a {problem.dtype} problem needs {storage}"
            )
        expected = layout_strides(shape, problem.layout)
        actual = tuple(s // array.itemsize for s in array.strides)
        if any(extent > 1 and a != e for extent, a, e in zip(shape, actual, expected)):
            raise InvalidInput(
                f"cudnn backend: operand {name!r} has element strides {actual}; a {problem.layout} "
                f"problem needs {expected}"
            )
        if array.device.id != self._device_id:
            raise InvalidInput(
                f"cudnn backend: operand {name!r} is on CUDA device {array.device.id}, the backend "
                f"runs on device {self._device_id}"
            )

    def _operands(self, problem: ConvProblem, plan: Plan, given: Mapping[str, Any], out: Any) -> list[Any]:
        """The caller's operands checked against `problem`, in the order the lowered graph reads them."""
        shapes = {"x": problem.x_shape, "w": problem.w_shape, "dy": problem.y_shape}
        for name in _INPUTS[problem.kind]:
            if given.get(name) is None:
                raise InvalidInput(f"cudnn backend: {problem.kind} needs operand {name!r}")
            self._check_operand(problem, name, given[name], shapes[name])
        self._check_operand(problem, "out", out, problem.out_shape)
        return [given[_caller_name(problem, name)] for name, _ in plan.declared.inputs]

    # ---- running ------------------------------------------------------------------------
    def _launch(
        self,
        problem: ConvProblem,
        plan: Plan,
        inputs: Sequence[Any],
        out: Any,
        workspace: Any,
        alpha: float,
        beta: float,
    ) -> None:
        import cudnn
        import cupy

        if workspace is None or workspace.nbytes < plan.workspace_bytes:
            have = 0 if workspace is None else workspace.nbytes
            raise InvalidInput(f"cudnn backend: the workspace has {have} B, the plan needs {plan.workspace_bytes} B")
        # order="K" keeps an NHWC view channels-last, as the graph declares it.
        inputs = [array if array.data.ptr % ALIGNMENT_BYTES == 0 else array.copy(order="K") for array in inputs]
        direct = alpha == 1.0 and beta == 0.0 and out.data.ptr % ALIGNMENT_BYTES == 0
        target = out if direct else cupy.empty_like(out)  # empty_like keeps an NHWC view's strides
        pack = {tensor_t: array.data.ptr for (_, tensor_t), array in zip(plan.declared.inputs, inputs)}
        pack[plan.declared.output] = target.data.ptr
        graph = plan.declared.graph
        with cupy.cuda.Device(self._device_id):
            cudnn.set_stream(self._handle, cupy.cuda.get_current_stream().ptr)
            graph.execute_plan_at_index(
                pack, workspace.data.ptr if plan.workspace_bytes else 0, index=plan.index, handle=self._handle
            )
            if not direct:
                blend(cupy, problem.dtype, target, out, alpha, beta)

    def run(
        self,
        problem: ConvProblem,
        algo: str,
        *,
        x: Any = None,
        w: Any = None,
        dy: Any = None,
        out: Any,
        workspace: Any,
        alpha: float = 1.0,
        beta: float = 0.0,
    ) -> None:
        plan = self._require_plan(problem, algo)
        inputs = self._operands(problem, plan, {"x": x, "w": w, "dy": dy}, out)
        self._launch(problem, plan, inputs, out, workspace, alpha, beta)

    def prepare_run(self, problem: ConvProblem, algo: str):
        """`run` with its per-call work done once: the built plan, the operand uids of the variant
        pack and the operand order are fixed here, and no operand is checked (the caller's first,
        checked `run` vouched for them). A launch with alpha = 1, beta = 0 and aligned pointers
        sets the stream and executes; anything else takes `run`'s blending or copying path.

        The frontend's fastest public execution (1.32): `execute_plan_at_index` with the buffers in a
        tuple and their uids fixed (`tensor_uids`, whose metadata the graph caches; what its own
        torch operators use), and `cudnn.set_stream`, which calls cudnnSetStream only when the
        handle's stream changes. Below that (`_lowered_graph`, a native pack) its names are private.
        """
        import cudnn
        import cupy

        plan = self._require_plan(problem, algo)
        graph, index, handle = plan.declared.graph, plan.index, self._handle
        (first, first_t), (second, second_t) = plan.declared.inputs
        output_t = plan.declared.output
        uids = (first_t.uid, second_t.uid, output_t.uid)
        position = {"x": 0, "w": 1, "dy": 2}
        a, b = position[_caller_name(problem, first)], position[_caller_name(problem, second)]
        with_workspace = plan.workspace_bytes > 0
        device = cupy.cuda.Device(self._device_id)

        def launch(x, w, dy, out, workspace, alpha, beta):
            operands = (x, w, dy)
            inputs = (operands[a], operands[b])
            if (
                alpha != 1.0
                or beta != 0.0
                or (inputs[0].data.ptr | inputs[1].data.ptr | out.data.ptr) % ALIGNMENT_BYTES
            ):
                self._launch(problem, plan, inputs, out, workspace, alpha, beta)
                return
            with device:
                cudnn.set_stream(handle, cupy.cuda.get_current_stream().ptr)
                graph.execute_plan_at_index(
                    (inputs[0].data.ptr, inputs[1].data.ptr, out.data.ptr),
                    workspace.data.ptr if with_workspace else 0,
                    index=index,
                    handle=handle,
                    tensor_uids=uids,
                )

        return launch

    def time_run_ms(
        self, problem: ConvProblem, algo: str, operands: dict[str, Any], workspace: Any, reps: int, beta: float = 0.0
    ) -> list[float]:
        """Per-launch kernel time (ms) of `reps` samples, each several launches back to back.

        One launch timed alone sizes the sample (about SAMPLE_TARGET_MS of kernel time); each
        sample's launches are queued behind a spin kernel, so the CUDA events around them measure
        the kernels and not the Python between launches.
        """
        import cupy
        import numpy

        plan = self._require_plan(problem, algo)
        out = operands["out"]
        inputs = self._operands(problem, plan, operands, out)

        def launch() -> None:
            self._launch(problem, plan, inputs, out, workspace, 1.0, beta)

        samples = []
        with cupy.cuda.Device(self._device_id):
            stream = cupy.cuda.get_current_stream()
            start, end = cupy.cuda.Event(), cupy.cuda.Event()
            start.record(stream)
            launch()
            end.record(stream)
            end.synchronize()
            single = float(cupy.cuda.get_elapsed_time(start, end))
            launches = launches_per_sample(single)
            hold = _hold_kernel()
            cycles = int(min(launches * HOST_MS_PER_LAUNCH, MAX_HOLD_MS) * self._clock_khz)
            for _ in range(reps):
                hold((1,), (1,), (numpy.int64(cycles),))  # the kernel takes a long long
                start.record(stream)
                for _ in range(launches):
                    launch()
                end.record(stream)
                end.synchronize()
                samples.append(float(cupy.cuda.get_elapsed_time(start, end)) / launches)
        return samples

    def trusted_result(self, problem: ConvProblem, inputs: dict[str, Any]) -> Any:
        """The float64 reference computed on the GPU with CuPy (the same direct summation as NumPy's)."""
        import cupy

        from ucudnn.reference import reference

        with cupy.cuda.Device(self._device_id):
            wide = {name: _widen(cupy, array, problem.dtype).astype(cupy.float64) for name, array in inputs.items()}
            return reference(problem, xp=cupy, **wide)

    def result_error(self, problem: ConvProblem, out: Any, trusted: Any) -> float:
        import cupy

        with cupy.cuda.Device(self._device_id):
            worst = float(cupy.abs(_widen(cupy, out, problem.dtype).astype(cupy.float64) - trusted).max())
            scale = max(float(cupy.abs(trusted).max()), 1e-30)
        return worst / scale if math.isfinite(worst) else math.inf

    def synchronize(self) -> None:
        import cupy

        with cupy.cuda.Device(self._device_id):
            cupy.cuda.get_current_stream().synchronize()

    def candidate_failures(self) -> tuple[type[BaseException], ...]:
        import cudnn

        return (cudnn.cudnnGraphNotSupportedError, RuntimeError, UnsupportedProblem)
