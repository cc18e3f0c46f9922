"""WD (workspace division): one configuration per kernel, the summed workspace within one total.

Each kernel k has a front C_k (from `pareto.front`) of configurations c with time t_kc and
workspace w_kc. WD picks one per kernel:

    minimise    sum_k sum_{c in C_k} t_kc x_kc
    subject to  sum_{c in C_k} x_kc = 1                     for every kernel k   (one-hot)
                sum_k sum_{c in C_k} w_kc x_kc <= W                               (knapsack)
                x_kc in {0, 1}

a multiple-choice knapsack problem (MCKP). Two exact solvers:

- `milp`: the program above, solved by HiGHS through `scipy.optimize.milp` (relative gap 0).
- `mckp`: a specialised branch-free solver, in three steps.
  1. LP relaxation: from every kernel's smallest option, take the segments of the kernels'
     lower convex hulls in order of decreasing time saved per byte until W runs out. The
     segment that does not fit gives the multiplier lambda of the knapsack row and the bound
     L = sum_k min_c (t_kc + lambda w_kc) - lambda W <= optimum; the LP solution rounded down
     and filled greedily gives an incumbent U.
  2. Reduced-cost fixing: r_kc = t_kc + lambda w_kc - min_c' (t_kc' + lambda w_kc') >= 0, and a
     solution of time T has sum_k r_kc_k <= T - L. So a solution better than L + g uses only
     items with r_kc <= g; kernels left with one such item are fixed.
  3. A DP over the other kernels (merged a few at a time into stages) keeps the partial choices
     that no other dominates in (workspace, time) and whose time plus the LP relaxation of the
     kernels still to choose can beat the best solution known; rounding that LP down completes
     each partial choice into a solution, which tightens the pruning as the DP goes.
  g starts small and doubles until the best solution found is within L + g: then it is optimal.
  Every pruning step is exact (proofs at `_solve_mckp` and `_bounded_dp`); on fronts shaped like
  real networks' only a few dozen kernels ever reach the DP.

`method="auto"` runs `mckp`, which measured well over an order of magnitude faster than `milp`
and than GLPK on ResNet-shaped instances (`python benchmarks/kernels/bench_wd_solver.py`), and hands the
instance to `milp` only if the DP would hold more than `_AUTO_MAX_STATES` partial choices at once.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
from ucudnn.solver.types import Configuration, Infeasible

from ucudnn.errors import InvalidInput, UcudnnError

METHODS = ("auto", "milp", "mckp")

# `auto` hands an instance to HiGHS when the mckp DP would hold more partial choices than this at
# once: a guard on time and memory for adversarial instances (dense near-ties in time per byte).
# The benchmark's instances stay in the hundreds.
_AUTO_MAX_STATES = 200_000

# HiGHS stops at an absolute gap of 1e-6 even with a relative gap of 0, so the MILP's costs are
# scaled to this magnitude first: the gap then stays below 1e-12 of the largest possible saving.
_MILP_COST_SCALE = 1e6

# HiGHS accepts a knapsack row that is violated within its feasibility tolerance (1e-7 of the
# scaled row); the rounded solution is checked in exact integers and, if over, the row is tightened
# by the excess and solved again, at most this many times. (A solution within that excess of the
# total could then be missed: `milp` is exact up to HiGHS's tolerances, `mckp` exactly.)
_MILP_TIGHTEN_ROUNDS = 3

# The bounded DP's rounds: the first admits the items that leave about _FIRST_ROUND_FREE kernels
# with a choice (but at least (U - L) / _GAP_MIN_DIVISOR of reduced cost); each next round doubles
# the gap, and jumps to U - L once the doubled gap exceeds _GAP_JUMP of it. A round costs more as
# its gap grows, and the greedy incumbent U is often far above the optimum, which lies near L.
# Tuned on the instances of benchmarks/kernels/bench_wd_solver.py by counting Python and NumPy calls.
_FIRST_ROUND_FREE = 24
_GAP_MIN_DIVISOR = 64.0
_GAP_JUMP = 0.5

# The DP merges consecutive free kernels into one stage while their candidate combinations
# number at most this: a stage costs a fixed number of NumPy calls, whatever its width.
_GROUP_OPTIONS = 16

# Reduced-cost tests compare sums of floats: they keep anything within this relative slack of the
# bound, which can only keep more candidates (slower, never wrong).
_BOUND_SLACK = 1e-9


@dataclass(frozen=True, slots=True)
class _Instance:
    """The usable, non-dominated options of every kernel, flat and in kernel order.

    Options of kernel k are items start[k]..start[k+1]-1, ascending in workspace and strictly
    descending in time; item start[k] is the smallest workspace of k.
    """

    keys: tuple[Hashable, ...]
    configs: tuple[Configuration, ...]  # item -> the caller's Configuration object
    time_ms: np.ndarray  # t_kc, float64
    workspace_B: np.ndarray  # w_kc, int64
    start: np.ndarray  # kernel k's items are start[k]:start[k+1]
    capacity_B: int  # C = W - sum_k min_c w_kc: what the choices may add

    @property
    def kernels(self) -> int:
        return len(self.keys)


def solve(
    fronts: Mapping[Hashable, Sequence[Configuration]], total_workspace: int, *, method: str = "auto"
) -> dict[Hashable, Configuration]:
    """The fastest choice of one configuration per kernel whose workspaces sum to <= `total_workspace`.

    Parameters
    ----------
    fronts : mapping kernel key -> that kernel's configurations (normally its Pareto front;
        dominated ones and ones with an infinite time are ignored)
    total_workspace : W, the bytes all kernels' workspaces may take together
    method : "auto" (the specialised solver, with HiGHS as a fallback on pathological
        instances), "mckp" (the specialised exact solver only) or "milp" (HiGHS only)

    Returns a dict in the order of `fronts`, mapping each key to one of the Configuration objects
    it was given. Raises `Infeasible` when even the smallest workspaces do not fit, and
    `InvalidInput` for an unknown method, a negative total, or an empty mapping or front.
    """
    if method not in METHODS:
        raise InvalidInput(f"method must be one of {', '.join(METHODS)}, got {method!r}")
    instance = _instance(fronts, total_workspace)
    chosen: np.ndarray | None
    if method == "milp":
        chosen = _solve_milp(instance)
    else:
        chosen = _solve_mckp(instance, max_states=_AUTO_MAX_STATES if method == "auto" else None)
        if chosen is None:
            chosen = _solve_milp(instance)
    return {key: instance.configs[item] for key, item in zip(instance.keys, chosen.tolist(), strict=True)}


def _instance(fronts: Mapping[Hashable, Sequence[Configuration]], total_workspace: int) -> _Instance:
    """Validate the arguments and keep each kernel's usable, non-dominated configurations."""
    if not isinstance(fronts, Mapping):
        raise InvalidInput(f"fronts must be a mapping kernel -> configurations, got {type(fronts).__name__}")
    if not fronts:
        raise InvalidInput("fronts is empty: give at least one kernel with at least one configuration")
    if (
        isinstance(total_workspace, bool)
        or not isinstance(total_workspace, numbers.Real)
        or math.isnan(total_workspace)
        or total_workspace < 0
    ):
        raise InvalidInput(f"total_workspace must be a non-negative number of bytes, got {total_workspace!r}")
    # Workspaces are whole bytes: a fractional total allows what its floor allows.
    total_B = math.inf if math.isinf(total_workspace) else math.floor(total_workspace)

    keys: list[Hashable] = list(fronts)
    given: list[Configuration] = []
    sizes: list[int] = []
    for key, front in fronts.items():
        # list and tuple first: the Sequence ABC check is slow, and this runs once per kernel.
        if (
            not isinstance(front, (list, tuple))
            and (isinstance(front, (str, bytes)) or not isinstance(front, Sequence))
        ) or not front:
            raise InvalidInput(f"fronts[{key!r}] must be a non-empty sequence of Configurations")
        given.extend(front)
        sizes.append(len(front))
    if not all(isinstance(c, Configuration) for c in given):
        item = next(i for i, c in enumerate(given) if not isinstance(c, Configuration))
        kernel, i = _locate(item, sizes)
        raise InvalidInput(f"fronts[{keys[kernel]!r}][{i}] must be a Configuration, got {type(given[item]).__name__}")
    times, workspaces = zip(*[(c.time, c.workspace) for c in given], strict=True)
    time_all = np.array(times, dtype=np.float64)
    workspace_all = np.array(workspaces, dtype=np.int64)
    bad = np.flatnonzero(np.isnan(time_all) | (workspace_all < 0))
    if len(bad):
        kernel, i = _locate(int(bad[0]), sizes)
        raise InvalidInput(
            f"fronts[{keys[kernel]!r}][{i}] has time {time_all[bad[0]]} ms and workspace "
            f"{workspace_all[bad[0]]} B: a time must be a number and a workspace non-negative"
        )

    kernel_all = np.repeat(np.arange(len(keys)), sizes)
    same_kernel = kernel_all[1:] == kernel_all[:-1]
    if (
        np.isfinite(time_all).all()
        and np.all((workspace_all[1:] > workspace_all[:-1]) | ~same_kernel)
        and np.all((time_all[1:] < time_all[:-1]) | ~same_kernel)
    ):
        # Already Pareto fronts (what `pareto.front` returns): keep every option as given.
        order, kernel_of = None, kernel_all
        start = np.concatenate(([0], np.cumsum(sizes)))
        time_arr, workspace_arr = time_all, workspace_all
    else:
        # Per kernel: drop infinite times, sort by (workspace, time), keep strictly decreasing
        # times. A padded kernel x option table makes the running minimum one NumPy call.
        order = np.lexsort((time_all, workspace_all, kernel_all))
        order = order[np.isfinite(time_all[order])]
        usable = np.bincount(kernel_all[order], minlength=len(keys))
        if not usable.all():
            raise Infeasible(f"kernel {keys[int(np.argmin(usable))]!r} has no configuration with a finite time")
        start = np.concatenate(([0], np.cumsum(usable)))
        kernel_of = kernel_all[order]
        column = np.arange(len(order)) - start[kernel_of]
        padded = np.full((len(keys), int(usable.max())), np.inf)
        padded[kernel_of, column] = time_all[order]
        earlier_min = np.minimum.accumulate(padded, axis=1)[kernel_of, column - 1]
        order = order[(column == 0) | (time_all[order] < earlier_min)]
        kernel_of = kernel_all[order]
        start = np.concatenate(([0], np.cumsum(np.bincount(kernel_of, minlength=len(keys)))))
        time_arr, workspace_arr = time_all[order], workspace_all[order]

    first = start[:-1]
    needed_B = int(workspace_arr[first].sum())
    if needed_B > total_B:
        raise Infeasible(
            f"the {len(keys)} kernels need at least {needed_B} B of workspace together (each at its "
            f"smallest configuration), but total_workspace is {total_B} B; give at least {needed_B} B"
        )
    capacity_B = int(min(total_B - needed_B, workspace_arr.sum()))
    # An option whose extra workspace over its kernel's smallest exceeds C can never be chosen.
    keep = workspace_arr - workspace_arr[first][kernel_of] <= capacity_B
    if not keep.all():
        order = np.flatnonzero(keep) if order is None else order[keep]
        kernel_of = kernel_of[keep]
        start = np.concatenate(([0], np.cumsum(np.bincount(kernel_of, minlength=len(keys)))))
        time_arr, workspace_arr = time_arr[keep], workspace_arr[keep]
    configs = tuple(given) if order is None else tuple([given[i] for i in order.tolist()])
    return _Instance(tuple(keys), configs, time_arr, workspace_arr, start, capacity_B)


