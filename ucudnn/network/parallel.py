"""`ucudnn bench --workers N`: one run's measurements split across N processes writing to one cache.

The paper benchmarked on several GPUs of one model at once. Here the run's measurement units, one
(problem, micro-batch size) each, are dealt to N worker processes, balanced by their FLOPs; each
worker measures its units with `measure_table` and stores them in the shared cache (SQLite in WAL
mode, or PostgreSQL). Then the ordinary `optimize` runs in this process and finds every measurement
cached, so its report is the one a single worker would give, and no row is measured twice.

Workers are separate interpreters (`python -m ucudnn.network.parallel`), so each gets its own
environment before anything is imported: on the `cudnn` backend `CUDA_VISIBLE_DEVICES` names one GPU
per worker. CPU workers share the machine's cores, so their timings are taken under each other's
load (the thread settings stay as they are: they are part of the cpu backend's cache key).
A worker sends one JSON line per unit on stdout (progress and counts); a failure ends the run with
the worker's message, and what was measured before it stays in the cache.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from queue import Queue

from ucudnn.errors import InvalidInput, UcudnnError
from ucudnn.kernel.measure import BenchStats, Policy, batch_sizes, device_key, measure_table
from ucudnn.problem import ConvProblem

__all__ = ["parallel_optimize", "partition", "prefill", "worker_environments"]


def worker_environments(
    workers: int, backend_name: str, environ: Mapping[str, str], gpu_count: int | None = None
) -> list[dict[str, str]]:
    """The environment of each worker: one GPU each (cudnn), or this process's (cpu)."""
    if not isinstance(workers, int) or workers < 1:
        raise InvalidInput(f"workers must be a positive integer, got {workers!r}")
    if backend_name == "cudnn":
        visible = environ.get("CUDA_VISIBLE_DEVICES")
        gpus = (
            [g.strip() for g in visible.split(",") if g.strip()]
            if visible is not None
            else [str(i) for i in range(gpu_count or 0)]
        )
        if workers > len(gpus):
            raise InvalidInput(f"--workers {workers} needs one GPU per worker, but {len(gpus)} are visible")
        return [{**environ, "CUDA_VISIBLE_DEVICES": gpus[i]} for i in range(workers)]
    # CPU workers keep this process's environment: the cpu backend's cache key holds the BLAS and
    # OpenMP thread settings, so a worker with other settings would measure another device.
    return [dict(environ) for _ in range(workers)]


def partition(units: Sequence[tuple[ConvProblem, int]], workers: int) -> list[list[tuple[ConvProblem, int]]]:
    """Units dealt to workers, the costliest first to the least loaded (LPT), FLOPs as the cost."""
    shares: list[list[tuple[ConvProblem, int]]] = [[] for _ in range(workers)]
    load = [0] * workers
    for problem, size in sorted(units, key=lambda u: (-u[0].with_batch(u[1]).flops, u[0].key, u[1])):
        i = load.index(min(load))
        shares[i].append((problem, size))
        load[i] += problem.with_batch(size).flops
    return shares


