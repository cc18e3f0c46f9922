"""The documentation site (docs/, issue 45) builds with no warning, and its generated pages hold what they
must: the CLI reference every command of `ucudnn`, the API reference the names users call first.

Sphinx, MyST and sphinx-click come with the `docs` extra; without them the test skips, with the reason.
The build runs as CI would run it, `sphinx-build -W --keep-going`, in a subprocess (a few seconds)."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from html import unescape
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parents[1] / "docs"
COMMANDS = ("bench", "cluster", "db", "devices", "networks", "plan", "selftest")


def _missing() -> list[str]:
    # torch too: the API reference documents ucudnn.torch, which autodoc imports.
    return [
        name for name in ("sphinx", "myst_parser", "sphinx_click", "torch") if importlib.util.find_spec(name) is None
    ]


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    missing = _missing()
    if missing:
        pytest.skip(f"{', '.join(missing)} not installed: pip install -e '.[docs,torch]' builds the docs")
    out = tmp_path_factory.mktemp("docs") / "html"
    build = subprocess.run(
        [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b", "html", str(DOCS), str(out)],
        check=False,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert build.returncode == 0, f"sphinx-build failed:\n{build.stdout}\n{build.stderr}"
    return out


def _text(path: Path) -> str:
    """A page's text: tags dropped (highlighted code is split into spans), whitespace runs made one space."""
    return re.sub(r"\s+", " ", unescape(re.sub(r"<[^>]+>", "", path.read_text())))


def test_the_site_builds_without_warnings(site):
    pages = {p.stem for p in site.glob("*.html")}
    assert {"index", "getting-started", "api", "cli", "troubleshooting", "design", "json", "cache"} <= pages


def test_the_cli_page_lists_every_command(site):
    from ucudnn.cli.main import cli

    assert set(COMMANDS) == set(cli.commands)  # a new command is listed here, and so checked on the page
    text = _text(site / "cli.html")
    for command in COMMANDS:
        assert re.search(rf"\bucudnn {command} \[OPTIONS\]", text), f"ucudnn {command} is not on the CLI page"


def test_the_api_page_documents_the_first_names(site):
    text = _text(site / "api.html")
    for name in ("ucudnn.torch.plan_memory", "ucudnn.torch.execute_plan", "ucudnn.Handle", "ucudnn.torch.convert"):
        assert re.search(rf"\b{re.escape(name)}\s*\(", text), f"{name} is not documented on the API page"
