"""Models nobody here wrote, captured, planned, executed and trained (CPU): what a user of `plan_memory` gets.

For each model of `models.py` (``--models``), plain and converted (``convert(model, workspace_limit=...,
policy="undivided")``, ``--workspace-limit``, 64 MiB: Wav2Vec2's positional convolution at batch 4 has no
undivided configuration within 8), and each policy (``--policies``):

  - plans at no limit (everything kept), at a 1-byte limit (the smallest peak the policy reaches) and halfway
    between the two, the halfway one checked to fit;
  - PyTorch's `MemTracker` counts one real step under the halfway and the smallest plan (after a warm-up step,
    gradients freed before; a converted conv's NumPy workspace added as its handle takes it, which MemTracker
    cannot see): its peak over the plan's prediction;
  - two SGD steps under the halfway plan against plain training: the norm of all parameters' difference, over
    plain training's own rounding noise (one thread against two), and whether it trains alike as the tests
    judge it (within twice that noise or 1e-6 of the parameters' norm: `plain_training.trains_alike`);
  - planning time: the first `plan_memory` of the model (capture on fake tensors, the other operations timed
    in real steps, the convolutions' fronts from the cache or measured), and a later one.

    pip install '.[models,bench]'
    OMP_NUM_THREADS=2 python benchmarks/memory/bench_models_planned.py [--models a,b] [--policies checkpoint,optimal]
        [--batch 2] [--size 32] [--workspace-limit 64MiB] [--json FILE]
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py, models.py
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))  # the repository's tests/
from common import table, write_json
from models import NAMES, build, loss
from plain_training import memtracker_peak, train, trains_alike  # the tests' training and count

from ucudnn.sizes import parse_size
from ucudnn.torch import convert, plan_memory

MiB = 2**20


def bench(name: str, args, db: str) -> list[dict]:
    base, x, y = build(name, args.batch, args.size)

    def batch(step):
        return x, y

    reference = train(copy.deepcopy(base), batch, loss=loss)
    noise = (reference - train(copy.deepcopy(base), batch, threads=2, loss=loss)).norm().item()
    rows = []

    def labelled(out):
        return loss(out, y)

    for variant in ("plain", "converted"):
        model = copy.deepcopy(base)
        if variant == "converted":
            model = convert(
                model, backend="cpu", workspace_limit=args.workspace_limit, policy="undivided", reps=1, db=db
            )
        for policy in args.policies:
            start = time.perf_counter()
            everything = plan_memory(model, x, memory_limit=2**40, policy=policy, loss=labelled)
            first = time.perf_counter() - start
            smallest = plan_memory(model, x, memory_limit=1, policy=policy, loss=labelled)
            start = time.perf_counter()
            plan = plan_memory(
                model, x, memory_limit=(everything.peak_bytes + smallest.peak_bytes) // 2, policy=policy, loss=labelled
            )
            later = time.perf_counter() - start
            ratios = [memtracker_peak(model, p, x, y, loss) / p.peak_bytes for p in (plan, smallest)]
            trained = train(copy.deepcopy(model), batch, plan, loss=loss)
            rows.append(
                {
                    "model": name,
                    "variant": variant,
                    "policy": policy,
                    "fits": plan.fits,
                    "everything_mib": everything.peak_bytes / MiB,
                    "smallest_mib": smallest.peak_bytes / MiB,
                    "halfway_mib": plan.peak_bytes / MiB,
                    "recomputed": sum(t.action == "recompute" for t in plan.tensors),
                    "memtracker_halfway": ratios[0],
                    "memtracker_smallest": ratios[1],
                    "train_diff_over_noise": (trained - reference).norm().item() / max(noise, 1e-30),
                    "trains_alike": trains_alike(trained, reference, noise),
                    "noise": noise,
                    "first_plan_s": first,
                    "later_plan_s": later,
                }
            )
            print(f"[{name}] {variant} {policy}: {rows[-1]['memtracker_halfway']:.3f}", file=sys.stderr, flush=True)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default=",".join(n for n in NAMES if n != "hf-resnet50"))
    ap.add_argument("--policies", default="checkpoint,optimal")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--size", type=int, default=32)
    ap.add_argument("--workspace-limit", type=parse_size, default=64 * MiB, help="per kernel, converted models")
    ap.add_argument("--db", default="sqlite://", help="measurement cache (default: a fresh one in memory)")
    ap.add_argument("--json", help="also write the rows to this file")
    args = ap.parse_args(argv)
    args.policies = args.policies.split(",")
    unknown = [m for m in args.models.split(",") if m not in NAMES]
    if unknown:
        ap.error(f"unknown model(s) {', '.join(unknown)}: {', '.join(NAMES)}")
    rows = [row for name in args.models.split(",") for row in bench(name, args, args.db)]
    print(
        table(
            [
                "model",
                "variant",
                "policy",
                "keep-all / smallest / halfway MiB",
                "recomputed",
                "MemTracker/plan halfway, smallest",
                "train diff / noise (alike)",
                "plan s (first, later)",
            ],
            [
                [
                    r["model"],
                    r["variant"],
                    r["policy"],
                    f"{r['everything_mib']:.1f} / {r['smallest_mib']:.1f} / {r['halfway_mib']:.1f}"
                    + ("" if r["fits"] else " (does not fit)"),
                    r["recomputed"],
                    f"{r['memtracker_halfway']:.3f}, {r['memtracker_smallest']:.3f}",
                    f"{r['train_diff_over_noise']:.2f} ({'yes' if r['trains_alike'] else 'NO'})",
                    f"{r['first_plan_s']:.1f}, {r['later_plan_s']:.1f}",
                ]
                for r in rows
            ],
        )
    )
    write_json(args.json, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
