"""The pure parts of benchmarks/gpu/run_all.py (the GPU figures script): it imports without a GPU."""

from __future__ import annotations

import dataclasses
import importlib.util
import math
from pathlib import Path
from types import SimpleNamespace

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu" / "run_all.py"


@pytest.fixture(scope="module")
def run_all():
    spec = importlib.util.spec_from_file_location("run_all", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # no CuPy, no GPU: the GPU imports live inside functions
    return module


def test_arguments(run_all, tmp_path):
    args = run_all.parse_args([str(tmp_path), "--quick"])
    assert args.out_dir == tmp_path and args.quick and args.db == "sqlite://" and args.reps == 3


def test_deepbench_forward_kernels_are_the_training_set_at_four_times_its_batch(run_all):
    from ucudnn.network.zoo import layers

    own = layers("deepbench")
    half = run_all.deepbench_forward_kernels("float16")
    assert len(half) == len(own) == 94
    for (name, problem), layer in zip(half, own, strict=True):
        assert name == layer.name and problem.kind == "fwd" and problem.dtype == "float16"
        assert problem.n == 4 * layer.problem.n
        assert dataclasses.replace(problem, n=layer.problem.n, dtype=layer.problem.dtype) == layer.problem.with_kind(
            "fwd"
        )
    assert len(run_all.deepbench_forward_kernels("float32", limit=8)) == 8


def test_figure_summaries(run_all):
    assert run_all.speedup_summary([1.0, 3.0, math.inf]) == {
        "kernels": 3,
        "with_baseline": 2,
        "mean_speedup": 2.0,
        "max_speedup": 3.0,
    }
    assert run_all.speedup_summary([math.inf])["mean_speedup"] is None
    near = run_all.prediction_figure(20.0, 20.8)
    assert near["within_5_percent"] and near["executed_over_predicted"] == 1.04
    assert not run_all.prediction_figure(49.6, 40.7)["within_5_percent"]  # the H100 figure before issue 9
    checks = [
        SimpleNamespace(status="pass", kind="fwd", algo="eng0", problem="p", reason=""),
        SimpleNamespace(
            status="excluded", kind="bwd_filter", algo="eng70", problem="q", reason="wrong result (rel. error 1.54)"
        ),
    ]
    report = SimpleNamespace(
        checks=checks, passed=True, seconds=1.0, count=lambda status: sum(c.status == status for c in checks)
    )
    figure = run_all.selftest_figure(report)
    assert (
        figure["passed"]
        and figure["pass"] == 1
        and figure["excluded"] == ["bwd_filter eng70 on q: wrong result (rel. error 1.54)"]
    )
