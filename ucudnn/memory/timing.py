"""Operation times for the simulator: measured conv configurations where the device has them, else a roofline.

A conv kernel (``fwd``, ``bwd_data``, ``bwd_filter``) has a front of options, time against workspace
(`KernelOption`, ascending workspace and strictly descending time), as the WD solver sees it:

- **measured** (``source="measured"``): the device has measurements of the kernel's problem (the
  H100's are shipped in ``ucudnn/memory/data/h100_convs.json``; a measurement cache given as `db`
  comes first); the front is `ucudnn.solver.pareto.front` over the measured micro-batch sizes, so a batch
  larger than any measured one runs as micro-batches.
- **scaled** (``source="scaled"``): another device, a problem the H100 measured. The H100's front
  keeps its workspaces and its times are multiplied by the ratio of the two devices' roofline
  estimates of the kernel: the trade between algorithms and workspace is the H100's, the speed is the
  device's. An estimate, and named as one.
- **roofline** (``source="roofline"``): one option, `DeviceProfile.roofline_ms` at no workspace.

Other operations take `roofline_ms` of their arithmetic and memory traffic; a backward step counts
twice the forward's. `step_costs` turns a choice of workspace per kernel into each graph step's time
and workspace (`ucudnn.memory.simulate.StepCost`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources

from ucudnn.devices import PROFILES, DeviceProfile
from ucudnn.errors import InvalidInput
from ucudnn.memory.graph import TrainingGraph
from ucudnn.memory.simulate import StepCost
from ucudnn.problem import ConvProblem
from ucudnn.solver.types import MicroConfig

__all__ = ["KernelOption", "conv_fronts", "fastest", "kernel_front", "measured_devices", "measurements_from_db",
           "step_costs"]

_DATA_FILES = {"h100": "h100_convs.json"}


@dataclass(frozen=True, slots=True)
class KernelOption:
    """One configuration of one conv kernel: its time and workspace, and what it runs."""

    time_ms: float
    workspace: int
    config: str = ""              # `Configuration.describe()` where measured
    source: str = "roofline"      # measured, scaled or roofline


@lru_cache(maxsize=None)
def _shipped(device: str) -> dict[tuple[str, str], dict[int, tuple[MicroConfig, ...]]]:
    """The measurements shipped for `device`: (problem key without kind, kind) -> batch -> micro-configs."""
    name = _DATA_FILES.get(device)
    if name is None:
        return {}
    data = json.loads(resources.files("ucudnn.memory").joinpath("data", name).read_text(encoding="utf-8"))
    out: dict[tuple[str, str], dict[int, tuple[MicroConfig, ...]]] = {}
    for entry in data["problems"]:
        bench: dict[int, tuple[MicroConfig, ...]] = {}
        for batch, options in entry["batches"].items():
            bench[int(batch)] = tuple(MicroConfig(algo, int(batch), float(t), int(w)) for algo, t, w in options)
        out[(entry["key"], entry["kind"])] = bench
    return out


def measured_devices() -> list[str]:
    """Devices whose conv measurements ship with ucudnn."""
    return list(_DATA_FILES)


def _problem_key(problem: ConvProblem) -> str:
    """The problem's key without its kind: one shape's three kernels share it."""
    return problem.with_kind("fwd").key.split(",", 1)[1]


def _equal_micro_front(bench: dict[int, tuple[MicroConfig, ...]] | None, batch: int) -> tuple[KernelOption, ...]:
    """Equal micro-batches of a measured size s dividing `batch` (batch/s runs of one algorithm), on
    their Pareto front. A subset of what the WD solver's DP can mix (unequal sizes, mixed algorithms),
    so a little pessimistic; but one pass instead of a DP over every size up to the batch, which for
    ResNet-152 at batch 256 took seconds."""
    if not bench:
        return ()
    candidates = [(m.time * (batch // size), m.workspace, f"{batch // size}x{size}:{m.algo}")
                  for size, micros in bench.items() if size <= batch and batch % size == 0 for m in micros]
    front: list[KernelOption] = []
    for ms, ws, config in sorted(candidates, key=lambda c: (c[1], c[0])):
        if not front or ms < front[-1].time_ms:
            front.append(KernelOption(ms, ws, config, "measured"))
    return tuple(front)


@lru_cache(maxsize=4096)
def _measured_front(device: str, key: str, kind: str, batch: int) -> tuple[KernelOption, ...]:
    return _equal_micro_front(_shipped(device).get((key, kind)), batch)


Measurements = dict[tuple[str, str], dict[int, tuple[MicroConfig, ...]]]


def measurements_from_db(db, device: DeviceProfile) -> Measurements:
    """The usable measurements in a measurement cache (a `ucudnn.db` URL or SQLite path) taken on a
    device whose model name starts with the profile's (``NVIDIA H100 80GB HBM3 (sm_90)`` for h100)."""
    from ucudnn.db import Cache

    cache = Cache(db, readonly=True, create=False)
    found: dict[tuple[str, str], dict[int, list[MicroConfig]]] = {}
    try:
        for r in cache.measurement_records():
            if r.time_ms is None or not r.device.startswith(device.model):
                continue
            kind, key = r.problem_key.split(",", 1)
            found.setdefault((key, kind.removeprefix("kind=")), {}).setdefault(r.batch, []).append(
                MicroConfig(r.algo, r.batch, r.time_ms, r.workspace_bytes))
    finally:
        cache.close()
    return {k: {b: tuple(v) for b, v in bench.items()} for k, bench in found.items()}


