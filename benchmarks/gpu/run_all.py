"""Every GPU figure of the cudnn backend, in one command, on any CUDA machine.

    python benchmarks/gpu/run_all.py OUT_DIR [--quick] [--db URL]

Prints one line per figure and writes OUT_DIR/figures.json (and each bench report as JSON):

- selftest: `run_selftest` on the cudnn backend (float32): checks passed, failed, excluded (wrong
  engines caught by verification, e.g. eng70 bwd_filter on the stride-2 h=9,w=8 problem);
- deepbench_fwd_float16 / _float32: DeepBench's training set (ucudnn.network.zoo "deepbench"), forward
  only, each problem at 4x its own batch, WR at 64 MiB per kernel: mean and max speedup over the
  undivided baseline (the paper's V100, float16: 1.60x mean, 4.54x max);
- alexnet_b256_wr_{8,64,512}MiB: WR plans of AlexNet at batch 256, with each plan executed back to
  back (all kernels, all micro-batches, queued behind a spin kernel between two CUDA events) next to
  its predicted time (the sum of the measured micro-configs): the goal is within 5%;
- resnet50_b64_wd_256MiB: the same for ResNet-50 at batch 64, WD with 256 MiB in all;
- resnet50_convert_step: one training step of torchvision's ResNet-50 (batch 64) through
  `ucudnn.torch.convert(..., backend="cudnn", workspace_limit=64 MiB)`, when torchvision imports.

Needs CuPy, the cuDNN frontend and libcudnn (the cudnn backend's requirements). The pure parts
(argument parsing, figure summaries, DeepBench kernels) are tested in tests/test_gpu_run_all.py.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

MIB = 2**20
ALEXNET_LIMITS_MIB = (8, 64, 512)
PREDICTION_GOAL = 0.05  # executed back to back within 5% of predicted


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir", type=Path, help="folder for figures.json and the bench reports")
    parser.add_argument("--quick", action="store_true", help="only the first 8 DeepBench problems: a smoke run")
    parser.add_argument("--db", default="sqlite://", help="measurement cache (default: in memory, fresh)")
    parser.add_argument("--reps", type=int, default=3, help="timed runs per measurement")
    return parser.parse_args(argv)


# ---- pure parts ----------------------------------------------------------------------------------
def deepbench_forward_kernels(dtype: str, factor: int = 4, limit: int | None = None):
    """DeepBench training problems, forward, at `factor` times their own batch, in `dtype`."""
    import dataclasses

    from ucudnn.network.zoo import layers

    chosen = layers("deepbench")[:limit]
    return [
        (layer.name, dataclasses.replace(layer.problem, n=layer.problem.n * factor, kind="fwd", dtype=dtype))
        for layer in chosen
    ]


def speedup_summary(speedups: Sequence[float]) -> dict:
    """Mean and max of the finite speedups (a kernel with no undivided baseline has none)."""
    finite = [s for s in speedups if math.isfinite(s)]
    return {
        "kernels": len(speedups),
        "with_baseline": len(finite),
        "mean_speedup": round(statistics.fmean(finite), 3) if finite else None,
        "max_speedup": round(max(finite), 3) if finite else None,
    }


def prediction_figure(predicted_ms: float, executed_ms: float) -> dict:
    """Predicted vs executed back to back, and whether it meets the 5% goal."""
    ratio = executed_ms / predicted_ms if predicted_ms > 0 else math.inf
    return {
        "predicted_ms": round(predicted_ms, 3),
        "executed_back_to_back_ms": round(executed_ms, 3),
        "executed_over_predicted": round(ratio, 4),
        "within_5_percent": abs(ratio - 1) <= PREDICTION_GOAL,
    }


def selftest_figure(report) -> dict:
    excluded = [f"{c.kind} {c.algo} on {c.problem}: {c.reason}" for c in report.checks if c.status == "excluded"]
    return {
        "passed": report.passed,
        "checks": len(report.checks),
        "pass": report.count("pass"),
        "fail": report.count("fail"),
        "skip": report.count("skip"),
        "excluded": excluded,
        "seconds": round(report.seconds, 1),
    }


# ---- GPU parts ---------------------------------------------------------------------------------------
def back_to_back_ms(work: Callable[[], None], reps: int = 10) -> float:
    """Median time (ms) of `work()` between two CUDA events, queued behind a spin kernel."""
    import cupy
    import numpy

    from ucudnn.backends.cuda_timing import _hold_kernel

    work()
    cupy.cuda.get_current_stream().synchronize()
    # CUDA 13 dropped clockRate from the properties: assume 2 GHz (a longer hold, never a shorter one)
    clock_khz = int(cupy.cuda.runtime.getDeviceProperties(cupy.cuda.runtime.getDevice()).get("clockRate", 2_000_000))
    stream = cupy.cuda.get_current_stream()
    start, end = cupy.cuda.Event(), cupy.cuda.Event()
    samples = []
    for _ in range(reps):
        _hold_kernel()((1,), (1,), (numpy.int64(50 * clock_khz),))  # 50 ms: the host queues everything meanwhile
        start.record(stream)
        work()
        end.record(stream)
        end.synchronize()
        samples.append(float(cupy.cuda.get_elapsed_time(start, end)))
    return statistics.median(samples)


def execute_report(backend, report) -> dict:
    """A bench report's plan executed back to back (every kernel, every micro-batch) vs its prediction."""
    from ucudnn.kernel.run import run_configuration

    jobs = []
    for k in report.kernels:
        operands = backend.random_operands(k.problem)
        workspace = backend.empty_workspace(k.config.workspace)
        jobs.append((k.problem, k.config, operands, workspace))

    def run_all() -> None:
        for problem, config, operands, workspace in jobs:
            run_configuration(backend, problem, config, workspace=workspace, **operands)

    return prediction_figure(report.time_ms, back_to_back_ms(run_all))


