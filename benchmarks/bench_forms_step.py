"""Converted training steps against plain PyTorch's, on models with every convolution form (CPU, WR and WD where
the workspace limit does not bind).

Models (``--models``): the zoo's hand-written ResNet-18 and, from the `models` extra (`models.py`), MONAI's 3-D
BasicUNet (Conv3d, ConvTranspose3d), Hugging Face Wav2Vec2 (a Conv1d feature encoder, a weight-normed grouped
Conv1d), MONAI's 2-D UNet (ConvTranspose2d) and Hugging Face EfficientNet (an nn.Conv2d subclass). From one
state, three contenders train (forward, backward, SGD with momentum) on the same batch:

  - torch: the model as written;
  - WR 64MiB and WR 1GiB: ``convert(model, workspace_limit=...)``;
  - WD 1GiB: ``convert(model, total_workspace="1GiB")``.

The first steps measure and plan; the warm-up rounds after them run each NumPy-planned kernel's in-step trial
against PyTorch's own convolution. Then the contenders' steps take turns, the order reversed every round, and
the medians are compared: the ratios are what a user gets, measured side by side. ``routed`` counts the kernels
that run through ucudnn's own code rather than torch's (the rest are torch's, chosen on measurements);
``binds`` the kernels whose torch convolution on the whole batch needs more workspace than the limit (its
column buffers, as the cpu backend declares them): where it is 0, the limit does not bind.

    python benchmarks/bench_forms_step.py [--models resnet18,monai-basic-unet-3d,hf-wav2vec2,monai-unet]
        [--reps 9] [--db URL] [--json FILE]
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import interleaved_medians_ms, table  # noqa: E402
from models import build, loss  # noqa: E402

from ucudnn.backends.cpu import NATIVE  # noqa: E402
from ucudnn.torch import convert, zoo  # noqa: E402
from ucudnn.torch.layer import TRIAL_RUNS, ConvLayer  # noqa: E402

# name -> (batch, size): a step of a second or less on a 2-core CPU
SHAPES = {"resnet18": (4, 64), "monai-basic-unet-3d": (1, 32), "hf-wav2vec2": (2, 25), "monai-unet": (4, 64),
          "hf-efficientnet": (4, 64)}
HANDLES = {"WR 64MiB": {"workspace_limit": "64MiB"}, "WR 1GiB": {"workspace_limit": "1GiB"},
           "WD 1GiB": {"total_workspace": "1GiB"}}


def _build(name: str):
    batch, size = SHAPES[name]
    if name != "resnet18":
        return build(name, batch, size)
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    return zoo.build(name, num_classes=10), torch.randn(batch, 3, size, size, generator=g), \
        torch.randint(0, 10, (batch,), generator=g)


def step_fn(model, x, y):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        loss(model(x), y).backward()
        optimizer.step()

    return step


def routed(model) -> int:
    """How many of the model's kernels run ucudnn's own code (the others are torch's own convolution)."""
    return sum(getattr(route, kind) is not None for m in model.modules() if isinstance(m, ConvLayer)
               for route in m._routes.values() if route.generation == m.handle.generation
               for kind in ("fwd", "bwd_data", "bwd_filter"))


def binds(model) -> int:
    """How many of the model's kernels would need more workspace than the handle's limit as torch's own
    convolution on the whole batch."""
    handle = next(m.handle for m in model.modules() if isinstance(m, ConvLayer))
    limit = handle.workspace_limit if handle.mode == "WR" else handle.total_workspace
    return sum(handle.backend.workspace_size(c.problem, NATIVE) > limit for c in handle.choices())


def bench(name: str, args) -> list[dict]:
    reference, x, y = _build(name)
    log = lambda msg: print(f"[{name}] {msg}", file=sys.stderr, flush=True)  # noqa: E731
    models = {"torch": reference}
    for contender, options in HANDLES.items():
        start = time.perf_counter()
        models[contender] = convert(copy.deepcopy(reference), backend="cpu", db=args.db, **options)
        step_fn(models[contender], x, y)()
        log(f"{contender}: the first step (measuring, planning) took {time.perf_counter() - start:.1f} s")
    steps = {key: step_fn(m, x, y) for key, m in models.items()}
    med = interleaved_medians_ms(steps, args.reps, args.warmup)
    convs = sum(isinstance(m, ConvLayer) for m in models["WD 1GiB"].modules())
    return [{"model": name, "batch": SHAPES[name][0], "size": SHAPES[name][1], "contender": key,
             "convolutions": convs, "ms": round(med[key], 2), "ratio": round(med[key] / med["torch"], 3),
             "routed_kernels": None if key == "torch" else routed(models[key]),
             "binding_kernels": None if key == "torch" else binds(models[key])} for key in steps]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="resnet18,monai-basic-unet-3d,hf-wav2vec2,monai-unet")
    ap.add_argument("--reps", type=int, default=9, help="timed steps per contender, interleaved")
    ap.add_argument("--warmup", type=int, default=2 * (TRIAL_RUNS + 1),
                    help="untimed rounds (default: as many as a kernel's in-step trial takes)")
    ap.add_argument("--db", default=None, help="measurement cache (default: the user's; sqlite:// for a fresh one)")
    ap.add_argument("--json", help="also write the rows to this file")
    args = ap.parse_args(argv)
    unknown = [m for m in args.models.split(",") if m not in SHAPES]
    if unknown:
        ap.error(f"unknown model(s) {', '.join(unknown)}: {', '.join(SHAPES)}")
    rows = [row for name in args.models.split(",") for row in bench(name, args)]
    print(table(["model", "batch x size", "contender", "ms/step", "vs torch", "routed", "binds"],
                [[r["model"], f"{r['batch']} x {r['size']}", r["contender"], f"{r['ms']:.1f}", f"{r['ratio']:.3f}",
                  "-" if r["routed_kernels"] is None else r["routed_kernels"],
                  "-" if r["binding_kernels"] is None else r["binding_kernels"]] for r in rows]))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
