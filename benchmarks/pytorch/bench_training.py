"""One training step (forward, backward, SGD) with ucudnn against plain PyTorch, on the CPU.

Models:
  - ResNet-20 for CIFAR (He et al. 2016, section 4.2): a 3x3 stem to 16 channels, then 3 stages of
    3 basic blocks at 16, 32 and 64 channels (32x32, 16x16, 8x8), the first block of stages 2 and
    3 strided; parameter-free identity shortcuts (the paper's option A: subsample, zero-pad the
    new channels); global average pool and a 10-way FC. 19 convolutions. Batch 128, 32x32 input.
  - AlexNet with the convolutions of `ucudnn.network.zoo` ("alexnet": Caffe's bvlc_alexnet shapes,
    227x227, grouped conv2/4/5), ReLU and 3x3/2 max-pools between them, and a small FC head
    (9216 -> 256 -> 10). Batch 32.

All contenders start from one state_dict. ucudnn is `ucudnn.torch.convert(model, backend="cpu",
workspace_limit=...)` (WR: each kernel may split its batch to fit the limit; `native`, PyTorch's own
convolution, is among the candidates); "undivided" is the paper's baseline, the same runtime with
policy "undivided" (cuDNN-style: the fastest single algorithm at the whole batch within the same
limit). The first ucudnn step measures every kernel and solves its
plan: it is timed on its own and reported as a one-off cost. Then, after warm-up, the step
functions run alternately (the order swapped every repetition, so drift and cache effects hit both
alike) and the medians are compared.

    python benchmarks/pytorch/bench_training.py [--models resnet20,alexnet] [--reps 10] [--workspace 64MiB]
                                        [--policy powerOfTwo] [--db URL] [--json FILE]
"""

from __future__ import annotations

import argparse
import copy
import os
import platform
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py, models.py
from common import interleaved_samples_ms, iqr, make_step, table, timed_ms, write_json

from ucudnn.network.zoo import layers as network_layers
from ucudnn.sizes import format_size, parse_size
from ucudnn.torch import convert

# ---- models ------------------------------------------------------------------------------------


