"""Export a cache to JSON lines, and import an export (or another cache) into a cache.

The export is one JSON object per line: a header, then every measurement with its full key, then
every plan, each in key order, so the same cache always exports to the same bytes (apart from
the header's `exported_at`). A measurement that could not run has `"time_ms": null` and its
reason. Import merges by `MERGE_RULE` (see `ucudnn.db.cache`).
"""

from __future__ import annotations

import json
import math
import os
import sys
import tempfile
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import IO, Any

from ucudnn.db.cache import (SQLITE_HEADER, Cache, MeasurementRecord, MergeReport, PlanRecord,
                             _kind_of, _now, _plan_json)
from ucudnn.db.models import SCHEMA_VERSION
from ucudnn.errors import DatabaseError, InvalidInput

EXPORT_FORMAT = "ucudnn-cache-export"
EXPORT_VERSION = 1


def _timestamp(value: datetime) -> str:
    return value.isoformat(timespec="microseconds") + "Z"


def _parse_timestamp(text: object) -> datetime:
    if not isinstance(text, str):
        raise ValueError(f"created_at must be an ISO 8601 string, got {text!r}")
    try:
        value = datetime.fromisoformat(text)
    except ValueError as exc:
        raise ValueError(f"created_at {text!r} is not an ISO 8601 timestamp") from exc
    if value.tzinfo is not None:
        value = value.astimezone(UTC).replace(tzinfo=None)
    return value


def export_objects(cache: Cache) -> Iterator[dict[str, Any]]:
    """The export of `cache`, one JSON-able dict per line: a header, measurements, plans."""
    yield {"type": "header", "format": EXPORT_FORMAT, "version": EXPORT_VERSION,
           "schema_version": SCHEMA_VERSION, "exported_at": _timestamp(_now())}
    for r in cache.measurement_records():
        yield {"type": "measurement", "device": r.device, "backend": r.backend,
               "versions": r.versions, "problem_key": r.problem_key,
               "kind": _kind_of(r.problem_key), "algo": r.algo, "batch": r.batch,
               "time_ms": r.time_ms, "spread_ms": r.spread_ms,
               "workspace_bytes": r.workspace_bytes, "reason": r.reason,
               "created_at": _timestamp(r.created_at)}
    for p in cache.plan_records():
        yield {"type": "plan", "key": p.key, "plan": json.loads(p.plan_json),
               "created_at": _timestamp(p.created_at)}


def export_to(cache: Cache, target: str) -> dict[str, int]:
    """Write the export to the file `target` ('-' for stdout); returns counts per record type.

    A file is written beside its final name and renamed into place, so a failed export never
    leaves half a file where a good one was.
    """
    counts = {"measurements": 0, "plans": 0}

    def write(fp: IO[str]) -> None:
        for obj in export_objects(cache):
            if obj["type"] != "header":
                counts[obj["type"] + "s"] += 1
            fp.write(json.dumps(obj, allow_nan=False) + "\n")

    if target == "-":
        write(sys.stdout)
        sys.stdout.flush()
        return counts
    path = Path(target).expanduser().resolve()
    if path.is_dir():
        raise InvalidInput(f"export target {target!r} is a directory; name a file")
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    except OSError as exc:
        raise DatabaseError(f"cannot write the export {path}: {exc.strerror or exc}") from exc
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fp:
            write(fp)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
    return counts


# ---------------------------------------------------------------------------------------------
# Reading an export


def _reject_constant(name: str) -> float:
    raise ValueError(f"{name} is not JSON; times must be finite numbers or null")


_TEXT_FIELDS = ("device", "backend", "versions", "problem_key", "algo")


def _measurement(obj: dict[str, Any]) -> MeasurementRecord:
    for name in _TEXT_FIELDS:
        if not isinstance(obj.get(name), str) or not obj[name].strip():
            raise ValueError(f"{name} must be a non-empty string, got {obj.get(name)!r}")
    batch, workspace = obj.get("batch"), obj.get("workspace_bytes")
    if not isinstance(batch, int) or isinstance(batch, bool) or batch < 1:
        raise ValueError(f"batch must be a positive integer, got {batch!r}")
    if not isinstance(workspace, int) or isinstance(workspace, bool) or workspace < 0:
        raise ValueError(f"workspace_bytes must be a non-negative integer, got {workspace!r}")
    time_ms, spread_ms = obj.get("time_ms"), obj.get("spread_ms", 0.0)
    if time_ms is not None and (isinstance(time_ms, bool) or not isinstance(time_ms, (int, float))
                                or not math.isfinite(time_ms) or time_ms < 0):
        raise ValueError(f"time_ms must be a non-negative number or null, got {time_ms!r}")
    if isinstance(spread_ms, bool) or not isinstance(spread_ms, (int, float)) \
            or not math.isfinite(spread_ms) or spread_ms < 0:
        raise ValueError(f"spread_ms must be a non-negative number, got {spread_ms!r}")
    reason = obj.get("reason", "")
    if not isinstance(reason, str):
        raise ValueError(f"reason must be a string, got {reason!r}")
    return MeasurementRecord(
        device=obj["device"], backend=obj["backend"], versions=obj["versions"],
        problem_key=obj["problem_key"], algo=obj["algo"], batch=batch,
        time_ms=None if time_ms is None else float(time_ms), spread_ms=float(spread_ms),
        workspace_bytes=workspace, reason=reason, created_at=_parse_timestamp(obj.get("created_at")))


