"""run_configuration on the cpu backend: micro-batched runs equal the undivided run and the reference."""

from __future__ import annotations

import numpy as np
import pytest
from conv_reference import assert_close, reference
from ucudnn.solver.types import Configuration, MicroConfig

from ucudnn.backends.cpu import ALGORITHMS, CpuBackend
from ucudnn.errors import InvalidInput
from ucudnn.kernel.run import run_configuration
from ucudnn.problem import KINDS, ConvProblem

BACKEND = CpuBackend()
ALL_ALGOS = BACKEND.algorithms(ConvProblem())
SPLIT = (3, 2, 1, 1)  # uneven micro-batches summing to n


def problem_for(kind: str) -> ConvProblem:
    return ConvProblem.parse("n=7,c=4,h=9,w=8,k=6,r=3,s=3,pad=1,groups=2").with_kind(kind)


def mixed_configuration(problem: ConvProblem, algo: str) -> Configuration:
    """`algo` on the first and third micro-batches, the other algorithms in turn on the rest."""
    others = [a for a in ALL_ALGOS if a != algo and BACKEND.unsupported_reason(problem, a) is None]
    micros = []
    for i, batch in enumerate(SPLIT):
        name = algo if i % 2 == 0 else others[(i // 2) % len(others)]
        part = problem.with_batch(batch)
        micros.append(MicroConfig(name, batch, 1.0, BACKEND.workspace_size(part, name)))
    return Configuration(tuple(micros))


def inputs_of(ops: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {name: ops[name] for name in ("x", "w", "dy") if name in ops}


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("algo", ALL_ALGOS)
def test_mixed_configuration_equals_undivided_run(algo: str, kind: str) -> None:
    problem = problem_for(kind)
    assert sum(SPLIT) == problem.n
    ops = BACKEND.random_operands(problem, seed=21)
    configuration = mixed_configuration(problem, algo)
    assert configuration.batch == problem.n
    out = np.full(problem.out_shape, np.nan, np.float32)
    run_configuration(BACKEND, problem, configuration, out=out, **inputs_of(ops))

    whole = np.full(problem.out_shape, np.nan, np.float32)
    BACKEND.run(
        problem,
        algo,
        workspace=BACKEND.empty_workspace(BACKEND.workspace_size(problem, algo)),
        out=whole,
        **inputs_of(ops),
    )
    expected = reference(problem, **inputs_of(ops))
    assert_close(whole, expected, "float32", f"undivided {algo} {kind}")
    assert_close(out, expected, "float32", f"{configuration.describe()} {kind}")
    assert_close(out, whole, "float32", f"{configuration.describe()} vs undivided {algo}")


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("algo", ALGORITHMS)
def test_alpha_beta_through_configuration(algo: str, kind: str) -> None:
    """out = alpha * conv + beta * out; bwd_filter sums the micro-batch gradients into out."""
    problem = problem_for(kind)
    ops = BACKEND.random_operands(problem, seed=22)
    before = np.random.default_rng(23).standard_normal(problem.out_shape, dtype=np.float32)
    out = before.copy()
    configuration = Configuration(
        tuple(MicroConfig(algo, b, 1.0, BACKEND.workspace_size(problem.with_batch(b), algo)) for b in SPLIT)
    )
    workspace = BACKEND.empty_workspace(configuration.workspace)
    workspace.fill(0xFF)  # shared by every micro-batch; NaN garbage must never be read
    run_configuration(
        BACKEND, problem, configuration, out=out, alpha=0.5, beta=2.0, workspace=workspace, **inputs_of(ops)
    )
    expected = 0.5 * reference(problem, **inputs_of(ops)) + 2.0 * before
    assert_close(out, expected, "float32", f"{configuration.describe()} {kind} alpha=0.5 beta=2")


def test_configuration_must_cover_the_batch() -> None:
    problem = problem_for("fwd")
    ops = BACKEND.random_operands(problem)
    short = Configuration((MicroConfig("im2col_gemm", 2, 1.0, 0),))
    with pytest.raises(InvalidInput, match="batch"):
        run_configuration(BACKEND, problem, short, **ops)
