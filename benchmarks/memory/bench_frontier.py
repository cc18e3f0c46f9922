"""Recomputation at equal memory: ucudnn's plans against PyTorch's own tools, peak memory against step time (CPU).

Two models (``--models chain,resnet``): a chain of conv + ReLU layers and a ResNet-shaped model (a stem,
basic residual blocks with batch-norm and in-place ReLUs, a classifier), both `nn.Sequential` so that
`checkpoint_sequential` can cut them. For each, the variants:

- ``plain``: everything resident;
- ``ckpt_seq(k)``: `torch.utils.checkpoint.checkpoint_sequential` with k segments (non-reentrant);
- ``compile(b)``: `torch.compile` with `torch._functorch.config.activation_memory_budget` = b (its
  min-cut partitioner under a knapsack budget), compiled once per budget;
- ``ucudnn:<policy>@<limit>``: a ucudnn plan (`plan_memory`, policies ``--policies``) run by
  `execute_plan`, at each peak a ``ckpt_seq`` point reached (the equal-memory comparison) and at
  ``--limits`` more fractions of the plain peak.

Peak memory is counted by `ucudnn.torch.checking.tracker.StepTracker` over one step after warm-up steps
(weights, weight gradients freed between steps as zero_grad() does, feature maps, gradients and
temporaries; host copies too, as a CPU has one memory). Compiled code runs compiled under the tracker (it ignores compile
internals), the buffers Inductor's generated C++ kernels allocate themselves included
(`ucudnn.torch.running.labels.watch_inductor_buffers`, before anything compiles).
Step time: the median over ``--rounds`` rounds in which every variant runs one step, interleaved in
one process (forward, backward, no optimizer step), as CPU time of this process (all its threads):
on a machine shared with other work, wall time moved by 2x between identical plans in one run; wall
time is printed beside it, and the minor page faults of a step (memory the C allocator gave back to
the kernel and takes again). ``--malloc keep`` makes glibc keep what a step frees
(`common.keep_freed_memory`): the steps then time compute alone.

Printed: every point, the frontier checks (at each ckpt_seq peak, does ucudnn's plan given that limit
reach it and is it no slower; is any PyTorch point both smaller and faster than a ucudnn point by more
than 5%), and ``--json`` / ``--plot`` write the figures and the frontier plot.

    OMP_NUM_THREADS=2 python benchmarks/memory/bench_frontier.py --rounds 5 --plot docs/frontier.png --json frontier.json
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py, models.py
import torch
import torch._functorch.config
import torch._inductor.config
from common import keep_freed_memory, minor_faults, table
from torch import nn
from torch.utils.checkpoint import checkpoint_sequential

from ucudnn.torch import execute_plan, plan_memory
from ucudnn.torch.checking.tracker import StepTracker
from ucudnn.torch.running.labels import watch_inductor_buffers

MiB = 2**20
SLACK = 0.05  # the "by more than 5%": differences below this are noise on a shared machine


def chain(layers: int, channels: int) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(3, channels, 3, padding=1),
        nn.ReLU(),
        *[m for _ in range(layers - 1) for m in (nn.Conv2d(channels, channels, 3, padding=1), nn.ReLU())],
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(channels, 10),
    )


class BasicBlock(nn.Module):
    def __init__(self, c: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c)

    def forward(self, x):
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        out = out + x
        return self.relu(out)


def resnet(blocks: int, channels: int) -> nn.Sequential:
    # the stem's ReLU is not in place: checkpoint_sequential may start a segment with it, and an
    # in-place op on a segment's input changes what the checkpoint saved
    return nn.Sequential(
        nn.Conv2d(3, channels, 3, padding=1, bias=False),
        nn.BatchNorm2d(channels),
        nn.ReLU(),
        *[BasicBlock(channels) for _ in range(blocks)],
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(channels, 10),
    )


class Variant:
    def __init__(self, name: str, tool: str, model: nn.Module, run, *, plan=None) -> None:
        self.name, self.tool, self.model, self.run, self.plan = name, tool, model, run, plan
        self.peak = 0
        self.times: list[float] = []
        self.cpu_times: list[float] = []
        self.faults: list[int] = []

    def step(self, x, y) -> None:
        for p in self.model.parameters():  # freed, as zero_grad() does by default (and check_plan)
            p.grad = None
        self.run(self.model, x, y)

    @property
    def ms(self) -> float:
        """The median CPU time of a step (this process's threads): on a machine shared with other work,
        wall time measures the others' load as much as the step; CPU time much less."""
        return statistics.median(self.cpu_times)

    @property
    def wall_ms(self) -> float:
        return statistics.median(self.times)


def _loss(out, y):
    return nn.functional.cross_entropy(out, y)


def _measure_peak(v: Variant, x, y, warmup: int = 2) -> None:
    for _ in range(warmup):
        v.step(x, y)
    with StepTracker(v.model) as tracker:
        tracker.track(x)
        v.step(x, y)
    v.peak = tracker.report().total_peak_bytes


def build(name: str, args) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = chain(args.layers, args.channels) if name == "chain" else resnet(args.blocks, args.channels)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(args.batch, 3, args.size, args.size, generator=g)
    y = torch.randint(0, 10, (args.batch,), generator=g)
    return model, x, y


def pytorch_variants(base: nn.Module, args) -> list[Variant]:
    out = [Variant("plain", "plain", copy.deepcopy(base), lambda m, x, y: _loss(m(x), y).backward())]
    n = len(base)
    for k in sorted({s for s in args.segments if 1 <= s <= n}):
        out.append(
            Variant(
                f"ckpt_seq({k})",
                "checkpoint_sequential",
                copy.deepcopy(base),
                lambda m, x, y, k=k: _loss(checkpoint_sequential(m, k, x, use_reentrant=False), y).backward(),
            )
        )
    for b in args.budgets:
        model = copy.deepcopy(base)
        compiled = torch.compile(_fresh_forward(model))
        state = {"first": True}

        def run(m, x, y, compiled=compiled, b=b, state=state):
            if state["first"]:  # the forward and the backward graphs compile at the first step, under the budget
                state["first"] = False
                with torch._functorch.config.patch(activation_memory_budget=b):
                    _loss(compiled(x), y).backward()
                return
            _loss(compiled(x), y).backward()

        out.append(Variant(f"compile({b:g})", "torch.compile", model, run))
    return out


def _fresh_forward(model: nn.Module):
    """`model`'s call under a code object of its own: Dynamo caches compiled graphs per code object (and,
    inlining modules, shares one graph between instances of one structure), so each budget compiles anew."""
    scope: dict = {}
    exec("def forward(x):\n    return model(x)\n", {"model": model}, scope)  # noqa: S102 - a new code object
    return scope["forward"]


def ucudnn_variant(base: nn.Module, x, y, policy: str, limit: int) -> Variant | None:
    model = copy.deepcopy(base)
    plan = plan_memory(model, x, memory_limit=limit, policy=policy, loss=lambda out: _loss(out, y))
    if not plan.fits:
        return None

    def run(m, x, y, plan=plan):
        with execute_plan(m, plan):
            _loss(m(x), y).backward()

    return Variant(f"ucudnn:{policy}@{limit / MiB:.1f}MiB", f"ucudnn {policy}", model, run, plan=plan)


def frontier(points: list[Variant]) -> list[Variant]:
    """The points no other point beats in both peak and time."""
    return [
        p
        for p in points
        if not any(q.peak <= p.peak and q.ms <= p.ms and (q.peak, q.ms) != (p.peak, p.ms) for q in points)
    ]


def run_model(name: str, args) -> dict:
    base, x, y = build(name, args)
    variants = pytorch_variants(base, args)
    print(f"[{name}] measuring peaks of {len(variants)} PyTorch variants", file=sys.stderr)
    for v in variants:
        _measure_peak(v, x, y)
    plain = variants[0].peak
    limits = sorted(
        {v.peak for v in variants if v.tool == "checkpoint_sequential"} | {int(f * plain) for f in args.limits}
    )  # above 1: everything resident, the executor's cost
    targets = {v.peak: v for v in variants if v.tool == "checkpoint_sequential"}
    ours: list[Variant] = []
    by_limit: dict[tuple[str, int], Variant] = {}
    for policy in args.policies:
        seen: dict[tuple, Variant] = {}
        for limit in limits:
            v = ucudnn_variant(base, x, y, policy, limit)
            if v is None:
                continue
            key = (v.plan.tensors, v.plan.conv_workspace)
            if key not in seen:  # a plan equal to one at a smaller limit is measured once
                _measure_peak(v, x, y)
                seen[key] = v
                ours.append(v)
            by_limit[(policy, limit)] = seen[key]
    everything = variants + ours
    print(f"[{name}] timing {len(everything)} variants, {args.rounds} interleaved rounds", file=sys.stderr)
    time_rounds(everything, x, y, args.rounds)

    rows = []
    for v in everything:
        pred = (f"{v.plan.peak_bytes / MiB:.1f}", f"{v.plan.step_ms:.1f}") if v.plan else ("", "")
        rows.append(
            [
                v.name,
                f"{v.peak / MiB:.1f}",
                f"{v.ms:.1f}",
                f"{v.wall_ms:.1f}",
                f"{statistics.median(v.faults):.0f}",
                *pred,
            ]
        )
    print(f"\n{name}: batch {args.batch}, {args.size}x{args.size}")
    print(
        table(
            [
                "variant",
                "peak MiB (tracker)",
                "CPU ms/step",
                "wall ms/step",
                "page faults/step",
                "planned peak MiB",
                "planned ms",
            ],
            rows,
        )
    )

    # at each checkpoint_sequential peak: ucudnn's plan given that limit
    equal = []
    for peak, ref in sorted(targets.items()):
        for policy in args.policies:
            mine = by_limit.get((policy, peak))
            row = {
                "checkpoint_sequential": ref.name,
                "limit_bytes": peak,
                "policy": policy,
                "ref_ms": ref.ms,
                "fits": mine is not None,
            }
            if mine is not None:
                row.update(
                    peak_bytes=mine.peak,
                    ms=mine.ms,
                    reaches=mine.peak <= peak * (1 + SLACK),
                    no_slower=mine.ms <= ref.ms * (1 + SLACK),
                )
            equal.append(row)
    print(
        table(
            ["at the peak of", "limit MiB", "policy", "fits", "peak MiB", "ms", "vs ckpt_seq ms"],
            [
                [
                    r["checkpoint_sequential"],
                    f"{r['limit_bytes'] / MiB:.1f}",
                    r["policy"],
                    r["fits"],
                    f"{r.get('peak_bytes', 0) / MiB:.1f}",
                    f"{r.get('ms', float('nan')):.1f}",
                    f"{r.get('ms', float('nan')) / r['ref_ms']:.2f}",
                ]
                for r in equal
            ],
        )
    )
    ucudnn_front = frontier(ours + [variants[0]])
    beaten = [
        (q.name, u.name)
        for u in ucudnn_front
        if u.tool.startswith("ucudnn")
        for q in variants
        if q.tool != "plain" and q.peak < u.peak * (1 - SLACK) and q.ms < u.ms * (1 - SLACK)
    ]
    print(
        f"PyTorch points both smaller and faster than a ucudnn frontier point by more than {SLACK:.0%}: "
        f"{beaten or 'none'}"
    )
    return {
        "model": name,
        "batch": args.batch,
        "size": args.size,
        "points": [
            {
                "name": v.name,
                "tool": v.tool,
                "peak_bytes": v.peak,
                "step_ms": v.ms,
                "wall_ms": v.wall_ms,
                "cpu_times_ms": v.cpu_times,
                "times_ms": v.times,
                "page_faults": v.faults,
                "planned_peak_bytes": v.plan.peak_bytes if v.plan else None,
                "planned_step_ms": v.plan.step_ms if v.plan else None,
            }
            for v in everything
        ],
        "equal_memory": equal,
        "beaten": beaten,
    }


def time_rounds(variants: list, x, y, rounds: int) -> None:
    """Each variant's step `rounds` times, the variants taking turns: wall and CPU ms and page faults per step."""
    for _ in range(rounds):
        for v in variants:
            faults, start, cpu = minor_faults(), time.perf_counter(), time.process_time()
            v.step(x, y)
            v.cpu_times.append((time.process_time() - cpu) * 1e3)
            v.times.append((time.perf_counter() - start) * 1e3)
            v.faults.append(minor_faults() - faults)


# tool -> (colour, marker) in the plot
STYLES = {
    "plain": ("k", "*"),
    "checkpoint_sequential": ("tab:blue", "o"),
    "torch.compile": ("tab:orange", "s"),
    "ucudnn checkpoint": ("tab:green", "^"),
    "ucudnn optimal": ("tab:red", "v"),
}


def plot(
    results: list[dict], path: str, styles: dict = STYLES, joined: tuple[str, ...] = ("checkpoint_sequential",)
) -> None:
    """Peak against step time per model, one marker per tool; ucudnn's points and those of the `joined` tools
    drawn as lines (fronts)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(6 * len(results), 4.5), squeeze=False)
    for ax, res in zip(axes[0], results):
        for tool in dict.fromkeys(p["tool"] for p in res["points"]):
            pts = sorted((p["peak_bytes"] / MiB, p["step_ms"]) for p in res["points"] if p["tool"] == tool)
            color, marker = styles.get(tool, ("gray", "x"))
            ax.plot(
                [p[0] for p in pts],
                [p[1] for p in pts],
                marker=marker,
                color=color,
                label=tool,
                linestyle="-" if tool.startswith("ucudnn") or tool in joined else "none",
            )
        ax.set_xlabel("peak memory, MiB (counted by StepTracker)")
        ax.set_ylabel("step CPU time, ms (median, interleaved)")
        ax.set_title(f"{res['model']}, batch {res['batch']}, {res['size']}x{res['size']} (CPU)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="chain,resnet")
    ap.add_argument("--layers", type=int, default=16, help="chain: conv layers")
    ap.add_argument("--blocks", type=int, default=8, help="resnet: basic blocks")
    ap.add_argument("--channels", type=int, default=32)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--size", type=int, default=32)
    ap.add_argument("--segments", default="2,3,4,6,8")
    ap.add_argument("--budgets", default="1,0.6,0.3,0")
    ap.add_argument("--policies", default="checkpoint,optimal")
    ap.add_argument("--limits", default="0.3,0.5,0.7,1.2", help="more ucudnn limits, as fractions of the plain peak")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument(
        "--malloc",
        choices=("default", "keep"),
        default="default",
        help="keep: glibc keeps what a step frees (no page faults to take it back)",
    )
    ap.add_argument("--json", dest="json_path")
    ap.add_argument("--plot", dest="plot_path")
    args = ap.parse_args()
    if args.malloc == "keep":
        keep_freed_memory()
    args.segments = [int(s) for s in args.segments.split(",")]
    args.budgets = [float(b) for b in args.budgets.split(",")]
    args.policies = args.policies.split(",")
    args.limits = [float(f) for f in args.limits.split(",") if f]
    watch_inductor_buffers()  # before anything compiles: the trackers count Inductor's own buffers
    # every budget compiles its own graphs: no compiled artifact is taken from an on-disk cache
    torch._functorch.config.enable_autograd_cache = False
    torch._inductor.config.fx_graph_cache = False
    results = [run_model(m, args) for m in args.models.split(",")]
    if args.json_path:
        with open(args.json_path, "w", encoding="utf-8") as f:
            json.dump(
                {
                    "results": results,
                    "torch": torch.__version__,
                    "threads": torch.get_num_threads(),
                    "malloc": args.malloc,
                },
                f,
                indent=1,
            )
    if args.plot_path:
        plot(results, args.plot_path)


if __name__ == "__main__":
    main()