def _plan(obj: dict[str, Any]) -> PlanRecord:
    key = obj.get("key")
    if not isinstance(key, str) or not key.strip():
        raise ValueError(f"key must be a non-empty string, got {key!r}")
    try:
        text = _plan_json(key, obj.get("plan"))
    except InvalidInput as exc:
        raise ValueError(str(exc)) from exc
    return PlanRecord(key=key, plan_json=text, created_at=_parse_timestamp(obj.get("created_at")))


def _read_export(path: Path) -> Iterator[MeasurementRecord | PlanRecord]:
    """Parse and check every line; InvalidInput names the file, the line and the rule broken."""
    try:
        fp = open(path, encoding="utf-8")
    except OSError as exc:
        raise InvalidInput(f"cannot read {path}: {exc.strerror or exc}") from exc
    with fp:
        header_seen = False
        try:
            for number, line in enumerate(fp, start=1):
                if not line.strip():
                    continue
                where = f"{path} line {number}"
                try:
                    obj = json.loads(line, parse_constant=_reject_constant)
                    if not isinstance(obj, dict):
                        raise ValueError("each line must be a JSON object")
                    kind = obj.get("type")
                    if not header_seen:
                        if kind != "header" or obj.get("format") != EXPORT_FORMAT:
                            raise ValueError(f"the first line must be a {EXPORT_FORMAT} header "
                                             f"(write one with `ucudnn db export`)")
                        if obj.get("version") != EXPORT_VERSION:
                            raise ValueError(f"export format version {obj.get('version')!r} is "
                                             f"not {EXPORT_VERSION}, the one this ucudnn reads")
                        header_seen = True
                    elif kind == "measurement":
                        yield _measurement(obj)
                    elif kind == "plan":
                        yield _plan(obj)
                    else:
                        raise ValueError(f"type must be 'measurement' or 'plan', got {kind!r}")
                except ValueError as exc:
                    raise InvalidInput(f"{where}: {exc}") from exc
        except UnicodeDecodeError as exc:
            raise InvalidInput(f"{path} is neither a ucudnn export (JSON lines) nor a SQLite "
                               f"cache: {exc.reason} at byte {exc.start}") from exc
        if not header_seen:
            raise InvalidInput(f"{path} is empty; expected a {EXPORT_FORMAT} file")


def _same_file(a: str, b: str) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def import_into(cache: Cache, source: str) -> MergeReport:
    """Merge `source` into `cache` by `MERGE_RULE`.

    `source` is an export file (JSON lines), a SQLite cache file, or a cache URL (read
    read-only). An export is checked line by line before anything is written, and the merge
    is one transaction, so a bad source changes nothing.
    """
    if not isinstance(source, str) or not source.strip():
        raise InvalidInput(f"import source must be a file path or cache URL, got {source!r}")
    target_file = cache.sqlite_path
    if "://" in source:
        return _import_cache(cache, Cache(source, readonly=True))
    path = Path(source).expanduser()
    if not path.is_file():
        raise InvalidInput(f"import source {source!r} is not a file")
    if target_file is not None and _same_file(str(path), str(target_file)):
        raise InvalidInput(f"import source {source!r} is the cache itself")
    with open(path, "rb") as fp:
        header = fp.read(len(SQLITE_HEADER))
    if header == SQLITE_HEADER:
        return _import_cache(cache, Cache(path, readonly=True))
    for _ in _read_export(path):  # check everything first: a bad line imports nothing
        pass

    def records(kind: type) -> Callable[[], Iterator]:
        return lambda: (r for r in _read_export(path) if isinstance(r, kind))

    return cache.merge(records(MeasurementRecord), records(PlanRecord))


def _import_cache(cache: Cache, source: Cache) -> MergeReport:
    try:
        if source.sqlite_path is not None and cache.sqlite_path is not None \
                and _same_file(str(source.sqlite_path), str(cache.sqlite_path)):
            raise InvalidInput(f"import source {source.url} is the cache itself")
        if source.url == cache.url and source.sqlite_path is None:
            raise InvalidInput(f"import source {source.url} is the cache itself")
        return cache.merge(source.measurement_records, source.plan_records)
    finally:
        source.close()
