"""Checks of the cudnn backend that need no GPU.

1. The backend module imports without CuPy, a GPU or libcudnn, and `CudnnBackend()` then says in
   one line what is missing.
2. Every `cudnn.X`, `graph.X` and `<tensor>_t.X` in the modules that call the frontend
   (`FRONTEND_MODULES`: ucudnn/backends/cudnn.py, cudnn_graph.py, cudnn_engines.py) is listed in
   `CUDNN_API_USED` (and every entry is used), and exists in the installed cuDNN frontend with the
   keyword arguments the backend passes; no other module imports the frontend.
3. The graph the backend declares (pure Python until `validate()`) has the dims, strides, data
   types and convolution parameters of the problem, for every kind, 2-D and 3-D; a transposed
   problem is declared as its lowered convolution.
4. The backend's orchestration (enumeration, naming, rebuild from a name, failures as data, the
   LRU, alignment copies, alpha/beta, timing, the selftest) runs end to end against a stand-in for
   the frontend and CuPy that computes on host memory through the same raw pointers. The
   stand-in frontend offers exactly the names in `CUDNN_API_USED`, on top of the real
   `cudnn.pygraph` IR, so the backend cannot use anything else unnoticed.
"""

from __future__ import annotations

import ast
import ctypes
import dataclasses
import gc
import importlib.util
import inspect
import re
import subprocess
import sys
import time
import weakref
from pathlib import Path
from types import ModuleType, SimpleNamespace

import numpy as np
import pytest

from ucudnn.backends import cudnn as cudnn_backend
from ucudnn.backends import cupy_arrays
from ucudnn.backends.cudnn import CUDNN_API_USED, FRONTEND_MODULES, EngineConfig, declare_graph, layout_strides
from ucudnn.errors import BackendUnavailable, InvalidInput, UnsupportedProblem
from ucudnn.kernel import selftest
from ucudnn.problem import KINDS, ConvProblem

SOURCES = [Path(importlib.util.find_spec(name).origin) for name in FRONTEND_MODULES]
ENUM_GROUPS = ("data_type", "heur_mode", "knob_type")


# ---- 1. importable without a GPU, clear errors ---------------------------------------------------
def test_backend_module_imports_without_cupy_or_the_frontend():
    # A clean interpreter in which neither CuPy nor the frontend can be imported.
    code = (
        "import sys; sys.modules['cupy'] = None; sys.modules['cudnn'] = None\n"
        "import ucudnn.backends.cudnn as m\n"
        "try:\n    m.CudnnBackend()\nexcept m.BackendUnavailable as exc:\n    print(exc)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("cupy is not installed") and result.stdout.count("\n") == 1


def test_missing_cupy_is_one_line(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", None)  # `import cupy` now raises ImportError
    with pytest.raises(BackendUnavailable) as info:
        cudnn_backend.CudnnBackend()
    message = str(info.value)
    assert "\n" not in message and message.startswith("cupy is not installed")


def _fake_cupy_without_device(error: Exception | None, count: int = 0):
    def device_count():
        if error is not None:
            raise error
        return count

    return SimpleNamespace(cuda=SimpleNamespace(runtime=SimpleNamespace(getDeviceCount=device_count)))


@pytest.mark.parametrize(
    "error, count", [(RuntimeError("cudaErrorNoDevice: no CUDA-capable device\nis detected"), 0), (None, 0)]
)
def test_no_cuda_device_is_one_line(monkeypatch, error, count):
    monkeypatch.setitem(sys.modules, "cupy", _fake_cupy_without_device(error, count))
    with pytest.raises(BackendUnavailable) as info:
        cudnn_backend.CudnnBackend()
    assert str(info.value).startswith("no CUDA device")
    assert "\n" not in str(info.value)


def test_libcudnn_not_loadable_is_one_line(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", _fake_cupy_without_device(None, 1))

    def backend_version():
        raise RuntimeError("Unable to find symbol cudnnGetVersion")

    monkeypatch.setitem(sys.modules, "cudnn", SimpleNamespace(backend_version=backend_version))
    with pytest.raises(BackendUnavailable) as info:
        cudnn_backend.CudnnBackend()
    assert str(info.value).startswith("libcudnn is not loadable") and "cudnnGetVersion" in str(info.value)


def test_frontend_not_installed_is_one_line(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", _fake_cupy_without_device(None, 1))
    monkeypatch.setitem(sys.modules, "cudnn", None)
    with pytest.raises(BackendUnavailable, match="^the cuDNN frontend is not installed"):
        cudnn_backend.CudnnBackend()


# ---- 2. the frontend API the backend uses --------------------------------------------------------
def _used_api(source: str) -> dict[str, set[str]]:
    """Attributes read from `cudnn` (and its enums), from `graph`, and from `*_t` tensors."""
    used: dict[str, set[str]] = {group: set() for group in CUDNN_API_USED}
    used["unlisted"] = set()
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Attribute):
            continue
        base = node.value
        # The object a chain of calls starts from: `out_t.set_output(True).set_dim(d)` reads
        # set_dim from what set_output returned, which is the tensor again.
        root = base
        while isinstance(root, (ast.Call, ast.Attribute)) and not (
            isinstance(root, ast.Attribute) and isinstance(root.value, ast.Name)
        ):
            root = root.func if isinstance(root, ast.Call) else root.value
        chained = isinstance(base, ast.Call)
        if isinstance(base, ast.Name) and base.id == "cudnn":
            used["cudnn"].add(node.attr)
        elif (
            isinstance(base, ast.Attribute)
            and isinstance(base.value, ast.Name)
            and base.value.id == "cudnn"
            and base.attr in ENUM_GROUPS
            and f"cudnn.{base.attr}" in used
        ):
            used[f"cudnn.{base.attr}"].add(node.attr)
        elif isinstance(base, ast.Name) and base.id == "graph":
            used["graph"].add(node.attr)
        elif isinstance(base, ast.Name) and base.id.endswith("_t"):
            used["tensor"].add(node.attr)
        elif chained and isinstance(root, ast.Attribute) and isinstance(root.value, ast.Name):
            if root.value.id.endswith("_t"):
                used["tensor"].add(node.attr)
            elif root.value.id in ("cudnn", "graph"):
                used["unlisted"].add(f"{root.value.id}.{root.attr}(...).{node.attr}")
    return used


def test_api_list_matches_the_source():
    used: dict[str, set[str]] = {}
    for source in SOURCES:  # one list for the modules together: each entry used by one of them at least
        for group, names in _used_api(source.read_text()).items():
            used.setdefault(group, set()).update(names)
    assert not used["unlisted"], f"results of frontend calls used without a listing: {sorted(used['unlisted'])}"
    for group, names in CUDNN_API_USED.items():
        assert used[group] == set(names), (
            f"CUDNN_API_USED[{group!r}] is out of date: used but unlisted {sorted(used[group] - set(names))}, "
            f"listed but unused {sorted(set(names) - used[group])}"
        )


def test_only_the_listed_modules_touch_the_frontend():
    # Importing it, or reading attributes of a `cudnn` passed in: either makes a module one the
    # API check must read.
    package = Path(cudnn_backend.__file__).parents[1]
    touching = set()
    for path in package.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom)
                else []
            )
            imports = any(name == "cudnn" or name.startswith("cudnn.") for name in names)
            reads = isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "cudnn"
            if imports or reads:
                touching.add(path)
    assert touching == set(SOURCES), sorted(str(p) for p in touching ^ set(SOURCES))
    assert all(len(path.read_text().splitlines()) <= 600 for path in SOURCES)


def test_the_grep_sees_calls():
    # Guard the guard: a sample in the backend's conventions is read the way the test above expects.
    used = _used_api(
        "graph.validate()\nx_t.set_output(True).set_dim([1])\ncudnn.data_type.FLOAT\n"
        "cudnn.create_handle()\ncudnn.create_handle().foo\n"
    )
    assert used["graph"] == {"validate"} and used["tensor"] == {"set_output", "set_dim"}
    assert used["unlisted"] == {"cudnn.create_handle(...).foo"}
    assert used["cudnn"] == {"data_type", "create_handle"} and used["cudnn.data_type"] == {"FLOAT"}


def test_every_used_attribute_exists_in_the_installed_frontend():
    cudnn = pytest.importorskip("cudnn")
    missing = [f"cudnn.{name}" for name in CUDNN_API_USED["cudnn"] if not hasattr(cudnn, name)]
    for group in ENUM_GROUPS:
        key = f"cudnn.{group}"
        if key in CUDNN_API_USED:
            missing += [f"{key}.{name}" for name in CUDNN_API_USED[key] if not hasattr(getattr(cudnn, group), name)]
    # Class attributes only: pygraph's __getattr__ forwards unknown names to a lowered C++ graph at
    # run time, which must not count as "exists" here.
    missing += [f"cudnn.pygraph.{name}" for name in CUDNN_API_USED["graph"] if not hasattr(cudnn.pygraph, name)]
    missing += [f"cudnn.Tensor.{name}" for name in CUDNN_API_USED["tensor"] if not hasattr(cudnn.Tensor, name)]
    assert not missing, f"cudnn-frontend {cudnn.__version__} lacks {missing}"


def _accepts(function, *keywords: str) -> None:
    parameters = inspect.signature(function).parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())
    unknown = [k for k in keywords if k not in parameters and not takes_any]
    assert not unknown, f"{function.__qualname__} does not take {unknown}"
    named = [k for k in keywords if k not in parameters]
    assert not named or takes_any


