"""Shared pieces of the benchmark scripts: interleaved timing (the package's own), a training step, plain-text
tables and JSON reports.

The scripts live in rooms below this folder (kernels/, cache/, memory/, pytorch/, gpu/) and find this module, and
models.py, by one line before their imports:

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py, models.py
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

from ucudnn.kernel.measure import interleaved_medians_ms, interleaved_samples_ms

__all__ = [
    "interleaved_medians_ms",
    "interleaved_samples_ms",
    "iqr",
    "keep_freed_memory",
    "make_step",
    "minor_faults",
    "plan_fields",
    "table",
    "timed_ms",
    "write_json",
]


def make_step(model, x, y, sync=None, loss=None, plan=None):
    """One SGD training step (lr 0.01, momentum 0.9: forward, `loss` (cross-entropy by default), backward, update)
    of `model` on (x, y), its forward and backward under `execute_plan(model, plan)` where a memory plan is given,
    then `sync()` where given. torch is imported here: the other pieces of this module need only the package."""
    import torch
    import torch.nn.functional as F

    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    loss = loss or F.cross_entropy
    if plan is not None:
        from ucudnn.torch import execute_plan

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        if plan is None:
            loss(model(x), y).backward()
        else:
            with execute_plan(model, plan):
                loss(model(x), y).backward()
        optimizer.step()
        if sync is not None:
            sync()

    return step


def timed_ms(fn) -> float:
    """Wall milliseconds of one call of `fn`."""
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def iqr(values: list[float]) -> float:
    """The interquartile range of `values` (0 for fewer than two)."""
    if len(values) < 2:
        return 0.0
    q1, _, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return q3 - q1


def keep_freed_memory() -> None:
    """Make glibc's malloc keep the memory a CPU step frees, for later steps to reuse.

    By default it hands large frees back to the kernel (a chunk it mapped alone is unmapped, and the
    heap's free top is trimmed), so the next step takes page faults to get them back: on the
    benchmarks' chain 27-40 MiB a step for plain training, and a varying amount for other plans, as
    the heap's layout falls. Python has no call for this: ctypes reaches glibc's
    `mallopt` (the variables MALLOC_TRIM_THRESHOLD_ and MALLOC_MMAP_MAX_ do it from a process's start)."""
    import ctypes

    libc = ctypes.CDLL("libc.so.6")
    m_trim_threshold, m_mmap_max = -1, -4  # <malloc.h>
    if not (libc.mallopt(m_trim_threshold, 2**31 - 1) and libc.mallopt(m_mmap_max, 0)):
        raise RuntimeError("mallopt refused the settings")


def minor_faults() -> int:
    """This process's minor page faults so far (pages the kernel mapped in on first touch)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def plan_fields(plan) -> dict:
    """A memory plan's figures in a benchmark's row: its limit, whether it fits, the maps it offloads and
    recomputes, its predicted peak."""
    return {
        "memory_limit": plan.memory_limit,
        "fits": plan.fits,
        "offloaded": sum(t.action == "offload" for t in plan.tensors),
        "recomputed": sum(t.action == "recompute" for t in plan.tensors),
        "predicted_bytes": plan.peak_bytes,
    }


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


def write_json(path, data, indent: int = 2) -> None:
    """A script's figures as JSON at `path` (its `--json FILE`); nothing where no path was given."""
    if path:
        Path(path).write_text(json.dumps(data, indent=indent) + "\n", encoding="utf-8")
