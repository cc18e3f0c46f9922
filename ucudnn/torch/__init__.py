"""PyTorch integration: `Conv1d`, `Conv2d`, `Conv3d`, `ConvTranspose1d`, `ConvTranspose2d`, `ConvTranspose3d`
(drop-ins for torch's), `convert(model)` and `announce`;
memory plans in training: `plan_memory(model, example_input, ...)` (`plan_frontier` at several limits) and
`execute_plan(model, plan)`, on a training step captured as PyTorch runs it (`capture`), or compiled:
``torch.compile(with_plan(model, plan))``.

Five rooms, each importing only the ones before it: `converting` (the drop-ins, `convert`, their kernels
as operators), `capturing` (one training step recorded), `running` (`execute_plan`: offload, prefetch,
recompute), `planning` (`plan_memory`) and `checking` (`StepTracker`, `check_plan`). Beside them: `zoo`
(torchvision-shaped models written by hand) and `distributed` (data-parallel training on uneven batches).
This package imports torch; ``import ucudnn`` does not import it.
"""

from ucudnn.torch import zoo
from ucudnn.torch.capturing.capture import capture
from ucudnn.torch.checking.check import PlanCheck, check_plan
from ucudnn.torch.checking.tracker import StepTracker
from ucudnn.torch.converting.conv import (
    Conv1d,
    Conv2d,
    Conv3d,
    ConvTranspose1d,
    ConvTranspose2d,
    ConvTranspose3d,
    announce,
    convert,
)
from ucudnn.torch.planning.frontier import plan_frontier
from ucudnn.torch.planning.planner import measure_profile, plan_memory
from ucudnn.torch.running.compiled import PlannedModule, with_plan
from ucudnn.torch.running.executor import ExecutionStats, execute_plan

__all__ = [
    "Conv1d",
    "Conv2d",
    "Conv3d",
    "ConvTranspose1d",
    "ConvTranspose2d",
    "ConvTranspose3d",
    "ExecutionStats",
    "PlanCheck",
    "PlannedModule",
    "StepTracker",
    "announce",
    "capture",
    "check_plan",
    "convert",
    "execute_plan",
    "measure_profile",
    "plan_frontier",
    "plan_memory",
    "with_plan",
    "zoo",
]