def test_signatures_take_the_arguments_the_backend_passes():
    cudnn = pytest.importorskip("cudnn")
    _accepts(cudnn.pygraph.__init__, "name", "io_data_type", "intermediate_data_type", "compute_data_type", "handle")
    _accepts(cudnn.pygraph.tensor, "name", "dim", "stride", "data_type")
    _accepts(cudnn.pygraph.create_execution_plans, "heuristics")
    _accepts(cudnn.pygraph.create_execution_plan, "engine_id", "knobs")
    _accepts(cudnn.pygraph.build_plan_at_index, "index")
    _accepts(cudnn.pygraph.get_workspace_size_plan_at_index, "index")
    _accepts(cudnn.pygraph.get_engine_and_knobs_at_index, "index")
    _accepts(cudnn.pygraph.execute_plan_at_index, "tensor_dict", "workspace", "index", "handle", "tensor_uids")
    _accepts(cudnn.set_stream, "handle", "stream")
    _accepts(cudnn.destroy_handle, "handle")
    # The knob dict is keyed by enum members that round-trip through their names.
    member = next(iter(cudnn.knob_type))
    assert cudnn.knob_type[member.name] is member


# ---- 3. the declared graph -----------------------------------------------------------------------
PROBLEM = ConvProblem(
    n=3, c=6, h=9, w=8, k=4, r=3, s=2, pad_h=1, pad_w=0, stride_h=2, stride_w=1, dilation_h=1, dilation_w=2, groups=2
)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
def test_declared_graph_matches_the_problem(kind, layout):
    cudnn = pytest.importorskip("cudnn")
    problem = ConvProblem(
        **{**{f: getattr(PROBLEM, f) for f in PROBLEM.__dataclass_fields__}, "kind": kind, "layout": layout}
    )
    declared = declare_graph(cudnn, problem)
    (node,) = declared.graph.nodes
    assert node.params["padding"] == [1, 0] and node.params["stride"] == [2, 1] and node.params["dilation"] == [1, 2]
    assert node.compute_data_type == cudnn.data_type.FLOAT
    shapes = {"x": problem.x_shape, "w": problem.w_shape, "dy": problem.y_shape}
    for name, tensor in declared.inputs:
        assert list(tensor.dim) == list(shapes[name])
        assert list(tensor.stride) == list(layout_strides(shapes[name], layout))
        assert tensor.data_type == cudnn.data_type.FLOAT
    out = declared.output
    assert list(out.dim) == list(problem.out_shape)
    assert list(out.stride) == list(layout_strides(problem.out_shape, layout))
    assert out.data_type == cudnn.data_type.FLOAT and not out.is_virtual
    expected_ports = {"fwd": {"image", "weight"}, "bwd_data": {"loss", "filter"}, "bwd_filter": {"image", "loss"}}[kind]
    assert set(node.inputs) == expected_ports
    # groups reach cuDNN through the weight's channel count
    weight = node.inputs.get("weight") or node.inputs.get("filter")
    if weight is not None:
        assert weight.dim[1] == problem.c // problem.groups


@pytest.mark.parametrize(
    "dtype, promoted, compute",
    [("float16", False, "HALF"), ("float16", True, "FLOAT"), ("bfloat16", True, "FLOAT"), ("float64", False, "DOUBLE")],
)
def test_declared_graph_data_types(dtype, promoted, compute):
    cudnn = pytest.importorskip("cudnn")
    declared = declare_graph(cudnn, ConvProblem(c=2, h=4, w=4, k=2, r=1, s=1, dtype=dtype), promoted=promoted)
    (node,) = declared.graph.nodes
    assert node.compute_data_type == getattr(cudnn.data_type, compute)
    io = {"float16": "HALF", "bfloat16": "BFLOAT16", "float64": "DOUBLE"}[dtype]
    assert declared.output.data_type == getattr(cudnn.data_type, io)


def test_layout_strides():
    assert layout_strides((2, 3, 4, 5), "NCHW") == (60, 20, 5, 1)
    assert layout_strides((2, 3, 4, 5), "NHWC") == (60, 1, 15, 3)
    assert layout_strides((2, 3, 4, 5, 6), "NCHW") == (360, 120, 30, 6, 1)  # NCDHW
    assert layout_strides((2, 3, 4, 5, 6), "NHWC") == (360, 1, 90, 18, 3)  # NDHWC


PROBLEM_3D = ConvProblem(
    n=2,
    c=6,
    d=7,
    h=9,
    w=8,
    k=4,
    t=3,
    r=3,
    s=2,
    pad_d=1,
    pad_h=1,
    pad_w=0,
    stride_d=2,
    stride_h=1,
    stride_w=2,
    dilation_d=1,
    dilation_h=2,
    dilation_w=1,
    groups=2,
)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
def test_declared_3d_graph_matches_the_problem(kind, layout):
    cudnn = pytest.importorskip("cudnn")
    problem = dataclasses.replace(PROBLEM_3D, kind=kind, layout=layout)
    declared = declare_graph(cudnn, problem)
    (node,) = declared.graph.nodes
    assert node.params["padding"] == [1, 1, 0] and node.params["stride"] == [2, 1, 2]
    assert node.params["dilation"] == [1, 2, 1]
    shapes = {"x": problem.x_shape, "w": problem.w_shape, "dy": problem.y_shape}
    for name, tensor in declared.inputs:
        assert len(tensor.dim) == 5 and list(tensor.dim) == list(shapes[name])
        assert list(tensor.stride) == list(layout_strides(shapes[name], layout))
    assert list(declared.output.dim) == list(problem.out_shape)
    assert list(declared.output.stride) == list(layout_strides(problem.out_shape, layout))


