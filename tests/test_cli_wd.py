"""`ucudnn bench` in WD mode: one total budget divided among kernels, the plot, and the network zoo."""

import json

import pytest
from ucudnn.cli.main import main

LAYERS = ["n=4,c=8,h=12,w=12,k=16,r=3,s=3,pad=1", "n=4,c=16,h=12,w=12,k=16,r=5,s=5,pad=2"]


def bench(tmp_path, capsys, *argv):
    code = main(["bench", "--backend", "cpu", "--reps", "1", "--json", "--db", str(tmp_path / "c.db"), *argv])
    out, err = capsys.readouterr()
    assert code == 0, err
    return json.loads(out)


def test_wd_divides_one_total_among_kernels(tmp_path, capsys):
    # Every candidate timed at every size (--exhaustive): pruned, which ones the roomy run times would follow
    # who won each timing race there, and a smaller total that no longer holds a winner times its losers.
    layer_args = [arg for spec in LAYERS for arg in ("--layer", spec)] + ["--exhaustive"]
    roomy = bench(tmp_path, capsys, *layer_args, "--total-workspace", "64MiB")
    need = sorted(k["workspace"] for k in roomy["kernels"])
    # A total below what the roomy solution used forces WD to trade speed for workspace.
    total = sum(need) * 2 // 3
    report = bench(tmp_path, capsys, *layer_args, "--total-workspace", str(total))
    assert report["mode"] == "WD" and report["total_workspace"] == total and report["workspace_limit"] is None
    assert len(report["kernels"]) == 6
    assert sum(k["workspace"] for k in report["kernels"]) == report["total"]["workspace"] <= total
    for k in report["kernels"]:
        assert sum(m["batch"] for m in k["config"]) == 4
    assert report["total"]["time_ms"] >= roomy["total"]["time_ms"] * (1 - 1e-9)
    assert report["benchmark"]["measured"] == 0  # every size and algorithm was measured by the roomy run


def test_wd_plot_is_written(tmp_path, capsys):
    png = tmp_path / "wd.png"
    bench(tmp_path, capsys, "--layer", LAYERS[0], "--total-workspace", "4MiB", "--plot", str(png))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_network_wd_reports_every_kernel(tmp_path, capsys):
    report = bench(
        tmp_path,
        capsys,
        "--network",
        "alexnet",
        "--batch",
        "1",
        "--policy",
        "undivided",
        "--algos",
        "shift_gemm",
        "--total-workspace",
        "32MiB",
    )
    assert report["mode"] == "WD" and len(report["kernels"]) == 15
    assert [k["layer"] for k in report["kernels"][:3]] == ["conv1"] * 3
    assert report["total"]["workspace"] <= 32 * 2**20


def test_an_impossible_total_fails_with_exit_1(tmp_path, capsys):
    code = main(
        [
            "bench",
            "--backend",
            "cpu",
            "--reps",
            "1",
            "--db",
            str(tmp_path / "c.db"),
            "--layer",
            LAYERS[0],
            "--algos",
            "im2col_gemm",
            "--total-workspace",
            "16",
        ]
    )
    _, err = capsys.readouterr()
    assert code == 1 and err.count("\n") == 1


@pytest.mark.parametrize("argv", [["--plot", "x.png", "--workspace", "1MiB"], ["--network", "lenet"]])
def test_wd_usage_errors_exit_2(argv, tmp_path, capsys):
    code = main(
        [
            "bench",
            "--backend",
            "cpu",
            "--db",
            str(tmp_path / "c.db"),
            *(["--layer", LAYERS[0]] if "--network" not in argv else []),
            *argv,
        ]
    )
    _, err = capsys.readouterr()
    assert code == 2 and err.count("\n") == 1
