"""Memory plans in training: what training adds above inference, and peak memory and step time per variant.

Part 1, ``--chain`` (CPU): a deep conv chain (conv + ReLU, ``--layers``, ``--channels``, batch
``--batch``, ``--size``^2 images). Each variant runs in a fresh subprocess (``--rounds`` of them,
interleaved): one no-grad forward (inference peak RSS), then ``--steps`` SGD steps; reported are the
peak RSS the training adds above inference (VmHWM, the process's peak RSS), the conv layers run in a
step (the forward's and the recomputed ones), the median step time (each process's first step left
out: it does one-time work), and the parameters after training against plain PyTorch's. Variants:
plain PyTorch; ``checkpoint_sequential`` with ``--segments`` segments; ``ucudnn:sequential``, the
same layout as a ucudnn plan (the same recomputation, so its step time is the executor's cost
beside PyTorch's); ``ucudnn:checkpoint``, the planner's checkpoint policy (limit a third of the
feature maps); both run by ``execute_plan``.

Part 2, ``--models vgg16,resnet50`` (VGG-16 / ResNet-50 shaped models built here, no torchvision):
plain, ``torch.autograd.graph.save_on_cpu``, ``checkpoint_sequential`` and ucudnn plans
(``--policies``), each in a fresh subprocess: peak memory and the median step time, in one run.
Peak memory on CUDA is what a plan's peak counts, so that the two compare: max_memory_allocated over
the steps after the first, less the optimizer's state and the labels (weights, weight gradients,
feature maps with the input, gradients and workspaces); weight gradients are zeroed, not freed,
between steps, as the plan holds them for the whole step. On the CPU: peak RSS above inference.
``--device cuda`` where a GPU is at hand; ``--cap`` (CUDA, with ``--memory-limit``) holds every
variant, plain PyTorch included, to the limit, so that a batch plain PyTorch cannot train within it
fails there (a limit the planner alone knows of binds nothing else).

    OMP_NUM_THREADS=2 python benchmarks/memory/bench_memory_training.py --chain --rounds 2 --interleaved 4
    python benchmarks/memory/bench_memory_training.py --models vgg16,resnet50 --batch 8 --size 64 --device cpu
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py, models.py
from common import table

from ucudnn.sizes import parse_size

# ---- the models -------------------------------------------------------------------------------------


def chain(layers: int, channels: int):
    from torch import nn

    return nn.Sequential(
        nn.Conv2d(3, channels, 3, padding=1),
        nn.ReLU(),
        *[m for _ in range(layers - 1) for m in (nn.Conv2d(channels, channels, 3, padding=1), nn.ReLU())],
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(channels, 10),
    )


def vgg16(num_classes: int = 1000):
    """torchvision's VGG-16 layout (conv 3x3 + ReLU, max-pools, a 4096-4096 classifier)."""
    from torch import nn

    cfg = [64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512, "M"]
    layers, c = [], 3
    for v in cfg:
        if v == "M":
            layers.append(nn.MaxPool2d(2))
        else:
            layers += [nn.Conv2d(c, v, 3, padding=1), nn.ReLU(inplace=True)]
            c = v
    return nn.Sequential(
        *layers,
        nn.AdaptiveAvgPool2d(7),
        nn.Flatten(),
        nn.Linear(512 * 49, 4096),
        nn.ReLU(inplace=True),
        nn.Linear(4096, 4096),
        nn.ReLU(inplace=True),
        nn.Linear(4096, num_classes),
    )