def _locate(item: int, sizes: list[int]) -> tuple[int, int]:
    """(kernel, position in its front) of a flat item index."""
    kernel = int(np.searchsorted(np.cumsum(sizes), item, side="right"))
    return kernel, item - sum(sizes[:kernel])


def _solve_milp(instance: _Instance) -> np.ndarray:
    """The 0-1 program in the module docstring, solved by HiGHS. Returns the chosen item per kernel."""
    from scipy.optimize import Bounds, LinearConstraint, milp
    from scipy.sparse import csr_array

    K, n = instance.kernels, len(instance.time_ms)
    kernel_of = np.repeat(np.arange(K), np.diff(instance.start))
    first = instance.start[:-1]
    # Costs and the knapsack row are taken relative to each kernel's smallest-workspace option
    # (t_kc - t_k0, w_kc - w_k0 >= 0): one-hot rows make this an equivalent program, with
    # smaller numbers.
    saving_ms = instance.time_ms - instance.time_ms[first][kernel_of]
    extra_B = instance.workspace_B - instance.workspace_B[first][kernel_of]
    max_saving_ms = float(-saving_ms.min()) if n else 0.0
    cost = saving_ms * (_MILP_COST_SCALE / max_saving_ms) if max_saving_ms > 0 else saving_ms
    # sum_c x_kc = 1 for every kernel k
    one_hot = LinearConstraint(csr_array((np.ones(n), (kernel_of, np.arange(n))), shape=(K, n)), 1, 1)
    capacity_B = instance.capacity_B
    for _ in range(_MILP_TIGHTEN_ROUNDS + 1):
        constraints = [one_hot]
        if capacity_B > 0 and extra_B.any():
            # sum_k sum_c (w_kc - w_k0) x_kc <= W - sum_k w_k0, scaled to a right-hand side of 1
            constraints.append(LinearConstraint((extra_B / capacity_B)[np.newaxis, :], -np.inf, 1.0))
        result = milp(
            cost,
            integrality=np.ones(n, dtype=np.int8),
            bounds=Bounds(0, 1),
            constraints=constraints,
            options={"mip_rel_gap": 0.0},
        )
        if result.status != 0 or result.x is None:
            raise UcudnnError(f"HiGHS did not solve the WD program: {result.message}")
        chosen = np.lexsort((-result.x, kernel_of))[first]  # each kernel's largest x_kc
        over_B = int(extra_B[chosen].sum() - instance.capacity_B) if n else 0
        if over_B <= 0:
            return chosen
        capacity_B -= over_B
    raise UcudnnError(
        f"HiGHS kept returning choices over the workspace total after {_MILP_TIGHTEN_ROUNDS} "
        f"tightenings (by {over_B} B); use method='mckp'"
    )


