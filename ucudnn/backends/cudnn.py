"""The `cudnn` backend: cuDNN engine configs through the cuDNN Frontend Python API, on CuPy memory.

One graph describes one kernel at one micro-batch size: `conv_fprop` (fwd), `conv_dgrad`
(bwd_data) or `conv_wgrad` (bwd_filter), with explicit dims and element strides, padding, stride
and dilation; groups follow from the weight's channel count (k, c/groups, r, s). An algorithm is an
engine config, named by `(engine_id, knobs)` as a stable string such as
`eng3:SPLIT_K_BUF=2,TILEK=0` (knobs by their `cudnn.knob_type` name, sorted), with the suffix
`+fp32acc` when a half-precision layer computes in float32 (paper §III-D, precision promotion).

API followed (nvidia-cudnn-frontend 1.32, read from its installed sources and NVIDIA/cudnn-frontend):
- graph construction and the plan sequence validate -> build_operation_graph ->
  create_execution_plans([A, FALLBACK]) -> check_support -> build: test/python/conv/graph/
  test_conv_fuzzer.py (`run_cudnn_conv`: dgrad and wgrad outputs need `set_dim`) and
  test/python/conv/graph/test_wgrads.py;
- `create_execution_plans` is one-shot on a `cudnn.pygraph` (a second call raises), so modes A
  and FALLBACK go in ONE call; `get_engine_and_knobs_at_index`, `build_plan_at_index`,
  `get_workspace_size_plan_at_index` and `execute_plan_at_index` address the ranked list:
  cudnn/_pygraph.py (pygraph docstrings);
- replaying a recorded choice with `create_execution_plan(engine_id, knobs)` on a fresh graph and
  addressing it as `get_execution_plan_count() - 1`: cudnn/_pygraph.py
  (`pygraph.create_execution_plan`) and cudnn/engines/engine_ids.py;
- `cudnn.create_handle()` and `cudnn.set_stream(handle, stream)`: cudnn/__init__.py;
- a variant pack keyed by graph tensors with raw device pointers (CuPy's `.data.ptr`), which borrow
  the graph's declared geometry: cudnn/_pygraph.py (`pygraph._describe`).

Code conventions that tests/test_cudnn_api.py relies on: the frontend module is always the local
name `cudnn`, a graph is always `graph`, and graph tensors are names ending in `_t`. The test reads
this file's syntax tree and checks every `cudnn.X`, `graph.X` and `*_t.X` against
`CUDNN_API_USED` and against the installed frontend, so it runs without a GPU.

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

One module because it is the one place that touches the cuDNN frontend, and
tests/test_cudnn_api.py checks that touch by reading this one file (every `cudnn.X`, `graph.X` and
`*_t.X` against `CUDNN_API_USED`, and every entry used). Declaring graphs, planning, naming engine
configs and executing plans all call the frontend, so they stay here together; what runs on CuPy
alone has moved out.
"""

from __future__ import annotations

import collections
import logging
import math
import re
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ucudnn.backends.base import Backend, DeviceInfo, one_line
from ucudnn.backends.cuda_timing import HOST_MS_PER_LAUNCH, MAX_HOLD_MS, _hold_kernel, launches_per_sample
from ucudnn.backends.cupy_arrays import _blend_kernels, _narrow, _storage_dtype, _widen
from ucudnn.errors import BackendUnavailable, InvalidInput, UnsupportedProblem
from ucudnn.problem import ConvProblem

log = logging.getLogger(__name__)

# Every attribute of the frontend this module touches, by the object it is read from. Kept exact
# (tests/test_cudnn_api.py fails on an unlisted use and on an unused entry) and checked against the
# installed `cudnn` module, `cudnn.pygraph` and `cudnn.Tensor`.
CUDNN_API_USED: dict[str, tuple[str, ...]] = {
    "cudnn": ("__version__", "backend_version", "backend_version_string", "create_handle",
              "cudnnGraphNotSupportedError", "data_type", "destroy_handle", "heur_mode", "knob_type",
              "pygraph", "set_stream"),
    "cudnn.data_type": ("BFLOAT16", "DOUBLE", "FLOAT", "HALF"),
    "cudnn.heur_mode": ("A", "FALLBACK"),
    "graph": ("build_operation_graph", "build_plan_at_index", "check_support", "conv_dgrad",
              "conv_fprop", "conv_wgrad", "create_execution_plan", "create_execution_plans",
              "execute_plan_at_index", "get_engine_and_knobs_at_index", "get_execution_plan_count",
              "get_workspace_size_plan_at_index", "tensor", "validate"),
    "tensor": ("set_data_type", "set_dim", "set_output", "set_stride"),
}

