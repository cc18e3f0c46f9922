"""ucudnn's plans against PyTorch's own planners on models nobody here wrote: peak memory against step time (CPU).

Models (``--models``; the `models` extra): Hugging Face transformers' ResNet-50 and MobileNetV2 and MONAI's 2-D
UNet, built from their configs. Variants, each at three budgets:

- ``ucudnn:<policy>@<limit>``: `plan_memory` (``checkpoint``, ``optimal``) run by `execute_plan`, at limits
  a quarter, a half and three quarters of the way from ucudnn's smallest peak to keeping everything;
- ``sac@<limit>``: PyTorch's selective-activation-checkpointing ILP (`torch.distributed._tools.sac_ilp.
  sac_milp`, PuLP's CBC) on the statistics of its estimators (`MemTracker`, `RuntimeEstimator`,
  `SACEstimator`, run on fake tensors), at the same limits, its per-module decisions applied as its
  authors do: each chosen module's forward under `torch.utils.checkpoint` with
  `create_selective_checkpoint_contexts`, saving the operations `get_optimal_checkpointing_policy_per_module`
  chooses. PyTorch's roofline models GPUs only (it asks for CUDA): here it is given this CPU's measured
  matmul throughput and copy bandwidth (`ucudnn.torch.measure_profile`), the figures ucudnn's CPU profile has.
  Its policies never save an in-place op's output or a factory's (checkpoint refuses a cached tensor changed
  later); a plan that selective checkpointing still refuses at its first step is named and left out;
- ``compile(b)``: `torch.compile` with `torch._functorch.config.activation_memory_budget` = b (its min-cut
  partitioner under a knapsack budget) for b in 0.25, 0.5, 0.75;
- ``plain``: everything resident; ``ucudnn:everything kept``: the plan with no limit (every map kept) under
  `execute_plan`, against it (the executor's own cost; target: at most 5% over the plain step).

Peak memory, time and the frontier check are `bench_frontier`'s: one tracked step (`StepTracker`, which counts
as PyTorch's MemTracker does and also sees Inductor's own buffers) after warm-up steps; step time the median of
``--rounds`` interleaved rounds (CPU time of this process); the check: is a PyTorch point both smaller and faster
than a point of ucudnn's frontier by more than 5%. Planning time: `plan_memory`; the estimators, the ILP and the
per-module policies; the first (compiling) step less a plain step.

    pip install '.[models,bench,plot]'
    OMP_NUM_THREADS=2 python benchmarks/memory/bench_planners.py --rounds 5 --plot docs/planners.png --json planners.json
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import functools
import json
import logging
import sys
import time
from pathlib import Path
from unittest import mock

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py, models.py
import torch
import torch._functorch.config
import torch._inductor.config
from bench_frontier import (
    SLACK,
    STYLES,
    MiB,
    Variant,
    _fresh_forward,
    _measure_peak,
    frontier,
    time_rounds,
)
from bench_frontier import plot as frontier_plot
from common import table
from models import build, loss
from torch import nn

from ucudnn.torch import execute_plan, measure_profile, plan_memory
from ucudnn.torch.running.labels import watch_inductor_buffers

FRACTIONS = (0.25, 0.5, 0.75)  # of the way from ucudnn's smallest peak to keeping everything
BUDGETS = (0.25, 0.5, 0.75)  # torch.compile's activation_memory_budget


def _run_plain(m, x, y):
    loss(m(x), y).backward()


def _run_planned(m, x, y, plan):
    with execute_plan(m, plan):
        loss(m(x), y).backward()


# ---- PyTorch's SAC ILP ----------------------------------------------------------------------------------------
def _cpu_roofline():
    """PyTorch's roofline on this CPU: its throughput and bandwidth as ucudnn measured them."""
    import torch.utils._runtime_estimation as estimation

    profile = measure_profile("cpu")
    return mock.patch.multiple(
        estimation, get_device_tflops=lambda dtype: profile.fp32_tflops, get_gpu_dram_gbps=lambda: profile.memory_gbps
    ), mock.patch.object(torch.cuda, "is_available", lambda: True)


