"""What a newcomer meets in the first hour: baselines for every kernel, outliers measured again before
they become a ratio, sizes rounded down with a note and units read only as documented, spec keys refused
rather than ignored, messages that say where a device name was looked for, a headline that says what it
rests on, a `--help` that loads no command, and Ctrl-C ending in one line."""

import json
import math
import signal
import subprocess
import sys
from decimal import Decimal
from pathlib import Path

import pytest
from ucudnn.cli.main import main
from ucudnn.db import Cache

from ucudnn.backends.cpu import CpuBackend
from ucudnn.errors import InvalidInput
from ucudnn.network.optimize import BASELINE_FASTEST, BASELINE_LEAST_WORKSPACE, expand_kernels, optimize
from ucudnn.problem import ConvProblem
from ucudnn.sizes import exact_bytes, parse_size

LAYER = "n=8,c=8,h=12,w=12,k=16,r=3,s=3,pad=1"
FAST = ("--backend", "cpu", "--reps", "1", "--quiet", "--algos", "im2col_gemm,shift_gemm")
PROBLEM = ConvProblem.parse(LAYER)


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


# ---- sizes: a fraction of a byte is rounded down on the command line, and the note says so ----


def test_parse_size_rounds_down_only_when_asked():
    exact = Decimal("10.35") * 2**30
    assert parse_size("10.35GiB", round_down=True) == math.floor(exact) == 11113227878
    assert exact_bytes("10.35GiB") == exact and exact_bytes("64MiB") is None
    with pytest.raises(InvalidInput, match="not a whole number"):
        parse_size("10.35GiB")
    with pytest.raises(InvalidInput, match="not a whole number"):  # below one byte: a slip, not a size
        parse_size("0.5", round_down=True)


def test_plan_memory_with_a_fraction_of_a_byte_is_rounded_down_with_a_note(capsys):
    code, out, err = run(
        capsys,
        "plan",
        "--network",
        "alexnet",
        "--batch",
        "16",
        "--device",
        "k40",
        "--memory",
        "1.35GiB",
        "--policy",
        "vdnn-all",
        "--json",
    )
    assert code == 0, err
    assert json.loads(out)["memory_limit"] == math.floor(Decimal("1.35") * 2**30)
    assert err.count("\n") == 1 and err.startswith(
        "ucudnn: note: --memory 1.35GiB is 1449551462.4 bytes; rounded down to 1449551462 bytes"
    )


def test_bench_workspace_is_rounded_down_too(tmp_path, capsys):
    code, out, err = run(
        capsys,
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
        "--workspace",
        "64.1KiB",
        "--json",
        "--db",
        str(tmp_path / "c.db"),
    )
    assert code == 0, err
    assert json.loads(out)["workspace_limit"] == 65638  # 64.1 * 1024 = 65638.4
    assert "rounded down to 65638 bytes" in err


# ---- --layer keys the command would ignore are refused, naming the keys it takes ----


@pytest.mark.parametrize("command", [["bench", "--backend", "cpu"], ["selftest", "--backend", "cpu"]])
def test_a_layer_key_the_command_does_not_use_is_refused_in_one_line(command, tmp_path, capsys):
    code, out, err = run(capsys, *command, "--layer", LAYER + ",kind=bwd_data")
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and "Traceback" not in err
    assert "the key 'kind' is not used here" in err and "keys taken: n, c, h, w, k, r, s, pad," in err
    assert "kind" not in err.split("keys taken:")[1]


def test_an_unknown_layer_key_names_the_keys_taken(tmp_path, capsys):
    code, _, err = run(capsys, "bench", "--layer", LAYER + ",padding=1", "--db", str(tmp_path / "c.db"))
    assert code == 2 and err.count("\n") == 1
    assert "unknown key 'padding'; keys taken: n, c, h, w," in err and "dilation_w, groups" in err


def test_parse_keeps_kind_where_it_is_used():
    assert ConvProblem.parse(LAYER + ",kind=bwd_data").kind == "bwd_data"


