"""WR micro-batching on AlexNet's five conv layers, CPU backend, measured side by side in one run.

For each per-kernel workspace limit (8 MiB and 64 MiB) and each candidate set (the NumPy algorithms
alone, and with PyTorch's `native` added), every kernel (fwd, bwd_data, bwd_filter) is run as:
  - undivided: the fastest algorithm at the whole batch within the limit (cuDNN-style selection);
  - WR powerOfTwo: the configuration `wr.solve` picked from sizes 1, 2, 4, ..., B;
  - WR all (conv2 only: `all` measures every size, which is slow on a CPU);
  - torch: `conv2d` / `conv2d_input` / `conv2d_weight` called once on the whole batch.
Each contender is executed for real (not summed from the benchmark table), interleaved rep by rep,
and the ratios are reported per kernel and in total.

    python benchmarks/kernels/bench_alexnet_wr.py [--batch 64] [--reps 5] [--db URL] [--json FILE]
"""

from __future__ import annotations

import argparse
import platform
import sys
from datetime import date
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py, models.py
from common import interleaved_medians_ms, table, write_json
from ucudnn.db import Cache
from ucudnn.solver.types import Configuration

from ucudnn.backends.cpu import CpuBackend
from ucudnn.kernel.run import run_configuration
from ucudnn.network.optimize import expand_kernels, optimize
from ucudnn.network.zoo import layers

MIB = 2**20
NUMPY_ALGOS = ["im2col_gemm", "shift_gemm", "fft", "winograd"]


def torch_call(problem, ops):
    import torch
    import torch.nn.grad as G

    t = {k: torch.from_numpy(v) for k, v in ops.items() if k != "out"}
    kw = {
        "stride": (problem.stride_h, problem.stride_w),
        "padding": (problem.pad_h, problem.pad_w),
        "dilation": (problem.dilation_h, problem.dilation_w),
        "groups": problem.groups,
    }
    if problem.kind == "fwd":
        return lambda: torch.nn.functional.conv2d(t["x"], t["w"], **kw)
    if problem.kind == "bwd_data":
        return lambda: G.conv2d_input(problem.x_shape, t["w"], t["dy"], **kw)
    return lambda: G.conv2d_weight(t["x"], problem.w_shape, t["dy"], **kw)


def runner(backend, problem, config, ops):
    workspace = backend.empty_workspace(config.workspace)
    return lambda: run_configuration(backend, problem, config, workspace=workspace, **ops)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--reps", type=int, default=5, help="interleaved timed runs per contender (median)")
    parser.add_argument("--measure-reps", type=int, default=3, help="reps of the WR benchmark phase")
    parser.add_argument("--db", help="measurement cache URL (default: the user cache)")
    parser.add_argument("--limits", default="8,64", help="per-kernel limits in MiB, comma-separated")
    parser.add_argument(
        "--skip-all",
        action="store_true",
        help="leave out WR `all` on conv2 (it measures 64 sizes; on 2 cores that takes most of an hour)",
    )
    parser.add_argument("--json", help="also write the results to this JSON file")
    args = parser.parse_args()

    backend = CpuBackend()
    cache = Cache(args.db)
    kernels = expand_kernels([(layer.name, layer.problem) for layer in layers("alexnet")], args.batch)
    results = []
    for limit_mib in [int(x) for x in args.limits.split(",")]:
        limit = limit_mib * MIB
        for label, algos in (("numpy", NUMPY_ALGOS), ("numpy+native", None)):
            print(f"[{limit_mib} MiB, {label}] benchmarking ...", file=sys.stderr, flush=True)
            pow2 = optimize(
                backend,
                kernels,
                policy="powerOfTwo",
                workspace_limit=limit,
                cache=cache,
                algos=algos,
                reps=args.measure_reps,
            )
            conv2 = [k for k in kernels if k[0] == "conv2"]
            every = (
                {}
                if args.skip_all
                else {
                    k.problem.kind: k.config
                    for k in optimize(
                        backend,
                        conv2,
                        policy="all",
                        workspace_limit=limit,
                        cache=cache,
                        algos=algos,
                        reps=args.measure_reps,
                    ).kernels
                }
            )
            for plan in pow2.kernels:
                p = plan.problem
                ops = backend.random_operands(p)
                contenders = {
                    "undivided": runner(backend, p, Configuration((plan.baseline,)), ops),
                    "wr_pow2": runner(backend, p, plan.config, ops),
                    "torch": torch_call(p, ops),
                }
                if plan.layer == "conv2" and every:
                    contenders["wr_all"] = runner(backend, p, every[p.kind], ops)
                t = interleaved_medians_ms(contenders, args.reps)
                results.append(
                    {
                        "limit_mib": limit_mib,
                        "candidates": label,
                        "layer": plan.layer,
                        "kind": p.kind,
                        "baseline_algo": plan.baseline.algo,
                        "config": plan.config.describe(),
                        "config_all": every[p.kind].describe() if plan.layer == "conv2" and every else None,
                        **{f"{name}_ms": v for name, v in t.items()},
                    }
                )
                print(
                    f"  {plan.layer:5s} {p.kind:10s} undivided {t['undivided']:8.1f} ms  "
                    f"WR {t['wr_pow2']:8.1f} ms  torch {t['torch']:8.1f} ms",
                    file=sys.stderr,
                    flush=True,
                )
    cache.close()
    print(report(results, args))
    write_json(args.json, results)
    return 0


def report(results, args) -> str:
    out = [
        (
            f"# AlexNet WR, batch {args.batch}, CPU backend ({platform.processor() or platform.machine()}, "
            f"{date.today()}); command: python benchmarks/kernels/bench_alexnet_wr.py --batch {args.batch} "
            f"--reps {args.reps}"
        )
    ]
    for limit_mib in sorted({r["limit_mib"] for r in results}):
        for label in ("numpy", "numpy+native"):
            rows = [r for r in results if r["limit_mib"] == limit_mib and r["candidates"] == label]
            if not rows:
                continue
            body = []
            for r in rows:
                body.append(
                    [
                        f"{r['layer']} {r['kind']}",
                        r["baseline_algo"],
                        r["config"],
                        f"{r['undivided_ms']:.1f}",
                        f"{r['wr_pow2_ms']:.1f}",
                        f"{r['torch_ms']:.1f}",
                        f"{r['undivided_ms'] / r['wr_pow2_ms']:.2f}",
                        f"{r['undivided_ms'] / r['wr_all_ms']:.2f}" if "wr_all_ms" in r else "",
                        f"{r['torch_ms'] / r['wr_pow2_ms']:.2f}",
                    ]
                )
            tot = {k: sum(r[k] for r in rows) for k in ("undivided_ms", "wr_pow2_ms", "torch_ms")}
            body.append(
                [
                    "total",
                    "",
                    "",
                    f"{tot['undivided_ms']:.1f}",
                    f"{tot['wr_pow2_ms']:.1f}",
                    f"{tot['torch_ms']:.1f}",
                    f"{tot['undivided_ms'] / tot['wr_pow2_ms']:.2f}",
                    "",
                    f"{tot['torch_ms'] / tot['wr_pow2_ms']:.2f}",
                ]
            )
            out += [
                "",
                f"## limit {limit_mib} MiB per kernel, candidates: {label}",
                table(
                    [
                        "kernel",
                        "undivided algo",
                        "WR powerOfTwo config",
                        "undiv ms",
                        "WR ms",
                        "torch ms",
                        "WR/undiv",
                        "WR-all/undiv",
                        "WR/torch",
                    ],
                    body,
                ),
            ]
    return "\n".join(out)


if __name__ == "__main__":
    sys.exit(main())
