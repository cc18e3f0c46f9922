"""Sublinear-memory checkpointing on a chain (Chen et al. 2016): which stage outputs to keep.

The chain has stages 0..n-1; stage i's output, of `sizes[i]` bytes, is what the backward pass of the
stages after it needs, and recomputing it costs `costs[i]` (its forward time). A checkpoint set K
keeps the outputs of its stages for the whole step; every other output is dropped after the
forward pass and recomputed, segment by segment, from the nearest kept output before it (Alg. 1).
The last stage's output starts the backward pass and is always kept.

The memory model is the paper's equation (1): the kept outputs, plus the largest segment rebuilt
during the backward pass,

    peak(K) = sum_{k in K} s_k + max_j sum_{i in segment j, i not in K} s_i

where a kept stage may weigh more than a dropped one (`kept_sizes`): an output no backward step
reads costs nothing dropped, but kept as a checkpoint it is held for the recomputation it seeds;

and the extra work is one forward computation of every dropped output before the last checkpoint:
the segment after it is kept, as `torch.utils.checkpoint.checkpoint_sequential` keeps its last
segment (the backward pass starts by reading it, so rebuilding it would hold the same memory at that
moment: the peak is the same). At most one forward pass. Ways to choose K:

- `sqrt_n(n)`: every ceil(sqrt n)-th stage (section 4.3), for stages of equal size;
- `greedy(sizes, budget)`: Algorithm 3, with `budget_search(sizes)`, Appendix A's search over B;
- `optimal(sizes)`: the exact minimum of peak(K), for checking how far the paper's search is;
- `frontier(sizes)`: sets on the front of peak against recompute cost, so that a limit between the
  smallest peak and keeping everything buys the least recompute there, which the three searches
  above never aim for.

Pure NumPy-free math; no graph and no I/O.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import chain

from ucudnn.errors import InvalidInput

__all__ = ["Segmentation", "budget_search", "evaluate", "frontier", "greedy", "optimal", "sqrt_n"]

# Appendix A: "a size 6 grid on [B/sqrt 2, sqrt 2 B] can already give good memory plans".
GRID_POINTS = 6
# Segment bounds tried at most (of the O(c^2) gaps between c candidates): each costs a pass over the chain,
# and a network captured operation by operation has hundreds of candidates (a MobileNet's 200: 20 s of
# passes). Beyond it, bounds evenly spread by rank: the peak found is within one tried gap of the least.
MAX_BOUNDS = 256
# `frontier`'s prices of recompute in kept bytes, relative to the chain's bytes per unit of cost
PRICES = (0.0, 0.25, 0.5, 1.0, 2.0, 4.0)


@dataclass(frozen=True, slots=True)
class Segmentation:
    """A checkpoint set and what it costs: the peak of equation (1) and the recomputed forward work."""

    checkpoints: tuple[int, ...]  # kept stage indices, ascending; always holds n - 1
    peak_bytes: int
    recompute_cost: float  # sum of the dropped stages' forward costs (the last segment is kept)


def _check_sizes(sizes: Sequence[int]) -> list[int]:
    if len(sizes) == 0:
        raise InvalidInput("sizes must name at least one stage, got an empty sequence")
    out = []
    for i, s in enumerate(sizes):
        if isinstance(s, bool) or not isinstance(s, int) or s < 0:
            raise InvalidInput(f"sizes[{i}] must be a non-negative integer number of bytes, got {s!r}")
        out.append(s)
    return out


def _check_kept(kept_sizes: Sequence[int] | None, sizes: list[int]) -> list[int]:
    if kept_sizes is None:
        return sizes
    if len(kept_sizes) != len(sizes):
        raise InvalidInput(f"kept_sizes must have one entry per stage ({len(sizes)}), got {len(kept_sizes)}")
    return _check_sizes(kept_sizes)


def _check_costs(costs: Sequence[float] | None, n: int) -> list[float]:
    if costs is None:
        return [0.0] * n
    if len(costs) != n:
        raise InvalidInput(f"costs must have one entry per stage ({n}), got {len(costs)}")
    for i, c in enumerate(costs):
        if not (isinstance(c, (int, float)) and c >= 0 and math.isfinite(c)):
            raise InvalidInput(f"costs[{i}] must be a non-negative finite time, got {c!r}")
    return [float(c) for c in costs]


def evaluate(
    sizes: Sequence[int],
    checkpoints: Sequence[int],
    costs: Sequence[float] | None = None,
    kept_sizes: Sequence[int] | None = None,
) -> Segmentation:
    """peak(K) of equation (1) and the recompute cost of keeping `checkpoints` (the last stage is added)."""
    s = _check_sizes(sizes)
    f = _check_costs(costs, len(s))
    kept_s = _check_kept(kept_sizes, s)
    for k in checkpoints:
        if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k < len(s):
            raise InvalidInput(f"checkpoint {k!r} is not a stage index in 0..{len(s) - 1}")
    return _evaluate(s, checkpoints, f, kept_s)


def _evaluate(s: list[int], checkpoints: Sequence[int], f: list[float], kept_s: list[int]) -> Segmentation:
    """`evaluate` on checked arguments (the searches call it thousands of times)."""
    n = len(s)
    kept = sorted({*checkpoints, n - 1})
    # the segments run between kept stages (the chain start before the first); the last stage is always kept
    gaps = list(zip([-1, *kept], kept))
    largest_segment = max(sum(s[a + 1 : b]) for a, b in gaps)
    peak = sum(kept_s[k] for k in kept) + largest_segment
    last = kept[-2] if len(kept) > 1 else -1  # the segment after it is kept whole
    # what is recomputed: the stages before `last` that are not kept, summed in stage order
    recompute = sum(chain.from_iterable(f[a + 1 : b] for a, b in gaps if b <= last))
    return Segmentation(tuple(kept), peak, recompute)


def sqrt_n(n: int) -> tuple[int, ...]:
    """Section 4.3: k = ceil(sqrt n) segments of equal length; keep each segment's last stage."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise InvalidInput(f"n must be a positive number of stages, got {n!r}")
    step = math.ceil(math.sqrt(n))
    return tuple(sorted({*range(step - 1, n, step), n - 1}))


