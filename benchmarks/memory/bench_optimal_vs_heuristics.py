"""`optimal` against every heuristic policy on the zoo networks at several limits (simulated, no GPU needed).

For each network and each limit (a fraction of the everything-resident plan's peak), every policy plans
on the device profile; a row says whether `optimal` fits and its step, and the fastest fitting heuristic.
``beaten`` counts the cases where a heuristic fits and `optimal` does not, or is faster.

    python benchmarks/memory/bench_optimal_vs_heuristics.py --device h100
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py, models.py
from common import table

from ucudnn.devices import load_profile
from ucudnn.memory.graph import from_network
from ucudnn.memory.planner import available_policies, make_plan

NETWORKS = [
    ("alexnet", 256),
    ("vgg16", 128),
    ("resnet50", 128),
    ("googlenet", 128),
    ("densenet40", 64),
    ("resnet18", 128),
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="h100")
    ap.add_argument("--fractions", default="0.25,0.4,0.55,0.7,0.85,0.95")
    args = ap.parse_args()
    device = load_profile(args.device)
    rows, beaten, cases = [], 0, 0
    for network, batch in NETWORKS:
        graph = from_network(network, batch)
        resident = make_plan(graph, device, 2**40, "checkpoint").peak_bytes
        for fraction in (float(f) for f in args.fractions.split(",")):
            limit = int(resident * fraction)
            start = time.perf_counter()
            plans = {p: make_plan(graph, device, limit, p) for p in available_policies()}
            optimal = plans.pop("optimal")
            best = min((p for p in plans.values() if p.fits), key=lambda p: p.step_ms, default=None)
            lost = best is not None and (not optimal.fits or optimal.step_ms > best.step_ms * (1 + 1e-9))
            beaten += lost
            cases += 1
            rows.append(
                [
                    network,
                    batch,
                    f"{limit / 2**30:.2f}",
                    "yes" if optimal.fits else "no",
                    f"{optimal.step_ms:.1f}",
                    optimal.search or "",
                    best.policy if best else "-",
                    f"{best.step_ms:.1f}" if best else "-",
                    "BEATEN" if lost else "",
                    f"{time.perf_counter() - start:.1f}",
                ]
            )
    print(
        table(
            [
                "network",
                "batch",
                "limit GiB",
                "optimal fits",
                "optimal ms",
                "optimal's search",
                "best heuristic",
                "its ms",
                "",
                "s (all policies)",
            ],
            rows,
        )
    )
    print(f"optimal beaten in {beaten} of {cases} cases")


if __name__ == "__main__":
    main()
