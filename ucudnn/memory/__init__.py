"""Memory planning: where each feature map lives during a training step, and what workspace each conv gets.

- `graph`: the training graph (`from_network(name, batch)` for the zoo; a PyTorch model's comes from
  its captured training step, `ucudnn.torch.capture(model, example_input).graph`).
- `timing`: each step's time and workspace (measured conv configurations, else a roofline).
- `simulate`: the event simulator every policy goes through (its docstring says how a policy drives it).
- `planner`: `make_plan(graph, device, memory_limit, policy, *, devices=1, db=None) -> MemoryPlan`; `frontier`
  at several limits in one pass, sharing a `reuse.PlanCache` (what plans of one graph and profile compute once).
- `plan`: the plan format shared by the planner and the PyTorch executor (`ucudnn.torch.running.executor`).
"""

from ucudnn.memory.plan import ACTIONS, ConvWorkspace, MemoryPlan, TensorAction
from ucudnn.memory.planner import POLICIES, available_policies, frontier, make_plan

__all__ = [
    "ACTIONS",
    "POLICIES",
    "ConvWorkspace",
    "MemoryPlan",
    "TensorAction",
    "available_policies",
    "frontier",
    "make_plan",
]