def _lower_hulls(dw: np.ndarray, dt: np.ndarray, kernel_of: np.ndarray) -> np.ndarray:
    """Mask of the items on their kernel's lower convex hull of (extra workspace, time) points.

    Items are grouped by kernel, ascending in workspace and strictly descending in time. A point
    on or above the chord between its neighbours is no hull vertex, whatever the other points, so
    all such points are dropped at once, again and again until none is left.
    """
    alive = np.ones(len(dw), dtype=bool)
    while True:
        idx = np.flatnonzero(alive)
        o, a, b = idx[:-2], idx[1:-1], idx[2:]
        inner = (kernel_of[o] == kernel_of[a]) & (kernel_of[a] == kernel_of[b])
        o, a, b = o[inner], a[inner], b[inner]
        # cross((a - o), (b - o)) <= 0: a is not strictly below the chord o-b
        above = (dw[a] - dw[o]) * (dt[b] - dt[o]) - (dt[a] - dt[o]) * (dw[b] - dw[o]) <= 0
        if not above.any():
            return alive
        alive[a[above]] = False


def _solve_mckp(instance: _Instance, *, max_states: int | None) -> np.ndarray | None:
    """Exact MCKP: LP relaxation on convex hulls, reduced-cost fixing, and a bounded Pareto DP.

    Returns the chosen item per kernel, or None when the DP would hold more than `max_states`
    partial choices (None for max_states means no limit).

    Why reduced-cost fixing is exact. For lambda >= 0, m_k = min_c (t_kc + lambda w_kc) and any
    feasible choice c_k (sum_k w_kc_k <= W):
        T = sum_k t_kc_k >= sum_k (t_kc_k + lambda w_kc_k) - lambda W = L + sum_k r_kc_k,
    so sum_k r_kc_k <= T - L: a solution with T <= L + g has every r_kc_k <= g (r >= 0), and the
    kernels' partial sums of r too. Rounds with a growing g therefore see, in the end, every
    solution better than the incumbent.
    """
    K = instance.kernels
    start = instance.start
    first = start[:-1]
    sizes = np.diff(start)
    kernel_of = np.repeat(np.arange(K), sizes)
    # Work relative to each kernel's smallest option: dw_kc >= 0 extra bytes, dt_kc <= 0 ms.
    dw = (instance.workspace_B - instance.workspace_B[first][kernel_of]).astype(np.float64)
    dt = instance.time_ms - instance.time_ms[first][kernel_of]
    capacity_B = instance.capacity_B
    last = start[1:] - 1

    if dw[last].sum() <= capacity_B:
        return last  # every kernel's fastest option fits: nothing to trade

    # LP relaxation: from every kernel's smallest option, take hull segments in order of
    # decreasing time saved per byte until the capacity runs out; lambda is the saving per byte
    # of the segment that does not fit.
    on_hull = _lower_hulls(dw, dt, kernel_of)
    vertex = np.flatnonzero(on_hull)
    # A segment ends at every hull vertex but a kernel's first item, and starts at the vertex before.
    ends = vertex[1:][kernel_of[vertex[1:]] == kernel_of[vertex[:-1]]]
    seg_from = vertex[:-1][kernel_of[vertex[1:]] == kernel_of[vertex[:-1]]]
    seg_kernel, seg_to = kernel_of[ends], ends
    seg_dw = dw[seg_to] - dw[seg_from]
    seg_dt = dt[seg_to] - dt[seg_from]  # < 0
    # A kernel's hull segments have decreasing gain (dt / dw increasing); the running maximum
    # only guards against rounding, so that a stable sort keeps every kernel's segments in hull
    # order and any prefix of the order is a valid choice (each kernel at one hull vertex).
    slope = seg_dt / seg_dw
    seg_first = np.searchsorted(seg_kernel, seg_kernel)
    column = np.arange(len(seg_kernel)) - seg_first
    padded = np.full((K, int(column.max(initial=0)) + 1), -np.inf)
    padded[seg_kernel, column] = slope
    slope = np.maximum.accumulate(padded, axis=1)[seg_kernel, column]
    order = np.argsort(slope, kind="stable")
    seg_kernel, seg_to, seg_dw, seg_dt = seg_kernel[order], seg_to[order], seg_dw[order], seg_dt[order]
    taken = np.cumsum(seg_dw) <= capacity_B
    crossing = int(np.argmin(taken))  # the first segment that does not fit (one exists, see above)
    lam = float(-seg_dt[crossing] / seg_dw[crossing])

    # Incumbent: the LP solution rounded down, then filled greedily.
    chosen = first.copy()
    np.maximum.at(chosen, seg_kernel[:crossing], seg_to[:crossing])  # a kernel's last segment taken
    chosen = _fill(dw, dt, kernel_of, chosen, capacity_B)
    U = float(dt[chosen].sum())

    # Lagrangian bound and reduced costs at lambda.
    priced = dt + lam * dw
    m_k = np.minimum.reduceat(priced, first)
    L = float(m_k.sum()) - lam * capacity_B
    reduced = priced - m_k[kernel_of]
    slack = _BOUND_SLACK * (float(-dt.min()) + lam * capacity_B + 1e-300)
    hull = _Hull(seg_kernel, seg_to, seg_dw, seg_dt)

    # Every solution of time T has sum_k r_kc_k = T - L - lambda (C - its extra workspace) <= T - L,
    # so a DP over the items with r_kc <= g sees every solution with T <= L + g; once the incumbent
    # is within L + g it is optimal. The optimum is usually much closer to L than the greedy
    # incumbent is, so g starts small and doubles; each round also improves the incumbent. The
    # first g leaves _FIRST_ROUND_FREE kernels with a choice (a kernel has one when its second
    # smallest reduced cost is within g).
    r_padded = np.full((K, int(sizes.max())), np.inf)
    r_padded[kernel_of, np.arange(len(kernel_of)) - first[kernel_of]] = reduced
    second_r = np.sort(np.partition(r_padded, 1, axis=1)[:, 1])
    gap = float(second_r[min(_FIRST_ROUND_FREE, K) - 1])
    gap = min(max(gap, (U - L) / _GAP_MIN_DIVISOR), U - L)
    while U - L > slack:
        gap = min(gap, U - L)
        found = _bounded_dp(
            dw,
            dt,
            reduced,
            start,
            kernel_of,
            capacity_B,
            hull,
            gap=gap + slack,
            incumbent=U - slack,
            max_states=max_states,
        )
        if found is _TOO_MANY:
            return None
        if found is not None:
            U, chosen = found
        if U <= L + gap + slack or gap >= U - L:
            break
        # Double the gap; when that comes near U - L, go straight to U - L (the last round).
        gap = 2.0 * gap if 2.0 * gap < _GAP_JUMP * (U - L) else U - L
    return chosen


