"""`plan_frontier(model, example_input, memory_limits, ...)`: `plan_memory` at several limits in one pass.

The step is captured once (and, planning for this machine, its operations timed and its kernels' options read
once); planned from the capture itself, every plan of it shares one `ucudnn.memory.reuse.PlanCache`, so the
heuristics that `optimal` compares itself with are computed once and each simulation that holds at another limit
is not run again: three limits cost little more than one (``benchmarks/memory/bench_planning_scale.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import nn

from ucudnn.errors import InvalidInput
from ucudnn.memory.plan import MemoryPlan
from ucudnn.sizes import parse_size
from ucudnn.torch.planning.planner import plan_memory

__all__ = ["plan_frontier"]


def plan_frontier(
    model: nn.Module, example_input: Any, memory_limits: Sequence[int | str], policy: str = "optimal", **options: Any
) -> list[MemoryPlan]:
    """`plan_memory(model, example_input, limit, policy, **options)` for each of `memory_limits` (bytes or sizes
    such as ``"2GiB"``), in their order; `options` are `plan_memory`'s (``device``, ``loss``, ``db``, ...)."""
    if isinstance(memory_limits, (str, bytes)) or not isinstance(memory_limits, Sequence) or not memory_limits:
        raise InvalidInput(f"memory_limits must be a non-empty list of limits, got {memory_limits!r}")
    limits = []
    for i, limit in enumerate(memory_limits):  # all refused before anything is captured
        try:
            limits.append(parse_size(limit))
        except InvalidInput as exc:
            raise InvalidInput(f"memory_limits[{i}]: {exc}") from None
        if limits[-1] <= 0:
            raise InvalidInput(f"memory_limits[{i}] must be a positive number of bytes, got {limit!r}")
    return [plan_memory(model, example_input, limit, policy, **options) for limit in limits]
