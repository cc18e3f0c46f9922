"""Where a cache lives: `$UCUDNN_DB`, the XDG default, or what the caller names.

Every spelling a user may give (a URL, a bare `postgresql://`, a plain or relative file path,
None) becomes one SQLAlchemy URL here, so the rest of `ucudnn.db` sees only absolute SQLite
paths and psycopg 3 URLs, and refuses any other database before a driver is loaded.
"""

from __future__ import annotations

import os
import re
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


# The password of a URL's user information (`scheme://user:PASSWORD@host`), or of a string shaped like one
# that no parser accepts (a leading space, no scheme, a scheme typo): up to the last `@` of the word, so that a
# password holding an unquoted `@` is masked whole.
_USERINFO = re.compile(r"(?<![^/\s])((?:[A-Za-z][\w+.-]*://)?[^:/@\s]*):(?!//)\S*@")


def mask_password(text: str) -> str:
    """`text` (a URL, or a message naming one) with every password in it replaced by `***`."""
    return _USERINFO.sub(r"\1:***@", text)


def _resolve_url(url: str | os.PathLike[str] | None) -> URL:
    """A SQLAlchemy URL from a URL, a plain file path (a SQLite file) or None (the default).

    Every message about `url` masks its password, whatever its shape; a URL that does not parse (a bad port,
    spaces, a scheme typo) is InvalidInput.
    """
    if url is None:
        url = default_url()
    if isinstance(url, os.PathLike):
        url = os.fspath(url)
    if not isinstance(url, str) or not url.strip():
        raise InvalidInput(f"cache URL must be a non-empty string or path, got {url!r}")
    if "://" not in url:
        if _USERINFO.search(url):
            raise InvalidInput(
                f"cache URL {mask_password(url)!r} holds a user and password but no scheme://; "
                f"use postgresql+psycopg://USER:PASSWORD@HOST/DB, or sqlite:///PATH for a file"
            )
        return URL.create("sqlite", database=os.path.abspath(os.path.expanduser(url)))
    problem, parsed = None, None
    try:
        parsed = make_url(url)
    except (sa_exc.ArgumentError, ValueError) as exc:
        problem = "has a port that is no number" if "int()" in str(exc) else "does not parse"
    if url != url.strip() or " " in url.split("?", 1)[0]:
        problem = "has white space"
    elif parsed is not None and "@" in (parsed.host or ""):
        problem = "has an @ in its password or host; write it as %40"
    elif parsed is not None and parsed.port is not None and not 0 < parsed.port < 65536:
        problem = f"has the port {parsed.port}, not one from 1 to 65535"
    if problem or parsed is None:
        raise InvalidInput(
            f"cache URL {mask_password(url)!r} is not a database URL (it {problem}); "
            f"use sqlite:///PATH, a file path, or postgresql+psycopg://USER@HOST:PORT/DB"
        )
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
