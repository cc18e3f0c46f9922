"""The measurement cache's speed on SQLite and PostgreSQL, measured side by side in one run.

  - concurrent insert throughput: the four-writer test of tests/test_db_concurrency.py (spawned
    processes storing overlapping and distinct problems into one fresh cache at once, lookups in
    between); rows written in all / the slowest writer's time from open to its last store;
  - single-writer insert throughput, the same workload in one process, for comparison;
  - lookup latency on a warm cache of 50 problems x 3 kinds x 9 batch sizes x 5 algorithms
    (6,750 rows): one `Cache.lookup` per problem and kind (45 rows each), median and p95,
    and the time to open the cache (`Cache(url)`, which validates a SQLite file first).

PostgreSQL runs on a throwaway local server started with tests/pg_server.py (skipped, and said
so, when no server binaries are found).

    python benchmarks/cache/bench_db.py [--rounds 3] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py, models.py
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))  # the repository's tests/
from common import table
from pg_server import PgServer, PgUnavailable
from test_db_concurrency import ALGOS, BATCHES, DEVICE, WRITERS, micros_for, problem_key, problems_of, run_writers
from ucudnn.db import Cache
from ucudnn.solver.types import MicroConfig

PROBLEMS = 50
KINDS = ("fwd", "bwd_data", "bwd_filter")


def single_writer_rows_per_s(url: str) -> float:
    names = sorted({name for i in range(WRITERS) for name in problems_of(i)})
    with Cache(url) as cache:
        start = time.perf_counter()
        rows = sum(cache.store(problem_key=problem_key(n), micros=micros_for(n), **DEVICE) for n in names)
        return rows / (time.perf_counter() - start)


def warm_key(p: int, kind: str) -> str:
    return f"kind={kind},c={16 * (p % 8 + 1)},h={7 * (p % 5 + 1)},w={7 * (p % 5 + 1)},k={32 + p},r=3,s=3"


def fill_warm(url: str) -> int:
    with Cache(url) as cache:
        rows = 0
        for p in range(PROBLEMS):
            for kind in KINDS:
                ms = [
                    MicroConfig(a, b, 0.01 * (i + 1) * b, 1024 * i * b, spread=0.001)
                    for i, a in enumerate(ALGOS)
                    for b in BATCHES
                ]
                rows += cache.store(problem_key=warm_key(p, kind), micros=ms, **DEVICE)
        return rows


def lookup_latencies_ms(url: str) -> tuple[list[float], float]:
    open_ms = []
    for _ in range(5):
        start = time.perf_counter()
        Cache(url).close()
        open_ms.append((time.perf_counter() - start) * 1e3)
    samples = []
    with Cache(url) as cache:
        for rep in range(3):  # the first pass warms the pool and SQLAlchemy's statement cache
            for p in range(PROBLEMS):
                for kind in KINDS:
                    start = time.perf_counter()
                    found = cache.lookup(problem_key=warm_key(p, kind), batches=BATCHES, algos=ALGOS, **DEVICE)
                    elapsed = (time.perf_counter() - start) * 1e3
                    assert len(found) == len(ALGOS) * len(BATCHES)
                    if rep:
                        samples.append(elapsed)
    return samples, statistics.median(open_ms)


def bench_engine(name: str, new_url, rounds: int) -> dict:
    concurrent = []
    for _ in range(rounds):
        rows, seconds = run_writers(new_url())
        concurrent.append(rows / seconds)
    single = [single_writer_rows_per_s(new_url()) for _ in range(rounds)]
    url = new_url()
    rows = fill_warm(url)
    samples, open_ms = lookup_latencies_ms(url)
    samples.sort()
    return {
        "engine": name,
        "concurrent_rows_per_s": statistics.median(concurrent),
        "single_rows_per_s": statistics.median(single),
        "warm_rows": rows,
        "lookup_median_ms": statistics.median(samples),
        "lookup_p95_ms": samples[int(0.95 * (len(samples) - 1))],
        "lookups_per_network_ms": statistics.median(samples) * PROBLEMS * len(KINDS),
        "open_ms": open_ms,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3, help="fresh caches per insert figure (median)")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()

    results = []
    with tempfile.TemporaryDirectory(prefix="ucudnn-bench-db-") as folder:
        count = iter(range(10**6))
        results.append(bench_engine("sqlite", lambda: f"sqlite:///{folder}/c{next(count)}.db", args.rounds))
        try:
            server = PgServer().start()
        except PgUnavailable as exc:
            print(f"PostgreSQL skipped: {exc}", file=sys.stderr)
        else:
            try:
                results.append(bench_engine("postgresql", server.create_database, args.rounds))
            finally:
                server.stop()

    print(
        f"ucudnn cache benchmark: {platform.node()}, {platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} CPUs, Python {platform.python_version()}, load average "
        f"{' '.join(f'{x:.1f}' for x in os.getloadavg())}"
    )
    print(f"command: python benchmarks/cache/bench_db.py --rounds {args.rounds}")
    print(
        f"inserts: {WRITERS} spawned writers, {len(ALGOS) * len(BATCHES)} rows per problem; "
        f"lookups: {PROBLEMS} problems x {len(KINDS)} kinds x {len(BATCHES)} batches x "
        f"{len(ALGOS)} algos, one lookup per problem and kind\n"
    )
    print(
        table(
            [
                "engine",
                f"{WRITERS} writers rows/s",
                "1 writer rows/s",
                "lookup median ms",
                "lookup p95 ms",
                f"{PROBLEMS * len(KINDS)} lookups ms",
                "open ms",
            ],
            [
                [
                    r["engine"],
                    f"{r['concurrent_rows_per_s']:.0f}",
                    f"{r['single_rows_per_s']:.0f}",
                    f"{r['lookup_median_ms']:.2f}",
                    f"{r['lookup_p95_ms']:.2f}",
                    f"{r['lookups_per_network_ms']:.0f}",
                    f"{r['open_ms']:.1f}",
                ]
                for r in results
            ],
        )
    )
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
