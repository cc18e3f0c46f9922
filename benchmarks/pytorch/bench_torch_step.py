"""One training step (forward, backward, SGD) of plain PyTorch against ucudnn WR and WD, in one run.

Models (torchvision is not required: the two real ones come from `ucudnn.torch.zoo`, with
torchvision's layer shapes, so the script runs wherever torch does):
  - tiny: two 3x3 convolutions (3->8->8) and a linear head, batch 2 on 8x8 (host overhead dominates).
  - resnet50: ResNet-50 v1.5 as torchvision builds it (7x7/2 stem, bottlenecks [3, 4, 6, 3] with the
    stride on the 3x3 convolution, 1x1 projections, batch norm, 1000-way FC).
  - vgg16: VGG-16 (configuration D: 13 3x3 convolutions, 5 max-pools), with torchvision's
    adaptive 7x7 pool and a reduced classifier (512*7*7 -> 256 -> 1000) to keep CPU runs short.

Contenders, all from one state_dict: torch (nn.Conv2d); ucudnn WR (`convert(model,
workspace_limit=64MiB)`); ucudnn WD (`convert(model, total_workspace=W)`, no `announce`: the first
forward pass registers the layers and the next one solves). W is `--wd-total`, by default the sum
of the WR plans' workspaces (so that WD can at least give every kernel its WR configuration; WR
itself holds only its largest one, reusing one buffer).
The first steps of the ucudnn contenders measure and solve their plans and are reported
separately; then, after warm-up, the step functions run alternately (order swapped every
repetition) and medians are compared. Peak memory: on CUDA, torch.cuda.max_memory_allocated over
two steps of each contender, less what was allocated before them (all three models, their
optimizer states and ucudnn's workspaces are resident throughout; no gradients), plus the workspace
the contender's own handle holds (WR's buffer, WD's arena of W bytes); ucudnn's workspaces come
from torch's allocator, so it sees everything. On the CPU, ucudnn's peak workspace (torch's own CPU allocations are not
counted).

    OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 python benchmarks/pytorch/bench_torch_step.py \\
        [--models tiny,resnet50,vgg16] [--batch N] [--resolution R] [--device cpu|cuda] [--reps 20]
        [--policy powerOfTwo] [--algos native,...] [--wd-total SIZE]
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py, models.py
from common import iqr, make_step, table, timed_ms, write_json

from ucudnn.handle import SEGMENT_ALIGN_BYTES
from ucudnn.sizes import format_size, parse_size
from ucudnn.torch import convert, zoo


class Tiny(nn.Module):
    def __init__(self, num_classes: int = 4) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1)
        self.fc = nn.Linear(8, num_classes)

    def forward(self, x):
        return self.fc(F.relu(self.conv2(F.relu(self.conv1(x)))).mean((2, 3)))


MODELS = {
    "tiny": (Tiny, 2, 8, 4),
    "resnet50": (lambda: zoo.build("resnet50"), 2, 64, 1000),
    "vgg16": (lambda: zoo.build("vgg16"), 2, 32, 1000),
}
# (class, CPU batch, CPU resolution, classes); on CUDA the defaults are batch 64 at 224x224.


def bench(name: str, args) -> dict:
    cls, batch, resolution, classes = MODELS[name]
    cuda = args.device == "cuda"
    batch = args.batch or (64 if cuda and name != "tiny" else batch)
    resolution = args.resolution or (224 if cuda and name != "tiny" else resolution)
    device = torch.device(args.device)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    backend = "cudnn" if cuda else "cpu"
    options = {
        "backend": backend,
        "policy": args.policy,
        "db": args.db,
        "reps": args.measure_reps,
        "algos": args.algos.split(",") if args.algos else None,
    }
    torch.manual_seed(0)
    reference = cls().to(device)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(batch, 3, resolution, resolution, generator=g).to(device)
    y = torch.randint(0, classes, (batch,), generator=g).to(device)

    wr = convert(copy.deepcopy(reference), workspace_limit=args.workspace, **options)
    steps = {"torch": make_step(reference, x, y, sync), "WR": make_step(wr, x, y, sync)}
    print(
        f"[{name}] b{batch} {resolution}x{resolution}: first WR step (plans every kernel) ...",
        file=sys.stderr,
        flush=True,
    )
    first = {"WR": timed_ms(steps["WR"])}
    wr_handle = next(m.handle for m in wr.modules() if hasattr(m, "handle"))
    # WD can at least give every kernel its WR configuration (segments start 256-byte aligned)
    total = args.wd_total or sum(c.config.workspace + SEGMENT_ALIGN_BYTES for c in wr_handle.choices())
    wd = convert(copy.deepcopy(reference), total_workspace=total, **options)
    steps["WD"] = make_step(wd, x, y, sync)
    wd_handle = next(m.handle for m in wd.modules() if hasattr(m, "handle"))
    print(f"[{name}] first WD steps (learn the layers, then solve) ...", file=sys.stderr, flush=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first["WD"] = timed_ms(steps["WD"]) + timed_ms(steps["WD"])
    late = sum("LateRegistration" in type(w.message).__name__ for w in caught)

    peaks = {}
    if cuda:
        # All three contenders stay resident (models, optimizer states, ucudnn's workspaces), so each
        # one's figure is its peak above that, plus the workspace its own handle holds throughout.
        steps["torch"]()  # its momentum buffers exist from here on, as the others' do
        held = {"torch": 0, "WR": wr_handle.peak_workspace, "WD": total}
        for key, step in steps.items():
            for model in (reference, wr, wd):  # no contender's gradients are resident
                model.zero_grad(set_to_none=True)
            torch.cuda.reset_peak_memory_stats()
            resident = torch.cuda.memory_allocated()
            step()
            step()
            peaks[key] = torch.cuda.max_memory_allocated() - resident + held[key]
    for _ in range(args.warmup):
        for step in steps.values():
            step()
    samples = {key: [] for key in steps}
    names = list(steps)
    print(f"[{name}] timing {args.reps} alternating steps ...", file=sys.stderr, flush=True)
    for rep in range(args.reps):
        for key in names if rep % 2 == 0 else names[::-1]:
            samples[key].append(timed_ms(steps[key]))
    med = {key: statistics.median(v) for key, v in samples.items()}
    plans = {key: h.choices() for key, h in (("WR", wr_handle), ("WD", wd_handle))}
    return {
        "model": name,
        "batch": batch,
        "resolution": resolution,
        "device": args.device,
        "ms": med,
        "iqr_ms": {k: iqr(v) for k, v in samples.items()},
        "ratio": {k: med[k] / med["torch"] for k in ("WR", "WD")},
        "first_step_ms": first,
        "wd_total": total,
        "wd_late_warnings": late,
        "peak_workspace": {"WR": wr_handle.peak_workspace, "WD": wd_handle.peak_workspace},
        "peak_memory": peaks,
        "torch_kernels": {
            k: sum(len(c.config.micros) == 1 and c.config.micros[0].algo == "native" for c in v)
            for k, v in plans.items()
        },
        "call_overhead_ms": wr_handle.call_overhead,
        "kernels": {k: len(v) for k, v in plans.items()},
        "micro_batched": {k: sum(c.micro_batched for c in v) for k, v in plans.items()},
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="tiny,resnet50,vgg16", help="comma-separated: " + ", ".join(MODELS))
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--batch", type=int, help="mini-batch (default: 2 on the CPU, 64 on CUDA; tiny: 2)")
    parser.add_argument("--resolution", type=int, help="input size (default: per model on the CPU, 224 on CUDA)")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--workspace", type=parse_size, default=64 * 2**20, help="WR limit per kernel (64MiB)")
    parser.add_argument("--wd-total", type=parse_size, help="WD total (default: sum of the WR plans' workspaces)")
    parser.add_argument("--policy", default="powerOfTwo")
    parser.add_argument("--algos", help="restrict ucudnn's candidate algorithms (comma-separated; default: all)")
    parser.add_argument("--measure-reps", type=int, default=3)
    parser.add_argument("--db", default="sqlite://", help="measurement cache (default: a fresh in-memory one)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads on the CPU (1)")
    parser.add_argument("--json", help="also write the results to this JSON file")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    names = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = [m for m in names if m not in MODELS]
    if unknown:
        parser.error(f"unknown model(s) {', '.join(unknown)}; choose from {', '.join(MODELS)}")
    load = os.getloadavg()[0]
    results = [bench(name, args) for name in names]
    print(
        f"# one training step, torch vs ucudnn WR ({format_size(args.workspace)}/kernel) and WD, {args.device}, "
        f"{torch.get_num_threads()} torch thread(s); 1-min load {load:.1f} -> {os.getloadavg()[0]:.1f}"
    )
    print("command: python benchmarks/pytorch/bench_torch_step.py " + " ".join(sys.argv[1:]))
    rows = []
    for r in results:
        mem = r["peak_memory"]
        rows.append(
            [
                r["model"],
                f"{r['batch']}x{r['resolution']}",
                f"{r['ms']['torch']:.2f}",
                f"{r['ms']['WR']:.2f}",
                f"{r['ms']['WD']:.2f}",
                f"{r['ratio']['WR']:.2f}",
                f"{r['ratio']['WD']:.2f}",
                format_size(r["peak_workspace"]["WR"]),
                (f"{format_size(r['peak_workspace']['WD'])} of {format_size(r['wd_total'])}"),
                " / ".join(format_size(mem[k]) for k in ("torch", "WR", "WD")) if mem else "-",
                f"{r['torch_kernels']['WR']}/{r['kernels']['WR']}, {r['torch_kernels']['WD']}/{r['kernels']['WD']}",
                f"{r['call_overhead_ms'] * 1e3:.0f}",
                r["wd_late_warnings"],
            ]
        )
    print(
        table(
            [
                "model",
                "batch",
                "torch ms",
                "WR ms",
                "WD ms",
                "WR/torch",
                "WD/torch",
                "WR workspace",
                "WD workspace",
                "peak torch/WR/WD",
                "torch-run kernels WR, WD",
                "charge us",
                "WD late warnings",
            ],
            rows,
        )
    )
    print(
        "(ms: median of alternating steps; a ratio below 1 means ucudnn is faster; torch-run kernels: those whose "
        "plan is torch's own convolution on the whole batch, which torch runs itself; charge: the host cost per "
        "kernel call charged to every other plan, Handle.call_overhead)"
    )
    write_json(args.json, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
