"""`Cache`: measurements and plans in SQLite (one machine) or PostgreSQL (a cluster).

The one object the rest of ucudnn talks to: every query, upsert and prune runs here, in one
transaction each. Rows are written with `INSERT ... ON CONFLICT` against unique constraints, so
writers storing the same measurement cannot duplicate it, and a transaction that meets a
transient error (busy, locked, deadlock, serialization failure) is retried (`ucudnn.db.retry`).
Where the cache is (`location`), whether and how it is opened (`opening`), its schema version
(`schema`), how values become rows (`rows`) and how two caches merge (`merge`) are each their
own module.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Self, TypeVar

from sqlalchemy import Connection, delete, exists, func, select
from sqlalchemy import exc as sa_exc
from ucudnn.db import maintenance
from ucudnn.db.location import ENV_VAR, _resolve_url, _sqlite_file, default_url, mask_password
from ucudnn.db.merge import (
    MERGE_RULE,
    MeasurementRecord,
    MergeCounts,
    MergeReport,
    PlanRecord,
    merge_measurements,
    merge_plans,
)
from ucudnn.db.models import SCHEMA_VERSION_KEY, TABLES
from ucudnn.db.opening import _precheck_sqlite_file, enable_wal, open_engine
from ucudnn.db.retry import _reason, retry
from ucudnn.db.rows import (
    PLAN_JSON,
    _check_micro,
    _key_sha256,
    _kind_of,
    _micro_from_row,
    _now,
    _plan_json,
    _text,
    row_error,
)
from ucudnn.db.schema import initialise, require_current
from ucudnn.solver.types import MicroConfig

from ucudnn.errors import DatabaseError, InvalidInput

# The names this module held before db/ was split; `ucudnn.db` exports them too.
__all__ = ["MERGE_RULE", "Cache", "MeasurementRecord", "MergeCounts", "MergeReport", "PlanRecord", "default_url"]

log = logging.getLogger(__name__)

# Batch sizes per IN (...) list of a lookup; far below SQLite's 32766 bound parameters.
ROWS_PER_STATEMENT = 500

_devices, _problems, _measurements, _plans, _meta = (
    TABLES["devices"],
    TABLES["problems"],
    TABLES["measurements"],
    TABLES["plans"],
    TABLES["meta"],
)

T = TypeVar("T")

_REPAIR = " (`ucudnn db check` lists damaged rows, `ucudnn db prune --invalid` removes them)"


def _chunks(items: list[T], size: int = ROWS_PER_STATEMENT) -> Iterator[list[T]]:
    for start in range(0, len(items), size):
        yield items[start : start + size]


class Cache:
    """Measurements and solved plans, in SQLite or PostgreSQL.

    `url` is a SQLAlchemy URL (`sqlite:///PATH`, `postgresql+psycopg://user@host/db`; a bare
    `postgresql://` gets psycopg 3), a plain file path (a SQLite file), or None for
    `default_url()`. `readonly=True` opens an existing cache without writing to it (no schema
    creation or migration; `store`, `put_plan`, `merge` and `prune` raise). `create=False`
    refuses a SQLite file that does not exist yet instead of creating it.
    """

    def __init__(
        self, url: str | os.PathLike[str] | None = None, *, readonly: bool = False, create: bool = True
    ) -> None:
        self._url = _resolve_url(url)
        self.readonly = readonly
        self.url = mask_password(self._url.render_as_string(hide_password=True))
        self._where = f"cache {self.url}"
        self._is_sqlite = self._url.get_backend_name() == "sqlite"
        self.sqlite_path = path = _sqlite_file(self._url)
        # Why this cache was opened read-only when writing was asked for (None: it was not).
        self.readonly_reason: str | None = None
        self._damaged: set[tuple[str, str]] = set()  # the damaged rows this object met (warned once each)
        if path is not None:
            if not create and not path.exists():
                raise DatabaseError(f"no cache at {path}; run a benchmark to create one, or pass --db")
            unwritable = _precheck_sqlite_file(path, readonly=readonly)
            if unwritable and not readonly:
                log.info("%s: %s; opened read-only", self._where, unwritable)
                self.readonly, self.readonly_reason = True, unwritable
        self._engine = open_engine(self._url, path, readonly=self.readonly, where=self._where)
        self._pid = os.getpid()
        try:
            if self.readonly:
                self._run(lambda conn: require_current(conn, self._where), write=False, action="open")
            else:
                if path is not None:
                    enable_wal(self._engine, self._where)
                self._run(
                    lambda conn: initialise(conn, self._where, is_sqlite=self._is_sqlite), write=True, action="open"
                )
        except BaseException:
            self._engine.dispose()
            raise

    # -- transactions -------------------------------------------------------------------------

    def _run(self, work: Callable[[Connection], T], *, write: bool, action: str, single_read: bool = False) -> T:
        """`work(conn)` in one transaction (an immediate one for writes on SQLite), retried.

        `single_read`: `work` only reads, one statement at a time, and needs no snapshot across
        them; on PostgreSQL it then runs without BEGIN/ROLLBACK, two round trips fewer.
        """
        if write and self.readonly:
            why = self.readonly_reason or "it was opened read-only"
            raise DatabaseError(
                f"cannot {action} {self._where}: {why} (the cache is read-only; "
                f"everything cached can be read, nothing new stored); pass --db or "
                f"set {ENV_VAR} to a writable cache"
            )

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

        return retry(attempt, action=action, where=self._where)

    def _lock_for_bulk(self, conn: Connection) -> None:
        """Hold off other writers for a whole-table operation (SQLite: BEGIN IMMEDIATE did)."""
        if not self._is_sqlite:
            conn.exec_driver_sql("LOCK TABLE measurements, plans IN SHARE ROW EXCLUSIVE MODE")

    def _insert(self, table: Any) -> Any:
        if self._is_sqlite:
            from sqlalchemy.dialects.sqlite import insert as sqlite_insert

            return sqlite_insert(table)
        from sqlalchemy.dialects.postgresql import insert as postgresql_insert

        return postgresql_insert(table)

    # -- devices and problems -----------------------------------------------------------------

    def _device_id(self, conn: Connection, model: str, backend: str, versions: str) -> int:
        conn.execute(
            self._insert(_devices)
            .values(model=model, backend=backend, versions=versions, created_at=_now())
            .on_conflict_do_nothing(index_elements=["model", "backend", "versions"])
        )
        # KEY SHARE: a concurrent prune cannot delete the row before our measurements point at it.
        query = (
            select(_devices.c.id)
            .where(_devices.c.model == model, _devices.c.backend == backend, _devices.c.versions == versions)
            .with_for_update(key_share=True)
        )
        return conn.execute(query).scalar_one()

    def _problem_id(self, conn: Connection, problem_key: str) -> int:
        conn.execute(
            self._insert(_problems)
            .values(key=problem_key, kind=_kind_of(problem_key), created_at=_now())
            .on_conflict_do_nothing(index_elements=["key"])
        )
        query = select(_problems.c.id).where(_problems.c.key == problem_key).with_for_update(key_share=True)
        return conn.execute(query).scalar_one()

    # -- measurements -------------------------------------------------------------------------

    def lookup(
        self,
        *,
        device: str,
        backend: str,
        versions: str,
        problem_key: str,
        batches: Iterable[int] | None,
        algos: Iterable[str] | None = None,
    ) -> dict[tuple[str, int], MicroConfig]:
        """Cached measurements of one problem on one device/backend/versions, keyed (algo, batch).

        Only rows whose device, backend, versions and problem key match exactly are returned, so
        a measurement taken with other library versions is never reused. `batches=None` means
        every batch size; `algos=None` every algorithm. A failed candidate comes back with
        `time=inf` and its reason.
        """
        ident = (
            _text("device", device),
            _text("backend", backend),
            _text("versions", versions),
            _text("problem_key", problem_key),
        )
        batch_list = None if batches is None else sorted(set(self._check_batches(batches)))
        algo_list = None if algos is None else sorted({_text("algo", a) for a in algos})
        if batch_list == [] or algo_list == []:
            return {}
        m, d, p = _measurements.c, _devices.c, _problems.c
        base = (
            select(m.algo, m.batch, m.time_ms, m.workspace_bytes, m.reason, m.spread_ms)
            .select_from(_measurements.join(_devices, d.id == m.device_id).join(_problems, p.id == m.problem_id))
            .where(d.model == ident[0], d.backend == ident[1], d.versions == ident[2], p.key == ident[3])
        )
        if algo_list is not None:
            base = base.where(m.algo.in_(algo_list))
        queries = [base] if batch_list is None else [base.where(m.batch.in_(chunk)) for chunk in _chunks(batch_list)]

        def work(conn: Connection) -> tuple[dict[tuple[str, int], MicroConfig], list[tuple[Any, str]]]:
            found, damaged = {}, []
            for query in queries:
                for row in conn.execute(query):
                    error = row_error(row)
                    if error:
                        damaged.append((row, error))
                    else:
                        found[(row.algo, row.batch)] = _micro_from_row(row)
            return found, damaged

        found, damaged = self._run(work, write=False, action="read", single_read=True)
        for row, error in damaged:
            self.discard(*ident, row.algo, row.batch, row.time_ms, row.workspace_bytes, error)
        return found

    def discard(
        self,
        device: str,
        backend: str,
        versions: str,
        problem_key: str,
        algo: str,
        batch: object,
        time_ms: object,
        workspace_bytes: object,
        rule: str,
    ) -> None:
        """A measurement read from this cache breaks `rule`: warn once, and delete it (where the cache can be
        written) while it still holds what was read, so that it is missing, as the caller treats it, and the
        new measurement is stored in its place. A row another process replaced meanwhile is kept."""
        self.damaged(
            "measurement", f"{algo!r:.80} at batch {batch!r:.20} of {problem_key!r:.160} on {device!r:.80}", rule
        )
        if self.readonly:
            return
        m, d, p = _measurements.c, _devices.c, _problems.c
        stmt = delete(_measurements).where(
            m.device_id.in_(select(d.id).where(d.model == device, d.backend == backend, d.versions == versions)),
            m.problem_id.in_(select(p.id).where(p.key == problem_key)),
            m.algo == algo,
            m.batch == batch,
            m.time_ms.is_not_distinct_from(time_ms),
            m.workspace_bytes == workspace_bytes,
        )
        self._run(lambda conn: conn.execute(stmt), write=True, action="write to")

    def damaged(self, what: str, key: str, rule: str) -> None:
        """Say once for this cache that a row (`what` under `key`) breaks `rule`: ignored as missing."""
        if (what, key) not in self._damaged:
            self._damaged.add((what, key))
            again = "measured" if what == "measurement" else "planned"
            log.warning(
                "%s: damaged %s %s ignored (%s); %s again and replaced%s", self._where, what, key, rule, again, _REPAIR
            )

    @staticmethod
    def _check_batches(batches: Iterable[int]) -> list[int]:
        out = []
        for b in batches:
            if not isinstance(b, int) or isinstance(b, bool) or b < 1:
                raise InvalidInput(f"batches must be positive integers, got {b!r}")
            out.append(b)
        return out

    def store(
        self,
        *,
        device: str,
        backend: str,
        versions: str,
        problem_key: str,
        micros: Iterable[MicroConfig],
        replace: bool = False,
    ) -> int:
        """Write measurements of one problem; returns how many rows were newly written.

        Idempotent: a measurement already cached under the same key is kept as it is (another
        process measured it first), unless `replace=True`, which overwrites it and counts it. An
        infinite time is stored as NULL with its reason and comes back as `inf`.
        """
        ident = (
            _text("device", device),
            _text("backend", backend),
            _text("versions", versions),
            _text("problem_key", problem_key),
        )
        rows = [_check_micro(mc, i) for i, mc in enumerate(micros)]
        seen: dict[tuple[str, int], int] = {}
        for i, row in enumerate(rows):
            first = seen.setdefault((row["algo"], row["batch"]), i)
            if first != i:
                raise InvalidInput(
                    f"micros[{first}] and micros[{i}] are both {row['algo']!r} at batch "
                    f"{row['batch']}; store one measurement per algorithm and batch"
                )
        if not rows:
            return 0
        # The same order in every writer, so PostgreSQL row locks are taken without deadlock.
        rows.sort(key=lambda r: (r["algo"], r["batch"]))

        keys = ["device_id", "problem_id", "algo", "batch"]
        stmt = self._insert(_measurements)
        if replace:
            stmt = stmt.on_conflict_do_update(
                index_elements=keys,
                set_={
                    name: stmt.excluded[name]
                    for name in ("time_ms", "spread_ms", "workspace_bytes", "reason", "created_at")
                },
            )
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
            values = [{**r, "device_id": device_id, "problem_id": problem_id, "created_at": created_at} for r in rows]
            return len(conn.execute(stmt, values).all())

        return self._run(work, write=True, action="write to")

    # -- plans --------------------------------------------------------------------------------

    def get_plan(self, key: str) -> dict | None:
        """The plan stored under `key`, or None."""
        _text("plan key", key)
        digest = _key_sha256(key)

        def work(conn: Connection) -> str | None:
            row = conn.execute(select(_plans.c.key, _plans.c.plan_json).where(_plans.c.key_sha256 == digest)).first()
            return row.plan_json if row is not None and row.key == key else None

        text = self._run(work, write=False, action="read", single_read=True)
        if text is None:
            return None
        return self._checked_plan(key, text)

    def _checked_plan(self, key: str, text: object) -> dict | None:
        """The plan in `text`, or None (with a warning) where it is no plan: a damaged row is a missing one."""
        plan, error = None, "plan_json is not text"
        if isinstance(text, str):
            try:
                plan, error = PLAN_JSON.decode(text), "it is no JSON object"
            except ValueError as exc:
                error = f"not JSON: {exc}"
        if isinstance(plan, dict):
            return plan
        self.damaged("plan", repr(key[:80]), error)
        return None

    def put_plan(self, key: str, plan: dict) -> None:
        """Store `plan` (a JSON-able dict) under `key`, replacing any plan already there."""
        _text("plan key", key)
        text = _plan_json(key, plan)
        values = {"key_sha256": _key_sha256(key), "key": key, "plan_json": text, "created_at": _now()}

        def work(conn: Connection) -> None:
            stmt = self._insert(_plans).values(values)
            conn.execute(
                stmt.on_conflict_do_update(
                    index_elements=["key_sha256"],
                    set_={
                        "key": stmt.excluded.key,
                        "plan_json": stmt.excluded.plan_json,
                        "created_at": stmt.excluded.created_at,
                    },
                )
            )

        self._run(work, write=True, action="write to")

    # -- maintenance --------------------------------------------------------------------------

    def info(self) -> dict[str, Any]:
        """Counts of devices, problems, measurements and plans; schema version; URL; per device."""
        m, d = _measurements.c, _devices.c

        def work(conn: Connection) -> dict[str, Any]:
            count = lambda table: conn.execute(select(func.count()).select_from(table)).scalar_one()
            per_device = conn.execute(
                select(d.model, d.backend, d.versions, func.count(m.id).label("n"))
                .select_from(_devices.outerjoin(_measurements, m.device_id == d.id))
                .group_by(d.id, d.model, d.backend, d.versions)
                .order_by(d.model, d.backend, d.versions)
            ).all()
            version = conn.execute(select(_meta.c.value).where(_meta.c.key == SCHEMA_VERSION_KEY)).scalar_one()
            return {
                "url": self.url,
                "schema_version": int(version),
                "devices": count(_devices),
                "problems": count(_problems),
                "measurements": count(_measurements),
                "plans": count(_plans),
                "by_device": [
                    {"device": r.model, "backend": r.backend, "versions": r.versions, "measurements": r.n}
                    for r in per_device
                ],
            }

        return self._run(work, write=False, action="read")

    def prune(
        self,
        *,
        device: str | None = None,
        backend: str | None = None,
        versions: str | None = None,
        older_than_days: float | None = None,
        everything: bool = False,
        invalid: bool = False,
        dry_run: bool = False,
    ) -> dict[str, int]:
        """Delete measurements matching every given filter; returns rows removed per table.

        Filters combine with AND. Plans carry no device, so they are removed only by age
        (`older_than_days` with no device/backend/versions filter) or by `everything`. `invalid`
        (alone) removes the damaged measurements and plans that `check` lists. Devices and
        problems left with no measurement are removed too. At least one filter, `invalid` or
        `everything=True` is required, so that a bare call cannot empty the cache.
        """
        if invalid:
            if everything or any(v is not None for v in (device, backend, versions, older_than_days)):
                raise InvalidInput("prune --invalid takes no other filter and not --all")
        else:
            where = maintenance.filters(
                device=device,
                backend=backend,
                versions=versions,
                older_than_days=older_than_days,
                everything=everything,
            )
        m, d = _measurements.c, _devices.c
        orphan_devices = ~exists().where(m.device_id == d.id)
        orphan_problems = ~exists().where(m.problem_id == _problems.c.id)

        def work(conn: Connection) -> dict[str, int]:
            self._lock_for_bulk(conn)
            measurement_where, plan_where = where if not invalid else maintenance.damaged_where(conn)
            count = lambda table, where: conn.execute(
                select(func.count()).select_from(table).where(*where)
            ).scalar_one()
            removed = {
                "measurements": count(_measurements, measurement_where),
                "plans": 0 if plan_where is None else count(_plans, plan_where),
            }
            if dry_run:
                return removed
            conn.execute(delete(_measurements).where(*measurement_where))
            if plan_where is not None:
                conn.execute(delete(_plans).where(*plan_where))
            removed["devices"] = conn.execute(delete(_devices).where(orphan_devices)).rowcount
            removed["problems"] = conn.execute(delete(_problems).where(orphan_problems)).rowcount
            return removed

        return self._run(work, write=not dry_run, action="prune")

    def check(self) -> list[maintenance.Damaged]:
        """The measurements and plans that break a rule (`ucudnn.db.rules`), as `db check` lists them."""
        return self._run(maintenance.damaged_rows, write=False, action="read")

    # -- export and merge ---------------------------------------------------------------------

    def measurement_records(self) -> Iterator[MeasurementRecord]:
        """Every measurement with its full key, in key order (stable across runs and engines)."""
        m, d, p = _measurements.c, _devices.c, _problems.c
        query = (
            select(
                d.model,
                d.backend,
                d.versions,
                p.key,
                m.algo,
                m.batch,
                m.time_ms,
                m.spread_ms,
                m.workspace_bytes,
                m.reason,
                m.created_at,
            )
            .select_from(_measurements.join(_devices, d.id == m.device_id).join(_problems, p.id == m.problem_id))
            .order_by(*map(self._bytewise, (d.model, d.backend, d.versions, p.key, m.algo)), m.batch)
        )
        yield from self._stream(
            query,
            lambda r: MeasurementRecord(
                r.model,
                r.backend,
                r.versions,
                r.key,
                r.algo,
                r.batch,
                r.time_ms,
                r.spread_ms,
                r.workspace_bytes,
                r.reason,
                r.created_at,
            ),
        )

    def plan_records(self) -> Iterator[PlanRecord]:
        """Every plan, in key order."""
        query = select(_plans.c.key, _plans.c.plan_json, _plans.c.created_at).order_by(self._bytewise(_plans.c.key))
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

    def merge(
        self, measurements: Callable[[], Iterable[MeasurementRecord]], plans: Callable[[], Iterable[PlanRecord]]
    ) -> MergeReport:
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
            return MergeReport(
                merge_measurements(conn, measurements(), self._device_id, self._problem_id), merge_plans(conn, plans())
            )

        return self._run(work, write=True, action="import into")

    # -- lifetime -----------------------------------------------------------------------------

    def close(self) -> None:
        """Release every connection. The cache cannot be used afterwards."""
        self._engine.dispose()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Cache({self.url!r}{', readonly=True' if self.readonly else ''})"
