"""`optimal`: per feature map keep / offload / recompute and per conv kernel a workspace, least simulated time.

The graph is turned into the tables of `ucudnn.solver.memplan` (one row per step of the training
iteration; each storage's resident rows under each action; each conv kernel's options, thinned to
at most `MAX_OPTIONS` along its front) and solved with HiGHS. The program models memory exactly at
step granularity but time only as compute, recomputation and each copy out's part that the compute
up to its map's last forward reader does not hide (the next step waits for it), with copies bounded
by the compute they hide behind; so its answer is simulated, and when the simulation overflows the
limit (a copy or prefetch ran later than the program assumed) or stalls, the program is solved again
with the limit lowered by the overflow, or the copy budget cut, and the best simulated plan that
fits wins.

Where everything kept with the fastest workspaces fits, that is the plan, unsearched: no step is faster.
vDNN's static plans (nothing, conv inputs or everything offloaded, fastest or smallest workspaces)
are simulated too, and win where they fit and run faster (the program's copy queue is conservative).
So are the other policies' plans (`ucudnn.memory.planner.POLICIES`) on the same graph, profile, limit
and fronts: `optimal` is never slower than a heuristic, nor fails where one fits (`OptimalResult.chosen`
then names the policy, and the plan's `search` says so).
Where no choice of the program fits the limit (its linear relaxation's least peak, a bound computed once per
graph, is above the limit: no 0-1 solve is needed to know it), the smallest simulated peak wins: a limit below
every plan gives the smallest plan. The program is then solved for the least peak it allows (`memplan.solve`'s
``minimise_peak``), and for the fastest choices within that peak, once for every such limit, but only where its
bound comes within `PROGRAM_REACH` of the smallest static or heuristic plan: the program offloads no more than its
copies hide behind compute, and where everything offloaded is far smaller (ResNet-50 and -152 at batch 64, half
the program's least peak or less) its search, seconds of HiGHS, could not win.
On a device whose memory is the host's (a CPU) nothing is offloaded: the program has no offload
option there and the static plans keep everything.

Each kernel's chosen workspace is its budget for the WD solver (the plan's `conv_workspace`).
`search` returns the plan with the program's figures: its objective (a model of the step time, a
bound for the decisions it weighs), HiGHS's own MIP gap, and the simulated step's distance to it.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
from dataclasses import dataclass

from ucudnn.devices import DeviceProfile
from ucudnn.memory.gradients import gradient_lives
from ucudnn.memory.graph import TrainingGraph
from ucudnn.memory.plan import MemoryPlan
from ucudnn.memory.planner import baseline, to_plan
from ucudnn.memory.reuse import PlanCache
from ucudnn.memory.timing import KernelOption, fastest
from ucudnn.memory.vdnn import actions_for
from ucudnn.solver import memplan
from ucudnn.solver.types import Infeasible

__all__ = ["OptimalResult", "plan", "search"]

log = logging.getLogger("ucudnn.memory.optimal")

QUEUE_FACTOR = 1.2  # copies back queue on their stream: one is assumed to take this times its time alone
QUEUE_BLOCKS = 24  # the copy-out queue is modelled per block of forward steps (see memplan)
MAX_OPTIONS = 4  # options kept per kernel front: the program stays small, the extremes stay in
MIP_REL_GAP = 0.005  # HiGHS stops within 0.5% of its bound: the time model is not finer than that
PEAK_REL_GAP = 1e-4  # ... and within 0.01% of it where it minimises the peak (nothing fits the limit)
PROGRAM_REACH = 1.25  # nothing fits: the program is searched where its least peak may be within this of the others'
ROUNDS = 6  # solve-simulate rounds at most
STALL_TOLERANCE = 0.01  # a plan stalling more than this share of its step is solved again with fewer copies
_PREFER_KEEP_MS = 1e-6  # per MB offloaded: among equally fast plans, copy less


@dataclass(frozen=True, slots=True)
class OptimalResult:
    plan: MemoryPlan
    objective_ms: float  # the program's model of the step time for its answer
    mip_gap: float  # HiGHS: relative distance between its answer and its proved bound
    model_gap: float  # simulated step / objective - 1: what the program's time model missed
    solve_time_s: float
    rounds: int
    chosen: str = "program"  # program; vdnn when a static vDNN plan simulated faster; or a heuristic's name


def _thin(options: tuple[KernelOption, ...]) -> tuple[KernelOption, ...]:
    if len(options) <= MAX_OPTIONS:
        return options
    picks = {round(i * (len(options) - 1) / (MAX_OPTIONS - 1)) for i in range(MAX_OPTIONS)}
    return tuple(options[i] for i in sorted(picks))


def _tables(graph: TrainingGraph, device: DeviceProfile, costs, fronts):
    steps = graph.steps
    T = len(steps)
    nf = graph.forward_steps
    first_write: dict[str, int] = {}
    last_fwd: dict[str, int] = {}
    bwd_uses: dict[str, list[int]] = {}
    for step in steps:
        for name in step.writes:
            first_write.setdefault(name, step.index)
        for name in (*step.reads, *step.writes):
            if step.phase == "fwd":
                last_fwd[name] = step.index
            elif name in step.reads:
                bwd_uses.setdefault(name, []).append(step.index)
    fixed = [graph.persistent_bytes] * T
    ms = [c.ms for c in costs]

    def add_fixed(lo: int, hi: int, b: int) -> None:
        for r in range(lo, hi + 1):
            fixed[r] += b

    for _, b, start, end in gradient_lives(graph, steps):
        add_fixed(start, end, b)
    tensors = []
    prefetch_at: dict[str, int] = {}
    for s in graph.storages:
        b = graph.bytes_of(s)
        p, f = first_write[s], last_fwd[s]
        uses = bwd_uses.get(s)
        if not uses:
            add_fixed(p, f, b)  # released after its last forward use
            continue
        u, e = uses[0], uses[-1]
        if s in graph.must_keep:  # kept whatever the plan
            add_fixed(p, e, b)
            continue
        rows = {"keep": tuple(range(p, e + 1))}
        cost = {"keep": 0.0}
        # offload: resident through its forward life (the copy-out queue Q_t holds what waits longer),
        # and again from the latest step whose compute before the use covers its copy back
        last_write = max(st.index for st in steps[:nf] if s in st.writes)
        if not device.shares_host_memory:  # there a copy to the host lands in the same memory
            need = QUEUE_FACTOR * device.copy_ms(b, "h2d")
            q, left = u, 0.0
            while q > f + 1 and left < need:
                q -= 1
                left += ms[q]
            prefetch_at[s] = q
            rows["offload"] = tuple(sorted(set(range(p, f + 1)) | set(range(q, e + 1))))
            # the step after its last forward reader waits for the copy out: what the compute from
            # the copy's start to that reader does not hide (the copy alone on its stream)
            hidden_ms = sum(ms[last_write + 1 : f + 1])
            cost["offload"] = max(0.0, device.copy_ms(b, "d2h") - hidden_ms) + _PREFER_KEEP_MS * b / 1e6
        producers = graph.producers(s)
        sources = tuple(
            dict.fromkeys(graph.storage_of(i) for op in producers for i in op.inputs if graph.storage_of(i) != s)
        )
        # rebuilt from resident sources only: a released source would have to be rebuilt too
        if producers[0].type != "input" and all(src in bwd_uses for src in sources):
            rows["recompute"] = tuple(sorted(set(range(p, f + 1)) | set(range(u, e + 1))))
            cost["recompute"] = sum(ms[graph.op_index[op.name]] + graph.replay_host_ms for op in producers)
        tensors.append(memplan.Tensor(s, b, rows, cost, sources, copy_row=last_write))
    kernels = []
    thinned = {}
    for (layer, kind), options in fronts.items():
        opts = _thin(options)
        thinned[(layer, kind)] = opts
        row = next(st.index for st in steps if st.op == layer and kind in st.kernels)
        kernels.append(
            memplan.Kernel(f"{layer}\t{kind}", row, tuple(o.time_ms for o in opts), tuple(o.memory for o in opts))
        )
    fwd_ms = sum(ms[:nf])
    bwd_ms = sum(ms[nf:])
    budget = min(fwd_ms * device.d2h_gbps, bwd_ms * device.h2d_gbps) * 1e6  # bytes (GB/s x ms = MB)
    # the steps that run no conv kernel take the same time whatever is chosen
    constant_ms = sum(c.ms for c, st in zip(costs, steps) if not st.kernels)
    # the copy-out queue in blocks of forward rows: what the stream drains while each block runs (bytes)
    size = max(1, -(-nf // QUEUE_BLOCKS))
    block = [r // size for r in range(nf)]
    drain = [0.0] * (block[-1] + 1)
    for r in range(nf):
        drain[block[r]] += ms[r] * device.d2h_gbps * 1e6
    return tensors, kernels, fixed, thinned, budget, constant_ms, prefetch_at, (drain, block)


def _triggers(graph: TrainingGraph, actions: dict[str, str], prefetch_at: dict[str, int]) -> dict[str, int]:
    """The program's prefetch rows as positions in the simulator's expanded schedule (recomputation
    inserts steps)."""
    from ucudnn.memory.simulate import expand

    position: dict[int, int] = {}
    first_read: dict[
        str, int
    ] = {}  # each storage's first read after the forward pass: a rebuild reading it may come before its row
    for i, st in enumerate(expand(graph, actions)):
        if st.phase != "recompute":
            position.setdefault(st.step, i)
        if i >= graph.forward_steps:
            for r in st.reads:
                first_read.setdefault(r, i)
    rows = {s: position[prefetch_at[s]] for s, a in actions.items() if a == "offload"}
    return {s: min(row, first_read.get(s, row)) for s, row in rows.items()}


def search(
    graph: TrainingGraph,
    device: DeviceProfile,
    memory_limit: int,
    *,
    devices: int = 1,
    db=None,
    fronts=None,
    time_limit_s: float = 4.0,
    cache: PlanCache | None = None,
) -> OptimalResult:
    """The optimal policy's plan and the program's figures (see the module docstring). `cache`: what plans of
    the same graph and profile at other limits simulated (`ucudnn.memory.reuse`), used and added to."""
    cache = PlanCache() if cache is None else cache
    fronts = cache.fronts(graph, device, db, fronts)
    base = baseline(graph, device, fronts, cache=cache)
    # everything kept with the fastest workspaces is the fastest step there is: where it fits, it is the plan
    keep, fast = actions_for(graph, "none"), {k: fastest(v).workspace for k, v in fronts.items()}
    costs = cache.costs(graph, device, fast, fronts)
    kept = cache.simulate(graph, device, costs, keep, memory_limit=memory_limit, prefetch="adaptive", devices=devices)
    if kept.fits:
        p = to_plan(graph, device, memory_limit, "optimal", keep, fast, kept, devices=devices, base=base)
        return OptimalResult(p, kept.step_ms, 0.0, 0.0, 0.0, 0, "vdnn")
    # the program's tables depend on no limit: made once for the plans at every limit
    key = (cache.ident(graph), device, cache.ident(fronts))
    tensors, kernels, fixed, thinned, budget, constant_ms, prefetch_at, drain = cache.memo(
        "optimal tables", key, lambda: _tables(graph, device, base.costs, fronts)
    )
    tables = (tensors, kernels, fixed, drain)
    # the least peak the program's model allows, as its linear relaxation bounds it (within 1% of the 0-1 answer on
    # the models benchmarked, at a fraction of its cost): a limit below it is out of the program's reach unsearched
    bound = cache.memo("optimal peak bound", key, lambda: _peak_bound(tables, budget))
    out_of_reach = bound > memory_limit
    statics = _statics(graph, device, fronts, memory_limit, devices, cache)
    if out_of_reach:
        # nothing the program chooses fits: the smallest plan wins. The program offloads no more than its copies can
        # hide behind compute, so a static plan or a heuristic's, offloading more, is often far smaller than any of
        # its choices; it is searched only where its bound comes within PROGRAM_REACH of the smallest of theirs
        others = [r.peak_bytes for _, _, r in statics]
        others += [p.peak_bytes for p in _heuristic_plans(graph, device, memory_limit, devices, fronts, cache)]
        searched = bound <= PROGRAM_REACH * min(others)
        if not searched:
            log.info("optimal: nothing fits; the program's least peak (%d bytes at least) is not searched", bound)
    else:
        searched = True
    target = memory_limit
    best = None
    last = None
    solve_s = 0.0
    rounds = 0
    least = None  # where no choice fits the limit: the program's choices of least peak
    for rounds in range(1, ROUNDS + 1 if searched else 1):
        try:
            if out_of_reach:
                raise Infeasible(f"{memory_limit} bytes is below the least peak the program allows, {bound} bytes")
            sol = _solve(tables, target, budget, time_limit_s=max(1.0, time_limit_s - solve_s), mip_rel_gap=MIP_REL_GAP)
        except Infeasible as exc:  # proved infeasible, or HiGHS found no answer in its time
            log.info("optimal: round %d: %s", rounds, exc)
            if rounds > 1 or least is not None:
                break
            # nothing fits: the least peak the program allows, then the fastest choices within it; the same at every
            # limit below it, so solved once
            found = cache.memo(
                "optimal least peak", key, functools.partial(_least_peak, tables, budget, time_limit_s - solve_s)
            )
            if found is None:
                break
            least, sol, target = found
            solve_s += least.solve_time_s
            log.info("optimal: nothing fits %d bytes; the program's least peak is %d bytes", memory_limit, target)
        solve_s += sol.solve_time_s
        workspace = {}
        for k in kernels:
            layer, kind = k.name.split("\t")
            workspace[(layer, kind)] = thinned[(layer, kind)][sol.options[k.name]].workspace
        costs = cache.costs(graph, device, workspace, fronts)
        result = cache.simulate(
            graph,
            device,
            costs,
            sol.actions,
            memory_limit=memory_limit,
            prefetch=_triggers(graph, sol.actions, prefetch_at),
            devices=devices,
        )
        sol = memplan.Solution(
            sol.actions, sol.options, sol.objective_ms + constant_ms, sol.mip_gap, sol.solve_time_s, sol.status
        )
        last = (sol, workspace, result)
        log.info(
            "optimal: round %d at %d bytes: peak %d, step %.1f ms (model %.1f), stall %.1f, fits %s",
            rounds,
            target,
            result.peak_bytes,
            result.step_ms,
            sol.objective_ms,
            result.stall_ms,
            result.fits,
        )
        if _better(result, best[2] if best else None):
            best = last
        overflow = result.peak_bytes - memory_limit
        stalled = result.stall_ms > STALL_TOLERANCE * result.step_ms
        if (result.fits and not stalled) or least is not None:  # (no choice within a lower peak)
            break
        if not result.fits:
            target -= max(overflow, memory_limit // 100)
        if stalled:
            budget *= 0.7
        if target <= 0:
            break
    # vDNN's static plans are candidates too: the program's memory model is conservative (whole-block
    # copy queues), so where a plain plan fits and runs faster in simulation, it is the better answer
    static = None
    for candidate in statics:
        if static is None or _better(candidate[2], static[2]):
            static = candidate
    assert static is not None  # (statics is never empty)
    if best is None or _better(static[2], best[2]):
        actions, workspace, result = static
        p = to_plan(graph, device, memory_limit, "optimal", actions, workspace, result, devices=devices, base=base)
        objective = last[0].objective_ms if last else float("nan")
        found = OptimalResult(
            p,
            objective,
            last[0].mip_gap if last else float("nan"),
            result.step_ms / objective - 1 if last else float("nan"),
            solve_s,
            rounds,
            "vdnn",
        )
    else:
        sol, workspace, result = best
        p = to_plan(graph, device, memory_limit, "optimal", sol.actions, workspace, result, devices=devices, base=base)
        found = OptimalResult(
            p, sol.objective_ms, sol.mip_gap, result.step_ms / sol.objective_ms - 1, solve_s, rounds, "program"
        )
    return _against_heuristics(found, graph, device, memory_limit, devices=devices, fronts=fronts, cache=cache)


def _solve(tables, memory_limit: int, copy_budget_bytes: float, **options) -> memplan.Solution:
    """`memplan.solve` on the program's `tables` (as `search` holds them), under `copy_budget_bytes`."""
    tensors, kernels, fixed, drain = tables
    return memplan.solve(
        tensors,
        kernels,
        fixed,
        memory_limit,
        copy_budget_bytes=copy_budget_bytes,
        drain_bytes=drain[0],
        queue_block=drain[1],
        **options,
    )


