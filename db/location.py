"""Where a cache lives: `$UCUDNN_DB`, the XDG default, or what the caller names.

Every spelling a user may give (a URL, a bare `postgresql://`, a plain or relative file path,
None) becomes one SQLAlchemy URL here, so the rest of `ucudnn.db` sees only absolute SQLite
paths and psycopg 3 URLs, and refuses any other database before a driver is loaded.
"""

from __future__ import annotations

import os
from pathlib import Path

from sqlalchemy import exc as sa_exc
from sqlalchemy.engine import URL, make_url

from ucudnn.errors import DatabaseError, InvalidInput

ENV_VAR = "UCUDNN_DB"


def default_url() -> str:
    """`$UCUDNN_DB` if set, else `sqlite:///$XDG_CACHE_HOME/ucudnn/cache.db` (creating the folder).

    `XDG_CACHE_HOME` defaults to `~/.cache`, as the XDG base directory spec says (a relative
    value is ignored, as the spec also says).
    """
    env = os.environ.get(ENV_VAR, "").strip()
    if env:
        return env
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    base = Path(xdg) if xdg and os.path.isabs(xdg) else Path.home() / ".cache"
    folder = base / "ucudnn"
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise DatabaseError(
            f"cannot create the cache folder {folder}: {exc.strerror or exc}; "
            f"set {ENV_VAR} or pass --db to put the cache elsewhere"
        ) from exc
    return f"sqlite:///{folder / 'cache.db'}"


def _resolve_url(url: str | os.PathLike[str] | None) -> URL:
    """A SQLAlchemy URL from a URL, a plain file path (a SQLite file) or None (the default)."""
    if url is None:
        url = default_url()
    if isinstance(url, os.PathLike):
        url = os.fspath(url)
    if not isinstance(url, str) or not url.strip():
        raise InvalidInput(f"cache URL must be a non-empty string or path, got {url!r}")
    if "://" not in url:
        return URL.create("sqlite", database=os.path.abspath(os.path.expanduser(url)))
    try:
        parsed = make_url(url)
    except sa_exc.ArgumentError as exc:
        raise InvalidInput(
            f"cache URL {url!r} is not a database URL ({exc}); "
            f"use sqlite:///PATH, a file path, or postgresql+psycopg://..."
        ) from exc
    backend = parsed.get_backend_name()
    if backend not in ("sqlite", "postgresql"):
        raise InvalidInput(
            f"cache URL {parsed.render_as_string(hide_password=True)!r} uses "
            f"{backend!r}; ucudnn caches live in SQLite or PostgreSQL"
        )
    if parsed.drivername == "postgresql":  # SQLAlchemy's default is psycopg2; ours is psycopg 3
        parsed = parsed.set(drivername="postgresql+psycopg")
    if backend == "sqlite" and parsed.database and parsed.database != ":memory:" and not parsed.query.get("uri"):
        parsed = parsed.set(database=os.path.abspath(os.path.expanduser(parsed.database)))
    return parsed


def _sqlite_file(url: URL) -> Path | None:
    """The file behind a SQLite URL, or None for an in-memory database or a `uri=true` URL."""
    if url.get_backend_name() != "sqlite" or url.query.get("uri"):
        return None
    if not url.database or url.database == ":memory:":
        return None
    return Path(url.database)
