"""Where a recomputing plan's extra time goes (CPU, one thread, process CPU time): a planned step against plain
PyTorch's, forward and backward apart, and against what the plan predicts.

For each model (``--models``, default MobileNetV2 and MONAI's UNet at batch 4, 64 px), the halfway plan of
``--policy`` (``optimal``; as `bench_executor.py` makes it). Plain and planned steps run interleaved (``--reps``,
the order reversed every rep); per step the forward pass (model and loss) and the backward pass are timed apart.
In the planned steps, the executor's rebuilds (`_Recompute._rebuild`) and, inside them, each replayed operation
are timed too. Printed per model:

- plain and planned step, and the planned step's extra in its forward pass (following the calls where dropped
  maps are made, the hooks) and in its backward pass (rebuilds, unpacks);
- the rebuilds: their time, of which the replayed operations' own, against the same operations' forward times
  as planning timed them (`_op_times`), per operation;
- the plan's prediction: its step over its baseline step, of which the replayed operations' forward times and
  the host time it charges per replayed operation (`TrainingGraph.replay_host_ms`, measured on the model by
  `ucudnn.torch.planning.replay_cost`).

    OMP_NUM_THREADS=1 python benchmarks/memory/bench_replay_cost.py [--models hf-mobilenet-v2,monai-unet] [--reps 15]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Self

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py, models.py
import torch
from common import keep_freed_memory, table
from models import NAMES, build, loss

from ucudnn.memory.simulate import expand
from ucudnn.torch import execute_plan, plan_memory
from ucudnn.torch.planning import planner as planning
from ucudnn.torch.running import recompute


class RebuildTimer:
    """Process time in the executor's rebuilds (the outermost: a rebuild of a dropped source runs inside its
    reader's) and in the operations they replay (by captured op index)."""

    def __init__(self) -> None:
        self.rebuild_s, self.replay_s, self.depth = 0.0, 0.0, 0
        self.per_op: dict[int, list[float]] = {}
        self.original = recompute._Recompute._rebuild

    def __enter__(self) -> Self:
        timer = self

        def rebuild(executor, r, program):
            for i in program.ops:  # each recorded operation, timed where it replays
                call = r.calls.get(i)
                if call is not None and not hasattr(call[0], "timed"):
                    call[0] = timer.timed(call[0], i)
            timer.depth += 1  # a dropped source is rebuilt inside its reader's rebuild: counted once
            start = time.process_time()
            try:
                return timer.original(executor, r, program)
            finally:
                timer.depth -= 1
                if not timer.depth:
                    timer.rebuild_s += time.process_time() - start

        recompute._Recompute._rebuild = rebuild
        return self

    def timed(self, func, index: int):
        def run(*args, **kwargs):
            start = time.process_time()
            out = func(*args, **kwargs)
            spent = time.process_time() - start
            self.replay_s += spent
            self.per_op.setdefault(index, []).append(spent)
            return out

        run.timed = True
        return run

    def __exit__(self, *exc) -> None:
        recompute._Recompute._rebuild = self.original


def bench(name: str, args) -> list:
    model, x, y = build(name, args.batch, args.size)

    def labelled(out):
        return loss(out, y)

    everything = plan_memory(model, x, memory_limit=2**40, policy=args.policy, loss=labelled)
    smallest = plan_memory(model, x, memory_limit=1, policy=args.policy, loss=labelled)
    plan = plan_memory(
        model, x, memory_limit=(everything.peak_bytes + smallest.peak_bytes) // 2, policy=args.policy, loss=labelled
    )
    ((measured, host_ms),) = planning._OP_TIMES[model].values()

    def step(planned: bool) -> tuple[float, float]:
        model.zero_grad(set_to_none=True)
        start = time.process_time()
        if planned:
            with execute_plan(model, plan):
                value = loss(model(x), y)
                middle = time.process_time()
                value.backward()
        else:
            value = loss(model(x), y)
            middle = time.process_time()
            value.backward()
        return middle - start, time.process_time() - middle

    samples: dict[bool, list[tuple[float, float]]] = {False: [], True: []}
    with RebuildTimer() as timer:
        step(False), step(True)
        timer.rebuild_s = timer.replay_s = 0.0
        timer.per_op.clear()
        for rep in range(args.reps):
            for planned in (False, True) if rep % 2 == 0 else (True, False):
                samples[planned].append(step(planned))
    fwd = {p: statistics.median(s[0] for s in v) * 1e3 for p, v in samples.items()}
    bwd = {p: statistics.median(s[1] for s in v) * 1e3 for p, v in samples.items()}
    total = {p: statistics.median(s[0] + s[1] for s in v) * 1e3 for p, v in samples.items()}
    actions = {t.name: t.action for t in plan.tensors}
    graph = plan.capture.graph
    replayed = [s for s in expand(graph, actions) if s.phase == "recompute"]
    replayed_fwd_ms = sum(measured.get(s.op, (0.0,))[0] for s in replayed)
    ops = [(plan.capture.ops[i].name or "-", statistics.median(v) * 1e3) for i, v in sorted(timer.per_op.items())]
    op_fwd = [measured.get(n, (float("nan"),))[0] for n, _ in ops]
    print(f"[{name}] per replayed op (replay ms / forward ms as timed in planning):", file=sys.stderr)
    for (n, ms), f in zip(ops, op_fwd):
        print(f"    {n}: {ms:.3f} / {f:.3f}", file=sys.stderr)
    return [
        name,
        len(replayed),
        f"{total[False]:.2f}",
        f"{total[True]:.2f} ({total[True] / total[False]:.3f}x)",
        f"{fwd[True] - fwd[False]:+.2f}",
        f"{bwd[True] - bwd[False]:+.2f}",
        f"{timer.rebuild_s / args.reps * 1e3:.2f}",
        f"{timer.replay_s / args.reps * 1e3:.2f}",
        f"{sum(ms for _, ms in ops):.3f} / {sum(op_fwd):.3f}",
        f"{plan.step_ms / plan.baseline_step_ms:.3f}",
        f"{replayed_fwd_ms:.2f}",
        f"{host_ms:.3f} x {len(replayed)} = {host_ms * len(replayed):.2f}",
    ]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="hf-mobilenet-v2,monai-unet")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--size", type=int, default=64)
    ap.add_argument("--policy", default="optimal")
    ap.add_argument("--reps", type=int, default=15)
    args = ap.parse_args(argv)
    unknown = [m for m in args.models.split(",") if m not in NAMES]
    if unknown:
        ap.error(f"unknown model(s) {', '.join(unknown)}: {', '.join(NAMES)}")
    keep_freed_memory()
    torch.set_num_threads(1)
    rows = [bench(name, args) for name in args.models.split(",")]
    print(
        table(
            [
                "model",
                "replayed ops",
                "plain ms",
                "planned ms",
                "extra fwd ms",
                "extra bwd ms",
                "rebuilds ms",
                "replayed ops ms",
                "per op sum: replay / fwd ms",
                "predicted",
                "pred. replayed fwd ms",
                "pred. host ms/op x ops",
            ],
            rows,
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
