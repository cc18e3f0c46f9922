"""The prepared kernel: what a repeated call runs, made once, and its launch. This is the hot path
(`Kernel.run` per layer per step), so it holds only records and the few steps every run takes; the
first run's checks, re-plans and trials branch off to their own modules."""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from ucudnn.backends.base import Backend
from ucudnn.backends.cpu import NATIVE
from ucudnn.kernel.run import PreparedConfiguration
from ucudnn.problem import ConvProblem
from ucudnn.solver.types import Configuration, MicroConfig


@dataclass(frozen=True, slots=True)
class _Prepared:
    """What a repeated call needs, looked up by the call's shapes and parameters alone."""

    problem: ConvProblem
    config: Configuration
    offset: int | None  # WD segment offset; None in WR (the shared buffer)
    kernels: PreparedConfiguration  # micro-batch problems, rows and launchers, made once
    out_shape: tuple[int, ...]  # problem.out_shape, which is derived per access
    budget: int | None = None  # planned within a caller's budget: its workspace is taken per run
    trial: _Trial | None = None  # timed against native undivided where it runs, for its first runs


@dataclass(slots=True)
class Turns:
    """Two ways of running one thing taking turns on the caller's own runs (first, second, first, ...), each
    run timed in this thread's CPU time (`ucudnn.handle.trials` says why), each side's first run untimed;
    open until both have `runs` timed runs. A kernel's trial and a converted layer's backward trial take them."""

    runs: int  # timed runs of each
    calls: int = 0
    first_ms: list[float] = dataclasses.field(default_factory=list)
    second_ms: list[float] = dataclasses.field(default_factory=list)

    @property
    def open(self) -> bool:
        return len(self.second_ms) < self.runs

    def take(self, first: Callable[[], Any], second: Callable[[], Any]) -> Any:
        """Run the side whose turn it is, timed; its result."""
        second_turn = self.calls % 2 == 1
        self.calls += 1
        start = time.thread_time()
        result = (second if second_turn else first)()
        if self.calls > 2:
            (self.second_ms if second_turn else self.first_ms).append((time.thread_time() - start) * 1e3)
        return result

    def first_won_by(self, margin_ms: float) -> bool:
        """Whether the first side's median beat the second's by more than `margin_ms`."""
        return statistics.median(self.first_ms) + margin_ms < statistics.median(self.second_ms)


@dataclass(slots=True)
class _Trial:
    """A planned kernel against torch's own convolution on the whole batch, timed where the caller
    runs it (inside its training step, where caches and thread pools are as they really are):
    the two take turns for the first runs, then the faster stays (`Handle(trial_runs=...)`)."""

    planned: _Prepared
    native: _Prepared
    turns: Turns  # first the plan, second native

    @property
    def open(self) -> bool:
        return self.turns.open


def native_only(config: Configuration) -> bool:
    """`native` on the whole batch: torch's own convolution, which a torch caller can run itself."""
    return len(config.micros) == 1 and config.micros[0].algo == NATIVE


def _prepared(
    backend: Backend, problem: ConvProblem, config: Configuration, offset: int | None, budget: int | None = None
) -> _Prepared:
    return _Prepared(
        problem, config, offset, PreparedConfiguration(backend, problem, config), problem.out_shape, budget
    )


class _Runs(Protocol):
    """What a `Kernel` runs through: its handle's launch (`_Launching._run`)."""

    def _run(
        self, prep: _Prepared, *, x: Any = None, w: Any = None, dy: Any = None, out: Any, alpha: float, beta: float
    ) -> None: ...


class Kernel:
    """One planned kernel, prepared to run again and again without a lookup (`Handle.kernel`).

    `run` takes operands of exactly the shapes, dtype and layout it was made for (the first run
    checks them in the backend; later runs only launch). It is valid while `handle.generation`
    equals `generation`: a WD re-solve moves segments and makes older kernels stale.
    """

    __slots__ = ("_handle", "_prep", "generation")

    def __init__(self, handle: _Runs, prep: _Prepared, generation: int) -> None:
        self._handle, self._prep, self.generation = handle, prep, generation

    @property
    def problem(self) -> ConvProblem:
        return self._prep.problem

    @property
    def config(self) -> Configuration:
        return self._prep.config

    @property
    def against_native(self) -> bool:
        """Whether it is timed against native undivided where it runs (`Handle(trial_runs=...)`, and native
        fits its limit)."""
        return self._prep.trial is not None

    @property
    def trying(self) -> bool:
        """Whether that trial is still running (the kernel may yet be swapped for native)."""
        trial = self._prep.trial
        return trial is not None and trial.open

    def run(
        self, *, x: Any = None, w: Any = None, dy: Any = None, out: Any, alpha: float = 1.0, beta: float = 0.0
    ) -> None:
        """out = alpha * kernel(...) + beta * out, with the handle's workspace."""
        self._handle._run(self._prep, x=x, w=w, dy=dy, out=out, alpha=alpha, beta=beta)


class _Launching:
    """The Handle's launch of a prepared kernel (a mixin of `Handle`, whose state it reads)."""

    # the Handle's state it uses (`Handle.__init__` says what each is)
    _backend: Backend
    workspace_listener: Any

    if TYPE_CHECKING:  # its workspaces' (`_Workspaces`), trials' (`_Trials`) and re-planning's (`_Recovery`)

        def _workspace(self, prep: _Prepared) -> Any: ...

        def _run_trial(self, prep: _Prepared, trial: _Trial, **call: Any) -> None: ...

        def _candidate_failures(self) -> tuple[type[BaseException], ...]: ...

        def _run_first(self, prep: _Prepared, *, out: Any, beta: float, **operands: Any) -> None: ...

        def _replan(self, prep: _Prepared, exc: BaseException, failures: Sequence[MicroConfig] = ()) -> _Prepared: ...

    def _run_kernels(self, prep: _Prepared, **operands: Any) -> None:
        workspace = self._workspace(prep)
        listener = self.workspace_listener
        if listener is None:
            prep.kernels.run(workspace=workspace, **operands)
            return
        # a memory tracker hears of the run: the workspace taken for this run only (a budget's; any on a per-run
        # backend; torch's own convolution takes none from us: `_workspace`), the array the run writes and those
        # it reads (an operator's result, and its operands' copies into the kernel's layout, are allocated where
        # the tracker's dispatch does not see them)
        held = (
            prep.config.workspace
            if (prep.budget is not None or self._backend.workspace_per_run) and not native_only(prep.config)
            else 0
        )
        listener(held, operands["out"], tuple(operands[k] for k in ("x", "w", "dy") if operands.get(k) is not None))
        try:
            prep.kernels.run(workspace=workspace, **operands)
        finally:
            listener(-held, None)

    def _run(
        self, prep: _Prepared, *, x: Any = None, w: Any = None, dy: Any = None, out: Any, alpha: float, beta: float
    ) -> None:
        trial = prep.trial
        if trial is not None and trial.open:
            self._run_trial(prep, trial, x=x, w=w, dy=dy, out=out, alpha=alpha, beta=beta)
            return
        if not prep.kernels.checked:  # its first run: a configuration that cannot run is re-planned
            self._run_first(prep, x=x, w=w, dy=dy, out=out, alpha=alpha, beta=beta)
            return
        try:
            self._run_kernels(prep, x=x, w=w, dy=dy, out=out, alpha=alpha, beta=beta)
        except self._candidate_failures() as exc:
            if beta != 0:  # out already holds part of the blend: no way back to the caller's values
                raise
            self._run_first(self._replan(prep, exc), x=x, w=w, dy=dy, out=out, alpha=alpha, beta=beta)
