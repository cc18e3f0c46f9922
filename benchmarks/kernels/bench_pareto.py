"""pareto.front on the paper's hard case: batch 256, every size 1..256 measured, 8 algorithms.

The measurement tables are synthetic and seeded (`synthetic_bench`): per algorithm a fixed
overhead a (0.02..0.3 ms) and a per-sample cost c (0.01..0.08 ms), time = (a + c b) x lognormal
noise (sigma 0.05); workspace linear in b (0.5..8 MiB per sample, plus up to 4 KiB), with two of
the eight algorithms needing none, and the faster per-sample algorithms the hungrier ones; 2 % of
the entries failed (infinite time). For each seeded kernel the script times `pareto.front`
without a limit and under a limit (the median workspace of the unlimited front), next to one
`wr.solve` on the same table (the single-limit DP the front generalises), interleaved rep by rep,
and checks that the front's fastest member is the WR optimum.

    python benchmarks/kernels/bench_pareto.py [--kernels 5] [--reps 5] [--batch 256] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py, models.py
from common import interleaved_medians_ms, table
from ucudnn.solver import MicroConfig, pareto, wr

MIB = 2**20
N_ALGOS = 8
TARGET_S = 0.2


def synthetic_bench(batch: int, seed: int, *, sizes: list[int] | None = None) -> dict[int, list[MicroConfig]]:
    """A seeded measurement table of N_ALGOS algorithms at every size in `sizes` (default 1..batch)."""
    rng = np.random.default_rng(seed)
    overhead_ms = rng.uniform(0.02, 0.3, N_ALGOS)
    per_sample_ms = rng.uniform(0.01, 0.08, N_ALGOS)
    per_sample_B = rng.uniform(0.5, 8.0, N_ALGOS) * MIB
    per_sample_B[rng.choice(N_ALGOS, 2, replace=False)] = 0
    by_workspace = np.argsort(per_sample_B)
    per_sample_ms[by_workspace] = np.sort(per_sample_ms)[::-1]  # hungrier algorithms are faster
    bench: dict[int, list[MicroConfig]] = {}
    for s in sizes or range(1, batch + 1):
        options = []
        for a in range(N_ALGOS):
            time_ms = float((overhead_ms[a] + per_sample_ms[a] * s) * rng.lognormal(0.0, 0.05))
            workspace_B = int(per_sample_B[a] * s) + (int(rng.integers(0, 4096)) if per_sample_B[a] else 0)
            if rng.random() < 0.02:
                time_ms = float("inf")
            options.append(MicroConfig(f"algo{a}", s, time_ms, workspace_B))
        bench[s] = options
    return bench


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--kernels", type=int, default=5, help="seeded synthetic kernels")
    parser.add_argument("--reps", type=int, default=5, help="interleaved timed runs (median)")
    parser.add_argument("--json", help="also write the results to this JSON file")
    args = parser.parse_args()

    rows, results = [], []
    for seed in range(args.kernels):
        bench = synthetic_bench(args.batch, seed)
        unlimited = pareto.front(bench, args.batch, None)
        limit = unlimited[len(unlimited) // 2].workspace
        limited = pareto.front(bench, args.batch, limit)
        for front, lim in ((unlimited, None), (limited, limit)):
            assert math.isclose(front[-1].time, wr.solve(bench, args.batch, lim).time, rel_tol=1e-12)
        times = interleaved_medians_ms(
            {
                "front": lambda bench=bench: pareto.front(bench, args.batch, None),
                "front_limited": lambda bench=bench, limit=limit: pareto.front(bench, args.batch, limit),
                "wr": lambda bench=bench: wr.solve(bench, args.batch, None),
            },
            reps=args.reps,
        )
        result = {
            "seed": seed,
            "front_members": len(unlimited),
            "limited_members": len(limited),
            "limit_B": limit,
            "front_s": times["front"] / 1e3,
            "front_limited_s": times["front_limited"] / 1e3,
            "wr_s": times["wr"] / 1e3,
        }
        results.append(result)
        rows.append(
            [
                seed,
                len(unlimited),
                f"{times['front'] / 1e3:.3f}",
                f"{limit / MIB:.0f}",
                len(limited),
                f"{times['front_limited'] / 1e3:.3f}",
                f"{times['wr'] / 1e3:.3f}",
                f"{times['front'] / times['wr']:.1f}x",
            ]
        )
    worst_s = max(max(r["front_s"], r["front_limited_s"]) for r in results)
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    print(
        f"pareto.front, batch {args.batch}, every size measured, {N_ALGOS} algorithms; "
        f"{platform.machine()} ({platform.node()}, {os.cpu_count()} CPUs, load {load}), "
        f"Python {platform.python_version()}, NumPy {np.__version__}"
    )
    print(table(["seed", "members", "front s", "limit MiB", "members", "limited s", "wr.solve s", "front/wr"], rows))
    print(f"worst {worst_s:.3f} s per kernel (target <= {TARGET_S} s): {'met' if worst_s <= TARGET_S else 'MISSED'}")
    if args.json:
        Path(args.json).write_text(
            json.dumps({"batch": args.batch, "target_s": TARGET_S, "results": results}, indent=2)
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
