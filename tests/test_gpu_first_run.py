"""benchmarks/gpu/first_run.py, the command a GPU session runs first: what runs without a GPU."""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu" / "first_run.py"


@pytest.fixture(scope="module")
def first_run():
    spec = importlib.util.spec_from_file_location("first_run", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_without_a_gpu_it_says_what_is_missing_in_one_line(tmp_path, first_run):
    if first_run.missing_gpu() is None:
        pytest.skip("a GPU is here: the command would run")
    done = subprocess.run(
        [sys.executable, str(SCRIPT), str(tmp_path)], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.startswith("first_run: needs a CUDA GPU") and done.stderr.count("\n") == 1


def test_every_part_runs_in_its_own_process_with_a_limit(tmp_path, first_run):
    args = first_run.parse_args([str(tmp_path)])
    names = [name for name, _, _ in first_run.parts(args)]
    assert names == ["selftest", "pytest", "bench", "convert", "compiled", "planned"]
    assert set(names) == set(first_run.LIMITS_S) and sum(first_run.LIMITS_S.values()) <= 30 * 60


def test_the_run_keeps_within_its_budget_and_says_which_parts_it_left(tmp_path, first_run, capsys):
    # the parts' own limits add up to more than a lent GPU's command may run: with no budget left, none starts
    assert sum(first_run.LIMITS_S.values()) > first_run.parse_args([str(tmp_path)]).budget
    assert first_run.run_parts(first_run.parse_args([str(tmp_path), "--budget", "30"])) == 1
    parts = json.loads((tmp_path / "first_run.json").read_text())["parts"]
    assert list(parts) == list(first_run.LIMITS_S)
    assert all(
        p == {"ok": False, "seconds": 0, "exit": None, "summary": "not run: budget spent"} for p in parts.values()
    )
    assert capsys.readouterr().out.count("SKIP not run") == len(parts)
    # a second command runs the parts the first had no time for
    assert (
        first_run.run_parts(first_run.parse_args([str(tmp_path), "--budget", "30", "--only", "convert,planned"])) == 1
    )
    assert list(json.loads((tmp_path / "first_run.json").read_text())["parts"]) == ["convert", "planned"]
    assert first_run.main([str(tmp_path), "--only", "convert,nope"]) == 2


def test_summaries_read_what_each_part_prints(first_run):
    ok, text, _ = first_run.selftest_summary(
        json.dumps(
            {"passed": True, "summary": {"passed": 612, "failed": 0, "excluded": 3, "skipped": 0, "seconds": 9.0}}
        )
    )
    assert ok and text == "612 passed, 0 failed, 3 excluded, 0 skipped"
    ok, text, figure = first_run.pytest_summary(
        "..F\nFAILED tests/test_gpu.py::test_micro_batched_matches_undivided - assert\n1 failed, 19 passed in 80.0s\n"
    )
    assert not ok and figure["counts"] == {"failed": 1, "passed": 19}
    assert text == "1 failed, 19 passed: tests/test_gpu.py::test_micro_batched_matches_undivided"
    assert first_run.pytest_summary("20 passed, 2 deselected in 80.0s")[0]
    assert not first_run.pytest_summary("no tests ran in 0.1s")[0]
    ok, text, _ = first_run.bench_summary(
        json.dumps({"total": {"baseline_ms": 36.65, "time_ms": 15.29, "speedup": 2.4}})
    )
    assert ok and text == "36.65 -> 15.29 ms, 2.40x"


def test_the_planned_step_runs_on_cpu_tensors_and_trains_like_plain(tmp_path, first_run):
    # The step code a GPU runs, on the CPU: the plan executes and its loss equals plain PyTorch's.
    pytest.importorskip("transformers")
    figure = first_run.training_step("planned", "hf-mobilenet-v2", 2, 32, "cpu", f"sqlite:///{tmp_path}/c.db", reps=1)
    ok, text, _ = first_run.step_summary(json.dumps(figure))
    assert ok, text
    assert figure["loss_diff"] == 0.0 and figure["predicted_peak_mib"] > 0 and math.isfinite(figure["ms"])
    assert text.startswith("hf-mobilenet-v2 b2: ")


def test_the_converted_step_runs_channels_last_on_cpu_tensors_and_computes_plains_loss(tmp_path, first_run):
    # `--channels-last`: model and input in the layout Inductor gives plain PyTorch's compiled convolutions
    pytest.importorskip("transformers")
    figure = first_run.training_step(
        "convert", "hf-mobilenet-v2", 2, 32, "cpu", f"sqlite:///{tmp_path}/c.db", reps=1, channels_last=True
    )
    ok, text, _ = first_run.step_summary(json.dumps(figure))
    assert ok, text
    assert text.startswith("hf-mobilenet-v2 channels-last b2: ") and math.isfinite(figure["ms"])
    assert first_run.parse_args(["out", "--channels-last", "--only", "convert,compiled"]).channels_last


def test_the_compiled_steps_summary_carries_what_issue_36_targets(first_run):
    # converted ResNet-50 under torch.compile(mode="reduce-overhead") against plain compiled the same way:
    # the speed ratio (target: at most 1.0x plain's time), the peak against plain's, the first step
    figure = {
        "model": "hf-resnet50",
        "batch": 64,
        "size": 224,
        "device": "cuda",
        "ms": 30.0,
        "plain_ms": 31.5,
        "peak_mib": 5200.0,
        "plain_peak_mib": 5400.0,
        "first_step_s": 95.2,
        "loss_diff": 1e-3,
        "loss_tolerance": 6.9e-2,
        "compile": {"mode": "reduce-overhead"},
    }
    ok, text, _ = first_run.step_summary(json.dumps(figure))
    assert ok and text == (
        "hf-resnet50 b64: 30.0 ms vs plain 31.5 ms (0.95x), peak 5200 vs 5400 MiB, first step 95.2 s"
    )
    assert not first_run.step_summary(json.dumps({**figure, "loss_diff": 0.1}))[0]


@pytest.mark.slow
def test_the_compiled_step_runs_on_cpu_tensors_and_computes_plains_loss(tmp_path, first_run):
    # The compiled part's step code on the CPU (aot_eager: CUDA graphs need a GPU), about 35 s on 2 cores.
    pytest.importorskip("transformers")
    figure = first_run.training_step("compiled", "hf-mobilenet-v2", 2, 32, "cpu", f"sqlite:///{tmp_path}/c.db", reps=1)
    ok, text, _ = first_run.step_summary(json.dumps(figure))
    assert ok, text
    assert figure["compile"] == {"backend": "aot_eager"}  # ok above: the loss within 1% of plain's
    assert math.isfinite(figure["ms"]) and figure["ours_first_step_s"] > 0
