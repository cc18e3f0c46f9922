"""Heterogeneous clusters: one batch per device so that the slowest device finishes first (μ-cuDNN §III-E).

    minimise   max_g  sum_b t[g,b] x[g,b]
    subject to sum_b x[g,b] <= 1                 for each device g   (0 = the device sits out)
               sum_g sum_b b x[g,b] = B
               x[g,b] in {0, 1}

Two exact solvers give the same optimal makespan T*:

- `method="search"` (the default): T* is one of the distinct times t[g,b], so a binary search over
  them asks "can the devices, each limited to its sizes with t[g,b] <= T, reach exactly B?". That
  is a subset-sum over devices, answered with a bitset of reachable sums (a Python int: bit s set
  when s samples can be covered). A device's allowed sizes are split into arithmetic runs
  (lo, lo+d, ..., hi), and a run is added to the bitset by doubling in O(log run) shifts, so the
  usual monotone time table costs a handful of shifts per device. O(log(GK) * G * K) big-int
  operations of B bits for G devices and K sizes each.
- `method="milp"`: the program above, through `scipy.optimize.milp` (HiGHS), with the makespan z
  as a continuous variable and sum_b t[g,b] x[g,b] <= z.

Among assignments with the optimal makespan, `search` gives each device, from the last to the
first, the largest allowed batch that leaves a reachable rest; `milp` returns whatever HiGHS finds.
"""

from __future__ import annotations

import bisect
import functools
import itertools
import math
from collections.abc import Mapping

from ucudnn.solver.types import Infeasible

from ucudnn.errors import InvalidInput

__all__ = ["best_batch_sizes", "makespan"]

METHODS = ("search", "milp")


def best_batch_sizes(times: Mapping[str, Mapping[int, float]], batch: int, *, method: str = "search") -> dict[str, int]:
    """The batch of each device (0 = unused) that covers `batch` with the smallest slowest-device time.

    Parameters
    ----------
    times : device -> {batch size b >= 1: step time t[g,b] in ms}. Any set of sizes per device; an
        infinite time means the device cannot run that size and is left out.
    batch : the global mini-batch B >= 1.
    method : "search" (exact, specialised) or "milp" (exact, HiGHS).

    Returns a dict with every device of `times`, in its order. Raises `InvalidInput` for malformed
    input and `Infeasible` when no choice of one size per device sums to B.
    """
    table = _check(times, batch, method)
    solve = _solve_search if method == "search" else _solve_milp
    return solve(table, batch)


def makespan(times: Mapping[str, Mapping[int, float]], assignment: Mapping[str, int]) -> float:
    """The slowest device's time under `assignment` (a device with batch 0 takes 0 ms)."""
    return max((times[g][b] for g, b in assignment.items() if b), default=0.0)


def _check(times, batch, method) -> dict[str, dict[int, float]]:
    if method not in METHODS:
        raise InvalidInput(f"method must be one of {', '.join(METHODS)}, got {method!r}")
    if not isinstance(batch, int) or isinstance(batch, bool) or batch < 1:
        raise InvalidInput(f"batch must be a positive integer, got {batch!r}")
    if not isinstance(times, Mapping) or not times:
        raise InvalidInput("times must map at least one device to its {batch size: time} table")
    table: dict[str, dict[int, float]] = {}
    for g, row in times.items():
        if not isinstance(row, Mapping):
            raise InvalidInput(f"times[{g!r}] must map batch sizes to times, got {type(row).__name__}")
        if not _plain_row(row):
            _name_bad_entry(g, row)
        # A size above B or one that cannot run (infinite time) is never chosen.
        clean = {b: float(t) for b, t in row.items() if b <= batch and t != math.inf}
        table[g] = clean
    return table


def _plain_row(row: Mapping) -> bool:
    """The fast check of a well-formed row (a 64x64 table is validated in well under a millisecond)."""
    try:
        return (
            all(type(b) is int for b in row)
            and min(row, default=1) >= 1
            and all(type(t) is not bool and t >= 0 for t in row.values())
        )  # NaN >= 0 is False
    except TypeError:
        return False


def _name_bad_entry(g: str, row: Mapping) -> None:
    for b, t in row.items():
        if not isinstance(b, int) or isinstance(b, bool) or b < 1:
            raise InvalidInput(f"times[{g!r}]: batch sizes must be positive integers, got {b!r}")
        if isinstance(t, bool) or not isinstance(t, (int, float)) or math.isnan(t) or t < 0:
            raise InvalidInput(f"times[{g!r}][{b}] must be a non-negative number of ms, got {t!r}")


def _infeasible(table: dict[str, dict[int, float]], batch: int) -> Infeasible:
    most = sum(max(row, default=0) for row in table.values())
    if most < batch:
        return Infeasible(
            f"the devices can take at most {most} samples together (each its largest usable "
            f"size), fewer than batch {batch}"
        )
    return Infeasible(
        f"no choice of one usable size per device sums to batch {batch} "
        f"(sizes per device: { ({g: sorted(row) for g, row in table.items()}) })"
    )


# ---- search: binary search on T over the distinct times, subset-sum bitset per threshold ----------


def _runs(sizes: list[int]) -> list[tuple[int, int, int]]:
    """Sorted sizes as maximal arithmetic runs (first, step, count): [1,2,3,4,8,12] -> (1,1,4), (8,4,2)."""
    if sizes and sizes[-1] - sizes[0] == len(sizes) - 1:  # the common case: 1..k, or a contiguous band
        return [(sizes[0], 1, len(sizes))]
    runs: list[tuple[int, int, int]] = []
    i = 0
    while i < len(sizes):
        if i + 1 == len(sizes):
            runs.append((sizes[i], 1, 1))
            break
        step = sizes[i + 1] - sizes[i]
        j = i + 1
        while j + 1 < len(sizes) and sizes[j + 1] - sizes[j] == step:
            j += 1
        runs.append((sizes[i], step, j - i + 1))
        i = j + 1
    return runs