_TOO_MANY = object()


def _fill(dw, dt, kernel_of, chosen, capacity_B) -> np.ndarray:
    """Greedy: the single-kernel change that saves the most time and still fits, until none does."""
    used_B = float(dw[chosen].sum())
    while True:
        fits = dw - dw[chosen][kernel_of] <= capacity_B - used_B
        gain = np.where(fits, dt[chosen][kernel_of] - dt, 0.0)
        best = int(np.argmax(gain))
        if gain[best] <= 0:
            return chosen
        used_B += dw[best] - dw[chosen[kernel_of[best]]]
        chosen[kernel_of[best]] = best


@dataclass(frozen=True, slots=True)
class _Hull:
    """Every kernel's convex-hull segments, in order of decreasing gain (the LP greedy's order)."""

    kernel: np.ndarray
    to: np.ndarray  # the item a segment ends at (it starts at the kernel's previous hull item)
    dw: np.ndarray  # extra bytes of the segment, > 0
    dt: np.ndarray  # time change of the segment, < 0


def _bounded_dp(
    dw, dt, reduced, start, kernel_of, capacity_B, hull: _Hull, *, gap: float, incumbent: float, max_states: int | None
):
    """Improve on `incumbent` with items of reduced cost <= gap: (time, items) of the best
    solution found, or None when none beats it, or _TOO_MANY past max_states partial choices.

    Every solution made of items with r_kc <= gap that beats the incumbent is found or bettered.
    Partial choices (a choice for the kernels of stages 0..j) are pruned three ways, each exact:
    - by dominance: one with no more workspace and no more time completes in every way the other
      does, into a solution no worse (the argument of `pareto`);
    - by capacity: the kernels after stage j need at least their smallest candidates' workspace;
    - by bound: time + LP_j(capacity left) is a lower bound on every completion, where LP_j is
      the LP relaxation of the kernels after stage j (their hulls include every option); one
      that cannot beat the best solution known is dropped.
    Each kept partial choice is also completed by rounding LP_j down (a greedy prefix of hull
    segments takes each kernel to one hull vertex: a valid choice that fits), which improves
    the best solution known and so tightens the bound as the DP goes.
    """
    K = len(start) - 1
    candidate = reduced <= gap
    n_candidates = np.bincount(kernel_of[candidate], minlength=K)
    # A kernel with one candidate is fixed to it (every kernel has one: its Lagrangian minimum,
    # reduced cost 0); the DP runs over the others, fewest candidates first (small early stages).
    fixed_item = np.full(K, -1, dtype=np.int64)
    single = candidate & (n_candidates[kernel_of] == 1)
    fixed_item[kernel_of[single]] = np.flatnonzero(single)
    base = fixed_item[fixed_item >= 0]
    base_w, base_t = float(dw[base].sum()), float(dt[base].sum())
    free = np.flatnonzero(n_candidates > 1)
    if not len(free):
        return (base_t, fixed_item) if base_w <= capacity_B and base_t < incumbent else None
    free = free[np.argsort(n_candidates[free], kind="stable")]
    group_of, groups = _group_items(free, n_candidates, candidate, kernel_of, dw, dt)
    n = len(groups)

    # Least extra workspace the groups after each stage still need: their kernels' smallest candidates.
    smallest_B = np.minimum.reduceat(np.where(candidate, dw, np.inf), start[:-1])[free]
    stage_min_B = np.bincount(group_of, weights=smallest_B, minlength=n)
    rest_min_B = np.concatenate((np.cumsum(stage_min_B[::-1])[::-1][1:], [0.0]))
    max_w = capacity_B - rest_min_B  # past this, the groups after stage j no longer fit
    # LP_j(c) of the kernels after stage j over capacity c is convex and piecewise linear: their
    # hull segments taken greedily, cum_dw / cum_dt row j. The DP looks it up by the workspace
    # already used, c = C - w, so the rows are reversed into lp_w / lp_t.
    stage_of = np.full(K, n, dtype=np.int64)
    stage_of[free] = group_of
    seg_stage = stage_of[hull.kernel]
    in_free = seg_stage < n
    seg_stage, seg_kernel, seg_to = seg_stage[in_free], hull.kernel[in_free], hull.to[in_free]
    after = seg_stage[np.newaxis, :] > np.arange(n)[:, np.newaxis]
    cum_dw = np.zeros((n, len(seg_stage) + 1))
    cum_dt = np.zeros((n, len(seg_stage) + 1))
    np.cumsum(np.where(after, hull.dw[in_free], 0.0), axis=1, out=cum_dw[:, 1:])
    np.cumsum(np.where(after, hull.dt[in_free], 0.0), axis=1, out=cum_dt[:, 1:])
    lp_w = capacity_B - cum_dw[:, ::-1]
    lp_t = cum_dt[:, ::-1]

    states = np.array([[base_w], [base_t]])  # row 0: extra workspace, row 1: time
    best_t = incumbent
    best_at: tuple[int, int, int] | None = None  # (stage, state, LP prefix length)
    parents: list[np.ndarray] = []
    picks: list[np.ndarray] = []
    for stage, g in enumerate(groups):
        expanded = (states[:, :, np.newaxis] + g.wt[:, np.newaxis, :]).reshape(2, -1)
        w, t = expanded
        keep = np.flatnonzero((t + np.interp(w, lp_w[stage], lp_t[stage]) < best_t) & (w <= max_w[stage]))
        if not len(keep):
            break
        # Non-dominated in (workspace, time): ascending workspace, strictly descending time.
        # Equal workspaces in any order keep a few dominated ones, which is harmless.
        keep = keep[np.argsort(w[keep])]
        running = np.minimum.accumulate(t[keep])
        drops = np.empty(len(keep), dtype=bool)
        drops[0] = True
        np.less(running[1:], running[:-1], out=drops[1:])
        keep = keep[drops]
        if max_states is not None and len(keep) > max_states:
            return _TOO_MANY
        states = expanded[:, keep]
        parent, pick = np.divmod(keep, g.wt.shape[1])
        parents.append(parent)
        picks.append(pick)
        # Complete every partial choice by the LP's greedy prefix that fits; keep the best.
        prefix = np.searchsorted(lp_w[stage], states[0], side="left")
        completed_t = states[1] + lp_t[stage][prefix]
        state = int(np.argmin(completed_t))
        if completed_t[state] < best_t:
            best_t, best_at = float(completed_t[state]), (stage, state, int(len(seg_stage) - prefix[state]))

    if best_at is None:
        return None
    stage, state, prefix_len = best_at
    chosen = fixed_item
    # Kernels after `stage`: their smallest option, moved up by the LP prefix's segments.
    later = free[group_of > stage]
    chosen[later] = start[later]
    taken = np.flatnonzero(after[stage, :prefix_len])
    # A kernel's later hull segments end at later (larger) items: the largest one taken wins.
    np.maximum.at(chosen, seg_kernel[taken], seg_to[taken])
    for j in range(stage, -1, -1):
        chosen[groups[j].kernels] = groups[j].items(int(picks[j][state]))
        state = int(parents[j][state])
    return best_t, chosen


