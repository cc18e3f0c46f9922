"""The cluster optimizer, measured: solver time at 64 devices x 64 sizes, and uneven ranks in real training.

Part 1, solver: `best_batch_sizes` on synthetic tables (64 devices, 64 batch sizes each, B = 1024),
the specialised search (median and minimum wall time, and median process CPU time, which a shared
machine's load disturbs less, over --reps calls) and HiGHS (once), the same optimal makespan asserted.
Two tables: monotone (t = b / speed + noise, the usual shape) and random (non-monotone).

Part 2, training: R gloo processes on this machine train one small CNN with the global batch B split
over them. Rank r is made `--slowdown[r]` times slower than it is by sleeping (s - 1) times its own
compute time after each forward+backward: a throttle that emulates a slower device without taking
CPU from the others (the machine has 2 cores, shared with other jobs). Each rank first measures its
own step time t[r,b] at the candidate sizes (through the throttle), rank 0 solves the split with
`best_batch_sizes`, and then the even split and the optimised split are timed in turn, step after
step (interleaved), gradients all-reduced by `allreduce_gradients`. Reported: the medians of the
step time (rank 0, from before the forward pass to after the all-reduce, which waits for the
slowest rank) and their ratio.

    python benchmarks/cache/bench_cluster.py [--reps 30] [--batch 32] [--slowdown 1,3] [--steps 8]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py, models.py
from common import table
from ucudnn.solver.cluster import best_batch_sizes, makespan


def solver_tables(seed: int) -> dict[str, dict[str, dict[int, float]]]:
    rng = random.Random(seed)
    monotone, noisy = {}, {}
    for g in range(64):
        speed = rng.uniform(0.5, 4.0)
        monotone[f"gpu{g}"] = {b: b / speed + rng.uniform(0, 0.01) for b in range(1, 65)}
        noisy[f"gpu{g}"] = {b: rng.uniform(1, 100) for b in range(1, 65)}
    return {"monotone": monotone, "random": noisy}


def bench_solver(reps: int) -> None:
    batch = 1024
    rows = []
    for name, times in solver_tables(0).items():
        search_ms, search_cpu_ms = [], []
        for _ in range(reps):
            start, start_cpu = time.perf_counter(), time.process_time()
            out = best_batch_sizes(times, batch)
            search_cpu_ms.append((time.process_time() - start_cpu) * 1e3)
            search_ms.append((time.perf_counter() - start) * 1e3)
        start = time.perf_counter()
        milp = best_batch_sizes(times, batch, method="milp")
        milp_ms = (time.perf_counter() - start) * 1e3
        assert abs(makespan(times, out) - makespan(times, milp)) <= 1e-9 * makespan(times, out)
        rows.append(
            [
                name,
                "64 x 64",
                batch,
                f"{statistics.median(search_ms):.2f}",
                f"{min(search_ms):.2f}",
                f"{statistics.median(search_cpu_ms):.2f}",
                f"{milp_ms:.0f}",
                f"{milp_ms / statistics.median(search_ms):.0f}x",
                f"{makespan(times, out):.3f}",
            ]
        )
    print(
        table(
            [
                "table",
                "devices x sizes",
                "B",
                "search ms (median)",
                "search ms (min)",
                "search CPU ms (median)",
                "HiGHS ms (once)",
                "HiGHS/search",
                "makespan",
            ],
            rows,
        )
    )


# ---- part 2: training on ranks of unequal speed ------------------------------------------------------


def make_model():
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 32, 3, padding=1),
        torch.nn.ReLU(),
        torch.nn.Conv2d(32, 16, 3, padding=1),
        torch.nn.ReLU(),
        torch.nn.AdaptiveAvgPool2d(4),
        torch.nn.Flatten(),
        torch.nn.Linear(256, 10),
    )


def rank_main(rank, world, init, args, results):
    import torch
    import torch.distributed as dist

    from ucudnn.torch.distributed import allreduce_gradients

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(args.batch, 3, 48, 48)
    y = torch.randint(0, 10, (args.batch,))
    slowdown = args.slowdown[rank]

    def step(b: int) -> float:
        """One training step at local batch b; returns this rank's compute time with the throttle (ms)."""
        start = time.perf_counter()
        opt.zero_grad()
        if b:
            torch.nn.functional.cross_entropy(model(x[:b]), y[:b]).backward()
            time.sleep((slowdown - 1) * (time.perf_counter() - start))
        local_ms = (time.perf_counter() - start) * 1e3
        allreduce_gradients(model, b, sum(split_now))
        opt.step()
        return local_ms

    sizes = list(range(2, args.batch + 1, 2))
    # t[r,b]: this rank's own step at each size (median of 5 after a warm-up pass), every rank at b at once.
    times = {}
    for b in sizes + sizes:  # the first pass warms up allocators and kernels; the second is kept
        split_now = [b] * world
        times[b] = statistics.median(step(b) for _ in range(5))
    gathered = [None] * world
    dist.all_gather_object(gathered, times)
    split = [None]
    if rank == 0:
        chosen = best_batch_sizes({f"rank{r}": gathered[r] for r in range(world)}, args.batch)
        split = [[chosen[f"rank{r}"] for r in range(world)]]
    dist.broadcast_object_list(split, src=0)
    optimised = split[0]
    even = [args.batch // world + (1 if r < args.batch % world else 0) for r in range(world)]

    samples = {"even": [], "optimised": []}
    for _ in range(args.steps):
        for name, plan in (("even", even), ("optimised", optimised)):
            split_now = plan
            dist.barrier()
            start = time.perf_counter()
            step(plan[rank])
            samples[name].append((time.perf_counter() - start) * 1e3)
    if rank == 0:
        predicted = {
            name: max(gathered[r][plan[r]] if plan[r] else 0.0 for r in range(world))
            for name, plan in (("even", even), ("optimised", optimised))
        }
        results.put(
            {"even": even, "optimised": optimised, "samples": samples, "predicted": predicted, "times": gathered}
        )
    dist.destroy_process_group()


def bench_training(args) -> None:
    import torch.multiprocessing as mp

    world = len(args.slowdown)
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(
            rank_main,
            args=(world, f"file://{tmp}/rendezvous", args, results),
            nprocs=world,
            start_method="spawn",
            join=True,
        )
    r = results.get(timeout=5)
    rows = []
    for name in ("even", "optimised"):
        s = r["samples"][name]
        q = statistics.quantiles(s, n=4)
        rows.append(
            [
                name,
                ",".join(map(str, r[name])),
                f"{r['predicted'][name]:.1f}",
                f"{statistics.median(s):.1f} ± {q[2] - q[0]:.1f}",
            ]
        )
    print(table(["split", "batches per rank", "predicted ms (slowest rank)", "measured ms/step (median ± IQR)"], rows))
    ratio = statistics.median(r["samples"]["even"]) / statistics.median(r["samples"]["optimised"])
    print(
        f"even / optimised step time: {ratio:.2f}x measured, "
        f"{r['predicted']['even'] / r['predicted']['optimised']:.2f}x predicted "
        f"(ranks slowed {','.join(map(str, args.slowdown))}x, batch {args.batch}, {args.steps} steps each)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--slowdown", type=lambda s: [float(v) for v in s.split(",")], default=[1.0, 3.0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--skip-training", action="store_true")
    parser.add_argument("--skip-solver", action="store_true")
    args = parser.parse_args()
    if not args.skip_solver:
        bench_solver(args.reps)
    if not args.skip_training:
        print()
        bench_training(args)


if __name__ == "__main__":
    main()
