"""A converted model's plans for this CPU, as a user makes them: predicted peak against the peak `StepTracker` counts.

Models (``--models``; the `models` extra): Hugging Face transformers' MobileNetV2 and ResNet-50 and MONAI's 2-D
UNet, built from their configs (`models.py`) at ``--batch`` 4 and ``--size`` 64 px, converted
(`ucudnn.torch.convert`, the CPU backend) and trained `TRIAL_STEPS` steps without a plan (so their handles hold
the workspace their kernels took), then planned by `plan_memory` (``--policy``, this CPU): the smallest plan (a
1-byte limit), 60% of everything kept, and halfway between the two; each checked by `check_plan` (a warm-up
step, then one counted step). Target: the count equals the prediction.

    pip install '.[models]'
    OMP_NUM_THREADS=1 python benchmarks/memory/bench_converted_peaks.py [--models hf-mobilenet-v2,hf-resnet50,monai-unet]
        [--batch 4] [--size 64] [--policy optimal] [--json FILE]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py, models.py
import torch
from common import plan_fields, table, write_json
from models import NAMES, build, loss

from ucudnn.torch import check_plan, convert, plan_memory
from ucudnn.torch.converting.layer import ConvLayer
from ucudnn.torch.converting.route_cost import TRIAL_STEPS

MODELS = ("hf-mobilenet-v2", "hf-resnet50", "monai-unet")
MIB = 2**20


def bench(name: str, args) -> list[dict]:
    torch.manual_seed(0)
    model, x, y = build(name, args.batch, args.size)
    model = convert(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for _ in range(TRIAL_STEPS):
        opt.zero_grad(set_to_none=True)
        loss(model(x), y).backward()
        opt.step()
    kept = sum(
        h.workspace_bytes
        for h in {id(m.handle): m.handle for m in model.modules() if isinstance(m, ConvLayer)}.values()
    )

    def planned(limit):
        return plan_memory(model, x, memory_limit=limit, policy=args.policy, loss=lambda out: loss(out, y))

    everything, smallest = planned(None), planned(1)
    plans = {
        "smallest": smallest,
        "60%": planned(int(0.6 * everything.peak_bytes)),
        "halfway": planned((everything.peak_bytes + smallest.peak_bytes) // 2),
    }
    rows = []
    for label, plan in plans.items():
        checked = check_plan(model, plan, x, y, loss_fn=loss, steps=1)
        rows.append(
            {
                "model": name,
                "batch": args.batch,
                "size": args.size,
                "policy": args.policy,
                "plan": label,
                **plan_fields(plan),
                "workspace_kept_bytes": kept,
                "counted_bytes": checked.peak_bytes,
                "ratio": checked.peak_ratio,
                "workspace_at_peak_bytes": checked.tracker.peak_by_category["workspace"],
            }
        )
        print(f"[{name}] {label}: counted {checked.peak_ratio:.4f} of predicted", file=sys.stderr, flush=True)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--size", type=int, default=64)
    ap.add_argument("--policy", default="optimal")
    ap.add_argument("--json", help="also write the rows to this file")
    args = ap.parse_args(argv)
    unknown = [m for m in args.models.split(",") if m not in NAMES]
    if unknown:
        ap.error(f"unknown model(s) {', '.join(unknown)}: {', '.join(NAMES)}")
    torch.set_num_threads(1)
    rows = [row for name in args.models.split(",") for row in bench(name, args)]
    print(
        table(
            [
                "model",
                "plan",
                "fits",
                "offl./recomp.",
                "workspace kept MiB",
                "predicted MiB",
                "counted MiB",
                "counted / pred.",
                "workspace at peak MiB",
            ],
            [
                [
                    r["model"],
                    r["plan"],
                    r["fits"],
                    f"{r['offloaded']}/{r['recomputed']}",
                    f"{r['workspace_kept_bytes'] / MIB:.2f}",
                    f"{r['predicted_bytes'] / MIB:.2f}",
                    f"{r['counted_bytes'] / MIB:.2f}",
                    f"{r['ratio']:.4f}",
                    f"{r['workspace_at_peak_bytes'] / MIB:.2f}",
                ]
                for r in rows
            ],
        )
    )
    write_json(args.json, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
