"""ucudnn's plans inside torch.compile against compile's own memory budget (issue 43), CPU.

Models (``--models``; the `models` extra): Hugging Face MobileNetV2 and ResNet-50, MONAI's UNet in 2-D and in 3-D
(not its 3-D BasicUNet, whose forward pass breaks Dynamo's graph: `plan_memory(..., compiled=True)` refuses it),
from their configs, dropout off (its random draws are not what is compared). Variants, each compiled
with Inductor once:

- ``plain``: `torch.compile(model)`;
- ``compile(b)``: the same under `torch._functorch.config.activation_memory_budget` = b, b in ``--budgets``;
- ``ucudnn@compile(b)``: `plan_memory(..., compiled=True)` at the peak ``compile(b)`` reached (equal memory),
  trained as `torch.compile(with_plan(model, plan))`.

Per point: the counted peak of one step after two warm-up steps (`StepTracker`, which also counts the buffers
Inductor's generated kernels allocate), every compile from nothing (no cached graphs; each model's kernels
compiled into an empty Inductor cache directory, as on a user's first run), the step time (median CPU ms over ``--rounds``
interleaved rounds, in an order shuffled every round), for a plan its step against compile(b)'s (the median of
their ratios round by round), its predicted peak and counted / predicted, and the parameters after ``--steps``
SGD steps on one batch against plain compiled training's (relative to their norm), beside the noise of
compiling itself (plain compiled against plain eager). Planning time: the three plans' `plan_memory` calls
against one compile (the plain variant's first step less a later step).

``--convert``: the model converted first (`ucudnn.torch.convert`, backend ``cpu``, its defaults) and warmed up
eagerly (its kernels measured, their trials against torch's settled), so that every variant, plain included, is
the converted model compiled, and a plan's prediction holds the workspace its kernels take under its budgets.

    pip install '.[models]'
    OMP_NUM_THREADS=2 python benchmarks/pytorch/bench_compiled_plans.py --models monai-unet --json compiled.json
    OMP_NUM_THREADS=2 python benchmarks/pytorch/bench_compiled_plans.py --models monai-unet --convert
    python benchmarks/pytorch/bench_compiled_plans.py --device cuda --models hf-resnet50 --batch 64 --size 224
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py, models.py
import torch
import torch._functorch.config
import torch._inductor.config
from common import table
from models import build, loss
from torch import nn

from ucudnn.torch import StepTracker, convert, plan_memory, with_plan
from ucudnn.torch.planning.compiled_step import fresh_call
from ucudnn.torch.running.labels import watch_inductor_buffers

MiB = 2**20
DEFAULTS = {  # (batch, size): small enough that four models compile and run on 2 cores
    "hf-mobilenet-v2": (4, 64),
    "hf-resnet50": (2, 64),
    "monai-unet": (4, 64),
    "monai-unet-3d": (2, 32),
}
CONVERTED_WARMUP = 8  # --convert: eager steps before anything compiles (kernels measured, trials settled)


class Point:
    def __init__(self, name: str, model: nn.Module, module: nn.Module, y, plan=None, budget: float = 1.0) -> None:
        self.name, self.model, self.plan, self.y, self.budget = name, model, plan, y, budget
        self.compiled = torch.compile(fresh_call(module))  # compiled anew, not shared with another variant's
        self.peak, self.ms, self.first_s = 0, [], 0.0

    def step(self, x) -> None:
        """One step (forward, backward), compiled under the point's activation_memory_budget (1: compile's own
        partitioning unbudgeted)."""
        for p in self.model.parameters():
            p.grad = None
        with torch._functorch.config.patch(activation_memory_budget=self.budget):
            loss(self.compiled(x), self.y).backward()


def _no_dropout(model: nn.Module) -> nn.Module:
    for m in model.modules():
        if isinstance(m, nn.Dropout):
            m.p = 0.0
    return model


def _measure(point: Point, x) -> None:
    start = time.perf_counter()
    point.step(x)  # compiles
    point.first_s = time.perf_counter() - start
    point.step(x)
    with StepTracker(point.model) as tracker:
        tracker.track(x)
        tracker.track(point.y)  # (the target is the step's from its start, as the prediction counts it)
        point.step(x)
    point.peak = tracker.report().peak_bytes


def _timed_ms(point: Point, x, device: torch.device) -> float:
    """One step's CPU time of this process (on a shared CPU, steadier than wall time); on a GPU, wall time to
    the device's end of the step."""
    if device.type == "cuda":  # pragma: no cover - needs a GPU
        torch.cuda.synchronize(device)
        start = time.perf_counter()
        point.step(x)
        torch.cuda.synchronize(device)  # measuring: the step's end on the device
        return (time.perf_counter() - start) * 1e3
    cpu = time.process_time()
    point.step(x)
    return (time.process_time() - cpu) * 1e3