# ---- baselines: one for every kernel, and the rule that chose it ----


def test_every_wd_kernel_has_a_baseline_even_when_nothing_fits_its_share(tmp_path):
    # shift_gemm needs 9,280 B on layer a and 55,360 B on layer b at every batch size: 200 KiB over
    # 6 kernels is a share of 34,133 B, which layer b's kernels cannot keep to undivided.
    kernels = expand_kernels([("a", PROBLEM), ("b", ConvProblem.parse("n=8,c=32,h=12,w=12,k=32,r=3,s=3,pad=1"))], 8)
    total = 200 * 2**10
    with Cache(str(tmp_path / "c.db")) as cache:
        report = optimize(
            CpuBackend(),
            kernels,
            policy="powerOfTwo",
            total_workspace=total,
            cache=cache,
            algos=["im2col_gemm", "shift_gemm"],
            reps=1,
        )
    share = total // len(kernels)
    for k in report.kernels:
        assert k.baseline is not None and k.baseline.batch == 8 and math.isfinite(k.baseline.time)
        if k.baseline.workspace > share:  # the fallback: the least workspace of every undivided candidate
            assert k.baseline_rule == BASELINE_LEAST_WORKSPACE
        else:
            assert k.baseline_rule == BASELINE_FASTEST
    assert any(k.baseline_rule == BASELINE_LEAST_WORKSPACE for k in report.kernels)
    data = report.to_json()
    assert math.isfinite(report.baseline_ms) and data["total"]["speedup"] is not None
    assert {k["baseline"]["chosen_by"] for k in data["kernels"]} <= {BASELINE_FASTEST, BASELINE_LEAST_WORKSPACE}
    assert "equal share" in data["legend"]["baseline"] and "least workspace" in data["legend"]["baseline"]
    assert data["benchmark"]["candidates"] == (
        data["benchmark"]["measured"] + data["benchmark"]["cached"] + data["benchmark"]["over_limit"]
    )


def test_a_wr_baseline_over_the_limit_is_measured_without_it(tmp_path):
    # im2col_gemm fits 60,000 B at batch 1 (50,752 B) but not undivided (405,568 B): the benchmark skips
    # it there, and the baseline, the least workspace undivided, is measured anyway.
    kernels = expand_kernels([("layer1", PROBLEM)], 8, ["fwd"])
    report = optimize(CpuBackend(), kernels, policy="powerOfTwo", workspace_limit=60000, algos=["im2col_gemm"], reps=1)
    (k,) = report.kernels
    assert k.baseline_rule == BASELINE_LEAST_WORKSPACE
    assert (k.baseline.algo, k.baseline.batch, k.baseline.workspace) == ("im2col_gemm", 8, 405568)
    assert math.isfinite(k.baseline.time) and k.config.workspace <= 60000
    s = report.stats
    assert s.candidates == 4 and (s.measured, s.over_limit) == (2, 2)  # sizes 1 and 8 ran; 2 and 4 did not


def test_the_table_explains_itself_and_prints_the_total_speedup(tmp_path, capsys):
    code, out, err = run(
        capsys,
        "bench",
        "--layer",
        LAYER,
        "--backend",
        "cpu",
        "--reps",
        "1",
        "--quiet",
        "--total-workspace",
        "64KiB",
        "--algos",
        "im2col_gemm,shift_gemm",
        "--db",
        str(tmp_path / "c.db"),
    )
    assert code == 0, err
    lines = out.splitlines()
    assert lines[1] == f"layer1: --layer {LAYER}"
    assert any(line.startswith("configuration: `") and "micro-batch" in line for line in lines)
    assert any(line.startswith("baseline: ") and "undivided" in line for line in lines)
    (headline,) = [line for line in lines if line.startswith("speedup: ")]
    assert headline.split()[1].endswith("x") and "in total" in headline
    (summary,) = [line for line in lines if line.startswith("benchmark: ")]
    counts = [int(word) for word in summary.replace(",", "").split() if word.isdigit()]
    assert counts[0] == sum(counts[1:4])  # candidates = measured + cached + not run


