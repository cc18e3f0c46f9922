"""What running a memory plan costs (CPU): planned steps against plain PyTorch, side by side, and the Python the
executor runs in one step.

Models (``--models``; the `models` extra): Hugging Face transformers' ResNet-50 and MobileNetV2 and MONAI's 2-D
UNet, built from their configs (`models.py`), at ``--batch`` 4 and ``--size`` 64 px. For each, three plans of
``--policy`` (``optimal``): everything kept (no limit), the smallest (a 1-byte limit) and halfway between their
peaks. Each planned step runs under `execute_plan`; plain is the model's own step. Steps are timed in
``--rounds`` rounds of ``--reps`` interleaved repetitions (as `interleaved_samples_ms`: every variant under the
same load, the order reversed every repetition; each plan in its own pair with plain), in wall time and in this
process's CPU time (on a shared machine, run it with one thread: the CPU time of two threads spinning for a
descheduled one is not the step's); per round the ratio of medians to plain's, then the median and range of the
rounds' ratios. Targets: everything kept at most 1.02x plain; halfway at most the plan's own predicted ratio (its
step with recomputation and transfers over its baseline step: ``step_ms / baseline_step_ms``; a recomputation is
charged its operations' forward times and the host time the executor was measured to spend per replayed
operation, `ucudnn.torch.planning.replay_cost`) plus 5%.

Python calls per planned step: the entries into the executor's code from outside it (PyTorch calling its hooks,
its dispatch mode, its context manager), counted by `sys.setprofile` over one untimed step, beside the step's
operations (the captured forward pass's) and the tensors autograd saves, and the saved tensors the plan offloads
or recomputes. Where the executor has them (`ExecutionStats.hook_calls`, ...), its own counts too.

Planning time: the three `plan_memory` calls, and the seconds spent in each of their parts (capture, device
profile, other operations timed in real steps, the convolutions' options, solve), timed where they are called.

``--convert``: each model converted (`ucudnn.torch.convert`, backend ``cpu``, its defaults: some layers run
ucudnn's kernels, others torch's), warmed up, planned; "plain" is then the converted model's own step, and
the converted step is timed against torch's own copy of the model too (the ``converted`` line).

``--host``: only the executor's own host time, with compute made negligible (tiny tensors, one thread: what
a GPU step pays on its host): a block that acts on nothing over a plain step, and each dropped map; and
`with_plan`'s module called eagerly (its backward pass run after the call returned): acting on nothing over a
plain step, and dropping the maps over the block that drops them.

The same script runs against another checkout of the package (``PYTHONPATH=<checkout>``): what the numbers were
before this executor.

    pip install '.[models]'
    OMP_NUM_THREADS=1 python benchmarks/memory/bench_executor.py [--models hf-resnet50,hf-mobilenet-v2,monai-unet]
        [--batch 4] [--size 64] [--policy optimal] [--rounds 5] [--reps 5] [--convert] [--json FILE]
    OMP_NUM_THREADS=1 python benchmarks/memory/bench_executor.py --host [--rounds 5]
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import random
import statistics
import sys
import time
from collections.abc import Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py, models.py
import torch
from common import keep_freed_memory, table, write_json
from models import NAMES, build, loss

import ucudnn
from ucudnn.torch import convert, execute_plan, plan_memory, with_plan

EXECUTOR_FILES = tuple(
    str(Path(ucudnn.__file__).parent / "torch" / "running" / f) for f in ("executor.py", "offload.py", "recompute.py")
)
MODELS = ("hf-resnet50", "hf-mobilenet-v2", "monai-unet")
KEPT_TARGET = 1.02  # everything kept: the executor's own cost, at most 2% of a plain step
HALFWAY_SLACK = 0.05  # halfway: the plan's predicted ratio plus 5%
CONVERTED_WARMUP = 8  # --convert: steps before planning (TRIAL_RUNS each way, and the first plans)
HOST_BLOCKS, HOST_DROPPED, HOST_REPS = 16, 8, 200  # --host: the chain, the maps dropped, steps per round


def interleaved(fns: dict, reps: int) -> dict[str, list[tuple[float, float]]]:
    """(wall ms, CPU ms of this process) of each function, run in turn rep after rep, in an order shuffled every
    rep (seeded), after one warm-up each (both clocks: on a loaded machine the process's CPU time is what its own
    work costs, the wall time what it waited too). Shuffled, not reversed: a step that runs after a heavy one
    pays for what that one left (freed graphs, cold caches; +40 us on a 670 us step here), and with a fixed or
    reversed order some function always follows a heavy one and another never does."""
    names = list(fns)
    for fn in fns.values():
        fn()
    samples: dict[str, list[tuple[float, float]]] = {name: [] for name in names}
    order = random.Random(0)
    for _ in range(reps):
        for name in order.sample(names, len(names)):
            wall, cpu = time.perf_counter(), time.process_time()
            fns[name]()
            samples[name].append(((time.perf_counter() - wall) * 1e3, (time.process_time() - cpu) * 1e3))
    return samples


def entries(fn) -> int:
    """How many times code of the executor's modules was entered from outside them while `fn` ran."""
    count = 0

    def profile(frame, event, arg):
        nonlocal count
        if event == "call" and frame.f_code.co_filename in EXECUTOR_FILES:
            back = frame.f_back
            if back is None or back.f_code.co_filename not in EXECUTOR_FILES:
                count += 1

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return count