def prefill(
    backend,
    kernels: Sequence[tuple[str, ConvProblem]],
    *,
    workers: int,
    db_url: str | None,
    policy: Policy,
    workspace_limit: int | None,
    algos: Sequence[str] | None,
    reps: int,
    progress=None,
) -> BenchStats:
    """Measure every (distinct problem, policy size) of `kernels` in `workers` processes into the cache.

    Returns what the workers did (measured now, found cached). `workspace_limit` is the limit the
    measurements are taken under (`optimize`'s: the WR limit, or the WD total).
    """
    start = time.perf_counter()
    problems = {p.key: p for _, p in kernels}
    batch = next(iter(problems.values())).n
    units = [(p, size) for p in problems.values() for size in batch_sizes(policy, batch)]
    gpu_count = _gpu_count() if backend.name == "cudnn" and "CUDA_VISIBLE_DEVICES" not in os.environ else None
    envs = worker_environments(workers, backend.name, os.environ, gpu_count)
    shares = [share for share in partition(units, workers) if share]
    messages: Queue = Queue()
    runs = []
    for i, share in enumerate(shares):
        spec = {
            "backend": backend.name,
            "db": db_url,
            "expect": device_key(backend),
            "algos": algos,
            "reps": reps,
            "workspace_limit": workspace_limit,
            "units": [[dataclasses.asdict(p), size] for p, size in share],
        }
        errors = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115 - the child writes it; read after it exits
        proc = subprocess.Popen(
            [sys.executable, "-m", "ucudnn.network.parallel"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=errors,
            env=envs[i],
            text=True,
        )
        assert proc.stdin is not None  # stdin=PIPE
        proc.stdin.write(json.dumps(spec))
        proc.stdin.close()
        reader = threading.Thread(target=_forward_lines, args=(proc.stdout, messages), daemon=True)
        reader.start()
        runs.append((proc, errors, reader))
    measured = cached = 0
    finished = 0
    while finished < len(runs):
        message = messages.get()
        if message is None:  # one worker's stdout closed
            finished += 1
            continue
        measured += message["measured"]
        cached += message["cached"]
        if progress is not None:
            progress.update(message["configs"])
    failures = []
    for i, (proc, errors, reader) in enumerate(runs):
        proc.wait()
        reader.join()
        if proc.returncode:
            errors.seek(0)
            lines = errors.read().strip().splitlines()
            failures.append(f"worker {i} (exit {proc.returncode}): {lines[-1] if lines else 'no message'}")
        errors.close()
    if failures:
        raise UcudnnError("parallel benchmark failed; measurements stored so far are kept: " + "; ".join(failures))
    return BenchStats(measured, cached, time.perf_counter() - start)


def parallel_optimize(workers: int, db_url: str | None):
    """`ucudnn.network.optimize.optimize` with the measuring done first by `workers` processes.

    The report is `optimize`'s on the filled cache; its counts say what the workers measured.
    """
    from ucudnn.network.optimize import optimize

    def run(
        backend,
        kernels,
        *,
        policy,
        workspace_limit=None,
        total_workspace=None,
        cache=None,
        algos=None,
        reps=3,
        progress=None,
        benchmark_limit=None,
    ):
        # The workers time every candidate (each takes whole sizes, so none can prune by another's timings):
        # the report then solves over all of them, whatever the limit.
        done = prefill(
            backend,
            kernels,
            workers=workers,
            db_url=db_url,
            policy=policy,
            workspace_limit=workspace_limit if total_workspace is None else total_workspace,
            algos=algos,
            reps=reps,
            progress=progress,
        )
        report = optimize(
            backend,
            kernels,
            policy=policy,
            workspace_limit=workspace_limit,
            total_workspace=total_workspace,
            cache=cache,
            algos=algos,
            reps=reps,
        )
        s = report.stats
        return dataclasses.replace(
            report, stats=BenchStats(done.measured + s.measured, s.cached - done.measured, done.seconds + s.seconds)
        )

    return run


def _forward_lines(stream, messages: Queue) -> None:
    for line in stream:
        if line.strip():
            messages.put(json.loads(line))
    messages.put(None)


def _gpu_count() -> int:
    import cupy

    return cupy.cuda.runtime.getDeviceCount()


def _work(spec: dict) -> None:
    """One worker: measure its units into the cache, one JSON line per unit on stdout."""
    from ucudnn.backends import get_backend
    from ucudnn.db import Cache

    backend = get_backend(spec["backend"])
    if device_key(backend) != spec["expect"]:
        raise UcudnnError(
            f"this worker measures on {device_key(backend)}, the run's device is {spec['expect']}; "
            f"--workers needs devices of one model"
        )
    with Cache(spec["db"]) as cache:
        for fields, size in spec["units"]:
            problem = ConvProblem(**fields)
            table, stats = measure_table(
                backend,
                problem,
                [size],
                cache=cache,
                algos=spec["algos"],
                reps=spec["reps"],
                workspace_limit=spec["workspace_limit"],
            )
            print(
                json.dumps({"configs": len(table[size]), "measured": stats.measured, "cached": stats.cached}),
                flush=True,
            )


if __name__ == "__main__":
    try:
        _work(json.load(sys.stdin))
    except Exception as exc:  # noqa: BLE001 - the traceback for the record; the parent shows the last line
        import traceback

        traceback.print_exc()
        print(f"{type(exc).__name__}: {exc}", file=sys.stderr)
        sys.exit(1)