def resnet50(num_classes: int = 1000):
    """torchvision's ResNet-50 layout (bottlenecks 3-4-6-3, batch-norm, in-place ReLUs), as a Sequential
    of blocks so that checkpoint_sequential can cut it."""
    import torch
    from torch import nn

    class Bottleneck(nn.Module):
        def __init__(self, c_in: int, width: int, stride: int) -> None:
            super().__init__()
            c_out = 4 * width
            self.conv1, self.bn1 = nn.Conv2d(c_in, width, 1, bias=False), nn.BatchNorm2d(width)
            self.conv2, self.bn2 = nn.Conv2d(width, width, 3, stride, 1, bias=False), nn.BatchNorm2d(width)
            self.conv3, self.bn3 = nn.Conv2d(width, c_out, 1, bias=False), nn.BatchNorm2d(c_out)
            self.relu = nn.ReLU(inplace=True)
            self.downsample = None
            if stride != 1 or c_in != c_out:
                self.downsample = nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride, bias=False), nn.BatchNorm2d(c_out))

        def forward(self, x):
            identity = x if self.downsample is None else self.downsample(x)
            out = self.relu(self.bn1(self.conv1(x)))
            out = self.relu(self.bn2(self.conv2(out)))
            out = self.bn3(self.conv3(out))
            out += identity
            return self.relu(out)

    blocks, c = [], 64
    for width, count, stride in ((64, 3, 1), (128, 4, 2), (256, 6, 2), (512, 3, 2)):
        for i in range(count):
            blocks.append(Bottleneck(c, width, stride if i == 0 else 1))
            c = 4 * width
    del torch
    return nn.Sequential(
        nn.Conv2d(3, 64, 7, 2, 3, bias=False),
        nn.BatchNorm2d(64),
        nn.ReLU(inplace=True),
        nn.MaxPool2d(3, 2, 1),
        *blocks,
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(c, num_classes),
    )


# ---- one variant, in a fresh process ------------------------------------------------------------------


def _sequential_plan(model, x, segments: int):
    """checkpoint_sequential's layout as a ucudnn plan, for a Sequential whose modules make one storage
    each (the chain): keep each segment's output, recompute the rest, run the last segment plainly."""
    from ucudnn.memory.plan import MemoryPlan, TensorAction
    from ucudnn.torch import capture

    step = capture(model, x)
    graph = step.graph
    size = len(model) // segments  # checkpoint_sequential's segment length
    boundaries = {(i + 1) * size - 1 for i in range(segments - 1)}

    def keep(storage: str) -> bool:  # a module's output is named after it: "12:relu" is module 12's
        head = storage.split(":", 1)[0]
        index = int(head) if head.isdigit() else None
        return index is None or index in boundaries or index >= (segments - 1) * size

    tensors = tuple(TensorAction(s, graph.bytes_of(s), "keep" if keep(s) else "recompute") for s in graph.storages)
    return MemoryPlan(
        graph.network,
        graph.batch,
        "host",
        1,
        2**62,
        "sequential",
        True,
        0,
        0,
        0,
        1.0,
        1.0,
        0.0,
        0,
        tensors,
        (),
        capture=step,
    )