@contextlib.contextmanager
def planning_parts() -> Iterator[dict[str, float]]:
    """Seconds spent in each part of `plan_memory` inside the block (its own functions, timed where they are
    called): the capture, the device profile, the other operations timed in real steps, the convolutions'
    options, and the solve (`make_plan`: the policy and its simulation)."""
    from ucudnn.memory import planner
    from ucudnn.torch.planning import planner as planning

    spent = {"capture": 0.0, "profile": 0.0, "timed steps": 0.0, "conv options": 0.0, "solve": 0.0}
    parts = [
        (planning, "_captured", "capture"),
        (planning, "_profile_for", "profile"),
        (planning, "_timed_ops", "timed steps"),
        (planning, "_conv_fronts", "conv options"),
        (planner, "make_plan", "solve"),
    ]

    running: set[str] = set()

    def timed(fn, part):
        def run(*a, **k):
            if part in running:  # a call inside another of the same part (make_plan runs the heuristics'): once
                return fn(*a, **k)
            running.add(part)
            start = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                running.discard(part)
                spent[part] += time.perf_counter() - start

        return run

    originals = [(module, attr, getattr(module, attr)) for module, attr, _ in parts]
    for (module, attr, part), (_, _, fn) in zip(parts, originals):
        setattr(module, attr, timed(fn, part))
    try:
        yield spent
    finally:
        for module, attr, fn in originals:
            setattr(module, attr, fn)


