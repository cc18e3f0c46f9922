"""What every backend offers (the DESIGN backend contract), and the timing they share."""

from __future__ import annotations

import abc
import logging
import math
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ucudnn.problem import ConvProblem
from ucudnn.solver.types import MicroConfig

log = logging.getLogger(__name__)

# A measurement whose interquartile range exceeds this fraction of its median is flagged as noisy:
# on a shared 2-core machine a 25% spread means the median may be off by about that much.
NOISY_SPREAD_FRACTION = 0.25

# The verified run finds its workspace full of these bytes (NaN in every float format), so an
# algorithm that reads workspace it never wrote gives a non-finite or wrong result instead of
# passing on the zeros a fresh allocation often happens to hold.
UNWRITTEN_WORKSPACE_BYTE = 0xFF
# Unit roundoff of the formats a result passes through: storage (inputs and output are rounded to
# it) and accumulation. TF32 is float32 with a 10-bit mantissa, what tensor cores use for float32.
UNIT_ROUNDOFF = {"float64": 2.0**-53, "float32": 2.0**-24, "tf32": 2.0**-11, "float16": 2.0**-11, "bfloat16": 2.0**-8}
# Headroom over the rounding estimate: correct cuDNN engines reached 5.7e-3 under TF32 summing over
# 16x224x224 (estimate 5.4e-4, tolerance 3.5e-2), a wrong one 1.54. The cap keeps low-precision
# accumulation over long sums from accepting anything.
VERIFY_SAFETY = 64.0
VERIFY_CAP = 0.25


def reduction_length(problem: ConvProblem) -> int:
    """How many products each output element sums (of the convolution that computes a transposed one)."""
    p = problem.lowered()
    taps = math.prod(a.filter for a in p.axes)
    if p.kind == "fwd":
        return p.c // p.groups * taps
    if p.kind == "bwd_data":
        return p.k // p.groups * taps
    return p.n * math.prod(a.out for a in p.axes)


def verification_tolerance(problem: ConvProblem, *, tf32: bool = False) -> float:
    """Normwise relative error (max |out - ref| / max |ref|) a correct algorithm stays within.

    Rounding the operands costs about one unit roundoff of the input format (TF32 for float32
    compute when `tf32`), summing L products about sqrt(L) units of the accumulator (random-walk
    growth of rounding errors).
    """
    compute = problem.effective_compute_type
    inputs = "tf32" if tf32 and compute == "float32" else compute
    storage = max(UNIT_ROUNDOFF[problem.dtype], UNIT_ROUNDOFF[inputs])
    estimate = storage + UNIT_ROUNDOFF[compute] * math.sqrt(reduction_length(problem))
    return min(VERIFY_SAFETY * estimate, VERIFY_CAP)


@dataclass(frozen=True, slots=True)
class DeviceInfo:
    """What the measurements were taken on; every field is part of the cache key."""

    model: str
    memory_bytes: int
    versions: tuple[tuple[str, str], ...] = field(default=())  # (library, version), sorted

    @property
    def versions_text(self) -> str:
        return ",".join(f"{lib}={ver}" for lib, ver in self.versions)


def one_line(exc: BaseException) -> str:
    """An exception as one line of text, for reasons and error messages."""
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def summarize_samples(samples_ms: Sequence[float]) -> tuple[float, float]:
    """Median and interquartile range of timing samples (ms)."""
    if len(samples_ms) == 1:
        return samples_ms[0], 0.0
    q1, median, q3 = statistics.quantiles(samples_ms, n=4, method="inclusive")
    return median, q3 - q1


