"""The command to run first whenever a GPU is at hand: every GPU line of ucudnn, in one sitting.

    python benchmarks/gpu/first_run.py [OUT_DIR] [--quick]

Six parts, each in its own process with its own time limit (a crash or a hang in one leaves the
others standing), one summary line each, every line of their output in OUT_DIR/first_run.log and
the figures in OUT_DIR/first_run.json:

- selftest: `ucudnn selftest --backend cudnn --json` (every engine, kind and form against float64);
- pytest -m gpu: the GPU tests of tests/ (run from the repository root, against the installed ucudnn);
- bench: `ucudnn bench --network alexnet --batch 256 --workspace 64MiB --backend cudnn --json`;
- convert step: HF ResNet-50 at batch 64, 224 px, converted (cudnn, 64 MiB per kernel) against
  plain PyTorch: first step's seconds, steps interleaved, peak memory, loss difference;
- compiled step: the same model, converted, under `torch.compile(mode="reduce-overhead")` (CUDA graphs
  of the whole step, the micro-batch launches inside) against plain PyTorch compiled the same way:
  step ms interleaved, peak memory above what each had before its first step, loss difference;
- planned step: the same model under vDNN's conv plan (every convolution's input offloaded to
  pinned host memory and prefetched), executed: step time against plain, peak against predicted.

Not timed on a GPU yet (estimated 8 minutes on an H100, Inductor compiling two ResNet-50 steps among
them). The parts' own limits add up to 26 minutes, more than a lent GPU's command may run, so the whole
run keeps within `--budget` seconds (default 540): each part gets what is left of it, and a part with less
than a minute left is not started (its line says so); `--only convert,compiled,planned` runs those parts
in a second command, into the same OUT_DIR (its cache kept). `--quick`: a small model at batch 8 for the three
steps. `--channels-last --only convert,compiled`: the two steps with model and input channels-last (Inductor
makes plain PyTorch's compiled convolutions channels-last by itself where its heuristics say so; it cannot see
ucudnn's operators as convolutions). Without a GPU it exits 2 with one line saying what is missing; it needs ucudnn installed (`pip install --no-deps -e .` from the repository root) and, for the
steps, transformers (the `models` extra).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MIB = 2**20
# Per-part limits (s): generous for an H100, so that a part that hangs still leaves time for the rest.
LIMITS_S = {"selftest": 120, "pytest": 300, "bench": 120, "convert": 300, "compiled": 420, "planned": 300}
MIN_PART_S = 60  # a part is not started with less of the budget left than this
STEP_REPS = 10


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "out_dir",
        nargs="?",
        type=Path,
        default=Path("gpu-first-run"),
        help="folder for first_run.log, first_run.json and the measurement cache",
    )
    parser.add_argument("--quick", action="store_true", help="a small model at batch 8 for the training steps")
    parser.add_argument(
        "--budget",
        type=float,
        default=540.0,
        help="seconds the whole run may take (default 540: a lent GPU's command runs 600 at most)",
    )
    parser.add_argument(
        "--only",
        type=lambda text: text.split(","),
        default=None,
        metavar="PART,...",
        help=f"run these parts only ({','.join(LIMITS_S)})",
    )
    parser.add_argument(
        "--channels-last",
        action="store_true",
        help="the training steps' models and inputs channels-last (the layout Inductor's layout "
        "optimization gives plain PyTorch's compiled convolutions; cuDNN's NHWC engines)",
    )
    parser.add_argument(
        "--part",
        choices=("convert", "compiled", "planned"),
        help="run one training step's part here and print its figures as JSON",
    )
    parser.add_argument("--device", default="cuda", help=argparse.SUPPRESS)  # cpu: the tests' smoke run
    return parser.parse_args(argv)


def missing_gpu() -> str | None:
    """Why the cudnn backend cannot run here, in one line, or None when it can."""
    from ucudnn.errors import BackendUnavailable

    try:
        from ucudnn.backends.cudnn import CudnnBackend

        CudnnBackend()
    except BackendUnavailable as exc:
        return str(exc)
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    return None if torch.cuda.is_available() else "torch sees no CUDA device (a CPU build of torch?)"


# ---- what each part printed, summarised ------------------------------------------------------------
def selftest_summary(stdout: str) -> tuple[bool, str, dict]:
    report = json.loads(stdout)
    s = report["summary"]
    text = f"{s['passed']} passed, {s['failed']} failed, {s['excluded']} excluded, {s['skipped']} skipped"
    return bool(report["passed"]), text, s


def pytest_summary(stdout: str) -> tuple[bool, str, dict]:
    """pytest's closing counts ("3 passed, 1 failed, 2 skipped in 4.1s") and the failing tests' ids."""
    counts = {word: int(n) for n, word in re.findall(r"(\d+) (passed|failed|skipped|errors?|deselected)", stdout)}
    failed = re.findall(r"^(?:FAILED|ERROR) (\S+)", stdout, flags=re.MULTILINE)
    text = ", ".join(f"{n} {word}" for word, n in counts.items() if word != "deselected") or "no summary line"
    if failed:
        text += ": " + " ".join(failed)
    ok = counts.get("passed", 0) > 0 and not counts.get("failed") and not counts.get("error", counts.get("errors"))
    return ok, text, {"counts": counts, "failed": failed}


def bench_summary(stdout: str) -> tuple[bool, str, dict]:
    total = json.loads(stdout)["total"]
    figure = {"baseline_ms": total["baseline_ms"], "time_ms": total["time_ms"], "speedup": total["speedup"]}
    return True, f"{total['baseline_ms']:.2f} -> {total['time_ms']:.2f} ms, {total['speedup']:.2f}x", figure


def step_summary(stdout: str) -> tuple[bool, str, dict]:
    figure = json.loads(stdout.strip().splitlines()[-1])
    if "skipped" in figure:
        return False, f"skipped: {figure['skipped']}", figure
    layout = " channels-last" if figure.get("channels_last") else ""
    text = (
        f"{figure['model']}{layout} b{figure['batch']}: {figure['ms']:.1f} ms vs plain {figure['plain_ms']:.1f} ms "
        f"({figure['ms'] / figure['plain_ms']:.2f}x), peak {figure['peak_mib']:.0f} vs {figure['plain_peak_mib']:.0f} MiB"
    )
    if "first_step_s" in figure:
        text += f", first step {figure['first_step_s']:.1f} s"
    if "predicted_peak_mib" in figure:
        text += (
            f", predicted {figure['predicted_peak_mib']:.0f} MiB (x{figure['peak_mib'] / figure['predicted_peak_mib']:.2f}), "
            f"{figure['offloaded']} offloaded, {figure['recomputed']} recomputed"
        )
    ok = figure["loss_diff"] <= figure["loss_tolerance"]
    return ok, text + ("" if ok else f", LOSS DIFFERS by {figure['loss_diff']:.2e}"), figure


# ---- the two training steps (run in a child process: --part) ----------------------------------------
def _timed_steps(steps: dict, device: str, reps: int) -> dict[str, float]:
    """Median ms of each step function, interleaved (each round runs every step once, order reversed
    every round), synchronised around each."""
    import torch

    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    samples: dict[str, list[float]] = {name: [] for name in steps}
    order = list(steps)
    for _ in range(reps):
        for name in order:
            sync()
            start = time.perf_counter()
            steps[name]()
            sync()
            samples[name].append((time.perf_counter() - start) * 1e3)
        order.reverse()
    return {name: statistics.median(values) for name, values in samples.items()}


def _peak_mib(step, device: str) -> float:
    import torch

    if device != "cuda":
        return float("nan")  # the CPU smoke run counts nothing; the GPU's allocator is the figure
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() / MIB


def training_step(
    part: str,
    name: str,
    batch: int,
    size: int,
    device: str,
    db: str,
    reps: int = STEP_REPS,
    channels_last: bool = False,
) -> dict:
    """One part's figures: `part` is "convert" (the model converted) or "planned" (a memory plan)."""
    import copy

    import torch

    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import models

        model, x, target = models.build(name, batch, size)
    except ImportError as exc:
        return {"skipped": f"{name} needs the models extra ({exc})"}
    from ucudnn.torch import convert, execute_plan, plan_memory

    fmt = torch.channels_last if channels_last else torch.contiguous_format
    plain = model.to(device, memory_format=fmt)
    x, target = x.to(device, memory_format=fmt), target.to(device)

    def step_of(net, context=None):
        def step():
            net.zero_grad(set_to_none=True)
            with context() if context else _nothing():
                loss = models.loss(net(x), target)
                loss.backward()
            return loss

        return step

    figure: dict = {"model": name, "batch": batch, "size": size, "device": device, "channels_last": channels_last}
    if part == "compiled":
        return _compiled_steps(plain, figure, x, target, device, db, reps)
    if part == "convert":
        ours = convert(
            copy.deepcopy(plain), backend="cudnn" if device == "cuda" else "cpu", workspace_limit=64 * MIB, db=db
        )
        start = time.perf_counter()
        step_of(ours)()
        if device == "cuda":
            torch.cuda.synchronize()
        figure["first_step_s"] = time.perf_counter() - start
        contender = step_of(ours)
    else:
        ours = plain
        # vDNN's conv policy offloads every convolution's input: the copy streams, pinned host buffers and
        # prefetches all run (a plan the optimal policy makes may only recompute)
        plan = plan_memory(plain, x, policy="vdnn-conv", db=db)
        stats = []

        def planned():
            with execute_plan(plain, plan) as s:
                loss = models.loss(plain(x), target)
                loss.backward()
            stats.append(s)
            return loss

        def contender():
            plain.zero_grad(set_to_none=True)
            return planned()

        figure.update(predicted_peak_mib=plan.peak_bytes / MIB)
    baseline = step_of(plain)
    torch.manual_seed(0)
    reference_loss = float(baseline().detach())
    torch.manual_seed(0)
    loss_diff = abs(float(contender().detach()) - reference_loss)
    times = _timed_steps({"plain": baseline, "ours": contender}, device, reps)
    figure.update(
        ms=times["ours"],
        plain_ms=times["plain"],
        peak_mib=_peak_mib(contender, device),
        plain_peak_mib=_peak_mib(baseline, device),
        loss_diff=loss_diff,
        # TF32 convolutions and another algorithm order: a loss of ~7 differs in its 3rd digit at most
        loss_tolerance=1e-2 * max(1.0, abs(reference_loss)),
    )
    if part == "planned":
        figure.update(offloaded=stats[-1].offloaded, recomputed=stats[-1].recomputed)
    return figure