def bench(name: str, args) -> dict:
    model, x, y = build(name, args.batch, args.size)

    def labelled(out):
        return loss(out, y)

    torch_model = None
    if args.convert:  # the converted model's own step is the one each plan is timed against
        torch_model = copy.deepcopy(model)
        model = convert(model, backend="cpu")
        for _ in range(CONVERTED_WARMUP):  # its kernels planned and their trials against torch's settled
            model.zero_grad(set_to_none=True)
            loss(model(x), y).backward()

    start = time.perf_counter()
    with planning_parts() as spent:
        everything = plan_memory(model, x, memory_limit=2**40, policy=args.policy, loss=labelled)
        smallest = plan_memory(model, x, memory_limit=1, policy=args.policy, loss=labelled)
        halfway = plan_memory(
            model, x, memory_limit=(everything.peak_bytes + smallest.peak_bytes) // 2, policy=args.policy, loss=labelled
        )
    planning_s = time.perf_counter() - start
    plans = {"everything kept": everything, "halfway": halfway, "smallest": smallest}
    last_stats = {}

    def plain():
        model.zero_grad(set_to_none=True)
        loss(model(x), y).backward()

    def planned(label):
        def step():
            model.zero_grad(set_to_none=True)
            with execute_plan(model, plans[label]) as stats:
                loss(model(x), y).backward()
            last_stats[label] = stats

        return step

    if args.convert:  # under a plan's budgets a layer's kernels are planned (and tried against torch's) again
        for label in plans:
            for _ in range(CONVERTED_WARMUP):
                planned(label)()
    # each plan against plain in its own interleaved pair: a step after another plan's (its freed memory, its
    # caches) would time that plan too
    ratios = {clock: {label: [] for label in plans} for clock in ("wall", "cpu")}
    plain_ms = {"wall": [], "cpu": []}
    converted = {"wall": [], "cpu": []}  # the converted step against torch's own model's
    for _ in range(args.rounds):
        if torch_model is not None:

            def torch_step():
                torch_model.zero_grad(set_to_none=True)
                loss(torch_model(x), y).backward()

            samples = interleaved({"torch": torch_step, "converted": plain}, args.reps)
            for c, clock in enumerate(("wall", "cpu")):
                converted[clock].append(
                    statistics.median(s[c] for s in samples["converted"])
                    / statistics.median(s[c] for s in samples["torch"])
                )
        for label in plans:
            samples = interleaved({"plain": plain, label: planned(label)}, args.reps)
            for c, clock in enumerate(("wall", "cpu")):
                base = statistics.median(s[c] for s in samples["plain"])
                plain_ms[clock].append(base)
                ratios[clock][label].append(statistics.median(s[c] for s in samples[label]) / base)
    step = halfway.capture
    row = {
        "model": name,
        "batch": args.batch,
        "size": args.size,
        "policy": args.policy,
        "plain_ms": statistics.median(plain_ms["wall"]),
        "plain_cpu_ms": statistics.median(plain_ms["cpu"]),
        "model_ops": step.model_ops,
        "saves": len(getattr(step, "saves", ())),
        "plans": {},
        "planning_s": planning_s,
        "planning_parts_s": dict(spent),
        "converted": bool(args.convert),
    }
    if args.convert:
        row["converted_ratio"] = statistics.median(converted["wall"])
        row["converted_cpu_ratio"] = statistics.median(converted["cpu"])
        print(
            f"[{name}] converted: {row['converted_ratio']:.3f}x torch's own model (wall), "
            f"{row['converted_cpu_ratio']:.3f}x (CPU)",
            file=sys.stderr,
            flush=True,
        )
    for label, plan in plans.items():
        stats = last_stats[label]
        row["plans"][label] = {
            "ratio": statistics.median(ratios["wall"][label]),
            "ratio_min": min(ratios["wall"][label]),
            "ratio_max": max(ratios["wall"][label]),
            "cpu_ratio": statistics.median(ratios["cpu"][label]),
            "cpu_ratio_min": min(ratios["cpu"][label]),
            "cpu_ratio_max": max(ratios["cpu"][label]),
            "predicted": plan.step_ms / plan.baseline_step_ms,
            "peak_mib": plan.peak_bytes / 2**20,
            "offloaded": sum(t.action == "offload" for t in plan.tensors),
            "recomputed": sum(t.action == "recompute" for t in plan.tensors),
            "entries": entries(planned(label)),
            "hook_calls": getattr(stats, "hook_calls", None),
            "acting_calls": getattr(stats, "acting_calls", None),
            "followed_ops": getattr(stats, "followed_ops", None),
        }
        p = row["plans"][label]
        print(
            f"[{name}] {label}: {p['ratio']:.3f}x plain (wall), {p['cpu_ratio']:.3f}x (CPU)",
            file=sys.stderr,
            flush=True,
        )
    return row


