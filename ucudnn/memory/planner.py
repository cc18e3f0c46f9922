"""The policies by name, and what every policy shares: the baseline and turning a simulation into a plan.

`make_plan(graph, device, memory_limit, policy, *, devices=1, db=None)` runs one policy. Each policy
is a module with a function ``plan(graph, device, memory_limit, *, devices=1, db=None, **options)``
returning a `MemoryPlan`; `POLICIES` maps a policy's name to its module, function and options.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from ucudnn.devices import DeviceProfile, load_profile
from ucudnn.errors import InvalidInput
from ucudnn.memory.graph import TrainingGraph
from ucudnn.memory.plan import ConvWorkspace, MemoryPlan, TensorAction
from ucudnn.memory.simulate import SimResult, StepCost, network_wide_bytes, simulate

__all__ = [
    "OFFLOADING",
    "POLICIES",
    "Baseline",
    "as_executed",
    "available_policies",
    "baseline",
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
) -> MemoryPlan:
    """The plan `policy` makes for `graph` on `devices` copies of `device` within `memory_limit` bytes each.

    Policies: vdnn-all, vdnn-conv, vdnn-dyn, swap-multi, dymem, checkpoint, optimal; an unknown or
    unavailable one raises `InvalidInput` naming those available. The plan's `fits` says whether the
    simulated memory stayed within the limit. `fronts`: conv kernels' options that the caller
    measured, (layer, kind) -> `KernelOption`s, used before the cache `db` and shipped figures.
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
    plan = fn(graph, profile, memory_limit, devices=devices, db=db, fronts=fronts, **options)
    if fronts:
        plan = _torch_own_marked(plan, fronts)
    return plan if plan.policy == policy else dataclasses.replace(plan, policy=policy)


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


def baseline(graph: TrainingGraph, device: DeviceProfile, fronts=None) -> Baseline:
    """Everything resident with the fastest option of each conv kernel (`fronts`: its options, as
    `ucudnn.memory.timing.conv_fronts` gives them; computed when not given)."""
    from ucudnn.memory.timing import step_costs

    costs = step_costs(graph, device, fronts=fronts)
    result = simulate(graph, device, costs, timeline=False)
    return Baseline(network_wide_bytes(graph, max(c.workspace for c in costs)), result.step_ms, costs)


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


def as_executed(plan: MemoryPlan, graph: TrainingGraph, device: DeviceProfile) -> MemoryPlan:
    """`plan` with the figures of its step as `ucudnn.torch.execute_plan` runs it. A policy times its copies
    back by its own trigger and starts each when memory allows; the executor issues them by its own rule,
    one map ahead of the backward pass, and each holds its memory from its issue, whatever the limit
    (`simulate`'s ``prefetch="ahead"``, without a limit: `fits` is then whether its peak is within the
    plan's). A plan that offloads nothing, or carries no simulation (read from JSON), is returned as it is."""
    sim = plan.simulation
    acts = [{t.name: t.action for t in ts} for ts in plan.device_actions()]
    if sim is None or not sim.costs or not any("offload" in a.values() for a in acts):
        return plan
    result = simulate(graph, device, sim.costs, acts, prefetch="ahead", devices=plan.devices)
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
) -> MemoryPlan:
    """`make_plan` with the figures of its step as `ucudnn.torch.execute_plan` runs it (`as_executed`). Where
    the policy's plan fits by its own timing of the copies back but not as executed, the policy plans again
    within the limit lowered by the overflow (`EXECUTED_ROUNDS` times at most); the first plan that fits as
    executed is returned, else the one of least peak as executed (a limit below every plan: the policy's
    smallest). `optimal` is beaten by no policy as executed either: where its plan does not fit, the fastest
    other policy's that fits is returned, else the least peak of them all."""
    profile = device if isinstance(device, DeviceProfile) else load_profile(device)
    made_plans = []
    target = memory_limit
    for _ in range(EXECUTED_ROUNDS):
        made = make_plan(graph, profile, target, policy, devices=devices, db=db, fronts=fronts)
        plan = as_executed(dataclasses.replace(made, memory_limit=memory_limit), graph, profile)
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
        other = make_executed_plan(graph, profile, memory_limit, name, devices=devices, db=db, fronts=fronts)
        if _closest(other) < _closest(plan):
            why = "faster than" if other.fits else "nothing fits; a smaller peak than"
            plan = dataclasses.replace(other, policy="optimal", search=f"{name}'s plan, {why} optimal's as executed")
    return plan


def _closest(plan: MemoryPlan) -> tuple:
    """A plan's rank among plans for one limit, least first: those that fit by step time, then the others by peak
    (the closest to the limit), each then by step time."""
    return (0, plan.step_ms, 0) if plan.fits else (1, plan.peak_bytes, plan.step_ms)


def smallest_fitting_limit(
    graph: TrainingGraph, device: DeviceProfile, policy: str, *, devices: int = 1, above: int = 0
) -> int:
    """The smallest memory limit at which `policy`'s plan fits, to within 1/256 of it (at least 1 MiB).

    Bisection between `above` (known not to fit) and the peak of the policy's plan without a limit
    (which fits at its own peak), assuming a larger limit never makes a plan stop fitting.
    """
    hi = make_plan(graph, device, 2**62, policy, devices=devices).peak_bytes
    while not make_plan(graph, device, hi, policy, devices=devices).fits:
        hi *= 2  # a policy's own unconstrained peak may still block on copies: give it room
    lo = min(above, hi)
    while hi - lo > max(2**20, hi // 256):
        mid = (lo + hi) // 2
        if make_plan(graph, device, mid, policy, devices=devices).fits:
            hi = mid
        else:
            lo = mid
    return hi