def _peak_bound(tables, budget: float) -> int:
    """A lower bound of the least peak the program allows: its linear relaxation's (0 where HiGHS finds none)."""
    try:
        relaxed = _solve(tables, 2**62, budget, minimise_peak=True, relaxed=True)
    except Infeasible:
        return 0
    assert relaxed.peak_bytes is not None  # minimise_peak: the least peak is the answer
    return math.floor(relaxed.peak_bytes * (1 - 1e-6))  # (HiGHS meets its rows to a tolerance)


def _least_peak(tables, budget: float, time_limit_s: float):
    """The program's choices of least peak, the fastest choices within that peak (a hair above: HiGHS meets its
    rows to a tolerance; the least-peak choices where it finds none in time) and that peak; None where HiGHS finds
    no least peak."""
    try:
        least = _solve(
            tables, 2**62, budget, time_limit_s=max(1.0, time_limit_s), mip_rel_gap=PEAK_REL_GAP, minimise_peak=True
        )
    except Infeasible as exc:
        log.info("optimal: the least peak: %s", exc)
        return None
    assert least.peak_bytes is not None
    target = math.ceil(least.peak_bytes * (1 + PEAK_REL_GAP / 10)) + 1
    try:
        within = _solve(
            tables, target, budget, time_limit_s=max(1.0, time_limit_s - least.solve_time_s), mip_rel_gap=MIP_REL_GAP
        )
    except Infeasible as exc:
        log.info("optimal: the fastest at the least peak: %s", exc)
        within = least
    return least, within, target


