"""`ucudnn bench` end to end on the CPU backend: the DESIGN JSON, the cache, and exit codes."""

import json
import subprocess
import sys

import pytest
from ucudnn.cli.main import main

LAYER = "n=8,c=8,h=12,w=12,k=16,r=3,s=3,pad=1"


def expand(text):
    """`2x4:fft + 1x8:native` as the micro-batches it stands for: [(fft, 4), (fft, 4), (native, 8)]."""
    out = []
    for group in text.split(" + "):
        count, rest = group.split("x", 1)
        size, algo = rest.split(":", 1)
        out += [(algo, int(size))] * int(count)
    return out


def run(argv, capsys):
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def bench_json(tmp_path, capsys, *extra):
    code, out, err = run(
        [
            "bench",
            "--layer",
            LAYER,
            "--backend",
            "cpu",
            "--reps",
            "1",
            "--json",
            "--db",
            str(tmp_path / "cache.db"),
            *extra,
        ],
        capsys,
    )
    assert code == 0, err
    return json.loads(out)


def test_json_follows_the_contract_and_the_second_run_measures_nothing(tmp_path, capsys):
    limit = 64 * 1024
    first = bench_json(tmp_path, capsys, "--workspace", "64KiB", "--policy", "powerOfTwo")
    assert set(first) == {
        "device",
        "backend",
        "policy",
        "mode",
        "workspace_limit",
        "total_workspace",
        "batch",
        "kernels",
        "total",
        "benchmark",
        "warnings",
        "noisy",
        "legend",
        "conditions",  # issue 54: what the speedup rests on (docs/json.md)
    }
    assert first["warnings"]["noisy_timings"] == len(first["noisy"]) and first["warnings"]["wrong_results"] == 0
    assert (first["backend"], first["policy"], first["mode"]) == ("cpu", "powerOfTwo", "WR")
    assert (first["workspace_limit"], first["total_workspace"], first["batch"]) == (limit, None, 8)
    assert [k["kind"] for k in first["kernels"]] == ["fwd", "bwd_data", "bwd_filter"]
    for k in first["kernels"]:
        assert set(k) == {
            "layer",
            "kind",
            "problem",
            "baseline",
            "config",
            "time_ms",
            "workspace",
            "speedup",
            "batch",
            "excluded",
            "configuration",
            "doubtful",
            "unsupported",
            "pruned",
        }
        assert k["layer"] == "layer1" and k["baseline"]["chosen_by"] == "fastest within the limit"
        assert k["unsupported"] == []  # a 2-D 3x3 stride-1 layer: every cpu algorithm runs it
        assert expand(k["configuration"]) == [(m["algo"], m["batch"]) for m in k["config"]]
        assert k["batch"] == 8 and k["excluded"] == []
        assert sum(m["batch"] for m in k["config"]) == 8
        assert all(m["workspace"] <= limit for m in k["config"])
        assert k["workspace"] == max(m["workspace"] for m in k["config"])
        assert k["time_ms"] == pytest.approx(sum(m["time_ms"] for m in k["config"]))
        assert k["baseline"]["workspace"] <= limit
        # The undivided baseline is one of WR's candidates, so WR is never slower.
        assert k["time_ms"] <= k["baseline"]["time_ms"] * (1 + 1e-9)
        assert k["speedup"] == pytest.approx(k["baseline"]["time_ms"] / k["time_ms"])
    total = first["total"]
    assert total["time_ms"] == pytest.approx(sum(k["time_ms"] for k in first["kernels"]))
    assert total["baseline_ms"] == pytest.approx(sum(k["baseline"]["time_ms"] for k in first["kernels"]))
    assert total["workspace"] == max(k["workspace"] for k in first["kernels"])
    assert total["baseline_workspace"] == max(k["baseline"]["workspace"] for k in first["kernels"])
    bench = first["benchmark"]
    assert bench["measured"] > 0 and bench["cached"] == 0
    # Every candidate the progress bar counts is measured, cached, over the limit or pruned.
    assert (
        bench["candidates"]
        == (bench["measured"] + bench["cached"] + bench["over_limit"] + bench["pruned"])
        > bench["measured"]
    )
    assert bench["pruned"] == sum(len(k["pruned"]) for k in first["kernels"])

    second = bench_json(tmp_path, capsys, "--workspace", "64KiB", "--policy", "powerOfTwo")
    assert second["benchmark"]["measured"] == 0 and second["benchmark"]["remeasured"] == 0
    assert second["benchmark"]["cached"] == first["benchmark"]["measured"]
    assert second["warnings"]["noisy_measured_now"] == 0 and second["warnings"]["advice"] == ""
    assert second["kernels"] == first["kernels"]
    assert second["noisy"] == first["noisy"]  # the spread is cached with the time