def _compiled_steps(plain, figure: dict, x, target, device: str, db: str, reps: int) -> dict:
    """Converted and plain, each under torch.compile: mode="reduce-overhead" on CUDA (the whole step in
    CUDA graphs, after a warm-up run and a recorded one); aot_eager on the CPU, where the smoke run
    checks the step code. Peaks are what each step took above the memory allocated before it first
    ran (the other's graphs stay allocated in their private pool)."""
    import copy

    import torch

    sys.path.insert(0, str(ROOT / "benchmarks"))
    import models

    from ucudnn.torch import convert

    options = {"mode": "reduce-overhead"} if device == "cuda" else {"backend": "aot_eager"}
    ours = convert(
        copy.deepcopy(plain), backend="cudnn" if device == "cuda" else "cpu", workspace_limit=64 * MIB, db=db
    )
    steps, peaks, losses = {}, {}, {}
    for name, net in (("ours", ours), ("plain", plain)):
        compiled = torch.compile(net, **options)

        def step(net=net, compiled=compiled):
            torch.compiler.cudagraph_mark_step_begin()  # the last step's graph outputs are not read again
            net.zero_grad(set_to_none=True)
            loss = models.loss(compiled(x), target)
            loss.backward()
            return float(loss.detach())

        before = torch.cuda.memory_allocated() if device == "cuda" else 0
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        torch.manual_seed(0)
        losses[name] = step()  # compiles (and, converted, plans every kernel)
        figure[f"{name}_first_step_s"] = time.perf_counter() - start
        step(), step()  # recorded, then replayed
        if device == "cuda":
            torch.cuda.synchronize()
            peaks[name] = (torch.cuda.max_memory_allocated() - before) / MIB
        steps[name] = step
    times = _timed_steps({"plain": steps["plain"], "ours": steps["ours"]}, device, reps)
    figure.update(
        ms=times["ours"],
        plain_ms=times["plain"],
        first_step_s=figure["ours_first_step_s"],
        peak_mib=peaks.get("ours", float("nan")),
        plain_peak_mib=peaks.get("plain", float("nan")),
        loss_diff=abs(losses["ours"] - losses["plain"]),
        loss_tolerance=1e-2 * max(1.0, abs(losses["plain"])),
        compile=options,
    )
    return figure


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


