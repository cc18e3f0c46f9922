"""A throwaway PostgreSQL server for the DB tests and `benchmarks/cache/bench_db.py`.

`PgServer.start()` finds `initdb` and `pg_ctl` (on PATH, then `/usr/lib/postgresql/*/bin`,
newest first), initialises a cluster in a fresh temporary folder, and starts it on a free
loopback port with its unix socket in that folder. PostgreSQL refuses to run as root, so when
this process is root the server runs as the `postgres` user (the Debian package creates it),
with the folder handed to that user. `stop()` stops the server and removes the folder.

Pytest use: import the fixtures into a test module,

    from pg_server import db_url, pg_server  # noqa: F401

`db_url` is parametrized over SQLite and PostgreSQL (marked `postgres`) and gives each test a
fresh, empty database (on PostgreSQL, a fresh schema in one shared test database). The server
is started once per session (kept in the pytest config, so several modules share it) and
stopped at the end. Without server binaries or psycopg the PostgreSQL cases skip and say why,
unless `UCUDNN_REQUIRE_POSTGRES=1`, which makes that an error (for CI, so that the cases cannot
silently vanish).
"""

from __future__ import annotations

import glob
import itertools
import os
import pwd
import re
import shutil
import socket
import subprocess
import tempfile
from pathlib import Path

import pytest

REQUIRE_ENV = "UCUDNN_REQUIRE_POSTGRES"
SERVER_USER = "postgres"  # who runs the server when we are root
START_TIMEOUT_S = 60
# Durability is irrelevant for a throwaway test cluster; these make it several times faster.
_FAST_SETTINGS = ("fsync=off", "synchronous_commit=off", "full_page_writes=off")


class PgUnavailable(RuntimeError):
    """No PostgreSQL server can be started here; the message says what is missing."""