# Built plans kept per (problem, batch, algorithm). A plan holds host descriptors and, for
# runtime-compiled engines, a loaded kernel: a few hundred cover every kernel of a large network
# at the micro-batch sizes of the powerOfTwo policy for the algorithms that win.
PLAN_CACHE_ENTRIES = 256
# Enumerated graphs (one per problem, batch and compute type), each holding every plan it built.
ENUMERATION_CACHE_ENTRIES = 64
# The frontend declares its tensors 16-byte aligned (CUDNN_ATTR_TENSOR_BYTE_ALIGNMENT); a pointer
# off that alignment is refused or misread by vectorised kernels, so such operands are copied.
ALIGNMENT_BYTES = 16
# Engine ids below this are cuDNN backend engines; 10_000 and up are the frontend's own C++ and
# Python engines, which need other runtimes (cudnn/engines/engine_ids.py).
BACKEND_ENGINE_ID_LIMIT = 10_000
PROMOTED_SUFFIX = "+fp32acc"
# The knob_type member the heuristics list beside real knobs; it sets nothing and cannot be passed back.
PLACEHOLDER_KNOB = "NOT_SET"
HALF_DTYPES = ("float16", "bfloat16")

_ALGO_NAME = re.compile(r"^eng(?P<engine>\d+)(?::(?P<knobs>[A-Za-z0-9_]+=-?\d+(?:,[A-Za-z0-9_]+=-?\d+)*))?"
                        r"(?P<promoted>\+fp32acc)?$")
# What the frontend raises when a graph, an engine config or a plan cannot be used. RuntimeError is
# how the binding reports a rejected descriptor or a failed build; ValueError and IndexError are
# how the Python graph reports a plan it refuses to address.
_BUILD_ERRORS_EXTRA = (RuntimeError, ValueError, IndexError)


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """A cuDNN engine config as ucudnn names it: engine id, knob settings, and compute promotion."""

    engine_id: int
    knobs: tuple[tuple[str, int], ...] = ()  # (knob_type name, value), sorted by name
    promoted: bool = False  # a half-precision layer computed in float32

    @property
    def name(self) -> str:
        knobs = ",".join(f"{knob}={value}" for knob, value in self.knobs)
        return f"eng{self.engine_id}" + (f":{knobs}" if knobs else "") + (PROMOTED_SUFFIX if self.promoted else "")

    @classmethod
    def parse(cls, name: str) -> EngineConfig:
        """Read a name written by `name`; raises InvalidInput on anything else."""
        match = _ALGO_NAME.match(name) if isinstance(name, str) else None
        if match is None:
            raise InvalidInput(f"{name!r} is not a cudnn algorithm name; expected e.g. 'eng3:SPLIT_K_BUF=2,TILEK=0' "
                               f"or 'eng0+fp32acc'")
        knobs = []
        if match["knobs"]:
            for item in match["knobs"].split(","):
                knob, _, value = item.partition("=")
                knobs.append((knob, int(value)))
        if len({knob for knob, _ in knobs}) != len(knobs):
            raise InvalidInput(f"cudnn algorithm name {name!r} sets a knob twice")
        return cls(int(match["engine"]), tuple(sorted(knobs)), bool(match["promoted"]))

    @classmethod
    def from_frontend(cls, engine_id: int, knobs: Mapping[Any, int], promoted: bool) -> EngineConfig:
        """From `graph.get_engine_and_knobs_at_index`: an id and a `{cudnn.knob_type: int}` dict."""
        return cls(int(engine_id), tuple(sorted((knob.name, int(value)) for knob, value in knobs.items())), promoted)

    def frontend_knobs(self, cudnn: Any) -> dict[Any, int]:
        """The `{cudnn.knob_type: int}` dict `graph.create_execution_plan` takes.

        `get_engine_and_knobs_at_index` reports a placeholder knob, NOT_SET, which the name keeps
        (names in users' caches carry it) but `create_execution_plan` rejects with
        CUDNN_STATUS_INVALID_VALUE, so it is left out here.
        """
        try:
            return {cudnn.knob_type[knob]: value for knob, value in self.knobs if knob != PLACEHOLDER_KNOB}
        except KeyError as exc:
            raise UnsupportedProblem(f"{self.name}: knob {exc.args[0]} is unknown to cudnn-frontend "
                                     f"{cudnn.__version__}") from None