# ---- a time a ratio rests on is measured again when it looks like an outlier ----


class StallOnce(CpuBackend):
    """The first time each undivided kernel is measured, it is STALL times too slow (a busy machine). The
    kernels run and are verified; their timings are a steady 0.1 ms per sample, so that the stall, not the
    machine's own load, is what the measurements show."""

    STALL = 50.0

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.stalled: dict[tuple[str, str], float] = {}

    def time_run_ms(self, problem, algo, operands, workspace, reps, beta=0.0):
        return [0.1 * problem.n] * reps

    def measure(self, problem, algos, reps=3, *, accumulate=False):
        out = super().measure(problem, algos, reps, accumulate=accumulate)
        if problem.n != 8:
            return out
        slowed = []
        for m in out:
            key = (problem.kind, m.algo)
            if m.usable and key not in self.stalled:
                m = type(m)(m.algo, m.batch, m.time * self.STALL, m.workspace, reason=m.reason, spread=0.0)
                self.stalled[key] = m.time
            slowed.append(m)
        return slowed


def test_a_stalled_baseline_is_measured_again_before_it_becomes_a_ratio(tmp_path):
    backend = StallOnce()
    kernels = expand_kernels([("layer1", PROBLEM)], 8, ["fwd"])
    with Cache(str(tmp_path / "c.db")) as cache:
        report = optimize(backend, kernels, policy="powerOfTwo", cache=cache, algos=["im2col_gemm"], reps=1)
        (k,) = report.kernels
        stalled = backend.stalled["fwd", "im2col_gemm"]
        assert report.remeasured >= 1
        assert k.baseline.time < stalled / 5  # the second measurement, not the stall
        # The kept time went to the cache: a second run measures nothing and gives the same ratio.
        again = optimize(CpuBackend(), kernels, policy="powerOfTwo", cache=cache, algos=["im2col_gemm"], reps=1)
    assert again.stats.measured == 0 and again.remeasured == 0
    assert again.kernels[0].baseline == k.baseline


class StallOnceBeside(StallOnce):
    """StallOnce (5 times too slow) beside shift_gemm, a steady 100 times slower than im2col_gemm: it loses at
    every size, so the benchmark prunes it between the largest size and the smallest, saying by how much it
    lost there, against the stalled time."""

    STALL = 5.0

    def time_run_ms(self, problem, algo, operands, workspace, reps, beta=0.0):
        return [(10.0 if algo == "shift_gemm" else 0.1) * problem.n] * reps


def test_a_rerun_from_the_cache_prunes_as_the_run_that_measured_again(tmp_path):
    # The undivided im2col_gemm, stalled, is measured again and replaced in the cache after shift_gemm was pruned
    # for losing to it. The run prunes anew from the replaced time, as a rerun from its cache does.
    kernels = expand_kernels([("layer1", PROBLEM)], 8, ["fwd"])
    algos = ["im2col_gemm", "shift_gemm"]
    with Cache(str(tmp_path / "c.db")) as cache:
        report = optimize(
            StallOnceBeside(), kernels, policy="powerOfTwo", cache=cache, algos=algos, reps=1, benchmark_limit=10
        )
        again = optimize(
            CpuBackend(), kernels, policy="powerOfTwo", cache=cache, algos=algos, reps=1, benchmark_limit=10
        )
    (k,) = report.kernels
    assert report.remeasured >= 1 and k.baseline.time == pytest.approx(0.8)  # (the stall was 4 ms)
    assert {m.batch for m in k.pruned if m.algo == "shift_gemm"} == {2, 4}
    assert all("against 0.8 ms" in m.reason for m in k.pruned)  # (the time it lost to, replaced)
    assert again.stats.measured == 0 and again.kernels == report.kernels
    assert report.stats.candidates == again.stats.candidates == 8  # (2 algorithms at 4 sizes, each counted once)