def _statics(graph: TrainingGraph, device: DeviceProfile, fronts, memory_limit: int, devices: int, cache: PlanCache):
    """vDNN's static plans simulated at `memory_limit`: nothing, the conv inputs or everything offloaded with the
    fastest workspaces, and everything with the smallest (a CPU: nothing offloaded, fastest or smallest), each as
    (actions, workspace, simulation)."""
    fast = {k: fastest(v).workspace for k, v in fronts.items()}
    small = {k: v[0].workspace for k, v in fronts.items()}
    modes = [("none", fast), ("none", small)]
    if not device.shares_host_memory:
        modes = [("none", fast), ("conv", fast), ("all", fast), ("all", small)]
    found = []
    for mode, workspace in modes:
        actions = actions_for(graph, mode)
        costs = cache.costs(graph, device, workspace, fronts)
        found.append(
            (
                actions,
                workspace,
                cache.simulate(
                    graph, device, costs, actions, memory_limit=memory_limit, prefetch="adaptive", devices=devices
                ),
            )
        )
    return found


def _heuristic_plans(
    graph: TrainingGraph, device: DeviceProfile, memory_limit: int, devices: int, fronts, cache: PlanCache
) -> list[MemoryPlan]:
    """Every other policy's plan (`ucudnn.memory.planner.POLICIES`) at `memory_limit`, made once per `cache`."""
    from ucudnn.memory.planner import POLICIES, make_plan

    return [
        make_plan(graph, device, memory_limit, name, devices=devices, fronts=fronts, cache=cache)
        for name in POLICIES
        if name != "optimal"
    ]


