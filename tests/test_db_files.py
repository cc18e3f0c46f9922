"""Bad files and places: nothing is written to a file that is not a healthy ucudnn cache.

Also the schema version: stored, a newer one refused, an older one migrated or refused.
"""

from __future__ import annotations

import ast
import hashlib
import os
import sqlite3
import subprocess
from pathlib import Path

import pytest
from pg_server import db_url, pg_server  # noqa: F401
from sqlalchemy import create_engine, text
from ucudnn.cli.main import main
from ucudnn.db import SCHEMA_VERSION, Cache
from ucudnn.db import schema as cache_module
from ucudnn.solver.types import MicroConfig

from ucudnn.errors import DatabaseError

DEVICE = {"device": "dev", "backend": "cpu", "versions": "numpy=2.1"}
KEY = "kind=fwd,c=3,h=8,w=8,k=4,r=3,s=3"
MICROS = [MicroConfig(f"algo{i}", b, 0.5 * i + b, 64 * b) for i in range(5) for b in range(1, 41)]


def fingerprint(folder: Path) -> dict[str, str]:
    """Every file in `folder` with the SHA-256 of its bytes."""
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


def good_cache(path: Path) -> Path:
    with Cache(path) as c:
        c.store(problem_key=KEY, micros=MICROS, **DEVICE)
        c.put_plan("plan", {"x": 1})
    assert not Path(f"{path}-wal").exists()  # closed cleanly: the WAL was checkpointed
    return path


def _text_file(p: Path) -> None:
    p.write_text("this is my shopping list\neggs\n")


def _binary_junk(p: Path) -> None:
    p.write_bytes(bytes(range(256)) * 64)


def _header_then_junk(p: Path) -> None:
    p.write_bytes(b"SQLite format 3\x00" + b"\xff" * 8000)


def _short_header(p: Path) -> None:
    p.write_bytes(b"SQLite format 3\x00\x10\x00")