def _roofline(device: DeviceProfile, problem: ConvProblem) -> float:
    traffic = 4 * (problem.n * problem.c * problem.h * problem.w + problem.n * problem.k * problem.out_h
                   * problem.out_w + problem.k * (problem.c // problem.groups) * problem.r * problem.s)
    return device.roofline_ms(problem.flops, traffic)


def kernel_front(device: DeviceProfile, problem: ConvProblem,
                 measured: Measurements | None = None) -> tuple[KernelOption, ...]:
    """The options of one conv kernel (`problem.kind`) on `device`; see the module docstring.
    `measured` (from `measurements_from_db`) comes first."""
    key = _problem_key(problem)
    if measured:
        front = _equal_micro_front(measured.get((key, problem.kind)), problem.n)
        if front:
            return front
    if device.name in _DATA_FILES and PROFILES.get(device.name) == device:
        measured = _measured_front(device.name, key, problem.kind, problem.n)
        if measured:
            return measured
    for ref in _DATA_FILES:
        shape = _measured_front(ref, key, problem.kind, problem.n)
        if shape:
            scale = _roofline(device, problem) / _roofline(PROFILES[ref], problem)
            return tuple(KernelOption(o.time_ms * scale, o.workspace, o.config, "scaled") for o in shape)
    return (KernelOption(_roofline(device, problem), 0, "", "roofline"),)


def conv_fronts(graph: TrainingGraph, device: DeviceProfile, *, db=None,
                given: Mapping[tuple[str, str], tuple[KernelOption, ...]] | None = None,
                ) -> dict[tuple[str, str], tuple[KernelOption, ...]]:
    """Every conv kernel of `graph` that a step runs: (layer, kind) -> its options. `given` fronts
    come first (a converted model's own handle measured them: `ucudnn.torch.plan_memory`); then,
    with `db` (a measurement cache), its measurements of this device; then the shipped ones."""
    given = given or {}
    missing = [(step.op, kind) for step in graph.steps for kind in step.kernels if (step.op, kind) not in given]
    measured = measurements_from_db(db, device) if db is not None and missing else None
    out: dict[tuple[str, str], tuple[KernelOption, ...]] = {}
    for step in graph.steps:
        if step.kernels:
            problem = graph.op(step.op).conv
            assert problem is not None
            for kind in step.kernels:
                out[(step.op, kind)] = given.get((step.op, kind)) or kernel_front(device, problem.with_kind(kind),
                                                                                  measured)
    return out


def fastest(options: tuple[KernelOption, ...], budget: int | None = None) -> KernelOption:
    """The fastest option within `budget` bytes of workspace (the smallest one when none fits)."""
    best = options[0]
    for o in options:
        if budget is None or o.workspace <= budget:
            best = o if o.time_ms < best.time_ms else best
    return best


def step_costs(graph: TrainingGraph, device: DeviceProfile, *,
               workspace: Mapping[tuple[str, str], int] | int | None = None,
               fronts: Mapping[tuple[str, str], tuple[KernelOption, ...]] | None = None) -> tuple[StepCost, ...]:
    """Each step's time and workspace when conv kernel (layer, kind) may use `workspace[(layer, kind)]`
    bytes (one number: every kernel; None: unlimited, the fastest option)."""
    if fronts is None:
        fronts = conv_fronts(graph, device)
    if isinstance(workspace, int) and not isinstance(workspace, bool) and workspace < 0:
        raise InvalidInput(f"workspace must be non-negative, got {workspace}")
    costs: list[StepCost] = []
    for step in graph.steps:
        op = graph.op(step.op)
        if step.kernels:
            ms, ws = 0.0, 0
            for kind in step.kernels:
                budget = workspace.get((step.op, kind)) if isinstance(workspace, Mapping) else workspace
                o = fastest(fronts[(step.op, kind)], budget)
                ms += o.time_ms
                ws = max(ws, o.workspace)
            costs.append(StepCost(ms, ws))
        elif op.type == "input":
            costs.append(StepCost(0.0))
        else:
            factor = 1 if step.phase == "fwd" else 2
            costs.append(StepCost(device.roofline_ms(factor * op.flops, factor * op.bytes_moved)))
    return tuple(costs)