def _better(result, other) -> bool:
    """Whether simulated `result` is a better answer than `other` (None: none yet): it fits where `other` does
    not; both fit and it is faster; neither fits and its peak is smaller (the closest to the limit)."""
    if other is None:
        return True
    if result.fits != other.fits:
        return result.fits
    if result.fits:
        return result.step_ms < other.step_ms
    return (result.peak_bytes, result.step_ms) < (other.peak_bytes, other.step_ms)


def _against_heuristics(
    found: OptimalResult,
    graph: TrainingGraph,
    device: DeviceProfile,
    memory_limit: int,
    *,
    devices: int,
    fronts,
    cache: PlanCache,
) -> OptimalResult:
    """`found`, or the fastest fitting plan of a heuristic policy when that one is faster (or `found` does
    not fit): the program's time and copy-queue models are conservative, so a heuristic's simulated plan
    can beat it, and `optimal` must never be beaten by a policy on the same graph, profile and limit.
    Where nothing fits, the plan with the smallest peak: the closest any policy comes. The heuristics' plans come
    from `cache` where a plan at this limit made them, and their simulations where a plan at another did."""
    best = found.plan
    for p in _heuristic_plans(graph, device, memory_limit, devices, fronts, cache):
        if _better(p, best):
            best = p
    if best is found.plan:
        return found
    why = "faster than" if best.fits else "nothing fits; a smaller peak than"
    log.info("optimal: %s's plan: %s the program's", best.policy, why)
    plan = dataclasses.replace(best, policy="optimal", search=f"{best.policy}'s plan, {why} the program's")
    return dataclasses.replace(found, plan=plan, model_gap=plan.step_ms / found.objective_ms - 1, chosen=best.policy)


def plan(
    graph: TrainingGraph,
    device: DeviceProfile,
    memory_limit: int,
    *,
    devices: int = 1,
    db=None,
    fronts=None,
    time_limit_s: float = 4.0,
    cache: PlanCache | None = None,
) -> MemoryPlan:
    """The `optimal` policy (see the module docstring)."""
    found = search(
        graph, device, memory_limit, devices=devices, db=db, fronts=fronts, time_limit_s=time_limit_s, cache=cache
    )
    return found.plan