@pytest.mark.parametrize(
    "kind, lowered_kind, port",
    [("fwd", "bwd_data", "loss"), ("bwd_data", "fwd", "image"), ("bwd_filter", "bwd_filter", "image")],
)
def test_a_transposed_problem_is_declared_as_its_convolution(kind, lowered_kind, port):
    cudnn = pytest.importorskip("cudnn")
    problem = ConvProblem.parse(
        f"n=2,c=4,d=3,h=4,w=3,k=6,t=2,r=3,s=2,pad_h=1,stride=2,transposed=1,output_padding_d=1,groups=2,kind={kind}"
    )
    with pytest.raises(ValueError, match="lowered"):
        declare_graph(cudnn, problem)
    declared = declare_graph(cudnn, problem.lowered())
    (node,) = declared.graph.nodes
    assert (
        node.node_type.name == {"fwd": "CONV_FPROP", "bwd_data": "CONV_DGRAD", "bwd_filter": "CONV_WGRAD"}[lowered_kind]
    )
    # the transposed problem's x (n, c, d, h, w) is what the graph reads as dy (fwd) or x (bwd_data, bwd_filter's dy)
    reads = {"fwd": problem.x_shape, "bwd_data": problem.y_shape, "bwd_filter": problem.y_shape}[kind]
    assert list(node.inputs[port].dim) == list(reads)
    assert list(declared.output.dim) == list(problem.out_shape)


# ---- algorithm names -----------------------------------------------------------------------------
def test_engine_config_names_round_trip():
    config = EngineConfig(12, (("SPLIT_K_BUF", 2), ("TILEK", -1)), promoted=True)
    assert config.name == "eng12:SPLIT_K_BUF=2,TILEK=-1+fp32acc"
    assert EngineConfig.parse(config.name) == config
    assert EngineConfig.parse("eng0") == EngineConfig(0)
    for bad in ("eng", "3", "eng3:", "eng3:TILEK", "eng3+fp16", "eng3:TILEK=1,TILEK=2", "im2col_gemm"):
        with pytest.raises(InvalidInput):
            EngineConfig.parse(bad)


def test_engine_config_from_the_frontend_dict():
    cudnn = pytest.importorskip("cudnn")
    knobs = {cudnn.knob_type.TILEK: 0, cudnn.knob_type.SPLIT_K_BUF: 2}
    config = EngineConfig.from_frontend(3, knobs, promoted=False)
    assert config.name == "eng3:SPLIT_K_BUF=2,TILEK=0"  # sorted by knob name, whatever the dict order
    assert config.frontend_knobs(cudnn) == knobs
    with pytest.raises(UnsupportedProblem, match="NO_SUCH_KNOB"):
        EngineConfig(3, (("NO_SUCH_KNOB", 1),)).frontend_knobs(cudnn)


# ---- 4. a stand-in frontend and CuPy over host memory ---------------------------------------------
class FakeArray(np.ndarray):
    """A NumPy array that answers like a CuPy one: `.data.ptr` and `.device.id`."""

    @property
    def data(self):
        return SimpleNamespace(ptr=self.__array_interface__["data"][0])

    @property
    def device(self):
        return SimpleNamespace(id=0)


def _fake(array: np.ndarray) -> FakeArray:
    return np.asarray(array).view(FakeArray)


# What the stand-in device did, in order: ("event",), ("hold", cycles), ("execute",), ("kernel", name).
TRACE: list[tuple] = []


class _Event:
    def record(self, stream=None):
        self.at = time.perf_counter()
        TRACE.append(("event",))

    def synchronize(self):
        pass


class _Stream:
    """A CUDA stream as CuPy wraps one (`cupy.cuda.ExternalStream(ptr)`): `with stream:` makes it the
    current stream, on which CuPy launches its kernels."""

    def __init__(self, ptr, device_id=-1):
        self.ptr = ptr

    def __enter__(self):
        STREAMS.append(self)
        return self

    def __exit__(self, *exc):
        STREAMS.pop()
        return False

    def synchronize(self):
        pass


# CuPy's current stream is the last entered (the null stream, 0, outside every `with`).
STREAMS = [_Stream(0)]
# The stream of each launch, in order: ("execute", stream) for the frontend, ("kernel", name, stream) for CuPy.
LAUNCHES: list[tuple] = []


class _Device:
    def __init__(self, device_id=0):
        self.id = device_id

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class _Rng:
    def __init__(self, seed):
        self._rng = np.random.default_rng(seed)

    def standard_normal(self, shape, dtype=np.float32):
        return _fake(self._rng.standard_normal(shape).astype(dtype))


class _RawKernel:
    def __init__(self, source, name):
        assert name in source
        self.name = name

    def __call__(self, grid, block, args):
        assert self.name == "ucudnn_hold" and len(args) == 1 and isinstance(args[0], np.int64)
        TRACE.append(("hold", int(args[0])))


# C types an ElementwiseKernel's operation may cast to, as NumPy types.
_C_TYPES = {"float": np.float32, "double": np.float64}


def _parse_params(text: str) -> list[tuple[str, str]]:
    """CuPy's parameter list "T tmp, float32 alpha" as [(type, name)]; as CuPy reads it
    (cupy/_core/_kernel.pyx, ParameterInfo), a one-letter type is a placeholder and any other a
    NumPy dtype name. `raw` is not used here."""
    params = [tuple(part.split()) for part in text.split(",")]
    assert all(len(p) == 2 for p in params), f"cannot parse parameters {text!r}"
    for type_name, _ in params:
        _is_placeholder(type_name) or np.dtype(type_name)  # an unknown name raises, as in CuPy
    return params


def _is_placeholder(type_name: str) -> bool:
    return len(type_name) == 1


class _ElementwiseKernel:
    """CuPy's ElementwiseKernel as CuPy resolves and runs it, for `out = (T)(expression)` kernels.

    Types as CuPy decides them (cupy/_core/_kernel.pyx, `_decide_params_type`): a placeholder type
    takes the dtype of the ARRAY arguments of its parameters; a scalar argument never fills one
    (CuPy issue #2091), and a placeholder left unfilled raises KeyError, as on the GPU. The operation
    is then evaluated in NumPy: its casts (`(T)`, `(float)`, `(double)`) become NumPy casts.
    """

    def __init__(self, in_params, out_params, operation, name):
        self.inputs, self.outputs = _parse_params(in_params), _parse_params(out_params)
        self.operation, self.name = operation, name

    def __call__(self, *args):
        assert len(args) == len(self.inputs) + len(self.outputs), f"{self.name}: wrong argument count"
        types: dict[str, np.dtype] = {}
        for (type_name, name), arg in zip(
            self.outputs + self.inputs, args[len(self.inputs) :] + args[: len(self.inputs)]
        ):
            if not isinstance(arg, np.ndarray):
                continue  # a scalar: converted to its parameter's type, never filling a placeholder
            if not _is_placeholder(type_name):
                if arg.dtype != np.dtype(type_name):
                    raise TypeError(f"Type is mismatched. {name} {arg.dtype} {type_name}")
            elif types.setdefault(type_name, arg.dtype) != arg.dtype:
                raise TypeError(f"Type is mismatched. {name} {arg.dtype} {types[type_name]} {type_name}")
        resolved = {t: types[t] if _is_placeholder(t) else np.dtype(t) for t, _ in self.inputs + self.outputs}
        TRACE.append(("kernel", self.name))
        LAUNCHES.append(("kernel", self.name, STREAMS[-1].ptr))
        values = {
            name: (arg if isinstance(arg, np.ndarray) else resolved[t].type(arg))
            for (t, name), arg in zip(self.inputs + self.outputs, args)
        }
        target, expression = (part.strip() for part in self.operation.split("=", 1))
        casts = {**_C_TYPES, **{t: types[t].type for t in types}}
        python = re.sub(r"\((\w+)\)\s*(\w+)", lambda m: f"_cast[{m.group(1)!r}]({m.group(2)})", expression)
        python = re.sub(r"^\((\w+)\)\(", lambda m: f"_cast[{m.group(1)!r}](", python)
        cast = {name: lambda v, t=t: np.asarray(v).astype(t) for name, t in casts.items()}
        values[target][...] = eval(python, {"_cast": cast}, values)


