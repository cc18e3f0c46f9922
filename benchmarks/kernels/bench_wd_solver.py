"""WD solve time: the specialised MCKP solver, HiGHS (scipy milp) and GLPK (glpsol), side by side.

The instances are synthetic, from a documented seeded generator (`network_fronts`), shaped like
the paper's (Oyama et al., "Accelerating deep learning frameworks with micro-batches"):

- ResNet-50, batch 32: 53 conv layers (the stem, 16 bottlenecks x 3, 4 projections) x 3 kernels,
  minus the first layer's bwd_data = 158 kernels with 560 front members in total (the paper's
  ~560 variables).
- ResNet-152, batch 128: 155 conv layers (the stem, 50 bottlenecks x 3, 4 projections) x 3 - 1 =
  464 kernels. A larger batch can be divided in more ways, so fronts are longer: we assume twice
  the mean length (sqrt(128 / 32) = 2), i.e. 464 x 2 x 560 / 158 = 3289 members.

Each total workspace W is the smallest feasible total plus a fraction of the range up to "every
kernel at its fastest" (10 %, 30 % and 60 %). Every solver gets the same instance; the same optimal
total time is asserted (relative 1e-9; glpsol's solution is read back and re-evaluated).

Timing: every contender runs once per rep, in turn (interleaved, so that all see the same machine
load), and the median of --reps is reported. Our two solvers are timed as `wd.solve(...)` calls
(validation included). glpsol is timed as a whole process solving a CPLEX LP file written
beforehand; its start-up, parsing and output are estimated by glpsol on a one-variable program,
interleaved the same way, and the table shows both the raw process time and the time net of that
start-up (the GLPK ratio uses the net time). glpsol's own "Time used" line has 0.1 s resolution,
so it is not used.

    python benchmarks/kernels/bench_wd_solver.py [--reps 15] [--json FILE]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py, models.py
from common import interleaved_medians_ms, table
from ucudnn.solver import Configuration, MicroConfig, wd

MIB = 2**20
FRACTIONS = (0.1, 0.3, 0.6)
# Tolerance on "the same optimum": solvers may pick different choices of equal total time.
SAME_OPTIMUM_REL = 1e-9
GLPK_TARGET_RATIO = 5.0


@contextlib.contextmanager
def quiet_stdout():
    """Silence file descriptor 1: HiGHS 1.12 prints a stray debug line from C++ on some solves
    (ERGO-Code/HiGHS#2783) that `disp=False` does not cover."""
    sys.stdout.flush()
    saved = os.dup(1)
    with open(os.devnull, "w") as devnull:
        os.dup2(devnull.fileno(), 1)
    try:
        yield
    finally:
        os.dup2(saved, 1)
        os.close(saved)


def solve_quietly(fronts, total: int, method: str):
    with quiet_stdout():
        return wd.solve(fronts, total, method=method)


def network_fronts(n_kernels: int, n_members: int, seed: int) -> dict[str, list[Configuration]]:
    """A seeded synthetic WD instance: `n_kernels` Pareto fronts with `n_members` members in all.

    Per kernel: a base time (log-uniform 0.2..6 ms, the spread of conv layers in a ResNet), a front
    length (1 + Poisson, adjusted so the lengths sum to `n_members`), a smallest workspace (0 for
    70 % of kernels, else up to 4 MiB) and a largest (log-uniform 8 MiB..1 GiB). The members between
    have log-uniform workspaces and times falling from 1.5..3x the base time to 0.5..1x in uneven
    steps. The fronts are neither convex nor aligned across kernels, so the LP relaxation is not
    integral.
    """
    rng = np.random.default_rng(seed)
    lengths = 1 + rng.poisson(n_members / n_kernels - 1, n_kernels)
    lengths = np.clip(lengths, 1, 12)
    while lengths.sum() != n_members:
        k = rng.integers(n_kernels)
        if lengths.sum() < n_members and lengths[k] < 12:
            lengths[k] += 1
        elif lengths.sum() > n_members and lengths[k] > 1:
            lengths[k] -= 1
    fronts: dict[str, list[Configuration]] = {}
    for k, length in enumerate(lengths.tolist()):
        kind = ("fwd", "bwd_data", "bwd_filter")[k % 3]
        base_ms = float(np.exp(rng.uniform(np.log(0.2), np.log(6.0))))
        smallest_B = 0 if rng.random() < 0.7 else int(rng.integers(1, 4 * MIB))
        largest_B = float(np.exp(rng.uniform(np.log(8 * MIB), np.log(1024 * MIB))))
        # Workspaces log-uniform between the smallest and the largest, times from 1.5..3x the base
        # down to 0.5..1x, in uneven (non-convex) steps.
        low_B = max(smallest_B, 256 * 1024)
        inner_B = np.exp(np.sort(rng.uniform(np.log(low_B), np.log(largest_B), length - 1)))
        workspaces_B = np.unique(np.concatenate(([smallest_B], inner_B.astype(np.int64))))
        slow_ms, fast_ms = base_ms * rng.uniform(1.5, 3.0), base_ms * rng.uniform(0.5, 1.0)
        steps = np.sort(rng.uniform(0.0, 1.0, len(workspaces_B) - 1))[::-1]
        times_ms = fast_ms + (slow_ms - fast_ms) * np.concatenate(([1.0], steps))
        fronts[f"conv{k // 3}.{kind}"] = [
            Configuration((MicroConfig(f"algo{j}", 1, float(t), int(w)),))
            for j, (t, w) in enumerate(zip(times_ms, workspaces_B, strict=True))
        ]
    return fronts


def instance_totals(fronts) -> list[int]:
    smallest = sum(f[0].workspace for f in fronts.values())
    largest = sum(f[-1].workspace for f in fronts.values())
    return [int(smallest + frac * (largest - smallest)) for frac in FRACTIONS]


def write_cplex_lp(fronts, total_workspace: int, path: Path) -> list[tuple[str, Configuration]]:
    """The WD program as a CPLEX LP file; returns the configuration behind each column x<i>."""
    columns: list[tuple[str, Configuration]] = []
    objective, rows, knapsack = [], [], []
    for k, (key, front) in enumerate(fronts.items()):
        names = []
        for config in front:
            name = f"x{len(columns)}"
            columns.append((key, config))
            names.append(name)
            objective.append(f"{config.time!r} {name}")
            if config.workspace:
                knapsack.append(f"{config.workspace} {name}")
        rows.append(f" onehot{k}: " + " + ".join(names) + " = 1")  # sum_c x_kc = 1
    lines = ["Minimize", " time: " + " + ".join(objective), "Subject To", *rows]
    # sum_kc w_kc x_kc <= W, wrapped: CPLEX LP lines must stay short
    lines.append(" knapsack: " + (" + ".join(knapsack) or "0 x0") + f" <= {total_workspace}")
    text = "\n".join(_wrap(line) if line.startswith(" ") else line for line in lines)
    text += "\nBinary\n" + "\n".join(f" x{i}" for i in range(len(columns))) + "\nEnd\n"
    path.write_text(text)
    return columns


def _wrap(line: str, width: int = 200) -> str:
    """Break a long row between terms (GLPK reads CPLEX LP lines of limited length)."""
    out, current = [], ""
    for token in line.split():
        if current and len(current) + 1 + len(token) > width:
            out.append(current)
            current = " " + token
        else:
            current = f"{current} {token}" if current else f" {token}"
    out.append(current)
    return "\n".join(out)


def glpsol_run(lp: Path, solution: Path):
    """A function that runs glpsol once on `lp` (as a whole process), writing `solution`."""
    command = ["glpsol", "--cpxlp", str(lp), "--write", str(solution), "--tmlim", "300"]
    return lambda: subprocess.run(command, check=True, capture_output=True)


def read_glpk_choice(solution: Path, columns) -> float:
    """Total time of the columns glpsol set to 1 (its plain-text solution format)."""
    chosen = {}
    for line in solution.read_text().splitlines():
        fields = line.split()
        if fields and fields[0] == "s" and fields[1] == "mip" and fields[4] not in ("o",):
            raise RuntimeError(f"glpsol did not find the optimum: {line}")
        if fields and fields[0] == "j" and float(fields[2]) > 0.5:
            key, config = columns[int(fields[1]) - 1]
            if key in chosen:
                raise RuntimeError(f"glpsol chose two configurations of {key}")
            chosen[key] = config
    if len(chosen) != len({key for key, _ in columns}):
        raise RuntimeError("glpsol's solution misses a kernel")
    return sum(c.time for c in chosen.values())


def write_trivial_lp(path: Path) -> None:
    """A one-variable program: glpsol's process start-up, parsing and output, and no search."""
    path.write_text("Minimize\n obj: x0\nSubject To\n c0: x0 = 1\nBinary\n x0\nEnd\n")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=15, help="interleaved timed runs of each contender (median)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="also write the results to this JSON file")
    args = parser.parse_args()

    glpsol = shutil.which("glpsol")
    if glpsol is None:
        print("glpsol not found (apt-get install glpk-utils): GLPK is skipped", file=sys.stderr)
    instances = [
        ("ResNet-50 b32", network_fronts(158, 560, args.seed)),
        ("ResNet-152 b128", network_fronts(464, 3289, args.seed + 1)),
    ]
    target_ms = {"ResNet-50 b32": 5.0, "ResNet-152 b128": 50.0}
    rows, results = [], []
    startups_ms: list[float] = []
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        write_trivial_lp(workdir / "trivial.lp")
        for name, fronts in instances:
            members = sum(len(f) for f in fronts.values())
            for frac, total in zip(FRACTIONS, instance_totals(fronts), strict=True):
                contenders = {
                    "mckp": lambda fronts=fronts, total=total: wd.solve(fronts, total, method="mckp"),
                    "milp": lambda fronts=fronts, total=total: solve_quietly(fronts, total, "milp"),
                }
                if glpsol:
                    columns = write_cplex_lp(fronts, total, workdir / "wd.lp")
                    contenders["glpk"] = glpsol_run(workdir / "wd.lp", workdir / "wd.sol")
                    contenders["glpk_startup"] = glpsol_run(workdir / "trivial.lp", workdir / "trivial.sol")
                times = interleaved_medians_ms(contenders, reps=args.reps)

                answers = {m: solve_quietly(fronts, total, m) for m in ("mckp", "milp")}
                optimum = {m: sum(c.time for c in a.values()) for m, a in answers.items()}
                for m, a in answers.items():
                    assert sum(c.workspace for c in a.values()) <= total, m
                glpk_ms = glpk_net_ms = None
                if glpsol:
                    optimum["glpk"] = read_glpk_choice(workdir / "wd.sol", columns)
                    glpk_ms = times["glpk"]
                    glpk_net_ms = times["glpk"] - times["glpk_startup"]
                    startups_ms.append(times["glpk_startup"])
                ref = optimum["mckp"]
                for m, value in optimum.items():
                    if abs(value - ref) > SAME_OPTIMUM_REL * ref:
                        raise AssertionError(f"{name} W={total}: {m} found {value!r} ms, mckp {ref!r} ms")
                result = {
                    "instance": name,
                    "kernels": len(fronts),
                    "members": members,
                    "total_workspace_B": total,
                    "fraction": frac,
                    "optimum_ms": ref,
                    "mckp_ms": times["mckp"],
                    "milp_ms": times["milp"],
                    "glpk_process_ms": glpk_ms,
                    "glpk_startup_ms": times.get("glpk_startup"),
                    "glpk_net_ms": glpk_net_ms,
                }
                results.append(result)
                rows.append(
                    [
                        f"{name} ({len(fronts)} k, {members} m)",
                        f"{frac:.0%}",
                        f"{total / MIB:.0f}",
                        f"{ref:.3f}",
                        f"{times['mckp']:.2f}",
                        f"{times['milp']:.1f}",
                        f"{times['milp'] / times['mckp']:.0f}x",
                        "-" if glpk_ms is None else f"{glpk_ms:.1f}",
                        "-" if glpk_net_ms is None else f"{glpk_net_ms:.1f}",
                        "-" if glpk_net_ms is None else f"{glpk_net_ms / times['mckp']:.1f}x",
                    ]
                )
    startup_ms = statistics.median(startups_ms) if startups_ms else None
    startup = "glpsol missing" if startup_ms is None else f"glpsol start-up {startup_ms:.1f} ms (median)"
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    print(
        f"WD solve time on {platform.machine()} ({platform.node()}, {os.cpu_count()} CPUs, load {load}), "
        f"Python {platform.python_version()}, {startup}"
    )
    print(
        table(
            [
                "instance",
                "W frac",
                "W MiB",
                "optimum ms",
                "mckp ms",
                "milp ms",
                "milp/mckp",
                "glpsol ms",
                "glpsol-startup ms",
                "glpk net/mckp",
            ],
            rows,
        )
    )
    for name, limit_ms in target_ms.items():
        worst = max(r["mckp_ms"] for r in results if r["instance"] == name)
        print(
            f"{name}: slowest mckp {worst:.2f} ms (target <= {limit_ms:.0f} ms): "
            f"{'met' if worst <= limit_ms else 'MISSED'}"
        )
    if startup_ms is not None:
        least = min(r["glpk_net_ms"] / r["mckp_ms"] for r in results)
        print(
            f"GLPK (net of start-up) / mckp: at least {least:.1f}x (target >= {GLPK_TARGET_RATIO:.0f}x): "
            f"{'met' if least >= GLPK_TARGET_RATIO else 'MISSED'}"
        )
    if args.json:
        Path(args.json).write_text(json.dumps({"glpsol_startup_ms": startup_ms, "results": results}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
