"""The CPU backend itself: which algorithms it offers and when each applies, what keys a measurement,
and the launchers that run a family's code on its carved workspace under the thread setting asked for.

Threads: by default BLAS and `scipy.fft` use every core. ``CpuBackend(numpy_threads=1)`` runs the
NumPy algorithms on one thread (BLAS through `threadpoolctl`, FFTs through ``scipy.fft.set_workers``),
for callers that run them between PyTorch's own operations: two thread pools that spin while
waiting take turns on the same cores, and a training step through both ran 2.5-5x slower than
PyTorch alone on 2 cores. The setting is part of each measurement's key, so timings taken under
one setting never stand in for the other.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import platform
import time
import weakref
from collections.abc import Mapping
from typing import Any

import numpy as np
import scipy
import scipy.fft

from ucudnn.backends.base import Backend, DeviceInfo, wall_clock_samples_ms
from ucudnn.backends.cpu.fft import FFT_WORKERS, _fft_layout, _run_fft
from ucudnn.backends.cpu.im2col import _im2col_layout, _prepare_im2col, _run_im2col
from ucudnn.backends.cpu.native import _native_launcher, _torch_version
from ucudnn.backends.cpu.shifted import _run_shift, _shift_layout
from ucudnn.backends.cpu.winograd import _run_winograd, _winograd_layout, _winograd_reason
from ucudnn.errors import InvalidInput, UnsupportedProblem
from ucudnn.problem import ConvProblem

IM2COL_GEMM = "im2col_gemm"
SHIFT_GEMM = "shift_gemm"
FFT = "fft"
WINOGRAD = "winograd"
NATIVE = "native"
ALGORITHMS = (IM2COL_GEMM, SHIFT_GEMM, FFT, WINOGRAD)  # `native` is added when torch imports

SUPPORTED_DTYPES = ("float32", "float64")

# The NumPy families by name: the workspace each carves, and the code that computes in it.
_LAYOUTS = {IM2COL_GEMM: _im2col_layout, SHIFT_GEMM: _shift_layout, FFT: _fft_layout, WINOGRAD: _winograd_layout}
# Families that make their per-problem work once (`prepare_run`): (views, run) as `_prepare_im2col` returns.
_PREPARE = {IM2COL_GEMM: _prepare_im2col}
_RANK = {algo: i for i, algo in enumerate((NATIVE, IM2COL_GEMM, WINOGRAD, SHIFT_GEMM, FFT))}
_RUNS = {IM2COL_GEMM: _run_im2col, SHIFT_GEMM: _run_shift, FFT: _run_fft, WINOGRAD: _run_winograd}


def _blas_version(config: Mapping[str, Any]) -> str:
    blas = config.get("Build Dependencies", {}).get("blas", {})
    return f"{blas.get('name', 'unknown')} {blas.get('version', 'unknown')}"


_THREAD_VARIABLES = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")
# Part of every measurement's key: raised when the way of measuring changes what a timing means, so
# that older timings are not reused. 2: the verification reference runs on one BLAS thread (before,
# its pool still spun while the next candidate was timed).
MEASUREMENT_PROTOCOL = 2
# `native`'s own: 3, timed only once a multi-threaded BLAS call's pool has stopped spinning (below).
NATIVE_MEASUREMENT_PROTOCOL = 3

# After a multi-threaded call, OpenBLAS's idle threads spin at full speed for about 0.1 s (2**28
# cycles) before they sleep. On a 2-core machine, PyTorch's convolution timed in that window shares a
# core with a spinning thread: measured 10-30x slower (the main job's backward kernels at batch 1:
# 13-33 ms against 1.1-1.6 ms), so that micro-batches of `native` lost to the undivided NumPy baseline
# and both backward kernels stayed at 1.00x. So `native` is timed after the spin is over. (A NumPy
# algorithm on one BLAS thread, as converted layers run them, leaves no pool spinning.)
_IDLE_POLL_S = 0.005  # how often the process's CPU time is read while waiting
_IDLE_CPU_FRACTION = 0.2  # other threads idle: they used under this share of one core over a poll
_IDLE_WAIT_MAX_S = 0.5  # never wait longer (a process whose own threads are busy with other work)
_blas_pool_may_spin = False  # the last candidate timed was a NumPy algorithm on more than one BLAS thread


def _wait_for_idle_threads(poll_s: float = _IDLE_POLL_S, limit_s: float = _IDLE_WAIT_MAX_S) -> float:
    """Sleep until this process's other threads stop using the CPU (a thread pool's idle spin is over),
    at most `limit_s`; the seconds waited. Read from the process's CPU time while this thread sleeps."""
    start = quiet = time.perf_counter()
    while True:
        cpu, wall = time.process_time(), time.perf_counter()
        time.sleep(poll_s)
        now = time.perf_counter()
        if time.process_time() - cpu >= _IDLE_CPU_FRACTION * (now - wall):
            quiet = now  # busy over this poll: the quiet spell starts again
        if now - quiet >= 2 * poll_s or now - start >= limit_s:  # two quiet polls in a row, or enough
            return now - start