def _truncated(p: Path) -> None:
    good_cache(p)
    data = p.read_bytes()
    p.write_bytes(data[: len(data) // 3])


def _page_one_smashed(p: Path) -> None:
    good_cache(p)
    data = bytearray(p.read_bytes())
    data[100:2000] = os.urandom(1900)
    p.write_bytes(bytes(data))


def _data_page_smashed(p: Path) -> None:
    good_cache(p)
    data = bytearray(p.read_bytes())
    page = 4096
    assert len(data) > 4 * page
    data[3 * page : 4 * page] = b"\x0d" + os.urandom(page - 1)
    p.write_bytes(bytes(data))


def _free_space_corrupt(p: Path) -> None:
    """A data page whose first-freeblock pointer is out of range: SQLite's check reports it in two lines."""
    good_cache(p)
    data = bytearray(p.read_bytes())
    page = 4096
    assert data[3 * page] == 0x0D  # a table leaf page
    data[3 * page + 1 : 3 * page + 3] = b"\x0f\xf0"
    p.write_bytes(bytes(data))


BAD_FILES = {
    "text": _text_file,
    "binary": _binary_junk,
    "header_then_junk": _header_then_junk,
    "short_header": _short_header,
    "truncated": _truncated,
    "page_one_smashed": _page_one_smashed,
    "data_page_smashed": _data_page_smashed,
    "free_space_corrupt": _free_space_corrupt,
}


@pytest.mark.parametrize("make", BAD_FILES.values(), ids=BAD_FILES.keys())
@pytest.mark.parametrize("readonly", [False, True], ids=["rw", "ro"])
def test_bad_file_is_refused_and_left_untouched(tmp_path: Path, make, readonly: bool) -> None:
    path = tmp_path / "cache.db"
    make(path)
    before = fingerprint(tmp_path)
    with pytest.raises(DatabaseError) as info:
        Cache(path, readonly=readonly)
    message = str(info.value)
    assert str(path) in message and "\n" not in message
    assert fingerprint(tmp_path) == before  # same bytes, and no -wal/-shm/-journal beside it


@pytest.mark.parametrize("make", [_text_file, _data_page_smashed], ids=["text", "data_page_smashed"])
@pytest.mark.parametrize("command", [["info"], ["export", "out.jsonl"], ["prune", "--all"], ["import", "other.jsonl"]])
def test_cli_bad_file_exit_2_one_line(
    tmp_path: Path, make, command: list[str], capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    path = tmp_path / "cache.db"
    make(path)
    (tmp_path / "other.jsonl").write_text("")
    before = fingerprint(tmp_path)
    assert main(["db", *command, "--db", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("ucudnn: error: ") and err.count("\n") == 1 and "Traceback" not in err
    assert fingerprint(tmp_path) == before


def test_foreign_sqlite_database_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "app.db"
    con = sqlite3.connect(path)
    con.execute("CREATE TABLE customers (id INTEGER PRIMARY KEY, name TEXT)")
    con.commit()
    con.close()
    before = fingerprint(tmp_path)
    with pytest.raises(DatabaseError, match="not a ucudnn cache.*customers"):
        Cache(path)
    assert fingerprint(tmp_path) == before


def test_empty_file_becomes_a_cache(tmp_path: Path) -> None:
    path = tmp_path / "cache.db"
    path.touch()
    with Cache(path) as c:
        assert c.store(problem_key=KEY, micros=MICROS, **DEVICE) == len(MICROS)


def test_directory_as_path(tmp_path: Path) -> None:
    with pytest.raises(DatabaseError, match="is a directory"):
        Cache(tmp_path)


def test_parent_is_not_a_directory(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    with pytest.raises(DatabaseError, match="not a directory"):
        Cache(tmp_path / "file" / "cache.db")


def test_missing_file_with_create_false(tmp_path: Path) -> None:
    with pytest.raises(DatabaseError, match="no cache at"):
        Cache(tmp_path / "absent.db", create=False)
    with pytest.raises(DatabaseError, match="no cache at"):
        Cache(tmp_path / "absent.db", readonly=True)
    assert list(tmp_path.iterdir()) == []


def _make_unwritable(folder: Path) -> str | None:
    """Make `folder` unwritable for this process; returns how, or None if it cannot be done here."""
    if os.geteuid() != 0:
        folder.chmod(0o555)
        return "chmod"
    # Root ignores permission bits, but not the immutable attribute (where the file system has it).
    result = subprocess.run(["chattr", "+i", str(folder)], capture_output=True, check=False)
    return "chattr" if result.returncode == 0 else None


def _restore(folder: Path, how: str) -> None:
    if how == "chmod":
        folder.chmod(0o755)
    else:
        subprocess.run(["chattr", "-i", str(folder)], check=True)


@pytest.mark.parametrize("exists", [False, True], ids=["new", "existing"])
def test_unwritable_directory(tmp_path: Path, exists: bool) -> None:
    folder = tmp_path / "ro"
    folder.mkdir()
    if exists:
        good_cache(folder / "cache.db")
    how = _make_unwritable(folder)
    if how is None:
        pytest.skip(
            "running as root on a file system without chattr +i: no way to make a directory unwritable for this process"
        )
    try:
        before = fingerprint(folder)
        if exists:  # opened read-only: it can be read, and a write says why it cannot be stored
            with Cache(folder / "cache.db") as cache:
                assert cache.readonly and "not writable" in cache.readonly_reason
                assert cache.info()["measurements"] > 0
                with pytest.raises(DatabaseError, match="not writable.*read-only"):
                    cache.put_plan("p", {"a": 1})
        else:
            with pytest.raises(DatabaseError, match="not writable"):
                Cache(folder / "cache.db")
        assert fingerprint(folder) == before
    finally:
        _restore(folder, how)


# ---- schema versions ---------------------------------------------------------------------------


def _set_version(url: str, value: str) -> None:
    engine = create_engine(url)
    with engine.begin() as conn:
        conn.execute(text("UPDATE meta SET value = :v WHERE key = 'schema_version'"), {"v": value})
    engine.dispose()


def _filled(url: str) -> None:
    with Cache(url) as c:
        c.store(problem_key=KEY, micros=MICROS, **DEVICE)


def test_schema_version_is_stored(db_url: str) -> None:  # noqa: F811
    _filled(db_url)
    engine = create_engine(db_url)
    with engine.connect() as conn:
        assert conn.execute(text("SELECT value FROM meta WHERE key = 'schema_version'")).scalar() == str(SCHEMA_VERSION)
    engine.dispose()


def _snapshot(url: str) -> object:
    if url.startswith("sqlite:///"):
        return fingerprint(Path(url.removeprefix("sqlite:///")).parent)
    engine = create_engine(url)
    with engine.connect() as conn:
        rows = (
            conn.execute(text("SELECT * FROM meta ORDER BY key")).all(),
            conn.execute(text("SELECT count(*) FROM measurements")).scalar(),
        )
    engine.dispose()
    return rows


def test_newer_schema_is_refused(db_url: str) -> None:  # noqa: F811
    _filled(db_url)
    _set_version(db_url, str(SCHEMA_VERSION + 1))
    before = _snapshot(db_url)
    for readonly in (False, True):
        with pytest.raises(DatabaseError, match=f"schema version {SCHEMA_VERSION + 1}, newer"):
            Cache(db_url, readonly=readonly)
    assert _snapshot(db_url) == before


def test_older_schema_without_migration_is_refused(db_url: str) -> None:  # noqa: F811
    _filled(db_url)
    _set_version(db_url, str(SCHEMA_VERSION - 1))
    before = _snapshot(db_url)
    with pytest.raises(DatabaseError, match="older.*cannot migrate.*export"):
        Cache(db_url)
    assert _snapshot(db_url) == before


def test_older_schema_is_migrated(db_url: str, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    _filled(db_url)
    old = SCHEMA_VERSION - 1
    _set_version(db_url, str(old))
    ran = []
    monkeypatch.setitem(cache_module._MIGRATIONS, old, lambda conn: ran.append(old))
    with Cache(db_url) as c:
        assert ran == [old]
        assert c.info()["schema_version"] == SCHEMA_VERSION
        assert len(c.lookup(problem_key=KEY, batches=None, **DEVICE)) == len(MICROS)  # nothing dropped
    with Cache(db_url):
        assert ran == [old]  # migrated once


def test_unreadable_schema_version_is_refused(db_url: str) -> None:  # noqa: F811
    _filled(db_url)
    _set_version(db_url, "banana")
    with pytest.raises(DatabaseError, match="no readable schema version"):
        Cache(db_url)


def test_readonly_open_of_empty_database(db_url: str) -> None:  # noqa: F811
    if db_url.startswith("sqlite"):
        Path(db_url.removeprefix("sqlite:///")).touch()
    with pytest.raises(DatabaseError, match="is empty"):
        Cache(db_url, readonly=True)


def test_db_package_imports_no_runtime() -> None:
    """db/ may use ucudnn.errors, ucudnn.solver.types, the value ucudnn.problem (an import checks
    that a problem key parses) and itself; never the runtime."""
    allowed = ("ucudnn.errors", "ucudnn.solver.types", "ucudnn.problem", "ucudnn.db")
    folder = Path(cache_module.__file__).parent
    for source in sorted(folder.glob("*.py")):
        for node in ast.walk(ast.parse(source.read_text())):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom)
                else []
            )
            for name in names:
                if name.startswith("ucudnn"):
                    assert name.startswith(allowed), f"{source.name} imports {name}"
