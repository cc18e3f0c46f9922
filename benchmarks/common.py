"""Shared pieces of the benchmark scripts: interleaved timing and plain-text tables."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping


def interleaved_medians_ms(fns: Mapping[str, Callable[[], object]], reps: int, warmup: int = 1) -> dict[str, float]:
    """Median wall time (ms) of each function, run in turn rep after rep.

    Interleaving puts every contender under the same machine load at the same moments, so the
    ratios stay meaningful on a noisy machine even when absolute times drift.
    """
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            samples[name].append((time.perf_counter() - start) * 1e3)
    return {name: statistics.median(s) for name, s in samples.items()}


def table(header: list[str], rows: list[list[object]]) -> str:
    """Left-aligned first column, right-aligned others."""
    cells = [[str(c) for c in row] for row in [header, *rows]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    out = []
    for j, row in enumerate(cells):
        out.append("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))))
        if j == 0:
            out.append("  ".join("-" * w for w in widths))
    return "\n".join(out)
