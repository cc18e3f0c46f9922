"""Export a cache to JSON lines, and import an export (or another cache) into a cache.

The export is one JSON object per line: a header, then every measurement with its full key, then
every plan, each in key order, so the same cache always exports to the same bytes (apart from
the header's `exported_at`). A measurement that could not run has `"time_ms": null` and its
reason. Import merges by `MERGE_RULE` (see `ucudnn.db.merge`).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import socket
import stat
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import IO, Any

from ucudnn.db.cache import Cache
from ucudnn.db.location import mask_password
from ucudnn.db.merge import MeasurementRecord, MergeReport, PlanRecord
from ucudnn.db.models import SCHEMA_VERSION
from ucudnn.db.opening import SQLITE_HEADER
from ucudnn.db.rows import _kind_of, _now, _plan_json
from ucudnn.db.rules import _check_text, _timestamp, check_measurement, check_plan

from ucudnn.errors import DatabaseError, InvalidInput

EXPORT_FORMAT = "ucudnn-cache-export"
EXPORT_VERSION = 1


def _parse_timestamp(text: object) -> datetime:
    if not isinstance(text, str):
        # A wrong type in a file is a bad value like any other: ValueError, which the reader turns into InvalidInput.
        raise ValueError(f"created_at must be an ISO 8601 string, got {text!r}")  # noqa: TRY004
    try:
        value = datetime.fromisoformat(text)
    except ValueError as exc:
        raise ValueError(f"created_at {text!r} is not an ISO 8601 timestamp") from exc
    if value.tzinfo is not None:
        value = value.astimezone(UTC).replace(tzinfo=None)
    return value


def export_objects(cache: Cache) -> Iterator[dict[str, Any]]:
    """The export of `cache`, one JSON-able dict per line: a header, measurements, plans."""
    yield {
        "type": "header",
        "format": EXPORT_FORMAT,
        "version": EXPORT_VERSION,
        "schema_version": SCHEMA_VERSION,
        "exported_at": _timestamp(_now()),
    }
    for r in cache.measurement_records():
        yield {
            "type": "measurement",
            "device": r.device,
            "backend": r.backend,
            "versions": r.versions,
            "problem_key": r.problem_key,
            "kind": _kind_of(r.problem_key),
            "algo": r.algo,
            "batch": r.batch,
            "time_ms": r.time_ms,
            "spread_ms": r.spread_ms,
            "workspace_bytes": r.workspace_bytes,
            "reason": r.reason,
            "created_at": _timestamp(r.created_at),
        }
    for p in cache.plan_records():
        yield {"type": "plan", "key": p.key, "plan": json.loads(p.plan_json), "created_at": _timestamp(p.created_at)}


def _umask() -> int:
    mask = os.umask(0o022)  # reading the umask means setting it; put it straight back
    os.umask(mask)
    return mask


# Who writes an export's temporary file, in its name (`.NAME.HOST-PID.XXXXXXXX.tmp`), so that the next export
# can tell one left by a killed writer (this host, a process that is gone) from one still being written.
_HOST = re.sub(r"[^A-Za-z0-9]", "", socket.gethostname())[:32] or "host"
# A temporary whose writer cannot be asked (another host, or a name without one) is stale once unchanged this long.
STALE_TEMPORARY = timedelta(hours=1)


def _writer_gone(host: str | None, pid: str | None) -> bool:
    if host != _HOST or pid is None:
        return False
    try:
        os.kill(int(pid), 0)  # signal 0: is it there?
    except ProcessLookupError:
        return True
    except (PermissionError, OverflowError):  # another user's process; a number no pid can be
        pass
    return False


def _remove_stale_temporaries(path: Path) -> None:
    """Remove temporaries of exports to `path` that their writer left behind (killed): written on this host by a
    process that is gone, or unchanged for `STALE_TEMPORARY`. Another export running now keeps its own."""
    pattern = re.compile(rf"\.{re.escape(path.name)}\.(?:(?P<host>[A-Za-z0-9]+)-(?P<pid>\d+)\.)?[^/]+\.tmp")
    cutoff = time.time() - STALE_TEMPORARY.total_seconds()
    with contextlib.suppress(OSError), os.scandir(path.parent) as entries:
        for entry in entries:
            match = pattern.fullmatch(entry.name)
            if match is None or not entry.is_file(follow_symlinks=False):
                continue
            with contextlib.suppress(OSError):
                if _writer_gone(match["host"], match["pid"]) or entry.stat(follow_symlinks=False).st_mtime < cutoff:
                    os.unlink(entry.path)


def export_to(cache: Cache, target: str) -> dict[str, int]:
    """Write the export to what `target` names; returns counts per record type.

    Only a regular file (or a new name) is replaced: the export is written beside it and renamed
    into place, so a failed export never leaves half a file where a good one was, and the new
    file gets the mode and owner the old one had (a new one the umask's mode). Anything else
    that is not a directory (`-` for stdout, a FIFO, a character or block device such as
    /dev/null) is written to as it is, never replaced. A failed write (a full disk) raises
    DatabaseError.
    """
    counts = {"measurements": 0, "plans": 0}

    def write(fp: IO[str]) -> None:
        for obj in export_objects(cache):
            if obj["type"] != "header":
                counts[obj["type"] + "s"] += 1
            fp.write(json.dumps(obj, allow_nan=False) + "\n")
        fp.flush()

    def failed(where: object, exc: OSError) -> DatabaseError:
        return DatabaseError(f"cannot write the export {where}: {exc.strerror or exc}")

    if target == "-":
        try:
            write(sys.stdout)
        except OSError as exc:
            raise failed("to stdout", exc) from exc
        return counts
    path = Path(target).expanduser().resolve()  # a symlink's target is written, the link kept
    try:
        old = path.stat()
    except FileNotFoundError:
        old = None
    except OSError as exc:
        raise failed(path, exc) from exc
    mode = None if old is None else old.st_mode
    if mode is not None and stat.S_ISDIR(mode):
        raise InvalidInput(f"export target {target!r} is a directory; name a file")
    if mode is not None and not stat.S_ISREG(mode):
        # A FIFO or a device: stream into it. Replacing it would destroy it (as root, even /dev/null).
        try:
            with open(path, "w", encoding="utf-8") as fp:
                write(fp)
        except OSError as exc:
            raise failed(path, exc) from exc
        return counts
    _remove_stale_temporaries(path)
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.{_HOST}-{os.getpid()}.", suffix=".tmp", dir=path.parent)
    except OSError as exc:
        raise failed(path, exc) from exc
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fp:
            os.fchmod(fp.fileno(), stat.S_IMODE(mode) if mode is not None else 0o666 & ~_umask())
            if old is not None and (old.st_uid, old.st_gid) != (os.geteuid(), os.getegid()):
                with contextlib.suppress(PermissionError):  # only root may give a file away
                    os.fchown(fp.fileno(), old.st_uid, old.st_gid)
            write(fp)
            os.fsync(fp.fileno())
        os.replace(tmp, path)
    except BaseException as exc:
        os.unlink(tmp)
        if isinstance(exc, OSError):
            raise failed(path, exc) from exc
        raise
    return counts


# ---------------------------------------------------------------------------------------------
# Reading an export


def _reject_constant(name: str) -> float:
    raise ValueError(f"{name} is not JSON; times must be finite numbers or null")


_DECODER = json.JSONDecoder(parse_constant=_reject_constant)  # made once, not per line


def _measurement(obj: dict[str, Any], now: datetime) -> MeasurementRecord:
    time_ms = obj.get("time_ms")
    if time_ms is not None and (isinstance(time_ms, bool) or not isinstance(time_ms, (int, float))):
        raise ValueError(f"time_ms must be a number or null, got {time_ms!r:.80}")
    spread_ms = obj.get("spread_ms", 0.0)
    if isinstance(spread_ms, bool) or not isinstance(spread_ms, (int, float)):
        raise ValueError(f"spread_ms must be a number, got {spread_ms!r:.80}")  # noqa: TRY004
    # the file's values as they are (None where missing): check_measurement checks the record's fields below
    stored: dict[str, Any] = {
        name: obj.get(name)
        for name in ("device", "backend", "versions", "problem_key", "algo", "batch", "workspace_bytes")
    }
    record = MeasurementRecord(
        **stored,
        time_ms=None if time_ms is None else float(time_ms),
        spread_ms=float(spread_ms),
        reason=obj.get("reason", ""),
        created_at=_parse_timestamp(obj.get("created_at")),
    )
    check_measurement(record, now)
    kind = obj.get("kind")
    if kind is not None and kind != _kind_of(record.problem_key):
        raise ValueError(f"kind {kind!r:.40} disagrees with the problem key's {_kind_of(record.problem_key)!r}")
    return record


def _plan(obj: dict[str, Any], now: datetime) -> PlanRecord:
    key = _check_text("plan key", obj.get("key"))
    try:
        text = _plan_json(key, obj.get("plan"))
    except InvalidInput as exc:
        raise ValueError(str(exc)) from exc
    record = PlanRecord(key=key, plan_json=text, created_at=_parse_timestamp(obj.get("created_at")))
    check_plan(record, now)
    return record


def _read_export(path: Path, now: datetime) -> Iterator[MeasurementRecord | PlanRecord]:
    """Parse and check every line; InvalidInput names the file, the line and the rule broken."""
    try:
        fp = open(path, encoding="utf-8")  # noqa: SIM115 - entered below; an error here is the open's alone
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
                    obj = _DECODER.decode(line)
                    if not isinstance(obj, dict):
                        raise ValueError("each line must be a JSON object")  # noqa: TRY004
                    kind = obj.get("type")
                    if not header_seen:
                        if kind != "header" or obj.get("format") != EXPORT_FORMAT:
                            raise ValueError(
                                f"the first line must be a {EXPORT_FORMAT} header (write one with `ucudnn db export`)"
                            )
                        if obj.get("version") != EXPORT_VERSION:
                            raise ValueError(
                                f"export format version {obj.get('version')!r} is "
                                f"not {EXPORT_VERSION}, the one this ucudnn reads"
                            )
                        header_seen = True
                    elif kind == "measurement":
                        yield _measurement(obj, now)
                    elif kind == "plan":
                        yield _plan(obj, now)
                    else:
                        raise ValueError(f"type must be 'measurement' or 'plan', got {kind!r}")
                except ValueError as exc:
                    raise InvalidInput(f"{where}: {exc}") from exc
        except UnicodeDecodeError as exc:
            raise InvalidInput(
                f"{path} is neither a ucudnn export (JSON lines) nor a SQLite cache: {exc.reason} at byte {exc.start}"
            ) from exc
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
        raise InvalidInput(f"import source {mask_password(source)!r} is not a file")
    if target_file is not None and _same_file(str(path), str(target_file)):
        raise InvalidInput(f"import source {mask_password(source)!r} is the cache itself")
    with open(path, "rb") as fp:
        header = fp.read(len(SQLITE_HEADER))
    if header == SQLITE_HEADER:
        return _import_cache(cache, Cache(path, readonly=True))
    now = _now()
    for _ in _read_export(path, now):  # check everything first: a bad line imports nothing
        pass

    def records(kind: type) -> Callable[[], Iterator]:
        return lambda: (r for r in _read_export(path, now) if isinstance(r, kind))

    return cache.merge(records(MeasurementRecord), records(PlanRecord))


def _import_cache(cache: Cache, source: Cache) -> MergeReport:
    try:
        if (
            source.sqlite_path is not None
            and cache.sqlite_path is not None
            and _same_file(str(source.sqlite_path), str(cache.sqlite_path))
        ):
            raise InvalidInput(f"import source {source.url} is the cache itself")
        if source.url == cache.url and source.sqlite_path is None:
            raise InvalidInput(f"import source {source.url} is the cache itself")
        now = _now()
        # Another cache is held to the same rules as an export, all of it before anything is written.
        for number, record in enumerate(source.measurement_records(), start=1):
            try:
                check_measurement(record, now)
            except ValueError as exc:
                raise InvalidInput(
                    f"{source.url} measurement {number} ({record.algo!r:.60} at batch {record.batch}): {exc}"
                ) from None
        for plan in source.plan_records():
            try:
                check_plan(plan, now)
            except ValueError as exc:
                raise InvalidInput(f"{source.url} plan {plan.key!r:.60}: {exc}") from None
        return cache.merge(source.measurement_records, source.plan_records)
    finally:
        source.close()