class _CifarBlock(nn.Module):
    """Basic block with an option-A shortcut (He et al. 2016, section 4.2)."""

    def __init__(self, c_in: int, c_out: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.stride, self.extra = stride, c_out - c_in

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        shortcut = x[:, :, :: self.stride, :: self.stride] if self.stride > 1 else x
        if self.extra:
            shortcut = F.pad(shortcut, (0, 0, 0, 0, self.extra // 2, self.extra - self.extra // 2))
        return F.relu(out + shortcut)


class ResNet20(nn.Module):
    def __init__(self, num_classes: int = 10, blocks_per_stage: int = 3) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 16, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(16)
        stages, c_in = [], 16
        for stage, width in enumerate((16, 32, 64)):
            blocks = []
            for b in range(blocks_per_stage):
                blocks.append(_CifarBlock(c_in, width, 2 if stage > 0 and b == 0 else 1))
                c_in = width
            stages.append(nn.Sequential(*blocks))
        self.layer1, self.layer2, self.layer3 = stages
        self.fc = nn.Linear(64, num_classes)

    def forward(self, x):
        x = F.relu(self.bn1(self.conv1(x)))
        x = self.layer3(self.layer2(self.layer1(x)))
        return self.fc(x.mean((2, 3)))


class AlexNet(nn.Module):
    """The zoo's AlexNet convolutions (ucudnn.network.zoo "alexnet") with a small FC head."""

    def __init__(self, num_classes: int = 10) -> None:
        super().__init__()
        convs = []
        for layer in network_layers("alexnet", 1):
            p = layer.problem
            convs.append(
                nn.Conv2d(
                    p.c, p.k, (p.r, p.s), stride=(p.stride_h, p.stride_w), padding=(p.pad_h, p.pad_w), groups=p.groups
                )
            )
        self.conv1, self.conv2, self.conv3, self.conv4, self.conv5 = convs
        self.fc1 = nn.Linear(256 * 6 * 6, 256)
        self.fc2 = nn.Linear(256, num_classes)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv1(x)), 3, 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 3, 2)
        x = F.relu(self.conv4(F.relu(self.conv3(x))))
        x = F.max_pool2d(F.relu(self.conv5(x)), 3, 2)
        return self.fc2(F.relu(self.fc1(x.flatten(1))))


MODELS = {"resnet20": (ResNet20, 128, 32), "alexnet": (AlexNet, 32, 227)}  # class, batch, resolution


# ---- timing ------------------------------------------------------------------------------------


def bench_model(name: str, args) -> dict:
    cls, batch, resolution = MODELS[name]
    torch.manual_seed(0)
    reference = cls()
    model = convert(
        copy.deepcopy(reference),
        backend="cpu",
        workspace_limit=args.workspace,
        policy=args.policy,
        db=args.db,
        reps=args.measure_reps,
    )
    # The paper's baseline: cuDNN-style selection, the fastest single algorithm at the whole batch
    # within the same limit (the same handle machinery with policy "undivided").
    undivided = convert(
        copy.deepcopy(reference),
        backend="cpu",
        workspace_limit=args.workspace,
        policy="undivided",
        db=args.db,
        reps=args.measure_reps,
    )
    handle = model.conv1.handle
    g = torch.Generator().manual_seed(1)
    x = torch.randn(batch, 3, resolution, resolution, generator=g)
    y = torch.randint(0, 10, (batch,), generator=g)
    steps = {
        "torch": make_step(reference, x, y),
        "ucudnn": make_step(model, x, y),
        "undivided": make_step(undivided, x, y),
    }

    print(f"[{name}] first ucudnn step (benchmarks every kernel) ...", file=sys.stderr, flush=True)
    first_ms = timed_ms(steps["ucudnn"])
    stats = handle.stats
    print(
        f"[{name}] first step {first_ms / 1e3:.1f} s ({stats.measured} measured, {stats.cached} cached); "
        f"first undivided step ...",
        file=sys.stderr,
        flush=True,
    )
    timed_ms(steps["undivided"])
    print(f"[{name}] timing {args.reps} alternating steps ...", file=sys.stderr, flush=True)
    samples = interleaved_samples_ms(steps, args.reps, args.warmup)
    t_torch, t_ucudnn, t_undivided = (statistics.median(samples[k]) for k in ("torch", "ucudnn", "undivided"))

    changed = []
    for c in sorted(handle.choices(), key=lambda c: (list(dict(model.named_modules())).index(c.layer), c.kind)):
        base = c.baseline
        if c.micro_batched or base is None or base.algo != c.config.micros[0].algo:
            changed.append(
                {
                    "layer": c.layer,
                    "kind": c.kind,
                    "baseline": f"1x{base.batch}:{base.algo}" if base else "(none fits)",
                    "baseline_ms": base.time if base else None,
                    "config": c.config.describe(),
                    "config_ms": c.config.time,
                    "workspace": c.config.workspace,
                }
            )
    return {
        "model": name,
        "batch": batch,
        "resolution": resolution,
        "torch_ms": t_torch,
        "torch_iqr_ms": iqr(samples["torch"]),
        "ucudnn_ms": t_ucudnn,
        "ucudnn_iqr_ms": iqr(samples["ucudnn"]),
        "undivided_ms": t_undivided,
        "undivided_iqr_ms": iqr(samples["undivided"]),
        "ratio": t_torch / t_ucudnn,
        "ratio_undivided": t_undivided / t_ucudnn,
        "undivided_algos": sorted({m.algo for c in undivided.conv1.handle.choices() for m in c.config.micros}),
        "first_step_ms": first_ms,
        "one_off_ms": first_ms - t_ucudnn,
        "benchmark_s": stats.seconds,
        "measured": stats.measured,
        "cached": stats.cached,
        "kernels": len(handle.choices()),
        "peak_workspace": handle.peak_workspace,
        "algos": sorted({m.algo for c in handle.choices() for m in c.config.micros}),
        "changed": changed,
        "samples": samples,
    }


def report(results: list[dict], args) -> str:
    threads = torch.get_num_threads()
    cpu = platform.processor() or platform.machine()
    lines = [
        (
            f"# one training step (forward + backward + SGD), CPU, {threads} torch threads, {cpu}, "
            f"{os.cpu_count()} cores"
        ),
        (
            f"command: python benchmarks/pytorch/bench_training.py --models {args.models} --reps {args.reps} "
            f"--workspace {format_size(args.workspace)} --policy {args.policy}"
            + (f" --db {args.db}" if args.db != "sqlite://" else "")
            + (f" --threads {args.threads}" if args.threads else "")
        ),
        f"1-minute load average {args.load[0]:.1f} before, {args.load[1]:.1f} after (other work shares the machine)",
        "",
    ]
    rows = [
        [
            r["model"],
            r["batch"],
            f"{r['torch_ms']:.1f} ± {r['torch_iqr_ms']:.1f}",
            f"{r['undivided_ms']:.1f} ± {r['undivided_iqr_ms']:.1f}",
            f"{r['ucudnn_ms']:.1f} ± {r['ucudnn_iqr_ms']:.1f}",
            f"{r['ratio']:.3f}",
            f"{r['ratio_undivided']:.3f}",
            f"{r['one_off_ms'] / 1e3:.1f} s",
            f"{len(r['changed'])}/{r['kernels']}",
            format_size(r["peak_workspace"]),
        ]
        for r in results
    ]
    lines.append(
        table(
            [
                "model",
                "batch",
                "torch ms/step",
                "undivided ms/step",
                "ucudnn ms/step",
                "torch/ucudnn",
                "undivided/ucudnn",
                "one-off (1st step)",
                "kernels changed",
                "peak workspace",
            ],
            rows,
        )
    )
    lines.append(
        "(ms: median of alternating steps ± interquartile range; a ratio > 1 means ucudnn is faster. "
        "undivided: cuDNN-style selection within the same limit, no micro-batches)"
    )
    for r in results:
        lines += [
            "",
            (
                f"## {r['model']}: kernels whose plan differs from undivided cuDNN-style selection "
                f"(fastest single algorithm at the whole batch within {format_size(args.workspace)}); "
                f"algorithms used: {', '.join(r['algos'])} (undivided: {', '.join(r['undivided_algos'])})"
            ),
        ]
        if not r["changed"]:
            lines.append("(none: every kernel runs its undivided fastest algorithm)")
            continue
        lines.append(
            table(
                ["layer", "kind", "undivided", "ms", "ucudnn plan", "ms", "workspace"],
                [
                    [
                        c["layer"],
                        c["kind"],
                        c["baseline"],
                        f"{c['baseline_ms']:.2f}" if c["baseline_ms"] else "-",
                        c["config"],
                        f"{c['config_ms']:.2f}",
                        format_size(c["workspace"]),
                    ]
                    for c in r["changed"]
                ],
            )
        )
        lines.append("(ms here: the benchmark's per-kernel measurements, not the step timing)")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="resnet20,alexnet", help="comma-separated: " + ", ".join(MODELS))
    parser.add_argument("--reps", type=int, default=10, help="timed steps per contender (median)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per contender after the first")
    parser.add_argument("--workspace", type=parse_size, default=64 * 2**20, help="WR limit per kernel (64MiB)")
    parser.add_argument("--policy", default="powerOfTwo")
    parser.add_argument("--measure-reps", type=int, default=3, help="timed runs per measurement")
    parser.add_argument(
        "--db",
        default="sqlite://",
        help="measurement cache (default: a fresh in-memory one, so that the one-off cost is real)",
    )
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's own choice)")
    parser.add_argument("--json", help="also write the results to this JSON file")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    names = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = [m for m in names if m not in MODELS]
    if unknown:
        parser.error(f"unknown model(s) {', '.join(unknown)}; choose from {', '.join(MODELS)}")
    load_before = os.getloadavg()[0]
    results = [bench_model(name, args) for name in names]
    args.load = (load_before, os.getloadavg()[0])
    print(report(results, args))
    write_json(args.json, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