def _sac_estimator():
    """PyTorch's SACEstimator, leaving out of its trade-off fit the modules that keep no activation memory or
    take no time (their ops all views or in place: its fit divides by both and fails) and those whose
    piecewise-linear fit is not finite (too few points): they are no candidates for the ILP, as leaves."""
    import math

    from torch.distributed._tools.sac_estimator import SACEstimator

    class Estimator(SACEstimator):
        def pwlf_sac_tradeoff_curve(self, *args, **kwargs):
            for fqn in [f for f, s in self.sac_mod_stats.items() if not sum(s.memory) or not sum(s.runtimes)]:
                del self.sac_mod_stats[fqn]
                self.sac_mod_greedy_order_meta.pop(fqn, None)
            super().pwlf_sac_tradeoff_curve(*args, **kwargs)
            for fqn, t in list(self.sac_mod_tradeoff_stats.items()):
                if not all(math.isfinite(v) for v in [*t.slopes, *t.intercepts, *t.fit_breaks]):
                    del self.sac_mod_tradeoff_stats[fqn]

    return Estimator()


def sac_statistics(name: str, args):
    """The SAC ILP's graph of one training step and the per-module statistics, estimated on fake tensors."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.ilp_utils import aggregate_stats, parse_module_info
    from torch.distributed._tools.mem_tracker import MemTracker
    from torch.distributed._tools.runtime_estimator import RuntimeEstimator

    flops, cuda = _cpu_roofline()
    with FakeTensorMode(), flops, cuda:
        model, x, y = build(name, args.batch, args.size)
        memory, runtime, sac = MemTracker(), RuntimeEstimator(), _sac_estimator()
        memory.track_external(model)
        _run_plain(model, x, y)
        for p in model.parameters():
            p.grad = None
        with memory, runtime("operator-level-cost-model"), sac("operator-level-cost-model"):
            _run_plain(model, x, y)
        info = aggregate_stats(model, memory, runtime, sac, torch.device("cpu"))
    return parse_module_info(info), sac.sac_mod_stats, type(model).__name__


def _policy_fn(stats, save: list[int]):
    """A selective-checkpoint policy for one module: the k-th call of an operation in its forward pass is
    saved or recomputed as the k-th call of that operation in the estimator's list (others recompute)."""
    from torch.utils.checkpoint import CheckpointPolicy

    by_name: dict[str, list[int]] = {}
    for name, keep in zip(stats.func_names, save):
        by_name.setdefault(name, []).append(keep)
    counts: dict[tuple[bool, str], int] = {}

    def policy(ctx, func, *args, **kwargs):
        name = func._overloadpacket.__name__
        k = counts.get((ctx.is_recompute, name), 0)
        counts[(ctx.is_recompute, name)] = k + 1
        decisions = by_name.get(name, ())
        keep = decisions[k % len(decisions)] if decisions else 0  # per step: the count restarts each step
        # Checkpoint refuses a cached tensor that is changed later: an in-place op's output, or a factory's
        # (torch.empty, filled in place afterwards); both are free to make again, so they are recomputed
        factory = not any(isinstance(a, torch.Tensor) for a in args)
        save = keep and not func._schema.is_mutable and not factory
        return CheckpointPolicy.MUST_SAVE if save else CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def apply_sac(model: nn.Module, decisions: dict[str, float], mod_stats, root: str) -> int:
    """Each module the ILP chose runs its forward under selective checkpointing; how many modules."""
    from torch.distributed._tools.sac_ilp import get_optimal_checkpointing_policy_per_module
    from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

    chosen = sorted((fqn for fqn, discard in decisions.items() if discard > 0), key=len)
    outer = [f for f in chosen if not any(f.startswith(o + ".") for o in chosen if o != f)]  # no nesting
    for fqn in outer:
        # PuLP drops a variable whose coefficients are all 0 (an op of no time and no memory) and then gives it
        # no value, on which PyTorch's knapsack fails (round(None)): every op gets a time of at least 1 ns
        stats = dataclasses.replace(mod_stats[fqn], runtimes=[max(t, 1e-6) for t in mod_stats[fqn].runtimes])
        save = get_optimal_checkpointing_policy_per_module(stats, memory_budget=1 - decisions[fqn])
        module = model.get_submodule(fqn[len(root) + 1 :]) if fqn != root else model
        forward = module.forward
        context = functools.partial(create_selective_checkpoint_contexts, _policy_fn(mod_stats[fqn], save))
        module.forward = functools.partial(checkpoint, forward, use_reentrant=False, context_fn=context)
    return len(outer)