def run_variant(spec: dict) -> dict:
    import resource

    import torch
    from torch import nn
    from torch.utils.checkpoint import checkpoint_sequential

    from ucudnn.torch import capture
    from ucudnn.torch.planning.planner import plan_memory
    from ucudnn.torch.running.executor import execute_plan

    torch.manual_seed(0)
    dev = torch.device(spec["device"])
    if spec["model"] == "chain":
        model = chain(spec["layers"], spec["channels"])
    else:
        model = {"vgg16": vgg16, "resnet50": resnet50}[spec["model"]](100)
    if spec.get("cap"):
        # the planner's limit counts weights and their gradients, not SGD's momentum (one buffer per parameter)
        momentum = sum(p.numel() * p.element_size() for p in model.parameters())
        total = torch.cuda.get_device_properties(dev).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, (spec["memory_limit"] + momentum) / total), dev)
    model = model.to(dev)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(spec["batch"], 3, spec["size"], spec["size"], generator=g).to(dev)
    y = torch.randint(0, 10, (spec["batch"],), generator=g).to(dev)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    variant = spec["variant"]
    if variant == "checkpoint_sequential":  # an in-place ReLU at a segment boundary would modify a saved input
        for m in model.modules():
            if isinstance(m, nn.ReLU):
                m.inplace = False
    plan = None
    if variant == "ucudnn:sequential":
        plan = _sequential_plan(model, x, spec["segments"])
    elif variant.startswith("ucudnn:"):  # --chain: limit a third of the feature maps

        def loss(out):
            return nn.functional.cross_entropy(out, y)

        limit = spec.get("memory_limit") or capture(model, x, loss=loss).graph.feature_map_bytes // 3
        plan = plan_memory(
            model, x, memory_limit=limit, policy=variant.split(":", 1)[1], device=spec.get("profile"), loss=loss
        )

    def rss() -> int:
        # VmHWM, the peak RSS of this process image (getrusage's maxrss would start at the parent's
        # size, which Linux carries across fork and exec); maxrss where there is no /proc
        try:
            with open("/proc/self/status") as f:
                return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))
        except (OSError, StopIteration):
            return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

    def sync() -> None:
        if dev.type == "cuda":
            torch.cuda.synchronize()

    with torch.no_grad():
        model(x)
    sync()
    inference = rss()
    # conv layers run in the last step: the forward pass's, plus those a recomputing variant runs again
    conv_runs = [0]
    for m in model.modules():
        if isinstance(m, nn.Conv2d):
            m.register_forward_pre_hook(lambda *_: conv_runs.__setitem__(0, conv_runs[0] + 1))
    times = []
    for step in range(spec["steps"]):
        conv_runs[0] = 0
        if dev.type == "cuda" and step == min(1, spec["steps"] - 1):
            torch.cuda.reset_peak_memory_stats()  # the first step does one-time work (the plan's check)
        start = time.perf_counter()
        opt.zero_grad(set_to_none=dev.type != "cuda")
        if variant == "save_on_cpu":
            with torch.autograd.graph.save_on_cpu(pin_memory=dev.type == "cuda"):
                loss = nn.functional.cross_entropy(model(x), y)
            loss.backward()
        elif variant == "checkpoint_sequential":
            loss = nn.functional.cross_entropy(
                checkpoint_sequential(model, spec["segments"], x, use_reentrant=False), y
            )
            loss.backward()
        elif plan is not None:
            with execute_plan(model, plan):
                loss = nn.functional.cross_entropy(model(x), y)
                loss.backward()
        else:
            loss = nn.functional.cross_entropy(model(x), y)
            loss.backward()
        opt.step()
        sync()
        times.append((time.perf_counter() - start) * 1e3)
    steady = times[1:] or times  # the first step does one-time work (first touches of memory, plan checks)
    out = {
        "variant": variant,
        "added_bytes": rss() - inference,
        "step_ms": statistics.median(steady),
        "step_times": times,
        "conv_runs": conv_runs[0],
        "params": [p.detach().cpu().double().sum().item() for p in model.parameters()],
    }
    if dev.type == "cuda":
        state = sum(
            t.numel() * t.element_size()
            for s in opt.state.values()
            for t in s.values()
            if torch.is_tensor(t) and t.is_cuda
        )
        out["peak_bytes"] = torch.cuda.max_memory_allocated() - state - y.numel() * y.element_size()
    if plan is not None:
        out["plan_peak_bytes"] = plan.peak_bytes
        out["plan"] = plan.policy
    return out


