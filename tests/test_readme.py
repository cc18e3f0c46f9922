"""README.md and the guide pages (docs/guide-*.md) as a newcomer pastes them: every `ucudnn` command parses,
every Python block compiles, and (slow) every block runs, through benchmarks/readme_check.py, the script that
times them on a fresh clone."""

from __future__ import annotations

import importlib.util
import itertools
import re
import shlex
import sys
from pathlib import Path

import click
import pytest
from ucudnn.cli.main import cli

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "readme_check.py"


def _load_checker():
    spec = importlib.util.spec_from_file_location("readme_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


checker = _load_checker()
BLOCKS = checker.blocks()
# The guide: what moved out of the README (issue 45), checked as the README is.
GUIDES = sorted((checker.ROOT / "docs").glob("guide-*.md"))
GUIDE_BLOCKS = [b for path in GUIDES for b in checker.blocks(path)]


def ucudnn_commands() -> list[tuple[str, list[str]]]:
    """(file:line of the block, argv) of every `ucudnn ...` in every bash block of the README and the guide,
    `&&` chains included."""
    found = []
    for block in BLOCKS + GUIDE_BLOCKS:
        if block.language != "bash":
            continue
        for command in block.commands():
            for part in command.split("&&"):
                words = shlex.split(part, comments=True)
                if words and Path(words[0]).name == "ucudnn":
                    found.append((f"{block.source}:{block.line}", words[1:]))
    return found


def parse_only(argv: list[str]) -> None:
    """Parse argv as the `ucudnn` command would, down to the leaf command, without running it."""
    ctx = cli.make_context("ucudnn", list(argv))
    command: click.Command = cli
    while isinstance(command, click.Group):
        rest = [*getattr(ctx, "_protected_args", ()), *ctx.args]
        name, command, rest = command.resolve_command(ctx, rest)
        ctx = command.make_context(name, rest, parent=ctx)


def test_the_readme_has_blocks_of_every_kind_and_known_tags():
    assert {b.language for b in BLOCKS} == {"bash", "python"}
    assert {b.tag for b in BLOCKS} <= {"", *checker.TAGS}
    # The set-up block is the fresh-machine one; the benchmarks are long, the rest quick.
    (setup,) = [b for b in BLOCKS if b.tag == "setup"]
    assert setup.commands()[0].startswith("python3 -m venv .venv")
    assert all("ucudnn bench" in c for b in BLOCKS + GUIDE_BLOCKS if b.tag == "slow" for c in b.commands())


def test_the_guide_pages_have_blocks_and_known_tags_and_are_linked():
    """Each guide page holds runnable blocks with known tags (no set-up: that is the README's), and is reached
    from the README and from the site's table of contents."""
    assert len(GUIDES) >= 4, "the README's details live in docs/guide-*.md"
    assert {b.language for b in GUIDE_BLOCKS} == {"bash", "python"}
    assert {b.tag for b in GUIDE_BLOCKS} <= set(checker.TAGS) - {"setup"} | {""}
    toctree = (checker.ROOT / "docs" / "index.md").read_text(encoding="utf-8")
    for path in GUIDES:
        assert [b for b in GUIDE_BLOCKS if b.source == f"docs/{path.name}"], path.name
        assert f"](docs/{path.name})" in README_TEXT, f"README.md does not link {path.name}"
        assert f"\n{path.stem}\n" in toctree, f"docs/index.md's toctree lacks {path.stem}"


@pytest.mark.parametrize("line, argv", ucudnn_commands(), ids=lambda v: v if isinstance(v, str) else " ".join(v)[:60])
def test_every_ucudnn_command_in_the_readme_parses(line, argv, capsys):
    parse_only(argv)  # a misspelt option, `[--json]` or a bad size raises here


def test_a_command_that_would_not_parse_is_caught():
    with pytest.raises(click.UsageError):
        parse_only(["db", "info", "[--json]"])
    with pytest.raises(click.BadParameter):
        parse_only(["plan", "--network", "vgg16", "--memory", "12g"])


@pytest.mark.parametrize(
    "block", [b for b in BLOCKS + GUIDE_BLOCKS if b.language == "python"], ids=lambda b: f"{b.source}:{b.line}"
)
def test_every_python_block_compiles(block):
    compile(block.text, f"{block.source}:{block.line}", "exec")


@pytest.mark.slow
def test_every_readme_block_runs():
    """Each block that can run here (not the set-up, GPU or missing-torchvision ones) exits 0."""
    results, left_out = checker.check(only="all")
    failed = [(r.what, r.code, r.tail) for r in results if r.code]
    assert not failed, failed
    assert results and all(why for _, why in left_out)


@pytest.mark.slow
def test_every_guide_block_runs():
    """The same for the guide pages, in one scratch folder, in order."""
    results, left_out = checker.check(only="all", files=GUIDES)
    failed = [(r.what, r.source, r.line, r.code, r.tail) for r in results if r.code]
    assert not failed, failed
    assert results and all(why for _, why in left_out)


# ---- what the first section promises (issue 37) ----

README_TEXT = checker.README.read_text(encoding="utf-8")
BENCHMARKS = checker.ROOT / "benchmarks" / "BENCHMARKS.md"  # the notebook, out of the front room (issue 54)
CI_RUN = checker.ROOT / ".ci" / "run"


def _setup_block():
    (setup,) = [b for b in BLOCKS if b.tag == "setup"]
    return setup.commands()


def test_the_test_command_lists_skip_reasons_as_ci_runs_it():
    pytest_command = _setup_block()[-1]
    assert pytest_command.startswith("bash .ci/setup && ") and pytest_command.endswith("python -m pytest -ra")
    assert pytest_command in CI_RUN.read_text(encoding="utf-8")  # CI runs the README's command, lint included


def _main_job_runs() -> tuple[str, list[tuple[float, float]]]:
    """The main job's command and its recorded cold runs on this project's machine, (cold seconds, total
    speedup), from the notebook's section that the README's range comes from."""
    section = BENCHMARKS.read_text(encoding="utf-8").split("## The main job where it runs (issue 54", 1)[1]
    section = section.split("\n## ", 1)[0]
    command = next(line.strip("` ") for line in section.splitlines() if line.startswith("`ucudnn bench "))
    lines = section.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("| run |"))
    header = [c.strip() for c in lines[start].strip("|").split("|")]
    runs = []
    for row in itertools.takewhile(lambda line: line.startswith("|"), lines[start + 2 :]):
        cells = dict(zip(header, (c.strip() for c in row.strip("|").split("|"))))
        runs.append((float(cells["cold s"]), float(cells["total"].rstrip("x?"))))
    return command, runs


