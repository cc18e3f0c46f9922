"""The policies by name, and what every policy shares: the baseline and turning a simulation into a plan.

`make_plan(graph, device, memory_limit, policy, *, devices=1, db=None)` runs one policy; `frontier(graph, device,
memory_limits, policy)` plans several limits in one pass (a `ucudnn.memory.reuse.PlanCache` shared). Each policy
is a module with a function ``plan(graph, device, memory_limit, *, devices=1, db=None, fronts=None, cache=None,
**options)`` returning a `MemoryPlan`, which simulates through `cache` (a `PlanCache`: `cache.simulate`,
`cache.costs`, `cache.fronts`); `POLICIES` maps a policy's name to its module, function and options.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import inspect
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from ucudnn.devices import DeviceProfile, load_profile
from ucudnn.errors import InvalidInput
from ucudnn.memory.graph import TrainingGraph
from ucudnn.memory.plan import ConvWorkspace, MemoryPlan, TensorAction
from ucudnn.memory.reuse import PlanCache
from ucudnn.memory.simulate import SimResult, StepCost, network_wide_bytes

__all__ = [
    "OFFLOADING",
    "POLICIES",
    "Baseline",
    "as_executed",
    "available_policies",
    "baseline",
    "frontier",
    "make_executed_plan",
    "make_plan",
    "smallest_fitting_limit",
    "to_plan",
]

# name -> (module, function, keyword options)
POLICIES: dict[str, tuple[str, str, dict]] = {
    "vdnn-all": ("ucudnn.memory.vdnn", "plan", {"mode": "all"}),
    "vdnn-conv": ("ucudnn.memory.vdnn", "plan", {"mode": "conv"}),
    "vdnn-dyn": ("ucudnn.memory.vdnn", "plan", {"mode": "dyn"}),
    "swap-multi": ("ucudnn.memory.swap_multi", "plan", {}),
    "dymem": ("ucudnn.memory.dymem", "plan", {}),
    "checkpoint": ("ucudnn.memory.checkpoint", "plan", {}),
    "optimal": ("ucudnn.memory.optimal", "plan", {}),
}
EXECUTED_ROUNDS = 4  # make_executed_plan: plans made at lowered limits until one fits as executed

# The policies that save memory by offloading alone: on a device that shares the host's memory,
# they plan as vdnn-dyn does there (keep every map, shrink workspaces).
OFFLOADING = ("vdnn-all", "vdnn-conv", "vdnn-dyn", "swap-multi", "dymem")


def _policy_function(name: str):
    module_name, function, options = POLICIES[name]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name == module_name:
            return None
        raise
    fn = getattr(module, function, None)
    return (fn, options) if fn is not None else None


@functools.cache
def _takes_cache(fn) -> bool:
    return "cache" in inspect.signature(fn).parameters


def available_policies() -> list[str]:
    """The policies whose modules are present, in `POLICIES` order."""
    return [name for name in POLICIES if _policy_function(name) is not None]


def _check_limit(memory_limit: int) -> None:
    if isinstance(memory_limit, bool) or not isinstance(memory_limit, int) or memory_limit <= 0:
        raise InvalidInput(f"memory_limit must be a positive number of bytes, got {memory_limit!r}")


def make_plan(
    graph: TrainingGraph,
    device: DeviceProfile | str,
    memory_limit: int,
    policy: str,
    *,
    devices: int = 1,
    db=None,
    fronts=None,
    cache: PlanCache | None = None,
) -> MemoryPlan:
    """The plan `policy` makes for `graph` on `devices` copies of `device` within `memory_limit` bytes each.

    Policies: vdnn-all, vdnn-conv, vdnn-dyn, swap-multi, dymem, checkpoint, optimal; an unknown or
    unavailable one raises `InvalidInput` naming those available. The plan's `fits` says whether the
    simulated memory stayed within the limit. `fronts`: conv kernels' options that the caller
    measured, (layer, kind) -> `KernelOption`s, used before the cache `db` and shipped figures.
    `cache`: what earlier plans of this graph and profile computed (`ucudnn.memory.reuse.PlanCache`): a plan
    made at this limit before is given again, and the simulations of plans at other limits are reused.
    """
    profile = device if isinstance(device, DeviceProfile) else load_profile(device)
    _check_limit(memory_limit)
    if not isinstance(devices, int) or isinstance(devices, bool) or devices < 1:
        raise InvalidInput(f"devices must be a positive integer, got {devices!r}")
    found = _policy_function(policy) if policy in POLICIES else None
    if found is None:
        raise InvalidInput(f"unknown or unavailable policy {policy!r}; available: {', '.join(available_policies())}")
    fn, options = found
    if profile.shares_host_memory and policy in OFFLOADING:
        # offloads would land in the same memory: vDNN's search without them (see ucudnn.memory.vdnn)
        fn, options = _policy_function("vdnn-dyn")
    cache = PlanCache() if cache is None else cache
    own = cache.fronts(graph, profile, db, fronts)

    def made() -> MemoryPlan:
        reused = {"cache": cache} if _takes_cache(fn) else {}  # (a policy written before caches: on its own)
        plan = fn(graph, profile, memory_limit, devices=devices, db=db, fronts=own, **reused, **options)
        if fronts:
            plan = _torch_own_marked(plan, fronts)
        return plan if plan.policy == policy else dataclasses.replace(plan, policy=policy)

    key = (cache.ident(graph), profile, memory_limit, policy, devices, cache.ident(own), bool(fronts))
    return cache.memo("plan", key, made)


def _torch_own_marked(plan: MemoryPlan, fronts) -> MemoryPlan:
    """`plan` with each kernel whose option within its budget holds nothing (`KernelOption.held` 0: torch's own
    convolution, as the fastest option within that budget, as the plan's costs took it) where others hold
    something (a converted layer's own kernels) marked `torch_own`: the budget (torch's measured workspace) could
    hold one of those, which the plan would not count. (A kernel with torch's options alone, a torch layer's,
    is torch's business: a plan made before `convert` gives its kernels no budget of their own.)"""
    from ucudnn.memory.timing import fastest

    def own(c) -> bool:
        front = fronts.get((c.layer, c.kind))
        return front is not None and fastest(front, c.bytes).held == 0 and any(o.held != 0 for o in front)

    marked = tuple(dataclasses.replace(c, torch_own=True) if own(c) else c for c in plan.conv_workspace)
    return dataclasses.replace(plan, conv_workspace=marked) if marked != plan.conv_workspace else plan


@dataclass(frozen=True, slots=True)
class Baseline:
    """Everything resident, the fastest algorithms, unlimited memory."""

    peak_bytes: int  # network-wide allocation, as vDNN's baseline
    step_ms: float
    costs: tuple[StepCost, ...]


def baseline(graph: TrainingGraph, device: DeviceProfile, fronts=None, *, cache: PlanCache | None = None) -> Baseline:
    """Everything resident with the fastest option of each conv kernel (`fronts`: its options, as
    `ucudnn.memory.timing.conv_fronts` gives them; computed when not given), once per `cache`."""
    cache = PlanCache() if cache is None else cache

    def made() -> Baseline:
        costs = cache.costs(graph, device, None, fronts)
        result = cache.simulate(graph, device, costs, timeline=False)
        return Baseline(network_wide_bytes(graph, max(c.workspace for c in costs)), result.step_ms, costs)

    return cache.memo("baseline", (cache.ident(graph), device, cache.ident(fronts)), made)


def to_plan(
    graph: TrainingGraph,
    device: DeviceProfile,
    memory_limit: int,
    policy: str,
    actions: Mapping[str, str],
    workspace: Mapping[tuple[str, str], int],
    result: SimResult,
    *,
    devices: int = 1,
    base: Baseline | None = None,
    search: str = "",
    device_actions: Sequence[Mapping[str, str]] = (),
) -> MemoryPlan:
    """The `MemoryPlan` of one simulated decision: `actions` per storage (keep where absent) and each
    conv kernel's workspace in bytes (what `result`'s costs used); `search`: how the policy found it;
    `device_actions`, one mapping per device with `actions` first, when the devices act differently."""
    base = base or baseline(graph, device)
    # a storage the policy left out is kept, or released when the backward pass never reads it
    backward = {r for st in graph.steps if st.phase == "bwd" for r in st.reads}

    def tensors_of(acts: Mapping[str, str]) -> tuple[TensorAction, ...]:
        return tuple(
            TensorAction(s, graph.bytes_of(s), acts.get(s, "keep" if s in backward else "release"))
            for s in graph.storages
        )

    tensors = tensors_of(actions)
    conv_ws = tuple(ConvWorkspace(layer, kind, int(b)) for (layer, kind), b in workspace.items())
    return MemoryPlan(
        network=graph.network,
        batch=graph.batch,
        device=device.name,
        devices=devices,
        memory_limit=memory_limit,
        policy=policy,
        fits=result.fits and result.peak_bytes <= memory_limit,
        peak_bytes=result.peak_bytes,
        average_bytes=result.average_bytes,
        baseline_peak_bytes=base.peak_bytes,
        step_ms=result.step_ms,
        baseline_step_ms=base.step_ms,
        stall_ms=result.stall_ms,
        bytes_offloaded=result.bytes_offloaded,
        tensors=tensors,
        conv_workspace=conv_ws,
        search=search,
        device_tensors=tuple(tensors_of(acts) for acts in device_actions),
        simulation=result,
    )


def as_executed(
    plan: MemoryPlan, graph: TrainingGraph, device: DeviceProfile, *, cache: PlanCache | None = None
) -> MemoryPlan:
    """`plan` with the figures of its step as `ucudnn.torch.execute_plan` runs it. A policy times its copies
    back by its own trigger and starts each when memory allows; the executor issues them by its own rule,
    one map ahead of the backward pass, and each holds its memory from its issue, whatever the limit
    (`simulate`'s ``prefetch="ahead"``, without a limit: `fits` is then whether its peak is within the
    plan's). A plan that offloads nothing, or carries no simulation (read from JSON), is returned as it is."""
    sim = plan.simulation
    acts = [{t.name: t.action for t in ts} for ts in plan.device_actions()]
    if sim is None or not sim.costs or not any("offload" in a.values() for a in acts):
        return plan
    cache = PlanCache() if cache is None else cache
    result = cache.simulate(graph, device, sim.costs, acts, prefetch="ahead", devices=plan.devices)
    return dataclasses.replace(
        plan,
        fits=result.peak_bytes <= plan.memory_limit,
        peak_bytes=result.peak_bytes,
        average_bytes=result.average_bytes,
        step_ms=result.step_ms,
        stall_ms=result.stall_ms,
        bytes_offloaded=result.bytes_offloaded,
        simulation=result,
    )


def make_executed_plan(
    graph: TrainingGraph,
    device: DeviceProfile | str,
    memory_limit: int,
    policy: str,
    *,
    devices: int = 1,
    db=None,
    fronts=None,
    cache: PlanCache | None = None,
) -> MemoryPlan:
    """`make_plan` with the figures of its step as `ucudnn.torch.execute_plan` runs it (`as_executed`). Where
    the policy's plan fits by its own timing of the copies back but not as executed, the policy plans again
    within the limit lowered by the overflow (`EXECUTED_ROUNDS` times at most); the first plan that fits as
    executed is returned, else the one of least peak as executed (a limit below every plan: the policy's
    smallest). `optimal` is beaten by no policy as executed either: where its plan does not fit, the fastest
    other policy's that fits is returned, else the least peak of them all. `cache`: as `make_plan`'s."""
    profile = device if isinstance(device, DeviceProfile) else load_profile(device)
    cache = PlanCache() if cache is None else cache
    made_plans = []
    target = memory_limit
    for _ in range(EXECUTED_ROUNDS):
        made = make_plan(graph, profile, target, policy, devices=devices, db=db, fronts=fronts, cache=cache)
        plan = as_executed(dataclasses.replace(made, memory_limit=memory_limit), graph, profile, cache=cache)
        made_plans.append(plan)
        if plan.fits or not made.fits:  # fits, or the policy itself does not: a lower limit will not help
            break
        target -= plan.peak_bytes - memory_limit
        if target <= 0:
            break
    if plan.fits:
        return plan
    plan = min(made_plans, key=_closest)
    if policy != "optimal":
        return plan
    for name in POLICIES:
        if name == "optimal":
            continue
        other = make_executed_plan(
            graph, profile, memory_limit, name, devices=devices, db=db, fronts=fronts, cache=cache
        )
        if _closest(other) < _closest(plan):
            why = "faster than" if other.fits else "nothing fits; a smaller peak than"
            plan = dataclasses.replace(other, policy="optimal", search=f"{name}'s plan, {why} optimal's as executed")
    return plan


def _closest(plan: MemoryPlan) -> tuple:
    """A plan's rank among plans for one limit, least first: those that fit by step time, then the others by peak
    (the closest to the limit), each then by step time."""
    return (0, plan.step_ms, 0) if plan.fits else (1, plan.peak_bytes, plan.step_ms)


def smallest_fitting_limit(
    graph: TrainingGraph,
    device: DeviceProfile,
    policy: str,
    *,
    devices: int = 1,
    above: int = 0,
    cache: PlanCache | None = None,
) -> int:
    """The smallest memory limit at which `policy`'s plan fits, to within 1/256 of it (at least 1 MiB).

    Bisection between `above` (known not to fit) and the peak of the policy's plan without a limit
    (which fits at its own peak), assuming a larger limit never makes a plan stop fitting. `cache`: as
    `make_plan`'s (the plans at the limits it tries share their simulations).
    """
    cache = PlanCache() if cache is None else cache
    hi = make_plan(graph, device, 2**62, policy, devices=devices, cache=cache).peak_bytes
    while not make_plan(graph, device, hi, policy, devices=devices, cache=cache).fits:
        hi *= 2  # a policy's own unconstrained peak may still block on copies: give it room
    lo = min(above, hi)
    while hi - lo > max(2**20, hi // 256):
        mid = (lo + hi) // 2
        if make_plan(graph, device, mid, policy, devices=devices, cache=cache).fits:
            hi = mid
        else:
            lo = mid
    return hi


def frontier(
    graph: TrainingGraph,
    device: DeviceProfile | str,
    memory_limits: Sequence[int],
    policy: str,
    *,
    devices: int = 1,
    db=None,
    fronts=None,
    executed: bool = False,
    cache: PlanCache | None = None,
    on_plan: Callable[[MemoryPlan], object] | None = None,
) -> list[MemoryPlan]:
    """`policy`'s plan at each of `memory_limits` (in their order), in one pass: the plans share one `cache`
    (`ucudnn.memory.reuse.PlanCache`: the baseline, the steps' costs, the heuristics' plans and every simulation
    that holds at another limit are computed once), so a few limits cost little more than one. Each plan is
    `make_plan`'s, or `make_executed_plan`'s where `executed`; `on_plan(plan)` is called as each is made."""
    limits = list(memory_limits)
    if not limits:
        raise InvalidInput("memory_limits must name at least one limit, got none")
    for limit in limits:
        _check_limit(limit)
    profile = device if isinstance(device, DeviceProfile) else load_profile(device)
    cache = PlanCache() if cache is None else cache
    make = make_executed_plan if executed else make_plan
    plans = []
    for limit in limits:
        plans.append(make(graph, profile, limit, policy, devices=devices, db=db, fronts=fronts, cache=cache))
        if on_plan is not None:
            on_plan(plans[-1])
    return plans