@dataclass(frozen=True, slots=True)
class _Group:
    """Kernels the DP takes in one stage, and every combination of their candidates.

    Combination p takes, for member i, candidates[i][digit_i] where (digit_0, digit_1, ...) is
    np.unravel_index(p, shape): the last member varies fastest.
    """

    kernels: np.ndarray  # (r,) kernel indices
    candidates: tuple[np.ndarray, ...]  # per member, its candidate items, ascending workspace
    wt: np.ndarray  # (2, P): extra workspace and time of each combination

    def items(self, p: int) -> list[int]:
        digits = np.unravel_index(p, [len(c) for c in self.candidates])
        return [int(c[d]) for c, d in zip(self.candidates, digits, strict=True)]


def _group_items(
    free: np.ndarray,
    n_candidates: np.ndarray,
    candidate: np.ndarray,
    kernel_of: np.ndarray,
    dw: np.ndarray,
    dt: np.ndarray,
) -> tuple[np.ndarray, list[_Group]]:
    """Free kernels in order, merged into consecutive groups of at most _GROUP_OPTIONS combinations.

    Each DP stage costs a fixed number of NumPy calls, so few wider stages beat many narrow ones.
    Returns each free kernel's group (stage) number and the groups.
    """
    rank = np.full(len(n_candidates), -1, dtype=np.int64)
    rank[free] = np.arange(len(free))
    items = np.flatnonzero(candidate & (rank[kernel_of] >= 0))
    items = items[np.argsort(rank[kernel_of[items]], kind="stable")]  # by kernel rank, then workspace
    wt = np.vstack((dw[items], dt[items]))
    bounds = np.concatenate(([0], np.cumsum(n_candidates[free]))).tolist()
    counts = n_candidates[free].tolist()
    group_of = np.empty(len(free), dtype=np.int64)
    groups: list[_Group] = []
    i = 0
    while i < len(free):
        j, size = i + 1, counts[i]
        while j < len(free) and size * counts[j] <= _GROUP_OPTIONS:
            size *= counts[j]
            j += 1
        combined = wt[:, bounds[i] : bounds[i + 1]]
        for m in range(i + 1, j):
            combined = (combined[:, :, np.newaxis] + wt[:, np.newaxis, bounds[m] : bounds[m + 1]]).reshape(2, -1)
        group_of[i:j] = len(groups)
        groups.append(_Group(free[i:j], tuple(items[bounds[m] : bounds[m + 1]] for m in range(i, j)), combined))
        i = j
    return group_of, groups