def greedy(
    sizes: Sequence[int], budget: float, candidates: Sequence[int] | None = None
) -> tuple[tuple[int, ...], int, int]:
    """Algorithm 3 (memory planning with budget B): walk the chain summing output sizes into `temp`;
    at a candidate stage where temp exceeds B, keep that stage and start a new segment.

    Returns (checkpoints, x, y): x approximates the bytes of the kept outputs, y the largest segment.
    """
    s = _check_sizes(sizes)
    if not (isinstance(budget, (int, float)) and budget >= 0 and math.isfinite(budget)):
        raise InvalidInput(f"budget must be a non-negative finite number of bytes, got {budget!r}")
    allowed = set(range(len(s))) if candidates is None else set(candidates)
    temp = x = y = 0
    kept = []
    for v, size in enumerate(s):
        temp += size
        if v in allowed and temp > budget:
            x += size
            y = max(y, temp)
            kept.append(v)
            temp = 0
    if not kept or kept[-1] != len(s) - 1:
        kept.append(len(s) - 1)
    return tuple(kept), x, y


def budget_search(
    sizes: Sequence[int],
    costs: Sequence[float] | None = None,
    *,
    candidates: Sequence[int] | None = None,
    grid_points: int = GRID_POINTS,
) -> Segmentation:
    """Appendix A: run Algorithm 3 with B = 0 to get x and y, then B = sqrt(xy) and a grid of
    `grid_points` budgets on [B / sqrt 2, sqrt 2 B]; keep the plan with the smallest exact peak
    (ties: the smaller recompute cost)."""
    s = _check_sizes(sizes)
    if isinstance(grid_points, bool) or not isinstance(grid_points, int) or grid_points < 1:
        raise InvalidInput(f"grid_points must be a positive integer, got {grid_points!r}")
    _, x, y = greedy(s, 0, candidates)
    b = math.sqrt(x * y)
    lo, hi = b / math.sqrt(2), b * math.sqrt(2)
    budgets = [0.0, b] + [lo + (hi - lo) * i / max(grid_points - 1, 1) for i in range(grid_points)]
    plans = [evaluate(s, greedy(s, budget, candidates)[0], costs) for budget in budgets]
    return min(plans, key=lambda p: (p.peak_bytes, p.recompute_cost))


def optimal(
    sizes: Sequence[int],
    costs: Sequence[float] | None = None,
    *,
    candidates: Sequence[int] | None = None,
    kept_sizes: Sequence[int] | None = None,
) -> Segmentation:
    """The checkpoint set with the smallest peak(K) (ties: the smaller recompute cost).

    For a fixed bound M on a segment's dropped bytes, the cheapest kept set is a shortest path over
    the stages, g(j) = s_j + min{g(i) : i < j, sum_{i<l<j} s_l <= M}, solved with a sliding-window
    minimum in O(n); peak(K) = g(n-1) + M. Only M equal to the dropped bytes between two candidate
    stages matters, so trying each of those (O(c^2) for c candidates) gives the exact optimum in
    O(c^2 n); beyond `MAX_BOUNDS` of them, a spread of them, within one gap of it. No library solves
    this small min-max path directly; a MILP would need the same n^2 bounds as constraints.
    """
    s = _check_sizes(sizes)
    f = _check_costs(costs, len(s))
    kept_s = _check_kept(kept_sizes, s)
    best: Segmentation | None = None
    for _, lasts in _least_kept(s, f, candidates, kept_s):
        kept = min(lasts, key=lambda last: (last[0], last[1]))[2]
        plan = _evaluate(s, kept, f, kept_s)
        if best is None or (plan.peak_bytes, plan.recompute_cost) < (best.peak_bytes, best.recompute_cost):
            best = plan
    assert best is not None  # the largest bound admits K = {n - 1}
    return best


