"""Which databases are ucudnn caches this ucudnn can use, and how one is created or migrated.

The tables themselves are in `ucudnn.db.models`; here is the schema version that `meta` holds,
the checks that refuse a foreign, newer or damaged database before anything is written (shared
by the read-only pre-check of a SQLite file and every open), and the steps that bring an empty
or older cache to `SCHEMA_VERSION` in one transaction.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from sqlalchemy import Connection, func, inspect, select, update
from ucudnn.db.models import SCHEMA_VERSION, SCHEMA_VERSION_KEY, TABLES, Base

from ucudnn.errors import DatabaseError

log = logging.getLogger("ucudnn.db.cache")  # the cache's one logger, as before db/ was split

# PostgreSQL advisory lock id that serialises schema creation (any constant shared by all
# ucudnn processes; the digits spell "ucudnn").
_PG_SCHEMA_LOCK_ID = 0x7563_7564_6E6E

_meta = TABLES["meta"]

# Steps that take a cache from schema version v to v + 1, run in one transaction on open.
# Version 1 is the first released schema, so there are none yet; a cache whose version has no
# path to SCHEMA_VERSION is refused with a message, never dropped.
_MIGRATIONS: dict[int, Callable[[Connection], None]] = {}


def _schema_version(conn: Connection, where: str) -> int | None:
    """The cache's schema version; None for an empty database; DatabaseError for anything else."""
    names = set(inspect(conn).get_table_names())
    if not names:
        return None
    if "meta" not in names:
        shown = ", ".join(sorted(names)[:5]) + (", ..." if len(names) > 5 else "")
        raise DatabaseError(
            f"{where} is a database but not a ucudnn cache (it holds tables {shown} "
            f"and no meta table); pass another --db, or use an empty database"
        )
    text = conn.execute(select(_meta.c.value).where(_meta.c.key == SCHEMA_VERSION_KEY)).scalar()
    if text is None or not str(text).isdigit():
        raise DatabaseError(
            f"{where} has no readable schema version (meta holds {text!r}); it was not written by ucudnn, or is damaged"
        )
    version = int(text)
    if version > SCHEMA_VERSION:
        raise DatabaseError(
            f"{where} has schema version {version}, newer than the {SCHEMA_VERSION} "
            f"this ucudnn knows; upgrade ucudnn, or pass another --db"
        )
    if version < SCHEMA_VERSION and any(v not in _MIGRATIONS for v in range(version, SCHEMA_VERSION)):
        raise DatabaseError(
            f"{where} has schema version {version}, older than {SCHEMA_VERSION}, and "
            f"this ucudnn cannot migrate it; export it with the ucudnn that wrote it "
            f"and `ucudnn db import` the export into a new cache"
        )
    if version == SCHEMA_VERSION:
        _check_columns(conn, names, where)
    return version


def _check_columns(conn: Connection, names: set[str], where: str) -> None:
    inspector = inspect(conn)
    for table in Base.metadata.sorted_tables:
        if table.name not in names:
            raise DatabaseError(
                f"{where} says schema version {SCHEMA_VERSION} but has no table "
                f"{table.name!r}; it is damaged or not a ucudnn cache"
            )
        present = {c["name"] for c in inspector.get_columns(table.name)}
        missing = [c.name for c in table.columns if c.name not in present]
        if missing:
            raise DatabaseError(
                f"{where} says schema version {SCHEMA_VERSION} but table "
                f"{table.name!r} lacks columns {', '.join(missing)}; it is damaged "
                f"or not a ucudnn cache"
            )


def require_current(conn: Connection, where: str) -> None:
    """DatabaseError unless the cache holds the current schema (a read-only open cannot migrate)."""
    version = _schema_version(conn, where)
    if version is None:
        raise DatabaseError(f"{where} is empty; run a benchmark to fill it, or pass --db")
    if version != SCHEMA_VERSION:
        raise DatabaseError(
            f"{where} has schema version {version}; open it once for writing to migrate it to {SCHEMA_VERSION}"
        )


def initialise(conn: Connection, where: str, *, is_sqlite: bool) -> None:
    """Create the tables in an empty database, or migrate an older one; in one transaction."""
    if not is_sqlite:
        conn.execute(select(func.pg_advisory_xact_lock(_PG_SCHEMA_LOCK_ID)))
    version = _schema_version(conn, where)
    if version == SCHEMA_VERSION:
        return
    if version is None:
        Base.metadata.create_all(conn)
        conn.execute(_meta.insert().values(key=SCHEMA_VERSION_KEY, value=str(SCHEMA_VERSION)))
        return
    for step in range(version, SCHEMA_VERSION):
        log.info("%s: migrating schema %d -> %d", where, step, step + 1)
        _MIGRATIONS[step](conn)
    conn.execute(update(_meta).where(_meta.c.key == SCHEMA_VERSION_KEY).values(value=str(SCHEMA_VERSION)))
    _check_columns(conn, set(inspect(conn).get_table_names()), where)
