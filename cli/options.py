"""Option parsing that several commands share."""

from __future__ import annotations

import click

from ucudnn.errors import InvalidInput
from ucudnn.sizes import decimal_unit, exact_bytes, format_size, parse_size


def size_option(ctx: click.Context | None, param: click.Parameter | None, value: str | None) -> int | None:
    """A click callback: bytes from `64MiB`, `1GiB`, `100MB` or a number. A size that is not a whole
    number of bytes (`10.35GiB`) is rounded down, with a note on stderr: refusing it helps nobody; one in powers
    of 1000 (`100MB`) gets a note of its bytes in binary units."""
    if value is None:
        return None
    name = f"--{param.name.replace('_', '-')}" if param is not None and param.name else "size"
    try:
        nbytes = parse_size(value, round_down=True)
    except InvalidInput as exc:
        raise click.BadParameter(str(exc), ctx=ctx, param=param) from None
    exact = exact_bytes(value)
    if exact is not None:
        click.echo(
            f"ucudnn: note: {name} {value} is {format(exact.normalize(), 'f')} bytes; rounded down to {nbytes} bytes",
            err=True,
        )
    elif decimal_unit(value):  # 8MB is 7.6 MiB: said, since a limit 5% under the one meant changes the answer
        click.echo(f"ucudnn: note: {name} {value} is {nbytes} bytes ({format_size(nbytes)}; powers of 1000)", err=True)
    return nbytes


def positive_int(ctx: click.Context | None, param: click.Parameter | None, value: int | None) -> int | None:
    """A click callback for a count such as `--batch`, refused as `ucudnn plan --batch` words it."""
    if value is not None and value < 1:
        name = f"--{param.name.replace('_', '-')}" if param is not None and param.name else "value"
        raise InvalidInput(f"{name} must be a positive integer, got {value}")
    return value
