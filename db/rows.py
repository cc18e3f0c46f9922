"""How Python values become rows and back, checked on the way in.

A cache is shared by processes and machines, so nothing reaches a table unchecked: texts are
non-empty strings, a plan is canonical JSON (so equal plans store equal text), a measurement's
infinite time is NULL, and times are naive UTC on every engine.
"""

from __future__ import annotations

import hashlib
import json
import math
from datetime import UTC, datetime
from typing import Any

from ucudnn.solver.types import MicroConfig

from ucudnn.errors import InvalidInput


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
        raise InvalidInput(
            f"plan for key {key[:80]!r} is not JSON-able ({exc}); "
            f"plans hold only dicts, lists, strings, finite numbers, bools, None"
        ) from exc


def _key_sha256(key: str) -> str:
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


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
    return {
        "algo": m.algo,
        "batch": m.batch,
        "time_ms": float(m.time) if math.isfinite(m.time) else None,
        "spread_ms": float(m.spread),
        "workspace_bytes": m.workspace,
        "reason": m.reason,
    }


def _micro_from_row(row: Any) -> MicroConfig:
    return MicroConfig(
        algo=row.algo,
        batch=row.batch,
        time=math.inf if row.time_ms is None else row.time_ms,
        workspace=row.workspace_bytes,
        reason=row.reason,
        spread=row.spread_ms,
    )
