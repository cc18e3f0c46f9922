"""Real processes writing one cache at once lose nothing, duplicate nothing and never fail.

Each of WRITERS spawned processes opens the same, not yet existing, cache (so the schema is
created under contention too), waits at a barrier, then stores SHARED problems that every writer
also stores and OWN problems that only it stores, interleaved with lookups. The values of a key
are the same in every writer, so the final table is known exactly.
"""

from __future__ import annotations

import multiprocessing
import queue
import time

from pg_server import db_url, pg_server  # noqa: F401
from ucudnn.db import Cache
from ucudnn.solver.types import MicroConfig

WRITERS = 4
SHARED = 12  # problems every writer stores
OWN = 12  # problems only one writer stores
ALGOS = ("gemm", "implicit_gemm", "fft", "winograd", "direct")
BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
DEVICE = {"device": "Test GPU", "backend": "cudnn", "versions": "cudnn=9.1.0"}
TIMEOUT_S = 120


def problem_key(name: str) -> str:
    return f"kind=fwd,c=64,h=56,w=56,k=128,r=3,s=3,name={name}"


def micros_for(name: str) -> list[MicroConfig]:
    seed = sum(map(ord, name))
    return [
        MicroConfig(algo, b, (seed % 7 + i) * 0.25 + b / 8, 4096 * b * i, spread=0.5 * (i % 2))
        for i, algo in enumerate(ALGOS)
        for b in BATCHES
    ]


def problems_of(writer: int) -> list[str]:
    shared = [f"shared{p}" for p in range(SHARED)]
    own = [f"w{writer}-own{p}" for p in range(OWN)]
    # Writers walk the shared problems in different orders, so they collide in different places.
    shared = shared[writer:] + shared[:writer] if writer % 2 == 0 else shared[::-1]
    return [name for pair in zip(shared, own, strict=True) for name in pair]


def writer(url: str, index: int, barrier, results) -> None:
    try:
        barrier.wait(timeout=TIMEOUT_S)
        with Cache(url) as cache:  # opened at the same moment by every writer
            written = 0
            start = time.perf_counter()
            for name in problems_of(index):
                ms = micros_for(name)
                # Half the stores go in two pieces, so writers also meet inside one problem.
                if index % 2:
                    written += cache.store(problem_key=problem_key(name), micros=ms[::2], **DEVICE)
                    written += cache.store(problem_key=problem_key(name), micros=ms[1::2], **DEVICE)
                else:
                    written += cache.store(problem_key=problem_key(name), micros=ms, **DEVICE)
                found = cache.lookup(problem_key=problem_key(name), batches=BATCHES, **DEVICE)
                assert len(found) == len(ms), f"{name}: {len(found)} of {len(ms)} readable after store"
            results.put((index, written, time.perf_counter() - start, None))
    except BaseException as exc:  # noqa: BLE001 - reported to the parent; a crashed child must not hang the test
        results.put((index, 0, 0.0, f"{type(exc).__name__}: {exc}"))


def run_writers(url: str, writers: int = WRITERS) -> tuple[int, float]:
    """Run the writers; returns (rows written in all, wall seconds). Raises on any failure."""
    ctx = multiprocessing.get_context("spawn")
    barrier = ctx.Barrier(writers)
    results = ctx.Queue()
    procs = [ctx.Process(target=writer, args=(url, i, barrier, results)) for i in range(writers)]
    for p in procs:
        p.start()
    outcomes = []
    deadline = time.monotonic() + TIMEOUT_S
    try:
        while len(outcomes) < writers:
            try:
                outcomes.append(results.get(timeout=0.2))
            except queue.Empty:
                # A child that died before reporting (e.g. at start-up) must fail the test now,
                # not after the timeout.
                dead = [p.exitcode for p in procs if p.exitcode is not None]
                if len(dead) > len(outcomes) and not _drain(results, outcomes):
                    raise AssertionError(f"a writer died without reporting (exit codes {dead})") from None
                if time.monotonic() > deadline:
                    raise AssertionError(f"writers did not finish in {TIMEOUT_S} s") from None
        for p in procs:
            p.join(timeout=TIMEOUT_S)
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
                p.join()
    errors = [f"writer {i}: {err}" for i, _, _, err in outcomes if err]
    assert not errors, "; ".join(errors)
    assert [p.exitcode for p in procs] == [0] * writers
    return sum(w for _, w, _, _ in outcomes), max(s for _, _, s, _ in outcomes)


def _drain(results, outcomes: list) -> bool:
    """Collect results that arrived meanwhile; returns whether any did."""
    got = False
    while True:
        try:
            outcomes.append(results.get(timeout=0.5))
            got = True
        except queue.Empty:
            return got


def test_concurrent_writers_lose_and_duplicate_nothing(db_url: str) -> None:  # noqa: F811
    written, _ = run_writers(db_url)
    names = sorted({name for i in range(WRITERS) for name in problems_of(i)})
    rows = len(ALGOS) * len(BATCHES)
    expected = len(names) * rows
    assert len(names) == SHARED + WRITERS * OWN
    assert written == expected  # every row written exactly once, by exactly one writer
    with Cache(db_url) as cache:
        info = cache.info()
        assert (info["devices"], info["problems"], info["measurements"]) == (1, len(names), expected)
        for name in names:
            found = cache.lookup(problem_key=problem_key(name), batches=BATCHES, **DEVICE)
            assert {k: (m.time, m.workspace, m.spread) for k, m in found.items()} == {
                (m.algo, m.batch): (m.time, m.workspace, m.spread) for m in micros_for(name)
            }


def _forked_child(cache: Cache, results) -> None:
    try:
        n = cache.store(problem_key=problem_key("forked"), micros=micros_for("forked"), **DEVICE)
        found = cache.lookup(problem_key=problem_key("parent"), batches=BATCHES, **DEVICE)
        results.put((n, len(found), None))
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        results.put((0, 0, f"{type(exc).__name__}: {exc}"))


def test_cache_survives_fork(db_url: str) -> None:  # noqa: F811
    """A Cache opened before a fork (as a DataLoader worker would inherit it) works on both sides."""
    ctx = multiprocessing.get_context("fork")
    results = ctx.Queue()
    with Cache(db_url) as cache:
        cache.store(problem_key=problem_key("parent"), micros=micros_for("parent"), **DEVICE)
        child = ctx.Process(target=_forked_child, args=(cache, results))
        child.start()
        n, found, err = results.get(timeout=TIMEOUT_S)
        child.join(timeout=TIMEOUT_S)
        assert err is None and child.exitcode == 0
        rows = len(ALGOS) * len(BATCHES)
        assert (n, found) == (rows, rows)
        # The parent's pooled connections still work after the child has gone.
        assert len(cache.lookup(problem_key=problem_key("forked"), batches=BATCHES, **DEVICE)) == rows
        assert cache.info()["measurements"] == 2 * rows
