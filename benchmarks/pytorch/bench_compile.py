"""torch.compile of a converted model against torch.compile of the plain model, in one run.

The model (`--model`) is ResNet-18's layer shapes by default (7x7/2 stem, max-pool, basic blocks [2, 2, 2, 2]
with 1x1 projections, batch norm, 1000-way FC; defined here, torchvision is not required), or one of
`benchmarks/models.py`'s models nobody here wrote (`hf-mobilenet-v2`, ...; `--channels-last` gives model and
input that memory format). One state_dict, two contenders: torch (nn.Conv2d) and ucudnn (`convert(model,
backend=..., policy=...)`), each trained with SGD (momentum 0.9), the model compiled with
`torch.compile(model, mode=--mode)`. The converted model first runs eager until its kernels' and layers'
in-step trials have closed (`TRIAL_STEPS`), as a user's first steps would.

Figures, each a ratio ucudnn / torch measured in this process:

- compile: the first compiled step (Dynamo, AOTAutograd, Inductor, then the step itself), each
  contender compiled `--compile-rounds` times, alternately, after `torch._dynamo.reset()` and with
  Inductor's on-disk caches off; medians. The converted model's kernels are planned by one eager
  step before (planning measures kernels: that is not compiling); its compiled graph finds the
  plans in the layers' route caches.
- step: a compiled training step (forward, backward, SGD), the two contenders alternately,
  `--reps` times after warm-up; medians (`ucudnn.kernel.measure.interleaved_medians_ms`).
- eager step: the same without compiling (for reference).
- on CUDA, host: the time a compiled step takes to return to Python without a device
  synchronisation, medians (what CUDA graphs remove: with `--mode reduce-overhead` the converted
  convolutions run inside the graphs, so their launches cost no host time per micro-batch).

    OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 python benchmarks/pytorch/bench_compile.py --threads 1 [--algos native]
        [--batch 8] [--resolution 64] [--reps 20] [--policy undivided] [--compile-rounds 2]
        [--model hf-mobilenet-v2 [--channels-last] [--no-layout-optimization]]
    python benchmarks/pytorch/bench_compile.py --device cuda --mode reduce-overhead --batch 64 --resolution 224
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py, models.py
from common import interleaved_medians_ms, make_step, table
from models import NAMES, build, loss

from ucudnn.torch import convert, zoo
from ucudnn.torch.converting.layer import ConvLayer
from ucudnn.torch.converting.route_cost import TRIAL_STEPS


def first_step_s(model: nn.Module, x, y, mode: str, sync) -> float:
    """Seconds of the first step of a fresh compile of `model` (compiling, then running once)."""
    torch._dynamo.reset()
    step = make_step(torch.compile(model, mode=mode), x, y, sync, loss)
    start = time.perf_counter()
    step()
    return time.perf_counter() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=("resnet18", *NAMES), default="resnet18")
    parser.add_argument("--channels-last", action="store_true", help="model and input channels-last")
    parser.add_argument(
        "--no-layout-optimization",
        action="store_true",
        help="Inductor's layout optimization off (it makes convolutions channels-last where its "
        "heuristics say so, and sees aten.convolution only, not ucudnn's operators)",
    )
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--resolution", type=int, default=64)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument(
        "--mode", default=None, help="torch.compile mode (default: torch's; 'reduce-overhead' for CUDA graphs)"
    )
    parser.add_argument("--policy", default="undivided")
    parser.add_argument(
        "--algos",
        help="comma-separated candidate algorithms (default: the backend's all); "
        "'native' alone routes every kernel through ucudnn's operators with "
        "torch computing it: the cost of the integration itself",
    )
    parser.add_argument("--threads", type=int, help="torch.set_num_threads (default: torch's)")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--compile-rounds", type=int, default=2, help="0: time the steps only")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        parser.error("--device cuda needs a CUDA GPU")
    # every compile from scratch: Inductor's caches would make the second round of a contender free
    torch._inductor.config.fx_graph_cache = False
    torch._inductor.config.autotune_local_cache = False
    torch._functorch.config.enable_autograd_cache = False
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 16)
    torch._inductor.config.layout_optimization = not args.no_layout_optimization
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    torch.manual_seed(0)
    if args.model == "resnet18":
        g = torch.Generator().manual_seed(1)
        plain = zoo.build("resnet18")
        x = torch.randn(args.batch, 3, args.resolution, args.resolution, generator=g)
        y = torch.randint(0, 1000, (args.batch,), generator=g)
    else:
        plain, x, y = build(args.model, args.batch, args.resolution)
    fmt = torch.channels_last if args.channels_last else torch.contiguous_format
    plain, x, y = plain.to(device, memory_format=fmt), x.to(device, memory_format=fmt), y.to(device)
    options = {"algos": args.algos.split(",")} if args.algos else {}
    ours = convert(copy.deepcopy(plain), backend="cudnn" if cuda else "cpu", policy=args.policy, **options)
    models = {"torch": plain, "ucudnn": ours}

    eager_step = make_step(ours, x, y, sync, loss)
    plan_start = time.perf_counter()
    eager_step()  # plans every kernel on real tensors
    plan_s = time.perf_counter() - plan_start
    for _ in range(TRIAL_STEPS):  # the in-step trials (CPU handles)
        eager_step()

    compile_s: dict[str, list[float]] = {name: [] for name in models}
    for r in range(args.compile_rounds):
        for name in models if r % 2 == 0 else reversed(list(models)):
            compile_s[name].append(first_step_s(models[name], x, y, args.mode, sync))
    torch._dynamo.reset()
    compiled = {name: make_step(torch.compile(m, mode=args.mode), x, y, sync, loss) for name, m in models.items()}
    eager = {f"{name} eager": make_step(m, x, y, sync, loss) for name, m in models.items()}
    steps = interleaved_medians_ms({**compiled, **eager}, reps=args.reps, warmup=3)
    results = {
        "model": args.model,
        "channels_last": args.channels_last,
        "layout_optimization": not args.no_layout_optimization,
        "batch": args.batch,
        "resolution": args.resolution,
        "device": args.device,
        "mode": args.mode,
        "policy": args.policy,
        "algos": args.algos,
        "threads": torch.get_num_threads(),
        "plan_s": plan_s,
        "compile_s": {name: statistics.median(v) for name, v in compile_s.items() if v},
        "step_ms": steps,
    }
    if cuda:  # host time: the step returns before the device finishes
        no_sync = {
            name: make_step(torch.compile(m, mode=args.mode), x, y, lambda: None, loss) for name, m in models.items()
        }
        host = interleaved_medians_ms(no_sync, reps=args.reps, warmup=3)
        torch.cuda.synchronize()
        results["host_ms"] = host
    routed = sum(
        k is not None
        for m in ours.modules()
        if isinstance(m, ConvLayer)
        for r in m._routes.values()
        for k in (r.fwd, r.bwd_data, r.bwd_filter)
    )
    results["kernels_through_ucudnn"] = routed

    def row(figure: str, values: dict, digits: int) -> list[str]:
        return [
            figure,
            f"{values['torch']:.{digits}f}",
            f"{values['ucudnn']:.{digits}f}",
            f"{values['ucudnn'] / values['torch']:.3f}x",
        ]

    rows = [row("compile (first step), s", results["compile_s"], 1)] if args.compile_rounds else []
    rows += [
        row("compiled step, ms", steps, 1),
        row("eager step, ms", {name: steps[f"{name} eager"] for name in models}, 1),
    ]
    if cuda:
        rows.append(row("compiled step host time, ms", results["host_ms"], 2))
    print(
        f"# {args.model}{' channels-last' if args.channels_last else ''}"
        f"{', no layout optimization' if args.no_layout_optimization else ''}, batch {args.batch}, "
        f"{args.resolution}x{args.resolution}, {args.device}, "
        f"mode={args.mode}, policy {args.policy}, algos {args.algos or 'all'}, {torch.get_num_threads()} "
        f"thread(s); {routed} kernel(s) routed through ucudnn; planning {plan_s:.1f} s"
    )
    print(table(["figure", "torch", "ucudnn", "ucudnn/torch"], rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
