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
BENCHMARKS = checker.ROOT / "BENCHMARKS.md"
CI_RUN = checker.ROOT / ".ci" / "run"


def _setup_block():
    (setup,) = [b for b in BLOCKS if b.tag == "setup"]
    return setup.commands()


def test_the_test_command_lists_skip_reasons_as_ci_runs_it():
    pytest_command = _setup_block()[-1]
    assert pytest_command.startswith("bash .ci/setup && ") and pytest_command.endswith("python -m pytest -ra")
    assert pytest_command in CI_RUN.read_text(encoding="utf-8")  # CI runs the README's command, lint included


def _main_job_runs() -> tuple[str, list[tuple[float, float]]]:
    """The main job's command and its recorded runs, (cold seconds, total speedup), from BENCHMARKS.md's
    table of runs that nothing else slowed."""
    section = BENCHMARKS.read_text(encoding="utf-8").split("## The first hour, again (issue 37)", 1)[1]
    command = next(line.strip("` ") for line in section.splitlines() if line.startswith("`ucudnn bench "))
    lines = section.split("### The main job, run after run", 1)[1].splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("| run | load | cold s |"))
    runs = []
    for row in itertools.takewhile(lambda line: line.startswith("|"), lines[start + 2 :]):
        cells = [c.strip() for c in row.strip("|").split("|")]
        runs.append((float(cells[2]), float(cells[4].rstrip("x"))))
    return command, runs


def test_the_main_job_headline_is_the_range_of_the_recorded_runs():
    command, runs = _main_job_runs()
    assert len(runs) >= 5
    # The README's main job is the command that was measured, with a fresh --db each time.
    main_job = _setup_block()[1]
    assert main_job.removeprefix(".venv/bin/") == command.split(" --db ")[0]
    low, high = min(s for _, s in runs), max(s for _, s in runs)
    stated = re.search(r"the `speedup:` line read (\d+\.\d+)x to (\d+\.\d+)x in total", " ".join(README_TEXT.split()))
    assert stated, "the README states the main job's headline as a range"
    assert (float(stated.group(1)), float(stated.group(2))) == (low, high)
    assert f"In {len(runs)} runs from an empty cache" in " ".join(README_TEXT.split())
    cold = re.search(r"the main job (\d+\.\d+) to (\d+\.\d+) s from an empty cache", " ".join(README_TEXT.split()))
    assert cold and (float(cold.group(1)), float(cold.group(2))) == (min(c for c, _ in runs), max(c for c, _ in runs))


def test_the_readme_says_one_table_is_printed():
    text = " ".join(README_TEXT.split())
    assert "a table per kernel" not in text and "prints one table, a row per kernel" in text
