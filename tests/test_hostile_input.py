"""Hostile input and special files (issue 15): every refusal is one line with exit 2, nothing the
user named is replaced, a refused command leaves the cache byte for byte as it was."""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import stat
import subprocess
import sys
import threading
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from ucudnn.cli.main import main
from ucudnn.db import Cache
from ucudnn.solver.types import MicroConfig

from ucudnn.problem import ConvProblem
from ucudnn.sizes import format_size, parse_size

KEY = ConvProblem(c=8, h=9, w=9, k=8, r=3, s=3, pad_h=1, pad_w=1).key
DEVICE = {"device": "Test GPU", "backend": "cudnn", "versions": "cudnn=9.1.0"}
SMALL = "n=2,c=4,h=6,w=6,k=4,r=3,s=3,pad=1"
FAST = ["--backend", "cpu", "--reps", "1", "--policy", "undivided", "--kinds", "fwd", "-q"]


def run(capsys: pytest.CaptureFixture, *args: str) -> tuple[int, str, str]:
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def refused(result: tuple[int, str, str], *words: str) -> None:
    """Exit 2, exactly one line on stderr that starts as every refusal does, no traceback, and the words that say
    why."""
    code, _, err = result
    assert code == 2, err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith("ucudnn: error: "), err
    for word in words:
        assert word in err, (word, err)


def cache_file(path: Path) -> Path:
    with Cache(path) as c:
        c.store(problem_key=KEY, micros=[MicroConfig("gemm", 1, 0.5, 0)], **DEVICE)
        c.put_plan("plan", {"x": 1})
    return path


def snapshot(path: Path) -> bytes:
    return path.read_bytes()


# ---- 1. export writes to what it is given -------------------------------------------------------


def test_export_into_a_fifo_streams_and_keeps_the_fifo(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    db = cache_file(tmp_path / "c.db")
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    received: list[bytes] = []
    reader = threading.Thread(target=lambda: received.append(fifo.read_bytes()))
    reader.start()
    code, _, err = run(capsys, "db", "export", "--db", str(db), str(fifo))
    reader.join(timeout=30)
    assert code == 0, err
    assert stat.S_ISFIFO(fifo.stat().st_mode)
    lines = received[0].decode().splitlines()
    assert json.loads(lines[0])["type"] == "header" and len(lines) == 3


def test_export_into_a_device_node_keeps_the_node(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    node = tmp_path / "null"
    try:
        os.mknod(node, 0o666 | stat.S_IFCHR, os.makedev(1, 3))  # a copy of /dev/null
    except PermissionError:
        pytest.skip("mknod needs root (CAP_MKNOD), which this process lacks")
    db = cache_file(tmp_path / "c.db")
    code, _, err = run(capsys, "db", "export", "--db", str(db), str(node))
    assert code == 0, err
    info = node.stat()
    assert stat.S_ISCHR(info.st_mode) and info.st_rdev == os.makedev(1, 3)
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")] == []


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o600, 0o664])
def test_export_keeps_an_existing_files_mode(mode: int, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    db = cache_file(tmp_path / "c.db")
    out = tmp_path / "out.jsonl"
    out.write_text("old\n")
    out.chmod(mode)
    assert run(capsys, "db", "export", "--db", str(db), str(out))[0] == 0
    assert stat.S_IMODE(out.stat().st_mode) == mode and out.read_text().startswith('{"type": "header"')


@pytest.mark.parametrize("umask", [0o022, 0o027, 0o077])
def test_a_new_export_gets_the_umasks_mode(umask: int, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    db = cache_file(tmp_path / "c.db")
    old = os.umask(umask)
    try:
        assert run(capsys, "db", "export", "--db", str(db), str(tmp_path / "new.jsonl"))[0] == 0
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "new.jsonl").stat().st_mode) == 0o666 & ~umask