class StallAlways(StallOnce):
    """Every measurement of the undivided kernel is STALL times too slow: re-measuring cannot help."""

    def measure(self, problem, algos, reps=3, *, accumulate=False):
        self.stalled.clear()
        return super().measure(problem, algos, reps, accumulate=accumulate)


def test_a_ratio_that_stays_doubtful_after_re_measuring_is_marked(tmp_path, capsys):
    from ucudnn.cli.bench import format_report

    from ucudnn.network.optimize import REMEASURE_ATTEMPTS

    backend = StallAlways()
    calls = []
    original = backend.measure
    backend.measure = lambda problem, algos, reps=3, **kw: (
        calls.append((problem.n, reps)) or original(problem, algos, reps, **kw)
    )
    kernels = expand_kernels([("layer1", PROBLEM)], 8, ["fwd"])
    report = optimize(backend, kernels, policy="powerOfTwo", algos=["im2col_gemm"], reps=1)
    (k,) = report.kernels
    assert k.doubtful and report.to_json()["kernels"][0]["doubtful"] is True
    # Measured once by the benchmark, then REMEASURE_ATTEMPTS times with three times the reps.
    assert calls.count((8, 1)) == 1 and calls.count((8, 3)) == REMEASURE_ATTEMPTS
    row = next(line for line in format_report(report).splitlines() if line.startswith("layer1"))
    assert row.endswith("x?")
    assert "`?` marks 1 ratio resting" in format_report(report)


# ---- cluster device names, plan plots, db info ----


def test_an_unknown_cluster_device_says_where_it_was_looked_for(tmp_path):
    import ucudnn

    url = str(tmp_path / "c.db")
    Cache(url).close()
    with pytest.raises(InvalidInput) as info:
        ucudnn.best_batch_size(256, ["NVIDIA H100 80GB HBM3 (sm_90)", "v100"], network="resnet18", db=url)
    message = str(info.value)
    assert "'NVIDIA H100 80GB HBM3 (sm_90)'" in message and "measurement cache" in message
    assert "holds no device" in message and "k40" in message and "\n" not in message


