"""What a driver error means: a transient lock is retried, anything else is one line saying why.

Busy or locked SQLite and PostgreSQL deadlocks or serialization failures go away if the
transaction runs again, so they are retried with capped, jittered exponential backoff; every
other driver error becomes a `DatabaseError` whose message holds no SQL and no parameters.
"""

from __future__ import annotations

import logging
import random
import sqlite3
import time
from collections.abc import Callable
from typing import TypeVar

from sqlalchemy import exc as sa_exc
from ucudnn.db.location import mask_password

from ucudnn.errors import DatabaseError

log = logging.getLogger("ucudnn.db.cache")  # the cache's one logger, as before db/ was split

# Transient failures (lock not granted, deadlock, serialization failure) are retried this many
# times, sleeping RETRY_BASE_S * 2**attempt (capped, with jitter so retries do not line up).
RETRY_ATTEMPTS = 8
RETRY_BASE_S = 0.02
RETRY_MAX_S = 2.0

T = TypeVar("T")


def _reason(exc: BaseException) -> str:
    """One line saying why: the driver's own message without SQL, parameters or newlines."""
    orig = getattr(exc, "orig", None)
    text = str(orig if orig is not None else exc)
    text = text.split("\n[SQL:", 1)[0]
    return mask_password(" ".join(text.split())) or type(exc).__name__


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


def retry(work: Callable[[], T], *, action: str, where: str) -> T:
    """Run `work`, retrying transient lock errors with capped exponential backoff."""
    for attempt in range(RETRY_ATTEMPTS):
        try:
            return work()
        except (sa_exc.DBAPIError, sqlite3.Error) as exc:
            if _is_transient(exc) and attempt + 1 < RETRY_ATTEMPTS:
                delay = min(RETRY_MAX_S, RETRY_BASE_S * 2**attempt) * (0.5 + random.random())
                log.debug("%s: %s (attempt %d), retrying in %.3f s", where, _reason(exc), attempt + 1, delay)
                time.sleep(delay)
                continue
            raise DatabaseError(f"cannot {action} {where}: {_reason(exc)}") from exc
        except sa_exc.SQLAlchemyError as exc:
            raise DatabaseError(f"cannot {action} {where}: {_reason(exc)}") from exc
    raise AssertionError("unreachable: the last attempt returns or raises")
