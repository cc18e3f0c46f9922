"""How two caches merge: records with their full key, one total order, the maximum kept.

`MeasurementRecord` and `PlanRecord` are what an export writes and an import reads; their `rank`
is `MERGE_RULE` as a total order on everything stored, so merging the same inputs in any order,
any number of times, gives the same cache. The functions here apply the rule inside a
transaction that `Cache.merge` holds.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from datetime import datetime

from sqlalchemy import Connection, bindparam, select, update
from ucudnn.db.models import TABLES
from ucudnn.db.rows import _key_sha256, row_error

_measurements, _plans = TABLES["measurements"], TABLES["plans"]


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
        return (
            self.created_at,
            usable,
            -(self.time_ms if self.time_ms is not None else 0.0),
            -self.spread_ms,
            -self.workspace_bytes,
            self.reason,
        )


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
    "gives the same cache."
)


def merge_measurements(
    conn: Connection,
    records: Iterable[MeasurementRecord],
    find_device: Callable[[Connection, str, str, str], int],
    find_problem: Callable[[Connection, str], int],
) -> MergeCounts:
    """Merge `records` by `MERGE_RULE`; `find_device` and `find_problem` give (inserting) a key's row id."""
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
                device_ids[dkey] = find_device(conn, *dkey)
            if rec.problem_key not in problem_ids:
                problem_ids[rec.problem_key] = find_problem(conn, rec.problem_key)
            groups.setdefault((device_ids[dkey], problem_ids[rec.problem_key]), []).append(rec)
        to_insert, to_update = [], []
        m = _measurements.c
        for (device_id, problem_id), recs in sorted(groups.items()):
            existing = {
                (row.algo, row.batch): row
                for row in conn.execute(
                    select(
                        m.id, m.algo, m.batch, m.time_ms, m.spread_ms, m.workspace_bytes, m.reason, m.created_at
                    ).where(m.device_id == device_id, m.problem_id == problem_id)
                )
            }
            for rec in sorted(recs, key=lambda r: (r.algo, r.batch)):
                values = {
                    "time_ms": rec.time_ms,
                    "spread_ms": rec.spread_ms,
                    "workspace_bytes": rec.workspace_bytes,
                    "reason": rec.reason,
                    "created_at": rec.created_at,
                }
                old = existing.get((rec.algo, rec.batch))
                if old is None:
                    to_insert.append(
                        {
                            "device_id": device_id,
                            "problem_id": problem_id,
                            "algo": rec.algo,
                            "batch": rec.batch,
                            **values,
                        }
                    )
                    inserted += 1
                    continue
                old_rec = dataclasses.replace(
                    rec,
                    time_ms=old.time_ms,
                    spread_ms=old.spread_ms,
                    workspace_bytes=old.workspace_bytes,
                    reason=old.reason,
                    created_at=old.created_at,
                )
                if row_error(old) is not None or rec.rank > old_rec.rank:  # a damaged row loses to any checked one
                    to_update.append({"_id": old.id, **values})
                    replaced += 1
                else:
                    kept += 1
        if to_insert:
            conn.execute(_measurements.insert(), to_insert)
        if to_update:
            conn.execute(update(_measurements).where(_measurements.c.id == bindparam("_id")), to_update)
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


def merge_plans(conn: Connection, records: Iterable[PlanRecord]) -> MergeCounts:
    """Merge plan `records` by `MERGE_RULE`, one key at a time."""
    inserted = replaced = kept = 0
    for rec in records:
        digest = _key_sha256(rec.key)
        old = conn.execute(
            select(_plans.c.id, _plans.c.key, _plans.c.plan_json, _plans.c.created_at).where(
                _plans.c.key_sha256 == digest
            )
        ).first()
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