@functools.cache
def _device_info() -> DeviceInfo:
    model = platform.processor() or platform.machine() or "unknown CPU"
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    model = line.partition(":")[2].strip()
                    break
    except OSError:  # not Linux: keep the platform module's name for the processor
        pass
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    try:
        memory_bytes = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # sysconf lacks these names on this platform
        memory_bytes = 0
    versions = {
        "numpy": np.__version__,
        "scipy": scipy.__version__,
        "numpy-blas": _blas_version(np.show_config(mode="dicts")),
        "scipy-blas": _blas_version(scipy.show_config(mode="dicts")),
    }
    torch_version = _torch_version()
    if torch_version is not None:
        versions["torch"] = torch_version
    # Thread counts change every timing, so measurements taken under other settings are not reused.
    for var in _THREAD_VARIABLES:
        versions[var] = os.environ.get(var, "default")
    return DeviceInfo(
        model=f"{model} ({cores} cores)", memory_bytes=int(memory_bytes), versions=tuple(sorted(versions.items()))
    )


def _same(views):
    return views


@functools.cache
def _blas_pools():
    """BLAS thread pools loaded in this process, found once (a search of the loaded libraries)."""
    from threadpoolctl import ThreadpoolController

    return ThreadpoolController().select(user_api="blas")


def _numpy_threads(threads: int | None):
    """The context a NumPy algorithm runs in: BLAS and scipy.fft on `threads` threads (None: BLAS
    as configured, FFTs on every core)."""
    if threads is None:
        return scipy.fft.set_workers(FFT_WORKERS)
    stack = contextlib.ExitStack()
    stack.enter_context(_blas_pools().limit(limits=threads))
    stack.enter_context(scipy.fft.set_workers(threads))
    return stack


