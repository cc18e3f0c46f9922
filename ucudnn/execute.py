"""Running a configuration: the mini-batch as a sequence of micro-batches, one algorithm each."""

from __future__ import annotations

from typing import Any

from ucudnn.backends.base import Backend
from ucudnn.errors import InvalidInput
from ucudnn.problem import ConvProblem
from ucudnn.solver.types import Configuration


def run_configuration(backend: Backend, problem: ConvProblem, configuration: Configuration, *,
                      x: Any = None, w: Any = None, dy: Any = None, out: Any,
                      alpha: float = 1.0, beta: float = 0.0, workspace: Any = None) -> None:
    """out = alpha * conv(...) + beta * out, computed micro-batch by micro-batch.

    fwd and bwd_data write disjoint slices of `out`. bwd_filter sums the micro-batch gradients
    into `out`: the first micro-batch applies the caller's `beta`, the later ones add (beta = 1),
    so out = alpha * sum_i dW_i + beta * out. All micro-batches share one workspace buffer
    (`workspace`, or a new one of `configuration.workspace` bytes).
    """
    if configuration.batch != problem.n:
        raise InvalidInput(f"configuration covers batch {configuration.batch}, problem has n={problem.n}")
    if workspace is None:
        workspace = backend.empty_workspace(configuration.workspace)
    start = 0
    for i, micro in enumerate(configuration.micros):
        part = problem.with_batch(micro.batch)
        rows = slice(start, start + micro.batch)
        start += micro.batch
        if problem.kind == "fwd":
            backend.run(part, micro.algo, x=x[rows], w=w, out=out[rows], workspace=workspace, alpha=alpha, beta=beta)
        elif problem.kind == "bwd_data":
            backend.run(part, micro.algo, dy=dy[rows], w=w, out=out[rows], workspace=workspace, alpha=alpha, beta=beta)
        else:
            backend.run(part, micro.algo, x=x[rows], dy=dy[rows], out=out, workspace=workspace,
                        alpha=alpha, beta=beta if i == 0 else 1.0)
