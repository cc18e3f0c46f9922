"""The workspace as named arrays at fixed offsets: one description that both sizes an algorithm's
buffer (`workspace_size`) and carves it (`run`), so the two cannot drift apart."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

# Every array carved from a workspace starts on a 64-byte boundary (a cache line, and the widest
# SIMD load), measured from the buffer's real address; the declared size carries 64 bytes of slack
# for that, so a caller's buffer at any address still fits. NumPy hands only aligned arrays to BLAS.
ALIGN_BYTES = 64


@dataclass(frozen=True, slots=True)
class _Slot:
    offset: int
    shape: tuple[int, ...]
    dtype: np.dtype


def _align(nbytes: int) -> int:
    return -(-nbytes // ALIGN_BYTES) * ALIGN_BYTES


class _Layout:
    """Named arrays at fixed byte offsets of one workspace buffer.

    `add` places arrays one after another; `overlay` places several alternative groups at the same
    offset, for temporaries whose lifetimes do not overlap (each group is laid out in sequence).
    """

    def __init__(self) -> None:
        self.slots: dict[str, _Slot] = {}
        self.end = 0

    def _place(self, start: int, items: Sequence[tuple[str, tuple[int, ...], Any]]) -> int:
        offset = start
        for name, shape, dtype in items:
            if name in self.slots:
                raise AssertionError(f"workspace slot {name!r} placed twice")
            dtype = np.dtype(dtype)
            offset = _align(offset)
            self.slots[name] = _Slot(offset, tuple(int(d) for d in shape), dtype)
            offset += math.prod(shape) * dtype.itemsize
        return offset

    def add(self, name: str, shape: tuple[int, ...], dtype: Any) -> None:
        self.end = self._place(self.end, [(name, shape, dtype)])

    def overlay(self, *groups: Sequence[tuple[str, tuple[int, ...], Any]]) -> None:
        start = _align(self.end)
        self.end = max([self._place(start, group) for group in groups], default=start)

    @property
    def nbytes(self) -> int:
        return self.end + ALIGN_BYTES if self.end else 0

    def carve(self, workspace: np.ndarray) -> dict[str, np.ndarray]:
        """Views of `workspace` for every slot (no copies, no allocation of array data)."""
        base = (-workspace.ctypes.data) % ALIGN_BYTES
        return {
            name: np.ndarray(slot.shape, slot.dtype, buffer=workspace, offset=base + slot.offset)
            for name, slot in self.slots.items()
        }
