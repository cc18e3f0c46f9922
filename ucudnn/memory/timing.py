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

**Calibration** (`CALIBRATIONS`, the built-in profile only). The H100 profile is calibrated against
PyTorch training steps measured on that H100 (the H100 run of 2026-11-22: NVIDIA H100 80GB HBM3,
PyTorch 2.11 CUDA 13, cuDNN 9.19; torchvision models, SGD, TF32 as PyTorch's default; the figures ship in
``ucudnn/memory/data/h100_steps.json``). Uncalibrated, the everything-resident step was 1.45-1.5x too
slow: ResNet-50 b128 102.7 ms predicted (40.7 conv + 62.0 other) against 70.9 measured, VGG-16 b128
152.3 (117.6 + 34.7) against 101.6. Both parts are off: fitting a factor on each part to those two
steps gives conv x0.653 and other x0.715, and one factor for everything fitted to all six zoo steps
recorded gives 0.666 for both. So:

- *conv kernels*: the shipped measurements are cuDNN float32 without TF32, while PyTorch's cuDNN
  convolutions use TF32 by default: `Calibration.conv_scale` = 0.653 on the H100's own measured fronts
  (not on `db` measurements or a converted model's own fronts, which are what ucudnn's kernels run, nor
  on the fronts scaled to other devices: a V100 has no TF32);
- *other operations*: the roofline at `ROOFLINE_EFFICIENCY` (0.5) was pessimistic: elementwise,
  batch-norm and pooling kernels reach `Calibration.other_efficiency` = 0.70 of the H100's peak.

Checked on the steps not fitted: VGG-16 b64 -1.6%, ResNet-50 b64 -0.4%, b256 +3.1%, ResNet-152 b64
+8.9% (GoogLeNet b128 +15%: 165 of its 170 conv kernels have no measurement and take the roofline).
The recorded per-kernel figures disagree: PyTorch's TF32 kernels of ucudnn's ResNet-50 b64 plan, each
timed alone between two events, summed to 21.0 ms where the calibrated fronts give 15.7 (AlexNet b256:
12.85 against 8.5); launched alone, a kernel pays its launch and its output's allocation, which a step's
stream hides, and the steps are what a plan predicts.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from functools import cache, lru_cache
from importlib import resources

from ucudnn.devices import PROFILES, ROOFLINE_EFFICIENCY, DeviceProfile
from ucudnn.errors import InvalidInput
from ucudnn.memory.graph import TrainingGraph
from ucudnn.memory.simulate import StepCost
from ucudnn.problem import ConvProblem
from ucudnn.solver.types import MicroConfig

__all__ = [
    "CALIBRATIONS",
    "Calibration",
    "KernelOption",
    "calibration",
    "conv_fronts",
    "fastest",
    "front_of",
    "kernel_front",
    "measured_devices",
    "measurements_from_db",
    "other_ms",
    "step_costs",
]

_DATA_FILES = {"h100": "h100_convs.json"}


@dataclass(frozen=True, slots=True)
class Calibration:
    """How a built-in profile's predictions are corrected to match steps measured on the device."""

    conv_scale: float  # times the device's own shipped conv measurements
    other_efficiency: float  # roofline efficiency of the other operations (instead of ROOFLINE_EFFICIENCY)
    source: str


# Fitted to ResNet-50 and VGG-16 at batch 128 (two factors, two steps; see the module docstring).
CALIBRATIONS: dict[str, Calibration] = {
    "h100": Calibration(
        conv_scale=0.653,
        other_efficiency=0.70,
        source="PyTorch training steps on an H100 (2026-11-22), ucudnn/memory/data/h100_steps.json",
    ),
}


def calibration(device: DeviceProfile) -> Calibration | None:
    """The calibration of `device` when it is a built-in profile that has one (its compute figures
    unchanged: a profile edited with another link still computes as the measured device did)."""
    ref = PROFILES.get(device.name)
    cal = CALIBRATIONS.get(device.name)
    if (
        cal is None
        or ref is None
        or (device.model, device.fp32_tflops, device.memory_gbps) != (ref.model, ref.fp32_tflops, ref.memory_gbps)
    ):
        return None
    return cal


def other_ms(device: DeviceProfile, flops: float, bytes_moved: float) -> float:
    """A non-conv operation's time: the roofline, at the calibrated efficiency where there is one."""
    ms = device.roofline_ms(flops, bytes_moved)
    cal = calibration(device)
    return ms * ROOFLINE_EFFICIENCY / cal.other_efficiency if cal is not None else ms


