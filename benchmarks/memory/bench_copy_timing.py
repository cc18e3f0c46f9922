"""A GPU plan's memory counted on the CPU, with the copies finishing late as on a GPU: predicted peak against the
peak `StepTracker` counts (its device categories: exact live storage) when the executor's copies to and from the
host finish at once (the CPU's plain copies) and when they finish as late as a GPU's copy streams may
(`ucudnn.torch.running.offload.late_copies`: a copy runs when something waits for it, so the executor holds every device
tensor as long as it does on a GPU, whose caching allocator counts in the host's order).

Models (``--models``; the `models` extra): Hugging Face transformers' ResNet-50 and MobileNetV2 and MONAI's 2-D
UNet, built from their configs (`models.py`), at ``--batch`` 4 and ``--size`` 64 px. For each, plans of
``--policy`` (``optimal``) for ``--device`` (``h100``) made by `plan_memory`: everything kept (no limit), the
smallest (a 1-byte limit) and halfway between their peaks; each checked by `check_plan` (a warm-up step, then one
counted step) with prompt copies and with late ones. Beside them, the plan the policy made by its own timing of
the copies back (`ucudnn.memory.make_plan` at the same limit: what `plan_memory` returned before its figures were
the executor's) with its prediction and its late-copy count. Target: late-copy count within 0.95-1.05 of the
prediction at halfway and smallest. ``--predict-only``: the predictions alone, no steps run (for sizes a CPU
does not train in reasonable time: the plans are made on fake tensors).

    pip install '.[models]'
    OMP_NUM_THREADS=1 python benchmarks/memory/bench_copy_timing.py [--models hf-resnet50,hf-mobilenet-v2,monai-unet]
        [--batch 4] [--size 64] [--policy optimal] [--device h100] [--predict-only] [--json FILE]
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py, models.py
import torch
from common import plan_fields, table, write_json
from models import NAMES, build, loss

from ucudnn.devices import load_profile
from ucudnn.memory.planner import make_plan
from ucudnn.torch import plan_memory
from ucudnn.torch.checking.check import check_plan
from ucudnn.torch.running.offload import late_copies

MODELS = ("hf-resnet50", "hf-mobilenet-v2", "monai-unet")
BAND = (0.95, 1.05)
MIB = 2**20


def target(row: dict) -> str:
    if row["plan"] == "everything kept":
        return ""
    return "met" if BAND[0] <= row["late_ratio"] <= BAND[1] else "NOT met"


def counted(model, plan, x, y, late: bool) -> int:
    """The device's peak over one step of `plan`, counted by StepTracker (after a warm-up step)."""
    with late_copies() if late else contextlib.nullcontext():
        return check_plan(model, plan, x, y, loss_fn=loss, steps=1).peak_bytes


def bench(name: str, args) -> list[dict]:
    model, x, y = build(name, args.batch, args.size)

    def labelled(out):
        return loss(out, y)

    def planned(limit):
        return plan_memory(model, x, memory_limit=limit, policy=args.policy, device=args.device, loss=labelled)

    everything, smallest = planned(2**40), planned(1)
    plans = {
        "everything kept": everything,
        "halfway": planned((everything.peak_bytes + smallest.peak_bytes) // 2),
        "smallest": smallest,
    }
    rows = []
    for label, plan in plans.items():
        step = plan.capture
        own = dataclasses.replace(
            make_plan(step.graph, load_profile(args.device), plan.memory_limit, args.policy), capture=step
        )
        row = {
            "model": name,
            "batch": args.batch,
            "size": args.size,
            "policy": args.policy,
            "device": args.device,
            "plan": label,
            **plan_fields(plan),
            "policy_predicted_bytes": own.peak_bytes,
        }
        if not args.predict_only:
            row["prompt_bytes"] = counted(model, plan, x, y, late=False)
            row["late_bytes"] = counted(model, plan, x, y, late=True)
            row["policy_late_bytes"] = counted(model, own, x, y, late=True)
            row["prompt_ratio"] = row["prompt_bytes"] / row["predicted_bytes"]
            row["late_ratio"] = row["late_bytes"] / row["predicted_bytes"]
            row["policy_late_ratio"] = row["policy_late_bytes"] / row["policy_predicted_bytes"]
            print(
                f"[{name}] {label}: late copies {row['late_ratio']:.3f} of predicted (the policy's own timing: "
                f"{row['policy_late_ratio']:.3f})",
                file=sys.stderr,
                flush=True,
            )
        rows.append(row)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--size", type=int, default=64)
    ap.add_argument("--policy", default="optimal")
    ap.add_argument("--device", default="h100", help="the device profile the plans are made for")
    ap.add_argument("--predict-only", action="store_true", help="the predictions alone: no steps run")
    ap.add_argument("--json", help="also write the rows to this file")
    args = ap.parse_args(argv)
    unknown = [m for m in args.models.split(",") if m not in NAMES]
    if unknown:
        ap.error(f"unknown model(s) {', '.join(unknown)}: {', '.join(NAMES)}")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads", file=sys.stderr)
    rows = [row for name in args.models.split(",") for row in bench(name, args)]
    if args.predict_only:
        print(
            table(
                ["model", "plan", "offl./recomp.", "predicted MiB", "policy's own: pred. MiB", "pred. / own"],
                [
                    [
                        r["model"],
                        r["plan"],
                        f"{r['offloaded']}/{r['recomputed']}",
                        f"{r['predicted_bytes'] / MIB:.1f}",
                        f"{r['policy_predicted_bytes'] / MIB:.1f}",
                        f"{r['predicted_bytes'] / r['policy_predicted_bytes']:.3f}",
                    ]
                    for r in rows
                ],
            )
        )
    else:
        print(
            table(
                [
                    "model",
                    "plan",
                    "offl./recomp.",
                    "predicted MiB",
                    "prompt MiB",
                    "late MiB",
                    "prompt / pred.",
                    "late / pred.",
                    f"target {BAND[0]}-{BAND[1]}",
                    "policy's own: pred. MiB",
                    "late MiB",
                    "late / pred.",
                ],
                [
                    [
                        r["model"],
                        r["plan"],
                        f"{r['offloaded']}/{r['recomputed']}",
                        f"{r['predicted_bytes'] / MIB:.2f}",
                        f"{r['prompt_bytes'] / MIB:.2f}",
                        f"{r['late_bytes'] / MIB:.2f}",
                        f"{r['prompt_ratio']:.3f}",
                        f"{r['late_ratio']:.3f}",
                        target(r),
                        f"{r['policy_predicted_bytes'] / MIB:.2f}",
                        f"{r['policy_late_bytes'] / MIB:.2f}",
                        f"{r['policy_late_ratio']:.3f}",
                    ]
                    for r in rows
                ],
            )
        )
    write_json(args.json, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
