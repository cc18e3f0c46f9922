"""vDNN (Rhu et al., MICRO 2016): offload feature maps to host memory during forward, prefetch them for backward.

- ``all``: every feature map the backward pass reads is offloaded after its last forward use
  (vDNN_all), except the loss's input (the backward pass starts there at once).
- ``conv``: only the inputs of convolutions are offloaded (vDNN_conv); the rest stay resident.
- ``dyn``: vDNN_dyn's profiling passes (the paper's section 3.3), each pass one simulated step:
  (1) vDNN_all with every conv kernel at its memory-optimal option (the smallest workspace): when
  that does not fit, nothing will, and that plan is the answer (it fails); (2) the fastest options
  with nothing offloaded, then vDNN_conv, then vDNN_all; (3) a greedy pass, with vDNN_conv then with
  vDNN_all: every conv layer whose workspace overflows the limit where it runs is downgraded, one
  option of its front at a time, toward the memory-optimal one, until it fits there (the others
  keep their fastest option), and the step is simulated again until it fits or no overflowing
  layer can give up more workspace; (4) when both greedy passes fail, pass (1)'s plan. The plan's
  `search` names the pass it came from (`SEARCH_PASSES`).

A feature map the backward pass does not read is released after its last forward use in every mode.
Prefetches follow vDNN: a feature map comes back when the backward step of the conv or linear layer
before its use starts (`simulate`'s ``prefetch="layer"``). `algorithms` chooses the static modes'
conv algorithms: ``fastest`` (vDNN's performance-optimal) or ``memory`` (memory-optimal).

On a device whose memory is the host's (`DeviceProfile.shares_host_memory`: a CPU), a copy "to
the host" lands in the same memory and saves nothing, so every mode keeps its feature maps and only
the workspaces can give: the fastest options when they fit, else pass (3)'s greedy downgrade, else
the memory-optimal options; `search` says `NO_OFFLOAD` and what was done.
"""

from __future__ import annotations

from ucudnn.devices import DeviceProfile
from ucudnn.errors import InvalidInput
from ucudnn.memory.graph import TrainingGraph
from ucudnn.memory.plan import MemoryPlan
from ucudnn.memory.planner import baseline, to_plan
from ucudnn.memory.reuse import PlanCache
from ucudnn.memory.timing import fastest

__all__ = ["SEARCH_PASSES", "actions_for", "overflowing_kernels", "plan"]

MODES = ("all", "conv", "dyn")
# vDNN_dyn's passes, as a plan's `search` names them: pass (1) (also the fallback), (2), (3)
SEARCH_PASSES = ("all-memory-optimal", "none", "conv", "all", "greedy-conv", "greedy-all")
NO_OFFLOAD = "no offload (device memory is host memory)"


def actions_for(graph: TrainingGraph, mode: str) -> dict[str, str]:
    """vDNN's static decision: offload (all or conv inputs), release what backward never reads, keep the rest."""
    backward = {r for s in graph.steps if s.phase == "bwd" for r in s.reads}
    conv_inputs = {graph.storage_of(op.inputs[0]) for op in graph.conv_ops}
    actions = {}
    for s in graph.storages:
        if s not in backward:
            actions[s] = "release"
        elif s in graph.must_keep or mode == "none":
            actions[s] = "keep"
        elif mode == "all" or s in conv_inputs:
            actions[s] = "offload"
        else:
            actions[s] = "keep"
    return actions