def test_algos_restricts_the_candidates_and_policy_lists_sizes(tmp_path, capsys):
    report = bench_json(tmp_path, capsys, "--algos", "shift_gemm,im2col_gemm", "--policy", "2,8", "--kinds", "fwd")
    assert [k["kind"] for k in report["kernels"]] == ["fwd"]
    assert report["policy"] == "2,8"
    for m in report["kernels"][0]["config"]:
        assert m["algo"] in {"shift_gemm", "im2col_gemm"} and m["batch"] in (2, 8)


def test_table_is_the_default_output(tmp_path, capsys):
    code, out, err = run(
        [
            "bench",
            "--layer",
            LAYER,
            "--backend",
            "cpu",
            "--reps",
            "1",
            "--kinds",
            "fwd",
            "--policy",
            "undivided",
            "--db",
            str(tmp_path / "c.db"),
        ],
        capsys,
    )
    assert code == 0, err
    assert "baseline" in out and "speedup" in out and "total" in out
    assert "benchmark: " in out


def test_a_limit_nothing_fits_fails_with_exit_1(tmp_path, capsys):
    code, _out, err = run(
        [
            "bench",
            "--layer",
            LAYER,
            "--backend",
            "cpu",
            "--reps",
            "1",
            "--kinds",
            "fwd",
            "--algos",
            "im2col_gemm",
            "--workspace",
            "1",
            "--db",
            str(tmp_path / "c.db"),
        ],
        capsys,
    )
    assert code == 1
    assert err.count("\n") == 1 and "Traceback" not in err


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--layer", "n=8,c=8,h=12"], "missing"),
        (["--layer", "nonsense"], "key=value"),
        (["--layer", LAYER, "--workspace", "-5MiB"], "size"),
        (["--layer", LAYER, "--workspace", "lots"], "size"),
        (["--layer", LAYER, "--policy", "sometimes"], "unknown policy"),
        (["--layer", LAYER, "--backend", "tpu"], "tpu"),
        (["--layer", LAYER, "--batch", "0"], "batch"),
        (["--layer", LAYER, "--kinds", "sideways"], "unknown kind"),
        (["--layer", LAYER, "--algos", "magic", "--backend", "cpu"], "unknown algorithm"),
        (["--layer", LAYER, "--workspace", "1MiB", "--total-workspace", "2MiB"], "not both"),
        ([], "--layer"),
        (["--layer", LAYER + ",output_padding=1"], "transposed convolutions only"),
        (["--layer", LAYER + ",t=3"], "give d (the input depth)"),
        (["--layer", LAYER + ",transposed=1,output_padding=1"], "smaller than stride_h (1)"),
        (["--layer", LAYER + ",d=0"], "d must be positive"),
        (["--layer", LAYER + ",transposed=2"], "transposed must be 0 or 1"),
    ],
)
def test_bad_input_exits_2_with_one_line(argv, words, tmp_path, capsys):
    code, _out, err = run(["bench", *argv, "--db", str(tmp_path / "c.db")], capsys)
    assert code == 2
    assert err.count("\n") == 1, err
    assert words in err and "Traceback" not in err


