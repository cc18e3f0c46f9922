"""Memory planning: where each feature map lives during a training step, and what workspace each conv gets.

`plan` holds the plan format shared by the planner and the PyTorch executor (`ucudnn.torch.memory`).
"""

from ucudnn.memory.plan import ACTIONS, ConvWorkspace, MemoryPlan, TensorAction

__all__ = ["ACTIONS", "ConvWorkspace", "MemoryPlan", "TensorAction"]