class CpuBackend(Backend):
    """Convolution on the CPU over NumPy/SciPy (and PyTorch as `native` when it imports).

    `numpy_threads`: threads for the NumPy algorithms' BLAS calls and FFTs (None: the libraries'
    defaults); see the module docstring."""

    name = "cpu"
    numpy_threads: int | None = None

    def __init__(self, numpy_threads: int | None = None) -> None:
        if numpy_threads is not None and (
            isinstance(numpy_threads, bool) or not isinstance(numpy_threads, int) or numpy_threads < 1
        ):
            raise InvalidInput(f"numpy_threads must be a positive integer or None, got {numpy_threads!r}")
        self.numpy_threads = numpy_threads

    def __repr__(self) -> str:
        return f"CpuBackend(numpy_threads={self.numpy_threads})"

    def settings(self) -> dict[str, str]:
        return {} if self.numpy_threads is None else {"numpy_threads": str(self.numpy_threads)}

    def trusted_result(self, problem: ConvProblem, inputs: dict[str, Any]) -> Any:
        # The float64 reference is BLAS work too, and a BLAS pool spins for a while after it: the
        # candidate timed next (torch's own, on its own pool) measured 2x slow. One thread leaves none.
        with _numpy_threads(1):
            return super().trusted_result(problem, inputs)

    @property
    def device(self) -> DeviceInfo:
        return _device_info()

    def algorithms(self, problem: ConvProblem) -> list[str]:
        return list(ALGORITHMS) + ([NATIVE] if _torch_version() is not None else [])

    def ranked(self, problem: ConvProblem, algos) -> list[str]:
        # A fixed order, fastest first on most shapes: PyTorch's own (oneDNN), then one GEMM over
        # unfolded columns, Winograd (3x3 only), the small-workspace shifted GEMMs, FFT (large filters).
        return sorted(algos, key=lambda algo: _RANK.get(algo, len(_RANK)))

    def versions_for(self, algo: str) -> str:
        # native is PyTorch's convolution; the others are NumPy/SciPy over their BLAS. Both read
        # the thread-count variables. So installing torch keeps every NumPy measurement.
        own = ("torch",) if algo == NATIVE else ("numpy", "numpy-blas", "scipy", "scipy-blas")
        key = ",".join(f"{lib}={ver}" for lib, ver in self.device.versions if lib in own or lib in _THREAD_VARIABLES)
        key += f",protocol={NATIVE_MEASUREMENT_PROTOCOL if algo == NATIVE else MEASUREMENT_PROTOCOL}"
        if algo != NATIVE and self.numpy_threads is not None:  # default keys stay as they were
            key += f",numpy-threads={self.numpy_threads}"
        return key

    def unsupported_reason(self, problem: ConvProblem, algo: str) -> str | None:
        known = ALGORITHMS + (NATIVE,)
        if algo not in known:
            return f"unknown algorithm {algo!r} for the cpu backend; known: {', '.join(known)}"
        if problem.dtype not in SUPPORTED_DTYPES:
            return f"the cpu backend computes in float32 or float64, not {problem.dtype}"
        if problem.effective_compute_type != problem.dtype:
            return (
                f"the cpu backend computes in the data type; compute_type {problem.compute_type} "
                f"differs from dtype {problem.dtype}"
            )
        if problem.layout != "NCHW":
            return f"the cpu backend runs NCHW tensors only, not {problem.layout}"
        if algo == WINOGRAD:
            return _winograd_reason(problem.lowered())
        if algo == NATIVE and _torch_version() is None:
            return "native needs PyTorch, which is not installed here"
        return None

    def workspace_size(self, problem: ConvProblem, algo: str) -> int:
        reason = self.unsupported_reason(problem, algo)
        if reason is not None:
            raise UnsupportedProblem(reason)
        if algo == NATIVE:
            # torch allocates its own temporaries and cannot use our buffer, so this is an estimate
            # of what it takes, not a carved size: the result tensor it returns plus the unfolded
            # columns of its reference CPU path for the whole batch (of the convolution that a
            # transposed one is the adjoint of). Declaring 0 would make native look free under
            # every limit and hide the memory it really uses.
            itemsize = np.dtype(problem.dtype).itemsize
            conv = problem.lowered()
            columns = conv.n * conv.c * math.prod(a.filter * a.out for a in conv.axes)
            return (math.prod(problem.out_shape) + columns) * itemsize
        return _LAYOUTS[algo](problem.lowered()).nbytes

    def empty_workspace(self, nbytes: int) -> np.ndarray:
        return np.empty(nbytes, np.uint8)

    def random_operands(self, problem: ConvProblem, seed: int = 0) -> dict[str, np.ndarray]:
        # Unsupported dtypes (float16, bfloat16) still get float32 operands, so that `measure` can
        # report every algorithm as unsupported instead of failing here.
        dtype = np.dtype(problem.dtype if problem.dtype in SUPPORTED_DTYPES else "float32")
        rng = np.random.default_rng(seed)
        shapes = {"fwd": ("x", "w"), "bwd_data": ("dy", "w"), "bwd_filter": ("x", "dy")}[problem.kind]
        full = {"x": problem.x_shape, "w": problem.w_shape, "dy": problem.y_shape}
        operands = {name: rng.standard_normal(full[name], dtype=dtype) for name in shapes}
        operands["out"] = np.zeros(problem.out_shape, dtype)
        return operands

    def time_run_ms(
        self, problem: ConvProblem, algo: str, operands: dict[str, Any], workspace: Any, reps: int, beta: float = 0.0
    ) -> list[float]:
        # The launcher a Handle runs in steady state, after `measure`'s checked warm-up run: the
        # per-call checks and layout work of `run` would otherwise count against every algorithm.
        # It honours beta itself (BLAS beta, or one blend into out), so what is timed is what runs.
        # native is timed only once the BLAS pool of a NumPy candidate timed before it has stopped
        # spinning (NATIVE_MEASUREMENT_PROTOCOL).
        global _blas_pool_may_spin
        launch = self.prepare_run(problem, algo)
        x, w, dy, out = (operands.get(name) for name in ("x", "w", "dy", "out"))
        if algo == NATIVE and _blas_pool_may_spin:
            _wait_for_idle_threads()
        _blas_pool_may_spin = algo != NATIVE and self.numpy_threads != 1
        return wall_clock_samples_ms(lambda: launch(x, w, dy, out, workspace, 1.0, beta), reps)

    def prepare_run(self, problem: ConvProblem, algo: str):
        """`run` without its per-call work: the workspace layout (and, for im2col_gemm, every index its
        copies take) made once, the workspace carved once per buffer, no operand checked (the caller's
        first, checked `run` vouched for their kind), and the thread setting applied by a direct call
        to each BLAS pool (threadpoolctl's `limit` context re-reads every pool: more than a small
        kernel's whole time)."""
        reason = self.unsupported_reason(problem, algo)
        if reason is not None:
            raise UnsupportedProblem(reason)
        if algo == NATIVE:
            return _native_launcher(problem)
        conv, swap = problem.lowered(), problem.transposed  # the NumPy families run convolutions only
        carve = _LAYOUTS[algo](conv).carve
        if algo in _PREPARE:
            shape_views, compute = _PREPARE[algo](conv)
        else:
            family = _RUNS[algo]
            shape_views = _same

            def compute(ws, x, w, dy, out, alpha, beta):
                family(conv, ws, x, w, dy, out, alpha, beta)

        threads = self.numpy_threads
        pools = _blas_pools().lib_controllers if threads is not None else ()
        fft = algo == FFT
        last: list = [None, None]  # the handle's workspace slice last carved (a weak reference) and its views

        def launch(x, w, dy, out, workspace, alpha, beta):
            if swap:
                x, dy = dy, x
            seen = last[0]
            if seen is not None and seen() is workspace:
                views = last[1]
            else:
                views = shape_views(carve(workspace))
                if workspace.base is not None:  # a slice of a buffer that outlives the run (the handle's)
                    last[0], last[1] = weakref.ref(workspace), views
            if fft:
                with _numpy_threads(threads):
                    compute(views, x, w, dy, out, alpha, beta)
                return
            saved = [(pool, pool.get_num_threads()) for pool in pools]
            for pool, count in saved:
                if count != threads:
                    pool.set_num_threads(threads)
            try:
                compute(views, x, w, dy, out, alpha, beta)
            finally:
                for pool, count in saved:
                    if count != threads:
                        pool.set_num_threads(count)

        return launch

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
        reason = self.unsupported_reason(problem, algo)
        if reason is not None:
            raise UnsupportedProblem(reason)
        dtype = np.dtype(problem.dtype)
        needed = {"fwd": {"x": x, "w": w}, "bwd_data": {"dy": dy, "w": w}, "bwd_filter": {"x": x, "dy": dy}}[
            problem.kind
        ]
        shapes = {"x": problem.x_shape, "w": problem.w_shape, "dy": problem.y_shape}
        for name, array in [*needed.items(), ("out", out)]:
            shape = problem.out_shape if name == "out" else shapes[name]
            if array is None:
                raise InvalidInput(f"{problem.kind} needs operand {name!r}, got None")
            if not isinstance(array, np.ndarray):
                raise InvalidInput(f"operand {name!r} must be a NumPy array, got {type(array).__name__}")
            if array.shape != shape or array.dtype != dtype:
                raise InvalidInput(
                    f"operand {name!r} must be {dtype} with shape {shape}, got {array.dtype} with shape {array.shape}"
                )
            if not array.flags.c_contiguous:
                raise InvalidInput(f"operand {name!r} must be C-contiguous (NCHW, or NCDHW in 3-D)")
        if not out.flags.writeable:
            raise InvalidInput("operand 'out' must be writeable")
        alpha, beta = float(alpha), float(beta)
        if algo == NATIVE:
            _native_launcher(problem)(x, w, dy, out, workspace, alpha, beta)
            return
        conv = problem.lowered()  # a transposed problem: its convolution, x and dy swapped (ConvProblem.lowered)
        if problem.transposed:
            x, dy = dy, x
        layout = _LAYOUTS[algo](conv)
        if not (isinstance(workspace, np.ndarray) and workspace.dtype == np.uint8 and workspace.ndim == 1):
            raise InvalidInput("workspace must be a 1-D NumPy uint8 array (see empty_workspace)")
        if workspace.nbytes < layout.nbytes:
            raise InvalidInput(
                f"workspace has {workspace.nbytes} bytes; {algo} on {problem.spec} "
                f"({problem.kind}) needs {layout.nbytes}"
            )
        if layout.nbytes and not workspace.flags.c_contiguous:
            raise InvalidInput("workspace must be contiguous")
        with _numpy_threads(self.numpy_threads):
            _RUNS[algo](conv, layout.carve(workspace), x, w, dy, out, alpha, beta)
