"""The memory a graph Inductor compiled holds as it runs, read from the Python wrapper it generates.

The wrapper's ``call`` is the graph's run, one statement a line, and its memory lines are Inductor's own memory
plan: a buffer allocated (``bufN = empty_strided_cpu(...)``), an extern kernel's result (``bufN =
torch.ops.aten.convolution_backward.default(...)``, a tuple whose elements ``bufM = bufN[i]`` are storages of
their own; an element no name takes, which Inductor gives no size, counts nothing), a buffer reused for another
(``bufM = bufN; del bufN  # reuse``) or viewed (``reinterpret_tensor(bufN, ...)``), and a reference dropped
(``del bufN``). A storage lives while a name holds it. Walking these lines gives the bytes live at each statement
as the generated code holds them: its CPU kernels allocate every buffer of a fused stretch of nodes before the
call, and an extern kernel's result lives beside its operands until the lines after it drop them, where the
scheduler's estimate (`torch._inductor.memory.estimate_peak_memory`) frees between nodes. On HF MobileNetV2's
compiled step that estimate was 6% off either way by plan and ordered two plans wrong; the walk counts both to
8 bytes (benchmarks/BENCHMARKS.md, issue 52).

Written by hand: Inductor exposes no replay of its generated code's memory, only the estimate above.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

import torch

__all__ = ["Walk", "walk_call"]

_ALLOCATE = re.compile(r"(\w+) = empty_strided_\w+\(\(([^)]*)\), \(([^)]*)\), torch\.(\w+)\)")
_REUSE = re.compile(r"(\w+) = (?:reinterpret_tensor\()?(\w+)\b.*; del (\w+)  # reuse")
_VIEW = re.compile(r"(\w+) = reinterpret_tensor\((\w+),")
_ELEMENT = re.compile(r"(\w+) = (\w+)\[(\d+)\]$")
_CALL = re.compile(r"(\w+) = ([\w.]+)\(")
_DELETE = re.compile(r"del (\w+)$")


@dataclass(frozen=True, slots=True)
class Walk:
    """A graph's run, walked: its peak bytes, and the bytes live at each line that assigns a name (the line's
    results counted, its operands not yet dropped)."""

    peak: int
    live_at: dict[str, int]


def _allocated_bytes(shape: str, stride: str, dtype: str) -> int:
    sizes = [int(s) for s in shape.split(",") if s.strip()]
    strides = [int(s) for s in stride.split(",") if s.strip()]
    if 0 in sizes:
        return 0
    return (1 + sum((n - 1) * s for n, s in zip(sizes, strides, strict=True))) * getattr(torch, dtype).itemsize


def walk_call(source: str, sizes: Mapping[str, int], freeable: Mapping[str, int]) -> Walk:
    """Walk the ``call`` function of a generated wrapper (`source`). `sizes`: each buffer's storage bytes by
    name (an extern kernel's result; a tuple's elements); `freeable`: the graph's inputs it frees as it goes
    (name: bytes), live from the start until the wrapper drops them; its other inputs are not counted."""
    lines = source.split("\n")
    start = next(i for i, line in enumerate(lines) if line.lstrip().startswith("def call("))
    indent = len(lines[start]) - len(lines[start].lstrip())
    body = []
    for line in lines[start + 1 :]:
        if line.strip() and len(line) - len(line.lstrip()) <= indent:
            break
        body.append(line.strip())
    elements: dict[str, dict[int, str]] = {}  # a tuple's name: the names its elements are bound to, by index
    for line in body:
        if m := _ELEMENT.match(line):
            elements.setdefault(m[2], {})[int(m[3])] = m[1]

    holders: dict[str, int] = {}  # name -> storage
    bytes_of: dict[int, int] = {}  # storage -> bytes, while it counts
    names_of: dict[int, set[str]] = {}
    live = 0

    def hold(name: str, nbytes: int) -> None:
        nonlocal live
        storage = len(names_of)
        holders[name], names_of[storage], bytes_of[storage] = storage, {name}, nbytes
        live += nbytes

    def alias(name: str, old: str) -> None:
        if old in holders:
            holders[name] = holders[old]
            names_of[holders[old]].add(name)

    def drop(name: str) -> None:
        nonlocal live
        storage = holders.pop(name, None)
        if storage is None:
            return
        names_of[storage].discard(name)
        if not names_of[storage]:
            live -= bytes_of.pop(storage)

    for name, nbytes in freeable.items():
        hold(name, nbytes)
    peak, live_at = live, {}
    for line in body:
        if line.startswith("return"):
            break
        if m := _DELETE.match(line):
            drop(m[1])
            for i in elements.get(m[1], {}):
                drop(f"{m[1]}[{i}]")
            continue
        if m := _ALLOCATE.match(line):
            hold(m[1], _allocated_bytes(m[2], m[3], m[4]))
        elif m := _REUSE.match(line):
            alias(m[1], m[2])
            drop(m[3])
        elif m := _VIEW.match(line):
            alias(m[1], m[2])
        elif m := _ELEMENT.match(line):
            alias(m[1], f"{m[2]}[{m[3]}]")
        elif (m := _CALL.match(line)) and "out=" not in line:  # an extern kernel's result (a tuple's elements)
            for i, element in elements.get(m[1], {}).items():
                hold(f"{m[1]}[{i}]", sizes.get(element, 0))
            if m[1] not in elements:
                hold(m[1], sizes.get(m[1], 0))
        else:
            continue
        peak = max(peak, live)
        live_at[m[1]] = live
    return Walk(peak, live_at)
