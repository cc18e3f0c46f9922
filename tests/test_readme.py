"""README.md as a newcomer pastes it: every `ucudnn` command parses, every Python block compiles, and
(slow) every block runs, through benchmarks/readme_check.py, the script that times them on a fresh clone."""

from __future__ import annotations

import importlib.util
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


def ucudnn_commands() -> list[tuple[int, list[str]]]:
    """(README line of the block, argv) of every `ucudnn ...` in every bash block, `&&` chains included."""
    found = []
    for block in BLOCKS:
        if block.language != "bash":
            continue
        for command in block.commands():
            for part in command.split("&&"):
                words = shlex.split(part, comments=True)
                if words and Path(words[0]).name == "ucudnn":
                    found.append((block.line, words[1:]))
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
    assert all("ucudnn bench" in c for b in BLOCKS if b.tag == "slow" for c in b.commands())


@pytest.mark.parametrize("line, argv", ucudnn_commands(), ids=lambda v: v if isinstance(v, int) else " ".join(v)[:60])
def test_every_ucudnn_command_in_the_readme_parses(line, argv, capsys):
    parse_only(argv)  # a misspelt option, `[--json]` or a bad size raises here


def test_a_command_that_would_not_parse_is_caught():
    with pytest.raises(click.UsageError):
        parse_only(["db", "info", "[--json]"])
    with pytest.raises(click.BadParameter):
        parse_only(["plan", "--network", "vgg16", "--memory", "12g"])


@pytest.mark.parametrize("block", [b for b in BLOCKS if b.language == "python"], ids=lambda b: f"line{b.line}")
def test_every_python_block_compiles(block):
    compile(block.text, f"README.md:{block.line}", "exec")


@pytest.mark.slow
def test_every_readme_block_runs():
    """Each block that can run here (not the set-up, GPU or missing-torchvision ones) exits 0."""
    results, left_out = checker.check(only="all")
    failed = [(r.what, r.code, r.tail) for r in results if r.code]
    assert not failed, failed
    assert results and all(why for _, why in left_out)