# Every block of device memory the stand-in CuPy handed out (`empty`, `empty_like`, `zeros`), weakly: a
# CUDA graph's private pool under torch.compile must hold only what the graph returns, so a test can
# ask which blocks taken in a span of work are still alive (cudagraph_trees.check_memory_pool).
BLOCKS: list = []


def _block(array: np.ndarray) -> FakeArray:
    block = _fake(array)
    BLOCKS.append(weakref.ref(block))
    return block


def _pool_block(shape, dtype, like=None) -> FakeArray:
    """New memory as CuPy's pool may hand it out: holding old bytes (0xFF, NaN in every float format)."""
    array = np.empty_like(like) if like is not None else np.empty(shape, dtype)
    array.fill({np.dtype(np.uint8): 0xFF, np.dtype(np.uint16): 0xFFFF}.get(array.dtype, np.nan))
    return _block(array)


def make_fake_cupy():
    runtime = SimpleNamespace(
        getDeviceCount=lambda: 1,
        getDevice=lambda: 0,
        runtimeGetVersion=lambda: 12090,
        driverGetVersion=lambda: 12090,
        getDeviceProperties=lambda i: {"name": b"Fake GPU", "totalGlobalMem": 2**34, "major": 9, "minor": 0},
    )
    cupy = ModuleType("cupy")  # hashable, as the real module (the backend caches kernels by it)
    cupy.__dict__.update(
        __version__="14.fake",
        ndarray=FakeArray,
        dtype=np.dtype,
        float16=np.float16,
        float32=np.float32,
        float64=np.float64,
        uint8=np.uint8,
        uint16=np.uint16,
        uint32=np.uint32,
        empty=lambda shape, dtype=np.float32: _pool_block(shape, dtype),
        zeros=lambda shape, dtype=np.float64: _block(np.zeros(shape, dtype)),
        empty_like=lambda a: _pool_block(a.shape, a.dtype, like=a),
        asarray=lambda a, dtype=None: _fake(np.asarray(a, dtype)),
        pad=lambda a, pads: _fake(np.pad(a, pads)),
        einsum=lambda *a, **kw: _fake(np.einsum(*a, **kw)),
        abs=lambda a: _fake(np.abs(a)),
        tensordot=lambda a, b, axes: _fake(np.tensordot(a, b, axes)),
        random=SimpleNamespace(default_rng=_Rng),
        RawKernel=_RawKernel,
        ElementwiseKernel=_ElementwiseKernel,
        cuda=SimpleNamespace(
            runtime=runtime,
            Device=_Device,
            Event=_Event,
            get_current_stream=lambda: STREAMS[-1],
            ExternalStream=_Stream,
            get_elapsed_time=lambda start, end: (end.at - start.at) * 1e3,
        ),
    )
    return cupy


# What the stand-in heuristics offer, in rank order: (engine id, knobs by name, workspace bytes per
# sample). A duplicate, a frontend python engine and the delegating entry must not become
# algorithms; engine 7 is offered but does not build; engine 28 is listed with the NOT_SET
# placeholder knob, which `create_execution_plan` rejects as the real frontend does.
FAKE_ENGINES = (
    (0, {}, 0),
    (1, {"TILE_SIZE": 2}, 256),
    (1, {"TILE_SIZE": 2}, 256),
    (7, {"SPLIT_K_BUF": 1}, 0),
    (20_800, {}, 0),
    (-1, {}, 0),
    (2, {"SPLIT_K_BUF": 4, "TILEK": 0}, 1024),
    (28, {"NOT_SET": 0, "TILE_SIZE": 4}, 64),
)
FAKE_ALGOS = [
    "eng0",
    "eng1:TILE_SIZE=2",
    "eng7:SPLIT_K_BUF=1",
    "eng2:SPLIT_K_BUF=4,TILEK=0",
    "eng28:NOT_SET=0,TILE_SIZE=4",
]


def _host_view(address: int, dims, strides, data_type, cudnn) -> np.ndarray:
    storage = {
        cudnn.data_type.FLOAT: np.float32,
        cudnn.data_type.HALF: np.float16,
        cudnn.data_type.DOUBLE: np.float64,
        cudnn.data_type.BFLOAT16: np.uint16,
    }[data_type]
    itemsize = np.dtype(storage).itemsize
    span = 1 + sum((d - 1) * s for d, s in zip(dims, strides))
    buffer = (ctypes.c_char * (span * itemsize)).from_address(address)
    return np.ndarray(tuple(dims), storage, buffer=buffer, strides=tuple(s * itemsize for s in strides))