def _probe() -> tuple[Any, Any, int]:
    """CuPy, the frontend and the current device, or BackendUnavailable saying what is missing."""
    try:
        import cupy
    except ImportError as exc:
        raise BackendUnavailable(f"cupy is not installed or does not import ({one_line(exc)}); "
                                 f"install cupy-cuda12x (cupy-cuda13x on CUDA 13)") from None
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:  # CUDARuntimeError without a driver; anything else CuPy raises is the same answer
        raise BackendUnavailable(f"no CUDA device: CuPy cannot reach one ({one_line(exc)})") from None
    if count < 1:
        raise BackendUnavailable("no CUDA device: CuPy sees 0 devices")
    try:
        import cudnn
    except ImportError as exc:
        raise BackendUnavailable(f"the cuDNN frontend is not installed ({one_line(exc)}); "
                                 f"install nvidia-cudnn-frontend") from None
    try:
        cudnn.backend_version()
    except Exception as exc:  # the binding raises RuntimeError("Unable to find symbol cudnnGetVersion")
        raise BackendUnavailable(f"libcudnn is not loadable ({one_line(exc)}); install nvidia-cudnn-cu12 "
                                 f"(nvidia-cudnn-cu13 on CUDA 13) "
                                 f"or put libcudnn.so.9 on LD_LIBRARY_PATH") from None
    return cupy, cudnn, int(cupy.cuda.runtime.getDevice())


def _data_type(cudnn: Any, dtype: str) -> Any:
    return {"float32": cudnn.data_type.FLOAT, "float16": cudnn.data_type.HALF,
            "bfloat16": cudnn.data_type.BFLOAT16, "float64": cudnn.data_type.DOUBLE}[dtype]


def layout_strides(shape: Sequence[int], layout: str) -> tuple[int, ...]:
    """Element strides of a logical (N, C, H, W) shape stored as NCHW or NHWC (channels last)."""
    n, c, h, w = shape
    if layout == "NCHW":
        return (c * h * w, h * w, w, 1)
    return (h * w * c, 1, w * c, c)


@dataclass(frozen=True, slots=True)
class DeclaredGraph:
    """A graph for one kernel, before validation, and its three operand tensors.

    `inputs` are the two operands in the kind's order (fwd: x, w; bwd_data: dy, w; bwd_filter:
    x, dy); `output` is what the kind writes (y, dx or dw).
    """

    graph: Any
    inputs: tuple[tuple[str, Any], tuple[str, Any]]
    output: Any


