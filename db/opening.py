"""Opening a cache: never damage what is at its URL, and connect so that concurrent writers queue.

A SQLite file is checked read-only first (its 16-byte header, then its schema and a quick
integrity check through an `immutable` or `mode=ro` connection); only a file that is empty,
absent, or a ucudnn cache of a known schema version is then opened for writing. Anything else
raises `DatabaseError` and leaves the file as it was. An existing cache that cannot be written
here is opened read-only instead.

The engine is set up for many writers: SQLite runs in WAL mode with a busy timeout, and every
write transaction starts with `BEGIN IMMEDIATE`, so writers queue for the lock instead of failing
when a read lock cannot be upgraded.
"""

from __future__ import annotations

import logging
import os
import sqlite3
import urllib.parse
from pathlib import Path

from sqlalchemy import Connection, Engine, create_engine, event
from sqlalchemy import exc as sa_exc
from sqlalchemy.engine import URL
from sqlalchemy.pool import NullPool
from ucudnn.db.location import ENV_VAR
from ucudnn.db.retry import _reason, retry
from ucudnn.db.schema import _schema_version

from ucudnn.errors import DatabaseError

log = logging.getLogger("ucudnn.db.cache")  # the cache's one logger, as before db/ was split

SQLITE_HEADER = b"SQLite format 3\x00"
# A writer waits this long for SQLite's lock before the busy handler gives up; long enough for
# any one transaction of ours, short enough that a stuck process is reported.
SQLITE_BUSY_TIMEOUT_S = 30.0
# Opening a SQLite file runs PRAGMA quick_check (about 5 ms per MiB here) up to this size, to
# refuse a damaged file before writing to it. A larger cache gets the header and schema checks
# only; damage elsewhere is still reported (as DatabaseError) when the damaged page is read.
QUICK_CHECK_MAX_BYTES = 64 * 2**20


def _ro_uri(path: Path, *, immutable: bool) -> str:
    quoted = urllib.parse.quote(str(path), safe="/")
    return f"file:{quoted}?mode=ro" + ("&immutable=1" if immutable else "")


def _unwritable(path: Path) -> str | None:
    """Why an existing cache file cannot be written here (None when it can).

    `os.access` answers for this process, root included: a read-only mount gives EROFS even to
    root. SQLite writes -wal and -shm files beside the database, so the folder counts too.
    """
    if not os.access(path, os.W_OK):
        return f"the file {path} is not writable"
    if not os.access(path.parent, os.W_OK | os.X_OK):
        return f"the directory {path.parent} is not writable"
    return None


def _precheck_sqlite_file(path: Path, *, readonly: bool) -> str | None:
    """Validate a SQLite file without writing anything; returns why it must be opened read-only.

    An existing cache that cannot be written (a read-only mount, a cache baked into an image)
    is opened read-only instead of refused: it serves every lookup, and only a write fails.

    Order matters: the header is read with plain `open(..., "rb")`, and only a file that starts
    with SQLite's header is handed to SQLite, through a read-only connection, for the schema
    check and (up to QUICK_CHECK_MAX_BYTES) an integrity check. A WAL file that no
    process has open (no -wal/-shm beside it) is opened `immutable`, so that not even those side
    files are created next to a file that may be damaged.
    """
    where = f"cache {path}"
    if path.is_dir():
        raise DatabaseError(f"{where} is a directory; pass a file path or URL with --db")
    if not path.exists():
        if readonly:
            raise DatabaseError(f"no cache at {path}; run a benchmark to create one, or pass --db")
        _check_writable_dir(path.parent, path)
        return None
    try:
        with open(path, "rb") as fp:
            header = fp.read(100)
    except OSError as exc:
        raise DatabaseError(f"cannot read {where}: {exc.strerror or exc}") from exc
    unwritable = _unwritable(path)
    if not header:
        if unwritable and not readonly:  # an empty database must be written to become a cache
            raise DatabaseError(
                f"cannot create cache {path}: {unwritable}; pass --db or set {ENV_VAR} to a writable place"
            )
        return None  # SQLite treats an empty file as an empty database
    if not header.startswith(SQLITE_HEADER):
        raise DatabaseError(
            f"{where} is not a SQLite database (it starts with {header[:16]!r}); move it away or pass another --db"
        )
    if len(header) < 100:
        raise DatabaseError(
            f"{where} is damaged: it is {len(header)} bytes, shorter than a SQLite "
            f"header; move it away or pass another --db"
        )
    uri = _ro_uri(path, immutable=_immutable(path, header, unwritable))
    engine = create_engine(
        URL.create("sqlite", database=str(path)),
        poolclass=NullPool,
        creator=lambda: sqlite3.connect(uri, uri=True, timeout=SQLITE_BUSY_TIMEOUT_S),
    )
    try:
        with engine.connect() as conn:
            _schema_version(conn, where)
            problems = ["ok"]
            if path.stat().st_size <= QUICK_CHECK_MAX_BYTES:
                # a problem may span lines ("*** in database main ***\nPage 4: ..."): one line each
                problems = [" ".join(str(row[0]).split()) for row in conn.exec_driver_sql("PRAGMA quick_check(5)")]
            if problems != ["ok"]:
                raise DatabaseError(
                    f"{where} is damaged (integrity check: {'; '.join(problems)}); move it away or pass another --db"
                )
    except sa_exc.DBAPIError as exc:
        raise DatabaseError(
            f"{where} cannot be read as a database ({_reason(exc)}); move it away or pass another --db"
        ) from exc
    finally:
        engine.dispose()
    return unwritable


