"""One model, end to end: plain PyTorch against converted convolutions, alone and inside memory plans.

For each model of `ucudnn.torch.zoo` (ResNet-18/50-, VGG-16- and DenseNet-shaped), from one
state_dict, these contenders train (forward, backward, SGD) on the same batch:

  - torch: the model as written;
  - WR: `convert(model)` with its defaults and a 64 MiB per-kernel limit;
  - WD: `convert(model, total_workspace=W)`, W the sum of the WR plans' workspaces;
  - plan:P for each policy P: the WR model, `plan_memory(model, x, memory_limit=L, policy=P)` and
    every step under `execute_plan` (L: `--memory-limit`; by default the weights and their
    gradients plus half of what plain training needs beyond them, as counted below).

After a warm-up (the first steps measure and plan, and the next ones run each NumPy-planned kernel's
in-step trial against PyTorch's own convolution), the contenders' steps run alternately, the
order swapped every round, and the medians are compared: the ratios are what a user gets, measured
side by side. Each plan's step is also counted by `ucudnn.torch.StepTracker` (live tensor storages
and the handles' workspaces, exact) and set beside the plan's prediction.

    python benchmarks/pytorch/bench_model_step.py [--models resnet18,resnet50,vgg16,densenet] [--batch 8]
        [--size 64] [--reps 7] [--policies checkpoint,optimal,vdnn-all] [--db URL] [--json FILE]
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py, models.py
from common import interleaved_medians_ms, make_step, table, write_json

from ucudnn.handle import SEGMENT_ALIGN_BYTES
from ucudnn.sizes import format_size, parse_size
from ucudnn.torch import Conv2d, StepTracker, convert, execute_plan, plan_memory, zoo
from ucudnn.torch.converting.route_cost import TRIAL_STEPS

MIB = 2**20


def counted_peak(model, x, y, plan=None) -> int:
    """Bytes at the peak of a forward and backward pass (what a plan covers; the optimizer's step
    and its momentum are not in it), as `ucudnn.torch.StepTracker` counts them from live storages:
    weights, their gradients, other tensors and the handles' workspaces. PyTorch's MemTracker sees no
    NumPy workspace, and here reported the same peak for every plan."""
    # PyTorch's default: gradients freed between steps (kept, each layer's new gradient would sit
    # beside the old one while autograd adds them: a transient of the largest one the plan does not hold)
    model.zero_grad(set_to_none=True)
    with StepTracker(model) as tracker:
        if plan is None:
            F.cross_entropy(model(x), y).backward()
        else:
            with execute_plan(model, plan):
                F.cross_entropy(model(x), y).backward()
    return tracker.report().peak_bytes


def bench(name: str, args) -> list[dict]:
    torch.manual_seed(0)
    reference = zoo.build(name, num_classes=10)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(args.batch, 3, args.size, args.size, generator=g)
    y = torch.randint(0, 10, (args.batch,), generator=g)
    options = {"backend": "cpu", "db": args.db}
    models = {"torch": reference}
    steps = {"torch": make_step(reference, x, y)}
    log = lambda msg: print(f"[{name}] {msg}", file=sys.stderr, flush=True)

    start = time.perf_counter()
    models["WR"] = convert(copy.deepcopy(reference), workspace_limit=64 * MIB, **options)
    steps["WR"] = make_step(models["WR"], x, y)
    steps["WR"]()
    log(f"WR planned in {time.perf_counter() - start:.1f} s")
    wr_handle = next(m.handle for m in models["WR"].modules() if isinstance(m, Conv2d))
    total = sum(c.config.workspace + SEGMENT_ALIGN_BYTES for c in wr_handle.choices())
    models["WD"] = convert(copy.deepcopy(reference), total_workspace=total, **options)
    steps["WD"] = make_step(models["WD"], x, y)
    steps["WD"](), steps["WD"]()

    steps["torch"]()  # momentum exists from here on, as it will in every counted step
    weights = sum(p.numel() * p.element_size() for p in reference.parameters())
    plain_peak = counted_peak(reference, x, y)
    # default: weights and their gradients, and half of what the step needs beyond them
    limit = parse_size(args.memory_limit) if args.memory_limit else 2 * weights + (plain_peak - 2 * weights) // 2
    plans = {}
    for policy in args.policies.split(","):
        start = time.perf_counter()
        planned = convert(copy.deepcopy(reference), workspace_limit=64 * MIB, **options)
        plan = plan_memory(planned, x, memory_limit=limit, policy=policy, loss=lambda out: F.cross_entropy(out, y))
        key = f"plan:{policy}"
        plans[key] = plan
        models[key] = planned
        steps[key] = make_step(planned, x, y, plan=plan)
        steps[key](), steps[key]()
        log(f"{policy}: planned in {time.perf_counter() - start:.1f} s, fits {plan.fits}, {plan.search or ''}")

    peaks = {key: counted_peak(models[key], x, y, plans[key]) for key in steps if key.startswith("plan:")}
    peaks["torch"] = plain_peak
    med = interleaved_medians_ms(steps, args.reps, args.warmup)
    rows = []
    for key in steps:
        plan = plans.get(key)
        rows.append(
            {
                "model": name,
                "batch": args.batch,
                "size": args.size,
                "contender": key,
                "ms": round(med[key], 2),
                "ratio": round(med[key] / med["torch"], 3),
                "counted_peak_bytes": peaks.get(key),
                "predicted_peak_bytes": plan.peak_bytes if plan else None,
                "predicted_step_ms": round(plan.step_ms, 2) if plan else None,
                "offloaded": sum(t.action == "offload" for t in plan.tensors) if plan else None,
                "fits": plan.fits if plan else None,
                "memory_limit": limit if plan else None,
            }
        )
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="resnet18,resnet50,vgg16,densenet")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--size", type=int, default=64)
    ap.add_argument("--reps", type=int, default=7, help="timed steps per contender, interleaved")
    ap.add_argument(
        "--warmup", type=int, default=TRIAL_STEPS, help="untimed rounds (default: as many as the in-step trials take)"
    )
    ap.add_argument("--policies", default="checkpoint,optimal,vdnn-all")
    ap.add_argument("--memory-limit", help="the plans' limit (default: half of plain training's counted peak)")
    ap.add_argument("--db", default=None, help="measurement cache (default: the user's; sqlite:// for a fresh one)")
    ap.add_argument("--json", help="also write the rows to this file")
    args = ap.parse_args(argv)
    rows = [row for name in args.models.split(",") for row in bench(name, args)]

    def mib(b):
        return "-" if b is None else format_size(b)

    print(
        table(
            ["model", "contender", "ms/step", "vs torch", "peak (counted)", "predicted", "offloads", "fits"],
            [
                [
                    r["model"],
                    r["contender"],
                    f"{r['ms']:.1f}",
                    f"{r['ratio']:.3f}",
                    mib(r["counted_peak_bytes"]),
                    mib(r["predicted_peak_bytes"]),
                    "-" if r["offloaded"] is None else r["offloaded"],
                    "-" if r["fits"] is None else r["fits"],
                ]
                for r in rows
            ],
        )
    )
    write_json(args.json, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
