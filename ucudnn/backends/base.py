"""What every backend offers (the DESIGN backend contract), and the timing they share."""

from __future__ import annotations

import abc
import logging
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
    """A convolution library. Arrays are NCHW and contiguous (NumPy on the CPU, CuPy on a GPU)."""

    name: str
    warmup_runs = 1  # untimed runs before the timed ones (caches, lazy compilation)

    @property
    @abc.abstractmethod
    def device(self) -> DeviceInfo: ...

    @abc.abstractmethod
    def algorithms(self, problem: ConvProblem) -> list[str]:
        """Every algorithm this backend knows for the problem's kind, supported or not."""

    @abc.abstractmethod
    def unsupported_reason(self, problem: ConvProblem, algo: str) -> str | None:
        """Why `algo` cannot run `problem`, or None when it can."""

    @abc.abstractmethod
    def workspace_size(self, problem: ConvProblem, algo: str) -> int:
        """Bytes of workspace `run` needs for this problem (at its batch size `problem.n`)."""

    @abc.abstractmethod
    def run(self, problem: ConvProblem, algo: str, *, x: Any = None, w: Any = None, dy: Any = None,
            out: Any, workspace: Any, alpha: float = 1.0, beta: float = 0.0) -> None:
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
    def time_run_ms(self, problem: ConvProblem, algo: str, operands: dict[str, Any], workspace: Any,
                    reps: int) -> list[float]:
        """`reps` timing samples (ms) of `run`, after the caller's warm-up."""

    def candidate_failures(self) -> tuple[type[BaseException], ...]:
        """Exceptions that mean one candidate failed to build or run, besides running out of memory."""
        return ()

    def measure(self, problem: ConvProblem, algos: Sequence[str], reps: int = 3) -> list[MicroConfig]:
        """Time each algorithm at `problem.n`: warm-up runs, then the median of `reps` runs.

        An algorithm that cannot run (unsupported, out of memory, or failing with one of
        `candidate_failures()`) is returned with infinite time and the reason; it never stops the
        others.
        """
        if reps < 1:
            raise ValueError(f"reps must be positive, got {reps}")
        operands = self.random_operands(problem)
        results: list[MicroConfig] = []
        for algo in algos:
            reason = self.unsupported_reason(problem, algo)
            if reason is not None:
                results.append(MicroConfig(algo, problem.n, float("inf"), 0, reason=reason))
                continue
            nbytes = self.workspace_size(problem, algo)
            try:
                workspace = self.empty_workspace(nbytes)
                for _ in range(self.warmup_runs):
                    self.run(problem, algo, workspace=workspace, **operands)
                samples = self.time_run_ms(problem, algo, operands, workspace, reps)
            except MemoryError as exc:  # cupy's OutOfMemoryError is one too
                results.append(MicroConfig(algo, problem.n, float("inf"), nbytes,
                                           reason=f"out of memory: {one_line(exc)}"))
                continue
            except self.candidate_failures() as exc:
                results.append(MicroConfig(algo, problem.n, float("inf"), nbytes,
                                           reason=f"failed to run: {one_line(exc)}"))
                continue
            median, spread = summarize_samples(samples)
            if median > 0 and spread > NOISY_SPREAD_FRACTION * median:
                log.warning("noisy timing: %s on %s: median %.3f ms, IQR %.3f ms", algo, problem.spec, median, spread)
            results.append(MicroConfig(algo, problem.n, median, nbytes, spread=spread))
        return results


def wall_clock_samples_ms(fn, reps: int) -> list[float]:
    """Time `fn()` `reps` times with a monotonic clock (for synchronous backends)."""
    samples = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1e3)
    return samples