# ---- the variants --------------------------------------------------------------------------------------------
def ucudnn_variants(base, x, y, args, timings):
    def labelled_loss(out):
        return loss(out, y)

    out, limits = [], {}
    for policy in args.policies:
        model = copy.deepcopy(base)
        start = time.perf_counter()
        everything = plan_memory(model, x, memory_limit=2**62, policy=policy, loss=labelled_loss)
        timings[f"ucudnn {policy}: the first plan (capture, timed steps, kernels from the cache)"] = (
            time.perf_counter() - start
        )
        smallest = plan_memory(model, x, memory_limit=1, policy=policy, loss=labelled_loss)
        ends = [everything.peak_bytes, smallest.peak_bytes]
        if policy == args.policies[0]:  # what executing a plan that acts on nothing costs over the plain step
            kept = all(t.action in ("keep", "release") for t in everything.tensors)
            out.append(
                Variant(
                    "ucudnn:everything kept",
                    "ucudnn everything kept",
                    copy.deepcopy(model),
                    lambda m, x, y, plan=everything: _run_planned(m, x, y, plan),
                    plan=everything,
                )
            )
            assert kept, "a plan with no limit keeps every map"
        limits[policy] = [int(ends[1] + f * (ends[0] - ends[1])) for f in FRACTIONS]
        for limit in limits[policy]:
            start = time.perf_counter()
            plan = plan_memory(model, x, memory_limit=limit, policy=policy, loss=labelled_loss)
            timings[f"ucudnn {policy}@{limit / MiB:.1f}MiB"] = time.perf_counter() - start

            out.append(
                Variant(
                    f"ucudnn:{policy}@{limit / MiB:.1f}MiB",
                    f"ucudnn {policy}",
                    copy.deepcopy(model),
                    lambda m, x, y, plan=plan: _run_planned(m, x, y, plan),
                    plan=plan,
                )
            )
    return out, limits


def sac_variants(name, base, x, y, limits, args, timings):
    from torch.distributed._tools.sac_ilp import sac_milp

    start = time.perf_counter()
    graph, mod_stats, root = sac_statistics(name, args)
    timings["sac: estimators"] = time.perf_counter() - start
    out = []
    for limit in limits:
        start = time.perf_counter()
        decisions, _, peak = sac_milp(graph, memory_budget=limit / 2**30, world_size=1)
        model = copy.deepcopy(base)
        modules = apply_sac(model, decisions, mod_stats, root) if peak >= 0 else 0
        timings[f"sac@{limit / MiB:.1f}MiB: ILP and policies"] = time.perf_counter() - start
        if peak < 0:
            print(f"[{name}] sac_milp found no plan within {limit / MiB:.0f} MiB", file=sys.stderr)
            continue
        try:
            _run_plain(model, x, y)
        except RuntimeError as exc:  # e.g. a saved output that the model then changes in place (`h += residual`)
            print(
                f"[{name}] PyTorch's selective checkpointing refused sac_milp's plan at {limit / MiB:.0f} MiB "
                f"({modules} modules): {str(exc).splitlines()[0]}",
                file=sys.stderr,
            )
            continue
        finally:
            model.zero_grad(set_to_none=True)
        out.append(Variant(f"sac@{limit / MiB:.1f}MiB ({modules} modules)", "PyTorch sac_milp", model, _run_plain))
    return out


def compile_variants(base, x, y, timings):
    out = []
    for b in BUDGETS:
        model = copy.deepcopy(base)
        compiled = torch.compile(_fresh_forward(model))
        state = {"first": True}

        def run(m, x, y, compiled=compiled, b=b, state=state):
            if state["first"]:  # forward and backward compile at the first step, under the budget
                state["first"] = False
                start = time.perf_counter()
                with torch._functorch.config.patch(activation_memory_budget=b):
                    loss(compiled(x), y).backward()
                timings[f"compile({b:g}): first step"] = time.perf_counter() - start
                return
            loss(compiled(x), y).backward()

        out.append(Variant(f"compile({b:g})", "torch.compile", model, run))
    return out