def host_cost(reps: int, rounds: int) -> dict:
    """The executor's host time with compute made negligible (what a GPU step pays on its host): a chain of
    `HOST_BLOCKS` tiny conv+ReLU blocks (1x4x4x4), plain and under hand-made plans that recompute none and
    `HOST_DROPPED` of its ReLU outputs, interleaved; per round the differences of the medians (CPU us): the
    block's own cost (none recomputed, over plain) and each dropped map's."""
    from torch import nn

    from ucudnn.memory.plan import MemoryPlan, TensorAction
    from ucudnn.torch import capture

    torch.manual_seed(0)
    model = nn.Sequential(*[m for _ in range(HOST_BLOCKS) for m in (nn.Conv2d(4, 4, 3, padding=1), nn.ReLU())])
    x = torch.randn(1, 4, 4, 4)
    step = capture(model, x, loss=lambda out: out.square().mean())
    graph = step.graph
    relus = [s for s in graph.storages if graph.op(s).type == "relu"]

    def plan(k: int) -> MemoryPlan:
        dropped = set(relus[:k])
        tensors = tuple(
            TensorAction(s, graph.bytes_of(s), "recompute" if s in dropped else "keep") for s in graph.storages
        )
        return MemoryPlan(
            network=graph.network,
            batch=1,
            device="host",
            devices=1,
            memory_limit=2**30,
            policy="hand",
            fits=True,
            peak_bytes=0,
            average_bytes=0,
            baseline_peak_bytes=0,
            step_ms=1.0,
            baseline_step_ms=1.0,
            stall_ms=0.0,
            bytes_offloaded=0,
            tensors=tensors,
            conv_workspace=(),
            capture=step,
        )

    def run(p: MemoryPlan | None):
        def one():
            model.zero_grad(set_to_none=True)
            with execute_plan(model, p) if p is not None else contextlib.nullcontext():
                model(x).square().mean().backward()

        return one

    def module(p: MemoryPlan):
        planned = with_plan(model, p)

        def one():
            model.zero_grad(set_to_none=True)
            planned(x).square().mean().backward()  # the backward pass after the planned call returned

        return one

    none, some = plan(0), plan(HOST_DROPPED)
    fns = {
        "plain": run(None),
        "none dropped": run(none),
        f"{HOST_DROPPED} dropped": run(some),
        "module, none dropped": module(none),
        f"module, {HOST_DROPPED} dropped": module(some),
    }
    parts: dict[str, list[float]] = {"block": [], "per_map": [], "module": [], "module_over_block": []}
    for _ in range(rounds):
        samples = interleaved(fns, reps)
        us = {name: statistics.median(cpu for _, cpu in v) * 1e3 for name, v in samples.items()}
        parts["block"].append(us["none dropped"] - us["plain"])
        parts["per_map"].append((us[f"{HOST_DROPPED} dropped"] - us["none dropped"]) / HOST_DROPPED)
        parts["module"].append(us["module, none dropped"] - us["plain"])
        # the module acting on maps against the block acting on the same ones (its fixed cost included)
        parts["module_over_block"].append(us[f"module, {HOST_DROPPED} dropped"] - us[f"{HOST_DROPPED} dropped"])
    out = {"plain_us": us["plain"]}
    for key, name in (
        ("block", "block"),
        ("per_map", "per_dropped_map"),
        ("module", "module"),
        ("module_over_block", "module_over_block"),
    ):
        out[f"{name}_us"] = statistics.median(parts[key])
        out[f"{name}_range"] = (min(parts[key]), max(parts[key]))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--size", type=int, default=64)
    ap.add_argument("--policy", default="optimal")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument(
        "--convert",
        action="store_true",
        help="convert each model (ucudnn.torch.convert, backend cpu, its defaults) and time its plans "
        "against the converted model's own step (also timed against torch's own model)",
    )
    ap.add_argument(
        "--host",
        action="store_true",
        help="only the executor's host time per block and per dropped map, on a chain of tiny layers "
        f"({HOST_REPS} interleaved steps in each of --rounds rounds)",
    )
    ap.add_argument("--json", help="also write the rows to this file")
    args = ap.parse_args(argv)
    if args.host:
        torch.set_num_threads(1)
        cost = host_cost(HOST_REPS, args.rounds)
        print(
            f"executor's host time (CPU us, median of {args.rounds} rounds, range): plain step "
            f"{cost['plain_us']:.0f}; a block that acts on nothing +{cost['block_us']:.0f} "
            f"({cost['block_range'][0]:.0f}-{cost['block_range'][1]:.0f}); per dropped map "
            f"+{cost['per_dropped_map_us']:.0f} ({cost['per_dropped_map_range'][0]:.0f}-"
            f"{cost['per_dropped_map_range'][1]:.0f}); with_plan's module acting on nothing "
            f"+{cost['module_us']:.0f} ({cost['module_range'][0]:.0f}-{cost['module_range'][1]:.0f}), dropping "
            f"{HOST_DROPPED} maps {cost['module_over_block_us']:+.0f} over the block dropping them "
            f"({cost['module_over_block_range'][0]:+.0f} to {cost['module_over_block_range'][1]:+.0f})"
        )
        write_json(args.json, cost)
        return 0
    unknown = [m for m in args.models.split(",") if m not in NAMES]
    if unknown:
        ap.error(f"unknown model(s) {', '.join(unknown)}: {', '.join(NAMES)}")
    keep_freed_memory()  # freed steps' memory stays with the process: the steps time compute, not page faults
    print(
        f"ucudnn from {Path(ucudnn.__file__).parent}, torch {torch.__version__}, {torch.get_num_threads()} threads",
        file=sys.stderr,
    )
    rows = [bench(name, args) for name in args.models.split(",")]

    def target(label, p):
        if label == "everything kept":
            limit = KEPT_TARGET
        elif label == "halfway":
            limit = p["predicted"] + HALFWAY_SLACK
        else:
            return ""
        return (
            f"<= {limit:.2f}: wall {'met' if p['ratio'] <= limit else 'NOT met'}, "
            f"CPU {'met' if p['cpu_ratio'] <= limit else 'NOT met'}"
        )

    print(
        table(
            [
                "model",
                "plain ms (CPU ms)",
                "plan",
                "peak MiB",
                "offl./recomp.",
                "x plain wall (range)",
                "x plain CPU (range)",
                "predicted",
                "target",
                "executor entries",
                "hooks / acting / followed ops",
                "ops, saves",
            ],
            [
                [
                    r["model"],
                    f"{r['plain_ms']:.0f} ({r['plain_cpu_ms']:.0f})",
                    label,
                    f"{p['peak_mib']:.1f}",
                    f"{p['offloaded']}/{p['recomputed']}",
                    f"{p['ratio']:.3f} ({p['ratio_min']:.3f}-{p['ratio_max']:.3f})",
                    f"{p['cpu_ratio']:.3f} ({p['cpu_ratio_min']:.3f}-{p['cpu_ratio_max']:.3f})",
                    f"{p['predicted']:.3f}",
                    target(label, p),
                    p["entries"],
                    "-"
                    if p["hook_calls"] is None
                    else f"{p['hook_calls']} / {p['acting_calls']} / {p['followed_ops']}",
                    f"{r['model_ops']}, {r['saves'] or '-'}",
                ]
                for r in rows
                for label, p in r["plans"].items()
            ],
        )
    )
    print(
        table(
            ["model", "3 plans s", *rows[0]["planning_parts_s"]],
            [
                [r["model"], f"{r['planning_s']:.1f}", *(f"{v:.1f}" for v in r["planning_parts_s"].values())]
                for r in rows
            ],
        )
    )
    write_json(args.json, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
