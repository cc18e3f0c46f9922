"""Shared pieces of the benchmark scripts: interleaved timing (the package's own) and plain-text tables."""

from __future__ import annotations

from ucudnn.kernel.measure import interleaved_medians_ms

__all__ = ["interleaved_medians_ms", "make_step", "table"]


def make_step(model, x, y, sync):
    """One SGD training step (forward, cross-entropy, backward, update) of `model` on (x, y), then `sync()`.
    torch is imported here: the other pieces of this module need only the package."""
    import torch
    import torch.nn.functional as F

    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
        sync()

    return step


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
