"""The memory-plan program: per tensor keep / offload / recompute, per conv kernel one option, least time.

Inputs are tables (no graph, no device): the training step is a sequence of T steps (rows); each
decided tensor s has, for each action a, the rows it is resident in (`Tensor.rows[a]`) and the time
the action adds (`Tensor.cost_ms[a]`); each conv kernel j has options c with time t_jc and
workspace w_jc, held in row `Kernel.row`; `fixed_bytes[t]` is what is resident at row t whatever is
decided (weights, gradients, tensors with one possible action). The 0-1 program (HiGHS through
`scipy.optimize.milp`):

    x_sa in {0, 1}: tensor s takes action a        y_jc in {0, 1}: kernel j runs option c
    W_t >= 0: the workspace held at row t

    min  sum_jc t_jc y_jc + sum_sa cost_sa x_sa
    s.t. sum_a x_sa = 1                              for every tensor s
         sum_c y_jc = 1                              for every kernel j
         W_t >= sum_c w_jc y_jc                      for every kernel j in row t (kernels of a row run in turn)
         fixed_t + sum_{s,a: t in rows_sa} b_s x_sa + W_t <= M     for every row t
         x_{s,recompute} + x_{p,offload} + x_{p,recompute} <= 1    for every tensor p that s is rebuilt from
         sum_s b_s x_{s,offload} <= copy_budget_bytes          (the copies must fit in the compute they hide behind)
         Q_k >= Q_{k-1} + sum_{s: copy_row_s in block k} b_s x_{s,offload} - drain_k,  Q_k >= 0
                                                     (the copy-out queue: bytes waiting on the device)
and Q_k joins the memory of every row of block k (`queue_block[t]` = k; the forward pass). Rows are
grouped in blocks because a queue per row makes the relaxation weak and HiGHS slow (ResNet-152: 3x).

The objective is the program's model of the step time; the caller simulates the answer and reports
how far the simulated time is from it. `solve` returns the choices, the objective, HiGHS's own MIP
gap (0 when proved optimal) and the solve time. With ``minimise_peak=True`` the objective is the peak
instead: M is a variable (at most `memory_limit`) and the program minimises it, whatever the time
(`Solution.peak_bytes`; its `objective_ms` is then the time model of the choices it made). With ``relaxed=True``
every 0-1 variable may take any value in [0, 1]: a linear program, solved in a fraction of the time, whose
optimum bounds the program's from below (its choices are then not a plan).
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
from ucudnn.solver.types import Infeasible

from ucudnn.errors import InvalidInput

__all__ = ["Kernel", "Solution", "Tensor", "solve"]


@dataclass(frozen=True, slots=True)
class Tensor:
    name: str
    bytes: int
    rows: dict[str, tuple[int, ...]]  # action -> the rows where the tensor is resident
    cost_ms: dict[str, float]  # action -> the time it adds
    rebuilt_from: tuple[str, ...] = ()  # tensors a recompute of this one reads
    copy_row: int | None = None  # offload: the row at whose end its copy out is queued


@dataclass(frozen=True, slots=True)
class Kernel:
    name: str
    row: int
    times_ms: tuple[float, ...]
    workspaces: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Solution:
    actions: dict[str, str]
    options: dict[str, int]  # kernel -> the index of its chosen option
    objective_ms: float
    mip_gap: float  # HiGHS's relative gap between its answer and its bound
    solve_time_s: float
    status: str = field(default="optimal")
    peak_bytes: float | None = None  # minimise_peak: the least peak M the program found


@contextlib.contextmanager
def _quiet_stdout():
    """HiGHS's MIP solver prints a debug line to the C-level stdout even with disp off; it would
    corrupt `ucudnn plan --json`. Point file descriptor 1 at /dev/null while it runs."""
    sys.stdout.flush()
    saved = os.dup(1)
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 1)
        yield
    finally:
        os.dup2(saved, 1)
        os.close(saved)
        os.close(devnull)


def solve(
    tensors: Sequence[Tensor],
    kernels: Sequence[Kernel],
    fixed_bytes: Sequence[int],
    memory_limit: int,
    *,
    copy_budget_bytes: float | None = None,
    drain_bytes: Sequence[float] = (),
    queue_block: Sequence[int] = (),
    time_limit_s: float = 8.0,
    mip_rel_gap: float = 1e-3,
    minimise_peak: bool = False,
    relaxed: bool = False,
) -> Solution:
    """Solve the program above; `Infeasible` when no choice fits `memory_limit`. `minimise_peak`: the
    choices with the least peak instead of the least time; `relaxed`: its linear relaxation, a bound (see the
    module docstring)."""
    from scipy.optimize import Bounds, LinearConstraint, milp
    from scipy.sparse import coo_matrix

    T = len(fixed_bytes)
    if memory_limit <= 0:
        raise InvalidInput(f"memory_limit must be positive, got {memory_limit}")
    # variable layout: x_sa for each tensor's actions, y_jc for each kernel's options, then W_t per row
    x_index: list[tuple[int, str, int]] = []
    cost: list[float] = []
    for si, t in enumerate(tensors):
        for a in t.rows:
            x_index.append((si, a, len(cost)))
            cost.append(t.cost_ms[a])
    y_index: list[tuple[int, int, int]] = []
    for ji, k in enumerate(kernels):
        for c, ms in enumerate(k.times_ms):
            y_index.append((ji, c, len(cost)))
            cost.append(ms)
    kernel_rows = sorted({k.row for k in kernels})
    w_var = {row: len(cost) + i for i, row in enumerate(kernel_rows)}
    cost += [0.0] * len(kernel_rows)
    q_var = {row: len(cost) + i for i in range(len(drain_bytes)) for row in (i,)}
    cost += [0.0] * len(drain_bytes)
    time_cost = np.asarray(cost)
    peak_var = None
    if minimise_peak:  # M as a variable, the only term of the objective (in MiB: the other costs are ms)
        peak_var = len(cost)
        cost = [0.0] * len(cost) + [1.0 / 2**20]
    n = len(cost)

    rows_i: list[int] = []
    cols: list[int] = []
    vals: list[float] = []
    lo: list[float] = []
    hi: list[float] = []

    def row(entries: list[tuple[int, float]], lower: float, upper: float) -> None:
        r = len(lo)
        for col, v in entries:
            rows_i.append(r)
            cols.append(col)
            vals.append(v)
        lo.append(lower)
        hi.append(upper)

    var_of: dict[tuple[int, str], int] = {}
    for si, a, col in x_index:
        var_of[(si, a)] = col
    # sum_a x_sa = 1
    for si, t in enumerate(tensors):
        row([(var_of[(si, a)], 1.0) for a in t.rows], 1.0, 1.0)
    # sum_c y_jc = 1 and W_t >= sum_c w_jc y_jc
    by_kernel: dict[int, list[tuple[int, int]]] = {}
    for ji, c, col in y_index:
        by_kernel.setdefault(ji, []).append((c, col))
    for ji, k in enumerate(kernels):
        opts = by_kernel[ji]
        row([(col, 1.0) for _, col in opts], 1.0, 1.0)
        row([(w_var[k.row], 1.0)] + [(col, -float(k.workspaces[c])) for c, col in opts], 0.0, np.inf)
    # memory per row, as a running sum so each window costs two nonzeros, not one per row it spans:
    # M_t = M_{t-1} + (fixed_t - fixed_{t-1}) + sum b_s x_sa [window of sa starts at t]
    #                                        - sum b_s x_sa [window of sa ended at t - 1]
    # M_t + W_t + Q_t <= M
    m_var = [n + r for r in range(T)]
    n += T
    cost += [0.0] * T
    delta: list[list[tuple[int, float]]] = [[] for _ in range(T + 1)]
    for si, a, col in x_index:
        b = float(tensors[si].bytes)
        rws = tensors[si].rows[a]
        for i, r in enumerate(rws):
            if i == 0 or rws[i - 1] != r - 1:
                delta[r].append((col, b))
            if i == len(rws) - 1 or rws[i + 1] != r + 1:
                delta[r + 1].append((col, -b))
    for r in range(T):
        entries = [(m_var[r], 1.0)] + ([(m_var[r - 1], -1.0)] if r else []) + [(c, -v) for c, v in delta[r]]
        step = float(fixed_bytes[r] - (fixed_bytes[r - 1] if r else 0))
        row(entries, step, step)
        cap = (
            [(m_var[r], 1.0)]
            + ([(w_var[r], 1.0)] if r in w_var else [])
            + ([(q_var[queue_block[r]], 1.0)] if r < len(queue_block) else [])
        )
        if peak_var is None:
            row(cap, -np.inf, float(memory_limit))
        else:
            row(cap + [(peak_var, -1.0)], -np.inf, 0.0)
    # x_{s,recompute} + x_{p,offload} + x_{p,recompute} <= 1
    index_of = {t.name: si for si, t in enumerate(tensors)}
    for si, t in enumerate(tensors):
        if "recompute" not in t.rows:
            continue
        for p in t.rebuilt_from:
            pi = index_of.get(p)
            if pi is None:
                continue
            entries = [(var_of[(si, "recompute")], 1.0)] + [
                (var_of[(pi, a)], 1.0) for a in ("offload", "recompute") if (pi, a) in var_of
            ]
            if len(entries) > 1:
                row(entries, -np.inf, 1.0)
    if copy_budget_bytes is not None:
        entries = [
            (var_of[(si, "offload")], float(t.bytes)) for si, t in enumerate(tensors) if (si, "offload") in var_of
        ]
        if entries:
            row(entries, -np.inf, float(copy_budget_bytes))
    queued: dict[int, list[tuple[int, float]]] = {}
    for si, t in enumerate(tensors):
        if (si, "offload") in var_of and t.copy_row is not None and t.copy_row < len(queue_block):
            queued.setdefault(queue_block[t.copy_row], []).append((var_of[(si, "offload")], -float(t.bytes)))
    for r in range(len(drain_bytes)):
        entries = [(q_var[r], 1.0)] + ([(q_var[r - 1], -1.0)] if r else []) + queued.get(r, [])
        row(entries, -float(drain_bytes[r]), np.inf)

    A = coo_matrix((np.asarray(vals), (np.asarray(rows_i), np.asarray(cols))), shape=(len(lo), n)).tocsr()
    continuous = [*w_var.values(), *q_var.values(), *m_var]
    if peak_var is not None:
        continuous.append(peak_var)
    integrality = np.ones(n, dtype=np.int8)  # 1: integer, 0: continuous
    integrality[continuous] = 0
    if relaxed:
        integrality[:] = 0
    upper = np.ones(n)
    upper[continuous] = np.inf
    if peak_var is not None:
        upper[peak_var] = float(memory_limit)
    lower = np.zeros(n)
    lower[m_var] = -np.inf
    start = time.perf_counter()
    with _quiet_stdout():
        res = milp(
            np.asarray(cost),
            constraints=LinearConstraint(A, lo, hi),
            integrality=integrality,
            bounds=Bounds(lower, upper),
            options={"time_limit": time_limit_s, "mip_rel_gap": mip_rel_gap, "disp": False},
        )
    elapsed = time.perf_counter() - start
    if res.x is None:
        raise Infeasible(f"no keep/offload/recompute choice fits {memory_limit} bytes ({res.message})")
    x = res.x
    actions = {}
    for si, t in enumerate(tensors):
        actions[t.name] = max(t.rows, key=lambda a: x[var_of[(si, a)]])
    options = {}
    for ji, k in enumerate(kernels):
        options[k.name] = max(by_kernel[ji], key=lambda cc: x[cc[1]])[0]
    gap = float(getattr(res, "mip_gap", 0.0) or 0.0)
    status = "optimal" if res.status == 0 else "time limit"
    if peak_var is not None:
        return Solution(
            actions,
            options,
            float(time_cost @ x[: len(time_cost)]),
            gap,
            elapsed,
            status,
            peak_bytes=float(x[peak_var]),
        )
    return Solution(actions, options, float(res.fun), gap, elapsed, status)
