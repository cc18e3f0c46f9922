"""The Pareto front (time x workspace) of one kernel's divisions, for WD.

A configuration's time is the sum of its micro times and its workspace the max of its micro
workspaces. For every b = 1..B the DP keeps F(b), the configurations of b that no other
configuration of b dominates (no slower and no larger, one of them strictly):

    P(s)  = the non-dominated usable micro-configs of size s (workspace <= M)
    F(0)  = {(time 0, workspace 0)}
    F(b)  = prune( U_{s measured, s <= b} combine(P(s), F(b - s)) )
    combine(P, F) = {(t_p + t_f, max(w_p, w_f)) : p in P, f in F}

Why pruning the sub-front F(b - s) loses no Pareto point of b: take any configuration C of b,
split it into its first micro-config p (size s) and the rest R (a configuration of b - s). If some
R' in F(b - s) dominates R, then p + R' has time t_p + t_R' <= t_p + t_R and workspace
max(w_p, w_R') <= max(w_p, w_R), because + and max are both monotone (and so is IEEE rounding of
+). So p + R' is at least as good as C in both objectives: every Pareto point of b is reached
from a member of some F(b - s), and by the same argument from a member of P(s).

The front is handled as a step function. Every workspace a configuration can have is the
workspace of one of its micro-configs, so workspaces are replaced by their rank k among the
distinct workspaces W_k of the micro fronts P(s). F(b) is then the step function
T_b(k) = min time of a configuration of b with workspace <= W_k; its members are the steps.
The non-dominated points of combine(P(s), F(b - s)) are the steps of T_{b-s}(k) + Tmu_s(k), and
those lie at the steps of either addend:

    part A  (t_f + Tmu_s(k_f), k_f)        for f in F(b - s)  (the fastest micro within W_{k_f})
    part B  (t_p + T_{b-s}(k_p), k_p)      for p in P(s)      (the fastest rest within W_{k_p})

(a pair whose workspace is the rest's must use the fastest micro that fits under it, and vice
versa). So F(b) = steps of the point-wise min of all part A and part B candidates: a
`np.minimum.at` into a length-K grid, then a running minimum. Candidates per b are
|F(1)| + ... + |F(b-1)| + |P(1)| + ... + |P(b)|, all gathered with NumPy in one pass; for B = 256
with every size measured and 8 algorithms that is a few million candidates in total.

Each step of F(b) keeps a back-pointer: the micro-config it starts with and the member of
F(b - s) it continues with. Only the members of F(B) are turned into `Configuration`s.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
from ucudnn.solver.types import Configuration, Infeasible, MicroConfig

from ucudnn.errors import InvalidInput

# Flat indices 0 and 1 of the front store are sentinels: F(0)'s one member (time 0) and "no
# configuration fits" (time inf). Members of F(1), F(2), ... follow from index 2.
_EMPTY = 0
_NONE = 1
_FIRST_MEMBER = 2


def _micro_fronts(
    bench: Mapping[int, Sequence[MicroConfig]], batch: int, workspace_limit: int | None
) -> list[tuple[int, list[MicroConfig]]]:
    """P(s) for each measured size s <= batch: usable micro-configs, ascending workspace, strictly descending time."""
    fronts: list[tuple[int, list[MicroConfig]]] = []
    for size, options in bench.items():
        if isinstance(size, bool) or not isinstance(size, (int, np.integer)) or size < 1:
            raise InvalidInput(f"bench keys must be positive micro-batch sizes, got {size!r}")
        for m in options:
            if m.batch != size:
                raise InvalidInput(f"bench[{size}] holds a micro-config of batch {m.batch}")
        if size > batch:
            continue
        usable = sorted(
            (m for m in options if m.usable and (workspace_limit is None or m.workspace <= workspace_limit)),
            key=lambda m: (m.workspace, m.time),
        )
        front: list[MicroConfig] = []
        for m in usable:
            if not front or m.time < front[-1].time:
                front.append(m)
        if front:
            fronts.append((int(size), front))
    fronts.sort(key=lambda item: item[0])
    return fronts


def front(bench: Mapping[int, Sequence[MicroConfig]], batch: int, workspace_limit: int | None) -> list[Configuration]:
    """Every configuration of `batch` that no other dominates in (time, workspace).

    Parameters
    ----------
    bench : mapping micro-batch size -> micro-configs measured at that size
    batch : the mini-batch B to cover
    workspace_limit : M in bytes (each micro-config's workspace must be <= M), or None

    Returns the front in ascending workspace and strictly descending time; the last member is the
    fastest configuration (the WR optimum under the same limit). Raises `Infeasible` when no
    division of `batch` into measured sizes fits the limit.
    """
    if isinstance(batch, bool) or not isinstance(batch, (int, np.integer)) or batch < 1:
        raise InvalidInput(f"batch must be a positive integer, got {batch!r}")
    if workspace_limit is not None and workspace_limit < 0:
        raise InvalidInput(f"workspace_limit must be non-negative or None, got {workspace_limit}")
    batch = int(batch)
    fronts = _micro_fronts(bench, batch, workspace_limit)
    if not fronts:
        raise Infeasible(
            f"no measured micro-config of size <= {batch} is usable within the workspace limit "
            f"{workspace_limit} B (measured sizes: {sorted(bench)})"
        )

    # Flat arrays over all micro fronts P(s), ordered by size, so P(1..b) is a prefix.
    micros = [m for _, ms in fronts for m in ms]
    m_size = np.array([m.batch for m in micros], dtype=np.int64)
    m_time = np.array([m.time for m in micros], dtype=np.float64)
    m_ws = np.array([m.workspace for m in micros], dtype=np.int64)
    W_k, m_rank = np.unique(m_ws, return_inverse=True)
    K = len(W_k)
    m_prefix = np.searchsorted(m_size, np.arange(batch + 1), side="right")  # |P(1..b)| per b

    # Tmu[row(s), k]: fastest micro of size s within W_k, and which micro it is. Row len(fronts)
    # stays inf for sizes that were not measured.
    sizes = [s for s, _ in fronts]
    row_of_size = np.full(batch + 1, len(fronts), dtype=np.int64)
    row_of_size[sizes] = np.arange(len(fronts))
    Tmu = np.full((len(fronts) + 1, K), np.inf)
    Tmu_micro = np.full((len(fronts) + 1, K), -1, dtype=np.int64)
    start = 0
    for row, (_, ms) in enumerate(fronts):
        ranks = m_rank[start : start + len(ms)]
        # P(s) is ascending in workspace and descending in time: micro j rules from its rank on.
        owner = np.full(K, -1, dtype=np.int64)
        owner[ranks] = np.arange(start, start + len(ms))
        owner = np.maximum.accumulate(owner)
        fits = owner >= 0
        Tmu[row, fits] = m_time[owner[fits]]
        Tmu_micro[row, fits] = owner[fits]
        start += len(ms)
    Tmu_flat = Tmu.ravel()

    # The front store: members of F(1), F(2), ... appended in order of b, with back-pointers.
    capacity = _FIRST_MEMBER + 64 * batch
    # (plain ndarrays: the store grows by concatenation, which numpy's stubs type by a union of the dtypes)
    f_b: np.ndarray = np.zeros(capacity, dtype=np.int64)  # b of the member
    f_rank: np.ndarray = np.zeros(capacity, dtype=np.int64)  # k: its workspace is W_k
    f_time: np.ndarray = np.zeros(capacity, dtype=np.float64)  # T_b(k)
    f_micro: np.ndarray = np.full(capacity, -1, dtype=np.int64)  # first micro-config (index into micros)
    f_rest: np.ndarray = np.full(capacity, -1, dtype=np.int64)  # member of F(b - s) that follows it
    f_time[_NONE] = np.inf
    n_members = _FIRST_MEMBER
    # owner_of[b, k]: the member of F(b) in effect at workspace W_k (its T_b(k)); F(0) is 0 everywhere.
    owner_of = np.full((batch + 1, K), _NONE, dtype=np.int64)
    owner_of[0] = _EMPTY
    member_range = np.zeros((batch + 2,), dtype=np.int64)  # F(b) is members [range[b], range[b+1])
    member_range[:2] = _FIRST_MEMBER
    grid = np.empty(K)

    for b in range(1, batch + 1):
        # part A: every member f of F(1..b-1), continued after a micro of size s = b - b_f.
        A = slice(_FIRST_MEMBER, n_members)
        a_row = row_of_size[b - f_b[A]]
        a_rank = f_rank[A]
        a_time = f_time[A] + Tmu_flat[a_row * K + a_rank]
        # part B: every micro p of P(1..b), followed by the fastest rest of b - s within W_{k_p}.
        nB = m_prefix[b]
        b_rest = owner_of[b - m_size[:nB], m_rank[:nB]]
        b_time = m_time[:nB] + f_time[b_rest]
        cand_time = np.concatenate((a_time, b_time))
        cand_rank = np.concatenate((a_rank, m_rank[:nB]))

        grid.fill(np.inf)
        np.minimum.at(grid, cand_rank, cand_time)
        running = np.minimum.accumulate(grid)
        # A step of T_b: the running minimum strictly drops at k (so grid[k] is that minimum).
        is_step = np.isfinite(running)
        is_step[1:] &= running[1:] < running[:-1]
        steps = np.flatnonzero(is_step)

        # Back-pointers: one candidate that attains grid[k] at each step (any one will do).
        winner = np.full(K, -1, dtype=np.int64)
        wins = np.flatnonzero(cand_time == grid[cand_rank])
        winner[cand_rank[wins]] = wins
        cand = winner[steps]
        n_new = len(steps)
        if n_members + n_new > len(f_b):
            grow = max(len(f_b), n_new)
            f_b, f_rank, f_time, f_micro, f_rest = (
                np.concatenate((arr, np.full(grow, fill, dtype=arr.dtype)))
                for arr, fill in ((f_b, 0), (f_rank, 0), (f_time, 0.0), (f_micro, -1), (f_rest, -1))
            )
        new = slice(n_members, n_members + n_new)
        f_b[new] = b
        f_rank[new] = steps
        f_time[new] = grid[steps]
        from_a = cand < len(a_time)
        ia = cand[from_a]
        f_micro[new][from_a] = Tmu_micro[a_row[ia], a_rank[ia]]
        f_rest[new][from_a] = ia + _FIRST_MEMBER
        ib = cand[~from_a] - len(a_time)
        f_micro[new][~from_a] = ib
        f_rest[new][~from_a] = b_rest[ib]

        # owner_of[b, k] = the last step at or below k.
        at = np.full(K, -1, dtype=np.int64)
        at[steps] = np.arange(n_members, n_members + n_new)
        at = np.maximum.accumulate(at)
        owner_of[b] = np.where(at >= 0, at, _NONE)
        n_members += n_new
        member_range[b + 1] = n_members

    final = range(int(member_range[batch]), int(member_range[batch + 1]))
    if not final:
        usable_sizes = [s for s in sizes if s <= batch]
        raise Infeasible(
            f"no division of batch {batch} fits the workspace limit {workspace_limit} B: "
            f"usable sizes within it are {usable_sizes} (measured: {sorted(bench)})"
        )

    result: list[Configuration] = []
    for member in final:
        chain: list[MicroConfig] = []
        while member != _EMPTY:
            chain.append(micros[int(f_micro[member])])
            member = int(f_rest[member])
        # Larger micro-batches first, as in wr.solve: order changes neither time nor workspace.
        chain.sort(key=lambda m: (-m.batch, m.algo))
        config = Configuration(tuple(chain))
        # The DP adds times in another order than Configuration.time does; keep the contract
        # (strictly descending time) on the values the caller will read.
        if result and config.time >= result[-1].time:
            continue
        result.append(config)
    return result