def test_the_main_job_headline_is_the_range_of_the_recorded_runs():
    command, runs = _main_job_runs()
    assert len(runs) >= 5
    # The README's main job is the command that was measured, with a fresh --db each time.
    main_job = _setup_block()[1]
    assert main_job.removeprefix(".venv/bin/") == command.split(" --db ")[0]
    low, high = min(s for _, s in runs), max(s for _, s in runs)
    assert checker.stated_range() == (low, high), "the README states the recorded runs' range"
    text = " ".join(README_TEXT.split())
    assert f"In {len(runs)} cold runs" in text
    cold = re.search(r"the main job took (\d+) to (\d+) s from an empty cache", text)
    assert cold and (int(cold.group(1)), int(cold.group(2))) == (
        round(min(c for c, _ in runs)),
        round(max(c for c, _ in runs)),
    )


def _job_result(tail: str, code: int = 0):
    (setup,) = [b for b in BLOCKS if b.tag == "setup"]
    return checker.Result(_setup_block()[1], setup.line, 5.0, code, tail)


def test_the_fresh_clone_check_fails_a_printed_headline_outside_the_stated_range():
    low, high = checker.stated_range()
    printed = "total ...\nspeedup: {:.2f}x in total, 40.0 ms against the baselines' 90.0 ms (sums over the 3 kernels)\n"
    (inside,) = checker.check_headline([_job_result(printed.format((low + high) / 2))])
    assert inside.code == 0 and "inside" in inside.what
    for value in (low - 0.01, high + 0.01):
        (outside,) = checker.check_headline([_job_result(printed.format(value))])
        assert outside.code == 1 and "OUTSIDE" in outside.what, outside
    (silent,) = checker.check_headline([_job_result("no table")])
    assert silent.code == 1 and "no `speedup:` line" in silent.what
    assert checker.check_headline([_job_result("", code=1)]) == []  # a job that failed is failed already
    assert checker.check_headline([]) == []  # without --fresh-clone the set-up block does not run


_LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


def test_every_relative_link_of_the_readme_and_the_docs_finds_its_file():
    pages = [checker.README, *sorted((checker.ROOT / "docs").glob("*.md")), checker.ROOT / "benchmarks" / "README.md"]
    broken = [
        (page.name, target)
        for page in pages
        for target in _LINK.findall(page.read_text(encoding="utf-8"))
        if "://" not in target
        and not target.startswith("mailto:")
        # a page of the site links another by its source (.md) or by what Sphinx makes of one (.rst, .html)
        and not any((page.parent / target).with_suffix(s).exists() for s in ("", ".md", ".rst", ".py"))
        and not (page.parent / target).exists()
        and "auto_examples" not in target  # made by the build
    ]
    assert broken == []


def test_the_notebook_is_out_of_the_front_room_and_linked():
    assert not (checker.ROOT / "BENCHMARKS.md").exists() and BENCHMARKS.is_file()
    assert "](benchmarks/BENCHMARKS.md)" in README_TEXT
    assert "{download}`" in (checker.ROOT / "docs" / "results.md").read_text(encoding="utf-8")
    # what a user reads at the root is a few hundred lines at most
    assert [p.name for p in checker.ROOT.glob("*.md") if len(p.read_text(encoding="utf-8").splitlines()) > 300] == []


def test_the_readme_says_one_table_is_printed():
    text = " ".join(README_TEXT.split())
    assert "a table per kernel" not in text and "prints one table, a row per kernel" in text