def _in_use(path: Path) -> bool:
    """Whether some process may have `path` open for writing (its side files exist)."""
    return any(Path(f"{path}{suffix}").exists() for suffix in ("-wal", "-shm", "-journal"))


def _immutable(path: Path, header: bytes, unwritable: str | None) -> bool:
    """Whether the pre-check reads `path` with SQLite's `immutable` flag: a WAL file that nobody
    has open, or a file that cannot be written here. A read-only WAL connection otherwise needs
    a -shm file, which it would create beside a file that may be damaged, or cannot create on a
    read-only mount."""
    return not _in_use(path) and (header[18] == 2 or unwritable is not None)


def _check_writable_dir(folder: Path, path: Path) -> None:
    if not folder.exists():
        raise DatabaseError(f"cannot create cache {path}: the folder {folder} does not exist; create it first")
    if not folder.is_dir():
        raise DatabaseError(f"cannot create cache {path}: {folder} is not a directory")
    # SQLite writes -wal and -shm files beside the database, so the folder must be writable.
    if not os.access(folder, os.W_OK | os.X_OK):
        raise DatabaseError(
            f"cannot write cache {path}: the directory {folder} is not writable; "
            f"pass --db or set {ENV_VAR} to a writable place"
        )


def open_engine(url: URL, path: Path | None, *, readonly: bool, where: str) -> Engine:
    """The engine of the cache at `url` (`path`: its SQLite file, if any), with SQLite's pragmas
    and `BEGIN IMMEDIATE` for writes; a read-only one never writes to `path`."""
    if url.get_backend_name() != "sqlite":
        try:
            engine = create_engine(url, pool_pre_ping=True)
        except (ImportError, sa_exc.NoSuchModuleError) as exc:
            raise DatabaseError(
                f"cannot use {where}: {exc}; install the driver with pip install 'psycopg[binary]'"
            ) from exc
        return engine
    if path is not None and readonly:
        # Immutable only where nobody can be writing (a read-only mount): elsewhere a writer may
        # start while this connection reads, and it must see the writer's locks.
        uri = _ro_uri(path, immutable=_unwritable(path) is not None and not _in_use(path))
        engine = create_engine(
            URL.create("sqlite", database=str(path)),
            creator=lambda: sqlite3.connect(uri, uri=True, timeout=SQLITE_BUSY_TIMEOUT_S, check_same_thread=False),
        )
    else:
        engine = create_engine(url, connect_args={"timeout": SQLITE_BUSY_TIMEOUT_S, "check_same_thread": False})

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_conn: sqlite3.Connection, _record: object) -> None:
        # Let SQLAlchemy, not the sqlite3 module, decide where transactions begin (below).
        dbapi_conn.isolation_level = None
        cursor = dbapi_conn.cursor()
        cursor.execute(f"PRAGMA busy_timeout = {int(SQLITE_BUSY_TIMEOUT_S * 1000)}")
        cursor.execute("PRAGMA foreign_keys = ON")
        if not readonly:
            cursor.execute("PRAGMA synchronous = NORMAL")  # durable enough in WAL mode
        cursor.close()

    @event.listens_for(engine, "begin")
    def _on_begin(conn: Connection) -> None:
        # A writer takes the write lock up front: a deferred transaction that reads, then
        # writes, cannot wait for the lock in WAL mode and fails with SQLITE_BUSY at once.
        write = conn.get_execution_options().get("ucudnn_write", False)
        conn.exec_driver_sql("BEGIN IMMEDIATE" if write else "BEGIN")

    return engine


def enable_wal(engine: Engine, where: str) -> None:
    """Put a SQLite file in WAL mode, so readers never wait on the writer; warn where it cannot be."""

    def set_wal() -> str:
        # Outside any transaction: SQLite cannot change the journal mode inside one.
        raw = engine.raw_connection()
        try:
            cursor = raw.cursor()
            mode = cursor.execute("PRAGMA journal_mode = WAL").fetchone()[0]
            cursor.close()
        finally:
            raw.close()
        return str(mode).lower()

    mode = retry(set_wal, action="open", where=where)
    if mode != "wal":
        log.warning(
            "%s: journal mode is %s, not WAL (a network file system?); concurrent writers will wait on each other",
            where,
            mode,
        )