def interleaved(spec: dict, steps: int) -> dict:
    """checkpoint_sequential and the same layout under execute_plan, steps alternating in one process
    (after a warm-up step each): step times without a fresh process's page faults and start-up."""
    import torch
    from torch import nn
    from torch.utils.checkpoint import checkpoint_sequential

    from ucudnn.torch.running.executor import execute_plan

    torch.manual_seed(0)
    model = chain(spec["layers"], spec["channels"])
    x = torch.randn(spec["batch"], 3, spec["size"], spec["size"])
    y = torch.randint(0, 10, (spec["batch"],))
    plan = _sequential_plan(model, x, spec["segments"])

    def sequential() -> None:
        nn.functional.cross_entropy(
            checkpoint_sequential(model, spec["segments"], x, use_reentrant=False), y
        ).backward()

    def planned() -> None:
        with execute_plan(model, plan):
            nn.functional.cross_entropy(model(x), y).backward()

    times: dict[str, list[float]] = {"checkpoint_sequential": [], "ucudnn:sequential": []}
    for step in range(steps + 1):
        for name, fn in zip(times, (sequential, planned)):
            start = time.perf_counter()
            fn()
            if step:  # the first is the warm-up
                times[name].append((time.perf_counter() - start) * 1e3)
    return {name: statistics.median(t) for name, t in times.items()}


def spawn(spec: dict) -> dict:
    env = dict(os.environ)
    proc = subprocess.run(
        [sys.executable, os.path.abspath(__file__), "--child", json.dumps(spec)],
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )
    if proc.returncode != 0:
        return {"variant": spec["variant"], "error": proc.stderr.strip().splitlines()[-1] if proc.stderr else "failed"}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def spawn_rounds(specs: list[dict], rounds: int) -> list[dict]:
    """Each spec run in `rounds` fresh processes, the order rotated per round so that a changing load
    falls on every variant; steady step times pooled (each process's first step left out), memory the
    median."""
    runs: list[list[dict]] = [[] for _ in specs]
    for r in range(rounds):
        for k in range(len(specs)):
            i = (k + r) % len(specs)
            runs[i].append(spawn(specs[i]))
    merged = []
    for results in runs:
        ok = [x for x in results if "error" not in x]
        if not ok:
            merged.append(results[0])
            continue
        out = dict(ok[0])
        out["step_times"] = [x["step_times"] for x in ok]  # per round
        out["step_ms"] = statistics.median(t for times in out["step_times"] for t in times[1:] or times)
        out["added_bytes"] = statistics.median(x["added_bytes"] for x in ok)
        merged.append(out)
    return merged


def _mib(b: float) -> str:
    return f"{b / 2**20:.1f}"


