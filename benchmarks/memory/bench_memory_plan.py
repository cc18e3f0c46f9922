"""Issue 11's targets for the memory planner, side by side in one run.

1. The memory model: VGG-16's network-wide baseline (every feature map and gradient map allocated
   for the whole step, weights and their gradients, the largest workspace) against the vDNN paper's
   15 GB (batch 128) and 28 GB (batch 256).
2. vDNN on the K40 profile: VGG-16 (256) within 12 GiB with vdnn-dyn; vdnn-all's peak against the
   baseline (target: at least 60% lower). Then vdnn-dyn's profiling passes on AlexNet (256): which pass
   gives the plan as the limit falls toward pass (1)'s floor (vDNN_all, memory-optimal algorithms).
3. optimal: VGG-16 (256) in 12 GiB on the K40 at <= 10% simulated overhead; ResNet-50 (128) on the
   H100 at half the peak of keeping everything (simulated, freed after last use: what PyTorch holds)
   at <= 15% overhead.
4. Planning ResNet-152 (256) with optimal on this machine: <= 10 s (wall clock, everything included:
   graph, conv fronts from the shipped H100 measurements, program, simulation).

    python benchmarks/memory/bench_memory_plan.py
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py, models.py

from common import table

from ucudnn.devices import PROFILES
from ucudnn.memory import make_plan
from ucudnn.memory.graph import from_network
from ucudnn.memory.optimal import search
from ucudnn.memory.planner import baseline
from ucudnn.memory.simulate import simulate
from ucudnn.memory.timing import conv_fronts, step_costs
from ucudnn.memory.vdnn import actions_for

GB, GIB = 10**9, 2**30


def keep_all_peak(graph, device) -> int:
    """Everything kept, each tensor freed after its last use (what PyTorch's autograd holds)."""
    return simulate(graph, device, baseline(graph, device).costs, timeline=False).peak_bytes


def main() -> None:
    k40, h100 = PROFILES["k40"], PROFILES["h100"]
    print("1. VGG-16 network-wide baseline against the vDNN paper")
    rows = []
    for batch, paper_gb in ((128, 15), (256, 28)):
        g = from_network("vgg16", batch)
        base = baseline(g, k40)
        # vDNN's own count shares one dX and one dY buffer across layers; shown for comparison
        grads = max(t.bytes for t in g.tensors.values() if t.kind == "gradient")
        shared = g.feature_map_bytes + 2 * grads + 2 * g.weight_bytes + max(c.workspace for c in base.costs)
        rows.append(
            [
                batch,
                f"{base.peak_bytes / GB:.1f} GB ({base.peak_bytes / GIB:.1f} GiB)",
                paper_gb,
                f"{base.peak_bytes / GB / paper_gb - 1:+.1%}",
                f"{base.peak_bytes / GIB / paper_gb - 1:+.1%}",
                f"{shared / GIB:.1f} GiB",
            ]
        )
    print(table(["batch", "ucudnn baseline", "paper GB", "vs paper (GB)", "vs paper (GiB)", "one shared dX, dY"], rows))

    print("\n2./3. VGG-16 (256) on the K40 profile, 12 GiB")
    g = from_network("vgg16", 256)
    rows = []
    for policy in ("vdnn-all", "vdnn-conv", "vdnn-dyn", "optimal"):
        start = time.perf_counter()
        p = make_plan(g, k40, 12 * GIB, policy)
        rows.append(
            [
                policy,
                "yes" if p.fits else "NO",
                f"{p.peak_bytes / GIB:.2f}",
                f"{1 - p.peak_bytes / p.baseline_peak_bytes:.1%}",
                f"{p.overhead:+.1%}",
                f"{p.stall_ms:.0f}",
                f"{p.bytes_offloaded / GIB:.1f}",
                f"{time.perf_counter() - start:.2f}",
                p.search,
            ]
        )
    print(
        table(
            [
                "policy",
                "fits",
                "peak GiB",
                "cut vs baseline",
                "overhead",
                "stall ms",
                "offloaded GiB",
                "plan s",
                "vdnn-dyn pass",
            ],
            rows,
        )
    )

    print("\n2b. vdnn-dyn's passes, AlexNet (256) on the K40 profile, limits relative to pass (1)'s peak")
    g = from_network("alexnet", 256)
    fronts = conv_fronts(g, k40)
    smallest = {k: o[0].workspace for k, o in fronts.items()}
    floor = simulate(
        g, k40, step_costs(g, k40, workspace=smallest, fronts=fronts), actions_for(g, "all"), timeline=False
    ).peak_bytes
    rows = []
    for fraction in (1.3, 1.1, 1.05, 1.03, 1.01, 1.0, 0.98):
        p = make_plan(g, k40, int(floor * fraction), "vdnn-dyn")
        downgraded = sum(c.bytes < max(o.workspace for o in fronts[(c.layer, c.kind)]) for c in p.conv_workspace)
        rows.append(
            [
                f"{fraction:.2f}",
                f"{floor * fraction / GIB:.2f}",
                p.search,
                "yes" if p.fits else "NO",
                f"{p.peak_bytes / GIB:.2f}",
                f"{p.overhead:+.1%}",
                f"{downgraded}/{len(fronts)}",
            ]
        )
    print(table(["x floor", "limit GiB", "pass", "fits", "peak GiB", "overhead", "kernels below fastest"], rows))

    print("\n3. ResNet-50 (128) on the H100 profile at half the peak of keeping everything")
    g = from_network("resnet50", 128)
    keep = keep_all_peak(g, h100)
    limit = keep // 2
    rows = []
    for policy in ("vdnn-all", "vdnn-dyn", "optimal"):
        start = time.perf_counter()
        if policy == "optimal":
            found = search(g, h100, limit)
            p, extra = found.plan, f"MIP gap {found.mip_gap:.2%}, simulated vs program {found.model_gap:+.1%}"
        else:
            p = make_plan(g, h100, limit, policy)
            extra = f"pass {p.search}" if p.search else ""
        rows.append(
            [
                policy,
                "yes" if p.fits else "NO",
                f"{p.peak_bytes / GIB:.2f}",
                f"{1 - p.peak_bytes / keep:.1%}",
                f"{p.overhead:+.1%}",
                f"{p.stall_ms:.1f}",
                f"{time.perf_counter() - start:.2f}",
                extra,
            ]
        )
    print(
        f"keeping everything: peak {keep / GIB:.2f} GiB (network-wide {baseline(g, h100).peak_bytes / GIB:.2f}"
        f" GiB); limit {limit / GIB:.2f} GiB; baseline step {baseline(g, h100).step_ms:.1f} ms"
    )
    print(table(["policy", "fits", "peak GiB", "cut vs keep", "overhead", "stall ms", "plan s", "search"], rows))

    print("\n4. Planning ResNet-152 (256) with optimal on the H100 profile, half the peak of keeping everything")
    start = time.perf_counter()
    g = from_network("resnet152", 256)
    limit = keep_all_peak(g, h100) // 2
    found = search(g, h100, limit)
    elapsed = time.perf_counter() - start
    p = found.plan
    print(
        table(
            ["limit GiB", "fits", "peak GiB", "overhead", "MIP gap", "solver s", "rounds", "total s"],
            [
                [
                    f"{limit / GIB:.2f}",
                    "yes" if p.fits else "NO",
                    f"{p.peak_bytes / GIB:.2f}",
                    f"{p.overhead:+.1%}",
                    f"{found.mip_gap:.2%}",
                    f"{found.solve_time_s:.2f}",
                    found.rounds,
                    f"{elapsed:.2f}",
                ]
            ],
        )
    )


if __name__ == "__main__":
    main()
