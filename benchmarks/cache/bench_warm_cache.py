"""End-to-end `ucudnn bench` on ResNet-50 from a cold and from a warm measurement cache.

Runs the real command in a subprocess (start-up, cache look-ups, solving and printing included):
  1. cold: WR, batch 64, powerOfTwo, into a new SQLite cache;
  2. warm: the same command again (it must measure nothing);
  3. warm WD: batch 32 with a 1 GiB total (native declares large workspaces); its sizes 1..32 are
     a subset of the cold run's.
A cold run of every CPU algorithm over ResNet-50 takes hours on 2 cores, so `--algos` restricts the
candidates (default: native); the warm figures depend on the number of cached rows, not on which
algorithms they hold.

    python benchmarks/cache/bench_warm_cache.py [--algos native] [--reps 1]
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py, models.py
from common import table


def run(argv: list[str]) -> tuple[float, dict]:
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "ucudnn.cli.main", *argv], capture_output=True, text=True, check=False)
    seconds = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"ucudnn {' '.join(argv)} failed ({proc.returncode}): {proc.stderr.strip()}")
    return seconds, json.loads(proc.stdout)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--algos", default="native")
    parser.add_argument("--reps", default="1")
    parser.add_argument("--warm-runs", type=int, default=3, help="warm runs of each command (median)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        db = str(Path(tmp) / "cache.db")
        common = [
            "--network",
            "resnet50",
            "--policy",
            "powerOfTwo",
            "--backend",
            "cpu",
            "--algos",
            args.algos,
            "--reps",
            args.reps,
            "--db",
            db,
            "--json",
            "--quiet",
        ]
        wr = ["bench", "--batch", "64", *common]
        wd = ["bench", "--batch", "32", "--total-workspace", "1GiB", *common]
        cold_s, cold = run(wr)
        warm = [run(wr) for _ in range(args.warm_runs)]
        warm_wd = [run(wd) for _ in range(args.warm_runs)]
    warm_s = sorted(s for s, _ in warm)[len(warm) // 2]
    wd_s = sorted(s for s, _ in warm_wd)[len(warm_wd) // 2]
    assert all(r["benchmark"]["measured"] == 0 for _, r in warm + warm_wd), "a warm run measured something"
    rows = [
        ["cold WR, batch 64", f"{cold_s:.2f}", cold["benchmark"]["measured"], cold["benchmark"]["cached"], ""],
        ["warm WR, batch 64", f"{warm_s:.2f}", 0, warm[0][1]["benchmark"]["cached"], f"{cold_s / warm_s:.0f}x"],
        ["warm WD, batch 32, 1 GiB", f"{wd_s:.2f}", 0, warm_wd[0][1]["benchmark"]["cached"], ""],
    ]
    print(
        f"# ResNet-50 end to end, CPU backend, algos {args.algos}, reps {args.reps} "
        f"({platform.processor() or platform.machine()}, {date.today()}); "
        f"command: python benchmarks/cache/bench_warm_cache.py --algos {args.algos}"
    )
    print(table(["run", "seconds", "measured", "cached", "cold / warm"], rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
