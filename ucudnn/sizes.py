"""Byte sizes as people write them: `64MiB`, `1.5GiB`, `100MB`, `1048576`.

The units, exactly as written here: `B` or none = bytes; `KiB MiB GiB TiB` = powers of 1024; `kB MB GB
TB` = powers of 1000, as SI says. Any other spelling is refused, naming these: some tools read `64m`,
`64mb` or `64KB` as MiB or KiB and others as MB or kB, and a workspace limit off by 5% is a silent wrong
answer (`8mb` read as 8 MB is 7.6 MiB, which changes the main job's answer). A size must come
to a whole number of bytes (`0.5` is refused, `1.5KiB` is 1536) unless the caller asks for it to
be rounded down (`round_down=True`, what the command line does, saying so) and at most 2**63 - 1
bytes, the most a cache column or an allocation can hold.
"""

from __future__ import annotations

import re
from decimal import ROUND_FLOOR, Decimal
from typing import NoReturn

from ucudnn.errors import InvalidInput

MAX_BYTES = 2**63 - 1
_UNITS = {
    "": 1,
    "B": 1,
    "kB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KiB": 2**10,
    "MiB": 2**20,
    "GiB": 2**30,
    "TiB": 2**40,
}
_BINARY = {"k": "KiB", "m": "MiB", "g": "GiB", "t": "TiB"}
_ACCEPTED = "B, kB, MB, GB, TB (powers of 1000) or KiB, MiB, GiB, TiB (powers of 1024)"
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
    unit = match.group(2) if match else ""
    if match and unit not in _UNITS:
        _refuse_unit(str(text), match.group(1), unit)
    if not match and str(text).strip().startswith("-") and _SIZE.match(str(text).strip()[1:]):
        raise InvalidInput(f"size must not be negative, got {text!r}")
    if not match:
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
    if not match or match.group(2) not in _UNITS:
        return None
    value = Decimal(match.group(1)) * _UNITS[match.group(2)]
    return None if value == value.to_integral_value() else value


def decimal_unit(text: str) -> bool:
    """Whether `text` is a size in powers of 1000 (`8MB`), which a reader may have meant as powers of 1024."""
    match = _SIZE.match(str(text))
    return match is not None and _UNITS.get(match.group(2), 1) % 1000 == 0


def _refuse_unit(text: str, number: str, unit: str) -> NoReturn:
    """InvalidInput for a unit spelt otherwise than `_UNITS`: what it may have meant, and what is read."""
    letter, lower = unit[:1].lower(), unit.lower()
    if letter in _BINARY and lower in (letter, letter + "b"):  # 64m, 64mb, 64Mb, 64KB: 1000s or 1024s?
        decimal = "kB" if letter == "k" else letter.upper() + "B"
        raise InvalidInput(
            f"size {text!r}: the unit {unit!r} is ambiguous; write {number}{_BINARY[letter]} (powers of 1024) or "
            f"{number}{decimal} (powers of 1000)"
        )
    meant = [u for u in _UNITS if u and u.lower() == lower]
    hint = f"write {number}{meant[0]}; " if meant else ""
    raise InvalidInput(f"size {text!r}: unknown unit {unit!r}; {hint}the units are {_ACCEPTED}, as written")


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
