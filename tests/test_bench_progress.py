"""`ucudnn bench` on a run that re-measures outliers: the progress bar counts the re-measurements, and
the `benchmark:` line's time is the whole benchmark's, re-measuring included.

The backend's timings are steady and its first undivided measurement of each kernel is stalled, so
that re-measuring is certain; the time is a stand-in clock that only its measurements move, so
that what the report says can be compared with what they took, whatever the machine's load."""

import io
import re
from typing import NamedTuple

import pytest
from tqdm import tqdm
from ucudnn.cli.main import main

import ucudnn.backends
from ucudnn.backends.cpu import CpuBackend
from ucudnn.network import optimize as optimize_module
from ucudnn.network.optimize import REMEASURE_REPS_FACTOR, expand_kernels, optimize
from ucudnn.problem import ConvProblem

LAYER = "n=8,c=8,h=12,w=12,k=16,r=3,s=3,pad=1"
PROBLEM = ConvProblem.parse(LAYER)
REPS = 1


class Measured(NamedTuple):
    what: tuple  # (kind, micro-batch size, algorithms)
    reps: int
    seconds: float
    n: int | None  # the bar's count and total as it began, when the backend has one
    total: int | None


class StalledFirstUndivided(CpuBackend):
    """Every timing is a steady 100 ms per sample, except the first undivided one of each kernel and
    algorithm, 50 times that (a busy machine): an outlier to re-measure. Each measurement moves
    `self.now` (seconds) by the time its timed runs add up to, and is logged (`Measured`)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.now = 0.0
        self.stalled: set[tuple[str, str]] = set()
        self.log: list[Measured] = []
        self.bar = None

    def time_run_ms(self, problem, algo, operands, workspace, reps, beta=0.0):
        return [100.0 * problem.n] * reps

    def measure(self, problem, algos, reps=3, *, accumulate=False):
        out = []
        for m in super().measure(problem, algos, reps, accumulate=accumulate):
            if m.usable and problem.n == PROBLEM.n and (problem.kind, m.algo) not in self.stalled:
                self.stalled.add((problem.kind, m.algo))
                m = type(m)(m.algo, m.batch, m.time * 50, m.workspace, reason=m.reason, spread=0.0)
            out.append(m)
        seconds = sum(m.time for m in out if m.usable) * reps / 1e3
        self.now += seconds
        bar = self.bar
        what = (problem.kind, problem.n, tuple(algos))
        self.log.append(Measured(what, reps, seconds, bar.n if bar else None, bar.total if bar else None))
        return out


def test_the_bar_counts_each_re_measurement_and_the_time_includes_them(monkeypatch):
    backend = StalledFirstUndivided()
    monkeypatch.setattr(optimize_module, "clock", lambda: backend.now)
    kernels = expand_kernels([("layer1", PROBLEM)], PROBLEM.n, ["fwd", "bwd_data"])
    algos = ["im2col_gemm", "shift_gemm"]
    candidates = len(kernels) * 4 * len(algos)  # powerOfTwo at batch 8: sizes 1, 2, 4, 8
    with tqdm(total=candidates, file=io.StringIO()) as bar:
        backend.bar = bar
        report = optimize(backend, kernels, policy="powerOfTwo", algos=algos, reps=REPS, progress=bar)
    again = [m for m in backend.log if m.reps == REMEASURE_REPS_FACTOR * REPS]
    assert report.remeasured == len({m.what for m in again}) >= 1
    # Each re-measurement is a step of the bar, which grew to count it and was short of its end while it ran.
    assert bar.total == candidates + len(again) and bar.n == bar.total
    assert all(m.n < m.total for m in again)
    assert [m.n for m in again] == list(range(candidates, candidates + len(again)))
    # The time is the benchmark's wall time, measuring and re-measuring (the clock moves in nothing else).
    assert report.stats.seconds == pytest.approx(sum(m.seconds for m in backend.log))
    remeasuring = sum(m.seconds for m in again)
    assert report.remeasure_seconds == pytest.approx(remeasuring)
    assert 0 < remeasuring < report.stats.seconds


def test_the_benchmark_line_and_the_bar_of_the_command(tmp_path, capsys, monkeypatch):
    backend = StalledFirstUndivided()
    monkeypatch.setattr(optimize_module, "clock", lambda: backend.now)
    monkeypatch.setattr(ucudnn.backends, "get_backend", lambda name: backend)
    argv = ["bench", "--layer", LAYER, "--backend", "cpu", "--kinds", "fwd", "--algos", "im2col_gemm,shift_gemm"]
    code = main([*argv, "--reps", str(REPS), "--db", str(tmp_path / "c.db")])
    out, err = capsys.readouterr()
    assert code == 0, err
    again = [m for m in backend.log if m.reps == REMEASURE_REPS_FACTOR * REPS]
    count, total = len({m.what for m in again}), sum(m.seconds for m in backend.log)
    (line,) = [line for line in out.splitlines() if line.startswith("benchmark: ")]
    outliers = "outlier" if count == 1 else "outliers"
    remeasuring = sum(m.seconds for m in again)
    assert line.endswith(
        f"; {total:.1f} s wall time (measuring, re-measuring {count} {outliers}: {remeasuring:.1f} s, solving)"
    )
    # The bar (on stderr, a test's stand-in for the terminal) is drawn when the re-measuring phase starts: past
    # the 8 candidates (2 algorithms at 4 sizes), its total grown by one step per outlier.
    shown = re.findall(r"re-measuring (\d+) outliers?:.*?\| *(\d+)/(\d+)", err)
    assert shown and (int(shown[0][1]), int(shown[0][2])) == (8, 8 + int(shown[0][0]))
