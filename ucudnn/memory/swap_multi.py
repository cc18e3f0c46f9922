"""Kim et al., multi-GPU swapping: GPUs on one PCIe switch take turns, prefetches start when measured times say.

Data-parallel GPUs run the same layers at the same moments, so under vDNN they all copy at once and
share their switch's link (each gets 1/N of it). Kim et al. (section III.A):

1. group the GPUs by PCIe switch (`devices_per_link` of the profile, or given);
2. with a swappable layers and b to swap, set the interval x = a / b;
3. within a group, GPU i swaps layers i % x + j x (0 <= j < b): neighbours swap different layers,
   so fewer GPUs copy at any moment.

"Layers" are the storages vDNN_all would offload (every map the backward pass reads but the loss's
input), in forward order. b is the smallest count for which every GPU fits the limit (a bisection;
b = a is vDNN_all on every GPU). Then the swap-in trigger (section III.C), each GPU its own (the
paper tunes it while training runs, on each GPU's own swap operations): each prefetch starts right
before its use (Step 1), and, from the compute and transfer times that GPU measured in the simulated
step (its transfers slowed by whatever else shares its link), is moved earlier until the compute
left before the use covers the transfer (Step 3), as long as the step still fits (Step 2); vDNN's
one-layer trigger stays when no round beats it. The paper searches from the other end (the earliest
triggers that fit, then later while the step does not slow down): both aim at the latest trigger
that hides its transfer, but ours stops every GPU's search at the first move that does not fit.

The plan's `tensors` are GPU 0's actions and its `device_tensors` every GPU's; its figures are the
slowest or largest GPU's (the paper measures throughput, and data-parallel GPUs wait for the slowest
every step). `stagger=False` gives the comparison, every GPU swapping the same layers at once (the
layers GPU `as_gpu` swaps when staggered).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from ucudnn.devices import DeviceProfile
from ucudnn.errors import InvalidInput
from ucudnn.memory.graph import TrainingGraph
from ucudnn.memory.plan import MemoryPlan
from ucudnn.memory.planner import baseline, to_plan
from ucudnn.memory.reuse import PlanCache
from ucudnn.memory.simulate import SimResult, StepCost
from ucudnn.memory.timing import fastest
from ucudnn.memory.vdnn import actions_for

__all__ = ["adapt_triggers", "device_actions", "plan", "staggered_layers", "swappable"]

# Step 3 repeats "measure, then move the late triggers one layer earlier"; the bound keeps the
# search to a few seconds on the largest zoo networks.
MAX_TRIGGER_ROUNDS = 40


def staggered_layers(gpu: int, layers: int, swapped: int) -> tuple[int, ...]:
    """Section III.A, step 3: the layer indices GPU `gpu` (its index within its switch group) swaps."""
    for name, value in (("gpu", gpu), ("layers", layers), ("swapped", swapped)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise InvalidInput(f"{name} must be a non-negative integer, got {value!r}")
    if swapped > layers:
        raise InvalidInput(f"swapped ({swapped}) cannot exceed layers ({layers})")
    if swapped == 0:
        return ()
    x = layers // swapped  # the interval x = a / b (floor: the b layers stay inside 0..a-1)
    return tuple(gpu % x + j * x for j in range(swapped))


def swappable(graph: TrainingGraph) -> tuple[str, ...]:
    """The storages vDNN_all offloads, in forward order: the "layers" that can be swapped."""
    return tuple(s for s, a in actions_for(graph, "all").items() if a == "offload")


def device_actions(
    graph: TrainingGraph, swapped: int, devices: int, devices_per_link: int, *, stagger: bool = True, as_gpu: int = 0
) -> list[dict[str, str]]:
    """Each GPU's actions when each swaps `swapped` layers: staggered within its switch group, or
    (`stagger=False`) every GPU the layers GPU `as_gpu` of a group swaps when staggered."""
    layers = swappable(graph)
    base = actions_for(graph, "none")
    out = []
    for d in range(devices):
        picks = staggered_layers(d % devices_per_link if stagger else as_gpu, len(layers), swapped)
        out.append(dict(base, **{layers[k]: "offload" for k in picks}))
    return out


def _late_prefetches(
    graph: TrainingGraph,
    actions: Sequence[Mapping[str, str]],
    result: SimResult,
) -> list[dict[str, tuple[float, int]]]:
    """Per device, its prefetches that ended after the step before their use: storage -> (the
    transfer's measured time in ms, its use step)."""
    compute: dict[tuple[int, str], float] = {}  # (device, "phase op") -> end
    h2d: dict[tuple[int, str], tuple[float, float]] = {}
    for i in result.timeline:
        if i.stream == "compute":
            compute[(i.device, i.label)] = i.end_ms
        elif i.stream == "h2d":
            h2d[(i.device, i.label)] = (i.start_ms, i.end_ms)
    out: list[dict[str, tuple[float, int]]] = []
    for d, acts in enumerate(actions):
        late = {}
        for s, a in acts.items():
            if a != "offload" or (d, s) not in h2d:
                continue
            use = graph.consumers(s, "bwd")[0]
            before = graph.steps[use - 1]
            start, end = h2d[(d, s)]
            if end > compute[(d, f"{before.phase} {before.op}")] + 1e-6:
                late[s] = (end - start, use)
        out.append(late)
    return out


def adapt_triggers(
    graph: TrainingGraph,
    device: DeviceProfile,
    costs: Sequence[StepCost],
    actions: Sequence[Mapping[str, str]],
    memory_limit: int,
    devices_per_link: int,
    cache: PlanCache | None = None,
) -> tuple[list[dict[str, int]] | str, SimResult]:
    """Section III.C: prefetch triggers from measured compute and transfer times, within the limit.

    Each GPU sets its own triggers from its own measured transfers (a GPU alone on its switch is not
    slowed by the others' copies). Returns the triggers (per device, storage -> schedule step; or
    ``"layer"`` when vDNN's one-layer trigger was not beaten) and their simulation: the fastest that
    fits of those tried."""
    cache = PlanCache() if cache is None else cache
    # Step 1: right before use
    triggers = [{s: graph.consumers(s, "bwd")[0] - 1 for s, a in acts.items() if a == "offload"} for acts in actions]

    def run(trig):
        return cache.simulate(
            graph,
            device,
            costs,
            list(actions),
            memory_limit=memory_limit,
            prefetch=trig,
            devices=len(actions),
            devices_per_link=devices_per_link,
        )

    result = run(triggers)
    best: tuple[list[dict[str, int]] | str, SimResult] = ("layer", run("layer"))  # vDNN's trigger, to beat
    if (result.fits, -result.step_ms) > (best[1].fits, -best[1].step_ms):
        best = (triggers, result)
    if not result.fits:
        # Step 2 moves a trigger only while the step fits: prefetching earlier than right before use holds more
        return best
    ms = [c.ms for c in costs]
    for _ in range(MAX_TRIGGER_ROUNDS):
        moved = [dict(t) for t in triggers]
        for d, late in enumerate(_late_prefetches(graph, actions, result)):
            for s, (transfer_ms, use) in late.items():
                # Step 3: the latest trigger whose compute before the use covers the measured transfer,
                # approached one layer per round (Step 2's incremental search: each move changes which
                # copies share the link, so the transfer is measured again before moving further)
                k, covered = use - 1, 0.0
                while k > graph.forward_steps - 1 and covered < transfer_ms:
                    covered += ms[k]
                    k -= 1
                if k < triggers[d][s]:
                    moved[d][s] = triggers[d][s] - 1
        if moved == triggers:
            break
        trial = run(moved)
        if not trial.fits:
            break  # Step 2: earlier prefetches no longer fit: keep the last triggers that did
        triggers, result = moved, trial
        if (result.fits, -result.step_ms) > (best[1].fits, -best[1].step_ms):
            best = (triggers, result)
    return best


def plan(
    graph: TrainingGraph,
    device: DeviceProfile,
    memory_limit: int,
    *,
    devices: int = 1,
    db=None,
    fronts=None,
    devices_per_link: int | None = None,
    stagger: bool = True,
    cache: PlanCache | None = None,
) -> MemoryPlan:
    """Kim et al.'s plan for `devices` GPUs of `device`, `devices_per_link` to a switch; see the module docstring."""
    per_link = device.devices_per_link if devices_per_link is None else devices_per_link
    if isinstance(per_link, bool) or not isinstance(per_link, int) or per_link < 1:
        raise InvalidInput(f"devices_per_link must be a positive integer, got {per_link!r}")
    cache = PlanCache() if cache is None else cache
    fronts = cache.fronts(graph, device, db, fronts)
    workspace = {k: fastest(opts).workspace for k, opts in fronts.items()}
    costs = cache.costs(graph, device, workspace, fronts)
    base = baseline(graph, device, fronts, cache=cache)
    layers = len(swappable(graph))

    def attempt(b: int):
        actions = device_actions(graph, b, devices, per_link, stagger=stagger)
        return actions, cache.simulate(
            graph,
            device,
            costs,
            actions,
            memory_limit=memory_limit,
            prefetch="layer",
            devices=devices,
            devices_per_link=per_link,
            timeline=False,
        )

    # the smallest b that fits, by bisection on b (0 swaps nothing; b = a is vDNN_all everywhere)
    lo, hi = 0, layers
    if not attempt(hi)[1].fits:
        lo = hi
    elif attempt(0)[1].fits:
        hi = 0
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if attempt(mid)[1].fits:
            hi = mid
        else:
            lo = mid
    actions, _ = attempt(hi)
    _, result = adapt_triggers(graph, device, costs, actions, memory_limit, per_link, cache)
    return to_plan(
        graph,
        device,
        memory_limit,
        "swap-multi",
        actions[0],
        workspace,
        result,
        devices=devices,
        base=base,
        device_actions=actions,
    )
