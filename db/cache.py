"""`Cache`: measurements and plans in SQLite (one machine) or PostgreSQL (a cluster).

Opening a cache never damages what is at its URL. A SQLite file is checked read-only first (its
16-byte header, then its schema and a quick integrity check through an `immutable` or `mode=ro`
connection); only a file that is empty, absent, or a ucudnn cache of a known schema version is
then opened for writing. Anything else raises `DatabaseError` and leaves the file as it was.

Concurrency: SQLite runs in WAL mode with a busy timeout, and every write transaction starts with
`BEGIN IMMEDIATE`, so writers queue for the lock instead of failing when a read lock cannot be
upgraded. Rows are written with `INSERT ... ON CONFLICT` against unique constraints, so writers
storing the same measurement cannot duplicate it. A transaction that still meets a transient
error (busy, locked, deadlock, serialization failure) is retried with exponential backoff.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import os
import random
import sqlite3
import time
import urllib.parse
from collections.abc import Callable, Iterable, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, TypeVar

from sqlalchemy import (Connection, Engine, and_, bindparam, create_engine, delete, event, exists,
                        func, inspect, select, update)
from sqlalchemy import exc as sa_exc
from sqlalchemy.engine import URL, make_url
from sqlalchemy.pool import NullPool

from ucudnn.db.models import SCHEMA_VERSION, SCHEMA_VERSION_KEY, TABLES, Base
from ucudnn.errors import DatabaseError, InvalidInput
from ucudnn.solver.types import MicroConfig

log = logging.getLogger(__name__)

ENV_VAR = "UCUDNN_DB"
SQLITE_HEADER = b"SQLite format 3\x00"
# A writer waits this long for SQLite's lock before the busy handler gives up; long enough for
# any one transaction of ours, short enough that a stuck process is reported.
SQLITE_BUSY_TIMEOUT_S = 30.0
# Transient failures (lock not granted, deadlock, serialization failure) are retried this many
# times, sleeping RETRY_BASE_S * 2**attempt (capped, with jitter so retries do not line up).
RETRY_ATTEMPTS = 8
RETRY_BASE_S = 0.02
RETRY_MAX_S = 2.0
# Opening a SQLite file runs PRAGMA quick_check (about 5 ms per MiB here) up to this size, to
# refuse a damaged file before writing to it. A larger cache gets the header and schema checks
# only; damage elsewhere is still reported (as DatabaseError) when the damaged page is read.
QUICK_CHECK_MAX_BYTES = 64 * 2**20
# Batch sizes per IN (...) list of a lookup; far below SQLite's 32766 bound parameters.
ROWS_PER_STATEMENT = 500
# PostgreSQL advisory lock id that serialises schema creation (any constant shared by all
# ucudnn processes; the digits spell "ucudnn").
_PG_SCHEMA_LOCK_ID = 0x7563_7564_6E6E

_devices, _problems, _measurements, _plans, _meta = (
    TABLES["devices"], TABLES["problems"], TABLES["measurements"], TABLES["plans"], TABLES["meta"])

T = TypeVar("T")

# Steps that take a cache from schema version v to v + 1, run in one transaction on open.
# Version 1 is the first released schema, so there are none yet; a cache whose version has no
# path to SCHEMA_VERSION is refused with a message, never dropped.
_MIGRATIONS: dict[int, Callable[[Connection], None]] = {}


# ---------------------------------------------------------------------------------------------
# URLs


def default_url() -> str:
    """`$UCUDNN_DB` if set, else `sqlite:///$XDG_CACHE_HOME/ucudnn/cache.db` (creating the folder).

    `XDG_CACHE_HOME` defaults to `~/.cache`, as the XDG base directory spec says (a relative
    value is ignored, as the spec also says).
    """
    env = os.environ.get(ENV_VAR, "").strip()
    if env:
        return env
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    base = Path(xdg) if xdg and os.path.isabs(xdg) else Path.home() / ".cache"
    folder = base / "ucudnn"
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise DatabaseError(f"cannot create the cache folder {folder}: {exc.strerror or exc}; "
                            f"set {ENV_VAR} or pass --db to put the cache elsewhere") from exc
    return f"sqlite:///{folder / 'cache.db'}"


def _resolve_url(url: str | os.PathLike[str] | None) -> URL:
    """A SQLAlchemy URL from a URL, a plain file path (a SQLite file) or None (the default)."""
    if url is None:
        url = default_url()
    if isinstance(url, os.PathLike):
        url = os.fspath(url)
    if not isinstance(url, str) or not url.strip():
        raise InvalidInput(f"cache URL must be a non-empty string or path, got {url!r}")
    if "://" not in url:
        return URL.create("sqlite", database=os.path.abspath(os.path.expanduser(url)))
    try:
        parsed = make_url(url)
    except sa_exc.ArgumentError as exc:
        raise InvalidInput(f"cache URL {url!r} is not a database URL ({exc}); "
                           f"use sqlite:///PATH, a file path, or postgresql+psycopg://...") from exc
    backend = parsed.get_backend_name()
    if backend not in ("sqlite", "postgresql"):
        raise InvalidInput(f"cache URL {parsed.render_as_string(hide_password=True)!r} uses "
                           f"{backend!r}; ucudnn caches live in SQLite or PostgreSQL")
    if parsed.drivername == "postgresql":  # SQLAlchemy's default is psycopg2; ours is psycopg 3
        parsed = parsed.set(drivername="postgresql+psycopg")
    if backend == "sqlite" and parsed.database and parsed.database != ":memory:" \
            and not parsed.query.get("uri"):
        parsed = parsed.set(database=os.path.abspath(os.path.expanduser(parsed.database)))
    return parsed


def _sqlite_file(url: URL) -> Path | None:
    """The file behind a SQLite URL, or None for an in-memory database or a `uri=true` URL."""
    if url.get_backend_name() != "sqlite" or url.query.get("uri"):
        return None
    if not url.database or url.database == ":memory:":
        return None
    return Path(url.database)


def _ro_uri(path: Path, *, immutable: bool) -> str:
    quoted = urllib.parse.quote(str(path), safe="/")
    return f"file:{quoted}?mode=ro" + ("&immutable=1" if immutable else "")


# ---------------------------------------------------------------------------------------------
# Errors


def _reason(exc: BaseException) -> str:
    """One line saying why: the driver's own message without SQL, parameters or newlines."""
    orig = getattr(exc, "orig", None)
    text = str(orig if orig is not None else exc)
    text = text.split("\n[SQL:", 1)[0]
    return " ".join(text.split()) or type(exc).__name__