def make_fake_cudnn(real):
    """The frontend as the backend may see it: only CUDNN_API_USED, with real enums and the real IR."""
    # "stale_workspace": engine ids that read the first float of their workspace without writing it;
    # "reads_output": engine ids that add into their output instead of overwriting it (right on a
    # zeroed output, wrong on a temporary holding old bytes, as eng70's bwd_filter accumulating).
    calls = {
        "create_execution_plans": [],
        "create_execution_plan": [],
        "build_plan_at_index": [],
        "execute": 0,
        "stale_workspace": set(),
        "reads_output": set(),
    }
    knob = real.knob_type

    class FakeGraph(real.pygraph):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.fake_state = {"validated": False, "operation_graph": False, "plans": None, "built": set()}

        def validate(self):
            self.fake_state["validated"] = True

        def build_operation_graph(self):
            assert self.fake_state["validated"], "build_operation_graph before validate"
            self.fake_state["operation_graph"] = True

        def create_execution_plans(self, heuristics=None):
            assert self.fake_state["operation_graph"]
            if self.fake_state["plans"] is not None:
                raise RuntimeError("create_execution_plans() was already called on this graph; planning is one-shot")
            calls["create_execution_plans"].append(list(heuristics))
            self.fake_state["plans"] = [(e, {knob[k]: v for k, v in knobs.items()}) for e, knobs, _ in FAKE_ENGINES]

        def create_execution_plan(self, engine_id, knobs=None):
            assert self.fake_state["operation_graph"]
            assert all(isinstance(k, knob) and isinstance(v, int) for k, v in (knobs or {}).items())
            if knob.NOT_SET in (knobs or {}):
                raise RuntimeError(
                    "convert_to_backend_knob_type(type, backend_type) failed with CUDNN_STATUS_INVALID_VALUE"
                )
            calls["create_execution_plan"].append((engine_id, dict(knobs or {})))
            self.fake_state["plans"] = (self.fake_state["plans"] or []) + [(engine_id, dict(knobs or {}))]
            return self

        def check_support(self):
            assert self.fake_state["plans"], "check_support before any plan"

        def get_execution_plan_count(self):
            return len(self.fake_state["plans"] or [])

        def get_engine_and_knobs_at_index(self, index):
            engine_id, knobs = self.fake_state["plans"][index]
            if engine_id == -1:
                raise NotImplementedError("plan delegates to the backend's own choice")
            return engine_id, dict(knobs)

        def _engine(self, index):
            engine_id, knobs = self.fake_state["plans"][index]
            for e, k, per_sample in FAKE_ENGINES:
                listed = {knob[n]: v for n, v in k.items() if n != "NOT_SET"}
                if e == engine_id and listed == {n: v for n, v in knobs.items() if n != knob.NOT_SET}:
                    return e, per_sample
            raise real.cudnnGraphNotSupportedError(f"no engine {engine_id} with knobs {knobs}")

        def build_plan_at_index(self, index):
            engine_id, _ = self._engine(index)
            calls["build_plan_at_index"].append(engine_id)
            if engine_id == 7:
                raise real.cudnnGraphNotSupportedError("[cudnn_frontend] Error: engine 7 rejects this layout")
            self.fake_state["built"].add(index)
            return self

        def get_workspace_size_plan_at_index(self, index, handle=None, *rest):
            assert index in self.fake_state["built"]
            return self._engine(index)[1] * self.nodes[0].inputs[next(iter(self.nodes[0].inputs))].dim[0]

        def execute_plan_at_index(self, tensor_dict, workspace=None, index=0, handle=None, *, tensor_uids=None):
            assert index in self.fake_state["built"], "executing a plan that was not built"
            assert isinstance(handle, FakeHandle)
            if self.get_workspace_size_plan_at_index(index):
                assert workspace, "a plan with workspace got a null workspace pointer"
            calls["execute"] += 1
            TRACE.append(("execute",))
            # the frontend launches on its handle's stream (classic set_stream semantics), which must be the
            # one the caller's work is ordered on: CuPy's current stream (ucudnn.torch makes it torch's)
            assert handle.stream == STREAMS[-1].ptr, f"executed on stream {handle.stream}, current {STREAMS[-1].ptr}"
            LAUNCHES.append(("execute", handle.stream))
            if tensor_uids is not None:  # buffers in a sequence, one distinct operand uid each (pygraph.execute)
                assert isinstance(tensor_dict, (tuple, list)) and len(tensor_uids) == len(tensor_dict)
                assert len(set(tensor_uids)) == len(tensor_uids), "duplicate uids are rejected"
                tensor_dict = dict(zip(tensor_uids, tensor_dict))
            pointers = self._uid_to_data(tensor_dict)
            (node,) = self.nodes
            kind = {"CONV_FPROP": "fwd", "CONV_DGRAD": "bwd_data", "CONV_WGRAD": "bwd_filter"}[node.node_type.name]
            views = {}
            for port, tensor in [*node.inputs.items(), *node.outputs.items()]:
                address = pointers[tensor.uid]
                assert isinstance(address, int), f"{port} is not bound to a raw pointer"
                assert address % 16 == 0, f"{port} pointer {address} is not 16-byte aligned"
                views[port] = _host_view(address, tensor.dim, tensor.stride, tensor.data_type, real)
            out_port = next(iter(node.outputs))
            dtype = {np.float32: "float32", np.float16: "float16", np.float64: "float64", np.uint16: "bfloat16"}[
                views[out_port].dtype.type
            ]
            host = {port: selftest.to_host_float64(v, dtype) for port, v in views.items() if port != out_port}
            names = {"image": "x", "weight": "w", "filter": "w", "loss": "dy"}
            x_dims = (node.inputs.get("image") or node.outputs.get("DX")).dim
            w_dims = (node.inputs.get("weight") or node.inputs.get("filter") or node.outputs.get("DW")).dim
            y_dims = (node.inputs.get("loss") or node.outputs.get("Y")).dim
            # Any number of spatial axes (4-D or 5-D tensors); the graph is always a convolution.
            problem = ConvProblem.from_shapes(
                x_dims,
                w_dims,
                stride=node.params["stride"],
                padding=node.params["padding"],
                dilation=node.params["dilation"],
                groups=x_dims[1] // w_dims[1],
                kind=kind,
                dtype=dtype,
            )
            assert tuple(y_dims) == problem.y_shape
            result = selftest.reference(problem, **{names[p]: v for p, v in host.items()})
            engine_id, _ = self._engine(index)
            if engine_id in calls["stale_workspace"]:  # right on zeroed memory, NaN on 0xFF bytes
                result = result + 0.0 * ctypes.c_float.from_address(workspace).value
            if engine_id in calls["reads_output"]:
                result = result + selftest.to_host_float64(views[out_port], dtype)
            if dtype == "bfloat16":
                bits = result.astype(np.float32).view(np.uint32)
                views[out_port][...] = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
            else:
                views[out_port][...] = result

    class FakeHandle:
        stream = 0  # as cudnn.create_handle seeds it: a new cudnnHandle_t runs on the null stream

    # "set_stream": every stream passed to set_stream; "switched": those cudnnSetStream was called for
    handles = {"created": 0, "destroyed": 0, "set_stream": [], "switched": []}

    def create_handle():
        handles["created"] += 1
        return FakeHandle()

    def destroy_handle(handle):
        assert isinstance(handle, FakeHandle)
        handles["destroyed"] += 1

    def set_stream(handle, stream):
        # As cudnn/__init__.py (1.32) does: the Handle remembers its stream and calls the backend's
        # cudnnSetStream only when it changes.
        assert isinstance(handle, FakeHandle) and isinstance(stream, int)
        handles["set_stream"].append(stream)
        if handle.stream != stream:
            handles["switched"].append(stream)
            handle.stream = stream

    api = {
        "__version__": real.__version__,
        "backend_version": lambda: 92800,
        "backend_version_string": lambda: "9.28.0",
        "create_handle": create_handle,
        "destroy_handle": destroy_handle,
        "set_stream": set_stream,
        "pygraph": FakeGraph,
        "cudnnGraphNotSupportedError": real.cudnnGraphNotSupportedError,
        "data_type": real.data_type,
        "heur_mode": real.heur_mode,
        "knob_type": real.knob_type,
    }
    assert set(api) == set(CUDNN_API_USED["cudnn"]), "the stand-in must offer exactly the listed API"
    return SimpleNamespace(**api), calls, handles


@pytest.fixture
def fake_gpu(monkeypatch):
    real = pytest.importorskip("cudnn")
    fake_cudnn, calls, handles = make_fake_cudnn(real)
    monkeypatch.setitem(sys.modules, "cupy", make_fake_cupy())
    monkeypatch.setitem(sys.modules, "cudnn", fake_cudnn)
    TRACE.clear()
    BLOCKS.clear()
    LAUNCHES.clear()
    cupy_arrays._blend_kernels.cache_clear()
    cudnn_backend._hold_kernel.cache_clear()
    return SimpleNamespace(calls=calls, handles=handles, real=real)


SMALL = ConvProblem(n=3, c=4, h=7, w=7, k=6, r=3, s=3, pad_h=1, pad_w=1)


def test_enumeration_names_dedupes_and_filters(fake_gpu):
    backend = cudnn_backend.CudnnBackend()
    assert backend.device.model == "Fake GPU (sm_90)" and backend.device_id == 0
    assert dict(backend.device.versions)["cudnn"] == "9.28.0"
    assert backend.algorithms(SMALL) == FAKE_ALGOS
    # both heuristic modes, in one call (planning is one-shot)
    assert fake_gpu.calls["create_execution_plans"] == [[fake_gpu.real.heur_mode.A, fake_gpu.real.heur_mode.FALLBACK]]
    assert backend.algorithms(SMALL) == FAKE_ALGOS  # cached: no second planning
    assert len(fake_gpu.calls["create_execution_plans"]) == 1


def test_half_precision_also_offers_float32_compute(fake_gpu):
    backend = cudnn_backend.CudnnBackend()
    half = ConvProblem(n=2, c=4, h=5, w=5, k=4, r=3, s=3, pad_h=1, pad_w=1, dtype="float16")
    assert backend.algorithms(half) == FAKE_ALGOS + [f"{a}+fp32acc" for a in FAKE_ALGOS]
    promoted_half = ConvProblem(n=2, c=4, h=5, w=5, k=4, r=3, s=3, dtype="float16", compute_type="float32")
    assert backend.algorithms(promoted_half) == FAKE_ALGOS
    assert "+fp32acc" in backend.unsupported_reason(SMALL, "eng0+fp32acc")