# ---- the parts, each a child process --------------------------------------------------------------
def parts(args: argparse.Namespace) -> list[tuple[str, list[str], object]]:
    python, db = sys.executable, f"sqlite:///{(args.out_dir / 'cache.db').resolve()}"
    step = (
        [python, str(Path(__file__).resolve()), str(args.out_dir)]
        + (["--quick"] if args.quick else [])
        + (["--channels-last"] if args.channels_last else [])
    )
    return [
        ("selftest", [python, "-m", "ucudnn.cli.main", "selftest", "--backend", "cudnn", "--json"], selftest_summary),
        (
            "pytest",
            [
                python,
                "-m",
                "pytest",
                "-m",
                "gpu",
                "-o",
                "addopts=",
                "-q",
                "-rfE",
                "-p",
                "no:cacheprovider",
                str(ROOT / "tests"),
            ],
            pytest_summary,
        ),
        (
            "bench",
            [
                python,
                "-m",
                "ucudnn.cli.main",
                "bench",
                "--network",
                "alexnet",
                "--batch",
                "256",
                "--workspace",
                "64MiB",
                "--backend",
                "cudnn",
                "--json",
                "--db",
                db,
            ],
            bench_summary,
        ),
        ("convert", step + ["--part", "convert"], step_summary),
        ("compiled", step + ["--part", "compiled"], step_summary),  # after convert: its kernels are measured
        ("planned", step + ["--part", "planned"], step_summary),
    ]


