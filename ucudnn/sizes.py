"""Byte sizes as people write them: `64MiB`, `1.5GiB`, `100MB`, `1048576`.

The units (case-insensitive): `B` or none = bytes; `KiB MiB GiB TiB` = powers of 1024; `kB MB GB
TB` = powers of 1000, as SI says. A bare `k`, `m`, `g` or `t` is refused: some tools read `64m` as
MiB and others as MB, and a workspace limit off by 5% is a silent wrong answer. A size must come
to a whole number of bytes (`0.5` is refused, `1.5KiB` is 1536) unless the caller asks for it to
be rounded down (`round_down=True`, what the command line does, saying so) and at most 2**63 - 1
bytes, the most a cache column or an allocation can hold.
"""

from __future__ import annotations

import re
from decimal import ROUND_FLOOR, Decimal

from ucudnn.errors import InvalidInput

MAX_BYTES = 2**63 - 1
_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_AMBIGUOUS = {"k": "KiB", "m": "MiB", "g": "GiB", "t": "TiB"}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")
_SHOWN = ("B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB")


def parse_size(text: str | int, *, round_down: bool = False) -> int:
    """Bytes from `64MiB`, `1.5GiB`, `100MB` or plain `1048576`; refuses negatives and junk.

    A size that is not a whole number of bytes (`10.35GiB`) is refused, or with `round_down` rounded
    down to one (`exact_bytes` gives the unrounded value, to tell the user).
    """
    if isinstance(text, int) and not isinstance(text, bool):
        if not 0 <= text <= MAX_BYTES:
            raise InvalidInput(f"size must be from 0 to {MAX_BYTES} bytes, got {text}")
        return text
    match = _SIZE.match(str(text))
    unit = match.group(2).lower() if match else ""
    if match and unit in _AMBIGUOUS:
        raise InvalidInput(
            f"size {text!r}: the unit {match.group(2)!r} is ambiguous; write "
            f"{match.group(1)}{_AMBIGUOUS[unit]} (powers of 1024) or "
            f"{match.group(1)}{_AMBIGUOUS[unit][0].upper()}B (powers of 1000)"
        )
    if not match and str(text).strip().startswith("-") and _SIZE.match(str(text).strip()[1:]):
        raise InvalidInput(f"size must not be negative, got {text!r}")
    if not match or unit not in _UNITS:
        raise InvalidInput(f"cannot read size {text!r}; write e.g. 64MiB, 1GiB, 100MB or a number of bytes")
    value = Decimal(match.group(1)) * _UNITS[unit]  # exact: 0.1GiB is not rounded through a float
    if value != value.to_integral_value():
        if not round_down or value < 1:  # below one byte is a slip, not a size to round to 0
            raise InvalidInput(f"size {text!r} is {value} bytes, not a whole number of bytes")
        value = value.to_integral_value(rounding=ROUND_FLOOR)
    if value > MAX_BYTES:
        raise InvalidInput(
            f"size {text!r} is {format_size(int(value))}, over the largest possible {format_size(MAX_BYTES)}"
        )
    return int(value)


def exact_bytes(text: str) -> Decimal | None:
    """The exact number of bytes `text` means when that is not whole (`10.35GiB`), else None."""
    match = _SIZE.match(str(text))
    if not match or match.group(2).lower() not in _UNITS:
        return None
    value = Decimal(match.group(1)) * _UNITS[match.group(2).lower()]
    return None if value == value.to_integral_value() else value


def format_size(nbytes: int | None) -> str:
    """Short binary-unit text: 512 B, 8.0 MiB, 3.2 TiB (up to EiB, so any size stays short)."""
    if nbytes is None:
        return "-"
    value = float(nbytes)
    for unit in _SHOWN:
        if abs(value) < 1024 or unit == _SHOWN[-1]:
            return f"{int(value)} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def format_sizes(*sizes: int) -> list[str]:
    """`format_size` of each, with as many decimals as it takes for different sizes to read differently
    (``10.35 GiB`` and ``10.4 GiB``, never ``10.4 GiB`` twice); plain bytes when six decimals are not enough."""
    for decimals in range(1, 7):
        shown = [_with_decimals(b, decimals) for b in sizes]
        if all(shown[i] != shown[j] for i in range(len(sizes)) for j in range(i) if sizes[i] != sizes[j]):
            return shown
    return [f"{b} B" for b in sizes]


def _with_decimals(nbytes: int, decimals: int) -> str:
    value = float(nbytes)
    for unit in _SHOWN:
        if abs(value) < 1024 or unit == _SHOWN[-1]:
            return f"{int(value)} {unit}" if unit == "B" else f"{value:.{decimals}f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")
