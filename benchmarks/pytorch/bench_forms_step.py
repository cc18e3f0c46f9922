"""Converted training steps against plain PyTorch's, on models with every convolution form (CPU, WR and WD where
the workspace limit does not bind).

Models (``--models``, ``all``: every one): the zoo's hand-written ResNet-18 and every model of `models.py` (the
`models` and `bench` extras: Hugging Face ResNet-50, MobileNetV2, ConvNeXt, RegNet, EfficientNet (an nn.Conv2d
subclass) and Wav2Vec2 (a Conv1d feature encoder, a weight-normed grouped Conv1d), diffusers' UNet2DModel and
AutoencoderKL, MONAI's 2-D UNet (ConvTranspose2d) and 3-D BasicUNet (Conv3d, ConvTranspose3d)). From one
state, these contenders (``--contenders``) train (forward, backward, SGD with momentum) on the same batch:

  - torch: the model as written, and "torch again": a copy of it on the same parameters (the timing's noise: its
    ratio is what two runs of one plain model differ by);
  - WR: ``convert(model)``, its defaults (no workspace limit); WR 64MiB and WR 1GiB: ``convert(model,
    workspace_limit=...)``;
  - WD 1GiB: ``convert(model, total_workspace="1GiB")``.

The first steps measure and plan; the warm-up rounds after them (`TRIAL_STEPS`) run the in-step trials against
PyTorch's own convolution: each NumPy-planned kernel's, then each routed layer's backward pass. Then the contenders' steps take turns, the order reversed every round, and
the medians are compared: the ratios are what a user gets, measured side by side. ``--runs N`` repeats the
interleaved timing N times on the same models (the first steps' measuring and trials are not timed) and prints
every run's ratio and the worst; ``--clock cpu`` times each step by this process's CPU time, which a loaded
machine does not inflate (one thread: ``OMP_NUM_THREADS=1``). ``routed`` counts the kernels
that run through ucudnn's own code rather than torch's (the rest are torch's, chosen on measurements);
``binds`` the kernels whose torch convolution on the whole batch needs more workspace than the limit (its
column buffers, as the cpu backend declares them): where it is 0, the limit does not bind.

    python benchmarks/pytorch/bench_forms_step.py [--models resnet18,monai-basic-unet-3d,hf-wav2vec2,monai-unet | all]
        [--contenders "WR 64MiB,WD 1GiB"] [--reps 9] [--runs 3] [--clock cpu] [--db URL] [--json FILE]
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py, models.py
from common import interleaved_medians_ms, keep_freed_memory, make_step, table, write_json
from models import build, loss

from ucudnn.backends.cpu import NATIVE
from ucudnn.torch import convert, zoo
from ucudnn.torch.converting.layer import ConvLayer
from ucudnn.torch.converting.route_cost import TRIAL_STEPS

# name -> (batch, size): a step of a second or less on a 2-core CPU
SHAPES = {
    "resnet18": (4, 64),
    "hf-resnet50": (4, 64),
    "hf-mobilenet-v2": (4, 64),
    "hf-convnext": (4, 64),
    "hf-regnet": (4, 64),
    "hf-efficientnet": (4, 64),
    "hf-wav2vec2": (2, 25),
    "diffusers-unet": (4, 32),
    "diffusers-vae": (4, 32),
    "monai-unet": (4, 64),
    "monai-basic-unet-3d": (1, 32),
}
HANDLES = {
    "WR": {},
    "WR 64MiB": {"workspace_limit": "64MiB"},
    "WR 1GiB": {"workspace_limit": "1GiB"},
    "WD 1GiB": {"total_workspace": "1GiB"},
}


def _build(name: str):
    batch, size = SHAPES[name]
    if name != "resnet18":
        return build(name, batch, size)
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    return (
        zoo.build(name, num_classes=10),
        torch.randn(batch, 3, size, size, generator=g),
        torch.randint(0, 10, (batch,), generator=g),
    )


def routed(model) -> int:
    """How many of the model's kernels run ucudnn's own code (the others are torch's own convolution)."""
    return sum(
        getattr(route, kind) is not None
        for m in model.modules()
        if isinstance(m, ConvLayer)
        for route in m._routes.values()
        if route.generation == m.handle.generation
        for kind in ("fwd", "bwd_data", "bwd_filter")
    )


def binds(model) -> int:
    """How many of the model's kernels would need more workspace than the handle's limit as torch's own
    convolution on the whole batch."""
    handle = next(m.handle for m in model.modules() if isinstance(m, ConvLayer))
    limit = handle.workspace_limit if handle.mode == "WR" else handle.total_workspace
    if limit is None:
        return 0
    return sum(handle.backend.workspace_size(c.problem, NATIVE) > limit for c in handle.choices())


def sharing_parameters(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of `model` with the same parameter objects (its buffers copied). Every contender computes on the
    same weights: two copies of one plain model, each with its own weights, differ by several percent a step on
    this machine (where the allocator placed them), which would read as a converted model's cost or gain."""
    return copy.deepcopy(model, memo={id(p): p for p in model.parameters()})


def bench(name: str, args) -> list[dict]:
    reference, x, y = _build(name)
    log = lambda msg: print(f"[{name}] {msg}", file=sys.stderr, flush=True)
    models = {"torch": reference, "torch again": sharing_parameters(reference)}
    for contender in args.contenders.split(","):
        options = HANDLES[contender]
        start = time.perf_counter()
        models[contender] = convert(sharing_parameters(reference), backend="cpu", db=args.db, **options)
        make_step(models[contender], x, y, loss=loss)()
        log(f"{contender}: the first step (measuring, planning) took {time.perf_counter() - start:.1f} s")
    steps = {key: make_step(m, x, y, loss=loss) for key, m in models.items()}
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    runs = []
    for run in range(args.runs):
        runs.append(interleaved_medians_ms(steps, args.reps, args.warmup if run == 0 else 1, clock))
        log("run {}: {}".format(run + 1, ", ".join(f"{k} {v / runs[-1]['torch']:.3f}" for k, v in runs[-1].items())))
    convs = sum(isinstance(m, ConvLayer) for m in models[args.contenders.split(",")[0]].modules())
    return [
        {
            "model": name,
            "batch": SHAPES[name][0],
            "size": SHAPES[name][1],
            "contender": key,
            "convolutions": convs,
            "ms": [round(med[key], 2) for med in runs],
            "ratios": [round(med[key] / med["torch"], 3) for med in runs],
            "routed_kernels": None if key not in HANDLES else routed(models[key]),
            "binding_kernels": None if key not in HANDLES else binds(models[key]),
        }
        for key in steps
    ]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--models",
        default="resnet18,monai-basic-unet-3d,hf-wav2vec2,monai-unet",
        help=f"comma-separated, or all: {','.join(SHAPES)}",
    )
    ap.add_argument("--contenders", default=",".join(HANDLES), help=f"comma-separated: {','.join(HANDLES)}")
    ap.add_argument("--reps", type=int, default=9, help="timed steps per contender, interleaved")
    ap.add_argument("--runs", type=int, default=1, help="interleaved timings, one after another")
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall", help="cpu: this process's CPU time")
    ap.add_argument(
        "--warmup", type=int, default=TRIAL_STEPS, help="untimed rounds (default: as many as the in-step trials take)"
    )
    ap.add_argument("--db", default=None, help="measurement cache (default: the user's; sqlite:// for a fresh one)")
    ap.add_argument("--json", help="also write the rows to this file")
    args = ap.parse_args(argv)
    names = list(SHAPES) if args.models == "all" else args.models.split(",")
    unknown = [m for m in names if m not in SHAPES]
    if unknown:
        ap.error(f"unknown model(s) {', '.join(unknown)}: {', '.join(SHAPES)}")
    unknown = [c for c in args.contenders.split(",") if c not in HANDLES]
    if unknown:
        ap.error(f"unknown contender(s) {', '.join(unknown)}: {', '.join(HANDLES)}")
    keep_freed_memory()  # the steps time compute, not the page faults of memory handed back between them
    rows = [row for name in names for row in bench(name, args)]
    print(
        table(
            ["model", "batch x size", "contender", "ms/step", "vs torch, each run", "worst", "routed", "binds"],
            [
                [
                    r["model"],
                    f"{r['batch']} x {r['size']}",
                    r["contender"],
                    "/".join(f"{ms:.0f}" for ms in r["ms"]),
                    ", ".join(f"{q:.3f}" for q in r["ratios"]),
                    f"{max(r['ratios']):.3f}",
                    "-" if r["routed_kernels"] is None else r["routed_kernels"],
                    "-" if r["binding_kernels"] is None else r["binding_kernels"],
                ]
                for r in rows
            ],
        )
    )
    write_json(args.json, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
