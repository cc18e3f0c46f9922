"""Pruned benchmarks (`benchmark_limit`) against full measurement: what they time and what they choose.

Part 1, the zoo (`ucudnn networks`) on the CPU backend, WR (`--workspace`) or WD (`--total-workspace`, where
the pruning keeps Pareto fronts): each network's kernels are benchmarked in full (`benchmark_limit=0`), then
pruned (`--benchmark-limit`, default 10 as the handle's) on the same measurement cache, so
that both solve from the same timings and any difference is the pruning's alone. Per network: candidates
timed by each, and the chosen configurations' total time, pruned over full (the target: at most 1.05, on
every kernel too). Where the two choices differ, both are also run side by side
(`interleaved_samples_ms`, real runs of `run_configuration`), and that ratio is printed as well.

Part 2 (`--model hf-resnet50`): a converted library model's first training step from an empty cache,
with the default limit and with none, then in a second process on the first one's cache (warm):
measurements taken, taken from the cache, candidates pruned, seconds.

    OMP_NUM_THREADS=1 python benchmarks/kernels/bench_pruning.py --networks alexnet,resnet18 --batch 4
    OMP_NUM_THREADS=1 python benchmarks/kernels/bench_pruning.py --model hf-resnet50 --batch 4 --size 64
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py, models.py
from common import write_json
from ucudnn.db import Cache

from ucudnn.backends import get_backend
from ucudnn.kernel.measure import DEFAULT_BENCHMARK_LIMIT, interleaved_samples_ms
from ucudnn.kernel.run import PreparedConfiguration
from ucudnn.network.optimize import expand_kernels, optimize
from ucudnn.network.zoo import layers as network_layers

# The target: the pruned choice may be at most this much slower than full measurement's.
TARGET_RATIO = 1.05


def side_by_side(backend, problem, pruned, full, reps: int) -> float:
    """Median time of the pruned configuration over the full one's, run in turn on the same operands."""
    operands = backend.random_operands(problem)
    workspace = backend.empty_workspace(max(pruned.workspace, full.workspace))
    runs = {}
    for name, config in (("pruned", pruned), ("full", full)):
        prepared = PreparedConfiguration(backend, problem, config)
        prepared.run(workspace=workspace, **operands)  # the checked first run
        runs[name] = lambda p=prepared: p.run(workspace=workspace, **operands)
    samples = interleaved_samples_ms(runs, reps)
    return statistics.median(samples["pruned"]) / statistics.median(samples["full"])


def zoo(
    networks: list[str],
    batch: int,
    workspace: int,
    reps: int,
    check_reps: int,
    total_workspace: int | None = None,
    benchmark_limit: int = DEFAULT_BENCHMARK_LIMIT,
) -> list[dict]:
    backend = get_backend("cpu")
    rows = []
    for network in networks:
        kernels = [
            k for layer in network_layers(network, batch) for k in expand_kernels([(layer.name, layer.problem)], batch)
        ]
        with tempfile.TemporaryDirectory() as folder:
            cache = Cache(f"sqlite:///{folder}/cache.db")
            start = time.perf_counter()
            limits = {"total_workspace": total_workspace} if total_workspace else {"workspace_limit": workspace}
            full = optimize(backend, kernels, policy="powerOfTwo", cache=cache, reps=reps, benchmark_limit=0, **limits)
            full_s = time.perf_counter() - start
            pruned = optimize(
                backend, kernels, policy="powerOfTwo", cache=cache, reps=reps, benchmark_limit=benchmark_limit, **limits
            )
            cache.close()
        worst, differ, checked = 1.0, 0, []
        seen = set()
        for a, b in zip(pruned.kernels, full.kernels, strict=True):
            worst = max(worst, a.config.time / b.config.time)
            if a.config.micros != b.config.micros and (a.problem.key, a.problem.n) not in seen:
                seen.add((a.problem.key, a.problem.n))
                differ += 1
                checked.append(side_by_side(backend, a.problem, a.config, b.config, check_reps))
        row = {
            "network": network,
            "batch": batch,
            "mode": "WD" if total_workspace else "WR",
            "benchmark_limit": benchmark_limit,
            "kernels": len(kernels),
            "timed_full": full.stats.measured,
            "timed_pruned": pruned.stats.cached,
            "pruned": pruned.stats.pruned,
            "full_s": round(full_s, 1),
            "ratio_total": pruned.time_ms / full.time_ms,
            "ratio_worst_kernel": worst,
            "choices_differ": differ,
            "side_by_side_worst": max(checked, default=1.0),
        }
        rows.append(row)
        print(
            f"{network:>10}  batch {batch} {row['mode']} limit {benchmark_limit}: timed {row['timed_pruned']:5d} "
            f"of {row['timed_full']:5d} "
            f"({row['pruned']} pruned); chosen time pruned/full {row['ratio_total']:.3f} total, "
            f"{worst:.3f} worst kernel; {differ} choices differ, side by side worst "
            f"{row['side_by_side_worst']:.3f} ({full_s:.0f} s to measure in full)",
            flush=True,
        )
    return rows


