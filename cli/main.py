"""`ucudnn`: the command-line entry point and its error policy.

Exit codes: 0 done, 1 the work failed, 2 bad usage or input (one line on stderr, no traceback).
"""

from __future__ import annotations

import logging
import os
import sys

import click
from ucudnn.solver.types import Infeasible

from ucudnn.errors import BackendUnavailable, DatabaseError, InvalidInput, UcudnnError, UnsupportedProblem

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2
# Errors that mean the user asked for something that cannot be: exit 2 (a backend that cannot run
# the problem at all is one; a limit that nothing fits is not, that is Infeasible: exit 1). Any
# other UcudnnError is work that failed: exit 1. Both print one line and no traceback.
_USAGE_ERRORS = (InvalidInput, BackendUnavailable, DatabaseError, UnsupportedProblem)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="ucudnn")
@click.option("-v", "--verbose", count=True, help="Log what is chosen and why (-vv for more).")
def cli(verbose: int) -> None:
    """ucudnn: fast convolutions inside a memory budget."""
    level = {0: logging.WARNING, 1: logging.INFO}.get(verbose, logging.DEBUG)
    logging.basicConfig(level=level, format="ucudnn: %(message)s", stream=sys.stderr)


def _register_commands() -> None:
    from ucudnn.cli.bench import bench
    from ucudnn.cli.cluster_cmd import cluster
    from ucudnn.cli.db_cmd import db
    from ucudnn.cli.devices_cmd import devices
    from ucudnn.cli.networks_cmd import networks
    from ucudnn.cli.plan_cmd import plan
    from ucudnn.cli.selftest_cmd import selftest

    for command in (bench, cluster, db, devices, networks, plan, selftest):
        cli.add_command(command)


_register_commands()


def main(argv: list[str] | None = None) -> int:
    """Run the CLI and map errors to exit codes; returns the code (also used by tests)."""
    try:
        # Without standalone mode click returns what ctx.exit(code) was given, or the command's value.
        result = cli.main(args=argv, prog_name="ucudnn", standalone_mode=False)
    except click.exceptions.Exit as exc:
        return exc.exit_code
    except click.exceptions.Abort:
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
    sys.exit(main())


if __name__ == "__main__":
    entry_point()