def find_pg_bin() -> Path | None:
    """The folder holding `initdb` and `pg_ctl`, or None."""
    initdb = shutil.which("initdb")
    if initdb:
        folder = Path(os.path.realpath(initdb)).parent
        if (folder / "pg_ctl").exists():
            return folder

    def version(path: str) -> tuple[int, ...]:
        match = re.search(r"/postgresql/([\d.]+)/", path)
        return tuple(int(x) for x in match.group(1).split(".")) if match else ()

    for path in sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), key=version, reverse=True):
        folder = Path(path).parent
        if (folder / "pg_ctl").exists():
            return folder
    return None


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class PgServer:
    """One PostgreSQL cluster in a temporary folder, reachable on 127.0.0.1:`port`."""

    def __init__(self) -> None:
        self.bin: Path | None = None
        self.folder: Path | None = None
        self.port = 0
        self._names = itertools.count(1)
        self._user: pwd.struct_passwd | None = None
        self._shared_db: str | None = None

    def _run(self, *args: str) -> subprocess.CompletedProcess:
        kwargs = {}
        if self._user is not None:
            kwargs = {"user": self._user.pw_uid, "group": self._user.pw_gid, "extra_groups": []}
        env = {**os.environ, "LC_ALL": "C", "HOME": str(self.folder)}
        result = subprocess.run(
            args,
            cwd=self.folder,
            env=env,
            capture_output=True,
            text=True,
            timeout=START_TIMEOUT_S,
            check=False,
            **kwargs,
        )
        if result.returncode != 0:
            log = ""
            if self.folder is not None and (self.folder / "server.log").exists():
                log = (self.folder / "server.log").read_text(errors="replace")[-2000:]
            raise RuntimeError(
                f"{' '.join(args)} failed ({result.returncode}): "
                f"{result.stderr.strip() or result.stdout.strip()}\n{log}"
            )
        return result

    def start(self) -> PgServer:
        try:
            import psycopg  # noqa: F401
        except ImportError as exc:
            raise PgUnavailable("psycopg is not installed (pip install 'psycopg[binary]')") from exc
        self.bin = find_pg_bin()
        if self.bin is None:
            raise PgUnavailable(
                "PostgreSQL server binaries (initdb, pg_ctl) are not on PATH or in "
                "/usr/lib/postgresql/*/bin (apt-get install postgresql)"
            )
        if os.geteuid() == 0:
            try:
                self._user = pwd.getpwnam(SERVER_USER)
            except KeyError as exc:
                raise PgUnavailable(
                    f"running as root, and there is no {SERVER_USER!r} user to run "
                    f"the server as (PostgreSQL refuses root)"
                ) from exc
        self.folder = Path(tempfile.mkdtemp(prefix="ucudnn-pg-"))
        if self._user is not None:
            os.chown(self.folder, self._user.pw_uid, self._user.pw_gid)
        try:
            data = self.folder / "data"
            self._run(
                str(self.bin / "initdb"),
                "-D",
                str(data),
                "-U",
                "postgres",
                "--auth=trust",
                "-E",
                "UTF8",
                "--no-locale",
                "--no-sync",
            )
            self.port = _free_port()
            options = [
                f"-p {self.port}",
                f"-k {self.folder}",
                "-c listen_addresses=127.0.0.1",
                *(f"-c {s}" for s in _FAST_SETTINGS),
            ]
            self._run(
                str(self.bin / "pg_ctl"),
                "-D",
                str(data),
                "-l",
                str(self.folder / "server.log"),
                "-w",
                "-t",
                str(START_TIMEOUT_S),
                "-o",
                " ".join(options),
                "start",
            )
        except BaseException:
            self.stop()
            raise
        return self

    def create_database(self, name: str | None = None) -> str:
        """Create an empty database; returns its SQLAlchemy URL."""
        import psycopg

        name = name or f"ucudnn_{next(self._names)}"
        with psycopg.connect(
            host="127.0.0.1", port=self.port, user="postgres", dbname="postgres", autocommit=True
        ) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/{name}"

    def create_schema(self, name: str | None = None) -> str:
        """Create an empty schema in one shared database; returns a URL whose search_path is it.

        Much cheaper than a database per test (CREATE DATABASE copies a template), and just as
        empty: every table the cache makes lands in that schema.
        """
        import psycopg

        if self._shared_db is None:
            self._shared_db = self.create_database("ucudnn_tests")
        name = name or f"t{next(self._names)}"
        with psycopg.connect(
            host="127.0.0.1", port=self.port, user="postgres", dbname="ucudnn_tests", autocommit=True
        ) as conn:
            conn.execute(f'CREATE SCHEMA "{name}"')
        return f"{self._shared_db}?options=-csearch_path%3D{name}"

    def stop(self) -> None:
        if self.folder is None:
            return
        data = self.folder / "data"
        if self.bin is not None and (data / "postmaster.pid").exists():
            try:
                self._run(str(self.bin / "pg_ctl"), "-D", str(data), "-m", "immediate", "-w", "stop")
            except RuntimeError:
                pass  # already gone; the folder is removed below either way
        shutil.rmtree(self.folder, ignore_errors=True)
        self.folder = None


_SERVER_KEY = pytest.StashKey[object]()


@pytest.fixture(scope="session")
def pg_server(request: pytest.FixtureRequest) -> PgServer:
    """The session's PostgreSQL server (started on first use), or a skip saying why not."""
    stash = request.config.stash
    if _SERVER_KEY not in stash:
        try:
            server: object = PgServer().start()
            request.config.add_cleanup(server.stop)
        except Exception as exc:  # noqa: BLE001 - remembered, so that later tests do not retry a slow failure
            server = exc
        stash[_SERVER_KEY] = server
    server = stash[_SERVER_KEY]
    if isinstance(server, PgUnavailable):
        if os.environ.get(REQUIRE_ENV) == "1":
            pytest.fail(f"{REQUIRE_ENV}=1 but no PostgreSQL server can be started: {server}")
        pytest.skip(f"no PostgreSQL server can be started: {server}")
    if isinstance(server, Exception):
        pytest.fail(f"the PostgreSQL test server did not start: {server}")
    return server


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A URL of a fresh, empty database: a SQLite file, or a new PostgreSQL schema."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'cache.db'}"
    return request.getfixturevalue("pg_server").create_schema()
