"""How Python values become rows and back, checked on the way in.

A cache is shared by processes and machines, so nothing reaches a table unchecked: texts are
non-empty strings, a plan is canonical JSON (so equal plans store equal text), a measurement's
infinite time is NULL, and times are naive UTC on every engine. What is read back is checked by
the same rules (`micro_error`), since another process, an older ucudnn or a hand edit may have
written it.
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


def _no_constant(name: str) -> float:
    raise ValueError(f"{name} is not JSON")


# Plans are written without NaN or Infinity (`_plan_json`); one read back holding them was not written by ucudnn.
PLAN_JSON = json.JSONDecoder(parse_constant=_no_constant)


def _key_sha256(key: str) -> str:
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


def _nan(x: float) -> bool:
    """Whether `x` is NaN; an int never is (and one too large for a float must not raise, as `math.isnan`'s)."""
    return isinstance(x, float) and math.isnan(x)


def micro_error(
    algo: object,
    batch: object,
    time: object,
    workspace: object,
    *,
    reason: object = "",
    spread: object = 0.0,
    columns: bool = False,
) -> str | None:
    """The rule a micro-config's fields break, or None: the one check that a stored row, a row read back, an
    imported record and a stored plan's micro-config all pass. `time` is infinite for a candidate that could not
    run, which must then say why. `columns`: name the fields as the tables and exports do (`time_ms`, ...)."""
    t, w, s = ("time_ms", "workspace_bytes", "spread_ms") if columns else ("time", "workspace", "spread")
    if not isinstance(algo, str) or not algo.strip():
        return f"algo must be a non-empty string, got {algo!r:.80}"
    if not isinstance(batch, int) or isinstance(batch, bool) or batch < 1:
        return f"batch must be a positive integer, got {batch!r:.80}"
    if isinstance(time, bool) or not isinstance(time, (int, float)) or _nan(time) or time < 0:
        return f"{t} must be a non-negative number of ms or +inf, got {time!r:.80}"
    if not isinstance(workspace, int) or isinstance(workspace, bool) or workspace < 0:
        return f"{w} must be a non-negative integer of bytes, got {workspace!r:.80}"
    if isinstance(spread, bool) or not isinstance(spread, (int, float)) or _nan(spread) or not 0 <= spread < math.inf:
        return f"{s} must be a finite non-negative number of ms, got {spread!r:.80}"
    if not isinstance(reason, str):
        return f"reason must be a string, got {type(reason).__name__}"
    if time == math.inf and not reason.strip():
        return f"a measurement that could not run ({t} null) must record its reason"
    return None


def _check_micro(m: object, index: int) -> dict[str, Any]:
    if not isinstance(m, MicroConfig):
        raise InvalidInput(f"micros[{index}] must be a MicroConfig, got {type(m).__name__}")
    error = micro_error(m.algo, m.batch, m.time, m.workspace, reason=m.reason, spread=m.spread)
    if error:
        raise InvalidInput(f"micros[{index}] ({m.algo!r:.80} at batch {m.batch!r:.20}): {error}")
    return {
        "algo": m.algo,
        "batch": m.batch,
        "time_ms": float(m.time) if math.isfinite(m.time) else None,
        "spread_ms": float(m.spread),
        "workspace_bytes": m.workspace,
        "reason": m.reason,
    }


def row_error(row: Any) -> str | None:
    """The rule a measurement row read from a table breaks (None: none). An engine with dynamic types (SQLite)
    gives back whatever was written into a column, text in a number's place included."""
    time = math.inf if row.time_ms is None else row.time_ms
    return micro_error(
        row.algo, row.batch, time, row.workspace_bytes, reason=row.reason, spread=row.spread_ms, columns=True
    )


def _micro_from_row(row: Any) -> MicroConfig:
    """A checked row (`row_error` is None) as a micro-config."""
    return MicroConfig(
        algo=row.algo,
        batch=row.batch,
        time=math.inf if row.time_ms is None else float(row.time_ms),
        workspace=row.workspace_bytes,
        reason=row.reason,
        spread=float(row.spread_ms),
    )


def micro_json_error(d: object) -> str | None:
    """The rule a stored plan's micro-config (`{"algo", "batch", "time_ms", "workspace"}`) breaks, or None."""
    if not isinstance(d, dict):
        return f"a micro-config must be an object, got {type(d).__name__}"
    missing = [name for name in ("algo", "batch", "time_ms", "workspace") if name not in d]
    if missing:
        return f"a micro-config lacks {', '.join(missing)}"
    error = micro_error(d["algo"], d["batch"], d["time_ms"], d["workspace"], reason="planned")
    if error:
        return error
    if d["time_ms"] == math.inf:
        return f"a planned micro-config must have a finite time, got {d['time_ms']!r}"
    return None


def config_json_error(items: object, batch: object) -> str | None:
    """The rule a stored plan's configuration (a list of micro-configs) breaks for a kernel of `batch` samples
    (None: a plan that does not say)."""
    if not isinstance(items, list) or not items:
        return f"a configuration must be a non-empty list of micro-configs, got {items!r:.80}"
    for d in items:
        error = micro_json_error(d)
        if error:
            return error
    total = sum(d["batch"] for d in items)
    if batch is not None and total != batch:
        return f"the configuration's micro-batches sum to {total} samples, not the kernel's batch of {batch!r:.20}"
    return None


def plan_error(plan: object) -> str | None:
    """The rule a stored plan breaks, or None: a JSON object; where it is a handle's plan (it has a `batch`) and
    holds a kernel's configuration (`config`) or a network's (`kernels`, each with a `config`), each as
    `config_json_error` wants."""
    if not isinstance(plan, dict):
        return f"a plan must be a JSON object, got {type(plan).__name__}"
    if "batch" not in plan:  # not a kernel's or a network's plan (a plan of a caller's own): only JSON is asked
        return None
    batch = plan.get("batch")
    parts = [plan]
    if "kernels" in plan:
        kernels = plan["kernels"]
        if not isinstance(kernels, list) or not all(isinstance(k, dict) for k in kernels):
            return "a plan's kernels must be a list of objects"
        parts = kernels
    for part in parts:
        if "config" in part:
            error = config_json_error(part["config"], batch)
            if error:
                return error
        baseline = part.get("baseline")
        if baseline is not None:
            error = micro_json_error(baseline)
            if error:
                return f"baseline: {error}"
    return None
