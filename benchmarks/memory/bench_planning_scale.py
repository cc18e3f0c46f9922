"""Planning time against the size of the captured step (issue 52): CPU seconds, one thread, `optimal` for the H100's
profile on a step captured on fake tensors, interleaved with PyTorch's `sac_milp` where it runs in reasonable time.

Models (``--models``): ``hf-resnet50`` (transformers' ResNet-50, batch 64, 224x224), ``hf-resnet152`` (transformers'
ResNet at depths 3, 8, 36, 3: ResNet-152, batch 64, 224x224) and ``sd15-unet`` (diffusers' UNet2DConditionModel
with Stable Diffusion 1.5's configuration, batch 4, 64x64 latents, 77 text tokens of 768; the `bench` extra).
Each is captured once (`ucudnn.torch.capture`: its ATen operations and graph steps are the step's size); then, in
``--rounds`` interleaved rounds, each with a fresh `ucudnn.memory.reuse.PlanCache` (nothing carried between them):

- ``one plan``: the plan halfway between the smallest peak and keeping everything, as `plan_memory` makes it
  from the capture (`make_executed_plan`);
- ``frontier``: no limit, halfway and the smallest in one pass (`frontier(..., executed=True)`, one cache);
- ``sac_milp`` (``--sac MODEL``): PyTorch's estimators on fake tensors and its ILP at the halfway limit, as
  ``bench_planners.py`` runs them (its CBC solve stops at 180 s).

The ``--json`` rows hold each frontier plan's peak, step and whether it fits (``frontier_plans``), to compare the
plans of two trees. Run on a tree without `ucudnn.memory.reuse` (before issue 52), the frontier is the three plans made one after
another, which is what a sweep cost there. Targets (issue 52): one plan of HF ResNet-50 <= 1.5 s, ResNet-152 <= 5 s,
the SD UNet <= 8 s; the frontier <= 1.3x one plan.

    pip install '.[models,bench]'
    OMP_NUM_THREADS=1 python benchmarks/memory/bench_planning_scale.py [--models hf-resnet50,hf-resnet152,sd15-unet]
        [--rounds 1] [--sac hf-resnet50] [--json FILE]
"""

from __future__ import annotations

import argparse
import resource
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py, models.py
import torch
from common import table, write_json
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from ucudnn.devices import load_profile
from ucudnn.memory.planner import make_executed_plan
from ucudnn.torch import capture

try:
    from ucudnn.memory.planner import frontier
    from ucudnn.memory.reuse import PlanCache
except ImportError:  # a tree before issue 52: each plan on its own
    PlanCache = None

MODELS = ("hf-resnet50", "hf-resnet152", "sd15-unet")
TARGETS = {"hf-resnet50": 1.5, "hf-resnet152": 5.0, "sd15-unet": 8.0}  # one plan, CPU s
FRONTIER_TARGET = 1.3  # the frontier over one plan


class _Denoiser(nn.Module):
    """The SD 1.5 UNet as a training step calls it: noisy latents at one timestep, conditioned on a text encoding."""

    def __init__(self, unet: nn.Module, text: torch.Tensor) -> None:
        super().__init__()
        self.unet, self.text = unet, text

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.unet(x, 10, encoder_hidden_states=self.text).sample


def build(name: str, mode: FakeTensorMode):
    """(model, its input on fake tensors, its loss of the output)."""
    torch.manual_seed(0)
    if name == "sd15-unet":
        import diffusers

        unet = diffusers.UNet2DConditionModel(
            sample_size=64,
            in_channels=4,
            out_channels=4,
            block_out_channels=(320, 640, 1280, 1280),
            down_block_types=("CrossAttnDownBlock2D",) * 3 + ("DownBlock2D",),
            up_block_types=("UpBlock2D",) + ("CrossAttnUpBlock2D",) * 3,
            cross_attention_dim=768,
            attention_head_dim=8,
            layers_per_block=2,
        )
        with mode:
            text, x = torch.randn(4, 77, 768), torch.randn(4, 4, 64, 64)
        return _Denoiser(unet, text), x, lambda out: out.float().pow(2).mean()
    import transformers

    depths = [3, 8, 36, 3] if name == "hf-resnet152" else [3, 4, 6, 3]
    model = transformers.ResNetForImageClassification(transformers.ResNetConfig(depths=depths, num_labels=10))
    with mode:
        x, y = torch.randn(64, 3, 224, 224), torch.randint(0, 10, (64,))
    return model, x, lambda out: nn.functional.cross_entropy(out.logits, y)


def cpu_seconds(fn):
    start = time.process_time()
    out = fn()
    return time.process_time() - start, out


def one_plan(graph, device, limit):
    cache = {} if PlanCache is None else {"cache": PlanCache()}
    return make_executed_plan(graph, device, limit, "optimal", **cache)


def sweep(graph, device, limits):
    if PlanCache is None:
        return [make_executed_plan(graph, device, limit, "optimal") for limit in limits]
    return frontier(graph, device, limits, "optimal", executed=True, cache=PlanCache())