def frontier(
    sizes: Sequence[int],
    costs: Sequence[float] | None = None,
    *,
    candidates: Sequence[int] | None = None,
    kept_sizes: Sequence[int] | None = None,
) -> tuple[Segmentation, ...]:
    """Checkpoint sets on a front of (peak(K), recompute cost), by ascending peak: none has both a
    smaller peak and a smaller recompute cost than another, so that a limit between the smallest peak
    and keeping everything buys little recompute (a longer kept last segment, larger segments before it).

    The candidates: for each segment bound M and each last checkpoint L, the kept set that minimises
    its bytes less a price on the recompute it saves, at each of `PRICES` (price 0 is `optimal`'s
    search), and `checkpoint_sequential`'s splits (k runs of equal length for every k). The exact
    front is a resource-constrained path problem per (M, L); these candidates come close: on 300 random
    chains of up to 12 stages (kept and dropped sizes equal), a brute force over every set found less
    recompute within the same limit at 14% of the limits, by at most 18% of a forward pass.
    """
    s = _check_sizes(sizes)
    f = _check_costs(costs, len(s))
    kept_s = _check_kept(kept_sizes, s)
    allowed = sorted({*range(len(s) - 1)} if candidates is None else {c for c in candidates if 0 <= c < len(s) - 1})
    bound_of: dict[
        tuple[int, ...], tuple[float, float]
    ] = {}  # each candidate's peak is at most its kept bytes plus its bound
    scale = sum(s) / max(sum(f), 1e-300)  # bytes per unit of cost, chain-wide
    for price in PRICES:
        for bound, lasts in _least_kept(s, f, candidates, kept_s, price * scale):
            for kept_bytes, recompute, kept in lasts:
                key = tuple(sorted(kept))
                bound_of[key] = min(bound_of.get(key, (math.inf, 0.0)), (kept_bytes + bound, recompute))
    plans = {_evaluate(s, kept, f, kept_s) for kept in bound_of}
    plans |= {
        _evaluate(s, [allowed[j * len(allowed) // k - 1] for j in range(1, k)], f, kept_s)
        for k in range(1, len(allowed) + 1)
    }
    exact = sorted(plans, key=lambda p: (p.peak_bytes, p.recompute_cost))
    return tuple(p for k, p in enumerate(exact) if all(p.recompute_cost < q.recompute_cost for q in exact[:k]))


def _least_kept(s: list[int], f: list[float], candidates: Sequence[int] | None, kept_s: list[int], price: float = 0.0):
    """For each bound M on a segment's dropped bytes: (M, [(kept bytes, recompute cost, kept stages)
    for each possible last checkpoint L]), each with the fewest kept bytes (ties: the least recompute)."""
    n = len(s)
    allowed = set(range(n)) if candidates is None else {c for c in candidates if 0 <= c < n}
    allowed.add(n - 1)
    prefix, work = [0], [0.0]  # bytes and forward costs of stages 0..i-1
    for size, cost in zip(s, f):
        prefix.append(prefix[-1] + size)
        work.append(work[-1] + cost)

    def dropped(i: int, j: int) -> int:  # bytes strictly between stages i and j (i = -1: chain start)
        return prefix[j] - prefix[i + 1]

    # Keeping stage j adds s_j bytes and saves its recompute cost f_j: both objectives are additive
    # over the kept stages, so the pair (bytes, -saved cost) is minimised lexicographically.
    # the largest segment always lies between two kept stages, so only those gaps are candidate bounds
    ends = sorted(allowed)
    bounds = sorted({dropped(i, j) for j in ends for i in [-1, *ends] if i < j})
    if len(bounds) > MAX_BOUNDS:
        bounds = [bounds[round(k * (len(bounds) - 1) / (MAX_BOUNDS - 1))] for k in range(MAX_BOUNDS)]
    for bound in bounds:
        g: dict[int, tuple[float, int, float]] = {-1: (0.0, 0, 0.0)}  # -1: the chain start, kept for free
        parent: dict[int, int] = {}
        window: deque[int] = deque([-1])  # kept-able predecessors by index, g increasing
        for j in range(n):
            while window and dropped(window[0], j) > bound:
                window.popleft()
            if j not in allowed or not window:
                continue
            i = window[0]
            g[j] = (g[i][0] + kept_s[j] - price * f[j], g[i][1] + kept_s[j], g[i][2] - f[j])
            parent[j] = i
            while window and g[window[-1]] >= g[j]:
                window.pop()
            window.append(j)
        # The last checkpoint L before stage n - 1 ends the recomputed part (the segment after it is
        # kept): what is recomputed is every stage before L that is not kept.
        lasts = []
        for last in g:
            if last >= n - 1 or dropped(last, n - 1) > bound:
                continue
            kept, j = [n - 1], last
            while j >= 0:
                kept.append(j)
                j = parent[j]
            recompute = 0.0 if last < 0 else work[last] + f[last] + g[last][2]
            lasts.append((g[last][1] + kept_s[n - 1], recompute, kept))
        if lasts:
            yield bound, lasts