def bench(backend, kernels, out_dir: Path, name: str, *, cache, reps: int, policy="powerOfTwo", **limits):
    from ucudnn.network.optimize import optimize

    report = optimize(backend, kernels, policy=policy, cache=cache, reps=reps, **limits)
    (out_dir / f"{name}.json").write_text(json.dumps(report.to_json(), indent=2))
    return report


def resnet50_convert_step() -> dict:
    try:
        import torch
        import torchvision
    except ImportError as exc:
        return {"skipped": f"torch/torchvision not importable: {exc}"}
    from ucudnn.torch import convert

    model = convert(torchvision.models.resnet50(num_classes=100).cuda(), backend="cudnn", workspace_limit=64 * MIB)
    x = torch.randn(64, 3, 224, 224, device="cuda")
    y = torch.randint(0, 100, (64,), device="cuda")
    start = time.perf_counter()
    loss = torch.nn.functional.cross_entropy(model(x), y)
    loss.backward()
    torch.cuda.synchronize()
    return {"first_step_s": round(time.perf_counter() - start, 1), "loss_finite": bool(torch.isfinite(loss))}


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    from ucudnn.db import Cache

    from ucudnn.backends.cudnn import CudnnBackend
    from ucudnn.kernel.selftest import run_selftest
    from ucudnn.network.zoo import kernels as network_kernels

    backend = CudnnBackend()
    cache = Cache(args.db)
    figures: dict = {"device": backend.device.model, "versions": dict(backend.device.versions)}

    def record(name: str, value: dict) -> None:
        figures[name] = value
        print(json.dumps({name: value}), flush=True)
        (args.out_dir / "figures.json").write_text(json.dumps(figures, indent=2))

    record("selftest", selftest_figure(run_selftest(backend)))
    limit = 8 if args.quick else None
    for dtype in ("float16", "float32"):
        report = bench(
            backend,
            deepbench_forward_kernels(dtype, limit=limit),
            args.out_dir,
            f"deepbench_fwd_{dtype}",
            cache=cache,
            reps=args.reps,
            workspace_limit=64 * MIB,
        )
        record(f"deepbench_fwd_{dtype}", speedup_summary([k.speedup for k in report.kernels]))
    alexnet = network_kernels("alexnet", 256)
    for mib in ALEXNET_LIMITS_MIB:
        report = bench(
            backend,
            alexnet,
            args.out_dir,
            f"alexnet_b256_wr_{mib}MiB",
            cache=cache,
            reps=args.reps,
            workspace_limit=mib * MIB,
        )
        record(
            f"alexnet_b256_wr_{mib}MiB",
            {"speedup": round(report.baseline_ms / report.time_ms, 3), **execute_report(backend, report)},
        )
    resnet = network_kernels("resnet50", 64)
    report = bench(
        backend, resnet, args.out_dir, "resnet50_b64_wd_256MiB", cache=cache, reps=args.reps, total_workspace=256 * MIB
    )
    record(
        "resnet50_b64_wd_256MiB",
        {"speedup": round(report.baseline_ms / report.time_ms, 3), **execute_report(backend, report)},
    )
    record("resnet50_convert_step", resnet50_convert_step())
    cache.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
