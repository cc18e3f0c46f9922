"""`ucudnn db info|export|import|prune`, and the merge rule of import."""

from __future__ import annotations

import itertools
import json
import math
import random
from pathlib import Path

import pytest
from pg_server import db_url, pg_server  # noqa: F401
from ucudnn.cli.main import main
from ucudnn.db import MERGE_RULE, SCHEMA_VERSION, Cache
from ucudnn.solver.types import MicroConfig

from ucudnn.problem import ConvProblem

DEVICE = {"device": "Test GPU", "backend": "cudnn", "versions": "cudnn=9.1.0"}
KEY = ConvProblem(c=64, h=56, w=56, k=128, r=3, s=3, pad_h=1, pad_w=1).key
MICROS = [
    MicroConfig("gemm", 1, 0.5, 0, spread=0.125),
    MicroConfig("fft", 1, 0.25, 4096),
    MicroConfig("winograd", 1, math.inf, 0, reason="unsupported: stride 2"),
]


def run(capsys: pytest.CaptureFixture, *args: str) -> tuple[int, str, str]:
    code = main(["db", *args])
    out, err = capsys.readouterr()
    return code, out, err


def filled(url: str) -> str:
    with Cache(url) as c:
        c.store(problem_key=KEY, micros=MICROS, **DEVICE)
        c.store(problem_key=KEY.replace("fwd", "bwd_data"), micros=MICROS[:1], **{**DEVICE, "versions": "cudnn=9.2.0"})
        c.put_plan("plan-1", {"mode": "WR", "config": [{"algo": "fft", "batch": 1}]})
    return url


def body(path: Path) -> list[dict]:
    """An export's records without its header (which holds the export time)."""
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert lines[0]["type"] == "header" and lines[0]["schema_version"] == SCHEMA_VERSION
    return lines[1:]


# ---- info --------------------------------------------------------------------------------------


def test_info(db_url: str, capsys: pytest.CaptureFixture) -> None:  # noqa: F811
    filled(db_url)
    code, out, _ = run(capsys, "info", "--db", db_url, "--json")
    assert code == 0
    info = json.loads(out)
    assert {k: info[k] for k in ("schema_version", "devices", "problems", "measurements", "plans")} == {
        "schema_version": SCHEMA_VERSION,
        "devices": 2,
        "problems": 2,
        "measurements": 4,
        "plans": 1,
    }
    code, out, _ = run(capsys, "info", "--db", db_url)
    assert code == 0
    assert "measurements    4" in out and "schema_version  1" in out and "Test GPU [cudnn] cudnn=9.2.0" in out


def test_info_uses_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    monkeypatch.setenv("UCUDNN_DB", filled(str(tmp_path / "env.db")))
    code, out, _ = run(capsys, "info", "--json")
    assert code == 0 and json.loads(out)["measurements"] == 4


def test_info_of_missing_cache_is_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    code, _, err = run(capsys, "info", "--db", str(tmp_path / "none.db"))
    assert code == 2 and err.startswith("ucudnn: error: no cache at") and err.count("\n") == 1
    assert list(tmp_path.iterdir()) == []


# ---- export and import -------------------------------------------------------------------------