def test_failures_are_data_and_names_rebuild(fake_gpu):
    backend = cudnn_backend.CudnnBackend()
    backend.algorithms(SMALL)
    reason = backend.unsupported_reason(SMALL, "eng7:SPLIT_K_BUF=1")
    assert "engine 7 rejects this layout" in reason and "\n" not in reason
    with pytest.raises(UnsupportedProblem):
        backend.workspace_size(SMALL, "eng7:SPLIT_K_BUF=1")
    assert "not a cudnn algorithm name" in backend.unsupported_reason(SMALL, "im2col_gemm")
    assert backend.workspace_size(SMALL, "eng2:SPLIT_K_BUF=4,TILEK=0") == 3 * 1024

    # A fresh backend (a later process) rebuilds a recorded name at another batch size with
    # create_execution_plan, without asking the heuristics.
    fresh = cudnn_backend.CudnnBackend()
    planned = len(fake_gpu.calls["create_execution_plans"])
    assert fresh.workspace_size(SMALL.with_batch(2), "eng2:SPLIT_K_BUF=4,TILEK=0") == 2 * 1024
    assert len(fake_gpu.calls["create_execution_plans"]) == planned
    knob = fake_gpu.real.knob_type
    assert fake_gpu.calls["create_execution_plan"][-1] == (2, {knob.SPLIT_K_BUF: 4, knob.TILEK: 0})


def test_measure_times_and_records_failures(fake_gpu):
    backend = cudnn_backend.CudnnBackend()
    results = {m.algo: m for m in backend.measure(SMALL, backend.algorithms(SMALL), reps=3)}
    assert set(results) == set(FAKE_ALGOS)
    assert not results["eng7:SPLIT_K_BUF=1"].usable and "rejects" in results["eng7:SPLIT_K_BUF=1"].reason
    usable = [m for m in results.values() if m.usable]
    assert len(usable) == 4 and all(m.time > 0 and m.batch == 3 for m in usable)
    assert results["eng1:TILE_SIZE=2"].workspace == 3 * 256


def test_plan_cache_is_bounded(fake_gpu, monkeypatch):
    monkeypatch.setattr(cudnn_backend, "PLAN_CACHE_ENTRIES", 3)
    backend = cudnn_backend.CudnnBackend()
    for n in range(1, 6):
        backend.workspace_size(SMALL.with_batch(n), "eng0")
    assert len(backend._plans) == 3


def test_handle_is_released_with_the_backend(fake_gpu):
    import gc

    backend = cudnn_backend.CudnnBackend()
    backend.workspace_size(SMALL, "eng0")
    del backend
    gc.collect()
    assert fake_gpu.handles["destroyed"] == fake_gpu.handles["created"] == 1


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16", "float64"])
def test_selftest_through_the_backend_passes(fake_gpu, dtype):
    # Every kind, micro-batched (odd sizes: unaligned slices get copied), alpha/beta, per dtype.
    backend = cudnn_backend.CudnnBackend()
    report = selftest.run_selftest(backend, problems=selftest.DEFAULT_PROBLEMS[:3], dtype=dtype)
    assert report.passed, report.format()
    assert report.count("skip") == 3 * 3 * (2 if dtype in ("float16", "bfloat16") else 1)  # engine 7
    assert {c.algo for c in report.checks if c.status == "pass"} >= {"eng0", "eng2:SPLIT_K_BUF=4,TILEK=0"}
    assert fake_gpu.handles["set_stream"] and set(fake_gpu.handles["set_stream"]) == {0}


@pytest.mark.parametrize("kind", KINDS)
def test_nhwc_operands_run_undivided_and_micro_batched(fake_gpu, kind):
    from ucudnn.solver.types import Configuration, MicroConfig

    from ucudnn.kernel.run import run_configuration

    backend = cudnn_backend.CudnnBackend()
    # 3 samples of 3x5x5 float32 (300 B each): the second micro-batch starts off 16-byte alignment.
    problem = ConvProblem(kind=kind, n=3, c=3, h=5, w=5, k=4, r=3, s=3, pad_h=1, pad_w=1, layout="NHWC")
    operands = backend.random_operands(problem)
    for name, array in operands.items():
        assert array.strides[1] == array.itemsize, f"{name} is not channels last"
    inputs = {name: array for name, array in operands.items() if name != "out"}
    expected = selftest.reference(problem, **{name: np.asarray(a, dtype=np.float64) for name, a in inputs.items()})
    workspace = backend.empty_workspace(backend.workspace_size(problem, "eng1:TILE_SIZE=2"))
    backend.run(problem, "eng1:TILE_SIZE=2", workspace=workspace, **operands)
    assert selftest.relative_error(np.asarray(operands["out"], dtype=np.float64), expected) < 1e-6
    micro_out = backend.random_operands(problem, seed=1)["out"]
    algo = "eng1:TILE_SIZE=2"
    micros = tuple(MicroConfig(algo, b, 0.0, backend.workspace_size(problem.with_batch(b), algo)) for b in (2, 1))
    run_configuration(backend, problem, Configuration(micros), out=micro_out, **inputs)
    assert selftest.relative_error(np.asarray(micro_out, dtype=np.float64), expected) < 1e-6


def test_run_rejects_bad_operands(fake_gpu):
    backend = cudnn_backend.CudnnBackend()
    operands = backend.random_operands(SMALL)
    workspace = backend.empty_workspace(backend.workspace_size(SMALL, "eng2:SPLIT_K_BUF=4,TILEK=0"))
    with pytest.raises(InvalidInput, match="shape"):
        backend.run(SMALL, "eng0", x=operands["x"][:2], w=operands["w"], out=operands["out"], workspace=workspace)
    with pytest.raises(InvalidInput, match="dtype"):
        backend.run(
            SMALL, "eng0", x=operands["x"].astype(np.float64), w=operands["w"], out=operands["out"], workspace=workspace
        )
    with pytest.raises(InvalidInput, match="CuPy array"):
        backend.run(
            SMALL, "eng0", x=np.asarray(operands["x"]), w=operands["w"], out=operands["out"], workspace=workspace
        )
    with pytest.raises(InvalidInput, match="needs operand 'w'"):
        backend.run(SMALL, "eng0", x=operands["x"], out=operands["out"], workspace=workspace)
    with pytest.raises(InvalidInput, match="workspace"):
        backend.run(SMALL, "eng2:SPLIT_K_BUF=4,TILEK=0", workspace=backend.empty_workspace(16), **operands)
    with pytest.raises(UnsupportedProblem):
        backend.run(SMALL, "eng7:SPLIT_K_BUF=1", workspace=workspace, **operands)


# ---- issue 9: rebuilds, cache overflow, verification, back-to-back timing, accumulation ----------
NOT_SET_ALGO = "eng28:NOT_SET=0,TILE_SIZE=4"


def test_a_not_set_name_rebuilds_with_the_placeholder_dropped(fake_gpu):
    fresh = cudnn_backend.CudnnBackend()  # a later process: the name comes from the cache
    problem = SMALL.with_batch(2)
    assert fresh.unsupported_reason(problem, NOT_SET_ALGO) is None
    knob = fake_gpu.real.knob_type
    assert fake_gpu.calls["create_execution_plan"][-1] == (28, {knob.TILE_SIZE: 4})
    assert EngineConfig.parse(NOT_SET_ALGO).name == NOT_SET_ALGO  # stored names keep their spelling
    operands = fresh.random_operands(problem)
    fresh.run(
        problem, NOT_SET_ALGO, workspace=fresh.empty_workspace(fresh.workspace_size(problem, NOT_SET_ALGO)), **operands
    )
    expected = selftest.reference(problem, x=np.asarray(operands["x"]), w=np.asarray(operands["w"]))
    assert selftest.relative_error(np.asarray(operands["out"], np.float64), expected) < 1e-6


