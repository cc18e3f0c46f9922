"""`ucudnn`: the command-line entry point and its error policy.

Exit codes: 0 done, 1 the work failed, 2 bad usage or input (one line on stderr, no traceback), 130 ended by
Ctrl-C (one line).
"""

from __future__ import annotations

import importlib
import logging
import os
import sys
from typing import NoReturn

import click
from ucudnn.solver.types import Infeasible

from ucudnn.errors import BackendUnavailable, DatabaseError, InvalidInput, UcudnnError, UnsupportedProblem

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as a shell reports a command that Ctrl-C ended
# Errors that mean the user asked for something that cannot be: exit 2 (a backend that cannot run
# the problem at all is one; a limit that nothing fits is not, that is Infeasible: exit 1). Any
# other UcudnnError is work that failed: exit 1. Both print one line and no traceback.
_USAGE_ERRORS = (InvalidInput, BackendUnavailable, DatabaseError, UnsupportedProblem)


# Each command: the module that defines it, loaded only when the command runs (`ucudnn --help` then loads none of
# them, nor NumPy, SciPy or SQLAlchemy), and its docstring's first sentence, which --help lists
# (tests/test_first_hour.py checks each against its command).
COMMANDS = {
    "bench": (
        "ucudnn.cli.bench",
        "Benchmark every algorithm at several micro-batch sizes and pick the fastest division.",
    ),
    "cluster": (
        "ucudnn.cli.cluster_cmd",
        "The batch of each device that minimises the slowest device's step (μ-cuDNN §III-E).",
    ),
    "db": ("ucudnn.cli.db_cmd", "Inspect and maintain the measurement cache."),
    "devices": (
        "ucudnn.cli.devices_cmd",
        "List the device profiles (a user profile is a JSON file with the same fields, given by path).",
    ),
    "networks": ("ucudnn.cli.networks_cmd", "List the network zoo, or with NAME the conv layers of one network."),
    "plan": (
        "ucudnn.cli.plan_cmd",
        "Plan where each feature map lives (kept, offloaded, recomputed) so NETWORK trains within --memory.",
    ),
    "selftest": (
        "ucudnn.cli.selftest_cmd",
        "Run every kind and every algorithm, undivided and micro-batched, against a float64 reference.",
    ),
}


class _LazyGroup(click.Group):
    """A group whose commands are imported when one is asked for by name."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(COMMANDS)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name not in COMMANDS:
            return None
        command = getattr(importlib.import_module(COMMANDS[cmd_name][0]), cmd_name)
        assert isinstance(command, click.Command)
        return command

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        with formatter.section("Commands"):
            formatter.write_dl([(name, summary) for name, (_, summary) in sorted(COMMANDS.items())])


@click.group(cls=_LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="ucudnn")
@click.option("-v", "--verbose", count=True, help="Log what is chosen and why (-vv for more).")
def cli(verbose: int) -> None:
    """ucudnn: fast convolutions inside a memory budget."""
    level = {0: logging.WARNING, 1: logging.INFO}.get(verbose, logging.DEBUG)
    logging.basicConfig(level=level, format="ucudnn: %(message)s", stream=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    """Run the CLI and map errors to exit codes; returns the code (also used by tests)."""
    try:
        # Without standalone mode click returns what ctx.exit(code) was given, or the command's value.
        result = cli.main(args=argv, prog_name="ucudnn", standalone_mode=False)
    except click.exceptions.Exit as exc:
        return exc.exit_code
    except click.exceptions.Abort as exc:
        if isinstance(exc.__cause__, KeyboardInterrupt):  # click turns Ctrl-C into Abort
            click.echo("ucudnn: interrupted", err=True)
            return EXIT_INTERRUPTED
        click.echo("ucudnn: aborted", err=True)
        return EXIT_FAILED
    except click.ClickException as exc:  # bad usage: click's own message, on one line, as every error starts
        click.echo(f"ucudnn: error: {exc.format_message()}", err=True)
        return EXIT_USAGE
    except _USAGE_ERRORS as exc:
        click.echo(f"ucudnn: error: {exc}", err=True)
        return EXIT_USAGE
    except (Infeasible, UcudnnError) as exc:
        click.echo(f"ucudnn: failed: {exc}", err=True)
        return EXIT_FAILED
    except OSError as exc:  # the output cannot be written: a full disk (> /dev/full), a closed pipe
        return _output_failed(exc)
    try:
        sys.stdout.flush()  # here, not at exit, where a full disk would end in a traceback
    except OSError as exc:
        return _output_failed(exc)
    return result if isinstance(result, int) else EXIT_OK


def _output_failed(exc: OSError) -> int:
    where = f" {exc.filename}" if exc.filename else ""
    try:
        click.echo(f"ucudnn: failed: cannot write the output{where}: {exc.strerror or exc}", err=True)
    except OSError:
        pass
    # Point stdout at /dev/null so that Python's own flush at exit finds nothing to fail on.
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):  # stdout is not a real file (captured by a test): nothing to do
        pass
    return EXIT_FAILED


def entry_point() -> None:
    """The `ucudnn` script: Ctrl-C, while a library still imports or a benchmark runs, ends it with one line."""
    try:
        code = main()
    except KeyboardInterrupt:
        _interrupted()
    sys.exit(code)


def _interrupted() -> NoReturn:
    try:
        click.echo("ucudnn: interrupted", err=True)
    finally:
        os._exit(EXIT_INTERRUPTED)  # at once: no exit handlers or thread joins that a second Ctrl-C would interrupt


if __name__ == "__main__":
    entry_point()