def run_parts(args: argparse.Namespace) -> int:
    args.out_dir.mkdir(parents=True, exist_ok=True)
    log_path, json_path = args.out_dir / "first_run.log", args.out_dir / "first_run.json"
    figures: dict = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "parts": {}}
    failures = 0
    with log_path.open("w") as log:
        deadline = time.perf_counter() + args.budget
        for name, command, summarise in parts(args):
            if args.only is not None and name not in args.only:
                continue
            start = time.perf_counter()
            left = deadline - start
            if left < MIN_PART_S:
                failures += 1
                figures["parts"][name] = {"ok": False, "seconds": 0, "exit": None, "summary": "not run: budget spent"}
                print(f"{name:<9} SKIP not run: {left:.0f} s of the --budget left", flush=True)
                json_path.write_text(json.dumps(figures, indent=2, default=str))
                continue
            try:
                done = subprocess.run(
                    command, cwd=ROOT, capture_output=True, text=True, timeout=min(LIMITS_S[name], left), check=False
                )
                stdout, stderr, code = done.stdout, done.stderr, done.returncode
            except subprocess.TimeoutExpired as exc:
                stdout, stderr, code = _text(exc.stdout), _text(exc.stderr), None
            seconds = time.perf_counter() - start
            log.write(
                f"==== {name}: {' '.join(command)}\n---- exit {code}, {seconds:.0f} s\n{stdout}\n---- stderr\n"
                f"{stderr}\n"
            )
            log.flush()
            try:
                ok, text, figure = summarise(stdout) if code is not None else (False, "timed out", {})
            except (ValueError, KeyError, IndexError) as exc:  # no JSON: the part crashed; its log says how
                last = (stderr.strip().splitlines() or ["no output"])[-1]
                ok, text, figure = False, f"exit {code}: {last[:200]} ({type(exc).__name__} reading its output)", {}
            ok = ok and code == 0
            failures += not ok
            figures["parts"][name] = {"ok": ok, "seconds": round(seconds, 1), "exit": code, "summary": text, **figure}
            print(f"{name:<9} {'ok  ' if ok else 'FAIL'} {text} ({seconds:.0f} s)", flush=True)
            json_path.write_text(json.dumps(figures, indent=2, default=str))
    print(f"log: {log_path}; figures: {json_path}")
    return 1 if failures else 0


def _text(value) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else (value or "")


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    unknown = sorted(set(args.only or ()) - set(LIMITS_S))
    if unknown:
        print(f"first_run: no part named {', '.join(unknown)} (parts: {', '.join(LIMITS_S)})", file=sys.stderr)
        return 2
    if args.part:  # a child: one training step's figures as the last line of its output
        name, batch, size = ("hf-mobilenet-v2", 8, 224) if args.quick else ("hf-resnet50", 64, 224)
        db = f"sqlite:///{(args.out_dir / 'cache.db').resolve()}"
        print(
            json.dumps(training_step(args.part, name, batch, size, args.device, db, channels_last=args.channels_last))
        )
        return 0
    try:
        import ucudnn.solver  # noqa: F401 -- the installed mapping, not the source folder alone
    except ImportError:
        print(
            "first_run: ucudnn is not installed; from the repository root: pip install --no-deps -e .", file=sys.stderr
        )
        return 2
    why = missing_gpu()
    if why is not None:
        print(f"first_run: needs a CUDA GPU with CuPy, the cuDNN frontend and libcudnn: {why}", file=sys.stderr)
        return 2
    return run_parts(args)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