def declare_graph(cudnn: Any, problem: ConvProblem, *, promoted: bool = False, handle: Any = None) -> DeclaredGraph:
    """The `cudnn.pygraph` of one kernel. Pure Python: no device is touched until `validate()`."""
    io = _data_type(cudnn, problem.dtype)
    compute = _data_type(cudnn, "float32" if promoted else problem.effective_compute_type)
    wide = cudnn.data_type.DOUBLE if problem.dtype == "float64" else cudnn.data_type.FLOAT
    graph = cudnn.pygraph(name=f"ucudnn_{problem.kind}", io_data_type=io, intermediate_data_type=wide,
                          compute_data_type=compute, handle=handle)
    conv = {"padding": [problem.pad_h, problem.pad_w], "stride": [problem.stride_h, problem.stride_w],
            "dilation": [problem.dilation_h, problem.dilation_w], "compute_data_type": compute}
    x_stride = layout_strides(problem.x_shape, problem.layout)
    w_stride = layout_strides(problem.w_shape, problem.layout)
    y_stride = layout_strides(problem.y_shape, problem.layout)
    if problem.kind == "fwd":
        x_t = graph.tensor(name="x", dim=list(problem.x_shape), stride=list(x_stride), data_type=io)
        w_t = graph.tensor(name="w", dim=list(problem.w_shape), stride=list(w_stride), data_type=io)
        out_t = graph.conv_fprop(image=x_t, weight=w_t, name="fprop", **conv)
        inputs, out_shape, out_stride = (("x", x_t), ("w", w_t)), problem.y_shape, y_stride
    elif problem.kind == "bwd_data":
        dy_t = graph.tensor(name="dy", dim=list(problem.y_shape), stride=list(y_stride), data_type=io)
        w_t = graph.tensor(name="w", dim=list(problem.w_shape), stride=list(w_stride), data_type=io)
        out_t = graph.conv_dgrad(loss=dy_t, filter=w_t, name="dgrad", **conv)
        inputs, out_shape, out_stride = (("dy", dy_t), ("w", w_t)), problem.x_shape, x_stride
    else:
        x_t = graph.tensor(name="x", dim=list(problem.x_shape), stride=list(x_stride), data_type=io)
        dy_t = graph.tensor(name="dy", dim=list(problem.y_shape), stride=list(y_stride), data_type=io)
        out_t = graph.conv_wgrad(image=x_t, loss=dy_t, name="wgrad", **conv)
        inputs, out_shape, out_stride = (("x", x_t), ("dy", dy_t)), problem.w_shape, w_stride
    # dgrad and wgrad outputs cannot be inferred (strided dgrad is ambiguous; wgrad has none), and
    # pinning all three keeps the layout the caller's buffer has.
    out_t.set_output(True).set_dim(list(out_shape)).set_stride(list(out_stride)).set_data_type(io)
    return DeclaredGraph(graph, inputs, out_t)


@dataclass(frozen=True, slots=True)
class _Plan:
    """A built execution plan: the graph that holds it, its index there, and its workspace."""

    declared: DeclaredGraph
    index: int
    workspace_bytes: int


@dataclass(frozen=True, slots=True)
class _Enumeration:
    """Every engine config the heuristics offered for one graph, by name -> plan index."""

    declared: DeclaredGraph | None
    indices: dict[str, int]
    reason: str = ""  # why nothing was offered


