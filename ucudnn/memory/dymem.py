"""Dymem (Yang & Cheng, HPDC 2020): dependency-aware offload and prefetch for fork/join networks.

Against vDNN, on the same simulator:

- **Execution order** (Algorithm 1): the ops run in `dymem_order.dfs_order`, each branch of a fork
  followed to its join. The zoo's graphs are already in that order; a captured PyTorch step keeps
  the order PyTorch ran it in.
- **No barrier** in the forward pass: a step does not wait for the offload of its input (the
  simulator only waits for an offload when memory is short, as Dymem does).
- **Prefetch look-ahead** (Algorithm 2): at each backward step the offloaded maps that the coming
  steps read are prefetched, up to the second convolution ahead, instead of one layer ahead.
- **What to offload**, as vDNN_dyn orders it: nothing when everything fits; else the inputs of
  convolutions; else every map the backward pass reads (the loss's input excepted); with the
  fastest algorithms first, then the memory-optimal ones; look-ahead 2, then 1 when the
  prefetched maps do not fit. The fastest plan that fits wins; where the least of them (every map offloaded,
  the memory-optimal algorithms, look-ahead 1) does not fit, nothing else is tried: the plan is it or the same
  with the fastest algorithms, the one closer to the limit.

`allocation_trace` turns a plan into the allocator's requests in step order, each with its GTBM
mobility, for `ucudnn.memory.gtbm` to replay on a best-fit and a GTBM pool.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from ucudnn.devices import DeviceProfile
from ucudnn.errors import InvalidInput
from ucudnn.memory import dymem_order
from ucudnn.memory.gradients import gradient_lives
from ucudnn.memory.graph import TrainingGraph
from ucudnn.memory.gtbm import Alloc, Event, Free
from ucudnn.memory.plan import MemoryPlan
from ucudnn.memory.planner import baseline, to_plan
from ucudnn.memory.reuse import PlanCache
from ucudnn.memory.simulate import StepCost
from ucudnn.memory.timing import fastest
from ucudnn.memory.vdnn import actions_for

__all__ = ["allocation_trace", "dfs_graph", "plan", "prefetch_schedule"]


def dfs_graph(graph: TrainingGraph) -> TrainingGraph:
    """`graph` with its ops in Algorithm 1's order; unchanged when that order would move a reader
    of a map after an op that overwrites the map in place (the original order is then kept), and for a
    captured step (the order is the one PyTorch runs: an executor cannot run another)."""
    if graph.captured is not None:
        return graph
    successors: dict[str, list[str]] = {op.name: [] for op in graph.ops}
    for op in graph.ops:
        for i in dict.fromkeys(op.inputs):
            successors[i].append(op.name)
    order = dymem_order.dfs_order(successors)
    position = {name: k for k, name in enumerate(order)}
    for op in graph.ops:
        if op.inplace:
            target = op.inputs[0]
            if any(position[r] > position[op.name] for r in successors[target] if r != op.name):
                return graph
    if order == [op.name for op in graph.ops]:
        return graph
    return dataclasses.replace(graph, ops=tuple(graph.op(name) for name in order))


def prefetch_schedule(
    graph: TrainingGraph, actions: Mapping[str, str], *, conv_lookahead: int = dymem_order.CONV_LOOKAHEAD
) -> dict[str, int]:
    """Algorithm 2's prefetch trigger of each offloaded storage, as a step index of the simulator's
    schedule (no recomputation: the graph's own steps)."""
    nf = graph.forward_steps
    backward = [(graph.op(s.op).type, s.reads) for s in graph.steps[nf:]]
    offloaded = {s for s, a in actions.items() if a == "offload"}
    starts = dymem_order.prefetch_starts(backward, offloaded, conv_lookahead=conv_lookahead)
    return {s: nf + k for s, k in starts.items()}


def plan(
    graph: TrainingGraph,
    device: DeviceProfile,
    memory_limit: int,
    *,
    devices: int = 1,
    db=None,
    fronts=None,
    conv_lookahead: int = dymem_order.CONV_LOOKAHEAD,
    cache: PlanCache | None = None,
) -> MemoryPlan:
    """Dymem's plan for `graph` within `memory_limit`; see the module docstring."""
    cache = PlanCache() if cache is None else cache
    graph = cache.memo("dfs order", (cache.ident(graph),), lambda: dfs_graph(graph))
    fronts = cache.fronts(graph, device, db, fronts)
    fast = {k: fastest(opts).workspace for k, opts in fronts.items()}
    small = {k: opts[0].workspace for k, opts in fronts.items()}
    base = baseline(graph, device, fronts, cache=cache)

    def run(workspace, mode: str, lookahead: int):
        actions = actions_for(graph, mode)
        prefetch = prefetch_schedule(graph, actions, conv_lookahead=lookahead)
        costs = cache.costs(graph, device, workspace, fronts)
        result = cache.simulate(
            graph, device, costs, actions, memory_limit=memory_limit, prefetch=prefetch, devices=devices
        )
        return actions, workspace, result

    if not run(fast, "none", conv_lookahead)[2].fits:
        # the least Dymem holds: every map offloaded, one convolution ahead, the smallest workspaces; where that does
        # not fit, no plan of Dymem's does, and the plan is the closer to the limit of it and the same with the
        # fastest workspaces (then the faster)
        least = [run(small, "all", 1), run(fast, "all", 1)]
        if not least[0][2].fits:
            actions, workspace, result = min(least, key=lambda t: (t[2].peak_bytes, t[2].step_ms))
            return to_plan(graph, device, memory_limit, "dymem", actions, workspace, result, devices=devices, base=base)
    tried = []
    for workspace in (fast, small):
        for mode in ("none", "conv", "all"):
            for lookahead in sorted({conv_lookahead, 1}, reverse=True) if mode != "none" else (conv_lookahead,):
                tried.append(run(workspace, mode, lookahead))  # (nothing offloaded: no look-ahead to vary)
        if any(r.fits for _, _, r in tried):
            break  # the memory-optimal algorithms are only for when the fastest cannot fit
    fitting = [t for t in tried if t[2].fits]
    actions, workspace, result = (
        min(fitting, key=lambda t: t[2].step_ms) if fitting else min(tried, key=lambda t: t[2].peak_bytes)
    )
    return to_plan(graph, device, memory_limit, "dymem", actions, workspace, result, devices=devices, base=base)


def allocation_trace(
    graph: TrainingGraph,
    actions: Mapping[str, str],
    costs: tuple[StepCost, ...],
    prefetch: Mapping[str, int] | None = None,
) -> list[Event]:
    """The allocator's requests over one step of `graph` under `actions` (keep, offload, release),
    in step order: what a step writes is allocated at its start, with its workspace; a tensor is
    freed after its last reader (an offloaded map after its last forward reader, as if its copy
    were done) and an offloaded map is allocated again at its prefetch trigger (`prefetch`, as
    `prefetch_schedule` gives it). Weights (and weight gradients held the whole step) are left out.

    Mobility (Algorithm 3, stated by lifetime): a request freed by the end of the step after its
    last writer is *movable*; one that lives longer (a fork's input, a branch output waiting for its join,
    a map kept for the backward pass) is *temporary*; classifier and loss outputs and their
    gradients are *reclaimed*. Only in-place writers (a ReLU after its conv, in either pass) continue
    a tensor's write.
    Gradient buffers live as `ucudnn.memory.gradients` says: one summed from several branches (a
    fork's, in the backward pass) waits for its last branch, so it is temporary from its first write.
    """
    steps = graph.steps
    nf = graph.forward_steps
    acts = {s: actions.get(s, "keep") for s in graph.storages}
    if any(a == "recompute" for a in acts.values()):
        raise InvalidInput("allocation_trace: actions must be keep, offload or release (no recompute)")
    prefetch = dict(prefetch or {})
    lives: list[tuple[str, int, int, int]] = []  # (name, bytes, alloc step, free-after step)
    first_write: dict[str, int] = {}
    last_write: dict[str, int] = {}  # the last of the first write and the in-place writes after it
    last_use: dict[str, int] = {}
    last_fwd_use: dict[str, int] = {}
    first_bwd_use: dict[str, int] = {}
    for s in steps:
        op = graph.op(s.op)
        inplace = graph.storage_of(op.inputs[0]) if op.inplace else None
        for name in s.writes:
            if name not in first_write:
                first_write[name] = last_write[name] = s.index
            elif name in (inplace, f"grad:{inplace}"):
                last_write[name] = s.index
        for name in (*s.reads, *s.writes):
            last_use[name] = s.index
            if s.index < nf:
                last_fwd_use[name] = s.index
        if s.index >= nf:
            for name in s.reads:
                first_bwd_use.setdefault(name, s.index)
    lives += gradient_lives(graph, steps)
    for name, k in first_write.items():
        if name.startswith(("wgrad:", "grad:")):
            continue
        nbytes = graph.bytes_of(name)
        action = acts.get(name, "keep")
        if action == "keep":
            lives.append((name, nbytes, k, last_use[name]))
        else:
            lives.append((name, nbytes, k, last_fwd_use[name]))
            if action == "offload" and name in first_bwd_use:
                use = first_bwd_use[name]
                lives.append((f"{name}@prefetch", nbytes, min(prefetch.get(name, use - 1), use), last_use[name]))
    for s, c in zip(steps, costs):
        if c.workspace:
            lives.append((f"workspace:{s.index}", c.workspace, s.index, s.index))
    reclaimed = {op.name for op in graph.ops if op.type in dymem_order.RECLAIMED_KINDS}

    def mobility(name: str, start: int, end: int) -> str:
        base_name = name.split("@")[0].split("#")[0].removeprefix("grad:")
        if base_name in reclaimed or (acts.get(name) == "keep" and end >= nf):
            return "reclaimed"
        # in-place writers (a ReLU after its conv) extend the write, not the wait for a reader
        written = max(start, last_write.get(name, start))
        return "movable" if end <= written + 1 else "temporary"

    events: list[tuple[int, int, Event]] = []
    for name, nbytes, start, end in lives:
        events.append((start, 0, Alloc(name, nbytes, mobility(name, start, end))))
        events.append((end, 1, Free(name)))
    events.sort(key=lambda e: (e[0], e[1]))
    return [e for _, _, e in events]