@dataclass(frozen=True, slots=True)
class KernelOption:
    """One configuration of one conv kernel: its time and workspace, and what it runs."""

    time_ms: float
    workspace: int  # the budget it needs: what a plan gives the kernel
    config: str = ""  # `Configuration.describe()` where measured
    source: str = "roofline"  # measured, scaled or roofline
    held: int | None = None  # bytes the step holds for it, where not its workspace (torch's own
    # convolution run by torch: its temporaries are torch's, never ours)

    @property
    def memory(self) -> int:
        """Workspace bytes the step holds while this option runs."""
        return self.workspace if self.held is None else self.held


@cache
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
    return front_of(
        KernelOption(m.time * (batch // size), m.workspace, f"{batch // size}x{size}:{m.algo}", "measured")
        for size, micros in bench.items()
        if size <= batch and batch % size == 0
        for m in micros
    )


def front_of(options: Iterable[KernelOption]) -> tuple[KernelOption, ...]:
    """The options no other dominates, by ascending workspace and strictly descending time."""
    front: list[KernelOption] = []
    for o in sorted(options, key=lambda o: (o.workspace, o.time_ms)):
        if not front or o.time_ms < front[-1].time_ms:
            front.append(o)
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
                MicroConfig(r.algo, r.batch, r.time_ms, r.workspace_bytes)
            )
    finally:
        cache.close()
    return {k: {b: tuple(v) for b, v in bench.items()} for k, bench in found.items()}


def _roofline(device: DeviceProfile, problem: ConvProblem) -> float:
    traffic = 4 * sum(math.prod(shape) for shape in (problem.x_shape, problem.y_shape, problem.w_shape))
    return device.roofline_ms(problem.flops, traffic)


def kernel_front(
    device: DeviceProfile, problem: ConvProblem, measured: Measurements | None = None
) -> tuple[KernelOption, ...]:
    """The options of one conv kernel (`problem.kind`) on `device`; see the module docstring.
    `measured` (from `measurements_from_db`) comes first."""
    key = _problem_key(problem)
    if measured:
        front = _equal_micro_front(measured.get((key, problem.kind)), problem.n)
        if front:
            return front
    if device.name in _DATA_FILES and (PROFILES.get(device.name) == device or calibration(device) is not None):
        own = _measured_front(device.name, key, problem.kind, problem.n)
        if own:
            cal = calibration(device)
            if cal is None:
                return own
            return tuple(KernelOption(o.time_ms * cal.conv_scale, o.workspace, o.config, o.source) for o in own)
    for ref in _DATA_FILES:
        shape = _measured_front(ref, key, problem.kind, problem.n)
        if shape:
            scale = _roofline(device, problem) / _roofline(PROFILES[ref], problem)
            return tuple(KernelOption(o.time_ms * scale, o.workspace, o.config, "scaled") for o in shape)
    return (KernelOption(_roofline(device, problem), 0, "", "roofline"),)


def conv_fronts(
    graph: TrainingGraph,
    device: DeviceProfile,
    *,
    db=None,
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
                out[(step.op, kind)] = given.get((step.op, kind)) or kernel_front(
                    device, problem.with_kind(kind), measured
                )
    return out


def fastest(options: tuple[KernelOption, ...], budget: int | None = None) -> KernelOption:
    """The fastest option within `budget` bytes of workspace (the smallest one when none fits)."""
    best = options[0]
    for o in options:
        if budget is None or o.workspace <= budget:
            best = o if o.time_ms < best.time_ms else best
    return best


def step_costs(
    graph: TrainingGraph,
    device: DeviceProfile,
    *,
    workspace: Mapping[tuple[str, str], int] | int | None = None,
    fronts: Mapping[tuple[str, str], tuple[KernelOption, ...]] | None = None,
) -> tuple[StepCost, ...]:
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
                ws = max(ws, o.memory)
            costs.append(StepCost(ms, ws))
        elif op.type == "input" or step.part:  # (a captured node's later part: its time is the first part's)
            costs.append(StepCost(0.0))
        else:
            factor = 1 if step.phase == "fwd" else 2
            if step.phase != "fwd" and op.measured_bwd_ms is not None:
                costs.append(StepCost(op.measured_bwd_ms))
            elif op.measured_ms is not None:  # timed on the device itself (`ucudnn.torch.plan_memory` on a CPU)
                costs.append(StepCost(factor * op.measured_ms))
            else:
                costs.append(StepCost(other_ms(device, factor * op.flops, factor * op.bytes_moved)))
    return tuple(costs)
