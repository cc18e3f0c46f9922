"""Byte sizes as people write them: `64MiB`, `1GiB`, `512KB`, `1000000`."""

from __future__ import annotations

import re

from ucudnn.errors import InvalidInput

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "k": 2**10, "m": 2**20, "g": 2**30}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str | int) -> int:
    """Bytes from `64MiB`, `1.5GiB`, `100MB` or plain `1048576`; refuses negatives and junk."""
    if isinstance(text, int) and not isinstance(text, bool):
        if text < 0:
            raise InvalidInput(f"size must be non-negative, got {text}")
        return text
    match = _SIZE.match(str(text))
    if not match or match.group(2).lower() not in _UNITS:
        raise InvalidInput(f"cannot read size {text!r}; write e.g. 64MiB, 1GiB or a number of bytes")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def format_size(nbytes: int | None) -> str:
    """Short binary-unit text: 8.0 MiB, 512 B."""
    if nbytes is None:
        return "-"
    value = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{int(value)} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")
