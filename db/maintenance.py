"""What `ucudnn db check` and `db prune` select: the rows that break the rules, and the rows a filter names.

A damaged row (one that `ucudnn.db.rules` refuses: a time stored as text, a negative workspace, a plan whose
micro-batches do not sum to its batch, ...) is ignored as missing wherever it is read, and replaced when it is
measured or planned again; these functions find such rows in a whole cache so that they can be listed or
removed at once.
"""

from __future__ import annotations

import dataclasses
import math
from datetime import datetime, timedelta

from sqlalchemy import ColumnElement, Connection, String, and_, select, type_coerce
from ucudnn.db.merge import MeasurementRecord, PlanRecord
from ucudnn.db.models import TABLES
from ucudnn.db.rows import PLAN_JSON, _now, _text, plan_error
from ucudnn.db.rules import check_measurement, check_plan

from ucudnn.errors import InvalidInput

_devices, _problems, _measurements, _plans = (
    TABLES["devices"],
    TABLES["problems"],
    TABLES["measurements"],
    TABLES["plans"],
)


@dataclasses.dataclass(frozen=True, slots=True)
class Damaged:
    """One row that breaks a rule: `kind` (`measurement` or `plan`), its key as text, the rule, its row id."""

    kind: str
    key: str
    rule: str
    id: int

    def to_json(self) -> dict[str, str]:
        return {"kind": self.kind, "key": self.key, "rule": self.rule}


def _created_at(value: object) -> datetime:
    """A timestamp column as stored: SQLite hands back its text (read uncoerced, so that a damaged one can
    be reported instead of failing the whole read), PostgreSQL a datetime."""
    if isinstance(value, datetime):
        return value
    if not isinstance(value, str):
        raise ValueError(f"created_at must be a timestamp, got {value!r:.40}")  # noqa: TRY004
    try:
        return datetime.fromisoformat(value)
    except ValueError:
        raise ValueError(f"created_at {value!r:.40} is not a timestamp") from None


def damaged_rows(conn: Connection) -> list[Damaged]:
    """Every measurement and plan in the cache that breaks a rule, measurements first, each in id order."""
    now = _now()
    m, d, p = _measurements.c, _devices.c, _problems.c
    found = []
    query = (
        select(
            m.id,
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
            type_coerce(m.created_at, String).label("created_at"),
        )
        .select_from(_measurements.join(_devices, d.id == m.device_id).join(_problems, p.id == m.problem_id))
        .order_by(m.id)
    )
    for r in conn.execute(query):
        try:
            check_measurement(
                MeasurementRecord(
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
                    _created_at(r.created_at),
                ),
                now,
            )
        except ValueError as exc:
            key = f"{r.model} [{r.backend}] {r.key} {r.algo} batch={r.batch}"
            found.append(Damaged("measurement", key, str(exc), r.id))
    plans = select(_plans.c.id, _plans.c.key, _plans.c.plan_json, type_coerce(_plans.c.created_at, String))
    for plan_id, key, text, created_at in conn.execute(plans.order_by(_plans.c.id)):
        try:
            check_plan(PlanRecord(key, text, _created_at(created_at)), now)
            if not isinstance(text, str):
                raise ValueError("plan_json is not text")  # noqa: TRY004
            error = plan_error(PLAN_JSON.decode(text))
            if error:
                raise ValueError(error)
        except ValueError as exc:
            found.append(Damaged("plan", str(key), str(exc), plan_id))
    return found


def damaged_where(conn: Connection) -> tuple[list[ColumnElement[bool]], list]:
    """The WHERE clauses (measurements, plans) of the damaged rows, for `prune --invalid`."""
    found = damaged_rows(conn)
    ids = {kind: [r.id for r in found if r.kind == kind] for kind in ("measurement", "plan")}
    return [_measurements.c.id.in_(ids["measurement"])], [_plans.c.id.in_(ids["plan"])]


def filters(
    *,
    device: str | None,
    backend: str | None,
    versions: str | None,
    older_than_days: float | None,
    everything: bool,
) -> tuple[list[ColumnElement[bool]], list | None]:
    """The WHERE clauses of a prune by filter: (measurements, plans; None: no plan goes). InvalidInput for a
    bad filter, or none (a bare prune cannot empty the cache)."""
    named = {"device": device, "backend": backend, "versions": versions}
    for name, value in named.items():
        if value is not None:
            _text(name, value)
    if older_than_days is not None and (
        not isinstance(older_than_days, (int, float)) or not math.isfinite(older_than_days) or older_than_days < 0
    ):
        raise InvalidInput(f"older_than_days must be a non-negative number, got {older_than_days!r}")
    has_filter = any(v is not None for v in named.values()) or older_than_days is not None
    if everything == has_filter:
        raise InvalidInput(
            "prune needs --device, --backend, --versions or --older-than (combined with AND), --invalid, or --all alone"
        )
    m, d = _measurements.c, _devices.c
    conditions = [column == value for column, value in zip((d.model, d.backend, d.versions), named.values()) if value]
    measurement_where: list[ColumnElement[bool]] = []
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
    return measurement_where, plan_where
