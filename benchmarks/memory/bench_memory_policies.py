"""Issue 11's targets for Chen et al.'s checkpointing, Dymem (order, prefetch, GTBM) and Kim et al.'s swapping.

Every figure comes from the planner's event simulator (`ucudnn.memory.simulate`) on the zoo's
training graphs and the built-in device profiles; none is a timing of this machine, so the figures
are deterministic and the same on any machine.

1. sqrt(n) checkpointing of ResNet-152 (H100 profile): the extra step time, in forward passes
   (target: at most 1), and the peak against keeping everything; with Algorithm 3's budget search
   and the exact segment search beside it.
2. GTBM against best-fit (K40 profile): the mean unusable free space U_f over the main-space
   requests of one step's allocation trace, both pools at the same capacity (target: GTBM's U_f
   below best-fit's on GoogLeNet and DenseNet), and each pool's smallest size. Traces: everything
   resident, vDNN_conv's and vDNN_all's offloads, and Dymem's own plan at 40% of the resident peak.
3. Dymem against vDNN at 40% of the resident peak (K40): the same search, vDNN's one-layer prefetch
   against Dymem's two-conv look-ahead.
4. Multi-GPU swapping: 4 P100s or H100s on one PCIe switch (devices_per_link = 4), 90% and 80% of
   the resident peak: staggered (GPU i swaps layers i % x + jx) against every GPU swapping the same
   b layers at once, with vDNN's one-layer trigger and with the measured-time trigger search (target:
   staggered stalls less). The slowest GPU's step time (data-parallel GPUs wait for it every step:
   the paper's throughput) and stall. "At once" twice: every GPU swaps GPU 0's layers (as the paper's
   vDNN baseline would: the same layers everywhere, but not the staggered run's bytes), and every GPU
   swaps GPU g's layers for each g of the group in turn, averaged (together the staggered run's
   bytes). One GPU alone for reference.

    python benchmarks/memory/bench_memory_policies.py [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py, models.py

from common import table

from ucudnn.devices import load_profile
from ucudnn.memory import checkpoint, dymem, gtbm, make_plan, swap_multi
from ucudnn.memory.graph import from_network
from ucudnn.memory.planner import baseline
from ucudnn.memory.simulate import simulate
from ucudnn.memory.timing import step_costs
from ucudnn.memory.vdnn import actions_for

GIB = 2**30
MIB = 2**20


def checkpointing(report: dict) -> None:
    device = load_profile("h100")
    rows = []
    for batch in (32, 128):
        graph = from_network("resnet152", batch)
        base = baseline(graph, device)
        forward = checkpoint.forward_ms(graph, base.costs)
        resident = simulate(graph, device, base.costs, timeline=False).peak_bytes
        for search in ("sqrt", "greedy", "optimal"):
            p = checkpoint.plan(graph, device, 2**62, search=search)
            extra = (p.step_ms - p.baseline_step_ms) / forward
            rows.append(
                [
                    f"resnet152 b{batch}",
                    search,
                    f"{resident / GIB:.2f}",
                    f"{p.peak_bytes / GIB:.2f}",
                    f"{1 - p.peak_bytes / resident:.0%}",
                    f"{p.baseline_step_ms:.1f}",
                    f"{p.step_ms:.1f}",
                    f"{extra:.2f}",
                    sum(t.action == "recompute" for t in p.tensors),
                ]
            )
            report.setdefault("checkpoint", []).append(
                {
                    "batch": batch,
                    "search": search,
                    "resident_peak_bytes": resident,
                    "peak_bytes": p.peak_bytes,
                    "baseline_step_ms": p.baseline_step_ms,
                    "step_ms": p.step_ms,
                    "forward_ms": forward,
                    "extra_forward_passes": extra,
                }
            )
    print("1. Checkpointing ResNet-152 on the H100 profile (target: sqrt at most 1 extra forward pass)\n")
    print(
        table(
            [
                "graph",
                "search",
                "resident GiB",
                "peak GiB",
                "saved",
                "base ms",
                "step ms",
                "extra fwd passes",
                "recomputed",
            ],
            rows,
        )
    )


def pools(report: dict) -> None:
    device = load_profile("k40")
    rows = []
    for net, batch in (("googlenet", 128), ("densenet40", 64), ("resnet50", 64)):
        graph = from_network(net, batch)
        costs = step_costs(graph, device)
        traces = {}
        for mode in ("none", "conv", "all"):
            acts = actions_for(graph, mode)
            traces[f"vdnn-{mode}" if mode != "none" else "resident"] = (graph, acts, costs)
        resident = simulate(graph, device, costs, timeline=False).peak_bytes
        p = dymem.plan(graph, device, int(resident * 0.4))
        g = dymem.dfs_graph(graph)
        acts = {t.name: t.action for t in p.tensors}
        ws = {(c.layer, c.kind): c.bytes for c in p.conv_workspace}
        traces["dymem@40%"] = (g, acts, step_costs(g, device, workspace=ws))
        for name, (g, acts, c) in traces.items():
            trace = dymem.allocation_trace(g, acts, c, dymem.prefetch_schedule(g, acts))
            cmp = gtbm.compare(trace)
            rows.append(
                [
                    f"{net} b{batch}",
                    name,
                    sum(isinstance(e, gtbm.Alloc) for e in trace),
                    f"{cmp.peak_live_bytes / MIB:.0f}",
                    f"{cmp.best_fit_bytes / MIB:.0f}",
                    f"{cmp.gtbm_bytes / MIB:.0f}",
                    f"{cmp.best_fit.mean_unusable:.4f}",
                    f"{cmp.gtbm.mean_unusable:.4f}",
                    "GTBM" if cmp.gtbm.mean_unusable < cmp.best_fit.mean_unusable else "best-fit",
                ]
            )
            report.setdefault("gtbm", []).append(
                {
                    "network": net,
                    "batch": batch,
                    "trace": name,
                    "peak_live_bytes": cmp.peak_live_bytes,
                    "best_fit_bytes": cmp.best_fit_bytes,
                    "gtbm_bytes": cmp.gtbm_bytes,
                    "best_fit_mean_uf": cmp.best_fit.mean_unusable,
                    "gtbm_mean_uf": cmp.gtbm.mean_unusable,
                }
            )
    print(
        "\n2. GTBM against best-fit on one step's allocation trace, K40 profile (target: GTBM's U_f lower "
        "on GoogLeNet and DenseNet)\n"
    )
    print(
        table(
            [
                "graph",
                "trace",
                "requests",
                "live peak MiB",
                "best-fit pool MiB",
                "GTBM pool MiB",
                "best-fit mean U_f",
                "GTBM mean U_f",
                "lower U_f",
            ],
            rows,
        )
    )


def dymem_vs_vdnn(report: dict) -> None:
    device = load_profile("k40")
    rows = []
    for net, batch in (("googlenet", 128), ("densenet40", 64), ("resnet50", 64), ("vgg16", 64)):
        graph = from_network(net, batch)
        resident = simulate(graph, device, baseline(graph, device).costs, timeline=False).peak_bytes
        limit = int(resident * 0.4)
        for policy in ("vdnn-dyn", "dymem"):
            p = make_plan(graph, device, limit, policy)
            rows.append(
                [
                    f"{net} b{batch}",
                    policy,
                    f"{limit / GIB:.2f}",
                    "yes" if p.fits else "NO",
                    f"{p.peak_bytes / GIB:.2f}",
                    f"{p.step_ms:.1f}",
                    f"{p.overhead:+.1%}",
                    f"{p.stall_ms:.1f}",
                ]
            )
            report.setdefault("dymem", []).append(
                {
                    "network": net,
                    "batch": batch,
                    "policy": policy,
                    "limit": limit,
                    "fits": p.fits,
                    "step_ms": p.step_ms,
                    "overhead": p.overhead,
                    "stall_ms": p.stall_ms,
                }
            )
    print("\n3. Dymem against vDNN_dyn at 40% of the resident peak, K40 profile\n")
    print(table(["graph", "policy", "limit GiB", "fits", "peak GiB", "step ms", "overhead", "stall ms"], rows))


def multi_gpu(report: dict) -> None:
    rows = []
    wins = {
        (trigger, against, figure): 0
        for trigger in ("layer", "kim")
        for against in ("gpu0", "equal")
        for figure in ("step", "stall")
    }
    for dev in ("p100", "h100"):
        device = load_profile(dev)
        for net, batch in (("vgg16", 64), ("resnet50", 64), ("googlenet", 128)):
            graph = from_network(net, batch)
            costs = baseline(graph, device).costs
            resident = simulate(graph, device, costs, timeline=False).peak_bytes
            a = len(swap_multi.swappable(graph))
            for fraction in (0.9, 0.8):
                limit = int(resident * fraction)
                plan = swap_multi.plan(graph, device, limit, devices=4, devices_per_link=4)
                b = sum(t.action == "offload" for t in plan.tensors)
                # at once: every GPU swaps the same layers; with each staggered GPU's layers in turn, the
                # runs together move what the staggered run moves (equal bytes), GPU 0's alone need not
                cases = {"staggered": (swap_multi.device_actions(graph, b, 4, 4), 4)}
                sets = min(a // b, 4)
                for g in range(sets):
                    cases[f"at once {g}"] = (swap_multi.device_actions(graph, b, 4, 4, stagger=False, as_gpu=g), 4)
                cases["1 GPU"] = (swap_multi.device_actions(graph, b, 1, 1), 1)
                figures: dict[str, dict] = {}
                for name, (actions, n) in cases.items():
                    layer = simulate(
                        graph, device, costs, actions, memory_limit=limit, devices=n, devices_per_link=n, timeline=False
                    )
                    _, kim = swap_multi.adapt_triggers(graph, device, costs, actions, limit, n)
                    figures[name] = {
                        "bytes_offloaded": sum(d.bytes_offloaded for d in layer.devices),
                        "fits": layer.fits and kim.fits,
                        # data-parallel GPUs wait for the slowest every step: its step time is the throughput
                        "layer": {"step_ms": layer.step_ms, "stall_ms": layer.stall_ms},
                        "kim": {"step_ms": kim.step_ms, "stall_ms": kim.stall_ms},
                    }
                at_once = [figures[f"at once {g}"] for g in range(sets)]
                figures["at once, equal bytes"] = {
                    "bytes_offloaded": sum(f["bytes_offloaded"] for f in at_once) / sets,
                    **{
                        t: {k: sum(f[t][k] for f in at_once) / sets for k in ("step_ms", "stall_ms")}
                        for t in ("layer", "kim")
                    },
                }
                against = {"gpu0": figures["at once 0"], "equal": figures["at once, equal bytes"]}
                for trigger in ("layer", "kim"):
                    mine = figures["staggered"][trigger]
                    for name, other in against.items():
                        wins[(trigger, name, "step")] += mine["step_ms"] < other[trigger]["step_ms"]
                        wins[(trigger, name, "stall")] += mine["stall_ms"] < other[trigger]["stall_ms"]
                    rows.append(
                        [
                            dev,
                            f"{net} b{batch}",
                            f"{fraction:.0%}",
                            b,
                            a // b,
                            "yes" if plan.fits and figures["staggered"]["fits"] else "NO",
                            "vDNN layer" if trigger == "layer" else "Kim",
                            f"{figures['staggered']['bytes_offloaded'] / figures['at once 0']['bytes_offloaded']:.2f}",
                            *(
                                f"{f[trigger]['step_ms']:.1f} / {f[trigger]['stall_ms']:.1f}"
                                for f in (figures["staggered"], against["gpu0"], against["equal"])
                            ),
                            f"{figures['1 GPU'][trigger]['step_ms']:.1f}",
                        ]
                    )
                report.setdefault("swap_multi", []).append(
                    {
                        "device": dev,
                        "network": net,
                        "batch": batch,
                        "limit_fraction": fraction,
                        "swapped_per_gpu": b,
                        "interval_x": a // b,
                        "fits": plan.fits,
                        "figures": figures,
                    }
                )
    print(
        "\n4. Swapping on 4 GPUs behind one PCIe switch (target: staggered stalls less than all at once);\n"
        "   step ms / stall ms of the slowest GPU, with vDNN's one-layer trigger and with Kim et al.'s measured trigger\n"
    )
    print(
        table(
            [
                "device",
                "graph",
                "limit",
                "b",
                "x",
                "fits",
                "trigger",
                "bytes vs GPU 0's",
                "staggered",
                "at once: GPU 0's layers",
                "at once: each GPU's (mean)",
                "1 GPU step ms",
            ],
            rows,
        )
    )
    cases = len(rows) // 2
    for trigger, label in (("layer", "vDNN's one-layer trigger"), ("kim", "Kim's trigger")):
        print(
            f"\nstaggered beats at once, {label}: "
            + "; ".join(
                f"{figure} {wins[(trigger, 'gpu0', figure)]}/{cases} against GPU 0's layers, "
                f"{wins[(trigger, 'equal', figure)]}/{cases} at equal bytes"
                for figure in ("step", "stall")
            )
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="also write the figures to this JSON file")
    args = parser.parse_args()
    report: dict = {}
    checkpointing(report)
    pools(report)
    dymem_vs_vdnn(report)
    multi_gpu(report)
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