def test_plan_compare_plot_draws_every_policy(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    target = tmp_path / "timeline.png"
    code, out, err = run(
        capsys,
        "plan",
        "--network",
        "alexnet",
        "--batch",
        "16",
        "--device",
        "k40",
        "--memory",
        "1GiB",
        "--compare",
        "--plot",
        str(target),
    )
    assert code == 0, err
    policies = [line.split()[0] for line in out.splitlines()[2:] if line and not line.startswith("plots:")]
    drawn = sorted(p.name for p in tmp_path.glob("timeline-*.png"))
    assert drawn == sorted(f"timeline-{p}.png" for p in policies) and len(drawn) >= 5
    assert not target.exists()
    assert all((tmp_path / name).read_bytes()[:4] == b"\x89PNG" for name in drawn)


def test_db_info_says_what_a_device_is(tmp_path, capsys):
    url = str(tmp_path / "c.db")
    with Cache(url) as cache:
        for versions in ("numpy=1", "torch=2"):
            cache.store(
                device="cpu0",
                backend="cpu",
                versions=versions,
                problem_key=PROBLEM.key,
                micros=[CpuBackend().measure(PROBLEM, ["shift_gemm"], 1)[0]],
            )
    code, out, err = run(capsys, "db", "info", "--db", url)
    assert code == 0, err
    (line,) = [line for line in out.splitlines() if line.startswith("devices")]
    assert line.split()[1] == "2" and "library versions" in line and "1 device model" in line
    code, out, err = run(capsys, "db", "info", "--db", url, "--json")
    facts = json.loads(out)
    assert facts["devices"] == 2 and facts["device_models"] == 1


# ---- the note under the table reads, and says only what happened ----


def test_the_note_says_only_what_happened(tmp_path):
    import dataclasses

    kernels = expand_kernels([("layer1", PROBLEM)], 8, ["fwd"])
    report = optimize(CpuBackend(), kernels, policy="undivided", algos=["shift_gemm"], reps=3)
    quiet = dataclasses.replace(report, noisy_now=0, remeasured=0)
    assert quiet.noise_text == ""
    noisy = dataclasses.replace(report, noisy_now=4, remeasured=0).noise_text
    assert noisy.startswith("4 of the ") and "timings taken now were noisy" in noisy
    assert "measured again" not in noisy and " 0 " not in noisy and "raise --reps (now 3)" in noisy
    one = dataclasses.replace(report, noisy_now=1, remeasured=1).noise_text
    assert "timings taken now was noisy" in one
    assert "1 timing that a speedup rests on looked like an outlier and was measured again (9 runs" in one
    both = dataclasses.replace(report, noisy_now=0, remeasured=2).noise_text
    assert both.startswith("2 timings that a speedup rests on looked like outliers and were measured again")


def test_every_option_of_every_command_says_what_it_does():
    import click
    from ucudnn.cli.main import cli

    def commands(group, path):
        ctx = click.Context(group)
        for name in group.list_commands(ctx):  # the top group loads its commands only when asked for one
            command = group.get_command(ctx, name)
            if isinstance(command, click.Group):
                yield from commands(command, [*path, name])
            else:
                yield [*path, name], command

    silent = [
        (" ".join(path), param.opts[0])
        for path, command in commands(cli, [])
        for param in command.params
        if isinstance(param, click.Option) and not param.help
    ]
    assert not silent, silent


# ---- sizes: only the documented units, and a size in powers of 1000 says its bytes ----


@pytest.mark.parametrize("text, meant", [("8mb", "8MiB"), ("8Mb", "8MiB"), ("8KB", "8KiB"), ("8mib", "8MiB")])
def test_a_unit_spelt_otherwise_than_documented_is_refused_naming_the_forms(text, meant, tmp_path, capsys):
    code, out, err = run(capsys, "bench", "--layer", LAYER, "--backend", "cpu", "--workspace", text)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("ucudnn: error: ") and "--workspace" in err, err
    assert meant in err and text in err


def test_a_size_in_powers_of_1000_says_its_bytes(tmp_path, capsys):
    code, out, err = run(
        capsys, "bench", "--layer", LAYER, *FAST, "--workspace", "8MB", "--json", "--db", str(tmp_path / "c.db")
    )
    assert code == 0, err
    assert json.loads(out)["workspace_limit"] == 8 * 10**6
    assert "--workspace 8MB is 8000000 bytes (7.6 MiB; powers of 1000)" in err


def test_bench_and_plan_refuse_a_negative_batch_in_the_same_words(capsys):
    bench = run(capsys, "bench", "--network", "alexnet", "--batch", "-3", "--backend", "cpu")
    plan = run(capsys, "plan", "--network", "alexnet", "--batch", "-3", "--memory", "1GiB")
    assert bench[0] == plan[0] == 2
    assert bench[2] == plan[2] == "ucudnn: error: --batch must be a positive integer, got -3\n"


# ---- the headline says what it rests on: each side's library, the BLAS and the threads ----


def test_the_headline_names_its_baseline_its_blas_and_torchs_threads(tmp_path, capsys):
    torch = pytest.importorskip("torch")
    from threadpoolctl import threadpool_info

    tiny = "n=2,c=4,h=8,w=8,k=4,r=3,s=3,pad=1"
    argv = ["bench", "--layer", tiny, "--backend", "cpu", "--reps", "1", "--quiet", "--workspace", "64MiB"]
    argv += ["--algos", "native", "--policy", "undivided", "--db", str(tmp_path / "c.db")]
    code, out, err = run(capsys, *argv, "--json")
    assert code == 0, err
    report = json.loads(out)
    conditions = report["conditions"]
    assert conditions["baseline_algos"] == sorted({k["baseline"]["algo"] for k in report["kernels"]})
    assert conditions["algos"] == sorted({m["algo"] for k in report["kernels"] for m in k["config"]})
    pools = [p for p in threadpool_info() if p["user_api"] == "blas"]
    assert pools, "NumPy's BLAS is found by threadpoolctl"
    assert [(b["library"], b["version"], b["threads"]) for b in conditions["blas"]] == [
        (p["internal_api"], p["version"], p["num_threads"]) for p in pools
    ]
    assert "native" in conditions["baseline_algos"] + conditions["algos"]
    assert conditions["torch"] == {"version": torch.__version__, "threads": torch.get_num_threads()}
    code, out, err = run(capsys, *argv)  # the table, from the cache
    assert code == 0, err
    why = [line for line in out.splitlines() if line.startswith("why: ")]
    lines = out.splitlines()
    assert len(why) == 2 and lines.index(why[0]) == 1 + next(i for i, x in enumerate(lines) if x.startswith("speedup:"))
    for algo in conditions["baseline_algos"] + conditions["algos"]:
        assert algo in why[0]
    assert all(f"{b['library']} {b['version']}" in why[0] for b in conditions["blas"])
    assert f"PyTorch {torch.__version__}, {torch.get_num_threads()} thread" in why[0]


# ---- the entry point: --help loads no command; Ctrl-C ends in one line ----


def test_help_lists_every_command_in_its_own_words_and_loads_none():
    import click
    from ucudnn.cli.main import COMMANDS, cli

    for name, (_, summary) in COMMANDS.items():  # the summary --help lists is the command's own first sentence
        assert summary == cli.get_command(click.Context(cli), name).get_short_help_str(limit=10**6), name
    script = (
        "import sys\nfrom ucudnn.cli.main import main\ncode = main(['--help'])\n"
        "print([m for m in sys.modules if m.split('.')[0] in ('numpy', 'scipy', 'sqlalchemy', 'torch')"
        " or m.startswith('ucudnn.cli.') and m != 'ucudnn.cli.main'], code)"
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr
    *help_lines, loaded = proc.stdout.splitlines()
    assert loaded == "[] 0"
    listed = "\n".join(help_lines).split("Commands:", 1)[1].split()
    assert [name for name in COMMANDS if name in listed] == list(COMMANDS)


def test_ctrl_c_while_a_command_loads_ends_in_one_line_and_130():
    # Ctrl-C arrives while the command's module imports (NumPy, SciPy, torch: seconds on a busy machine)
    script = (
        "import importlib\nfrom ucudnn.cli import main\n"
        "def interrupted(name, *args):\n    raise KeyboardInterrupt\n"
        "main.importlib.import_module = interrupted\nmain.sys.argv = ['ucudnn', 'bench', '--help']\n"
        "main.entry_point()\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=False)
    assert proc.returncode == 130 and proc.stdout == ""
    assert proc.stderr.strip() == "ucudnn: interrupted", proc.stderr


def test_ctrl_c_during_a_benchmark_ends_in_one_line_and_130(tmp_path):
    ucudnn = Path(sys.executable).with_name("ucudnn")
    if not ucudnn.exists():
        pytest.skip("the ucudnn script is not installed beside this interpreter")
    argv = [str(ucudnn), "bench", "--layer", "n=64,c=64,h=56,w=56,k=64,r=3,s=3,pad=1", "--backend", "cpu"]
    argv += ["--policy", "all", "--exhaustive", "--db", str(tmp_path / "c.db")]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    seen = b""
    while b"benchmark" not in seen:  # the progress bar: the command has loaded and is measuring
        chunk = proc.stderr.read1(4096)
        assert chunk, f"the benchmark ended before it was interrupted: {seen.decode(errors='replace')}"
        seen += chunk
    proc.send_signal(signal.SIGINT)
    _, rest = proc.communicate()
    err = (seen + rest).decode(errors="replace").split("\r")[-1]  # after the progress bar's last redraw
    assert proc.returncode == 130, err
    assert "Traceback" not in err and err.strip().splitlines()[-1] == "ucudnn: interrupted", err
