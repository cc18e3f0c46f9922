"""What planning one graph on one device profile computes again and again, computed once: `PlanCache`.

A plan at one limit runs every policy's search (`optimal` compares itself with all of them) and each search
simulates many candidate steps; plans at other limits of the same graph and profile (a frontier, the lowered
limits of `make_executed_plan`, a bisection for the smallest limit that fits) simulate most of them again.
`PlanCache.simulate` runs a simulation once and answers the same question again from it wherever the answer
is the same: at the same limit, or at any limit under which each allocation would wait, or go ahead, as it did
(`ucudnn.memory.simulate.Bounded`: a step that copies nothing runs alike under every limit). `PlanCache.memo`
holds what depends on no limit (the baseline, the steps' costs under one choice of workspaces) and the plans of
one policy at one limit.

A cache is explicit: a caller makes one per graph and profile it plans for (`ucudnn.memory.planner.frontier`,
`ucudnn.torch.plan_memory` beside its captured step) and passes it down; without one every call computes
afresh. Objects that are keyed by identity (the graph, the caller's fronts) are held by the cache, so that no
other object takes their identity while it lives. It is bounded: least recently used entries go first.
"""

from __future__ import annotations

import os
from collections import Counter, OrderedDict
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

from ucudnn.devices import DeviceProfile
from ucudnn.memory.graph import TrainingGraph
from ucudnn.memory.simulate import Bounded, SimResult, StepCost, simulate_bounded
from ucudnn.memory.timing import conv_fronts, step_costs

__all__ = ["PlanCache"]

T = TypeVar("T")

# simulations kept (a ResNet-152 step's holds about a megabyte), and at most so many per question (one run for each
# range of limits that no other run holds for)
MAX_SIMULATIONS = 192
MAX_RUNS = 8
MAX_VALUES = 512  # baselines, costs and plans kept


def _frozen(value: Any) -> Any:
    """A hashable key of a simulation argument: a mapping by its items, a sequence of them element by element."""
    if isinstance(value, Mapping):
        return tuple(sorted(value.items()))
    if isinstance(value, Sequence) and not isinstance(value, str):
        return tuple(_frozen(v) for v in value)
    return value


def _offloads(actions: Any) -> bool:
    if isinstance(actions, Mapping):
        return "offload" in actions.values()
    if isinstance(actions, Sequence) and not isinstance(actions, str):
        return any(_offloads(a) for a in actions)
    return False


class PlanCache:
    """Simulations and values reused across the plans of one graph and profile (see the module docstring).
    `counts`: simulations run (``simulated``) and answered from the cache (``reused``), values made and reused
    by kind (``made:<kind>``, ``reused:<kind>``), for a caller to see what was reused."""

    def __init__(self, max_simulations: int = MAX_SIMULATIONS, max_values: int = MAX_VALUES) -> None:
        self.max_simulations, self.max_values = max_simulations, max_values
        self._simulations: OrderedDict[tuple, list[tuple[Bounded, bool]]] = OrderedDict()  # (run, its timeline)
        self._stored = 0  # runs held in `_simulations`
        self._values: OrderedDict[tuple, Any] = OrderedDict()
        self._held: dict[int, Any] = {}
        self._fronts_made: set[int | None] = set()
        self.counts: Counter[str] = Counter()

    def ident(self, obj: Any) -> int | None:
        """`obj`'s identity as a key (None for None), `obj` held while the cache lives."""
        if obj is None:
            return None
        self._held.setdefault(id(obj), obj)
        return id(obj)

    def memo(self, kind: str, key: tuple, make: Callable[[], T]) -> T:
        """The value of `kind` for `key` (hashable; objects by `ident`), made by `make()` where not held."""
        full = (kind, *key)
        if full in self._values:
            self._values.move_to_end(full)
            self.counts[f"reused:{kind}"] += 1
            return self._values[full]
        value = make()
        self.counts[f"made:{kind}"] += 1
        self._values[full] = value
        if len(self._values) > self.max_values:
            self._values.popitem(last=False)
        return value

    def simulate(
        self,
        graph: TrainingGraph,
        device: DeviceProfile,
        costs: Sequence[StepCost],
        actions: Mapping[str, str] | Sequence[Mapping[str, str]] | None = None,
        *,
        memory_limit: int | None = None,
        prefetch="layer",
        devices: int = 1,
        devices_per_link: int | None = None,
        timeline: bool = True,
    ) -> SimResult:
        """`ucudnn.memory.simulate.simulate`, answered from an earlier run where that holds for `memory_limit`."""
        # where nothing is offloaded, no copy comes back: the triggers change nothing
        trigger = _frozen(prefetch) if _offloads(actions) else None
        key = (self.ident(graph), device, tuple(costs), _frozen(actions), trigger, devices, devices_per_link)
        runs = self._simulations.setdefault(key, [])
        self._simulations.move_to_end(key)
        for run, traced in runs:
            if run.holds_for(memory_limit) and (traced or not timeline):
                self.counts["reused"] += 1
                return run.at(memory_limit)
        run = simulate_bounded(
            graph,
            device,
            costs,
            actions,
            memory_limit=memory_limit,
            prefetch=prefetch,
            devices=devices,
            devices_per_link=devices_per_link,
            timeline=timeline,
        )
        self.counts["simulated"] += 1
        runs.append((run, timeline))
        self._stored += 1
        if len(runs) > MAX_RUNS:
            runs.pop(0)
            self._stored -= 1
        while self._stored > self.max_simulations:  # the least recently asked questions go first
            _, dropped = self._simulations.popitem(last=False)
            self._stored -= len(dropped)
        return run.result

    def fronts(self, graph: TrainingGraph, device: DeviceProfile, db=None, given=None) -> dict:
        """`ucudnn.memory.timing.conv_fronts`, once per graph, profile, cache and given fronts (fronts this made are
        given back as they are: a policy passes its own on to another)."""
        if given is not None and id(given) in self._fronts_made:
            return given
        db_key = db if db is None or isinstance(db, (str, os.PathLike)) else self.ident(db)
        key = (self.ident(graph), device, db_key, self.ident(given))
        made = self.memo("fronts", key, lambda: conv_fronts(graph, device, db=db, given=given))
        self._fronts_made.add(self.ident(made))
        return made

    def costs(self, graph: TrainingGraph, device: DeviceProfile, workspace=None, fronts=None) -> tuple[StepCost, ...]:
        """`ucudnn.memory.timing.step_costs`, once per graph, profile, workspaces and fronts."""
        key = (self.ident(graph), device, _frozen(workspace), self.ident(fronts))
        return self.memo("costs", key, lambda: step_costs(graph, device, workspace=workspace, fronts=fronts))
