"""Shared pieces of the benchmark scripts: interleaved timing (the package's own) and plain-text tables."""

from __future__ import annotations

from ucudnn.kernel.measure import interleaved_medians_ms, interleaved_samples_ms

__all__ = ["interleaved_medians_ms", "interleaved_samples_ms", "keep_freed_memory", "make_step", "minor_faults",
           "table"]


def make_step(model, x, y, sync, loss=None):
    """One SGD training step (forward, `loss` (cross-entropy by default), backward, update) of `model` on (x, y),
    then `sync()`. torch is imported here: the other pieces of this module need only the package."""
    import torch
    import torch.nn.functional as F

    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    loss = loss or F.cross_entropy

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        loss(model(x), y).backward()
        optimizer.step()
        sync()

    return step


def keep_freed_memory() -> None:
    """Make glibc's malloc keep the memory a CPU step frees, for later steps to reuse.

    By default it hands large frees back to the kernel (a chunk it mapped alone is unmapped, and the
    heap's free top is trimmed), so the next step takes page faults to get them back: on the
    benchmarks' chain 27-40 MiB a step for plain training, and a varying amount for other plans, as
    the heap's layout falls. Python has no call for this: ctypes reaches glibc's
    `mallopt` (the variables MALLOC_TRIM_THRESHOLD_ and MALLOC_MMAP_MAX_ do it from a process's start)."""
    import ctypes

    libc = ctypes.CDLL("libc.so.6")
    m_trim_threshold, m_mmap_max = -1, -4          # <malloc.h>
    if not (libc.mallopt(m_trim_threshold, 2**31 - 1) and libc.mallopt(m_mmap_max, 0)):
        raise RuntimeError("mallopt refused the settings")


def minor_faults() -> int:
    """This process's minor page faults so far (pages the kernel mapped in on first touch)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def plan_fields(plan) -> dict:
    """A memory plan's figures in a benchmark's row: its limit, whether it fits, the maps it offloads and
    recomputes, its predicted peak."""
    return {"memory_limit": plan.memory_limit, "fits": plan.fits,
            "offloaded": sum(t.action == "offload" for t in plan.tensors),
            "recomputed": sum(t.action == "recompute" for t in plan.tensors), "predicted_bytes": plan.peak_bytes}


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