def sac_seconds(name: str, limit: int) -> tuple[float, float]:
    """PyTorch's estimators and its ILP at `limit` on HF ResNet-50 (as bench_planners.py runs them): CPU seconds
    and the peak it returns (-1: it found no plan)."""
    from bench_planners import sac_statistics
    from torch.distributed._tools.sac_ilp import sac_milp

    def spent() -> float:  # this process's CPU time and its children's (PuLP runs CBC as a program of its own)
        children = resource.getrusage(resource.RUSAGE_CHILDREN)
        return time.process_time() + children.ru_utime + children.ru_stime

    start = spent()
    graph, _, _ = sac_statistics(name, argparse.Namespace(batch=64, size=224))
    _, _, peak = sac_milp(graph, memory_budget=limit / 2**30, world_size=1)
    return spent() - start, peak


def bench(name: str, args, device) -> dict:
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    model, x, loss = build(name, mode)
    capture_s, step = cpu_seconds(lambda: capture(model, x, loss=loss))
    graph = step.graph
    ends = [make_executed_plan(graph, device, limit, "optimal").peak_bytes for limit in (2**62, 1)]
    half = sum(ends) // 2
    row: dict = {"model": name, "ops": len(step.ops), "steps": len(graph.steps), "capture_s": capture_s}
    times: dict[str, list[float]] = {"one plan": [], "frontier": [], "sac_milp": []}
    sac = name in args.sac
    if not sac:
        row["sac_skipped"] = (
            "not asked for (--sac)"
            if name == "hf-resnet50"
            else "bench_planners.py's estimators build the models of models.py only; its CBC solve may take 180 s"
        )
    for r in range(args.rounds):
        print(f"[{name}] round {r + 1}/{args.rounds}", file=sys.stderr, flush=True)
        seconds, plan = cpu_seconds(lambda: one_plan(graph, device, half))
        times["one plan"].append(seconds)
        seconds, plans = cpu_seconds(lambda: sweep(graph, device, [2**62, half, 1]))
        times["frontier"].append(seconds)
        # the frontier's halfway plan is the one plan's, unless HiGHS stopped at its time limit (a busy machine)
        row.setdefault("frontier_plans", []).append([[p.peak_bytes, p.step_ms, p.fits] for p in plans])
        row.setdefault("halfway_differs", []).append(
            None if (plans[1].tensors, plans[1].step_ms) == (plan.tensors, plan.step_ms) else plans[1].step_ms
        )
        if sac:
            seconds, row["sac_peak"] = sac_seconds(name, half)
            times["sac_milp"].append(seconds)
    row.update({k.replace(" ", "_") + "_s": statistics.median(v) for k, v in times.items() if v})
    row.update(times=times, halfway_bytes=half, halfway_fits=plan.fits, halfway_step_ms=plan.step_ms)
    row["frontier_ratio"] = row["frontier_s"] / row["one_plan_s"]
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--sac", default="", help="models to run PyTorch's sac_milp on (hf-resnet50 only)")
    ap.add_argument("--device", default="h100")
    ap.add_argument("--json", help="also write the rows to this file")
    args = ap.parse_args(argv)
    models = args.models.split(",")
    unknown = [m for m in models if m not in MODELS]
    if unknown:
        ap.error(f"unknown model(s) {', '.join(unknown)}: {', '.join(MODELS)}")
    args.sac = [m for m in args.sac.split(",") if m]
    if any(m != "hf-resnet50" for m in args.sac):
        ap.error("--sac: hf-resnet50 only (bench_planners.py's statistics)")
    torch.set_num_threads(1)
    device = load_profile(args.device)
    print(f"torch {torch.__version__}, 1 thread, reuse: {PlanCache is not None}", file=sys.stderr)
    rows = [bench(m, args, device) for m in models]
    print(
        table(
            [
                "model",
                "ATen ops",
                "steps",
                "capture s",
                "one plan s",
                "target",
                "frontier s",
                "/ one plan",
                "sac_milp s",
            ],
            [
                [
                    r["model"],
                    r["ops"],
                    r["steps"],
                    f"{r['capture_s']:.2f}",
                    f"{r['one_plan_s']:.2f}",
                    f"<= {TARGETS[r['model']]:g} {'met' if r['one_plan_s'] <= TARGETS[r['model']] else 'NOT met'}",
                    f"{r['frontier_s']:.2f}",
                    f"{r['frontier_ratio']:.2f} {'met' if r['frontier_ratio'] <= FRONTIER_TARGET else 'NOT met'}",
                    f"{r['sac_milp_s']:.1f}" if "sac_milp_s" in r else "skipped",
                ]
                for r in rows
            ],
        )
    )
    for r in rows:
        for step_ms in filter(None, r["halfway_differs"]):
            print(
                f"{r['model']}: the frontier's halfway plan differs: {step_ms:.2f} ms against {r['halfway_step_ms']:.2f}"
            )
        if "sac_skipped" in r:
            print(f"{r['model']}: sac_milp skipped: {r['sac_skipped']}")
    if args.json:
        write_json(args.json, {"rows": rows, "torch": torch.__version__, "reuse": PlanCache is not None})
    return 0


if __name__ == "__main__":
    sys.exit(main())