def test_more_problems_than_the_caches_hold_run_without_error(fake_gpu, monkeypatch):
    from ucudnn import Handle

    monkeypatch.setattr(cudnn_backend, "ENUMERATION_CACHE_ENTRIES", 2)
    monkeypatch.setattr(cudnn_backend, "PLAN_CACHE_ENTRIES", 3)
    backend = cudnn_backend.CudnnBackend()
    # Only the NOT_SET engine: every plan at a micro-batch size is a rebuild from its name.
    problems = [ConvProblem(n=4, c=3, h=5 + i, w=6, k=4, r=3, s=3, pad_h=1, pad_w=1) for i in range(6)]
    with Handle(backend=backend, db=False, algos=[NOT_SET_ALGO], reps=1) as handle:
        for _ in range(2):  # the second pass finds every problem evicted from both caches
            for p in problems:
                x, w = (backend.random_operands(p, seed=p.h)[name] for name in ("x", "w"))
                y = handle.conv_forward(x, w, padding=1)
                expected = selftest.reference(p, x=np.asarray(x), w=np.asarray(w))
                assert selftest.relative_error(np.asarray(y, np.float64), expected) < 1e-6
    assert len(backend._enumerations) <= 2 and len(backend._plans) <= 3


@pytest.mark.parametrize("fault", ["stale_workspace", "reads_output"])
def test_a_wrong_engine_is_excluded_by_measurement_selftest_and_optimize(fake_gpu, fault):
    from ucudnn.network.optimize import expand_kernels, optimize

    fake_gpu.calls[fault].add(2)
    backend = cudnn_backend.CudnnBackend()
    wrong = "eng2:SPLIT_K_BUF=4,TILEK=0"
    results = {m.algo: m for m in backend.measure(SMALL, backend.algorithms(SMALL), reps=1)}
    assert results[wrong].reason == "wrong result (rel. error inf)" and not results[wrong].usable
    assert results["eng0"].usable
    report = selftest.run_selftest(backend, problems=selftest.DEFAULT_PROBLEMS[:1])
    assert report.passed and {c.algo for c in report.checks if c.status == "excluded"} == {wrong}
    plan = optimize(backend, expand_kernels([("l", SMALL)], SMALL.n), policy="powerOfTwo", reps=1)
    for k in plan.kernels:
        assert wrong not in {m.algo for m in k.config.micros}
        assert wrong in {m.algo for m in k.excluded}


def test_timing_launches_back_to_back_behind_a_hold(fake_gpu):
    backend = cudnn_backend.CudnnBackend()
    operands = backend.random_operands(SMALL)
    workspace = backend.empty_workspace(backend.workspace_size(SMALL, "eng0"))
    TRACE.clear()
    samples = backend.time_run_ms(SMALL, "eng0", operands, workspace, reps=3)
    assert len(samples) == 3 and all(t > 0 for t in samples)
    # One launch alone sizes the sample, then per sample: hold, event, N launches, event.
    assert TRACE[:3] == [("event",), ("execute",), ("event",)]
    rest = TRACE[3:]
    n = len(rest) // 3 - 3
    assert n >= 1 and rest == [("hold", rest[0][1]), ("event",), *[("execute",)] * n, ("event",)] * 3
    assert rest[0][1] == int(min(n * cudnn_backend.HOST_MS_PER_LAUNCH, cudnn_backend.MAX_HOLD_MS) * 2_000_000)


def test_launches_per_sample():
    from ucudnn.backends.cuda_timing import MAX_LAUNCHES_PER_SAMPLE, SAMPLE_TARGET_MS, launches_per_sample

    assert launches_per_sample(SAMPLE_TARGET_MS * 2) == 1
    assert launches_per_sample(SAMPLE_TARGET_MS / 10) == 10
    assert launches_per_sample(1e-6) == launches_per_sample(0.0) == MAX_LAUNCHES_PER_SAMPLE


def test_bwd_filter_accumulation_is_one_fused_kernel_and_is_timed(fake_gpu):
    backend = cudnn_backend.CudnnBackend()
    problem = SMALL.with_kind("bwd_filter")
    TRACE.clear()
    backend.measure(problem, ["eng0"], reps=2)
    assert ("kernel", "ucudnn_blend_float32") not in TRACE  # beta = 0 writes out directly
    TRACE.clear()
    backend.measure(problem, ["eng0"], reps=2, accumulate=True)
    blends = TRACE.count(("kernel", "ucudnn_blend_float32"))
    executes = TRACE.count(("execute",))
    # every run after the verified one accumulates: one blend kernel each
    assert blends == executes - 1 and blends > 0
    assert ("kernel", "ucudnn_scale_float32") not in TRACE


@pytest.mark.parametrize("dtype", ["float16", "float32", "float64", "bfloat16"])
def test_the_blend_runs_as_cupy_resolves_its_types(dtype):
    """The blend's kernels called as CuPy calls them: every type placeholder is filled by an array
    argument (a scalar never fills one: CuPy issue #2091), and the result is alpha * tmp + beta * out
    in the data's arithmetic type, checked against float64 on fresh random data."""
    cupy = make_fake_cupy()
    rng = np.random.default_rng()
    storage = {"float16": np.float16, "float32": np.float32, "float64": np.float64, "bfloat16": np.uint16}[dtype]
    unit = selftest.TOLERANCE[dtype] if dtype in selftest.TOLERANCE else 2.0**-7
    for alpha, beta in ((1.0, 0.0), (0.7, 0.0), (1.0, 1.0), (-0.3, 2.5)):
        tmp_values, out_values = rng.standard_normal((2, 3, 4, 5))
        tmp = _fake(cupy_arrays._narrow(np, tmp_values, dtype))
        out = _fake(cupy_arrays._narrow(np, out_values, dtype) if beta else _pool_block((3, 4, 5), storage))
        before = selftest.to_host_float64(out, dtype) if beta else 0.0
        expected = alpha * selftest.to_host_float64(tmp, dtype) + beta * before
        cupy_arrays.blend(cupy, dtype, tmp, out, alpha, beta)
        assert out.dtype == storage
        assert selftest.relative_error(selftest.to_host_float64(out, dtype), expected) <= unit


def test_a_placeholder_only_scalars_use_is_refused_as_cupy_refuses_it():
    # The blend as it was on 2026-11-22 (W filled by nothing): CuPy raised KeyError: 'W' on every
    # launch that blends. The stand-in refuses it the same way, so the tests above would catch it.
    cupy = make_fake_cupy()
    kernel = cupy.ElementwiseKernel(
        "T tmp, W alpha, W beta", "T out", "out = (T)(alpha * (W)tmp + beta * (W)out)", "old_blend"
    )
    tmp, out = _fake(np.ones(4, np.float32)), _fake(np.ones(4, np.float32))
    with pytest.raises(KeyError, match="W"):
        kernel(tmp, np.float32(2.0), np.float32(1.0), out)
    # Given as arrays, the same placeholder is filled: the rule is about scalars.
    kernel(tmp, _fake(np.float32(2.0) * np.ones(4, np.float32)), _fake(np.ones(4, np.float32)), out)
    assert np.all(out == 3.0)


@pytest.mark.parametrize("kind", KINDS)
def test_prepared_launches_check_operands_once(fake_gpu, kind, monkeypatch):
    # A micro-batched configuration run three times: the first run checks every operand through
    # `run`, later ones go through `prepare_run`'s launchers (unaligned slices and bwd_filter's
    # accumulation still take the copying / blending path) and give the same results.
    from ucudnn.solver.types import Configuration, MicroConfig

    from ucudnn.kernel.run import PreparedConfiguration

    backend = cudnn_backend.CudnnBackend()
    checks = []
    real_check = backend._check_operand
    monkeypatch.setattr(backend, "_check_operand", lambda *a: checks.append(a[1]) or real_check(*a))
    problem = SMALL.with_kind(kind)
    algo = "eng1:TILE_SIZE=2"
    micros = tuple(MicroConfig(algo, b, 0.0, backend.workspace_size(problem.with_batch(b), algo)) for b in (2, 1))
    prepared = PreparedConfiguration(backend, problem, Configuration(micros))
    workspace = backend.empty_workspace(max(m.workspace for m in micros))
    for seed in range(3):
        operands = backend.random_operands(problem, seed=seed)
        inputs = {name: array for name, array in operands.items() if name != "out"}
        expected = selftest.reference(problem, **{n: np.asarray(a, dtype=np.float64) for n, a in inputs.items()})
        prepared.run(out=operands["out"], workspace=workspace, **inputs)
        assert selftest.relative_error(np.asarray(operands["out"], dtype=np.float64), expected) < 1e-6
        if seed == 0:
            first = len(checks)
    assert first == 3 * len(micros) and len(checks) == first  # checked on the first run only


