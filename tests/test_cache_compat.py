"""A cache written by the release before problems grew depth and transposed fields still serves.

`tests/data/cache-v1-2d.sqlite` was written by ucudnn at commit 5ea1da0 (tests/data/README.md says
how). A 2-D problem's key is byte-identical to what that release wrote, so the file opens as it is
(schema version 1, no migration), keeps every row, and serves its 2-D layers without measuring.
"""

from __future__ import annotations

import json
import shutil
import sqlite3
from pathlib import Path

import numpy as np
import pytest
from ucudnn.cli.main import main
from ucudnn.db import SCHEMA_VERSION, Cache

from ucudnn import Handle
from ucudnn.backends.cpu import NATIVE, CpuBackend
from ucudnn.problem import KINDS, ConvProblem

FIXTURE = Path(__file__).parent / "data" / "cache-v1-2d.sqlite"
TABLES = ("meta", "devices", "problems", "measurements", "plans")
LAYERS = ("n=2,c=8,h=8,w=8,k=8,r=3,s=3", "n=2,c=8,h=8,w=8,k=16,r=1,s=1,stride=2")


def raw_rows(path: Path) -> dict[str, list[tuple]]:
    """Every row of every table, read with sqlite3 itself (no ucudnn code involved)."""
    with sqlite3.connect(path) as conn:
        return {table: sorted(conn.execute(f"SELECT * FROM {table}").fetchall(), key=repr) for table in TABLES}


@pytest.fixture
def old_cache(tmp_path) -> Path:
    copy = tmp_path / "old.sqlite"
    shutil.copyfile(FIXTURE, copy)
    return copy


def as_this_machine(path: Path) -> None:
    """Give the cache's device rows this machine's identity, as if this machine had written them:
    the measurements are keyed by the CPU model and library versions that took them, and this test
    is about the problem keys. NumPy algorithms' rows and native's are told apart by torch's version."""
    backend = CpuBackend()
    with sqlite3.connect(path) as conn:
        for row_id, versions in conn.execute("SELECT id, versions FROM devices").fetchall():
            algo = NATIVE if "torch=" in versions else "im2col_gemm"
            conn.execute(
                "UPDATE devices SET model = ?, versions = ? WHERE id = ?",
                (backend.device.model, backend.versions_for(algo), row_id),
            )


def test_the_fixture_is_what_the_old_release_wrote():
    rows = raw_rows(FIXTURE)
    assert rows["meta"] == [("schema_version", "1")]
    assert (len(rows["devices"]), len(rows["problems"]), len(rows["measurements"]), len(rows["plans"])) == (2, 6, 57, 1)
    assert FIXTURE.stat().st_size < 200 * 1024


def test_opening_keeps_every_row_and_needs_no_migration(old_cache):
    before = raw_rows(old_cache)
    cache = Cache(old_cache)  # opened for writing: a migration, if one were due, would run here
    try:
        info = cache.info()
    finally:
        cache.close()
    assert SCHEMA_VERSION == info["schema_version"] == 1
    assert (info["devices"], info["problems"], info["measurements"], info["plans"]) == (2, 6, 57, 1)
    assert raw_rows(old_cache) == before  # not a byte of a row changed


def test_every_stored_key_is_the_key_of_its_2d_problem_today(old_cache):
    stored = {key for _, key, _, _ in raw_rows(old_cache)["problems"]}
    today = {ConvProblem.parse(spec).with_kind(kind).key for spec in LAYERS for kind in KINDS}
    assert stored == today
    for key in stored:  # and each reads back to itself (db export/import check keys this way)
        assert ConvProblem.parse(key).key == key


def test_export_and_import_carry_every_row(old_cache, tmp_path, capsys):
    export = tmp_path / "old.jsonl"
    assert main(["db", "export", str(export), "--db", str(old_cache)]) == 0
    fresh = tmp_path / "fresh.sqlite"
    assert main(["db", "import", str(export), "--db", str(fresh)]) == 0
    capsys.readouterr()
    assert main(["db", "info", "--json", "--db", str(fresh)]) == 0
    info = json.loads(capsys.readouterr().out)
    assert (info["measurements"], info["plans"], info["problems"]) == (57, 1, 6)


@pytest.mark.parametrize(
    "argv",
    [
        ["--layer", LAYERS[0]],
        ["--layer", LAYERS[0], "--layer", LAYERS[1], "--total-workspace", "64KiB"],
    ],
)
def test_bench_serves_its_2d_layers_without_measuring(old_cache, argv, capsys):
    as_this_machine(old_cache)
    code = main(["bench", *argv, "--backend", "cpu", "--json", "--quiet", "--db", str(old_cache)])
    out, err = capsys.readouterr()
    assert code == 0, err
    report = json.loads(out)
    assert report["benchmark"]["measured"] == 0 and report["benchmark"]["remeasured"] == 0
    assert report["benchmark"]["cached"] > 0
    assert len(raw_rows(old_cache)["measurements"]) == 57  # nothing added


def test_a_handle_is_served_without_measuring(old_cache):
    # (Its stored plan is keyed by a hash of every library version of the machine that solved it,
    # so only that machine finds it; any machine with the cached measurements measures nothing.)
    as_this_machine(old_cache)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 8, 8, 8), dtype=np.float32)
    w = rng.standard_normal((8, 8, 3, 3), dtype=np.float32)
    with Handle(backend=CpuBackend(), workspace_limit="64KiB", db=str(old_cache)) as handle:
        y = handle.conv_forward(x, w)
        assert handle.stats.measured == 0
    assert y.shape == (2, 8, 6, 6)


def test_a_3d_layer_beside_them_is_a_new_problem(old_cache, capsys):
    as_this_machine(old_cache)
    spec = "n=2,c=8,d=4,h=8,w=8,k=8,t=1,r=3,s=3"  # a 3-D layer of depth filter 1: not the 2-D layer
    code = main(
        [
            "bench",
            "--layer",
            spec,
            "--kinds",
            "fwd",
            "--backend",
            "cpu",
            "--json",
            "--quiet",
            "--reps",
            "1",
            "--db",
            str(old_cache),
        ]
    )
    out, err = capsys.readouterr()
    assert code == 0, err
    assert json.loads(out)["benchmark"]["measured"] > 0
    problems = {key for _, key, _, _ in raw_rows(old_cache)["problems"]}
    assert len(problems) == 7 and ConvProblem.parse(spec).key in problems
