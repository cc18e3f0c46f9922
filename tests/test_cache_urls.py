"""A cache URL never leaves the process with its password (issue 51): every message, exception and JSON field
that names a cache masks it, whatever the URL's shape, and a URL that cannot be (a bad port, a scheme typo, spaces)
is one line with exit 2."""

from __future__ import annotations

import itertools
import json
import traceback
from pathlib import Path

import pytest
from ucudnn.cli.main import main
from ucudnn.db import Cache
from ucudnn.db.location import mask_password

from ucudnn.errors import UcudnnError

SECRET = "Sup3rS3cret"
# Passwords that SQLAlchemy's parser and a hand-written one read differently: an unquoted @ or /, a quoted one.
PASSWORDS = (SECRET, f"{SECRET}@x", f"p/{SECRET}", f"{SECRET}%40x")
# Every shape of URL a user may type, good or not; nothing listens on 127.0.0.1:1, so no server is reached.
SHAPES = (
    "postgresql+psycopg://user:{pw}@127.0.0.1:1/db",
    "postgresql://user:{pw}@127.0.0.1:1/db",
    " postgresql+psycopg://user:{pw}@127.0.0.1:1/db",
    "postgresql+psycopg://user:{pw}@127.0.0.1:1/db ",
    "postgresql+psycopg://user:{pw}@127.0.0.1:5432x/db",
    "postgresql+psycopg://user:{pw}@127.0.0.1:99999/db",
    "postgresq+psycopg://user:{pw}@127.0.0.1:1/db",
    "mysql://user:{pw}@127.0.0.1:1/db",
    "user:{pw}@127.0.0.1:1/db",
    "postgresql+psycopg://:{pw}@127.0.0.1:1/db",
    "postgresql+psycopg://user:{pw}@/db?host=127.0.0.1&port=1",
    "postgresql+psycopg:/user:{pw}@127.0.0.1:1/db",
    "postgresql+psycopg://us er:{pw}@127.0.0.1:1/db",
)
CASES = [shape.format(pw=pw) for shape, pw in itertools.product(SHAPES, PASSWORDS)]


def _leaks(text: str) -> bool:
    return SECRET in text or SECRET.lower() in text.lower()


@pytest.mark.parametrize("url", CASES)
def test_the_python_api_never_shows_the_password(url: str) -> None:
    with pytest.raises(UcudnnError) as info:
        Cache(url).close()
    shown = "".join(traceback.format_exception(info.value))  # the message and every exception chained to it
    assert not _leaks(shown), shown


@pytest.mark.parametrize("url", CASES)
@pytest.mark.parametrize("command", [["db", "info", "--json"], ["db", "check"], ["db", "prune", "--all"]])
def test_the_cli_never_shows_the_password(url: str, command: list[str], capsys: pytest.CaptureFixture) -> None:
    code = main([*command, "--db", url])
    out, err = capsys.readouterr()
    assert code == 2, err
    assert err.count("\n") == 1 and err.startswith("ucudnn: error: ") and "Traceback" not in err, err
    assert not _leaks(out + err), err


@pytest.mark.parametrize("url", CASES[:: len(PASSWORDS)])
def test_an_import_source_url_never_shows_the_password(url: str, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    code = main(["db", "import", "--db", str(tmp_path / "c.db"), url])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and not _leaks(err), err


@pytest.mark.parametrize("url", CASES[:: len(PASSWORDS)])
def test_a_cache_named_by_the_environment_never_shows_the_password(
    url: str, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("UCUDNN_DB", url)
    code = main(["bench", "--layer", "n=1,c=1,h=3,w=3,k=1,r=1,s=1", "--backend", "cpu", "--reps", "1", "-q"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and not _leaks(err), err


def test_a_malformed_url_says_what_is_wrong(capsys: pytest.CaptureFixture) -> None:
    for url, words in (
        (f"postgresql+psycopg://u:{SECRET}@h:5432x/db", "port that is no number"),
        (f" postgresql+psycopg://u:{SECRET}@h/db", "white space"),
        (f"postgresql+psycopg://u:{SECRET}@h:70000/db", "port 70000"),
        (f"postgresql+psycopg://u:{SECRET}@x@h/db", "%40"),
        (f"u:{SECRET}@h/db", "no scheme"),
    ):
        assert main(["db", "info", "--db", url]) == 2
        err = capsys.readouterr().err
        assert words in err and "u:***@" in err, err


def test_a_good_url_is_shown_masked_where_it_is_shown(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    db = tmp_path / "c.db"
    Cache(db).close()
    assert main(["db", "info", "--db", f"sqlite:///{db}", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["url"] == f"sqlite:///{db}"
    assert mask_password(f"cannot open postgresql://u:{SECRET}@h/db: no") == "cannot open postgresql://u:***@h/db: no"
    assert mask_password("postgresql://u@h/db and /tmp/a.db") == "postgresql://u@h/db and /tmp/a.db"