def _trained(module: nn.Module, model: nn.Module, x, y, steps: int) -> torch.Tensor:
    """The parameters after `steps` SGD steps on one batch, flattened."""
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for _ in range(steps):
        opt.zero_grad()
        loss(module(x), y).backward()
        opt.step()
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def run_model(name: str, args) -> dict:
    batch, size = DEFAULTS[name]
    batch, size = args.batch or batch, args.size or size
    base, x, y = build(name, batch, size)
    device = torch.device(args.device)
    base, x, y = base.to(device), x.to(device), y.to(device)
    _no_dropout(base)
    if args.convert:
        base = convert(base, backend="cpu" if device.type == "cpu" else "auto")
        for _ in range(CONVERTED_WARMUP):
            base.zero_grad(set_to_none=True)
            loss(base(x), y).backward()
    torch._dynamo.reset()
    points = [Point("plain", m := copy.deepcopy(base), m, y)]
    _measure(points[0], x)
    for b in args.budgets:
        points.append(Point(f"compile({b})", m := copy.deepcopy(base), m, y, budget=b))
        _measure(points[-1], x)
    planning = []
    model = copy.deepcopy(base)  # planned as a user would: one model, one loss, three limits

    def criterion(out):
        return loss(out, y)

    for b in args.budgets:
        reached = next(p.peak for p in points if p.name == f"compile({b})")
        start = time.perf_counter()
        plan = plan_memory(model, x, memory_limit=reached, compiled=True, loss=criterion)
        planning.append(time.perf_counter() - start)
        planned = copy.deepcopy(base)
        points.append(Point(f"ucudnn@compile({b})", planned, with_plan(planned, plan), y, plan))
        _measure(points[-1], x)
        print(f"{name}: planned at compile({b})'s {reached / MiB:.1f} MiB in {planning[-1]:.0f} s", flush=True)
    order = random.Random(0)
    for _ in range(args.rounds):  # interleaved, in an order shuffled every round: no point always follows another
        for p in order.sample(points, len(points)):
            p.ms.append(_timed_ms(p, x, device))
    # training equality: each plan's parameters against plain compiled training's, beside compile's own noise
    plain_eager = _trained(m := copy.deepcopy(base), m, x, y, args.steps)
    plain = _trained(torch.compile(fresh_call(m := copy.deepcopy(base))), m, x, y, args.steps)
    norm = plain.norm().item()
    rows = []
    for p in points:
        row = {
            "model": name,
            "variant": p.name,
            "peak_mib": p.peak / MiB,
            "step_ms": statistics.median(p.ms),
            "first_step_s": p.first_s,
        }
        if p.plan is not None:  # the plan measured above, on a fresh copy of the model
            at = next(c for c in points if c.name == p.name.removeprefix("ucudnn@"))  # compile's point, its limit
            model = copy.deepcopy(base)
            trained = _trained(torch.compile(fresh_call(with_plan(model, p.plan))), model, x, y, args.steps)
            row |= {
                "predicted_mib": p.plan.peak_bytes / MiB,
                "counted_over_predicted": p.peak / p.plan.peak_bytes,
                # the step against compile's at the same limit, round by round: a slow round slows both
                "step_vs_compile_point": statistics.median(u / c for u, c in zip(p.ms, at.ms)),
                "params_vs_plain_compiled": (trained - plain).norm().item() / norm,
                "recomputed": sum(t.action == "recompute" for t in p.plan.tensors),
            }
        rows.append(row)
    compile_s = points[0].first_s - statistics.median(points[0].ms) / 1e3
    return {
        "model": name,
        "converted": args.convert,
        "batch": batch,
        "size": size,
        "rows": rows,
        "noise_compiled_vs_eager": (plain - plain_eager).norm().item() / norm,
        "planning_s": planning,
        "compile_s": compile_s,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default=",".join(DEFAULTS), help="comma-separated: " + ", ".join(DEFAULTS))
    parser.add_argument("--budgets", default="0.25,0.5,0.75", help="compile's activation_memory_budget values")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved timing rounds")
    parser.add_argument("--steps", type=int, default=3, help="SGD steps for the training-equality check")
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:i] (a GPU: step time is wall time)")
    parser.add_argument("--batch", type=int, help="batch size for every model (default: each model's own)")
    parser.add_argument("--size", type=int, help="input size for every model (default: each model's own)")
    parser.add_argument("--convert", action="store_true", help="convert each model first (ucudnn.torch.convert)")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    args.budgets = [float(b) for b in args.budgets.split(",")]
    models = args.models.split(",")
    unknown = [m for m in models if m not in DEFAULTS]
    if unknown:
        parser.error(f"unknown model(s) {', '.join(unknown)}; known: {', '.join(DEFAULTS)}")
    watch_inductor_buffers()  # before anything compiles: the trackers count Inductor's own buffers
    # every variant compiles from nothing: a cached graph would skip compile's own budget (its key does not hold
    # it) and make the compile time a cache read
    torch._functorch.config.enable_autograd_cache = False
    torch._inductor.config.fx_graph_cache = False
    results = []
    for name in models:
        # a compile from nothing: kernels an earlier run compiled, left in Inductor's on-disk cache, would make the
        # compile a partial cache read (HF MobileNetV2's took 44 s so, against 65 s from an empty cache)
        with tempfile.TemporaryDirectory(prefix="inductor-") as fresh:
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = fresh
            r = run_model(name, args)
        results.append(r)
        plain_ms = r["rows"][0]["step_ms"]
        print(
            f"\n{name}{' converted' if r['converted'] else ''} (batch {r['batch']}, {r['size']} px): compiling took {r['compile_s']:.0f} s, three plans "
            f"{sum(r['planning_s']):.0f} s; compile's own noise {r['noise_compiled_vs_eager']:.1e}"
        )
        print(
            table(
                [
                    "variant",
                    "peak MiB",
                    "x plain step",
                    "x compile(b)",
                    "predicted MiB",
                    "counted/pred",
                    "params vs plain",
                    "recomputed",
                ],
                [
                    [
                        row["variant"],
                        f"{row['peak_mib']:.2f}",
                        f"{row['step_ms'] / plain_ms:.3f}",
                        f"{row['step_vs_compile_point']:.3f}" if "predicted_mib" in row else "",
                        f"{row['predicted_mib']:.2f}" if "predicted_mib" in row else "",
                        f"{row['counted_over_predicted']:.3f}" if "predicted_mib" in row else "",
                        f"{row['params_vs_plain_compiled']:.1e}" if "predicted_mib" in row else "",
                        str(row.get("recomputed", "")),
                    ]
                    for row in r["rows"]
                ],
            ),
            flush=True,
        )
        if args.json:
            Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
