"""The event simulator's values (`ucudnn.memory.simulate`): what it is given per graph step (`StepCost`), the
steps of its expanded schedule (`SimStep`), and what it returns: each stream's activity (`Interval`), each
device's figures (`DeviceResult`), the step's (`SimResult`) and the limits they hold for (`Bounded`)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

__all__ = ["Bounded", "DeviceResult", "Interval", "SimResult", "SimStep", "StepCost"]


@dataclass(frozen=True, slots=True)
class StepCost:
    """The compute time and the workspace of one graph step (index as in `TrainingGraph.steps`)."""

    ms: float
    workspace: int = 0


@dataclass(frozen=True, slots=True)
class SimStep:
    """One step of the expanded schedule: a graph step, or the forward step of an op run again."""

    step: int  # index into TrainingGraph.steps (its cost)
    op: str
    phase: str  # "fwd", "bwd" or "recompute"
    reads: tuple[str, ...]
    writes: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Interval:
    """Activity on one stream: `stream` is compute, recompute, d2h or h2d."""

    device: int
    stream: str
    start_ms: float
    end_ms: float
    label: str


@dataclass(frozen=True, slots=True)
class DeviceResult:
    peak_bytes: int
    average_bytes: int
    step_ms: float
    stall_ms: float
    bytes_offloaded: int
    bytes_prefetched: int
    recompute_ms: float
    overflow: bool  # an allocation went past the memory limit
    missing: tuple[str, ...]  # "step op: tensor" for every read of a tensor not resident (a bad plan)
    memory: tuple[tuple[float, int], ...]  # (time, bytes in use) at every change
    # the allocation trace: (time, tensor, +bytes allocated or -bytes freed), in order; conv
    # workspaces are named "workspace:<op>"; weights (and weight gradients held the whole step) are not in it
    allocations: tuple[tuple[float, str, int], ...] = ()


@dataclass(frozen=True, slots=True)
class SimResult:
    """Each device's result; the figures below are the slowest / largest device's (one device: its own)."""

    memory_limit: int | None
    timeline: tuple[Interval, ...]
    devices: tuple[DeviceResult, ...]
    schedule: tuple[tuple[SimStep, ...], ...]  # each device's expanded schedule
    costs: tuple[StepCost, ...] = ()  # what each graph step cost (to simulate the same step again)

    def _max(self, name: str):
        return max(getattr(d, name) for d in self.devices)

    peak_bytes = property(lambda self: self._max("peak_bytes"))
    average_bytes = property(lambda self: self._max("average_bytes"))
    step_ms = property(lambda self: self._max("step_ms"))
    stall_ms = property(lambda self: self._max("stall_ms"))
    bytes_offloaded = property(lambda self: self._max("bytes_offloaded"))
    bytes_prefetched = property(lambda self: self._max("bytes_prefetched"))
    recompute_ms = property(lambda self: self._max("recompute_ms"))

    @property
    def fits(self) -> bool:
        """Every device stayed within memory_limit."""
        return self.memory_limit is None or not any(d.overflow for d in self.devices)

    @property
    def memory(self) -> tuple[tuple[float, int], ...]:
        """Device 0's memory in use over the step."""
        return self.devices[0].memory


@dataclass(frozen=True, slots=True)
class Bounded:
    """A simulation and the limits it holds for: every limit from `passed` up to (not including) `failed` runs the
    same course (each allocation that waited, or went ahead, would again), so that its result there is `result`
    with each device over the limit where its `tops` (the most it held after an allocation) is."""

    result: SimResult
    passed: int
    failed: float
    tops: tuple[int, ...]

    def holds_for(self, memory_limit: int | None) -> bool:
        if memory_limit is None:
            return self.failed == math.inf
        return self.passed <= memory_limit < self.failed

    def at(self, memory_limit: int | None) -> SimResult:
        """`result` as the simulation at `memory_limit` (one `holds_for`) returns it."""
        r = self.result
        if memory_limit == r.memory_limit:
            return r
        devs = tuple(
            dataclasses.replace(d, overflow=memory_limit is not None and top > memory_limit)
            for d, top in zip(r.devices, self.tops)
        )
        return dataclasses.replace(r, memory_limit=memory_limit, devices=devs)
