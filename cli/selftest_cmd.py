"""`ucudnn selftest`: the correctness suite on whatever backend is available."""

from __future__ import annotations

import json

import click

from ucudnn.backends import BACKENDS
from ucudnn.errors import UnsupportedProblem
from ucudnn.problem import DTYPES


@click.command()
@click.option(
    "--backend",
    "backend_name",
    default="auto",
    show_default=True,
    type=click.Choice(BACKENDS),
    help="Backend to check; cudnn without a usable GPU exits 2 saying what is missing.",
)
@click.option(
    "--dtype", default="float32", show_default=True, type=click.Choice(DTYPES), help="Data type of every problem."
)
@click.option(
    "--layer",
    "layer_specs",
    multiple=True,
    metavar="SPEC",
    help="Check these layers instead of the built-in problems (repeatable).",
)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of a table.")
def selftest(backend_name, dtype, layer_specs, as_json):
    """Run every kind and every algorithm, undivided and micro-batched, against a float64 reference.

    Prints a pass/fail table (algorithm x kind, worst relative error); exits 0 when every check
    passes, 1 when any fails, and 2 when the backend supports none of them (e.g. a dtype it lacks). An
    algorithm that gives a wrong result which the measurement's own verification also rejects is listed
    as excluded (ucudnn never chooses it) and does not fail.
    """
    from ucudnn.backends import get_backend
    from ucudnn.kernel.selftest import DEFAULT_PROBLEMS, SelftestFailed, run_selftest
    from ucudnn.problem import ConvProblem

    problems = [ConvProblem.parse(spec, unused={"kind": "selftest checks every kind"}) for spec in layer_specs] or list(
        DEFAULT_PROBLEMS
    )
    backend = get_backend(backend_name)
    report = run_selftest(backend, problems=problems, dtype=dtype)
    click.echo(json.dumps(report.to_json(), indent=2) if as_json else report.format())
    if report.count("pass") + report.count("fail") == 0:
        raise UnsupportedProblem(
            f"selftest: backend {report.backend} runs none of the {len(report.checks)} "
            f"checks at {dtype}; every one is skipped (the reasons are listed above)"
        )
    if not report.passed:
        raise SelftestFailed(
            f"selftest: {report.count('fail')} of {len(report.checks)} checks failed on backend {report.backend}"
        )
