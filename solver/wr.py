"""WR (workspace reuse): the fastest division of one kernel's mini-batch under a workspace limit M.

    T_mu(b) = fastest usable micro-config of size b with workspace <= M
    T(b)    = min( T_mu(b), min_{b'} T(b') + T(b - b') )

The recursion splits b into a first part b' that is itself optimal and a rest; restricting b' to the
measured sizes (every division is a sequence of measured sizes) gives the same optimum with fewer
candidates, O(B * |sizes|).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from ucudnn.solver.types import Configuration, Infeasible, MicroConfig


def fastest_within(bench: Mapping[int, Sequence[MicroConfig]], workspace_limit: int | None) -> dict[int, MicroConfig]:
    """T_mu: for each measured size, its fastest usable micro-config within the limit."""
    best: dict[int, MicroConfig] = {}
    for size, options in bench.items():
        for m in options:
            if m.batch != size:
                raise ValueError(f"bench[{size}] holds a micro-config of batch {m.batch}")
            if not m.usable or (workspace_limit is not None and m.workspace > workspace_limit):
                continue
            if size not in best or (m.time, m.workspace) < (best[size].time, best[size].workspace):
                best[size] = m
    return best


def solve(bench: Mapping[int, Sequence[MicroConfig]], batch: int, workspace_limit: int | None) -> Configuration:
    """The fastest configuration whose micro-batches sum to `batch`, each within `workspace_limit`.

    Parameters
    ----------
    bench : mapping micro-batch size -> micro-configs measured at that size
    batch : the mini-batch B to cover
    workspace_limit : M in bytes, or None for no limit

    Raises `Infeasible` when no division of `batch` into measured sizes fits the limit.
    """
    if batch < 1:
        raise ValueError(f"batch must be positive, got {batch}")
    if workspace_limit is not None and workspace_limit < 0:
        raise ValueError(f"workspace_limit must be non-negative or None, got {workspace_limit}")
    t_mu = fastest_within(bench, workspace_limit)
    sizes = sorted(s for s in t_mu if s <= batch)
    # T[b] and the first micro-config of an optimal division of b (back-pointer).
    T = [0.0] + [math.inf] * batch
    first: list[MicroConfig | None] = [None] * (batch + 1)
    for b in range(1, batch + 1):
        # Largest sizes first, so that among equally fast divisions the one with fewer micro-batches wins.
        for size in reversed(sizes):
            if size > b:
                continue
            t = t_mu[size].time + T[b - size]
            if t < T[b]:
                T[b], first[b] = t, t_mu[size]
    if math.isinf(T[batch]):
        measured = sorted(bench)
        raise Infeasible(
            f"no division of batch {batch} fits the workspace limit "
            f"{workspace_limit} B: usable sizes within it are {sizes or 'none'} (measured: {measured})"
        )
    micros: list[MicroConfig] = []
    b = batch
    while b:
        m = first[b]
        assert m is not None
        micros.append(m)
        b -= m.batch
    # Larger micro-batches first: the order does not change time or workspace, and it reads better.
    micros.sort(key=lambda m: (-m.batch, m.algo))
    return Configuration(tuple(micros))
