"""What a stored row must be: the rules an import, `ucudnn db check` and `db prune --invalid` hold every
measurement and plan to (those a reader needs to use a row, `ucudnn.db.rows.micro_error`, among them).
"""

from __future__ import annotations

import functools
import math
import re
from datetime import datetime, timedelta

from ucudnn.db.merge import MeasurementRecord, PlanRecord
from ucudnn.db.rows import micro_error

from ucudnn.errors import InvalidInput


def _timestamp(value: datetime) -> str:
    return value.isoformat(timespec="microseconds") + "Z"


# What a fresh measurement can hold; an import is held to the same, so nothing poisons a cache.
# Clocks of the machines sharing a cache may disagree by this much, no more.
CLOCK_SKEW = timedelta(hours=1)
EARLIEST = datetime(2000, 1, 1)
_MAX_INT32, _MAX_INT64 = 2**31 - 1, 2**63 - 1
_MAX_TIME_MS = 86_400_000.0  # one kernel taking a day is a broken record, not a measurement
# Longest text per field: device models, version lists, problem keys and cuDNN engine names with
# their knobs are all far below these; a reason quotes an exception, so it gets more room.
_MAX_LENGTH = {
    "device": 256,
    "backend": 32,
    "versions": 1024,
    "problem_key": 512,
    "algo": 256,
    "reason": 4096,
    "plan key": 4096,
}
_BACKEND_NAME = re.compile(r"[a-z][a-z0-9_-]*")
_WHITE_SPACE = re.compile(r"\s")
_CPU_ALGORITHMS = ("im2col_gemm", "shift_gemm", "fft", "winograd", "native")


def _check_text(name: str, value: object, *, empty_ok: bool = False) -> str:
    if not isinstance(value, str) or (not value.strip() and not empty_ok):
        raise ValueError(f"{name} must be a non-empty string, got {value!r:.80}")
    if len(value) > _MAX_LENGTH[name]:
        raise ValueError(f"{name} is {len(value)} characters long, over the {_MAX_LENGTH[name]} a real one needs")
    if not value.isprintable():
        raise ValueError(f"{name} {value!r:.80} holds control characters")
    return value


def _check_timestamp(value: datetime, now: datetime) -> None:
    if value > now + CLOCK_SKEW:
        raise ValueError(
            f"created_at {_timestamp(value)} is in the future (now is {_timestamp(now)}, "
            f"clock skew allowed {CLOCK_SKEW}); it would win every later merge"
        )
    if value < EARLIEST:
        raise ValueError(f"created_at {_timestamp(value)} is before {EARLIEST.year}; no ucudnn measurement is that old")


def _check_number(name: str, value: object, *, maximum: float) -> None:
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or not 0 <= value <= maximum
    ):
        raise ValueError(f"{name} must be a number from 0 to {maximum:g}, got {value!r:.80}")


def _check_int(name: str, value: object, *, minimum: int, maximum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not minimum <= value <= maximum:
        raise ValueError(f"{name} must be an integer from {minimum} to {maximum}, got {value!r:.80}")


@functools.lru_cache(maxsize=4096)  # a cache holds few problems and many rows of each
def _problem_key_error(key: str) -> str | None:
    from ucudnn.problem import ConvProblem  # a leaf value module (it imports only the errors)

    try:
        problem = ConvProblem.parse(key)
    except InvalidInput as exc:
        return f"problem_key {key!r:.120} is not a problem: {exc}"
    if problem.key != key:
        return f"problem_key {key!r:.120} is not in canonical form ({problem.key!r}); it would never be looked up"
    return None


def check_measurement(r: MeasurementRecord, now: datetime) -> None:
    """ValueError unless `r` could have been written by a fresh measurement at or before `now`.

    The problem key must parse back to a problem and be its canonical text (a key in any other
    form is never looked up); the backend a plain name; a cpu algorithm one the cpu backend has;
    numbers in range; a failed candidate must say why; nothing from the future.
    """
    for name in ("device", "backend", "versions", "problem_key", "algo"):
        _check_text(name, getattr(r, name))
    _check_text("reason", r.reason, empty_ok=True)
    if not _BACKEND_NAME.fullmatch(r.backend):
        raise ValueError(f"backend {r.backend!r} is not a backend name (lower-case letters, digits, _ -)")
    if r.backend == "cpu" and r.algo not in _CPU_ALGORITHMS:
        raise ValueError(f"algo {r.algo!r:.80} is not a cpu algorithm ({', '.join(_CPU_ALGORITHMS)})")
    if _WHITE_SPACE.search(r.algo):
        raise ValueError(f"algo {r.algo!r:.80} holds white space; algorithm names have none")
    problem_error = _problem_key_error(r.problem_key)
    if problem_error:
        raise ValueError(problem_error)
    time = math.inf if r.time_ms is None else r.time_ms
    error = micro_error(r.algo, r.batch, time, r.workspace_bytes, reason=r.reason, spread=r.spread_ms, columns=True)
    if error:  # the rules every stored row keeps; then the bounds a real measurement keeps
        raise ValueError(error)
    _check_int("batch", r.batch, minimum=1, maximum=_MAX_INT32)
    _check_int("workspace_bytes", r.workspace_bytes, minimum=0, maximum=_MAX_INT64)
    if r.time_ms is not None:
        _check_number("time_ms", r.time_ms, maximum=_MAX_TIME_MS)
    _check_number("spread_ms", r.spread_ms, maximum=_MAX_TIME_MS)
    _check_timestamp(r.created_at, now)


def check_plan(p: PlanRecord, now: datetime) -> None:
    """ValueError unless `p` is a plan a fresh run could have stored at or before `now`."""
    _check_text("plan key", p.key)
    _check_timestamp(p.created_at, now)