class Backend(abc.ABC):
    """A convolution library. Arrays are NCHW (NCDHW in 3-D) and contiguous (NumPy on the CPU, CuPy
    on a GPU), in the shapes of the problem (`ConvProblem.x_shape`, `w_shape`, `y_shape`, any form).

    A backend that cannot run a form (a dtype, a layout, an algorithm without a 3-D version) says
    so in `unsupported_reason`; `measure` records that reason, the selftest skips with it, and
    `ucudnn bench` lists it."""

    name: str
    warmup_runs = 1  # untimed runs before the timed ones (caches, lazy compilation); the first is verified
    tf32 = False  # float32 compute may round operands to TF32 (GPU tensor cores)
    # Whether a handle takes each run's workspace from `empty_workspace` and lets it go after the run,
    # instead of keeping a buffer (WR) or an arena (WD) between runs: see CudnnBackend.
    workspace_per_run = False

    @property
    @abc.abstractmethod
    def device(self) -> DeviceInfo: ...

    @property
    def device_id(self) -> int | None:
        """The CUDA device it runs on (`CudnnBackend`'s); None for a backend that runs on none."""
        return None

    def settings(self) -> dict[str, str]:
        """This instance's options that change its timings (e.g. the CPU backend's thread count),
        which plans solved from its measurements are keyed by; none by default."""
        return {}

    @abc.abstractmethod
    def algorithms(self, problem: ConvProblem) -> list[str]:
        """Every algorithm this backend knows for the problem's kind, supported or not."""

    def ranked(self, problem: ConvProblem, algos: Sequence[str]) -> list[str]:
        """`algos` best first, as the backend itself would try them: the order `algorithms` lists
        them in (cuDNN's is its heuristics' ranking). Pruned benchmarks time the first ones."""
        rank = {algo: i for i, algo in enumerate(self.algorithms(problem))}
        return sorted(algos, key=lambda algo: rank.get(algo, len(rank)))

    @abc.abstractmethod
    def unsupported_reason(self, problem: ConvProblem, algo: str) -> str | None:
        """Why `algo` cannot run `problem`, or None when it can."""

    @abc.abstractmethod
    def workspace_size(self, problem: ConvProblem, algo: str) -> int:
        """Bytes of workspace `run` needs for this problem (at its batch size `problem.n`)."""

    @abc.abstractmethod
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
        """One kernel: out = alpha * result + beta * out, temporaries taken from `workspace`."""

    def prepare_run(self, problem: ConvProblem, algo: str):
        """A launcher for repeated runs of `algo` on `problem`: ``launch(x, w, dy, out, workspace,
        alpha, beta)`` (positional; operands the kind does not read may be None).

        It may skip every check `run` makes: call it only with operands of the shapes, dtype,
        layout and array type that a checked `run` of the same problem accepted. Backends override
        it to do once what `run` does per call (workspace layouts, built plans, operand checks);
        this default is `run` itself.
        """
        run = self.run

        def launch(x: Any, w: Any, dy: Any, out: Any, workspace: Any, alpha: float, beta: float) -> None:
            run(problem, algo, x=x, w=w, dy=dy, out=out, workspace=workspace, alpha=alpha, beta=beta)

        return launch

    def synchronize(self) -> None:
        """Wait until every kernel launched so far has finished (asynchronous devices override this)."""

    @abc.abstractmethod
    def empty_workspace(self, nbytes: int) -> Any:
        """A byte buffer of `nbytes` on this backend's device."""

    @abc.abstractmethod
    def random_operands(self, problem: ConvProblem, seed: int = 0) -> dict[str, Any]:
        """Fresh inputs and an output buffer for `run`: keys among x, w, dy, and out."""

    @abc.abstractmethod
    def time_run_ms(
        self, problem: ConvProblem, algo: str, operands: dict[str, Any], workspace: Any, reps: int, beta: float = 0.0
    ) -> list[float]:
        """`reps` timing samples (ms) of `run` with this `beta`, after the caller's warm-up."""

    def trusted_result(self, problem: ConvProblem, inputs: dict[str, Any]) -> Any:
        """The kernel's float64 result on `inputs`, computed independently of every algorithm.

        Here on the host in NumPy; a device backend overrides it to compute where the data is.
        """
        from ucudnn.reference import reference, to_host_float64

        return reference(problem, **{name: to_host_float64(a, problem.dtype) for name, a in inputs.items()})

    def result_error(self, problem: ConvProblem, out: Any, trusted: Any) -> float:
        """Normwise relative error of `out` against `trusted_result` (inf for NaN or inf)."""
        from ucudnn.reference import relative_error, to_host_float64

        return relative_error(to_host_float64(out, problem.dtype), trusted)

    def versions_for(self, algo: str) -> str:
        """The library versions that can change `algo`'s measurements: its part of the cache key.

        By default every library of the device; a backend whose algorithms come from different
        libraries narrows it, so that installing or upgrading one library keeps the others'
        measurements.
        """
        return self.device.versions_text

    def candidate_failures(self) -> tuple[type[BaseException], ...]:
        """Exceptions that mean one candidate failed to build or run, besides running out of memory."""
        return ()

    def measure(
        self, problem: ConvProblem, algos: Sequence[str], reps: int = 3, *, accumulate: bool = False
    ) -> list[MicroConfig]:
        """Verify, then time each algorithm at `problem.n`: warm-up runs, then the median of `reps` runs.

        The first warm-up run is the verified one: its workspace holds UNWRITTEN_WORKSPACE_BYTE, its
        output NaN (beta = 0 must not read it), and its output is compared with `trusted_result` on
        the same operands (computed once per call, that is once per problem and micro-batch size).
        With `accumulate` (a bwd_filter micro-batch, which `run_configuration` adds into the first
        one's result with beta = 1) a second run with beta = 1 must double that result: an engine
        that is right alone and wrong when accumulating is caught at the size it would run at. A
        candidate beyond `verification_tolerance` is returned unusable with the reason
        `wrong result (...)`. `accumulate` also times the runs with beta = 1.

        An algorithm that cannot run (unsupported, out of memory, or failing with one of
        `candidate_failures()`) is returned with infinite time and the reason; it never stops the
        others. Noisy timings are logged at debug level; `MicroConfig.spread` carries them to reports.
        """
        if reps < 1:
            raise ValueError(f"reps must be positive, got {reps}")
        operands = self.random_operands(problem)
        inputs = {name: array for name, array in operands.items() if name != "out"}
        tolerance = verification_tolerance(problem, tf32=self.tf32)
        beta = 1.0 if accumulate else 0.0
        trusted = None
        results: list[MicroConfig] = []
        for algo in algos:
            reason = self.unsupported_reason(problem, algo)
            if reason is not None:
                results.append(MicroConfig(algo, problem.n, float("inf"), 0, reason=reason))
                continue
            nbytes = self.workspace_size(problem, algo)
            try:
                workspace = self.empty_workspace(nbytes)
                workspace.fill(UNWRITTEN_WORKSPACE_BYTE)
                fill_unwritten(operands["out"])  # nothing to inherit a right answer from, NaN if read
                self.run(problem, algo, workspace=workspace, **operands)
                self.synchronize()
                if trusted is None:
                    trusted = self.trusted_result(problem, inputs)
                wrong = self._wrong_result(problem, operands["out"], trusted, tolerance, "")
                if wrong is None and accumulate:
                    self.run(problem, algo, workspace=workspace, beta=1.0, **operands)
                    self.synchronize()
                    wrong = self._wrong_result(
                        problem, operands["out"], 2 * trusted, tolerance, "accumulating with beta = 1, "
                    )
                if wrong is not None:
                    results.append(MicroConfig(algo, problem.n, float("inf"), nbytes, reason=wrong))
                    log.debug("%s on %s (%s): %s over %.3g", algo, problem.spec, problem.kind, wrong, tolerance)
                    continue
                for _ in range(self.warmup_runs - 1):
                    self.run(problem, algo, workspace=workspace, beta=beta, **operands)
                samples = self.time_run_ms(problem, algo, operands, workspace, reps, beta=beta)
            except MemoryError as exc:  # cupy's OutOfMemoryError is one too
                results.append(
                    MicroConfig(algo, problem.n, float("inf"), nbytes, reason=f"out of memory: {one_line(exc)}")
                )
                continue
            except self.candidate_failures() as exc:
                results.append(
                    MicroConfig(algo, problem.n, float("inf"), nbytes, reason=f"failed to run: {one_line(exc)}")
                )
                continue
            median, spread = summarize_samples(samples)
            if is_noisy(median, spread):
                log.debug("noisy timing: %s on %s: median %.3f ms, IQR %.3f ms", algo, problem.spec, median, spread)
            results.append(MicroConfig(algo, problem.n, median, nbytes, spread=spread))
        return results

    def _wrong_result(self, problem: ConvProblem, out: Any, trusted: Any, tolerance: float, how: str) -> str | None:
        error = self.result_error(problem, out, trusted)
        return None if error <= tolerance else f"wrong result ({how}rel. error {error:.3g})"  # NaN fails too


def fill_unwritten(array: Any) -> None:
    """Fill an output with NaN (all-ones bits for bfloat16's uint16 storage): a kernel that reads
    an output it should overwrite then gives NaN instead of passing on zeros."""
    array.fill(0xFFFF if array.dtype.kind == "u" else math.nan)


def is_noisy(median_ms: float, spread_ms: float) -> bool:
    """A timing whose interquartile range is a large fraction of its median."""
    return median_ms > 0 and spread_ms > NOISY_SPREAD_FRACTION * median_ms


def wall_clock_samples_ms(fn, reps: int) -> list[float]:
    """Time `fn()` `reps` times with a monotonic clock (for synchronous backends)."""
    samples = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1e3)
    return samples