def _add_device(reach: int, runs: list[tuple[int, int, int]], mask: int) -> int:
    """Sums reachable after one more device: reach (the device idle) | reach << b for each allowed b."""
    out = reach
    for first, step, count in runs:
        # spread = reach | reach << step | ... | reach << (count-1)*step, by doubling the covered span.
        spread, covered = reach, 1
        while covered < count:
            extra = min(covered, count - covered)
            spread |= spread << (extra * step)
            covered += extra
        out |= (spread << first) & mask
    return out


def _solve_search(table: dict[str, dict[int, float]], batch: int) -> dict[str, int]:
    devices = list(table)
    mask = (1 << (batch + 1)) - 1
    # Per device: its sizes ordered by time, so the sizes allowed under T are a prefix.
    pairs = {g: sorted(zip(table[g].values(), table[g])) for g in devices}  # (t, b), ascending
    by_time = {g: [b for _, b in pairs[g]] for g in devices}
    sorted_times = {g: [t for t, _ in pairs[g]] for g in devices}

    def allowed(g: str, limit: float) -> list[int]:
        return sorted(by_time[g][: bisect.bisect_right(sorted_times[g], limit)])

    @functools.cache  # the walk back re-asks the optimum's layers
    def layers(limit: float) -> list[int] | None:
        """reach[i] = sums reachable by the first i devices under `limit`; None when B is not reachable."""
        reach = [1]
        for g in devices:
            reach.append(_add_device(reach[-1], _runs(allowed(g, limit)), mask))
        return reach if reach[-1] >> batch & 1 else None

    candidates = sorted({t for row in table.values() for t in row.values()})
    if not candidates or layers(candidates[-1]) is None:
        raise _infeasible(table, batch)
    # A cheap necessary condition first: under T the devices' largest allowed sizes must add up to B.
    # The optimum is usually at or just above that bound, so the bitset checks gallop up from it.
    largest = {g: list(itertools.accumulate(by_time[g], max)) for g in devices}

    def capacity(limit: float) -> int:
        total = 0
        for g in devices:
            k = bisect.bisect_right(sorted_times[g], limit)
            total += largest[g][k - 1] if k else 0
        return total

    lo = bisect.bisect_left(range(len(candidates)), batch, key=lambda i: capacity(candidates[i]))
    hi, step = lo, 1  # find a feasible hi by galloping; everything below lo is infeasible
    while hi < len(candidates) - 1 and layers(candidates[hi]) is None:
        lo, hi, step = hi + 1, min(hi + step, len(candidates) - 1), step * 2
    while lo < hi:  # invariant: feasible at candidates[hi], infeasible below lo
        mid = (lo + hi) // 2
        if layers(candidates[mid]) is None:
            lo = mid + 1
        else:
            hi = mid
    best = candidates[hi]
    reach = layers(best)
    assert reach is not None
    # Walk back from the last device: the largest allowed size whose rest the earlier devices reach.
    out: dict[str, int] = {}
    rest = batch
    for i in range(len(devices) - 1, -1, -1):
        g = devices[i]
        choice = next((b for b in reversed(allowed(g, best)) if b <= rest and reach[i] >> (rest - b) & 1), 0)
        if choice == 0 and not reach[i] >> rest & 1:  # cannot happen: reach[i+1] had bit `rest`
            raise AssertionError("bitset back-tracking lost the path")
        out[g] = choice
        rest -= choice
    return {g: out[g] for g in devices}


# ---- milp: the paper's program through HiGHS -------------------------------------------------------


def _solve_milp(table: dict[str, dict[int, float]], batch: int) -> dict[str, int]:
    import numpy as np
    from scipy.optimize import Bounds, LinearConstraint, milp
    from scipy.sparse import lil_array

    devices = list(table)
    columns = [(g, b) for g in devices for b in sorted(table[g])]  # x[g,b]; the last variable is z
    n = len(columns) + 1
    if not columns:
        raise _infeasible(table, batch)
    rows = len(devices) * 2 + 1
    A = lil_array((rows, n))
    lower, upper = np.full(rows, -np.inf), np.zeros(rows)
    index = {g: i for i, g in enumerate(devices)}
    for j, (g, b) in enumerate(columns):
        i = index[g]
        A[i, j] = 1.0  # sum_b x[g,b] <= 1
        A[len(devices) + i, j] = table[g][b]  # sum_b t[g,b] x[g,b] - z <= 0
        A[2 * len(devices), j] = b  # sum_g sum_b b x[g,b] = B
    upper[: len(devices)] = 1.0
    A[len(devices) : 2 * len(devices), n - 1] = -1.0
    lower[-1] = upper[-1] = batch
    c = np.zeros(n)
    c[-1] = 1.0
    integrality = np.ones(n, dtype=np.int8)  # 1: integer, 0: continuous
    integrality[-1] = 0
    ub = np.ones(n)
    ub[-1] = np.inf
    result = milp(
        c,
        integrality=integrality,
        bounds=Bounds(np.zeros(n), ub),
        constraints=LinearConstraint(A.tocsr(), lower, upper),
        options={"mip_rel_gap": 0.0},
    )
    if result.status == 2:  # HiGHS proved the program infeasible
        raise _infeasible(table, batch)
    if result.x is None:
        raise Infeasible(f"HiGHS found no assignment: {result.message}")
    out = {g: 0 for g in devices}
    for j, (g, b) in enumerate(columns):
        if result.x[j] > 0.5:
            out[g] = b
    return out
