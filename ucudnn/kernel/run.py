"""Running a configuration: the mini-batch as a sequence of micro-batches, one algorithm each.

`PreparedConfiguration` does once what depends only on the problem and the configuration (the
problem of each micro-batch, its rows, and the backend's launcher with its built plan or
workspace layout); its `run` then only launches. `run_configuration` is the
one-shot form.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ucudnn.backends.base import Backend
from ucudnn.errors import InvalidInput
from ucudnn.problem import ConvProblem
from ucudnn.solver.types import Configuration

__all__ = ["PreparedConfiguration", "run_configuration"]


class PreparedConfiguration:
    """A configuration ready to run again and again on operands of one shape, dtype and layout.

    The first `run` goes through `Backend.run`, which checks every operand; later runs call the
    backend's prepared launchers (`Backend.prepare_run`) directly. The caller guarantees that
    later operands match the first ones (the Handle keys its prepared kernels by shape and dtype
    and makes operands contiguous); nothing is re-derived per call.
    """

    __slots__ = ("_checked", "_launches", "_steps", "backend", "configuration", "problem")

    def __init__(self, backend: Backend, problem: ConvProblem, configuration: Configuration) -> None:
        if configuration.batch != problem.n:
            raise InvalidInput(f"configuration covers batch {configuration.batch}, problem has n={problem.n}")
        self.backend, self.problem, self.configuration = backend, problem, configuration
        steps, start = [], 0
        for micro in configuration.micros:
            part = problem if micro.batch == problem.n else problem.with_batch(micro.batch)
            steps.append((part, micro.algo, slice(start, start + micro.batch)))
            start += micro.batch
        self._steps: tuple[tuple[ConvProblem, str, slice], ...] = tuple(steps)
        self._launches: tuple[Callable, ...] = ()  # built after the checked first run
        self._checked = False

    @property
    def checked(self) -> bool:
        """Whether a first, checked run has completed (later runs only launch)."""
        return self._checked

    def run(
        self,
        *,
        x: Any = None,
        w: Any = None,
        dy: Any = None,
        out: Any,
        alpha: float = 1.0,
        beta: float = 0.0,
        workspace: Any = None,
    ) -> None:
        """out = alpha * conv(...) + beta * out, micro-batch by micro-batch.

        fwd and bwd_data write disjoint slices of `out`. bwd_filter sums the micro-batch gradients
        into `out`: the first micro-batch applies the caller's `beta`, the later ones add (beta = 1),
        so out = alpha * sum_i dW_i + beta * out. All micro-batches share one workspace buffer
        (`workspace`, or a new one of `configuration.workspace` bytes).
        """
        if workspace is None:
            workspace = self.backend.empty_workspace(self.configuration.workspace)
        kind = self.problem.kind
        if not self._checked:
            run = self.backend.run
            for i, (part, algo, rows) in enumerate(self._steps):
                if kind == "fwd":
                    run(part, algo, x=x[rows], w=w, out=out[rows], workspace=workspace, alpha=alpha, beta=beta)
                elif kind == "bwd_data":
                    run(part, algo, dy=dy[rows], w=w, out=out[rows], workspace=workspace, alpha=alpha, beta=beta)
                else:
                    run(
                        part,
                        algo,
                        x=x[rows],
                        dy=dy[rows],
                        out=out,
                        workspace=workspace,
                        alpha=alpha,
                        beta=beta if i == 0 else 1.0,
                    )
            self._launches = tuple(self.backend.prepare_run(part, algo) for part, algo, _ in self._steps)
            self._checked = True
            return
        alpha, beta = float(alpha), float(beta)
        if len(self._steps) == 1:  # undivided: no slicing at all
            self._launches[0](x, w, dy, out, workspace, alpha, beta)
            return
        for i, ((_, _, rows), launch) in enumerate(zip(self._steps, self._launches)):
            if kind == "fwd":
                launch(x[rows], w, None, out[rows], workspace, alpha, beta)
            elif kind == "bwd_data":
                launch(None, w, dy[rows], out[rows], workspace, alpha, beta)
            else:
                launch(x[rows], None, dy[rows], out, workspace, alpha, beta if i == 0 else 1.0)


def run_configuration(
    backend: Backend,
    problem: ConvProblem,
    configuration: Configuration,
    *,
    x: Any = None,
    w: Any = None,
    dy: Any = None,
    out: Any,
    alpha: float = 1.0,
    beta: float = 0.0,
    workspace: Any = None,
) -> None:
    """out = alpha * conv(...) + beta * out, computed micro-batch by micro-batch, every operand
    checked (see `PreparedConfiguration.run`)."""
    PreparedConfiguration(backend, problem, configuration).run(
        x=x, w=w, dy=dy, out=out, alpha=alpha, beta=beta, workspace=workspace
    )