def _vs(run: dict, plain: dict, key: str) -> str:
    """A variant's figure over plain's ("" where plain failed)."""
    return "" if "error" in plain else f"{run[key] / plain[key]:.2f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--chain", action="store_true", help="the CPU conv-chain experiment")
    ap.add_argument("--layers", type=int, default=49)
    ap.add_argument("--channels", type=int, default=32)
    ap.add_argument("--segments", type=int, default=7)
    ap.add_argument("--models", default="", help="comma-separated: vgg16, resnet50")
    ap.add_argument("--policies", default="vdnn-all,vdnn-conv", help="ucudnn policies for --models")
    ap.add_argument("--memory-limit", default=None, help="planner limit for --models (default: half of plain's)")
    ap.add_argument(
        "--cap",
        action="store_true",
        help="CUDA: hold every variant to --memory-limit (plus SGD's momentum), plain PyTorch included",
    )
    ap.add_argument("--profile", default=None, help="device profile for the planner (default: the device's)")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--size", type=int, default=48)
    ap.add_argument("--steps", type=int, default=3, help="SGD steps per process; the first is left out of ms/step")
    ap.add_argument("--rounds", type=int, default=1, help="--chain: fresh processes per variant, interleaved")
    ap.add_argument(
        "--interleaved",
        type=int,
        default=0,
        metavar="STEPS",
        help="--chain: also time checkpoint_sequential and ucudnn:sequential alternating in one process",
    )
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.cap and not (args.memory_limit and args.device.startswith("cuda")):
        ap.error("--cap needs --memory-limit and a CUDA --device")
    if args.child:
        print(json.dumps(run_variant(json.loads(args.child))))
        return
    results = {}
    if args.chain:
        base = {
            "model": "chain",
            "layers": args.layers,
            "channels": args.channels,
            "batch": args.batch,
            "size": args.size,
            "steps": args.steps,
            "device": args.device,
            "segments": args.segments,
        }
        variants = ("plain", "checkpoint_sequential", "ucudnn:sequential", "ucudnn:checkpoint")
        rows, runs = [], spawn_rounds([{**base, "variant": v} for v in variants], args.rounds)
        plain = runs[0]
        for r in runs:
            if "error" in r:
                rows.append([r["variant"], "error: " + r["error"], "", "", "", "", ""])
                continue
            cut = 1 - r["added_bytes"] / plain["added_bytes"]
            same = max(abs(a - b) / max(1.0, abs(b)) for a, b in zip(r["params"], plain["params"]))
            rows.append(
                [
                    r["variant"],
                    _mib(r["added_bytes"]),
                    f"{-cut:+.0%}" if r is not plain else "",
                    f"{r['conv_runs']:.0f}",
                    f"{r['step_ms']:.0f}",
                    f"{r['step_ms'] / plain['step_ms']:.2f}",
                    f"{same:.1e}",
                ]
            )
        print(
            f"conv chain: {args.layers} layers, {args.channels} channels, batch {args.batch}, "
            f"{args.size}x{args.size}, {args.steps} SGD steps x {args.rounds} round(s), {args.device}"
        )
        print(
            table(
                [
                    "variant",
                    "training adds (MiB RSS)",
                    "vs plain",
                    "conv runs/step",
                    "ms/step",
                    "vs plain",
                    "params rel. diff",
                ],
                rows,
            )
        )
        results["chain"] = runs
        if args.interleaved:
            ms = interleaved(base, args.interleaved)
            cs, ours = ms["checkpoint_sequential"], ms["ucudnn:sequential"]
            print(
                f"in one process, {args.interleaved} steps each, interleaved: checkpoint_sequential {cs:.0f} ms, "
                f"ucudnn:sequential {ours:.0f} ms ({ours / cs:.2f}x)"
            )
            results["interleaved"] = ms
    for name in [m for m in args.models.split(",") if m]:
        base = {
            "model": name,
            "batch": args.batch,
            "size": args.size,
            "steps": args.steps,
            "device": args.device,
            "segments": args.segments,
            "profile": args.profile,
            "cap": args.cap,
        }
        if args.cap:
            base["memory_limit"] = parse_size(args.memory_limit)
        plain = spawn({**base, "variant": "plain"})
        measure = "peak_bytes" if args.device.startswith("cuda") else "added_bytes"
        limit = parse_size(args.memory_limit) if args.memory_limit else int(plain.get(measure, 2**30) // 2)
        runs = [plain] + [
            spawn({**base, "variant": v, "memory_limit": limit})
            for v in ["save_on_cpu", "checkpoint_sequential"] + [f"ucudnn:{p}" for p in args.policies.split(",")]
        ]
        rows = []
        for r in runs:
            if "error" in r:
                rows.append([r["variant"], "error: " + r["error"][:80], "", "", "", ""])
                continue
            rows.append(
                [
                    r["variant"],
                    _mib(r[measure]),
                    _vs(r, plain, measure),
                    f"{r['step_ms']:.0f}",
                    _vs(r, plain, "step_ms"),
                    _mib(r["plan_peak_bytes"]) if "plan_peak_bytes" in r else "",
                ]
            )
        what = "peak, as a plan counts (MiB)" if measure == "peak_bytes" else "training adds (MiB RSS)"
        print(
            f"\n{name}: batch {args.batch}, {args.size}x{args.size}, {args.device}, planner limit {_mib(int(limit))} MiB"
        )
        print(table(["variant", what, "vs plain", "ms/step", "vs plain", "plan peak (MiB)"], rows))
        results[name] = runs
    if args.json:
        print(json.dumps(results))


if __name__ == "__main__":
    main()