class _Lru:
    """A bounded mapping that forgets the least recently used entry."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._items: collections.OrderedDict = collections.OrderedDict()

    def get(self, key: Any) -> Any:
        if key not in self._items:
            return None
        self._items.move_to_end(key)
        return self._items[key]

    def put(self, key: Any, value: Any) -> None:
        self._items[key] = value
        self._items.move_to_end(key)
        while len(self._items) > self.capacity:
            self._items.popitem(last=False)

    def clear(self) -> None:
        self._items.clear()

    def __len__(self) -> int:
        return len(self._items)


def _release(caches: Sequence[_Lru], cudnn: Any, handle: Any) -> None:
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

    def __init__(self) -> None:
        cupy, cudnn, device_id = _probe()
        self._device_id = device_id
        with cupy.cuda.Device(device_id):
            try:
                self._handle = cudnn.create_handle()
            except RuntimeError as exc:
                raise BackendUnavailable(f"cuDNN could not create a handle on CUDA device {device_id} "
                                         f"({one_line(exc)})") from None
        self._device = self._describe_device(cupy, cudnn, device_id)
        # kHz, for the spin kernel of back-to-back timing. CUDA 13 dropped clockRate from the
        # properties; 2 GHz, above current parts' boost clocks, then errs on a longer hold.
        self._clock_khz = int(cupy.cuda.runtime.getDeviceProperties(device_id).get("clockRate", 2_000_000))
        self._plans = _Lru(PLAN_CACHE_ENTRIES)  # (problem incl. its batch n, algo) -> _Plan | reason
        self._enumerations = _Lru(ENUMERATION_CACHE_ENTRIES)  # (problem, promoted) -> _Enumeration
        self._finalizer = weakref.finalize(self, _release, (self._plans, self._enumerations), cudnn, self._handle)

    @staticmethod
    def _describe_device(cupy: Any, cudnn: Any, device_id: int) -> DeviceInfo:
        props = cupy.cuda.runtime.getDeviceProperties(device_id)
        name = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
        runtime = cupy.cuda.runtime.runtimeGetVersion()
        driver = cupy.cuda.runtime.driverGetVersion()
        versions = {"cudnn": cudnn.backend_version_string(), "cudnn-frontend": cudnn.__version__,
                    "cupy": cupy.__version__, "cuda-runtime": f"{runtime // 1000}.{runtime % 1000 // 10}",
                    "cuda-driver": f"{driver // 1000}.{driver % 1000 // 10}"}
        return DeviceInfo(model=f"{name} (sm_{props['major']}{props['minor']})",
                          memory_bytes=int(props["totalGlobalMem"]), versions=tuple(sorted(versions.items())))

    @property
    def device(self) -> DeviceInfo:
        return self._device

    @property
    def device_id(self) -> int:
        """The CUDA device it runs on: the one current when it was made. Operands must live there."""
        return self._device_id

    # ---- algorithms -------------------------------------------------------------------
    def _promotions(self, problem: ConvProblem) -> tuple[bool, ...]:
        """The compute variants offered: as declared, and float32 for half-precision io."""
        if problem.dtype in HALF_DTYPES and problem.effective_compute_type != "float32":
            return (False, True)
        return (False,)

    def _enumerate(self, problem: ConvProblem, promoted: bool) -> _Enumeration:
        import cudnn

        key = (problem, promoted)
        found = self._enumerations.get(key)
        if found is not None:
            return found
        declared = declare_graph(cudnn, problem, promoted=promoted, handle=self._handle)
        graph = declared.graph
        try:
            graph.validate()
            graph.build_operation_graph()
            # One call with both modes: planning is one-shot on a cudnn.pygraph.
            graph.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
            graph.check_support()
            count = graph.get_execution_plan_count()
        except (cudnn.cudnnGraphNotSupportedError, *_BUILD_ERRORS_EXTRA) as exc:
            enumeration = _Enumeration(None, {}, one_line(exc))
            log.debug("cudnn offers no engine for %s (%s): %s", problem.spec, problem.kind, enumeration.reason)
            self._enumerations.put(key, enumeration)
            return enumeration
        indices: dict[str, int] = {}
        for index in range(count):
            try:
                engine_id, knobs = graph.get_engine_and_knobs_at_index(index)
            except NotImplementedError:  # the delegating "backend's own choice" entry: nothing to name
                continue
            if not 0 <= engine_id < BACKEND_ENGINE_ID_LIMIT:
                continue
            # The list is already ranked and de-duplicated by (engine, knobs); keep the first anyway.
            indices.setdefault(EngineConfig.from_frontend(engine_id, knobs, promoted).name, index)
        enumeration = _Enumeration(declared, indices, "" if indices else "the heuristics offered no cuDNN engine")
        self._enumerations.put(key, enumeration)
        return enumeration

    def algorithms(self, problem: ConvProblem) -> list[str]:
        """Every engine config cuDNN's heuristics (modes A and FALLBACK) offer, best ranked first."""
        names: list[str] = []
        for promoted in self._promotions(problem):
            names.extend(self._enumerate(problem, promoted).indices)
        return names

    # ---- plans --------------------------------------------------------------------------
    def _static_reason(self, problem: ConvProblem, algo: str) -> tuple[EngineConfig | None, str | None]:
        try:
            config = EngineConfig.parse(algo)
        except InvalidInput as exc:
            return None, str(exc)
        if config.promoted and True not in self._promotions(problem):
            return None, (f"{algo}: {PROMOTED_SUFFIX} promotes half-precision io to float32 compute; this problem "
                          f"has dtype {problem.dtype} and compute type {problem.effective_compute_type}")
        if config.engine_id >= BACKEND_ENGINE_ID_LIMIT:
            return None, f"{algo}: engine ids from {BACKEND_ENGINE_ID_LIMIT} on are not cuDNN backend engines"
        return config, None

    def _plan(self, problem: ConvProblem, algo: str) -> _Plan | str:
        """The built plan of `algo` at `problem.n`, or why it cannot be built (both cached)."""
        import cudnn

        key = (problem, algo)
        found = self._plans.get(key)
        if found is not None:
            return found
        config, reason = self._static_reason(problem, algo)
        if config is None:
            return reason
        enumeration = self._enumerations.get((problem, config.promoted))
        try:
            if enumeration is not None and algo in enumeration.indices:
                declared, index = enumeration.declared, enumeration.indices[algo]
                graph = declared.graph
            else:
                # A name recorded earlier (the cache, another batch size): rebuild exactly that
                # engine config on a fresh graph.
                declared = declare_graph(cudnn, problem, promoted=config.promoted, handle=self._handle)
                graph = declared.graph
                graph.validate()
                graph.build_operation_graph()
                graph.create_execution_plan(config.engine_id, config.frontend_knobs(cudnn))
                index = graph.get_execution_plan_count() - 1
                graph.check_support()
            graph.build_plan_at_index(index)
            plan: _Plan | str = _Plan(declared, index, int(graph.get_workspace_size_plan_at_index(index)))
        except (cudnn.cudnnGraphNotSupportedError, UnsupportedProblem, *_BUILD_ERRORS_EXTRA) as exc:
            plan = f"{algo} does not build for this problem: {one_line(exc)}"
            log.debug("%s (%s, %s)", plan, problem.spec, problem.kind)
        self._plans.put(key, plan)
        return plan

    def _require_plan(self, problem: ConvProblem, algo: str) -> _Plan:
        plan = self._plan(problem, algo)
        if isinstance(plan, str):
            raise UnsupportedProblem(plan)
        return plan

    def unsupported_reason(self, problem: ConvProblem, algo: str) -> str | None:
        plan = self._plan(problem, algo)
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

        def make(shape: tuple[int, int, int, int], zero: bool = False) -> Any:
            # Allocated in physical order, then viewed as (N, C, H, W).
            physical = shape if problem.layout == "NCHW" else (shape[0], shape[2], shape[3], shape[1])
            values = cupy.zeros(physical, dtype=wide) if zero else rng.standard_normal(physical, dtype=wide)
            array = _narrow(cupy, values, problem.dtype)
            return array if problem.layout == "NCHW" else array.transpose(0, 3, 1, 2)

        with cupy.cuda.Device(self._device_id):
            rng = cupy.random.default_rng(seed)
            operands = {"fwd": {"x": problem.x_shape, "w": problem.w_shape},
                        "bwd_data": {"dy": problem.y_shape, "w": problem.w_shape},
                        "bwd_filter": {"x": problem.x_shape, "dy": problem.y_shape}}[problem.kind]
            result = {name: make(shape) for name, shape in operands.items()}
            result["out"] = make(problem.out_shape, zero=True)
        return result

    def _check_operand(self, problem: ConvProblem, name: str, array: Any, shape: tuple[int, ...]) -> None:
        import cupy

        if not isinstance(array, cupy.ndarray):
            raise InvalidInput(f"cudnn backend: operand {name!r} must be a CuPy array, got {type(array).__name__}")
        if tuple(array.shape) != tuple(shape):
            raise InvalidInput(f"cudnn backend: operand {name!r} has shape {tuple(array.shape)}, the problem needs "
                               f"{tuple(shape)} ({problem.spec}, {problem.kind})")
        storage = cupy.dtype(_storage_dtype(cupy, problem.dtype))
        if array.dtype != storage:
            raise InvalidInput(f"cudnn backend: operand {name!r} has dtype {array.dtype}, a {problem.dtype} problem "
                               f"needs {storage}")
        expected = layout_strides(shape, problem.layout)
        actual = tuple(s // array.itemsize for s in array.strides)
        if any(extent > 1 and a != e for extent, a, e in zip(shape, actual, expected)):
            raise InvalidInput(f"cudnn backend: operand {name!r} has element strides {actual}; a {problem.layout} "
                               f"problem needs {expected}")
        if array.device.id != self._device_id:
            raise InvalidInput(f"cudnn backend: operand {name!r} is on CUDA device {array.device.id}, the backend "
                               f"runs on device {self._device_id}")

    def _operands(self, problem: ConvProblem, plan: _Plan, given: Mapping[str, Any], out: Any) -> list[Any]:
        shapes = {"x": problem.x_shape, "w": problem.w_shape, "dy": problem.y_shape}
        arrays = []
        for name, _ in plan.declared.inputs:
            if given.get(name) is None:
                raise InvalidInput(f"cudnn backend: {problem.kind} needs operand {name!r}")
            self._check_operand(problem, name, given[name], shapes[name])
            arrays.append(given[name])
        self._check_operand(problem, "out", out, problem.out_shape)
        return arrays

    # ---- running ------------------------------------------------------------------------
    def _launch(self, problem: ConvProblem, plan: _Plan, inputs: Sequence[Any], out: Any, workspace: Any,
                alpha: float, beta: float) -> None:
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
            graph.execute_plan_at_index(pack, workspace.data.ptr if plan.workspace_bytes else 0,
                                        index=plan.index, handle=self._handle)
            if not direct:
                self._blend(problem, target, out, alpha, beta)

    def _blend(self, problem: ConvProblem, target: Any, out: Any, alpha: float, beta: float) -> None:
        """out = alpha * target + beta * out; beta = 0 never reads `out`, which may hold garbage."""
        import cupy

        if problem.dtype == "bfloat16":  # uint16 bits: no arithmetic type for the fused kernel
            blended = _widen(cupy, target, problem.dtype) * alpha
            if beta != 0.0:
                blended += beta * _widen(cupy, out, problem.dtype)
            out[...] = _narrow(cupy, blended, problem.dtype)
            return
        wide = cupy.float64 if problem.dtype == "float64" else cupy.float32
        scale, blend = _blend_kernels()
        if beta == 0.0:
            scale(target, wide(alpha), out)
        else:
            blend(target, wide(alpha), wide(beta), out)

    def run(self, problem: ConvProblem, algo: str, *, x: Any = None, w: Any = None, dy: Any = None,
            out: Any, workspace: Any, alpha: float = 1.0, beta: float = 0.0) -> None:
        plan = self._require_plan(problem, algo)
        inputs = self._operands(problem, plan, {"x": x, "w": w, "dy": dy}, out)
        self._launch(problem, plan, inputs, out, workspace, alpha, beta)

    def prepare_run(self, problem: ConvProblem, algo: str):
        """`run` with its per-call work done once: the built plan, the graph tensors of the variant
        pack and the operand order are fixed here, and no operand is checked (the caller's first,
        checked `run` vouched for them). A launch with alpha = 1, beta = 0 and aligned pointers
        builds the pack and executes; anything else takes `run`'s blending or copying path.

        The frontend's public `execute_plan_at_index` is the lowest entry point used: below it
        (`_lowered_graph`, the raw-pointer execute) the frontend offers only private names.
        """
        import cudnn
        import cupy

        plan = self._require_plan(problem, algo)
        graph, index, handle = plan.declared.graph, plan.index, self._handle
        (first, first_t), (second, second_t) = plan.declared.inputs
        output_t = plan.declared.output
        position = {"x": 0, "w": 1, "dy": 2}
        a, b = position[first], position[second]
        with_workspace = plan.workspace_bytes > 0
        device = cupy.cuda.Device(self._device_id)

        def launch(x, w, dy, out, workspace, alpha, beta):
            operands = (x, w, dy)
            inputs = (operands[a], operands[b])
            if alpha != 1.0 or beta != 0.0 or (inputs[0].data.ptr | inputs[1].data.ptr | out.data.ptr) % ALIGNMENT_BYTES:
                self._launch(problem, plan, inputs, out, workspace, alpha, beta)
                return
            with device:
                cudnn.set_stream(handle, cupy.cuda.get_current_stream().ptr)
                graph.execute_plan_at_index({first_t: inputs[0].data.ptr, second_t: inputs[1].data.ptr,
                                             output_t: out.data.ptr},
                                            workspace.data.ptr if with_workspace else 0, index=index, handle=handle)

        return launch

    def time_run_ms(self, problem: ConvProblem, algo: str, operands: dict[str, Any], workspace: Any,
                    reps: int, beta: float = 0.0) -> list[float]:
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