def test_export_import_round_trip(db_url: str, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:  # noqa: F811
    filled(db_url)
    first = tmp_path / "a.jsonl"
    code, out, _ = run(capsys, "export", "--db", db_url, str(first))
    assert code == 0 and "exported 4 measurements and 1 plans" in out
    records = body(first)
    failed = [r for r in records if r.get("algo") == "winograd"]
    assert failed[0]["time_ms"] is None and failed[0]["reason"] == "unsupported: stride 2"
    assert [r["type"] for r in records] == ["measurement"] * 4 + ["plan"]
    assert [r.get("kind") for r in records] == ["fwd"] * 3 + ["bwd_data", None]  # key order
    assert records[0]["created_at"].endswith("Z")

    copy = tmp_path / "copy.db"
    code, out, _ = run(capsys, "import", "--db", str(copy), str(first), "--json")
    assert code == 0
    assert json.loads(out) == {
        "measurements": {"inserted": 4, "replaced": 0, "kept": 0},
        "plans": {"inserted": 1, "replaced": 0, "kept": 0},
    }
    second = tmp_path / "b.jsonl"
    assert run(capsys, "export", "--db", str(copy), str(second))[0] == 0
    assert body(second) == records
    with Cache(copy) as c:
        found = c.lookup(problem_key=KEY, batches=[1], **DEVICE)
        assert found["winograd", 1].time == math.inf and found["gemm", 1].spread == 0.125
        assert c.get_plan("plan-1") == {"mode": "WR", "config": [{"algo": "fft", "batch": 1}]}
    # Importing again changes nothing.
    code, out, _ = run(capsys, "import", "--db", str(copy), str(first))
    assert code == 0 and "measurements: 0 inserted, 0 replaced, 4 kept" in out


def test_export_to_stdout(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    db = filled(str(tmp_path / "c.db"))
    code, out, _ = run(capsys, "export", "--db", db, "-")
    assert code == 0 and len(out.splitlines()) == 6 and json.loads(out.splitlines()[0])["type"] == "header"


def test_import_a_cache_file_and_a_url(db_url: str, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:  # noqa: F811
    source_file = filled(str(tmp_path / "source.db"))
    code, out, _ = run(capsys, "import", "--db", db_url, source_file)
    assert code == 0 and "measurements: 4 inserted" in out
    # ... and back the other way, naming the cache by URL.
    target = tmp_path / "target.db"
    code, out, _ = run(capsys, "import", "--db", str(target), db_url)
    assert code == 0 and "measurements: 4 inserted" in out and "plans: 1 inserted" in out
    run(capsys, "export", "--db", source_file, str(tmp_path / "s.jsonl"))
    run(capsys, "export", "--db", str(target), str(tmp_path / "t.jsonl"))
    assert body(tmp_path / "s.jsonl") == body(tmp_path / "t.jsonl")


def test_import_into_itself_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    db = filled(str(tmp_path / "c.db"))
    code, _, err = run(capsys, "import", "--db", db, db)
    assert code == 2 and "is the cache itself" in err


def header() -> dict:
    return {
        "type": "header",
        "format": "ucudnn-cache-export",
        "version": 1,
        "schema_version": 1,
        "exported_at": "2026-01-01T00:00:00Z",
    }


def measurement(
    algo: str = "gemm",
    batch: int = 1,
    time_ms: float | None = 1.0,
    *,
    created_at: str = "2026-01-01T00:00:00.000000Z",
    device: str = "Test GPU",
    spread_ms: float = 0.0,
    workspace_bytes: int = 0,
    reason: str = "",
) -> dict:
    return {
        "type": "measurement",
        "device": device,
        "backend": "cudnn",
        "versions": "cudnn=9.1.0",
        "problem_key": KEY,
        "algo": algo,
        "batch": batch,
        "time_ms": time_ms,
        "spread_ms": spread_ms,
        "workspace_bytes": workspace_bytes,
        "reason": reason,
        "created_at": created_at,
    }


def plan(key: str, value: dict, created_at: str = "2026-01-01T00:00:00Z") -> dict:
    return {"type": "plan", "key": key, "plan": value, "created_at": created_at}


def write(path: Path, records: list[dict], with_header: bool = True) -> Path:
    lines = ([header()] if with_header else []) + records
    path.write_text("".join(json.dumps(r) + "\n" for r in lines))
    return path


BAD_EXPORTS = {
    "no header": ([measurement()], False, "line 1: the first line must be"),
    "not json": (["{nope"], True, "line 2"),
    "infinity": (['{"type": "measurement", "time_ms": Infinity}'], True, "line 2: Infinity is not JSON"),
    "negative time": ([measurement(time_ms=-1.0)], True, "line 2: time_ms"),
    "zero batch": ([measurement(batch=0)], True, "line 2: batch"),
    "bad time stamp": ([measurement(created_at="yesterday")], True, "line 2: created_at"),
    "unknown type": ([{"type": "gossip"}], True, "line 2: type"),
    "plan not dict": ([plan("k", [1])], True, "line 2: plan"),
}


@pytest.mark.parametrize("name", BAD_EXPORTS)
def test_import_bad_export_changes_nothing(
    name: str,
    db_url: str,  # noqa: F811 - the fixture imported above
    tmp_path: Path,
    capsys: pytest.CaptureFixture,
) -> None:
    records, with_header, message = BAD_EXPORTS[name]
    lines = ([json.dumps(header())] if with_header else []) + [
        r if isinstance(r, str) else json.dumps(r) for r in records
    ]
    # A good record first, so that an import that wrote as it read would leave it behind.
    if with_header:
        lines.insert(1, json.dumps(measurement("direct")))
    source = tmp_path / "bad.jsonl"
    source.write_text("\n".join(lines) + "\n")
    code, _, err = run(capsys, "import", "--db", db_url, str(source))
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err
    if with_header:
        message = message.replace("line 2", "line 3")
    assert message in err, err
    with Cache(db_url) as c:
        assert c.info()["measurements"] == 0


def test_import_of_a_text_file(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    (tmp_path / "notes.txt").write_text("hello\n")
    code, _, err = run(capsys, "import", "--db", str(tmp_path / "c.db"), str(tmp_path / "notes.txt"))
    assert code == 2 and "line 1" in err
    code, _, err = run(capsys, "import", "--db", str(tmp_path / "c.db"), str(tmp_path / "absent"))
    assert code == 2 and "is not a file" in err


# ---- the merge rule ----------------------------------------------------------------------------


def merged(tmp_path: Path, capsys: pytest.CaptureFixture, *sources: Path, url: str | None = None) -> list[dict]:
    db = url or str(tmp_path / f"merged-{random.random()}.db")
    for source in sources:
        assert run(capsys, "import", "--db", db, str(source))[0] == 0
    out = tmp_path / f"out-{random.random()}.jsonl"
    assert run(capsys, "export", "--db", db, str(out))[0] == 0
    return body(out)


@pytest.mark.parametrize(
    "old, new, winner",
    [
        # later created_at wins, whatever the values
        (
            measurement(time_ms=1.0, created_at="2026-01-01T00:00:00Z"),
            measurement(time_ms=5.0, created_at="2026-01-02T00:00:00Z"),
            "new",
        ),
        (
            measurement(time_ms=None, reason="oom", created_at="2026-01-03T00:00:00Z"),
            measurement(time_ms=5.0, created_at="2026-01-02T00:00:00Z"),
            "old",
        ),
        # time zones are honoured: 01:00+02:00 is 23:00 the day before
        (
            measurement(time_ms=1.0, created_at="2026-01-01T22:00:00Z"),
            measurement(time_ms=5.0, created_at="2026-01-02T01:00:00+02:00"),
            "new",
        ),
        # equal created_at: usable beats failed, then lower time, spread, workspace, then reason
        (measurement(time_ms=None, reason="oom"), measurement(time_ms=9.0), "new"),
        (measurement(time_ms=2.0), measurement(time_ms=1.0), "new"),
        (measurement(time_ms=1.0, spread_ms=0.5), measurement(time_ms=1.0, spread_ms=0.25), "new"),
        (measurement(time_ms=1.0, workspace_bytes=8), measurement(time_ms=1.0, workspace_bytes=16), "old"),
        (measurement(time_ms=1.0, reason="a"), measurement(time_ms=1.0, reason="b"), "new"),
    ],
)
def test_merge_rule(old: dict, new: dict, winner: str, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    a = write(tmp_path / "a.jsonl", [old])
    b = write(tmp_path / "b.jsonl", [new])
    expected = {"old": old, "new": new}[winner]
    for order in ((a, b), (b, a)):
        [got] = merged(tmp_path, capsys, *order)
        assert (got["time_ms"], got["spread_ms"], got["workspace_bytes"], got["reason"]) == (
            expected["time_ms"],
            expected["spread_ms"],
            expected["workspace_bytes"],
            expected["reason"],
        )


def test_plan_merge_rule(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    a = write(tmp_path / "a.jsonl", [plan("k", {"v": 1}, "2026-01-02T00:00:00Z"), plan("t", {"v": "a"})])
    b = write(tmp_path / "b.jsonl", [plan("k", {"v": 2}, "2026-01-01T00:00:00Z"), plan("t", {"v": "b"})])
    for order in ((a, b), (b, a)):
        got = {r["key"]: r["plan"] for r in merged(tmp_path, capsys, *order)}
        assert got == {"k": {"v": 1}, "t": {"v": "b"}}


def random_exports(tmp_path: Path, count: int = 3) -> list[Path]:
    """Overlapping exports with conflicts, exact ties and duplicates inside one file."""
    rng = random.Random(1234)
    stamps = [f"2026-01-0{d}T00:00:00Z" for d in (1, 2, 3)]
    files = []
    for f in range(count):
        records = []
        for _ in range(300):
            record = measurement(
                algo=rng.choice(["gemm", "fft", "winograd"]),
                batch=rng.choice([1, 2, 4, 8]),
                time_ms=rng.choice([None, 0.5, 1.0, 2.0]),
                created_at=rng.choice(stamps),
                device=rng.choice(["A", "B"]),
                spread_ms=rng.choice([0.0, 0.25]),
                workspace_bytes=rng.choice([0, 64]),
                reason=rng.choice(["", "x"]),
            )
            if record["time_ms"] is None:  # a candidate that could not run always says why
                record["reason"] = record["reason"] or "y"
            records.append(record)
        records += [plan(f"p{rng.randrange(5)}", {"v": rng.randrange(3)}, rng.choice(stamps)) for _ in range(10)]
        files.append(write(tmp_path / f"e{f}.jsonl", records))
    return files


def test_merge_is_deterministic_in_any_order(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    files = random_exports(tmp_path)
    results = [merged(tmp_path, capsys, *order) for order in itertools.permutations(files)]
    assert all(r == results[0] for r in results[1:])
    assert merged(tmp_path, capsys, *files, *files) == results[0]  # idempotent
    # Merging in stages (A+B, then that with C) gives the same as all at once.
    ab = tmp_path / "ab.db"
    merged(tmp_path, capsys, files[0], files[1], url=str(ab))
    staged = tmp_path / "staged.db"
    merged(tmp_path, capsys, files[2], url=str(staged))
    assert merged(tmp_path, capsys, url=str(staged)) != results[0]
    assert run(capsys, "import", "--db", str(staged), str(ab))[0] == 0
    assert merged(tmp_path, capsys, url=str(staged)) == results[0]


def test_merge_is_the_same_on_both_engines(
    db_url: str,  # noqa: F811 - the fixture imported above
    tmp_path: Path,
    capsys: pytest.CaptureFixture,
) -> None:
    files = random_exports(tmp_path)
    assert merged(tmp_path, capsys, *files, url=db_url) == merged(tmp_path, capsys, *files[::-1])


def test_import_help_states_the_rule(capsys: pytest.CaptureFixture) -> None:
    assert main(["db", "import", "--help"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "Merge rule" in out and " ".join(MERGE_RULE.split()) in out


# ---- prune -------------------------------------------------------------------------------------


def test_prune(db_url: str, capsys: pytest.CaptureFixture) -> None:  # noqa: F811
    filled(db_url)
    code, out, _ = run(capsys, "prune", "--db", db_url, "--versions", "cudnn=9.2.0", "--dry-run")
    assert code == 0 and out.startswith("would remove 1 rows (1 measurements, 0 plans)")
    code, out, _ = run(capsys, "prune", "--db", db_url, "--versions", "cudnn=9.2.0")
    assert code == 0 and out.startswith("removed 3 rows (1 measurements, 0 plans, 1 devices, 1 problems)")
    code, out, _ = run(
        capsys, "prune", "--db", db_url, "--device", "Test GPU", "--backend", "cudnn", "--older-than", "1"
    )
    assert code == 0 and out.startswith("removed 0 rows")
    code, out, _ = run(capsys, "prune", "--db", db_url, "--older-than", "0")
    assert code == 0 and out.startswith("removed 6 rows (3 measurements, 1 plans, 1 devices, 1 problems)")


@pytest.mark.parametrize(
    "args, message",
    [
        ([], "prune needs"),
        (["--all", "--device", "x"], "prune needs"),
        (["--older-than", "-1"], "--older-than"),
        (["--device", ""], "device must be a non-empty"),
    ],
)
def test_prune_bad_usage(args: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    db = filled(str(tmp_path / "c.db"))
    code, _, err = run(capsys, "prune", "--db", db, *args)
    assert code == 2 and message in err and err.count("\n") == 1
    with Cache(db) as c:
        assert c.info()["measurements"] == 4


def test_prune_missing_cache_creates_nothing(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    code, _, err = run(capsys, "prune", "--db", str(tmp_path / "none.db"), "--all")
    assert code == 2 and "no cache at" in err and list(tmp_path.iterdir()) == []
