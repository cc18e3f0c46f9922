"""The documentation site (docs/, issue 45) builds with no warning, and its generated pages hold what they
must: the CLI reference every command of `ucudnn`, the API reference the names users call first, each worked
example (docs/examples/) its figure and printed output. A broken internal link fails the build. Opened in a
real headless browser (Debian's chromium), the landing page and an example page show what they should.

Sphinx, MyST, sphinx-click and sphinx-gallery come with the `docs` extra; without them the tests skip, with the
reason. The build runs as CI would run it, `sphinx-build -W --keep-going`, in a subprocess, with no time limit (a
busy machine makes it slow, not wrong): a few seconds, and on a clean checkout the examples' run too (about
a minute on an idle 2-core VM; sphinx-gallery keeps their output in docs/auto_examples/ and runs an example
again only when its script changed). Without chromium the
browser test skips, unless `UCUDNN_REQUIRE_BROWSER=1` (CI's .ci/run), which makes that a failure."""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
from html import unescape
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parents[1] / "docs"
COMMANDS = ("bench", "cluster", "db", "devices", "networks", "plan", "selftest")
EXAMPLES = sorted(p.stem for p in (DOCS / "examples").glob("plot_*.py"))
REQUIRE_BROWSER_ENV = "UCUDNN_REQUIRE_BROWSER"
SHOT_W, SHOT_H = 1200, 1600


def _missing() -> list[str]:
    # torch too: the API reference documents ucudnn.torch, which autodoc imports; matplotlib draws the examples.
    names = ("sphinx", "myst_parser", "sphinx_click", "sphinx_gallery", "torch", "matplotlib")
    return [name for name in names if importlib.util.find_spec(name) is None]


def _skip_unless_installed() -> None:
    missing = _missing()
    if missing:
        pytest.skip(f"{', '.join(missing)} not installed: pip install -e '.[docs,torch]' builds the docs")


