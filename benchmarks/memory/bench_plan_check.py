"""Every policy's plan checked against a real step on this machine (CPU): predicted against achieved peak
(counted by `ucudnn.torch.checking.tracker.StepTracker`), step time and bytes moved, through `check_plan`.

The models are `bench_frontier`'s chain and ResNet-shaped model; each policy plans for this machine
(`plan_memory`, the measured CPU profile) at a limit of the weights and half the feature maps, so that
recompute plans are exercised (a CPU profile shares the host's memory: no policy offloads there).
``--malloc keep`` makes glibc keep what a step frees (see `bench_frontier`).

    OMP_NUM_THREADS=2 python benchmarks/memory/bench_plan_check.py
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py, models.py
from bench_frontier import build
from common import keep_freed_memory, table

from ucudnn.memory import available_policies
from ucudnn.torch import capture
from ucudnn.torch.checking.check import check_plan
from ucudnn.torch.planning.planner import plan_memory

MiB = 2**20


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="chain,resnet")
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--blocks", type=int, default=8)
    ap.add_argument("--channels", type=int, default=32)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--size", type=int, default=32)
    ap.add_argument("--fraction", type=float, default=0.5, help="limit: the weights + this share of the feature maps")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--malloc", choices=("default", "keep"), default="default")
    args = ap.parse_args()
    if args.malloc == "keep":
        keep_freed_memory()
    for name in args.models.split(","):
        model, x, y = build(name, args)

        def loss(out, y=y):
            return nn.functional.cross_entropy(out, y)

        graph = capture(model, x, loss=loss).graph
        limit = graph.weight_bytes + int(args.fraction * graph.feature_map_bytes)
        rows = []
        for policy in available_policies():
            plan = plan_memory(model, x, memory_limit=limit, policy=policy, loss=loss)
            c = check_plan(model, plan, x, y, steps=args.steps)
            recompute = sum(1 for t in plan.tensors if t.action == "recompute")
            rows.append(
                [
                    policy,
                    plan.fits,
                    recompute,
                    f"{c.predicted_peak_bytes / MiB:.2f}",
                    f"{c.peak_bytes / MiB:.2f}",
                    f"{c.peak_ratio:.3f}",
                    f"{c.predicted_step_ms:.1f}",
                    f"{c.step_ms:.1f}",
                    f"{c.step_ratio:.2f}",
                    f"{c.predicted_bytes_moved / MiB:.1f}",
                    f"{c.bytes_moved / MiB:.1f}",
                ]
            )
        print(f"\n{name}: batch {args.batch}, {args.size}x{args.size}, limit {limit / MiB:.1f} MiB")
        print(
            table(
                [
                    "policy",
                    "fits",
                    "recomputed",
                    "planned peak MiB",
                    "peak MiB (tracker)",
                    "ratio",
                    "planned ms",
                    "ms (median)",
                    "ratio",
                    "planned moved MiB",
                    "moved MiB",
                ],
                rows,
            )
        )


if __name__ == "__main__":
    main()