def first_step(name: str, batch: int, size: int, reps: int, limit: int, db: str) -> dict:
    """A converted model's first training step (forward and backward) on the cache at `db`: what it measured,
    took from the cache and pruned, and its seconds."""
    import models  # torch and the `models` extra: part 2 only
    import torch

    from ucudnn.torch import convert

    torch.manual_seed(0)
    model, x, target = models.build(name, batch, size)
    converted = convert(model, backend="cpu", db=db, reps=reps, benchmark_limit=limit)
    handle = next(m for m in converted.modules() if hasattr(m, "handle")).handle
    start = time.perf_counter()
    models.loss(converted(x), target).backward()
    seconds = time.perf_counter() - start
    s = handle.stats
    handle.close()
    return {
        "model": name,
        "batch": batch,
        "size": size,
        "benchmark_limit": limit,
        "measured": s.measured,
        "cached": s.cached,
        "pruned": s.pruned,
        "over_limit": s.over_limit,
        "candidates": s.candidates,
        "step_s": round(seconds, 1),
    }


def model_step(name: str, batch: int, size: int, reps: int) -> list[dict]:
    """A converted model's first training step from an empty cache, pruned (default) and in full, then a second
    process's on the pruned run's cache (warm: it should measure nothing)."""
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        for limit, cache in ((DEFAULT_BENCHMARK_LIMIT, "empty"), (0, "empty"), (DEFAULT_BENCHMARK_LIMIT, "warm")):
            db = f"sqlite:///{folder}/{limit}.db"
            if cache == "empty":
                row = first_step(name, batch, size, reps, limit, db)
            else:  # a new process: nothing of the first one's memory, only its cache
                out = subprocess.run(
                    [
                        sys.executable,
                        __file__,
                        "--model",
                        name,
                        "--batch",
                        str(batch),
                        "--size",
                        str(size),
                        "--reps",
                        str(reps),
                        "--warm-db",
                        db,
                    ],
                    check=True,
                    capture_output=True,
                    text=True,
                ).stdout
                row = json.loads(out)
            rows.append({**row, "cache": cache})
            print(
                f"{name} batch {batch} {size} px, benchmark_limit {limit}, {cache} cache: {row['measured']} "
                f"measured, {row['cached']} cached, {row['pruned']} pruned, {row['over_limit']} over the limit, "
                f"of {row['candidates']} candidates; first step {row['step_s']:.1f} s",
                flush=True,
            )
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--networks", default="alexnet,resnet18,densenet40", help="zoo networks, comma-separated")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--workspace", type=int, default=64 << 20, help="WR limit per kernel, bytes")
    parser.add_argument("--total-workspace", type=int, help="WD instead: the network's workspace, bytes")
    parser.add_argument(
        "--benchmark-limit",
        type=int,
        default=DEFAULT_BENCHMARK_LIMIT,
        help="the pruned run's limit (the CPU backend has 5 algorithms: below 5 the limit bites)",
    )
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--check-reps", type=int, default=15, help="side-by-side runs of differing choices")
    parser.add_argument("--model", help="a benchmarks/models.py model for part 2 instead (e.g. hf-resnet50)")
    parser.add_argument("--size", type=int, default=64, help="--model's image size")
    parser.add_argument("--json", help="also write the rows here")
    parser.add_argument("--warm-db", help=argparse.SUPPRESS)  # model_step's second process: one step on this cache
    args = parser.parse_args()
    if args.warm_db:
        print(
            json.dumps(first_step(args.model, args.batch, args.size, args.reps, DEFAULT_BENCHMARK_LIMIT, args.warm_db))
        )
        return 0
    if args.model:
        rows = model_step(args.model, args.batch, args.size, args.reps)
    else:
        rows = zoo(
            [n for n in args.networks.split(",") if n],
            args.batch,
            args.workspace,
            args.reps,
            args.check_reps,
            args.total_workspace,
            args.benchmark_limit,
        )
        worst = max(max(r["ratio_worst_kernel"], r["side_by_side_worst"]) for r in rows)
        print(f"worst pruned/full: {worst:.3f} (target <= {TARGET_RATIO})")
    write_json(args.json, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