def plan(
    graph: TrainingGraph,
    device: DeviceProfile,
    memory_limit: int,
    *,
    devices: int = 1,
    db=None,
    fronts=None,
    mode: str = "dyn",
    algorithms: str = "fastest",
    cache: PlanCache | None = None,
) -> MemoryPlan:
    """vDNN's plan in `mode` (all, conv, dyn); see the module docstring."""
    if mode not in MODES:
        raise InvalidInput(f"vDNN mode must be one of {', '.join(MODES)}, got {mode!r}")
    if algorithms not in ("fastest", "memory"):
        raise InvalidInput(f"algorithms must be 'fastest' or 'memory', got {algorithms!r}")
    cache = PlanCache() if cache is None else cache
    fronts = cache.fronts(graph, device, db, fronts)
    fast = {k: fastest(opts).workspace for k, opts in fronts.items()}
    small = {k: opts[0].workspace for k, opts in fronts.items()}
    base = baseline(graph, device, fronts, cache=cache)
    policy = f"vdnn-{mode}"

    def run(actions: dict[str, str], workspace: dict[tuple[str, str], int]):
        costs = cache.costs(graph, device, workspace, fronts)
        return costs, cache.simulate(graph, device, costs, actions, memory_limit=memory_limit, devices=devices)

    def done(actions, workspace, result, search: str = "") -> MemoryPlan:
        return to_plan(
            graph, device, memory_limit, policy, actions, workspace, result, devices=devices, base=base, search=search
        )

    if device.shares_host_memory:
        actions = actions_for(graph, "none")
        start = fast if mode == "dyn" or algorithms == "fastest" else small
        _, result = run(actions, start)
        if result.fits or start is small:
            return done(actions, start, result, NO_OFFLOAD)
        workspace, result = _greedy(graph, fronts, fast, lambda ws, actions=actions: run(actions, ws))
        if result.fits:
            return done(actions, workspace, result, f"{NO_OFFLOAD}; workspaces reduced")
        return done(actions, small, run(actions, small)[1], f"{NO_OFFLOAD}; memory-optimal workspaces")
    if mode != "dyn":
        workspace = fast if algorithms == "fastest" else small
        actions = actions_for(graph, mode)
        return done(actions, workspace, run(actions, workspace)[1])

    floor = (actions_for(graph, "all"), small)  # pass (1)
    _, floor_result = run(*floor)
    if not floor_result.fits:
        return done(*floor, floor_result, "all-memory-optimal")
    for m in ("none", "conv", "all"):  # pass (2)
        actions = actions_for(graph, m)
        _, result = run(actions, fast)
        if result.fits:
            return done(actions, fast, result, m)
    for m in ("conv", "all"):  # pass (3)
        actions = actions_for(graph, m)
        workspace, result = _greedy(graph, fronts, fast, lambda ws, actions=actions: run(actions, ws))
        if result.fits:
            return done(actions, workspace, result, f"greedy-{m}")
    return done(*floor, floor_result, "all-memory-optimal")  # (4): back to pass (1)


def overflowing_kernels(graph: TrainingGraph, costs, result) -> dict[int, int]:
    """The conv steps (index into `graph.steps`) that held their workspace while device 0's memory
    was over the limit, each with the most workspace it could have held there within the limit
    (negative when the step's other tensors alone overflow)."""
    limit = result.memory_limit
    events = result.devices[0].allocations
    used = result.devices[0].memory[-1][1] - sum(delta for _, _, delta in events)  # weights, always held
    # the k-th workspace allocation of op X belongs to the k-th step of X in the schedule that has one
    pending: dict[str, list[int]] = {}
    for s in result.schedule[0]:
        if costs[s.step].workspace:
            pending.setdefault(s.op, []).append(s.step)
    held: tuple[int, int] | None = None  # (step, its workspace): one conv step runs at a time
    room: dict[int, int] = {}
    for _, name, delta in events:
        used += delta
        if name.startswith("workspace:"):
            held = (pending[name.removeprefix("workspace:")].pop(0), delta) if delta > 0 else None
        if held is not None and used > limit:
            step, workspace = held
            room[step] = min(room.get(step, workspace), workspace - (used - limit))
    return room


def _greedy(graph: TrainingGraph, fronts, fast, run):
    """Pass (3): from the fastest options, downgrade each overflowing conv layer one option at a time
    until its workspace fits where it runs; simulate (`run`) again until the step fits or nothing changes."""
    workspace = dict(fast)
    while True:
        costs, result = run(workspace)
        if result.fits:
            return workspace, result
        changed = False
        for step, room in overflowing_kernels(graph, costs, result).items():
            for kind in graph.steps[step].kernels:
                key = (graph.steps[step].op, kind)
                options = fronts[key]
                i = max(k for k, o in enumerate(options) if o.workspace <= workspace[key])
                while i > 0 and options[i].workspace > room:
                    i -= 1  # one option down: slower, less workspace
                if options[i].workspace < workspace[key]:
                    workspace[key] = options[i].workspace
                    changed = True
        if not changed:
            return workspace, result