def test_the_installed_command_reports_bad_input_without_traceback():
    proc = subprocess.run(
        [sys.executable, "-m", "ucudnn.cli.main", "bench", "--layer", "c=1"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 2
    assert proc.stderr.startswith("ucudnn: ") and "Traceback" not in proc.stderr


def test_an_exported_cache_imported_elsewhere_serves_a_rerun(tmp_path, capsys):
    first = bench_json(tmp_path, capsys, "--kinds", "fwd,bwd_filter")
    assert first["benchmark"]["measured"] > 0
    export = tmp_path / "cache.jsonl"
    assert run(["db", "export", "--db", str(tmp_path / "cache.db"), str(export)], capsys)[0] == 0
    other = tmp_path / "other.db"
    assert run(["db", "import", "--db", str(other), str(export)], capsys)[0] == 0
    code, out, err = run(
        [
            "bench",
            "--layer",
            LAYER,
            "--backend",
            "cpu",
            "--reps",
            "1",
            "--json",
            "--kinds",
            "fwd,bwd_filter",
            "--db",
            str(other),
        ],
        capsys,
    )
    assert code == 0, err
    again = json.loads(out)
    assert again["benchmark"]["measured"] == 0
    assert again["kernels"] == first["kernels"]


def test_wr_accepts_layers_with_different_batch_sizes(tmp_path, capsys):
    # DeepBench-style: every kernel at its own batch, each standing alone in WR.
    small = "n=2,c=4,h=8,w=8,k=4,r=3,s=3,pad=1"
    report = bench_json(
        tmp_path, capsys, "--layer", small, "--workspace", "1MiB", "--policy", "undivided", "--kinds", "fwd"
    )
    assert report["batch"] is None
    assert [(k["layer"], k["batch"]) for k in report["kernels"]] == [("layer1", 8), ("layer2", 2)]
    assert [sum(m["batch"] for m in k["config"]) for k in report["kernels"]] == [8, 2]
    # Same shape at two batch sizes: two tables, not one.
    same = bench_json(
        tmp_path, capsys, "--layer", LAYER.replace("n=8", "n=4"), "--policy", "undivided", "--kinds", "fwd"
    )
    assert [k["config"][0]["batch"] for k in same["kernels"]] == [8, 4]
    code, _, err = run(
        [
            "bench",
            "--layer",
            LAYER,
            "--layer",
            small,
            "--total-workspace",
            "1MiB",
            "--backend",
            "cpu",
            "--db",
            str(tmp_path / "cache.db"),
        ],
        capsys,
    )
    assert code == 2 and "give --batch" in err


def test_stderr_has_no_per_measurement_lines_and_verbose_lists_noisy_timings(tmp_path, capsys, monkeypatch):
    from ucudnn.backends import base

    # Every timing counts as noisy, so the summary and the details must show up.
    monkeypatch.setattr(base, "NOISY_SPREAD_FRACTION", -1.0)
    argv = [
        "bench",
        "--layer",
        LAYER,
        "--backend",
        "cpu",
        "--reps",
        "2",
        "--policy",
        "undivided",
        "--kinds",
        "fwd",
        "--db",
        str(tmp_path / "cache.db"),
        "--quiet",
    ]
    code, out, err = run(argv, capsys)
    assert code == 0 and err == ""
    (summary,) = [line for line in out.splitlines() if line.startswith("note: ")]
    count = int(summary.split()[1])
    assert count > 0 and "raise --reps (now 2)" in summary and "measured again" in summary
    assert not any(line.startswith("noisy: ") for line in out.splitlines())
    code, out, err = run([*argv, "--verbose"], capsys)
    assert code == 0 and err == ""
    # Reported once: a run served from the cache does not repeat the note, --verbose still lists them.
    assert not any(line.startswith("note: ") for line in out.splitlines())
    assert sum(line.startswith("noisy: layer1 fwd ") for line in out.splitlines()) >= 1


def test_3d_and_transposed_layers_list_what_cannot_run_them(tmp_path, capsys):
    # A 3-D layer and a transposed 3-D up-convolution: winograd has no 3-D form, and says so in
    # the table (one `skipped:` line) and per kernel in the JSON; the rest measure and run.
    layers = ["n=2,c=4,d=6,h=6,w=6,k=4,t=3,r=3,s=3,pad=1", "n=2,c=4,d=3,h=3,w=3,k=4,t=2,r=2,s=2,transposed=1,stride=2"]
    argv = ["bench", "--backend", "cpu", "--reps", "1", "--db", str(tmp_path / "c.db")]
    for spec in layers:
        argv += ["--layer", spec]
    code, out, err = run([*argv, "--json"], capsys)
    assert code == 0, err
    report = json.loads(out)
    assert [k["problem"] for k in report["kernels"][::3]] == layers
    for k in report["kernels"]:
        assert [u["algo"] for u in k["unsupported"]] == ["winograd"] and "3-D" in k["unsupported"][0]["reason"]
        assert "winograd" not in k["configuration"] and k["baseline"] is not None
    assert report["warnings"]["unsupported"] == 6
    code, out, err = run(argv, capsys)
    assert code == 0 and report["benchmark"]["measured"] > 0
    skipped = [line for line in out.splitlines() if line.startswith("skipped:")]
    assert skipped == [
        (
            "skipped: winograd on 6 of 6 kernels, which it cannot run: winograd F(2x2,3x3) has no "
            "3-D form (its tiles and transforms are 2-D)"
        )
    ]
    assert "measured now" in out and ", 0 measured now" in out  # the second run is served by the cache