def _sphinx(src: Path, out: Path) -> subprocess.CompletedProcess:
    # No timeout: the build's time is the machine's load (a minute idle, over ten beside other suites), and a
    # verdict must not be; a build that hangs is the CI job's own time limit to catch.
    return subprocess.run(
        [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b", "html", str(src), str(out)],
        check=False,
        capture_output=True,
        text=True,
    )


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    _skip_unless_installed()
    out = tmp_path_factory.mktemp("docs") / "html"
    build = _sphinx(DOCS, out)
    assert build.returncode == 0, f"sphinx-build failed:\n{build.stdout}\n{build.stderr}"
    return out


def _text(path: Path) -> str:
    """A page's text: tags dropped (highlighted code is split into spans), whitespace runs made one space."""
    return re.sub(r"\s+", " ", unescape(re.sub(r"<[^>]+>", "", path.read_text())))


def test_the_site_builds_without_warnings(site):
    pages = {p.stem for p in site.glob("*.html")}
    assert {"index", "getting-started", "api", "cli", "troubleshooting", "design", "json", "cache"} <= pages


def test_the_cli_page_lists_every_command(site):
    import click
    from ucudnn.cli.main import cli

    # a new command is listed here, and so checked on the page
    assert set(COMMANDS) == set(cli.list_commands(click.Context(cli)))
    text = _text(site / "cli.html")
    for command in COMMANDS:
        assert re.search(rf"\bucudnn {command} \[OPTIONS\]", text), f"ucudnn {command} is not on the CLI page"


def test_the_api_page_documents_the_first_names(site):
    text = _text(site / "api.html")
    for name in ("ucudnn.torch.plan_memory", "ucudnn.torch.execute_plan", "ucudnn.Handle", "ucudnn.torch.convert"):
        assert re.search(rf"\b{re.escape(name)}\s*\(", text), f"{name} is not documented on the API page"


def test_every_public_name_has_an_entry(site):
    """Every name `ucudnn` and `ucudnn.torch` export, and every public member of `ucudnn.Handle`, is an entry
    (an anchor) of the API page."""
    import inspect

    import ucudnn
    import ucudnn.torch

    ids = set(re.findall(r'id="([^"]+)"', (site / "api.html").read_text()))
    names = [f"ucudnn.{n}" for n in ucudnn.__all__]
    names += [f"ucudnn.torch.{n}" for n in ucudnn.torch.__all__ if n != "zoo"]  # (a module of models: its page)
    names += [f"ucudnn.Handle.{n}" for n, _ in inspect.getmembers(ucudnn.Handle) if not n.startswith("_")]
    assert [n for n in names if n not in ids] == []


def _images(page: Path, html: str) -> list[Path]:
    """The files of a page's <img> tags, resolved in the build (missing ones included, to be reported)."""
    return [(page.parent / unescape(src)).resolve() for src in re.findall(r'<img\b[^>]*\bsrc="([^"]+)"', html)]


def _output(html: str) -> str:
    """The text an example printed: sphinx-gallery's output blocks."""
    blocks = re.findall(
        r'<div class="sphx-glr-script-out[^"]*">\s*<div class="highlight">\s*<pre>(.*?)</pre>', html, flags=re.DOTALL
    )
    return re.sub(r"\s+", " ", unescape(re.sub(r"<[^>]+>", "", " ".join(blocks))))


def test_every_example_has_a_page_with_its_figure_and_output(site):
    assert EXAMPLES, "no docs/examples/plot_*.py"
    index = (site / "auto_examples" / "index.html").read_text()
    for name in EXAMPLES:
        page = site / "auto_examples" / f"{name}.html"
        assert page.exists(), f"{name}: no page"
        assert f"{name}.html" in index, f"{name} is not in the gallery's index"
        html = page.read_text()
        figures = [p for p in _images(page, html) if p.name.startswith(f"sphx_glr_{name}_")]
        assert figures, f"{name}: no figure on its page"
        assert all(p.is_file() and p.stat().st_size > 0 for p in figures), f"{name}: a figure is not in the build"
        assert _output(html).strip(), f"{name}: no printed output on its page"


def test_the_wr_example_prints_its_table(site):
    text = _output((site / "auto_examples" / "plot_1_wr_table.html").read_text())
    assert re.search(r"layer\s+kind\s+baseline\s+base ms\s+configuration\s+ms\s+workspace\s+speedup", text)
    baseline = r"(\S+ [\d.]+|\(none fits\) -)"  # an algorithm and its ms, or none
    configuration = r"\d+x\d+:\S+( \+ \d+x\d+:\S+)*"  # micro-batches x size : algorithm, one after another
    for kind in ("fwd", "bwd_data", "bwd_filter"):  # a row per kernel: baseline, configuration, ms, workspace, speedup
        row = rf"alexnet conv2 {kind} {baseline} {configuration} [\d.]+ [\d.]+ MiB +([\d.]+|nan)x"
        assert re.search(row, text), f"no row for alexnet conv2 {kind}:\n{text}"


# ---- a broken internal link fails the build -------------------------------------------------------------------
# A tiny site with the real docs/conf.py (and the gallery's header, no example), built once with a good link and
# once with each broken one: the build passes, then fails on the link alone, naming it.
BROKEN = {  # what is broken: (the link, the target its warning names)
    "a missing page": ("[a page](missing.md)", "missing.md"),
    "a missing heading": ("[a heading](other.md#no-such-heading)", "no-such-heading"),
    "a missing page in a role": ("{doc}`missing`", "missing"),
}


def _tiny_site(root: Path, link: str) -> Path:
    src = root / "src"
    (src / "examples").mkdir(parents=True)
    shutil.copy(DOCS / "conf.py", src / "conf.py")
    shutil.copy(DOCS / "examples" / "GALLERY_HEADER.rst", src / "examples")
    (src / "other.md").write_text("# Other\n\n## A heading\n")
    (src / "index.md").write_text(f"# Tiny\n\nSee {link}.\n\n```{{toctree}}\nother\nauto_examples/index\n```\n")
    return src


@pytest.fixture(scope="module")
def tiny_ok(tmp_path_factory):
    _skip_unless_installed()
    root = tmp_path_factory.mktemp("tiny")
    build = _sphinx(_tiny_site(root, "[a heading](other.md#a-heading)"), root / "html")
    assert build.returncode == 0, f"the tiny site with a good link failed:\n{build.stdout}\n{build.stderr}"


@pytest.mark.parametrize("what", sorted(BROKEN))
def test_a_broken_link_fails_the_build(tiny_ok, tmp_path, what):
    link, target = BROKEN[what]
    build = _sphinx(_tiny_site(tmp_path, link), tmp_path / "html")
    assert build.returncode != 0, f"{what}: the build passed"
    assert re.search(rf"index\.md:\d+: WARNING: .*'{re.escape(target)}'", build.stderr), build.stderr


# ---- the site in a real browser -------------------------------------------------------------------------------
def _chromium() -> str:
    path = shutil.which("chromium")
    if path is None:
        reason = "chromium is not installed (as root, bash .ci/setup installs Debian's)"
        if os.environ.get(REQUIRE_BROWSER_ENV) == "1":
            pytest.fail(f"{REQUIRE_BROWSER_ENV}=1 but {reason}")
        pytest.skip(reason)
    return path


def _browse(chromium: str, page: Path, tmp_path: Path) -> tuple[str, Path]:
    """The DOM of `page` after a headless chromium loaded it, and a screenshot of its first screen."""
    shot = tmp_path / f"{page.stem}.png"
    run = subprocess.run(
        [
            chromium,
            "--headless",
            "--no-sandbox",  # as root (CI) chromium refuses to start sandboxed
            "--disable-gpu",
            "--disable-quic",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            f"--user-data-dir={tmp_path / f'profile-{page.stem}'}",
            f"--screenshot={shot}",
            f"--window-size={SHOT_W},{SHOT_H}",
            "--dump-dom",
            page.as_uri(),
        ],
        check=False,
        capture_output=True,
        text=True,
        timeout=1800,  # only a hang: a page opens in seconds, and in a minute on the busiest machine seen
    )
    assert run.returncode == 0, f"chromium failed on {page}:\n{run.stderr[-3000:]}"
    return run.stdout, shot


def _check_screenshot(shot: Path) -> None:
    import matplotlib.image

    assert shot.is_file() and shot.stat().st_size > 0, f"no screenshot at {shot}"
    pixels = matplotlib.image.imread(shot)  # PNG: floats in [0, 1], (height, width, channels)
    assert pixels.shape[:2] == (SHOT_H, SHOT_W), f"{shot.name}: {pixels.shape[1]}x{pixels.shape[0]} pixels"
    flat = pixels.reshape(-1, pixels.shape[2])
    assert (flat != flat[0]).any(), f"{shot.name} is one uniform colour: nothing rendered"


def test_the_site_opens_in_a_browser(site, tmp_path):
    chromium = _chromium()
    landing = site / "index.html"
    dom, shot = _browse(chromium, landing, tmp_path)
    _check_screenshot(shot)
    assert re.search(r"<title>ucudnn\b", dom) and re.search(r"<h1>ucudnn\b", dom), "the landing page's title"
    source = (DOCS / "index.md").read_text()
    toctree = re.search(r"```\{toctree\}\n(.*?)```", source, flags=re.DOTALL)
    assert toctree is not None
    entries = [line.strip() for line in toctree.group(1).splitlines() if line.strip() and not line.startswith(":")]
    wrapper = re.search(r'<div class="toctree-wrapper compound">(.*?)</div>', dom, flags=re.DOTALL)
    assert wrapper is not None, "no toctree on the landing page"
    for entry in entries:
        assert f'href="{entry}.html"' in wrapper.group(1), f"the toctree entry {entry} is not on the landing page"

    example = site / "auto_examples" / "plot_1_wr_table.html"
    dom, shot = _browse(chromium, example, tmp_path)
    _check_screenshot(shot)
    figures = [p for p in _images(example, dom) if p.name.startswith("sphx_glr_plot_1_wr_table_")]
    assert figures and all(p.is_file() and p.stat().st_size > 0 for p in figures), f"figures: {figures}"
    assert re.search(r"configuration\s+ms\s+workspace\s+speedup", _output(dom)), "the printed table"
