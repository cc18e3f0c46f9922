"""WR micro-batching on the 3-D U-Net's layers (ucudnn networks unet3d), CPU backend, side by side.

Each kernel (fwd, bwd_data, bwd_filter) of each chosen layer is run, for real and interleaved rep by rep, as:
  - undivided: the fastest algorithm at the whole batch within the per-kernel limit (framework-style
    selection); where none fits, the one needing the least workspace, as `ucudnn bench` falls back;
  - WR: the configuration `optimize` (powerOfTwo) chose within the limit;
  - torch: PyTorch's own convolution (`native`: conv3d, conv_transpose3d, convolution_backward) on the
    whole batch with no limit, which is what the limit keeps the undivided contender from running.
The `native@B` column is the workspace ucudnn charges torch's own at the whole batch (its result and
unfolded columns): over the limit wherever the undivided contender is not native.

On a 2-core CPU the full-size network is slow (533 GFLOP per forward pass at batch 1; its second
layer alone is 203), so the default takes the layers under `--max-gflop` per sample and forward pass
(14 of 18, every kind of layer among them: the up-convolutions, the concatenating convs, the 1x1x1).

    python benchmarks/kernels/bench_unet3d_wr.py [--batch 4] [--limit 512] [--max-gflop 40] [--layers a,b] [--reps 3]
"""

from __future__ import annotations

import argparse
import platform
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py, models.py
from common import interleaved_medians_ms, table, write_json
from ucudnn.db import Cache
from ucudnn.solver.types import Configuration

from ucudnn.backends.cpu import NATIVE, CpuBackend
from ucudnn.kernel.run import run_configuration
from ucudnn.network.optimize import BASELINE_LEAST_WORKSPACE, expand_kernels, optimize
from ucudnn.network.zoo import layers

MIB = 2**20


def cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        model = next(line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name"))
        cpus = next(line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("CPU(s)"))
        return f"{model}, {cpus} cores"
    except (OSError, subprocess.CalledProcessError, StopIteration):
        return platform.processor() or platform.machine()


def runner(backend, problem, config, ops):
    workspace = backend.empty_workspace(config.workspace)
    return lambda: run_configuration(backend, problem, config, workspace=workspace, **ops)


def torch_runner(backend, problem, ops):
    launch = backend.prepare_run(problem, NATIVE)  # torch allocates its own temporaries
    x, w, dy, out = (ops.get(name) for name in ("x", "w", "dy", "out"))
    return lambda: launch(x, w, dy, out, None, 1.0, 0.0)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--limit", type=int, default=512, help="per-kernel workspace limit, MiB")
    parser.add_argument(
        "--max-gflop",
        type=float,
        default=40.0,
        help="leave out layers whose forward pass costs more per sample (GFLOP)",
    )
    parser.add_argument("--layers", help="comma-separated layer names (overrides --max-gflop)")
    parser.add_argument("--reps", type=int, default=3, help="interleaved timed runs per contender (median)")
    parser.add_argument("--measure-reps", type=int, default=3, help="reps of the WR benchmark phase")
    parser.add_argument("--db", help="measurement cache URL (default: the user cache)")
    parser.add_argument("--json", help="also write the results to this JSON file")
    args = parser.parse_args()

    net = layers("unet3d", args.batch)
    if args.layers:
        wanted = args.layers.split(",")
        unknown = set(wanted) - {layer.name for layer in net}
        if unknown:
            parser.error(f"unknown layers {sorted(unknown)}; see `ucudnn networks unet3d`")
        chosen = [layer for layer in net if layer.name in wanted]
    else:
        chosen = [layer for layer in net if layer.problem.flops / args.batch / 1e9 <= args.max_gflop]
    backend = CpuBackend()
    cache = Cache(args.db)
    limit = args.limit * MIB
    kernels = expand_kernels([(layer.name, layer.problem) for layer in chosen], args.batch)
    print(f"benchmarking {len(kernels)} kernels of {len(chosen)} layers ...", file=sys.stderr, flush=True)
    report = optimize(backend, kernels, policy="powerOfTwo", workspace_limit=limit, cache=cache, reps=args.measure_reps)
    cache.close()
    results = []
    for plan in report.kernels:
        p = plan.problem
        ops = backend.random_operands(p)
        t = interleaved_medians_ms(
            {
                "undivided": runner(backend, p, Configuration((plan.baseline,)), ops),
                "wr": runner(backend, p, plan.config, ops),
                "torch": torch_runner(backend, p, ops),
            },
            args.reps,
        )
        results.append(
            {
                "layer": plan.layer,
                "kind": p.kind,
                "spec": p.spec,
                "baseline": plan.baseline.algo + ("*" if plan.baseline_rule == BASELINE_LEAST_WORKSPACE else ""),
                "config": plan.config.describe(),
                "wr_workspace": plan.config.workspace,
                "native_workspace": backend.workspace_size(p, NATIVE),
                **{f"{name}_ms": v for name, v in t.items()},
            }
        )
        print(
            f"  {plan.layer:12s} {p.kind:10s} undivided {t['undivided']:9.1f} ms  WR {t['wr']:9.1f} ms  "
            f"torch {t['torch']:9.1f} ms",
            file=sys.stderr,
            flush=True,
        )
    print(render(results, args, report))
    write_json(args.json, results)
    return 0


def render(results, args, report) -> str:
    command = " ".join(["python benchmarks/kernels/bench_unet3d_wr.py", *sys.argv[1:]])
    when = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    # WR's configuration can be the undivided one itself (`=`): those pairs time one thing twice, and
    # how far their ratio strays from 1 is the noise of this run.
    same = [r for r in results if r["config"] == f"1x{args.batch}:{r['baseline'].rstrip('*')}"]
    rows = [
        [
            f"{r['layer']} {r['kind']}",
            r["baseline"],
            r["config"] + (" =" if r in same else ""),
            f"{r['native_workspace'] / MIB:.0f}",
            f"{r['undivided_ms']:.1f}",
            f"{r['wr_ms']:.1f}",
            f"{r['torch_ms']:.1f}",
            f"{r['undivided_ms'] / r['wr_ms']:.2f}",
            f"{r['torch_ms'] / r['wr_ms']:.2f}",
        ]
        for r in results
    ]
    total = {k: sum(r[k] for r in results) for k in ("undivided_ms", "wr_ms", "torch_ms")}
    rows.append(
        [
            "total",
            "",
            "",
            "",
            f"{total['undivided_ms']:.1f}",
            f"{total['wr_ms']:.1f}",
            f"{total['torch_ms']:.1f}",
            f"{total['undivided_ms'] / total['wr_ms']:.2f}",
            f"{total['torch_ms'] / total['wr_ms']:.2f}",
        ]
    )
    fits = sum(r["native_workspace"] <= args.limit * MIB for r in results)
    strays = [abs(r["undivided_ms"] / r["wr_ms"] - 1) for r in same]
    noise = (
        f"; the {len(same)} kernels where WR keeps the undivided configuration (=) time it twice: ratios within "
        f"{max(strays):.0%} of 1"
        if same
        else ""
    )
    return "\n".join(
        [
            f"# 3-D U-Net WR, batch {args.batch}, limit {args.limit} MiB per kernel, CPU backend ({cpu_model()}, {when})",
            f"# command: {command}",
            f"# benchmark: {report.stats.measured} measured, {report.stats.cached} cached, "
            f"{report.stats.over_limit} over the limit; native fits the limit undivided on {fits} of {len(results)} kernels"
            + noise,
            "",
            table(
                [
                    "kernel",
                    "undivided algo",
                    "WR powerOfTwo config",
                    "native@B MiB",
                    "undiv ms",
                    "WR ms",
                    "torch ms",
                    "WR/undiv",
                    "WR/torch",
                ],
                rows,
            ),
        ]
    )


if __name__ == "__main__":
    sys.exit(main())
