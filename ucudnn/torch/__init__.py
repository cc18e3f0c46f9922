"""PyTorch integration: `Conv1d`, `Conv2d`, `Conv3d`, `ConvTranspose1d`, `ConvTranspose2d`, `ConvTranspose3d`
(drop-ins for torch's), `convert(model)` and `announce`;
memory plans in training: `plan_memory(model, example_input, ...)` and `execute_plan(model, plan)`, on a
training step captured as PyTorch runs it (`capture`).

Submodules: `conv` (the drop-ins and `convert`), `layer` (how a converted layer runs), `ops` (its kernels as
torch.library operators, for torch.compile and torch.export), `launch` (a planned kernel run on torch
tensors), `capturing` (one training step
recorded: forward, loss, backward), `capture_graph` (what it recorded as the planner's graph),
`operations` (ATen operations as a capture reads them), `planning` (`plan_memory`),
`memory` (running a plan in training: `execute_plan`), `offload` (its host copies and saved-tensor
hooks), `recompute` (dropped storages rebuilt), `zoo` (torchvision-shaped models written by hand),
`distributed` (uneven batches), `tracker` (a step's memory counted from live storages), `check` (a
plan's predictions against one real step: `check_plan`), `graph_model` (a training graph as a PyTorch
model). This package imports torch; ``import ucudnn`` does not import it.
"""

from ucudnn.torch.capturing import capture
from ucudnn.torch.conv import (Conv1d, Conv2d, Conv3d, ConvTranspose1d, ConvTranspose2d, ConvTranspose3d, announce,
                               convert)
from ucudnn.torch.memory import ExecutionStats, execute_plan
from ucudnn.torch.planning import measure_profile, plan_memory
from ucudnn.torch import zoo
from ucudnn.torch.check import PlanCheck, check_plan
from ucudnn.torch.tracker import StepTracker

__all__ = ["Conv1d", "Conv2d", "Conv3d", "ConvTranspose1d", "ConvTranspose2d", "ConvTranspose3d", "ExecutionStats",
           "PlanCheck", "StepTracker", "announce", "capture", "check_plan", "convert", "execute_plan",
           "measure_profile", "plan_memory", "zoo"]
