"""The whole test run keeps away from the user's own files: HOME and XDG_CACHE_HOME point at a temporary
folder and UCUDNN_DB is unset, from before the first test module is imported until the run ends.

So every test that leaves `db` at its default (a `Handle`, `convert`, `ucudnn bench` without `--db`), and
every subprocess a test starts (it inherits the environment), measures into a cache of the run's own,
`$XDG_CACHE_HOME/ucudnn/cache.db` under that folder, never into the user's `~/.cache/ucudnn` (or
`$XDG_CACHE_HOME/ucudnn`, or `$UCUDNN_DB`). Other libraries' caches (matplotlib's, Hugging Face's) go
to the same folder. tests/test_user_cache.py checks that the user's cache file is left byte for byte.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest

_VARIABLES = ("HOME", "XDG_CACHE_HOME", "UCUDNN_DB")


@dataclass(frozen=True)
class RunFolders:
    """The run's stand-ins for the user's folders, and the user's own values they replace."""

    root: Path
    home: Path
    cache: Path  # $XDG_CACHE_HOME: the default measurement cache is cache / "ucudnn" / "cache.db"
    user: dict[str, str | None]  # the user's HOME, XDG_CACHE_HOME and UCUDNN_DB (None: unset)


_folders: RunFolders | None = None


def pytest_configure(config: pytest.Config) -> None:
    # Here rather than in the fixture's body: test modules are imported (collected) before any
    # fixture runs, and nothing they do at import time may reach the user's folders either.
    global _folders
    root = Path(tempfile.mkdtemp(prefix="ucudnn-tests-"))
    home = root / "home"
    cache = home / ".cache"
    cache.mkdir(parents=True)
    _folders = RunFolders(root, home, cache, {name: os.environ.get(name) for name in _VARIABLES})
    os.environ["HOME"] = str(home)
    os.environ["XDG_CACHE_HOME"] = str(cache)
    os.environ.pop("UCUDNN_DB", None)


def pytest_unconfigure(config: pytest.Config) -> None:
    global _folders
    if _folders is None:
        return
    for name, value in _folders.user.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    shutil.rmtree(_folders.root, ignore_errors=True)
    _folders = None


@pytest.fixture(scope="session", autouse=True)
def run_folders() -> RunFolders:
    """Every test runs with HOME and XDG_CACHE_HOME in the run's temporary folder and UCUDNN_DB unset.

    Tests that change these variables do it with `monkeypatch`, which puts the run's values back
    after them; this checks that each still holds when the session starts."""
    assert _folders is not None, "tests/conftest.py's pytest_configure did not run"
    assert os.environ["HOME"] == str(_folders.home) and os.environ["XDG_CACHE_HOME"] == str(_folders.cache)
    assert "UCUDNN_DB" not in os.environ
    return _folders