def test_export_through_a_symlink_writes_the_target_and_keeps_the_link(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    db = cache_file(tmp_path / "c.db")
    target = tmp_path / "real.jsonl"
    target.write_text("")
    link = tmp_path / "link.jsonl"
    link.symlink_to(target)
    assert run(capsys, "db", "export", "--db", str(db), str(link))[0] == 0
    assert link.is_symlink() and len(target.read_text().splitlines()) == 3


@pytest.mark.parametrize(
    "target, words",
    [
        ("{tmp}", ["is a directory"]),
        ("{tmp}/absent/out.jsonl", ["cannot write the export", "No such file"]),
        ("/dev/full", ["cannot write the export", "No space left"]),
    ],
)
def test_export_failures_are_one_line(
    target: str, words: list[str], tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    db = cache_file(tmp_path / "c.db")
    before = snapshot(db)
    refused(run(capsys, "db", "export", "--db", str(db), target.format(tmp=tmp_path)), *words)
    assert snapshot(db) == before and stat.S_ISCHR(os.stat("/dev/full").st_mode)


@pytest.mark.parametrize("argv", [["networks"], ["networks", "alexnet"], ["db", "export", "-", "--db", "{db}"]])
def test_output_to_a_full_disk_is_one_line(argv: list[str], tmp_path: Path) -> None:
    db = cache_file(tmp_path / "c.db")
    with open("/dev/full", "w") as full:
        result = subprocess.run(
            [sys.executable, "-m", "ucudnn.cli.main", *[a.format(db=db) for a in argv]],
            stdout=full,
            stderr=subprocess.PIPE,
            text=True,
            timeout=120,
            check=False,
        )
    assert result.returncode in (1, 2) and "Traceback" not in result.stderr, result.stderr
    assert result.stderr.count("\n") == 1 and "No space left" in result.stderr, result.stderr


_KILLED_EXPORT = """
import os, signal, sys
from ucudnn.db import Cache
from ucudnn.db.transfer import export_to
os.replace = lambda *a: os.kill(os.getpid(), signal.SIGKILL)  # killed after writing, before the rename
with Cache(sys.argv[1], readonly=True) as cache:
    export_to(cache, sys.argv[2])
"""


def _temporaries(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.endswith(".tmp"))


def test_a_killed_exports_temporary_is_removed_by_the_next(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    db = cache_file(tmp_path / "c.db")
    out = tmp_path / "out.jsonl"
    killed = subprocess.run([sys.executable, "-c", _KILLED_EXPORT, str(db), str(out)], check=False, timeout=120)
    assert killed.returncode == -9
    (left,) = _temporaries(tmp_path)
    assert left.startswith(".out.jsonl.") and not out.exists()
    assert run(capsys, "db", "export", "--db", str(db), str(out))[0] == 0
    assert _temporaries(tmp_path) == [] and len(out.read_text().splitlines()) == 3


def test_an_export_keeps_the_temporaries_of_writers_that_may_still_run(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """A concurrent export's file (its writer alive, or on another host, or written by an older ucudnn and
    recent) is kept; one unchanged for longer than the bound, and another name's, are judged apart."""
    from ucudnn.db.transfer import _HOST, STALE_TEMPORARY

    db = cache_file(tmp_path / "c.db")
    alive = tmp_path / f".out.jsonl.{_HOST}-{os.getpid()}.a1b2c3.tmp"
    elsewhere = tmp_path / ".out.jsonl.otherhost-1.d4e5f6.tmp"
    unnamed_recent = tmp_path / ".out.jsonl.g7h8i9.tmp"
    unnamed_old = tmp_path / ".out.jsonl.j0k1l2.tmp"
    other_target = tmp_path / f".other.jsonl.{_HOST}-999999999.m3n4.tmp"
    for p in (alive, elsewhere, unnamed_recent, unnamed_old, other_target):
        p.write_text("partial")
    old = time.time() - STALE_TEMPORARY.total_seconds() - 60
    os.utime(unnamed_old, (old, old))
    assert run(capsys, "db", "export", "--db", str(db), str(tmp_path / "out.jsonl"))[0] == 0
    assert _temporaries(tmp_path) == sorted(p.name for p in (alive, elsewhere, unnamed_recent, other_target))


# ---- 2. import refuses records a fresh measurement could not have written ------------------------


def _record(**changes: object) -> dict:
    base = {
        "type": "measurement",
        **DEVICE,
        "problem_key": KEY,
        "kind": "fwd",
        "algo": "gemm",
        "batch": 1,
        "time_ms": 1.0,
        "spread_ms": 0.0,
        "workspace_bytes": 0,
        "reason": "",
        "created_at": "2026-01-01T00:00:00Z",
    }
    return {**base, **changes}


FUTURE = (datetime.now(UTC) + timedelta(days=2)).isoformat()
POISON = {
    "future created_at": (_record(created_at="9999-12-31T00:00:00Z", time_ms=1000.0), "in the future"),
    "two days ahead": (_record(created_at=FUTURE), "in the future"),
    "before 2000": (_record(created_at="1970-01-01T00:00:00Z"), "before 2000"),
    "garbage key": (_record(problem_key="garbage key"), "problem_key"),
    "key of no problem": (_record(problem_key="kind=fwd,c=3"), "missing"),
    "key not canonical": (_record(problem_key="kind=fwd,c=8,h=9,w=9,k=8,r=3,s=3"), "canonical"),
    "kind disagrees": (_record(kind="bwd_data"), "kind"),
    "algo 100000 chars": (_record(algo="a" * 100_000), "algo is 100000 characters"),
    "algo with spaces": (_record(algo="rm -rf"), "white space"),
    "unknown cpu algo": (_record(backend="cpu", algo="magic"), "not a cpu algorithm"),
    "backend not a name": (_record(backend="CPU; DROP TABLE"), "backend"),
    "device with newline": (_record(device="GPU\nX"), "control characters"),
    "versions 10k chars": (_record(versions="v" * 10_000), "versions is 10000"),
    "batch over int32": (_record(batch=2**31), "batch"),
    "workspace over int64": (_record(workspace_bytes=2**63), "workspace_bytes"),
    "time of a year": (_record(time_ms=3.2e10), "time_ms"),
    "time a string": (_record(time_ms="1"), "time_ms"),
    "negative time": (_record(time_ms=-3.0), "time_ms"),
    "negative workspace": (_record(workspace_bytes=-1), "workspace_bytes"),
    "batch zero": (_record(batch=0), "batch"),
    "failure without reason": (_record(time_ms=None, reason=""), "reason"),
    "reason 100k chars": (_record(time_ms=None, reason="r" * 100_000), "reason is"),
    "plan from the future": (
        {"type": "plan", "key": "k", "plan": {}, "created_at": "9999-01-01T00:00:00Z"},
        "in the future",
    ),
    "plan key 10k chars": (
        {"type": "plan", "key": "k" * 10_000, "plan": {}, "created_at": "2026-01-01T00:00:00Z"},
        "plan key is",
    ),
}


@pytest.mark.parametrize("name", POISON)
def test_import_refuses_a_poisoned_record_whole(name: str, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    db = cache_file(tmp_path / "c.db")
    before = snapshot(db)
    bad, words = POISON[name]
    header = {"type": "header", "format": "ucudnn-cache-export", "version": 1}
    source = tmp_path / "in.jsonl"
    # Good records first: an import that wrote as it read would leave them behind.
    good = [_record(algo=f"good{i}") for i in range(3)]
    source.write_text("".join(json.dumps(r) + "\n" for r in [header, *good, bad]))
    refused(run(capsys, "db", "import", "--db", str(db), str(source)), "line 5", words)
    assert snapshot(db) == before


def test_import_from_a_cache_holding_a_future_row_is_refused_whole(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    source = cache_file(tmp_path / "source.db")
    import sqlite3

    with contextlib.closing(sqlite3.connect(source)) as conn, conn:
        conn.execute("UPDATE measurements SET created_at = '9999-12-31 00:00:00.000000'")
    db = cache_file(tmp_path / "c.db")
    before = snapshot(db)
    refused(run(capsys, "db", "import", "--db", str(db), str(source)), "measurement 1", "in the future")
    assert snapshot(db) == before


def test_an_export_imports_back_after_validation(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """The checks refuse poison, not real data: a real benchmark's export imports cleanly."""
    db = tmp_path / "c.db"
    assert run(capsys, "bench", "--layer", SMALL, *FAST, "--db", str(db))[0] == 0
    assert run(capsys, "db", "export", "--db", str(db), str(tmp_path / "e.jsonl"))[0] == 0
    code, out, err = run(capsys, "db", "import", "--db", str(tmp_path / "d.db"), str(tmp_path / "e.jsonl"))
    assert code == 0 and "inserted" in out, err


# ---- 3. sizes that cannot exist or be allocated -------------------------------------------------


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--layer", "n=1,c=64,h=1000000,w=1000000,k=64,r=3,s=3"], ["needs", "TiB", "available"]),
        (["--layer", "n=1,c=99999999999999999999,h=8,w=8,k=64,r=3,s=3"], ["needs", "available"]),
        (["--layer", SMALL, "--batch", "100000000"], ["needs", "batch 100000000", "available"]),
        (["--layer", "n=1,c=8,h=8,w=8,k=99999999999999,r=1,s=1"], ["needs", "available"]),
    ],
)
def test_problems_too_big_for_the_machine_are_refused_first(
    argv: list[str], words: list[str], tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    start = time.perf_counter()
    refused(run(capsys, "bench", *argv, *FAST, "--db", str(tmp_path / "c.db")), *words)
    assert time.perf_counter() - start < 30  # refused before benchmarking, not after minutes
    assert not (tmp_path / "c.db").exists()


def test_handle_and_convert_refuse_with_the_bytes_not_a_memory_error(monkeypatch: pytest.MonkeyPatch) -> None:
    from ucudnn import Handle
    from ucudnn.kernel import resources
    from ucudnn.kernel.resources import NotEnoughMemory

    handle = Handle(backend="cpu", policy="undivided", reps=1, db="sqlite://")
    with pytest.raises(NotEnoughMemory, match="needs .* TiB .* available"):
        handle.prepare("fwd", (1, 64, 10**6, 10**6), (64, 64, 3, 3))
    # A machine with 64 KiB: a small layer through convert() is refused the same way.
    monkeypatch.setattr(resources, "available_bytes", lambda backend: 64 * 2**10)
    torch = pytest.importorskip("torch", reason="convert() needs PyTorch")
    from ucudnn.torch import convert

    model = convert(
        torch.nn.Sequential(torch.nn.Conv2d(8, 8, 3, padding=1)),
        backend="cpu",
        policy="undivided",
        reps=1,
        db="sqlite://",
    )
    with pytest.raises(NotEnoughMemory, match="64.0 KiB"):
        model(torch.randn(4, 8, 32, 32))


@pytest.mark.parametrize(
    "text, value",
    [
        ("64MiB", 64 * 2**20),
        ("64MB", 64 * 10**6),
        ("1.5KiB", 1536),
        ("0.5KiB", 512),
        ("1000000", 10**6),
        ("0", 0),
        (" 2 GiB ", 2 * 2**30),
        ("0.1GB", 10**8),
    ],
)
def test_sizes_read_exactly(text: str, value: int) -> None:
    assert parse_size(text) == value


@pytest.mark.parametrize(
    "text, words",
    [
        ("0.5", ["not a whole number"]),
        ("0.0003kB", ["not a whole number"]),
        ("64m", ["ambiguous", "64MiB", "64MB"]),
        ("64mb", ["ambiguous", "64MiB", "64MB"]),
        ("64mib", ["unknown unit", "64MiB"]),
        ("2g", ["ambiguous"]),
        ("1k", ["ambiguous"]),
        ("99999999999TB", ["over the largest"]),
        ("-1", ["must not be negative"]),
        ("-8MiB", ["must not be negative"]),
        ("1e9", []),
        ("64 MiBs", []),
        ("", []),
        ("nan", []),
    ],
)
def test_sizes_that_cannot_be_are_refused(
    text: str, words: list[str], tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    refused(
        run(capsys, "bench", "--layer", SMALL, *FAST, "--workspace", text, "--db", str(tmp_path / "c.db")),
        "--workspace",
        *words,
    )
    assert not (tmp_path / "c.db").exists()


@pytest.mark.parametrize(
    "nbytes, text",
    [
        (0, "0 B"),
        (1023, "1023 B"),
        (2**20, "1.0 MiB"),
        (2**40 * 3, "3.0 TiB"),
        (2**63 - 1, "8.0 EiB"),
        (1023999999999999982820130816, "888178419.7 EiB"),
    ],
)
def test_huge_sizes_print_sanely(nbytes: int, text: str) -> None:
    assert format_size(nbytes) == text


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--nope"], ["No such option", "--nope"]),
        (["--layer", SMALL, "--reps", "abc"], ["--reps", "abc"]),
        (["--layer", SMALL, "--backend", "sideways"], ["--backend", "sideways"]),
    ],
)
def test_what_click_refuses_reads_like_every_other_refusal(
    argv: list[str], words: list[str], capsys: pytest.CaptureFixture
) -> None:
    refused(run(capsys, "bench", *argv), *words)


def test_a_cache_in_a_folder_that_does_not_exist_says_so(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    missing = tmp_path / "no-such-folder"
    refused(
        run(capsys, "bench", "--layer", SMALL, *FAST, "--db", str(missing / "c.db")), str(missing), "does not exist"
    )
    assert not missing.exists()


# ---- 4. unsupported is said as such (exit 2); exit 1 stays for a limit nothing fits ---------------


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--layer", SMALL + ",dtype=float16"], ["cannot run", "float16"]),
        (["--layer", SMALL + ",dtype=bfloat16"], ["cannot run", "bfloat16"]),
        (["--layer", SMALL + ",layout=NHWC"], ["cannot run", "NHWC"]),
        (["--layer", SMALL + ",compute_type=float64"], ["cannot run", "compute_type"]),
        (["--layer", "n=2,c=4,h=9,w=9,k=4,r=5,s=5", "--algos", "winograd"], ["cannot run", "winograd"]),
        (["--layer", SMALL, "--policy", "64,128"], ["every size is larger than the batch 2"]),
    ],
)
def test_unsupported_requests_exit_2_with_the_reason(
    argv: list[str], words: list[str], tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    args = [a for a in FAST if a not in ("--policy", "undivided")] if "--policy" in argv else FAST
    refused(run(capsys, "bench", *argv, *args, "--db", str(tmp_path / "c.db")), *words)
    assert "nothing fits" not in capsys.readouterr().err


def test_a_limit_nothing_fits_still_exits_1(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    code, _, err = run(
        capsys,
        "bench",
        "--layer",
        SMALL,
        *FAST,
        "--algos",
        "im2col_gemm",
        "--workspace",
        "1",
        "--db",
        str(tmp_path / "c.db"),
    )
    assert code == 1 and "Traceback" not in err and err.count("\n") == 1


def test_selftest_skips_what_the_backend_lacks(capsys: pytest.CaptureFixture) -> None:
    code, out, err = run(capsys, "selftest", "--backend", "cpu", "--dtype", "float16", "--layer", SMALL)
    refused((code, out, err), "none of the", "float16")
    assert "0 failed" in out and "FAIL" not in out
    assert "skip im2col_gemm" in out and "not float16" in out


# ---- 5. late or unhandled failures --------------------------------------------------------------


@pytest.mark.parametrize(
    "plot, words",
    [
        ("{tmp}/absent/wd.png", ["does not exist"]),
        ("{tmp}", ["is a directory"]),
        ("{tmp}/wd.nosuchformat", ["cannot write '.nosuchformat'"]),
        ("/proc/wd.png", ["cannot be written"]),
    ],
)
def test_plot_path_is_checked_before_the_benchmark(
    plot: str, words: list[str], tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    refused(
        run(
            capsys,
            "bench",
            "--layer",
            SMALL,
            *FAST,
            "--total-workspace",
            "1MiB",
            "--plot",
            plot.format(tmp=tmp_path),
            "--db",
            str(tmp_path / "c.db"),
        ),
        "--plot",
        *words,
    )
    assert not (tmp_path / "c.db").exists()  # nothing was measured


@pytest.mark.parametrize("days", ["99999999999999", "1e300", "3652059"])
def test_prune_older_than_any_number_of_days(days: str, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    db = cache_file(tmp_path / "c.db")
    code, out, err = run(capsys, "db", "prune", "--db", str(db), "--older-than", days)
    assert code == 0 and "removed 0 rows" in out, err


@pytest.mark.parametrize("days", ["inf", "nan", "-1"])
def test_prune_refuses_days_that_are_no_number(days: str, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    db = cache_file(tmp_path / "c.db")
    before = snapshot(db)
    refused(run(capsys, "db", "prune", "--db", str(db), "--older-than", days))
    assert snapshot(db) == before


@pytest.mark.parametrize("reps", ["0", "-3", "1001", "99999999999999999999", "x"])
def test_reps_are_bounded(reps: str, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    argv = [a if a != "1" else reps for a in FAST]
    refused(run(capsys, "bench", "--layer", SMALL, *argv, "--db", str(tmp_path / "c.db")), "--reps")


# ---- 6. counted once -----------------------------------------------------------------------------


@pytest.mark.parametrize("kinds, expected", [("fwd,fwd", ["fwd"]), ("fwd, fwd ,bwd_data,fwd", ["fwd", "bwd_data"])])
def test_repeated_kinds_and_algos_count_once(
    kinds: str, expected: list[str], tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    argv = [a for a in FAST if a not in ("--kinds", "fwd")]
    code, out, err = run(
        capsys,
        "bench",
        "--layer",
        SMALL,
        *argv,
        "--kinds",
        kinds,
        "--algos",
        "im2col_gemm,im2col_gemm",
        "--json",
        "--db",
        str(tmp_path / "c.db"),
    )
    assert code == 0, err
    report = json.loads(out)
    assert [k["kind"] for k in report["kernels"]] == expected
    assert report["total"]["time_ms"] == pytest.approx(sum(k["time_ms"] for k in report["kernels"]))
    assert report["benchmark"]["measured"] == len(expected)


# ---- 8. a read-only cache ---------------------------------------------------------------------------


@contextlib.contextmanager
def read_only_mount(folder: Path):
    """`folder` bind-mounted read-only over itself (needs CAP_SYS_ADMIN); skips where impossible."""
    result = subprocess.run(
        ["mount", "--bind", "-o", "ro", str(folder), str(folder)], capture_output=True, text=True, check=False
    )
    if result.returncode != 0:
        pytest.skip(f"cannot make a read-only mount here ({result.stderr.strip() or 'mount failed'})")
    try:
        if os.access(folder, os.W_OK):  # an old kernel ignores ro on the first bind: remount
            subprocess.run(["mount", "-o", "remount,bind,ro", str(folder)], check=True)
        yield
    finally:
        subprocess.run(["umount", str(folder)], check=True)


def test_a_cache_on_a_read_only_mount_is_read(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    folder = tmp_path / "ro"
    folder.mkdir()
    db = folder / "cache.db"
    bench = ["bench", "--layer", SMALL, *FAST, "--algos", "im2col_gemm", "--json", "--db", str(db)]
    assert run(capsys, *bench)[0] == 0
    before = snapshot(db)
    with read_only_mount(folder):
        code, out, err = run(capsys, "db", "info", "--db", str(db))
        assert code == 0 and "measurements    1" in out, err
        code, _, err = run(capsys, "db", "export", "--db", str(db), str(tmp_path / "e.jsonl"))
        assert code == 0, err
        code, out, err = run(capsys, "db", "import", "--db", str(tmp_path / "other.db"), str(db))
        assert code == 0 and "1 inserted" in out, err
        code, out, err = run(capsys, *bench)  # everything it needs is cached: served
        assert code == 0 and json.loads(out)["benchmark"] == {**json.loads(out)["benchmark"], "measured": 0}, err
        # A new measurement would have to be stored: refused, saying so.
        refused(run(capsys, *[a if a != "im2col_gemm" else "fft" for a in bench]), "read-only", "not writable")
        refused(run(capsys, "db", "import", "--db", str(db), str(tmp_path / "e.jsonl")), "read-only")
        refused(run(capsys, "db", "prune", "--db", str(db), "--all"), "read-only")
    assert snapshot(db) == before and sorted(p.name for p in folder.iterdir()) == ["cache.db"]


# ---- 9. the versions that can change a measurement ------------------------------------------------


def test_installing_torch_keeps_the_numpy_measurements(monkeypatch: pytest.MonkeyPatch) -> None:
    from ucudnn.backends.base import DeviceInfo
    from ucudnn.backends.cpu import backend as cpu
    from ucudnn.kernel.measure import measure_table

    backend = cpu.CpuBackend()
    problem = ConvProblem.parse(SMALL)
    with Cache("sqlite://") as cache:
        _, first = measure_table(backend, problem, [2], cache=cache, algos=["im2col_gemm", "fft"], reps=1)
        assert first.measured == 2
        real = backend.device
        versions = dict(real.versions)
        versions["torch"] = "99.0" if "torch" in versions else "1.0"  # torch installed or upgraded
        changed = DeviceInfo(real.model, real.memory_bytes, tuple(sorted(versions.items())))
        monkeypatch.setattr(cpu, "_device_info", lambda: changed)
        _, again = measure_table(backend, problem, [2], cache=cache, algos=["im2col_gemm", "fft"], reps=1)
        assert (again.measured, again.cached) == (0, 2)
        # ...while a BLAS thread setting, which changes NumPy timings, is part of their key.
        versions["OMP_NUM_THREADS"] = "7"
        threads = DeviceInfo(real.model, real.memory_bytes, tuple(sorted(versions.items())))
        monkeypatch.setattr(cpu, "_device_info", lambda: threads)
        _, third = measure_table(backend, problem, [2], cache=cache, algos=["im2col_gemm"], reps=1)
        assert third.measured == 1
    assert "torch" in backend.versions_for("native") and "torch" not in backend.versions_for("fft")
    assert "numpy" in backend.versions_for("fft") and "numpy=" not in backend.versions_for("native")


# ---- 9. what a newcomer reads and sees ---------------------------------------------------------------


def _wd_report(layers: int, baseline: bool = True):
    from ucudnn.solver.types import Configuration

    from ucudnn.kernel.measure import BenchStats
    from ucudnn.network.optimize import KernelPlan, Report

    problem = ConvProblem.parse(SMALL)
    micro = MicroConfig("fft", 2, 1.0, 2**20)
    kernels = tuple(
        KernelPlan(f"conv{i}", problem.with_kind(kind), micro if baseline and i else None, Configuration((micro,)))
        for i in range(layers)
        for kind in ("fwd", "bwd_data", "bwd_filter")
    )
    front = {p.key: [Configuration((micro,))] for p in (k.problem for k in kernels)}
    return Report("cpu", "cpu", "powerOfTwo", "WD", None, 2**30, 2, kernels, BenchStats(), front)


def test_a_total_without_a_baseline_prints_a_dash_not_inf() -> None:
    from ucudnn.cli.bench import format_report

    text = format_report(_wd_report(3))
    total = next(line for line in text.splitlines() if line.startswith("total"))
    assert "inf" not in text and total.split()[1] == "-"
    assert json.loads(json.dumps(_wd_report(3).to_json(), allow_nan=False))["total"]["baseline_ms"] is None


def test_the_wd_plot_of_159_kernels_has_readable_labels(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from ucudnn.network.plot import MAX_TICK_LABELS, layer_ticks, plot_wd

    layers = [f"layer{i}" for i in range(53) for _ in range(3)]  # ResNet-50: 53 layers, 159 kernels
    positions, labels = layer_ticks(layers)
    assert 20 <= len(labels) <= MAX_TICK_LABELS and labels[:2] == ["layer0", "layer2"]
    assert positions[0] == 1.0 and all(b - a >= 3 for a, b in itertools.pairwise(positions))
    plot_wd(_wd_report(53), str(tmp_path / "wd.png"))
    assert (tmp_path / "wd.png").read_bytes()[:4] == b"\x89PNG"


def test_readme_and_docs_stand_alone() -> None:
    root = Path(__file__).resolve().parents[1]
    texts = {p: p.read_text() for p in [root / "README.md", *sorted((root / "docs").glob("*.md"))]}
    assert len(texts) >= 3, "docs/ holds the design and the JSON schemas"
    for path, text in texts.items():
        assert "../shared" not in text and "/work/" not in text, path
    readme = texts[root / "README.md"]
    assert ".venv/bin/activate" in readme and "docs/" in readme


def test_the_memory_check_counts_the_smallest_workspace_near_the_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    from ucudnn.backends.cpu import CpuBackend
    from ucudnn.kernel import resources

    backend, problem = CpuBackend(), ConvProblem.parse(SMALL)
    operands = resources.operand_bytes(problem)
    workspace = backend.workspace_size(problem, "shift_gemm")
    assert operands == (2 * 4 * 6 * 6 * 2 + 4 * 4 * 3 * 3) * 4 and 0 < workspace < operands
    monkeypatch.setattr(resources, "available_bytes", lambda b: operands + workspace)
    resources.check_fits(backend, problem, algos=["shift_gemm", "im2col_gemm"])  # exactly fits
    monkeypatch.setattr(resources, "available_bytes", lambda b: operands + workspace - 1)
    with pytest.raises(resources.NotEnoughMemory, match=f"needs .*{operands + workspace} bytes"):
        resources.check_fits(backend, problem, algos=["shift_gemm", "im2col_gemm"])
    # Far from the limit, workspaces are not sized (a plan per cuDNN engine): the benchmark
    # records a candidate whose workspace does not fit as out of memory and runs the others.
    monkeypatch.setattr(resources, "available_bytes", lambda b: 3 * operands)
    monkeypatch.setattr(backend, "workspace_size", lambda *a: pytest.fail("sized far from the limit"))
    resources.check_fits(backend, problem, algos=["im2col_gemm"])


def test_export_over_another_users_file_keeps_its_owner(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    if os.geteuid() != 0:
        pytest.skip("only root can write over another user's file here")
    db = cache_file(tmp_path / "c.db")
    out = tmp_path / "theirs.jsonl"
    out.write_text("")
    os.chown(out, 12345, 23456)
    assert run(capsys, "db", "export", "--db", str(db), str(out))[0] == 0
    assert (out.stat().st_uid, out.stat().st_gid) == (12345, 23456) and out.read_text()