def run_model(name: str, args) -> dict:
    base, x, y = build(name, args.batch, args.size)
    timings: dict[str, float] = {}
    plain = Variant("plain", "plain", copy.deepcopy(base), _run_plain)
    print(f"[{name}] ucudnn plans", file=sys.stderr)
    ours, limits = ucudnn_variants(base, x, y, args, timings)
    print(f"[{name}] PyTorch's SAC ILP", file=sys.stderr)
    sac = sac_variants(name, base, x, y, limits[args.policies[0]], args, timings)
    variants = [plain, *ours, *sac, *compile_variants(base, x, y, timings)]
    print(f"[{name}] peaks of {len(variants)} variants", file=sys.stderr)
    for v in variants:
        _measure_peak(v, x, y)
    print(f"[{name}] timing, {args.rounds} interleaved rounds", file=sys.stderr)
    time_rounds(variants, x, y, args.rounds)
    rows = [
        [
            v.name,
            f"{v.peak / MiB:.1f}",
            f"{v.peak / plain.peak:.2f}",
            f"{v.ms:.0f}",
            f"{v.ms / plain.ms:.2f}",
            f"{v.plan.peak_bytes / MiB:.1f}" if v.plan else "",
        ]
        for v in variants
    ]
    print(f"\n{name}: batch {args.batch}, {args.size}x{args.size}")
    print(table(["variant", "peak MiB", "/ plain", "CPU ms/step", "/ plain", "planned peak MiB"], rows))
    kept = next((v for v in variants if v.tool == "ucudnn everything kept"), None)
    if kept is not None:
        print(f"executing the plan that keeps everything: {kept.ms / plain.ms:.3f}x the plain step's CPU time")
    ours_front = frontier([v for v in variants if v.tool.startswith("ucudnn")] + [plain])
    beaten = [
        (q.name, u.name)
        for u in ours_front
        if u.tool.startswith("ucudnn")
        for q in variants
        if not q.tool.startswith("ucudnn")
        and q.tool != "plain"
        and q.peak < u.peak * (1 - SLACK)
        and q.ms < u.ms * (1 - SLACK)
    ]
    print(
        f"PyTorch points both smaller and faster than a ucudnn frontier point by more than {SLACK:.0%}: "
        f"{beaten or 'none'}"
    )
    print(table(["planning", "s"], [[k, f"{s:.1f}"] for k, s in timings.items()]))
    return {
        "model": name,
        "batch": args.batch,
        "size": args.size,
        "beaten": beaten,
        "planning_s": timings,
        "points": [
            {
                "name": v.name,
                "tool": v.tool,
                "peak_bytes": v.peak,
                "step_ms": v.ms,
                "wall_ms": v.wall_ms,
                "cpu_times_ms": v.cpu_times,
                "planned_peak_bytes": v.plan.peak_bytes if v.plan else None,
            }
            for v in variants
        ],
    }


def plot(results: list[dict], path: str) -> None:
    frontier_plot(results, path, {**STYLES, "PyTorch sac_milp": ("tab:blue", "o")}, joined=())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="hf-resnet50,hf-mobilenet-v2,monai-unet")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--size", type=int, default=64)
    ap.add_argument("--policies", default="optimal,checkpoint")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", dest="json_path")
    ap.add_argument("--plot", dest="plot_path")
    args = ap.parse_args()
    args.policies = args.policies.split(",")
    watch_inductor_buffers()  # before anything compiles: the trackers count Inductor's own buffers
    # sac_ilp logs each module where its two estimators disagree and each infeasible budget; what this benchmark
    # needs of that (a budget with no plan) it prints itself (a filter: torch's logging resets levels)
    logging.getLogger("torch.distributed._tools.sac_ilp").addFilter(lambda record: False)
    torch._functorch.config.enable_autograd_cache = False  # every budget compiles its own graphs
    torch._inductor.config.fx_graph_cache = False
    results = [run_model(m, args) for m in args.models.split(",")]
    if args.json_path:
        with open(args.json_path, "w", encoding="utf-8") as f:
            json.dump({"results": results, "torch": torch.__version__, "threads": torch.get_num_threads()}, f, indent=1)
    if args.plot_path:
        plot(results, args.plot_path)


if __name__ == "__main__":
    main()
