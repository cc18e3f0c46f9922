"""WR against WD at equal memory on AlexNet (the paper's comparison), CPU backend.

WR gives every kernel its own limit M; WD divides one total among all kernels. At equal memory the
total is K x M (K = 15 kernels: 5 layers x 3 kinds), e.g. 15 x 8 MiB = 120 MiB. Both solve over the
same cached measurements; times are the sums of the measured micro-batch times of the chosen
configurations. A sweep of totals shows how WD's time falls as the budget grows.

    python benchmarks/kernels/bench_wr_vs_wd.py [--batch 64] [--per-kernel-mib 8] [--db URL] [--json FILE]
"""

from __future__ import annotations

import argparse
import platform
import sys
from datetime import date
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py, models.py
from common import table, write_json
from ucudnn.db import Cache
from ucudnn.solver.types import Infeasible

from ucudnn.backends.cpu import CpuBackend
from ucudnn.network.optimize import expand_kernels, optimize
from ucudnn.network.zoo import layers

MIB = 2**20


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--per-kernel-mib", type=int, default=8)
    parser.add_argument("--sweep-mib", default="16,32,64,120,240,480", help="WD totals to sweep (MiB)")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--db", help="measurement cache URL (default: the user cache)")
    parser.add_argument("--json", help="also write the results to this JSON file")
    args = parser.parse_args()

    backend = CpuBackend()
    cache = Cache(args.db)
    kernels = expand_kernels([(layer.name, layer.problem) for layer in layers("alexnet")], args.batch)
    per_kernel = args.per_kernel_mib * MIB
    common = {"policy": "powerOfTwo", "cache": cache, "reps": args.reps}
    wr = optimize(backend, kernels, workspace_limit=per_kernel, **common)
    equal = optimize(backend, kernels, total_workspace=len(kernels) * per_kernel, **common)
    rows = [
        [
            "WR",
            f"{args.per_kernel_mib} MiB x {len(kernels)}",
            f"{wr.time_ms:.1f}",
            f"{sum(k.config.workspace for k in wr.kernels) / MIB:.1f}",
            "1.00",
        ],
        [
            "WD",
            f"{len(kernels) * args.per_kernel_mib} MiB total",
            f"{equal.time_ms:.1f}",
            f"{equal.workspace / MIB:.1f}",
            f"{wr.time_ms / equal.time_ms:.2f}",
        ],
    ]
    results = {
        "batch": args.batch,
        "per_kernel_mib": args.per_kernel_mib,
        "wr_ms": wr.time_ms,
        "wd_equal_ms": equal.time_ms,
        "sweep": [],
    }
    for total_mib in [int(x) for x in args.sweep_mib.split(",")]:
        try:
            wd = optimize(backend, kernels, total_workspace=total_mib * MIB, **common)
        except Infeasible:
            rows.append(["WD", f"{total_mib} MiB total", "infeasible", "", "-"])
            continue
        rows.append(
            [
                "WD",
                f"{total_mib} MiB total",
                f"{wd.time_ms:.1f}",
                f"{wd.workspace / MIB:.1f}",
                f"{wr.time_ms / wd.time_ms:.2f}",
            ]
        )
        results["sweep"].append({"total_mib": total_mib, "wd_ms": wd.time_ms, "used_bytes": wd.workspace})
    cache.close()
    print(
        f"# AlexNet WR vs WD, batch {args.batch}, CPU backend ({platform.processor() or platform.machine()}, "
        f"{date.today()}); command: python benchmarks/kernels/bench_wr_vs_wd.py --batch {args.batch}"
    )
    print(table(["mode", "memory", "time ms", "workspace used MiB", "WR time / this"], rows))
    write_json(args.json, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
