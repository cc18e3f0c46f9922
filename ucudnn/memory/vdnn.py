"""vDNN (Rhu et al., MICRO 2016): offload feature maps to host memory during forward, prefetch them for backward.

- ``all``: every feature map the backward pass reads is offloaded after its last forward use
  (vDNN_all), except the loss's input (the backward pass starts there at once).
- ``conv``: only the inputs of convolutions are offloaded (vDNN_conv); the rest stay resident.
- ``dyn``: vDNN_dyn's search. Everything resident with the fastest algorithms when that fits; else,
  when even offloading everything with memory-optimal algorithms (the smallest workspace) does not
  fit, that plan (it fails); else vDNN_conv then vDNN_all with the fastest algorithms; else,
  offloading everything, conv kernels are moved to their memory-optimal algorithm one layer at a
  time, the largest workspace first, until the step fits.

A feature map the backward pass does not read is released after its last forward use in every mode.
Prefetches follow vDNN: a feature map comes back when the backward step of the conv or linear layer
before its use starts (`simulate`'s ``prefetch="layer"``). `algorithms` chooses the static modes'
conv algorithms: ``fastest`` (vDNN's performance-optimal) or ``memory`` (memory-optimal).
"""

from __future__ import annotations

from ucudnn.devices import DeviceProfile
from ucudnn.errors import InvalidInput
from ucudnn.memory.graph import TrainingGraph
from ucudnn.memory.plan import MemoryPlan
from ucudnn.memory.planner import baseline, to_plan
from ucudnn.memory.simulate import simulate
from ucudnn.memory.timing import conv_fronts, fastest, step_costs

__all__ = ["actions_for", "plan"]

MODES = ("all", "conv", "dyn")


def actions_for(graph: TrainingGraph, mode: str) -> dict[str, str]:
    """vDNN's static decision: offload (all or conv inputs), release what backward never reads, keep the rest."""
    backward = {r for s in graph.steps if s.phase == "bwd" for r in s.reads}
    conv_inputs = {graph.storage_of(op.inputs[0]) for op in graph.conv_ops}
    loss_inputs = {graph.storage_of(i) for op in graph.ops if op.type == "loss" for i in op.inputs}
    actions = {}
    for s in graph.storages:
        if s not in backward:
            actions[s] = "release"
        elif s in loss_inputs or mode == "none":
            actions[s] = "keep"
        elif mode == "all" or s in conv_inputs:
            actions[s] = "offload"
        else:
            actions[s] = "keep"
    return actions


def plan(graph: TrainingGraph, device: DeviceProfile, memory_limit: int, *, devices: int = 1, db=None,
         mode: str = "dyn", algorithms: str = "fastest") -> MemoryPlan:
    """vDNN's plan in `mode` (all, conv, dyn); see the module docstring."""
    if mode not in MODES:
        raise InvalidInput(f"vDNN mode must be one of {', '.join(MODES)}, got {mode!r}")
    if algorithms not in ("fastest", "memory"):
        raise InvalidInput(f"algorithms must be 'fastest' or 'memory', got {algorithms!r}")
    fronts = conv_fronts(graph, device, db=db)
    fast = {k: fastest(opts).workspace for k, opts in fronts.items()}
    small = {k: opts[0].workspace for k, opts in fronts.items()}
    base = baseline(graph, device, fronts)
    policy = f"vdnn-{mode}"

    def run(actions: dict[str, str], workspace: dict[tuple[str, str], int]):
        costs = step_costs(graph, device, workspace=workspace, fronts=fronts)
        result = simulate(graph, device, costs, actions, memory_limit=memory_limit, devices=devices)
        return result

    def done(actions, workspace, result) -> MemoryPlan:
        return to_plan(graph, device, memory_limit, policy, actions, workspace, result, devices=devices, base=base)

    if mode != "dyn":
        workspace = fast if algorithms == "fastest" else small
        actions = actions_for(graph, mode)
        return done(actions, workspace, run(actions, workspace))

    # vDNN_dyn: the cheapest static plans first, then trade algorithms for memory layer by layer
    for m in ("none", "conv", "all"):
        actions = actions_for(graph, m)
        result = run(actions, fast)
        if result.fits:
            return done(actions, fast, result)
        if m == "none":
            floor = actions_for(graph, "all")
            floor_result = run(floor, small)
            if not floor_result.fits:
                return done(floor, small, floor_result)
    actions = actions_for(graph, "all")
    workspace = dict(fast)
    layers = sorted({layer for layer, _ in fronts},
                    key=lambda layer: -max(fast[k] for k in fronts if k[0] == layer))
    for layer in layers:
        for key in fronts:
            if key[0] == layer:
                workspace[key] = small[key]
        result = run(actions, workspace)
        if result.fits:
            return done(actions, workspace, result)
    return done(actions, workspace, run(actions, workspace))
