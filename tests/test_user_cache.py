"""The tests never write into the user's measurement cache or home (tests/conftest.py points HOME and
XDG_CACHE_HOME at a folder of the run's own and unsets UCUDNN_DB).

The `writer` tests write through the default cache as a user's commands do: `ucudnn bench` without
`--db` in a subprocess, a `Handle` and `convert` without `db`. The last test runs them in a pytest of
their own, as a user with a filled cache in `~/.cache/ucudnn` would, and checks that the user's home,
that cache included, is byte for byte, and time for time, what it was."""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from ucudnn.db import Cache, default_url

from ucudnn import Handle
from ucudnn.backends.cpu import CpuBackend
from ucudnn.problem import ConvProblem

ROOT = Path(__file__).resolve().parents[1]
# Layers no other test measures, so that each writer's measurements are its own.
BENCH_LAYER = "n=2,c=3,h=7,w=5,k=5,r=3,s=3,pad=1"
HANDLE_PROBLEM = ConvProblem(n=2, c=5, h=5, w=7, k=3, r=3, s=3, pad_h=1, pad_w=1)


def _default_cache_file() -> Path:
    url = default_url()
    assert url.startswith("sqlite:///"), url
    return Path(url.removeprefix("sqlite:///"))


def _problem_keys(path: Path) -> set[str]:
    with Cache(path, readonly=True) as cache:
        return {record.problem_key for record in cache.measurement_records()}


def _check_default_cache_is_the_runs(run_folders) -> Path:
    path = _default_cache_file()
    assert path == run_folders.cache / "ucudnn" / "cache.db"
    assert run_folders.root in path.parents
    return path


def test_writer_bench_cli_without_db(run_folders):
    path = _check_default_cache_is_the_runs(run_folders)
    script = Path(sys.executable).with_name("ucudnn")
    command = [str(script)] if script.exists() else [sys.executable, "-m", "ucudnn.cli.main"]
    result = subprocess.run(
        [
            *command,
            "bench",
            "--layer",
            BENCH_LAYER,
            "--backend",
            "cpu",
            "--kinds",
            "fwd",
            "--policy",
            "undivided",
            "--reps",
            "1",
            "--quiet",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert ConvProblem.parse(BENCH_LAYER).key in _problem_keys(path)


def test_writer_handle_without_db(run_folders):
    path = _check_default_cache_is_the_runs(run_folders)
    rng = np.random.default_rng(0)
    p = HANDLE_PROBLEM
    x = rng.standard_normal(p.x_shape, dtype=np.float32)
    w = rng.standard_normal(p.w_shape, dtype=np.float32)
    with Handle(backend=CpuBackend(), policy="undivided", reps=1) as handle:  # db=None: the default cache
        handle.conv_forward(x, w, padding=1, layer="writer")
        assert handle.stats.measured > 0
    assert p.key in _problem_keys(path)


def test_writer_convert_without_db(run_folders):
    torch = pytest.importorskip("torch")
    from ucudnn.torch import convert

    path = _check_default_cache_is_the_runs(run_folders)
    layer = convert(torch.nn.Conv2d(3, 6, 3, padding=1), backend="cpu", policy="undivided", reps=1)
    layer(torch.randn(2, 3, 9, 6, requires_grad=True)).sum().backward()
    assert ConvProblem(n=2, c=3, h=9, w=6, k=6, r=3, s=3, pad_h=1, pad_w=1).key in _problem_keys(path)


def _snapshot(folder: Path) -> dict[str, tuple[str, int, int]]:
    """Every file under `folder`: (sha256, size, mtime in ns), by relative path."""
    return {
        str(p.relative_to(folder)): (hashlib.sha256(p.read_bytes()).hexdigest(), p.stat().st_size, p.stat().st_mtime_ns)
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def test_a_test_run_leaves_the_users_cache_and_home_byte_for_byte(tmp_path):
    # A user whose default cache (~/.cache/ucudnn/cache.db, no XDG_CACHE_HOME, no UCUDNN_DB) holds
    # measurements of their own, among them one of the very layer the CLI writer benchmarks.
    home = tmp_path / "user"
    user_cache = home / ".cache" / "ucudnn" / "cache.db"
    user_cache.parent.mkdir(parents=True)
    backend = CpuBackend()
    problem = ConvProblem.parse(BENCH_LAYER)
    with Cache(user_cache) as cache:
        cache.store(
            device="user's CPU",
            backend="cpu",
            versions="numpy=1",
            problem_key=problem.key,
            micros=backend.measure(problem, ["shift_gemm"], 1),
        )
    (home / ".bashrc").write_text("# the user's\n")
    os.utime(user_cache, ns=(1_000_000_000, 1_000_000_000))  # an old file: any write changes its time
    before = _snapshot(home)
    assert set(before) == {".cache/ucudnn/cache.db", ".bashrc"}

    env = {name: value for name, value in os.environ.items() if name not in ("XDG_CACHE_HOME", "UCUDNN_DB")}
    env["HOME"] = str(home)
    result = subprocess.run(
        [sys.executable, "-m", "pytest", str(Path(__file__)), "-k", "writer", "-q", "-p", "no:cacheprovider"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    summary = result.stdout.strip().splitlines()[-1] if result.stdout.strip() else ""
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert re.search(r"\b[23] passed\b", summary), summary  # convert's writer skips without torch

    assert _snapshot(home) == before  # nothing changed, nothing added (no ~/.cache/matplotlib either)
    assert _problem_keys(user_cache) == {problem.key}