@pytest.mark.parametrize("mode", [{"workspace_limit": 4096}, {"total_workspace": 8192}], ids=["WR", "WD"])
def test_a_handle_keeps_no_device_memory_between_runs(fake_gpu, mode):
    # torch.compile(mode="reduce-overhead") runs a step once to warm up with every allocation in its CUDA
    # graphs' private pool, then requires every block still alive there to be one of the graph's outputs
    # (cudagraph_trees.check_memory_pool). A workspace the handle kept (WR's buffer, WD's arena) would be
    # such a block; on the cudnn backend each run takes its workspace and lets it go.
    from ucudnn.handle import Handle

    backend = cudnn_backend.CudnnBackend()
    handle = Handle(
        backend=backend,
        db=False,
        reps=1,
        policy=(1, 2, 4),
        algos=["eng1:TILE_SIZE=2", "eng2:SPLIT_K_BUF=4,TILEK=0"],
        **mode,
    )
    problems = {kind: SMALL.with_kind(kind) for kind in KINDS}
    handle.register("conv", SMALL, kinds=KINDS)
    operands = {kind: backend.random_operands(problem, seed=1) for kind, problem in problems.items()}
    taken = len(BLOCKS)
    kernels = {kind: handle.kernel(kind, SMALL.x_shape, SMALL.w_shape, padding=1, layer="conv") for kind in KINDS}
    for _ in range(3):
        for kind, kernel in kernels.items():
            kernel.run(**operands[kind])
    assert all(k.config.workspace > 0 for k in kernels.values()), [k.config for k in kernels.values()]
    gc.collect()
    alive = [ref() for ref in BLOCKS[taken:] if ref() is not None]
    assert not alive, f"{len(alive)} blocks of {[a.nbytes for a in alive]} B outlive the runs"
    assert handle.workspace_bytes == 0 and handle.arena is None
    assert handle.peak_workspace >= max(k.config.workspace for k in kernels.values())
    for kind, problem in problems.items():
        inputs = {n: np.asarray(a, np.float64) for n, a in operands[kind].items() if n != "out"}
        expected = selftest.reference(problem, **inputs)
        assert selftest.relative_error(np.asarray(operands[kind]["out"], np.float64), expected) < 1e-6


def test_every_launch_runs_on_the_callers_current_stream(fake_gpu):
    # ucudnn.torch enters cupy.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream) around a layer's
    # kernels: under CUDA graph capture that is the capturing stream, and every launch (the frontend's
    # execute, CuPy's blend and copies) must be enqueued there. The handle's stream is set before each
    # execute; the frontend calls cudnnSetStream only when it changes.
    import cupy
    from ucudnn.solver.types import Configuration, MicroConfig

    from ucudnn.kernel.run import PreparedConfiguration

    backend = cudnn_backend.CudnnBackend()
    problem = SMALL.with_kind("bwd_filter")  # micro-batches after the first accumulate: a blend per launch
    algo = "eng1:TILE_SIZE=2"
    micros = tuple(MicroConfig(algo, b, 0.0, backend.workspace_size(problem.with_batch(b), algo)) for b in (2, 1))
    prepared = PreparedConfiguration(backend, problem, Configuration(micros))
    operands = backend.random_operands(problem, seed=2)
    workspace = backend.empty_workspace(max(m.workspace for m in micros))
    for stream in (7, 9, 9, 0):
        LAUNCHES.clear()
        with cupy.cuda.ExternalStream(stream, 0):
            prepared.run(workspace=workspace, **operands)
        kinds = {launch[0] for launch in LAUNCHES}
        assert kinds == {"execute", "kernel"} and {launch[-1] for launch in LAUNCHES} == {stream}, LAUNCHES
    assert fake_gpu.handles["switched"] == [7, 9, 0]


# ---- every form through the stand-in: 1-D, 3-D and transposed, lowered and run -----------------------
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_selftest_runs_every_form_through_the_backend(fake_gpu, dtype):
    # The forms the selftest adds after the five 2-D problems: 1-D, 3-D, transposed 2-D and 3-D;
    # 5-D descriptors through the real pygraph IR, transposed kernels as their lowered graphs.
    backend = cudnn_backend.CudnnBackend()
    forms = selftest.DEFAULT_PROBLEMS[5:]
    assert any("d=" in spec for spec in forms) and any("transposed=1" in spec for spec in forms)
    report = selftest.run_selftest(backend, problems=forms, dtype=dtype)
    assert report.passed, report.format()
    assert {c.algo for c in report.checks if c.status == "pass"} >= {"eng0", "eng2:SPLIT_K_BUF=4,TILEK=0"}
    assert report.count("pass") >= len(forms) * len(KINDS) * 4


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(
    "spec",
    [
        "n=3,c=3,d=4,h=5,w=3,k=4,t=3,r=3,s=3,pad=1,layout=NHWC",
        ("n=3,c=4,d=2,h=3,w=3,k=6,t=2,r=2,s=2,stride=2,transposed=1,output_padding_w=1,layout=NHWC"),
    ],
)
def test_ndhwc_and_transposed_operands_run_micro_batched(fake_gpu, spec, kind):
    from ucudnn.solver.types import Configuration, MicroConfig

    from ucudnn.kernel.run import PreparedConfiguration

    backend = cudnn_backend.CudnnBackend()
    problem = ConvProblem.parse(spec).with_kind(kind)
    algo = "eng1:TILE_SIZE=2"
    micros = tuple(MicroConfig(algo, b, 0.0, backend.workspace_size(problem.with_batch(b), algo)) for b in (2, 1))
    prepared = PreparedConfiguration(backend, problem, Configuration(micros))
    workspace = backend.empty_workspace(max(m.workspace for m in micros))
    for seed in range(2):  # the checked first run, then the prepared launchers
        operands = backend.random_operands(problem, seed=seed)
        for name, array in operands.items():
            assert array.strides[1] == array.itemsize, f"{name} is not channels last"
        inputs = {name: array for name, array in operands.items() if name != "out"}
        expected = selftest.reference(problem, **{n: np.asarray(a, dtype=np.float64) for n, a in inputs.items()})
        prepared.run(out=operands["out"], workspace=workspace, **inputs)
        assert selftest.relative_error(np.asarray(operands["out"], dtype=np.float64), expected) < 1e-6


def test_transposed_operands_are_checked_by_the_callers_names(fake_gpu):
    backend = cudnn_backend.CudnnBackend()
    problem = ConvProblem.parse("n=2,c=4,h=3,w=3,k=6,r=2,s=2,stride=2,transposed=1")
    operands = backend.random_operands(problem)
    workspace = backend.empty_workspace(backend.workspace_size(problem, "eng0"))
    with pytest.raises(InvalidInput, match="operand 'x' has shape"):
        backend.run(
            problem, "eng0", x=operands["x"][:, :, :2], w=operands["w"], out=operands["out"], workspace=workspace
        )
    assert backend.algorithms(problem) == FAKE_ALGOS
    assert backend.workspace_size(problem, "eng1:TILE_SIZE=2") == backend.workspace_size(
        problem.lowered(), "eng1:TILE_SIZE=2"
    )
