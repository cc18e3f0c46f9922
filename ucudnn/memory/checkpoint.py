"""Chen et al. (2016), sublinear memory: keep some feature maps, recompute the rest before backward use.

The graph's storages, in forward order, form the chain of `ucudnn.solver.checkpoint`: a storage's
size is its bytes when the backward pass reads it (0 otherwise: it is released anyway) and its
cost is the forward time of the ops that write it. Only *articulation* storages can be checkpoints:
those the forward pass alone carries across a cut (nothing produced before them is read after
them, but what every plan keeps), such as a residual block's output or an inception block's
concatenation. Keeping one there splits the graph into segments that recompute from it alone (Alg. 1
on a fork/join graph). What the program merely holds across a cut (a captured step's
`Captured.holds`: a Python variable) is not read there, so it does not cut the chain.

A kept storage stays resident; every other storage that the backward pass reads, or that a
recomputed op reads, is `recompute`: the simulator rebuilds it, segment by segment, from the nearest
kept storage before its first backward use, each op once (one extra forward pass at most). What no
one reads after the forward pass is released.

`search` picks the checkpoints: ``sqrt`` (every ceil(sqrt m)-th of the m candidates, section 4.3),
``greedy`` (Algorithm 3 with Appendix A's budget grid), ``optimal`` (the exact minimum of equation 1),
``frontier`` (the least recompute on the front of equation 1's peak against recompute that fits a
limit between the smallest peak and keeping everything) or ``auto`` (default):
keeping everything when that fits, else the fastest of all four that fits, else the one with the
smallest simulated peak. Convs run their fastest algorithms.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

from ucudnn.devices import DeviceProfile
from ucudnn.errors import InvalidInput
from ucudnn.memory.graph import TrainingGraph
from ucudnn.memory.plan import MemoryPlan
from ucudnn.memory.planner import baseline, to_plan
from ucudnn.memory.reuse import PlanCache
from ucudnn.memory.simulate import StepCost
from ucudnn.memory.timing import fastest
from ucudnn.solver import checkpoint as chain

__all__ = ["SEARCHES", "actions_for", "articulation_storages", "chain_of", "forward_ms", "plan"]

SEARCHES = ("auto", "sqrt", "greedy", "optimal", "frontier")
# Of the front's sets that equation (1) says fit, at most this many, least recompute first, are simulated
# until one fits: simulating all of a ResNet-152's would cost seconds per plan.
FRONT_SIMULATED = 8


def articulation_storages(graph: TrainingGraph) -> tuple[str, ...]:
    """Storages that alone carry the forward pass across the cut after their last forward writer, besides
    what every plan keeps (the inputs, a second output the loss reads): a segment recomputed from one
    reads nothing else from before it."""
    kept = {op.name for op in graph.ops if op.type == "input"} | graph.must_keep
    storages = graph.storages
    order = {s: k for k, s in enumerate(storages)}
    last_write: dict[str, int] = {}
    last_read: dict[str, int] = {}
    for k, op in enumerate(graph.ops):  # what ops read, not what the program holds (`Captured.holds`)
        last_write[graph.storage_of(op.name)] = k
        for i in op.inputs:
            last_read[graph.storage_of(i)] = k
    out = []
    for s in storages:
        cut = last_write[s]
        crossing = [t for t in storages[: order[s]] if last_read.get(t, -1) > cut and t not in kept]
        if not crossing and graph.op(s).type not in ("input", "loss"):
            out.append(s)
    return tuple(out)


def chain_of(graph: TrainingGraph, costs: Sequence[StepCost]) -> tuple[list[int], list[int], list[float], list[int]]:
    """The storages as Chen's chain, in `graph.storages` order: (sizes dropped, sizes kept, forward costs,
    candidate indices). Dropped, a storage that no backward step reads costs nothing; kept, every
    storage is held (a checkpoint seeds the recomputation after it)."""
    backward = {r for s in graph.steps if s.phase == "bwd" for r in s.reads}
    fwd_ms = {graph.steps[k].op: costs[k].ms for k in range(graph.forward_steps)}
    storages = graph.storages
    sizes = [graph.bytes_of(s) if s in backward else 0 for s in storages]
    forward_costs = [sum(fwd_ms[op.name] + graph.replay_host_ms for op in graph.producers(s)) for s in storages]
    articulation = set(articulation_storages(graph))
    candidates = [k for k, s in enumerate(storages) if s in articulation]
    return sizes, [graph.bytes_of(s) for s in storages], forward_costs, candidates


def actions_for(graph: TrainingGraph, kept: Sequence[str]) -> dict[str, str]:
    """Keep `kept`, the input and what follows the last of `kept`; recompute what backward, or a
    recomputed op, reads; release the rest.

    The last segment stays (as `checkpoint_sequential` runs its last segment): the backward pass
    starts by reading it, so rebuilding it would hold the same memory at that moment and cost its
    forward pass again."""
    backward = {r for s in graph.steps if s.phase == "bwd" for r in s.reads}
    # the inputs, what the loss reads (the backward pass starts there at once) and what the program holds
    keep = set(kept) | {op.name for op in graph.ops if op.type == "input"} | graph.must_keep
    storages = graph.storages
    last = max(
        (k for k, s in enumerate(storages) if s in kept and s not in graph.must_keep and graph.op(s).type != "loss"),
        default=0,
    )
    keep |= set(storages[last + 1 :])
    recompute = {s for s in graph.storages if s in backward and s not in keep}
    # walk back from what is recomputed: the storages its producers read must be rebuilt too
    pending = list(recompute)
    while pending:
        s = pending.pop()
        for op in graph.producers(s):
            for i in op.inputs:
                src = graph.storage_of(i)
                if src != s and src not in keep and src not in recompute:
                    recompute.add(src)
                    pending.append(src)
    return {s: "keep" if s in keep else "recompute" if s in recompute else "release" for s in graph.storages}


def _segmentations(
    sizes: list[int], kept_sizes: list[int], forward_costs: list[float], candidates: list[int], search: str
) -> dict[str, chain.Segmentation]:
    out = {}
    if search in ("sqrt", "auto"):
        picks = chain.sqrt_n(len(candidates)) if candidates else ()
        out["sqrt"] = chain.evaluate(sizes, [candidates[k] for k in picks], forward_costs, kept_sizes)
    if search in ("greedy", "auto"):
        out["greedy"] = chain.budget_search(sizes, forward_costs, candidates=candidates)
    if search in ("optimal", "auto"):
        out["optimal"] = chain.optimal(sizes, forward_costs, candidates=candidates, kept_sizes=kept_sizes)
    return out


def plan(
    graph: TrainingGraph,
    device: DeviceProfile,
    memory_limit: int,
    *,
    devices: int = 1,
    db=None,
    fronts=None,
    search: str = "auto",
    cache: PlanCache | None = None,
) -> MemoryPlan:
    """Chen et al.'s checkpointing plan for `graph` within `memory_limit`; see the module docstring."""
    if search not in SEARCHES:
        raise InvalidInput(f"checkpoint search must be one of {', '.join(SEARCHES)}, got {search!r}")
    cache = PlanCache() if cache is None else cache
    fronts = cache.fronts(graph, device, db, fronts)
    workspace = {k: fastest(opts).workspace for k, opts in fronts.items()}
    costs = cache.costs(graph, device, workspace, fronts)
    base = baseline(graph, device, fronts, cache=cache)
    storages = graph.storages
    sizes, kept_sizes, forward_costs, candidates = cache.memo(
        "checkpoint chain", (cache.ident(graph), cache.ident(costs)), lambda: chain_of(graph, costs)
    )

    def run(actions):
        return cache.simulate(graph, device, costs, actions, memory_limit=memory_limit, devices=devices)

    tried = []
    if search == "auto":
        keep_all = actions_for(graph, storages)
        tried.append((keep_all, run(keep_all)))
        if tried[0][1].fits:
            return to_plan(
                graph, device, memory_limit, "checkpoint", keep_all, workspace, tried[0][1], devices=devices, base=base
            )

    def attempt(seg: chain.Segmentation) -> bool:
        """Simulate keeping `seg`'s checkpoints; whether that fits."""
        actions = actions_for(graph, [storages[k] for k in seg.checkpoints])
        tried.append((actions, run(actions)))
        return tried[-1][1].fits

    # (the segmentations depend on the chain alone, not on the limit: one search for the plans at every limit)
    segmentations = cache.memo(
        "checkpoint segmentations",
        (tuple(sizes), tuple(kept_sizes), tuple(forward_costs), tuple(candidates), search),
        lambda: _segmentations(sizes, kept_sizes, forward_costs, candidates, search),
    )
    for seg in segmentations.values():
        attempt(seg)
    if search in ("frontier", "auto") and candidates:
        # Equation (1) counts the maps backward reads and nothing else (weights, gradients, workspaces):
        # that rest is what the everything-kept simulation peaks at beyond all the maps backward reads.
        everything = tried[0][1] if search == "auto" else run(actions_for(graph, storages))
        rest = everything.peak_bytes - sum(sizes)
        front = _frontier(tuple(sizes), tuple(forward_costs), tuple(candidates), tuple(kept_sizes))  # peak up
        likely = [seg for seg in reversed(front) if seg.peak_bytes + rest <= memory_limit][:FRONT_SIMULATED]
        for seg in likely or front[:1]:
            if attempt(seg):
                break  # the least recompute that fits: the others differ from it by more recompute only
    fitting = [t for t in tried if t[1].fits]
    actions, result = min(fitting, key=lambda t: t[1].step_ms) if fitting else min(tried, key=lambda t: t[1].peak_bytes)
    return to_plan(graph, device, memory_limit, "checkpoint", actions, workspace, result, devices=devices, base=base)


@functools.lru_cache(maxsize=8)
def _frontier(sizes: tuple, forward_costs: tuple, candidates: tuple, kept_sizes: tuple) -> tuple:
    """`chain.frontier`, once per chain: it does not depend on the limit, and plans at several limits (a sweep,
    the optimal policy's comparison with this one) ask for the same chain's."""
    return tuple(chain.frontier(sizes, forward_costs, candidates=candidates, kept_sizes=kept_sizes))


def forward_ms(graph: TrainingGraph, costs: Sequence[StepCost]) -> float:
    """One forward pass: what sqrt(n) checkpointing may add at most."""
    return math.fsum(costs[k].ms for k in range(graph.forward_steps))
