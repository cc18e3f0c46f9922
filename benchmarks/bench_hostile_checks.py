"""What issue 15's checks cost, measured side by side in one run.

  - `db import` of an export of 6,750 measurements (50 problems x 3 kinds x 9 batch sizes x 5
    algorithms, realistic keys and names) into a fresh SQLite cache, with every record checked as
    a fresh measurement would be, against the same import with the checks switched off;
  - the pre-check that bench and Handle run before measuring (`resources.check_can_run`: support,
    then memory) over every distinct kernel of ResNet-50, per kernel.

Rounds alternate between the two variants (each goes first in half of them), so both see the
same machine load.

    python benchmarks/bench_hostile_checks.py [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from common import table  # noqa: E402

from ucudnn.db import Cache, transfer  # noqa: E402
from ucudnn.problem import KINDS, ConvProblem  # noqa: E402

ALGOS = ("im2col_gemm", "shift_gemm", "fft", "winograd", "native")
BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def write_export(path: Path) -> int:
    lines = [{"type": "header", "format": transfer.EXPORT_FORMAT, "version": transfer.EXPORT_VERSION}]
    for i in range(50):
        base = ConvProblem(c=16 + i, h=28, w=28, k=64, r=3, s=3, pad_h=1, pad_w=1)
        for kind in KINDS:
            key = base.with_kind(kind).key
            for algo in ALGOS:
                for batch in BATCHES:
                    lines.append({"type": "measurement", "device": "Intel Xeon (2 cores)", "backend": "cpu",
                                  "versions": "numpy=2.1.0,scipy=1.14.0", "problem_key": key, "kind": kind,
                                  "algo": algo, "batch": batch, "time_ms": 0.1 * batch, "spread_ms": 0.01,
                                  "workspace_bytes": 4096 * batch, "reason": "",
                                  "created_at": "2026-11-01T00:00:00.000000Z"})
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return len(lines) - 1


def import_seconds(source: Path, folder: Path, checked: bool, round_: int) -> float:
    original = transfer.check_measurement
    if not checked:
        transfer.check_measurement = lambda record, now: None
    try:
        with Cache(folder / f"{'checked' if checked else 'unchecked'}-{round_}.db") as cache:
            start = time.perf_counter()
            transfer.import_into(cache, str(source))
            return time.perf_counter() - start
    finally:
        transfer.check_measurement = original


def precheck_us(rounds: int) -> tuple[int, float]:
    from ucudnn.backends.cpu import CpuBackend
    from ucudnn.network.zoo import layers
    from ucudnn.kernel.resources import check_can_run

    backend = CpuBackend()
    problems = {p.key: p for layer in layers("resnet50", 32) for p in (layer.problem.with_kind(k) for k in KINDS)}
    samples = []
    for _ in range(rounds):
        start = time.perf_counter()
        for problem in problems.values():
            check_can_run(backend, problem, sizes=[1, 2, 4, 8, 16, 32])
        samples.append((time.perf_counter() - start) / len(problems) * 1e6)
    return len(problems), statistics.median(samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        source = folder / "export.jsonl"
        records = write_export(source)
        times: dict[bool, list[float]] = {True: [], False: []}
        for r in range(args.rounds):
            for checked in ((False, True) if r % 2 else (True, False)):  # each goes first half the time
                times[checked].append(import_seconds(source, folder, checked, r))
    checked, unchecked = statistics.median(times[True]), statistics.median(times[False])
    print(table(["db import of an export", "records", "median s", "records/s"], [
        ["without the checks", records, f"{unchecked:.2f}", f"{records / unchecked:,.0f}"],
        ["with every record checked", records, f"{checked:.2f}", f"{records / checked:,.0f}"],
    ]))
    print(f"checked / unchecked: {checked / unchecked:.3f}  ({args.rounds} rounds, interleaved)")
    kernels, per_kernel = precheck_us(args.rounds)
    print(f"pre-check (support + memory) over ResNet-50's {kernels} distinct kernels: "
          f"{per_kernel:.1f} us per kernel, median of {args.rounds} rounds")


if __name__ == "__main__":
    main()