def _is_transient(exc: BaseException) -> bool:
    """Busy/locked SQLite, or a PostgreSQL deadlock or serialization failure: worth a retry."""
    orig = getattr(exc, "orig", exc)
    name = getattr(orig, "sqlite_errorname", "") or ""
    if name.startswith(("SQLITE_BUSY", "SQLITE_LOCKED")):
        return True
    if getattr(orig, "sqlstate", None) in ("40001", "40P01"):
        return True
    text = str(orig).lower()
    return "database is locked" in text or "database table is locked" in text


# ---------------------------------------------------------------------------------------------
# Values


def _now() -> datetime:
    """UTC, naive (both engines store naive timestamps), to the microsecond."""
    return datetime.now(UTC).replace(tzinfo=None)


def _kind_of(problem_key: str) -> str:
    for part in problem_key.split(","):
        name, _, value = part.partition("=")
        if name.strip() == "kind":
            return value.strip()
    return ""


def _text(name: str, value: object) -> str:
    if not isinstance(value, str) or not value.strip():
        raise InvalidInput(f"{name} must be a non-empty string, got {value!r}")
    return value


def _plan_json(key: str, plan: object) -> str:
    if not isinstance(plan, dict):
        raise InvalidInput(f"plan for key {key[:80]!r} must be a dict, got {type(plan).__name__}")
    try:
        return json.dumps(plan, sort_keys=True, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise InvalidInput(f"plan for key {key[:80]!r} is not JSON-able ({exc}); "
                           f"plans hold only dicts, lists, strings, finite numbers, bools, None") from exc


def _key_sha256(key: str) -> str:
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


@dataclasses.dataclass(frozen=True, slots=True)
class MeasurementRecord:
    """One stored measurement with its full key: what `export` writes and `merge` reads.

    `time_ms` is None for a candidate that could not run (an infinite time); `created_at` is
    naive UTC.
    """

    device: str
    backend: str
    versions: str
    problem_key: str
    algo: str
    batch: int
    time_ms: float | None
    spread_ms: float
    workspace_bytes: int
    reason: str
    created_at: datetime

    @property
    def identity(self) -> tuple[str, str, str, str, str, int]:
        return (self.device, self.backend, self.versions, self.problem_key, self.algo, self.batch)

    @property
    def rank(self) -> tuple:
        """Merge order; the larger rank wins (see `MERGE_RULE`). A total order on stored fields."""
        usable = self.time_ms is not None
        return (self.created_at, usable, -(self.time_ms if usable else 0.0), -self.spread_ms,
                -self.workspace_bytes, self.reason)


@dataclasses.dataclass(frozen=True, slots=True)
class PlanRecord:
    """One cached plan: its key, its canonical JSON text and when it was written (naive UTC)."""

    key: str
    plan_json: str
    created_at: datetime

    @property
    def rank(self) -> tuple:
        return (self.created_at, self.plan_json)


@dataclasses.dataclass(frozen=True, slots=True)
class MergeCounts:
    """What `Cache.merge` did: rows inserted, rows replaced by a winning import, rows kept."""

    inserted: int = 0
    replaced: int = 0
    kept: int = 0


@dataclasses.dataclass(frozen=True, slots=True)
class MergeReport:
    measurements: MergeCounts
    plans: MergeCounts


MERGE_RULE = (
    "Merge rule: records are matched on their full key (device, backend, versions, problem key, "
    "algorithm, batch; plans on their key). The record with the later created_at wins. At equal "
    "created_at a usable measurement beats a failed one (no time), then the lower time_ms, the "
    "lower spread_ms, the smaller workspace_bytes, and last the reason text that sorts later; a "
    "plan at equal created_at loses to the one whose canonical JSON sorts later. This is a total "
    "order on everything stored, so merging the same inputs in any order, any number of times, "
    "gives the same cache.")


def _check_micro(m: object, index: int) -> dict[str, Any]:
    if not isinstance(m, MicroConfig):
        raise InvalidInput(f"micros[{index}] must be a MicroConfig, got {type(m).__name__}")
    where = f"micros[{index}] ({m.algo!r} at batch {m.batch})"
    _text(f"{where} algo", m.algo)
    if not isinstance(m.batch, int) or isinstance(m.batch, bool) or m.batch < 1:
        raise InvalidInput(f"{where}: batch must be a positive integer, got {m.batch!r}")
    if not isinstance(m.time, (int, float)) or math.isnan(m.time) or m.time < 0:
        raise InvalidInput(f"{where}: time must be a non-negative number of ms or +inf, got {m.time!r}")
    if not isinstance(m.workspace, int) or isinstance(m.workspace, bool) or m.workspace < 0:
        raise InvalidInput(f"{where}: workspace must be a non-negative integer of bytes, got {m.workspace!r}")
    if not isinstance(m.spread, (int, float)) or not math.isfinite(m.spread) or m.spread < 0:
        raise InvalidInput(f"{where}: spread must be a finite non-negative number of ms, got {m.spread!r}")
    if not isinstance(m.reason, str):
        raise InvalidInput(f"{where}: reason must be a string, got {type(m.reason).__name__}")
    return {"algo": m.algo, "batch": m.batch,
            "time_ms": float(m.time) if math.isfinite(m.time) else None,
            "spread_ms": float(m.spread), "workspace_bytes": m.workspace, "reason": m.reason}


def _micro_from_row(row: Any) -> MicroConfig:
    return MicroConfig(algo=row.algo, batch=row.batch,
                       time=math.inf if row.time_ms is None else row.time_ms,
                       workspace=row.workspace_bytes, reason=row.reason, spread=row.spread_ms)


def _chunks(items: list[T], size: int = ROWS_PER_STATEMENT) -> Iterator[list[T]]:
    for start in range(0, len(items), size):
        yield items[start:start + size]


# ---------------------------------------------------------------------------------------------
# Schema checks (shared by the read-only pre-check and the read-write open)


def _schema_version(conn: Connection, where: str) -> int | None:
    """The cache's schema version; None for an empty database; DatabaseError for anything else."""
    names = set(inspect(conn).get_table_names())
    if not names:
        return None
    if "meta" not in names:
        shown = ", ".join(sorted(names)[:5]) + (", ..." if len(names) > 5 else "")
        raise DatabaseError(f"{where} is a database but not a ucudnn cache (it holds tables {shown} "
                            f"and no meta table); pass another --db, or use an empty database")
    text = conn.execute(select(_meta.c.value).where(_meta.c.key == SCHEMA_VERSION_KEY)).scalar()
    if text is None or not str(text).isdigit():
        raise DatabaseError(f"{where} has no readable schema version (meta holds {text!r}); "
                            f"it was not written by ucudnn, or is damaged")
    version = int(text)
    if version > SCHEMA_VERSION:
        raise DatabaseError(f"{where} has schema version {version}, newer than the {SCHEMA_VERSION} "
                            f"this ucudnn knows; upgrade ucudnn, or pass another --db")
    if version < SCHEMA_VERSION and any(v not in _MIGRATIONS for v in range(version, SCHEMA_VERSION)):
        raise DatabaseError(f"{where} has schema version {version}, older than {SCHEMA_VERSION}, and "
                            f"this ucudnn cannot migrate it; export it with the ucudnn that wrote it "
                            f"and `ucudnn db import` the export into a new cache")
    if version == SCHEMA_VERSION:
        _check_columns(conn, names, where)
    return version


def _check_columns(conn: Connection, names: set[str], where: str) -> None:
    inspector = inspect(conn)
    for table in Base.metadata.sorted_tables:
        if table.name not in names:
            raise DatabaseError(f"{where} says schema version {SCHEMA_VERSION} but has no table "
                                f"{table.name!r}; it is damaged or not a ucudnn cache")
        present = {c["name"] for c in inspector.get_columns(table.name)}
        missing = [c.name for c in table.columns if c.name not in present]
        if missing:
            raise DatabaseError(f"{where} says schema version {SCHEMA_VERSION} but table "
                                f"{table.name!r} lacks columns {', '.join(missing)}; it is damaged "
                                f"or not a ucudnn cache")


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
        return
    try:
        with open(path, "rb") as fp:
            header = fp.read(100)
    except OSError as exc:
        raise DatabaseError(f"cannot read {where}: {exc.strerror or exc}") from exc
    unwritable = _unwritable(path)
    if not header:
        if unwritable and not readonly:  # an empty database must be written to become a cache
            raise DatabaseError(f"cannot create cache {path}: {unwritable}; pass --db or set "
                                f"{ENV_VAR} to a writable place")
        return None  # SQLite treats an empty file as an empty database
    if not header.startswith(SQLITE_HEADER):
        raise DatabaseError(f"{where} is not a SQLite database (it starts with {header[:16]!r}); "
                            f"move it away or pass another --db")
    if len(header) < 100:
        raise DatabaseError(f"{where} is damaged: it is {len(header)} bytes, shorter than a SQLite "
                            f"header; move it away or pass another --db")
    uri = _ro_uri(path, immutable=_immutable(path, header, unwritable))
    engine = create_engine(URL.create("sqlite", database=str(path)), poolclass=NullPool,
                           creator=lambda: sqlite3.connect(uri, uri=True, timeout=SQLITE_BUSY_TIMEOUT_S))
    try:
        with engine.connect() as conn:
            _schema_version(conn, where)
            problems = ["ok"]
            if path.stat().st_size <= QUICK_CHECK_MAX_BYTES:
                # a problem may span lines ("*** in database main ***\nPage 4: ..."): one line each
                problems = [" ".join(str(row[0]).split()) for row in conn.exec_driver_sql("PRAGMA quick_check(5)")]
            if problems != ["ok"]:
                raise DatabaseError(f"{where} is damaged (integrity check: {'; '.join(problems)}); "
                                    f"move it away or pass another --db")
    except sa_exc.DBAPIError as exc:
        raise DatabaseError(f"{where} cannot be read as a database ({_reason(exc)}); "
                            f"move it away or pass another --db") from exc
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
    if not folder.is_dir():
        raise DatabaseError(f"cannot create cache {path}: {folder} is not a directory")
    # SQLite writes -wal and -shm files beside the database, so the folder must be writable.
    if not os.access(folder, os.W_OK | os.X_OK):
        raise DatabaseError(f"cannot write cache {path}: the directory {folder} is not writable; "
                            f"pass --db or set {ENV_VAR} to a writable place")


# ---------------------------------------------------------------------------------------------
# The cache


class Cache:
    """Measurements and solved plans, in SQLite or PostgreSQL.

    `url` is a SQLAlchemy URL (`sqlite:///PATH`, `postgresql+psycopg://user@host/db`; a bare
    `postgresql://` gets psycopg 3), a plain file path (a SQLite file), or None for
    `default_url()`. `readonly=True` opens an existing cache without writing to it (no schema
    creation or migration; `store`, `put_plan`, `merge` and `prune` raise). `create=False`
    refuses a SQLite file that does not exist yet instead of creating it.
    """

    def __init__(self, url: str | os.PathLike[str] | None = None, *, readonly: bool = False,
                 create: bool = True) -> None:
        self._url = _resolve_url(url)
        self.readonly = readonly
        self.url = self._url.render_as_string(hide_password=True)
        self._where = f"cache {self.url}"
        self._is_sqlite = self._url.get_backend_name() == "sqlite"
        self.sqlite_path = path = _sqlite_file(self._url)
        # Why this cache was opened read-only when writing was asked for (None: it was not).
        self.readonly_reason: str | None = None
        if path is not None:
            if not create and not path.exists():
                raise DatabaseError(f"no cache at {path}; run a benchmark to create one, or pass --db")
            unwritable = _precheck_sqlite_file(path, readonly=readonly)
            if unwritable and not readonly:
                log.info("%s: %s; opened read-only", self._where, unwritable)
                self.readonly, self.readonly_reason = True, unwritable
        self._engine = self._create_engine(path)
        self._pid = os.getpid()
        try:
            if self.readonly:
                self._run(lambda conn: self._require_current(conn), write=False, action="open")
            else:
                if path is not None:
                    self._enable_wal()
                self._run(self._initialise, write=True, action="open")
        except BaseException:
            self._engine.dispose()
            raise

    # -- engine and transactions --------------------------------------------------------------

    def _create_engine(self, path: Path | None) -> Engine:
        if not self._is_sqlite:
            try:
                engine = create_engine(self._url, pool_pre_ping=True)
            except (ImportError, sa_exc.NoSuchModuleError) as exc:
                raise DatabaseError(f"cannot use {self._where}: {exc}; install the driver with "
                                    f"pip install 'psycopg[binary]'") from exc
            return engine
        if path is not None and self.readonly:
            # Immutable only where nobody can be writing (a read-only mount): elsewhere a writer may
            # start while this connection reads, and it must see the writer's locks.
            uri = _ro_uri(path, immutable=_unwritable(path) is not None and not _in_use(path))
            engine = create_engine(
                URL.create("sqlite", database=str(path)),
                creator=lambda: sqlite3.connect(uri, uri=True, timeout=SQLITE_BUSY_TIMEOUT_S,
                                                check_same_thread=False))
        else:
            engine = create_engine(self._url, connect_args={"timeout": SQLITE_BUSY_TIMEOUT_S,
                                                            "check_same_thread": False})

        @event.listens_for(engine, "connect")
        def _on_connect(dbapi_conn: sqlite3.Connection, _record: object) -> None:
            # Let SQLAlchemy, not the sqlite3 module, decide where transactions begin (below).
            dbapi_conn.isolation_level = None
            cursor = dbapi_conn.cursor()
            cursor.execute(f"PRAGMA busy_timeout = {int(SQLITE_BUSY_TIMEOUT_S * 1000)}")
            cursor.execute("PRAGMA foreign_keys = ON")
            if not self.readonly:
                cursor.execute("PRAGMA synchronous = NORMAL")  # durable enough in WAL mode
            cursor.close()

        @event.listens_for(engine, "begin")
        def _on_begin(conn: Connection) -> None:
            # A writer takes the write lock up front: a deferred transaction that reads, then
            # writes, cannot wait for the lock in WAL mode and fails with SQLITE_BUSY at once.
            write = conn.get_execution_options().get("ucudnn_write", False)
            conn.exec_driver_sql("BEGIN IMMEDIATE" if write else "BEGIN")

        return engine

    def _enable_wal(self) -> None:
        def set_wal() -> str:
            # Outside any transaction: SQLite cannot change the journal mode inside one.
            raw = self._engine.raw_connection()
            try:
                cursor = raw.cursor()
                mode = cursor.execute("PRAGMA journal_mode = WAL").fetchone()[0]
                cursor.close()
            finally:
                raw.close()
            return str(mode).lower()

        mode = self._retry(set_wal, action="open")
        if mode != "wal":
            log.warning("%s: journal mode is %s, not WAL (a network file system?); concurrent "
                        "writers will wait on each other", self._where, mode)

    def _retry(self, work: Callable[[], T], *, action: str) -> T:
        """Run `work`, retrying transient lock errors with capped exponential backoff."""
        for attempt in range(RETRY_ATTEMPTS):
            try:
                return work()
            except (sa_exc.DBAPIError, sqlite3.Error) as exc:
                if _is_transient(exc) and attempt + 1 < RETRY_ATTEMPTS:
                    delay = min(RETRY_MAX_S, RETRY_BASE_S * 2 ** attempt) * (0.5 + random.random())
                    log.debug("%s: %s (attempt %d), retrying in %.3f s", self._where,
                              _reason(exc), attempt + 1, delay)
                    time.sleep(delay)
                    continue
                raise DatabaseError(f"cannot {action} {self._where}: {_reason(exc)}") from exc
            except sa_exc.SQLAlchemyError as exc:
                raise DatabaseError(f"cannot {action} {self._where}: {_reason(exc)}") from exc
        raise AssertionError("unreachable: the last attempt returns or raises")

    def _run(self, work: Callable[[Connection], T], *, write: bool, action: str,
             single_read: bool = False) -> T:
        """`work(conn)` in one transaction (an immediate one for writes on SQLite), retried.

        `single_read`: `work` only reads, one statement at a time, and needs no snapshot across
        them; on PostgreSQL it then runs without BEGIN/ROLLBACK, two round trips fewer.
        """
        if write and self.readonly:
            why = self.readonly_reason or "it was opened read-only"
            raise DatabaseError(f"cannot {action} {self._where}: {why} (the cache is read-only; "
                                f"everything cached can be read, nothing new stored); pass --db or "
                                f"set {ENV_VAR} to a writable cache")

        if os.getpid() != self._pid:
            # A forked child must not use its parent's connections (both would talk over the
            # same socket or SQLite file handle): drop them here, leaving the parent's open.
            self._engine.dispose(close=False)
            self._pid = os.getpid()

        def attempt() -> T:
            with self._engine.connect() as conn:
                if write:
                    conn.execution_options(ucudnn_write=True)
                elif single_read and not self._is_sqlite:
                    conn.execution_options(isolation_level="AUTOCOMMIT")
                with conn.begin():
                    return work(conn)

        return self._retry(attempt, action=action)

    def _lock_for_bulk(self, conn: Connection) -> None:
        """Hold off other writers for a whole-table operation (SQLite: BEGIN IMMEDIATE did)."""
        if not self._is_sqlite:
            conn.exec_driver_sql("LOCK TABLE measurements, plans IN SHARE ROW EXCLUSIVE MODE")

    # -- schema -------------------------------------------------------------------------------

    def _require_current(self, conn: Connection) -> None:
        version = _schema_version(conn, self._where)
        if version is None:
            raise DatabaseError(f"{self._where} is empty; run a benchmark to fill it, or pass --db")
        if version != SCHEMA_VERSION:
            raise DatabaseError(f"{self._where} has schema version {version}; open it once for "
                                f"writing to migrate it to {SCHEMA_VERSION}")

    def _initialise(self, conn: Connection) -> None:
        """Create the tables in an empty database, or migrate an older one; in one transaction."""
        if not self._is_sqlite:
            conn.execute(select(func.pg_advisory_xact_lock(_PG_SCHEMA_LOCK_ID)))
        version = _schema_version(conn, self._where)
        if version == SCHEMA_VERSION:
            return
        if version is None:
            Base.metadata.create_all(conn)
            conn.execute(_meta.insert().values(key=SCHEMA_VERSION_KEY, value=str(SCHEMA_VERSION)))
            return
        for step in range(version, SCHEMA_VERSION):
            log.info("%s: migrating schema %d -> %d", self._where, step, step + 1)
            _MIGRATIONS[step](conn)
        conn.execute(update(_meta).where(_meta.c.key == SCHEMA_VERSION_KEY)
                     .values(value=str(SCHEMA_VERSION)))
        _check_columns(conn, set(inspect(conn).get_table_names()), self._where)

    def _insert(self, table: Any) -> Any:
        if self._is_sqlite:
            from sqlalchemy.dialects.sqlite import insert
        else:
            from sqlalchemy.dialects.postgresql import insert
        return insert(table)

    # -- devices and problems -----------------------------------------------------------------

    def _device_id(self, conn: Connection, model: str, backend: str, versions: str) -> int:
        conn.execute(self._insert(_devices)
                     .values(model=model, backend=backend, versions=versions, created_at=_now())
                     .on_conflict_do_nothing(index_elements=["model", "backend", "versions"]))
        # KEY SHARE: a concurrent prune cannot delete the row before our measurements point at it.
        query = (select(_devices.c.id).where(_devices.c.model == model, _devices.c.backend == backend,
                                             _devices.c.versions == versions)
                 .with_for_update(key_share=True))
        return conn.execute(query).scalar_one()

    def _problem_id(self, conn: Connection, problem_key: str) -> int:
        conn.execute(self._insert(_problems)
                     .values(key=problem_key, kind=_kind_of(problem_key), created_at=_now())
                     .on_conflict_do_nothing(index_elements=["key"]))
        query = select(_problems.c.id).where(_problems.c.key == problem_key).with_for_update(key_share=True)
        return conn.execute(query).scalar_one()

    # -- measurements -------------------------------------------------------------------------

    def lookup(self, *, device: str, backend: str, versions: str, problem_key: str,
               batches: Iterable[int] | None, algos: Iterable[str] | None = None,
               ) -> dict[tuple[str, int], MicroConfig]:
        """Cached measurements of one problem on one device/backend/versions, keyed (algo, batch).

        Only rows whose device, backend, versions and problem key match exactly are returned, so
        a measurement taken with other library versions is never reused. `batches=None` means
        every batch size; `algos=None` every algorithm. A failed candidate comes back with
        `time=inf` and its reason.
        """
        ident = (_text("device", device), _text("backend", backend), _text("versions", versions),
                 _text("problem_key", problem_key))
        batch_list = None if batches is None else sorted(set(self._check_batches(batches)))
        algo_list = None if algos is None else sorted({_text("algo", a) for a in algos})
        if batch_list == [] or algo_list == []:
            return {}
        m, d, p = _measurements.c, _devices.c, _problems.c
        base = (select(m.algo, m.batch, m.time_ms, m.workspace_bytes, m.reason, m.spread_ms)
                .select_from(_measurements.join(_devices, d.id == m.device_id)
                             .join(_problems, p.id == m.problem_id))
                .where(d.model == ident[0], d.backend == ident[1], d.versions == ident[2],
                       p.key == ident[3]))
        if algo_list is not None:
            base = base.where(m.algo.in_(algo_list))
        queries = [base] if batch_list is None else [base.where(m.batch.in_(chunk))
                                                     for chunk in _chunks(batch_list)]

        def work(conn: Connection) -> dict[tuple[str, int], MicroConfig]:
            found = {}
            for query in queries:
                for row in conn.execute(query):
                    found[(row.algo, row.batch)] = _micro_from_row(row)
            return found

        return self._run(work, write=False, action="read", single_read=True)

    @staticmethod
    def _check_batches(batches: Iterable[int]) -> list[int]:
        out = []
        for b in batches:
            if not isinstance(b, int) or isinstance(b, bool) or b < 1:
                raise InvalidInput(f"batches must be positive integers, got {b!r}")
            out.append(b)
        return out

    def store(self, *, device: str, backend: str, versions: str, problem_key: str,
              micros: Iterable[MicroConfig], replace: bool = False) -> int:
        """Write measurements of one problem; returns how many rows were newly written.

        Idempotent: a measurement already cached under the same key is kept as it is (another
        process measured it first), unless `replace=True`, which overwrites it and counts it. An
        infinite time is stored as NULL with its reason and comes back as `inf`.
        """
        ident = (_text("device", device), _text("backend", backend), _text("versions", versions),
                 _text("problem_key", problem_key))
        rows = [_check_micro(mc, i) for i, mc in enumerate(micros)]
        seen: dict[tuple[str, int], int] = {}
        for i, row in enumerate(rows):
            first = seen.setdefault((row["algo"], row["batch"]), i)
            if first != i:
                raise InvalidInput(f"micros[{first}] and micros[{i}] are both {row['algo']!r} at batch "
                                   f"{row['batch']}; store one measurement per algorithm and batch")
        if not rows:
            return 0
        # The same order in every writer, so PostgreSQL row locks are taken without deadlock.
        rows.sort(key=lambda r: (r["algo"], r["batch"]))

        keys = ["device_id", "problem_id", "algo", "batch"]
        stmt = self._insert(_measurements)
        if replace:
            stmt = stmt.on_conflict_do_update(index_elements=keys, set_={
                name: stmt.excluded[name] for name in
                ("time_ms", "spread_ms", "workspace_bytes", "reason", "created_at")})
        else:
            stmt = stmt.on_conflict_do_nothing(index_elements=keys)
        # RETURNING gives exactly the rows this call wrote (none for a skipped conflict). Run as
        # an executemany, SQLAlchemy batches the rows into multi-row INSERTs ("insertmanyvalues")
        # and compiles the statement once.
        stmt = stmt.returning(_measurements.c.id)

        def work(conn: Connection) -> int:
            device_id = self._device_id(conn, *ident[:3])
            problem_id = self._problem_id(conn, ident[3])
            created_at = _now()
            values = [{**r, "device_id": device_id, "problem_id": problem_id,
                       "created_at": created_at} for r in rows]
            return len(conn.execute(stmt, values).all())

        return self._run(work, write=True, action="write to")

    # -- plans --------------------------------------------------------------------------------

    def get_plan(self, key: str) -> dict | None:
        """The plan stored under `key`, or None."""
        _text("plan key", key)
        digest = _key_sha256(key)

        def work(conn: Connection) -> str | None:
            row = conn.execute(select(_plans.c.key, _plans.c.plan_json)
                               .where(_plans.c.key_sha256 == digest)).first()
            return row.plan_json if row is not None and row.key == key else None

        text = self._run(work, write=False, action="read", single_read=True)
        if text is None:
            return None
        try:
            return json.loads(text)
        except ValueError as exc:
            raise DatabaseError(f"{self._where}: the plan under key {key[:80]!r} is not valid JSON "
                                f"({exc}); prune it or use another --db") from exc

    def put_plan(self, key: str, plan: dict) -> None:
        """Store `plan` (a JSON-able dict) under `key`, replacing any plan already there."""
        _text("plan key", key)
        text = _plan_json(key, plan)
        values = {"key_sha256": _key_sha256(key), "key": key, "plan_json": text, "created_at": _now()}

        def work(conn: Connection) -> None:
            stmt = self._insert(_plans).values(values)
            conn.execute(stmt.on_conflict_do_update(index_elements=["key_sha256"], set_={
                "key": stmt.excluded.key, "plan_json": stmt.excluded.plan_json,
                "created_at": stmt.excluded.created_at}))

        self._run(work, write=True, action="write to")

    # -- maintenance --------------------------------------------------------------------------

    def info(self) -> dict[str, Any]:
        """Counts of devices, problems, measurements and plans; schema version; URL; per device."""
        m, d = _measurements.c, _devices.c

        def work(conn: Connection) -> dict[str, Any]:
            count = lambda table: conn.execute(select(func.count()).select_from(table)).scalar_one()  # noqa: E731
            per_device = conn.execute(
                select(d.model, d.backend, d.versions, func.count(m.id).label("n"))
                .select_from(_devices.outerjoin(_measurements, m.device_id == d.id))
                .group_by(d.id, d.model, d.backend, d.versions)
                .order_by(d.model, d.backend, d.versions)).all()
            version = conn.execute(select(_meta.c.value)
                                   .where(_meta.c.key == SCHEMA_VERSION_KEY)).scalar_one()
            return {"url": self.url, "schema_version": int(version),
                    "devices": count(_devices), "problems": count(_problems),
                    "measurements": count(_measurements), "plans": count(_plans),
                    "by_device": [{"device": r.model, "backend": r.backend, "versions": r.versions,
                                   "measurements": r.n} for r in per_device]}

        return self._run(work, write=False, action="read")

    def prune(self, *, device: str | None = None, backend: str | None = None,
              versions: str | None = None, older_than_days: float | None = None,
              everything: bool = False, dry_run: bool = False) -> dict[str, int]:
        """Delete measurements matching every given filter; returns rows removed per table.

        Filters combine with AND. Plans carry no device, so they are removed only by age
        (`older_than_days` with no device/backend/versions filter) or by `everything`. Devices
        and problems left with no measurement are removed too. At least one filter or
        `everything=True` is required, so that a bare call cannot empty the cache.
        """
        filters = {"device": device, "backend": backend, "versions": versions}
        for name, value in filters.items():
            if value is not None:
                _text(name, value)
        if older_than_days is not None and (not isinstance(older_than_days, (int, float))
                                            or not math.isfinite(older_than_days) or older_than_days < 0):
            raise InvalidInput(f"older_than_days must be a non-negative number, got {older_than_days!r}")
        has_filter = any(v is not None for v in filters.values()) or older_than_days is not None
        if everything == has_filter:
            raise InvalidInput("prune needs --device, --backend, --versions or --older-than "
                               "(combined with AND), or --all alone")
        m, d = _measurements.c, _devices.c
        conditions = []
        for column, value in ((d.model, device), (d.backend, backend), (d.versions, versions)):
            if value is not None:
                conditions.append(column == value)
        measurement_where = []
        if conditions:
            measurement_where.append(m.device_id.in_(select(d.id).where(and_(*conditions))))
        cutoff = None
        if older_than_days is not None:
            try:
                cutoff = _now() - timedelta(days=older_than_days)
            except OverflowError:  # before year 1: nothing stored is that old
                cutoff = datetime.min
            measurement_where.append(m.created_at < cutoff)
        plan_where: list | None = None
        if everything:
            plan_where = []
        elif cutoff is not None and not conditions:
            plan_where = [_plans.c.created_at < cutoff]
        orphan_devices = ~exists().where(m.device_id == d.id)
        orphan_problems = ~exists().where(m.problem_id == _problems.c.id)

        def work(conn: Connection) -> dict[str, int]:
            self._lock_for_bulk(conn)
            count = lambda table, where: conn.execute(  # noqa: E731
                select(func.count()).select_from(table).where(*where)).scalar_one()
            removed = {"measurements": count(_measurements, measurement_where),
                       "plans": 0 if plan_where is None else count(_plans, plan_where)}
            if dry_run:
                return removed
            conn.execute(delete(_measurements).where(*measurement_where))
            if plan_where is not None:
                conn.execute(delete(_plans).where(*plan_where))
            removed["devices"] = conn.execute(delete(_devices).where(orphan_devices)).rowcount
            removed["problems"] = conn.execute(delete(_problems).where(orphan_problems)).rowcount
            return removed

        return self._run(work, write=not dry_run, action="prune")

    # -- export and merge ---------------------------------------------------------------------

    def measurement_records(self) -> Iterator[MeasurementRecord]:
        """Every measurement with its full key, in key order (stable across runs and engines)."""
        m, d, p = _measurements.c, _devices.c, _problems.c
        query = (select(d.model, d.backend, d.versions, p.key, m.algo, m.batch, m.time_ms,
                        m.spread_ms, m.workspace_bytes, m.reason, m.created_at)
                 .select_from(_measurements.join(_devices, d.id == m.device_id)
                              .join(_problems, p.id == m.problem_id))
                 .order_by(*map(self._bytewise, (d.model, d.backend, d.versions, p.key, m.algo)),
                           m.batch))
        yield from self._stream(query, lambda r: MeasurementRecord(
            r.model, r.backend, r.versions, r.key, r.algo, r.batch, r.time_ms, r.spread_ms,
            r.workspace_bytes, r.reason, r.created_at))

    def plan_records(self) -> Iterator[PlanRecord]:
        """Every plan, in key order."""
        query = (select(_plans.c.key, _plans.c.plan_json, _plans.c.created_at)
                 .order_by(self._bytewise(_plans.c.key)))
        yield from self._stream(query, lambda r: PlanRecord(r.key, r.plan_json, r.created_at))

    def _bytewise(self, column: Any) -> Any:
        """`column` compared by code point on every engine, whatever the database's locale."""
        return column.collate("BINARY" if self._is_sqlite else "C")

    def _stream(self, query: Any, convert: Callable[[Any], T]) -> Iterator[T]:
        try:
            with self._engine.connect() as conn:
                result = conn.execution_options(yield_per=1000).execute(query)
                for row in result:
                    yield convert(row)
        except sa_exc.SQLAlchemyError as exc:
            raise DatabaseError(f"cannot read {self._where}: {_reason(exc)}") from exc

    def merge(self, measurements: Callable[[], Iterable[MeasurementRecord]],
              plans: Callable[[], Iterable[PlanRecord]]) -> MergeReport:
        """Merge records into this cache in one transaction; returns what was inserted/replaced/kept.

        The rule (also `MERGE_RULE`, shown by `ucudnn db import --help`): records match on their
        full key (device, backend, versions, problem key, algorithm, batch; plans on their key).
        The record with the later `created_at` wins. At equal `created_at`, a usable measurement
        beats a failed one (no time), then the lower `time_ms` wins, then the lower `spread_ms`,
        the smaller `workspace_bytes`, and last the `reason` that sorts later; a plan at equal
        `created_at` loses to the one whose canonical JSON sorts later. That is a total order on
        everything stored (`MeasurementRecord.rank`, `PlanRecord.rank`), and the merge keeps the
        maximum of each key, so the same inputs in any order, any number of times, give the same
        cache. (`store` is different on purpose: a measurement already cached is kept, so that
        concurrent writers are idempotent; `store(replace=True)` overwrites.)

        Each argument is a callable returning a fresh iterable, because a transaction that
        meets a transient lock error is retried from the start. Other writers wait while a
        merge runs (SQLite's write lock; a table lock on PostgreSQL).
        """

        def work(conn: Connection) -> MergeReport:
            self._lock_for_bulk(conn)
            return MergeReport(self._merge_measurements(conn, measurements()),
                               self._merge_plans(conn, plans()))

        return self._run(work, write=True, action="import into")

    def _merge_measurements(self, conn: Connection, records: Iterable[MeasurementRecord]) -> MergeCounts:
        device_ids: dict[tuple[str, str, str], int] = {}
        problem_ids: dict[str, int] = {}
        inserted = replaced = kept = 0
        batch: dict[tuple, MeasurementRecord] = {}

        def flush() -> None:
            nonlocal inserted, replaced, kept
            groups: dict[tuple[int, int], list[MeasurementRecord]] = {}
            for rec in batch.values():
                dkey = (rec.device, rec.backend, rec.versions)
                if dkey not in device_ids:
                    device_ids[dkey] = self._device_id(conn, *dkey)
                if rec.problem_key not in problem_ids:
                    problem_ids[rec.problem_key] = self._problem_id(conn, rec.problem_key)
                groups.setdefault((device_ids[dkey], problem_ids[rec.problem_key]), []).append(rec)
            to_insert, to_update = [], []
            m = _measurements.c
            for (device_id, problem_id), recs in sorted(groups.items()):
                existing = {(row.algo, row.batch): row for row in conn.execute(
                    select(m.id, m.algo, m.batch, m.time_ms, m.spread_ms, m.workspace_bytes,
                           m.reason, m.created_at)
                    .where(m.device_id == device_id, m.problem_id == problem_id))}
                for rec in sorted(recs, key=lambda r: (r.algo, r.batch)):
                    values = {"time_ms": rec.time_ms, "spread_ms": rec.spread_ms,
                              "workspace_bytes": rec.workspace_bytes, "reason": rec.reason,
                              "created_at": rec.created_at}
                    old = existing.get((rec.algo, rec.batch))
                    if old is None:
                        to_insert.append({"device_id": device_id, "problem_id": problem_id,
                                          "algo": rec.algo, "batch": rec.batch, **values})
                        inserted += 1
                        continue
                    old_rec = dataclasses.replace(rec, time_ms=old.time_ms, spread_ms=old.spread_ms,
                                                  workspace_bytes=old.workspace_bytes,
                                                  reason=old.reason, created_at=old.created_at)
                    if rec.rank > old_rec.rank:
                        to_update.append({"_id": old.id, **values})
                        replaced += 1
                    else:
                        kept += 1
            if to_insert:
                conn.execute(_measurements.insert(), to_insert)
            if to_update:
                conn.execute(update(_measurements).where(_measurements.c.id == bindparam("_id")),
                             to_update)
            batch.clear()

        for rec in records:
            # Duplicates inside the input are resolved by the same rule, so order cannot matter.
            prior = batch.get(rec.identity)
            if prior is None or rec.rank > prior.rank:
                if prior is not None:
                    kept += 1
                batch[rec.identity] = rec
            else:
                kept += 1
            if len(batch) >= 5000:
                flush()
        flush()
        return MergeCounts(inserted, replaced, kept)

    def _merge_plans(self, conn: Connection, records: Iterable[PlanRecord]) -> MergeCounts:
        inserted = replaced = kept = 0
        for rec in records:
            digest = _key_sha256(rec.key)
            old = conn.execute(select(_plans.c.id, _plans.c.key, _plans.c.plan_json, _plans.c.created_at)
                               .where(_plans.c.key_sha256 == digest)).first()
            values = {"key": rec.key, "plan_json": rec.plan_json, "created_at": rec.created_at}
            if old is None:
                conn.execute(_plans.insert().values(key_sha256=digest, **values))
                inserted += 1
            elif rec.rank > PlanRecord(old.key, old.plan_json, old.created_at).rank:
                conn.execute(update(_plans).where(_plans.c.id == old.id).values(**values))
                replaced += 1
            else:
                kept += 1
        return MergeCounts(inserted, replaced, kept)

    # -- lifetime -----------------------------------------------------------------------------

    def close(self) -> None:
        """Release every connection. The cache cannot be used afterwards."""
        self._engine.dispose()

    def __enter__(self) -> Cache:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Cache({self.url!r}{', readonly=True' if self.readonly else ''})"
