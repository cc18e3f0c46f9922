"""A plan checked against a real step: predicted peak, step time and bytes moved beside what one step does.

    plan = ucudnn.torch.plan_memory(model, x, memory_limit="2GiB", policy="checkpoint")
    check = ucudnn.torch.check_plan(model, plan, x, y)
    print(check.peak_bytes / check.predicted_peak_bytes)

`check_plan` runs training steps (forward and backward; no optimizer step) under `execute_plan`:

1. ``warmup`` steps untracked: the first prepares the (model, plan) pair (its trace and check) and
   takes the executor's host buffers, as a training loop's first step does. (The workspace a converted
   conv's handle kept from steps outside a plan is given back by every planned step: `execute_plan`.)
2. One step under a `ucudnn.torch.checking.tracker.StepTracker`: the peak of the device's live storages
   (weights, weight gradients, feature maps, gradients, workspaces), the host copies apart, and
   memory over the step. Weight gradients are freed between steps, as `zero_grad()` does by default
   (zeroed, a layer's new gradient and its zeroed one would be held at once while autograd adds
   them: 151 MB more for AlexNet's fc6); `plan_memory`'s plans count each from its first backward
   write, as the step makes it. The input batch counts as the plan's input feature map does, the
   target (labels) as the plan holds it: all through the step.
3. ``steps`` timed steps, untracked (the tracker's dispatch costs time): their median is the step time.

Bytes moved are the copies between device and host: offloaded bytes out and the same back, as the
simulator counts them (`predicted_bytes_moved` is its bytes offloaded plus prefetched).

The model is left as it was: parameters' gradients and buffers (batch-norm statistics) are put back.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ucudnn.errors import InvalidInput
from ucudnn.memory.plan import MemoryPlan
from ucudnn.torch.capturing.model_call import batched_call, default_loss
from ucudnn.torch.checking.tracker import StepTracker, TrackerReport
from ucudnn.torch.running.executor import execute_plan
from ucudnn.torch.running.prepared_plan import _prepared

__all__ = ["PlanCheck", "check_network", "check_plan"]


@dataclass(frozen=True, slots=True)
class PlanCheck:
    """A plan's predictions beside one real step's figures (bytes, ms)."""

    policy: str
    device: str  # where the step ran
    predicted_peak_bytes: int
    peak_bytes: int  # counted by the tracker: every device category
    predicted_step_ms: float
    step_ms: float  # median of the timed steps
    step_ms_samples: tuple[float, ...]
    predicted_bytes_moved: int
    bytes_moved: int  # offloaded bytes out and back
    host_peak_bytes: int  # the executor's host copies at their highest
    tracker: TrackerReport
    plan: MemoryPlan  # the plan checked

    @property
    def peak_ratio(self) -> float:
        """Achieved peak / predicted peak."""
        return self.peak_bytes / self.predicted_peak_bytes if self.predicted_peak_bytes else float("nan")

    @property
    def step_ratio(self) -> float:
        """Achieved step time / predicted step time."""
        return self.step_ms / self.predicted_step_ms if self.predicted_step_ms else float("nan")

    def to_json(self) -> dict:
        return {
            "policy": self.policy,
            "device": self.device,
            "plan_device": self.plan.device if self.plan else None,
            "memory_limit": self.plan.memory_limit if self.plan else None,
            "fits": self.plan.fits if self.plan else None,
            "predicted": {
                "peak_bytes": self.predicted_peak_bytes,
                "step_ms": self.predicted_step_ms,
                "bytes_moved": self.predicted_bytes_moved,
            },
            "achieved": {
                "peak_bytes": self.peak_bytes,
                "step_ms": self.step_ms,
                "bytes_moved": self.bytes_moved,
                "host_peak_bytes": self.host_peak_bytes,
                "step_ms_samples": list(self.step_ms_samples),
                "peak_by_category": self.tracker.peak_by_category,
            },
            "peak_ratio": self.peak_ratio,
            "step_ratio": self.step_ratio,
        }


def _predicted_moved(plan: MemoryPlan) -> int:
    sim = plan.simulation
    if sim is not None:
        return int(sim.devices[0].bytes_offloaded + sim.devices[0].bytes_prefetched)
    return 2 * plan.bytes_offloaded  # a plan read from JSON carries no simulation: each copy out comes back


def _sync(device: torch.device) -> None:
    if device.type == "cuda":  # pragma: no cover - needs a GPU
        torch.cuda.synchronize(device)  # timing a step: the host waits for the device on purpose


def check_plan(
    model: nn.Module,
    plan: MemoryPlan,
    example_input: Any,
    target: torch.Tensor | None = None,
    *,
    loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
    loss: Callable[[Any], torch.Tensor] | None = None,
    warmup: int = 1,
    steps: int = 3,
) -> PlanCheck:
    """Run `model` on `example_input` (a tensor, a tuple of positional arguments or a dict of keyword
    arguments) under `plan` and compare with the plan's predictions (see the module docstring). The loss
    is `loss_fn(output, target)` where given, else `loss(output)` (as `plan_memory` takes it), else
    cross-entropy against `target` where given, else `ucudnn.torch.capturing.model_call.default_loss`."""
    if not isinstance(model, nn.Module):
        raise InvalidInput(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(plan, MemoryPlan):
        raise InvalidInput(f"plan must be a ucudnn.memory.MemoryPlan, got {type(plan).__name__}")
    args, kwargs, inputs = batched_call(example_input)
    for name, value, least in (("warmup", warmup, 1), ("steps", steps, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise InvalidInput(f"{name} must be an integer of at least {least}, got {value!r}")
    if loss_fn is not None:
        compute = lambda out: loss_fn(out, target)
    elif loss is not None:
        compute = loss
    elif target is not None:
        compute = lambda out: nn.functional.cross_entropy(out, target)
    else:
        compute = default_loss
    device = inputs[0].device
    params = list(model.parameters())
    grads = [p.grad for p in params]
    buffers = [b.detach().clone() for b in model.buffers()]

    def step() -> Any:
        for p in params:  # freed, as zero_grad() does by default: autograd then takes each new
            p.grad = None  # gradient as it is, where adding it into a zeroed one would hold both at once
        with execute_plan(model, plan) as stats:
            compute(model(*args, **kwargs)).backward()
        return stats

    try:
        for _ in range(warmup):
            step()
        tracker = StepTracker(model, device=device)
        with tracker:
            for t in [*inputs, *([target] if isinstance(target, torch.Tensor) else [])]:
                tracker.track(t, "tensor")  # the labels too: a plan holds what its loss reads all through the step
            for _, pool in _prepared(model, plan).copies.values():
                for host in pool.held():  # taken by the warm-up, back in the pool: the step takes them again
                    tracker.track(host, "host")
            stats = step()
        report = tracker.report()
        samples = []
        for _ in range(steps):
            _sync(device)
            start = time.perf_counter()
            step()
            _sync(device)
            samples.append((time.perf_counter() - start) * 1e3)
    finally:
        with torch.no_grad():
            for p, g in zip(params, grads):
                p.grad = g
            for b, old in zip(model.buffers(), buffers):
                b.copy_(old)
    return PlanCheck(
        plan.policy,
        str(device),
        plan.peak_bytes,
        report.peak_bytes,
        plan.step_ms,
        statistics.median(samples),
        tuple(samples),
        _predicted_moved(plan),
        2 * stats.bytes_offloaded,
        report.host_peak_bytes,
        report,
        plan,
    )


def check_network(
    network: str,
    batch: int,
    *,
    memory_limit: int | None = None,
    policy: str = "optimal",
    device: str | None = None,
    steps: int = 3,
) -> PlanCheck:
    """`check_plan` for zoo network `network`: built in PyTorch (`ucudnn.torch.checking.graph_model.model_of`), planned for
    this machine (`plan_memory` with the example input on `device`: "cuda" where a GPU is at hand,
    else the CPU) and run, with random inputs and labels."""
    from ucudnn.memory.graph import from_network
    from ucudnn.torch.checking.graph_model import model_of
    from ucudnn.torch.planning.planner import plan_memory

    graph = from_network(network, batch)
    where = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    torch.manual_seed(0)
    model = model_of(graph).to(where)
    x = torch.randn(*graph.ops[0].shape, device=where)
    loss = next(op for op in graph.ops if op.type == "loss")
    y = torch.randint(0, graph.op(loss.inputs[0]).shape[-1], (batch,), device=where)
    plan = plan_memory(
        model, x, memory_limit=memory_limit, policy=policy, loss=lambda out: nn.functional.cross_entropy(out, y)
    )
    return check_plan(model, plan, x, y, steps=steps)
