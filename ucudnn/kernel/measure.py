"""Measuring a kernel at the micro-batch sizes of a policy, through the measurement cache."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from ucudnn.backends.base import Backend, is_noisy
from ucudnn.errors import InvalidInput
from ucudnn.kernel.run import run_configuration
from ucudnn.problem import ConvProblem
from ucudnn.solver.types import Configuration, MicroConfig

POLICIES = ("all", "powerOfTwo", "undivided")

Policy = str | tuple[int, ...]


def parse_policy(text: str) -> Policy:
    """A policy name, or an explicit comma-separated list of micro-batch sizes (`1,2,8,32`)."""
    if text in POLICIES:
        return text
    try:
        sizes = tuple(sorted({int(part) for part in text.split(",")}))
    except ValueError:
        raise InvalidInput(
            f"unknown policy {text!r}; choose one of {', '.join(POLICIES)} or give micro-batch sizes such as 1,2,8,32"
        ) from None
    if not sizes or sizes[0] < 1:
        raise InvalidInput(f"policy sizes must be positive integers, got {text!r}")
    return sizes


def policy_name(policy: Policy) -> str:
    return policy if isinstance(policy, str) else ",".join(map(str, policy))


def batch_sizes(policy: Policy, batch: int) -> list[int]:
    """The micro-batch sizes a policy benchmarks for mini-batch `batch` (ascending)."""
    if batch < 1:
        raise InvalidInput(f"batch must be positive, got {batch}")
    if policy == "all":
        return list(range(1, batch + 1))
    if policy == "powerOfTwo":
        return sorted({1 << i for i in range(batch.bit_length()) if 1 << i <= batch} | {batch})
    if policy == "undivided":
        return [batch]
    if isinstance(policy, tuple):
        return [size for size in policy if size <= batch]
    raise InvalidInput(f"unknown policy {policy!r}; choose one of {', '.join(POLICIES)}")


@dataclass(frozen=True, slots=True)
class BenchStats:
    """How a benchmark went, per candidate (one algorithm at one micro-batch size): measured now,
    taken from the cache, not run because its workspace is over the limit, or pruned before it was
    timed (`measure_table`'s `benchmark_limit`); and wall time.
    `measured + cached + over_limit + pruned` is every candidate, what the progress bar counts."""

    measured: int = 0
    cached: int = 0
    seconds: float = 0.0
    over_limit: int = 0
    pruned: int = 0

    @property
    def candidates(self) -> int:
        return self.measured + self.cached + self.over_limit + self.pruned

    def __add__(self, other: BenchStats) -> BenchStats:
        return BenchStats(
            self.measured + other.measured,
            self.cached + other.cached,
            self.seconds + other.seconds,
            self.over_limit + other.over_limit,
            self.pruned + other.pruned,
        )


# PyTorch's `torch.backends.cudnn.benchmark_limit`: at most this many candidates are timed per kernel and
# micro-batch size, the backend's best-ranked first (0 or None: every candidate).
DEFAULT_BENCHMARK_LIMIT = 10
# A candidate more than this many times slower than another at the next larger micro-batch size and at
# the smallest (and, where workspace matters, with no less workspace) is not timed at the sizes between
# while that other one fits there. Relative speeds drift with the batch, but not by half: closer
# contenders are all timed.
LOSS_MARGIN = 1.5
PRUNED = "pruned: "  # the reason of every candidate pruned before it was timed starts so


def _short_of(micro: MicroConfig, need: int) -> str | None:
    if micro.workspace < need:
        return f"{micro.algo!r:.80} at batch {micro.batch} records {micro.workspace} B of workspace, not the {need} B it needs"
    return None


def discard(cache, backend: Backend, problem: ConvProblem, micro: MicroConfig, rule: str) -> None:
    """Tell `cache` that its row of `micro` (of `problem`) is damaged by `rule`: warned once, and removed so
    that the measurement taken again takes its place."""
    time_ms = micro.time if micro.usable else None
    key = device_key(backend, micro.algo)
    where = (key["device"], key["backend"], key["versions"], problem.key)
    cache.discard(*where, micro.algo, micro.batch, time_ms, micro.workspace, rule)


def understated(backend: Backend, problem: ConvProblem, micro: MicroConfig) -> str | None:
    """Why `micro` (of `problem`, from a cache or a stored plan) is damaged, or None: it records less workspace
    than its algorithm needs at that size, which a run would refuse. (An algorithm this backend no longer has is
    no damage: the run records it unusable and plans again, `Handle`'s recovery.) `measure_table` checks this
    where it computes the workspace anyway (under a limit); a plan checks its own micro-configs."""
    part = problem.with_batch(micro.batch)
    if backend.unsupported_reason(part, micro.algo) is not None:
        return None
    return _short_of(micro, backend.workspace_size(part, micro.algo))


def device_key(backend: Backend, algo: str | None = None) -> dict[str, str]:
    """The cache fields that identify where a measurement was taken: for one algorithm, the
    versions of the libraries it runs on (`Backend.versions_for`); without one, all of them."""
    versions = backend.device.versions_text if algo is None else backend.versions_for(algo)
    return {"device": backend.device.model, "backend": backend.name, "versions": versions}


def measure_table(
    backend: Backend,
    problem: ConvProblem,
    sizes: Sequence[int],
    *,
    cache=None,
    algos: Sequence[str] | None = None,
    reps: int = 3,
    workspace_limit: int | None = None,
    progress=None,
    fresh: set[tuple[str, int]] | None = None,
    benchmark_limit: int | None = None,
    front: bool = False,
    known: Mapping[tuple[str, int], MicroConfig] | None = None,
) -> tuple[dict[int, list[MicroConfig]], BenchStats]:
    """Every candidate algorithm at every size: `{size: [MicroConfig, ...]}`.

    Cached measurements are reused; the rest are measured (each verified against a trusted result,
    see `Backend.measure`) and stored. An algorithm whose workspace
    at a size exceeds `workspace_limit` is not run there: it appears with infinite time and the
    reason (and is not cached, since another limit may admit it). `progress`, if given, is a tqdm
    bar advanced once per micro-config. `fresh`, if given, receives the `(algo, size)` of every
    measurement taken now (not read from the cache). `known`: rows this run holds already, `(algo, size)`:
    row, taken as the cache's are (and counted as measured where `fresh` has them): a table derived anew
    from its rows after some were measured again.

    `benchmark_limit` k (None or 0: every candidate is timed) prunes before timing, as PyTorch's
    `cudnn.benchmark_limit` does: the sizes are taken largest first, then the smallest, then down
    (`_pruning_order`), and at each one only the k best-ranked candidates (`Backend.ranked`) that fit
    the limit are timed, leaving out, between the largest and the smallest, one that lost at both the
    next larger size and the smallest (more than `LOSS_MARGIN` times slower, on a steady timing, than
    one that fits here too; with `front`, for a Pareto front, only to one that also needs no more
    workspace). The others appear with infinite time and a reason starting with `PRUNED`, and are not
    cached. Which candidates are timed depends only on the timings of those timed before, so a second
    run finds them all in the cache.
    """
    if benchmark_limit is not None and (
        isinstance(benchmark_limit, bool) or not isinstance(benchmark_limit, int) or benchmark_limit < 0
    ):
        raise InvalidInput(f"benchmark_limit must be a non-negative integer or None, got {benchmark_limit!r}")
    start = time.perf_counter()
    candidates = list(algos) if algos is not None else backend.algorithms(problem)
    limit = benchmark_limit or 0  # 0: every candidate is timed
    pruning = limit > 0
    found = {}
    by_versions: dict[str, list[str]] = {}  # algorithms grouped by their versions key
    for algo in candidates:
        by_versions.setdefault(backend.versions_for(algo), []).append(algo)
    if cache is not None:
        for group in by_versions.values():
            found.update(
                cache.lookup(problem_key=problem.key, batches=sizes, algos=group, **device_key(backend, group[0]))
            )
    found.update(known or {})
    earlier = set(fresh or ())  # rows this run measured before this call: counted as measured, not cached
    order = backend.ranked(problem, candidates) if pruning else candidates
    # size -> algo -> {winner: why}: who beat whom, clearly and on a steady timing, at each size timed
    losses: dict[int, dict[str, dict[str, str]]] = {}
    ascending = sorted(sizes)
    table: dict[int, list[MicroConfig]] = {}
    measured = over_limit = pruned = 0
    served: list[tuple[str, int]] = []  # rows found (in the cache, or `known`)
    for size in _pruning_order(sizes) if pruning else sizes:
        part = problem.with_batch(size)
        row: dict[str, MicroConfig] = {}
        to_measure = []
        runnable = []  # supported and within the limit at this size, in rank order
        for algo in order:
            reason = backend.unsupported_reason(part, algo)
            if reason is None and workspace_limit is not None:
                need = backend.workspace_size(part, algo)
                stored = found.get((algo, size))
                # a damaged row (a run would refuse it): measured again below, and the new row replaces it
                if stored is not None and stored.usable and (why := _short_of(stored, need)):
                    discard(cache, backend, problem, stored, why)
                    del found[algo, size]
                if need > workspace_limit:
                    if (algo, size) in found:
                        row[algo] = found[algo, size]
                        served.append((algo, size))
                    else:
                        row[algo] = MicroConfig(
                            algo,
                            size,
                            float("inf"),
                            need,
                            reason=f"needs {need} B of workspace, over the limit {workspace_limit} B",
                        )
                        over_limit += 1
                    continue
            if reason is None:
                runnable.append(algo)
            elif (algo, size) in found:
                row[algo] = found[algo, size]
                served.append((algo, size))
            else:
                to_measure.append(algo)  # `measure` records why it cannot run
        # The largest and the smallest sizes are timed first; a size between them drops a candidate that
        # lost at both the next larger size and the smallest (one stray timing prunes nothing).
        larger = ascending[ascending.index(size) + 1] if pruning and size < ascending[-1] else None
        lost_both = (
            {}
            if larger is None or size == ascending[0]
            else {algo: why for algo, why in losses[larger].items() if algo in losses[ascending[0]]}
        )
        timed: list[str] = []
        kept_losses: dict[str, dict[str, str]] = {}
        for algo in runnable:
            winners = [
                f"{why} and at micro-batch {ascending[0]}"
                for winner, why in lost_both.get(algo, {}).items()
                if winner in runnable
            ]
            if winners:
                row[algo] = MicroConfig(algo, size, float("inf"), 0, reason=PRUNED + winners[0])
                kept_losses[algo] = lost_both[algo]  # still lost, for the next smaller size
            elif pruning and len(timed) >= limit:
                row[algo] = MicroConfig(
                    algo,
                    size,
                    float("inf"),
                    0,
                    reason=f"{PRUNED}beyond the benchmark limit of {benchmark_limit} candidates",
                )
            else:
                timed.append(algo)
                if (algo, size) in found:
                    row[algo] = found[algo, size]
                    served.append((algo, size))
                else:
                    to_measure.append(algo)
                continue
            pruned += 1
        if to_measure:
            # A bwd_filter micro-batch smaller than the batch runs with beta = 1 after the first
            # one (run_configuration): time it so, to charge the accumulation where it happens.
            accumulate = problem.kind == "bwd_filter" and size < problem.n
            new = backend.measure(part, to_measure, reps, accumulate=accumulate)
            if cache is not None:
                for group in by_versions.values():
                    cache.store(
                        problem_key=problem.key,
                        micros=[m for m in new if m.algo in group],
                        **device_key(backend, group[0]),
                    )
            row.update((m.algo, m) for m in new)
            measured += len(new)
            if fresh is not None:
                fresh.update((m.algo, size) for m in new)
        if pruning:
            losses[size] = _losses(row, timed, size, front) | kept_losses
        table[size] = [row[algo] for algo in candidates]
        if progress is not None:
            progress.update(len(candidates))
    table = {size: table[size] for size in sizes}
    prior = sum(key in earlier for key in served)
    return table, BenchStats(measured + prior, len(served) - prior, time.perf_counter() - start, over_limit, pruned)


def _pruning_order(sizes: Sequence[int]) -> list[int]:
    """The order a pruned benchmark takes the sizes in: the largest (the undivided baseline), the
    smallest, then the rest from the larger down, each after its larger neighbour."""
    ascending = sorted(sizes)
    return ascending[-1:] + ascending[:1][: len(ascending) - 1] + ascending[-2:0:-1]


def _losses(row: Mapping[str, MicroConfig], timed: Sequence[str], size: int, front: bool) -> dict[str, dict[str, str]]:
    """Who beat whom at this size by more than LOSS_MARGIN (with `front`, also needing no more
    workspace). A noisy timing loses nothing: it may be the machine, not the algorithm."""
    usable = [row[a] for a in timed if row[a].usable]
    losses = {}
    for m in usable:
        if is_noisy(m.time, m.spread):
            continue
        why = {
            b.algo: f"over {LOSS_MARGIN}x slower than {b.algo} at micro-batch {size} "
            f"({m.time:.3g} ms against {b.time:.3g} ms)"
            for b in usable
            if b.time * LOSS_MARGIN < m.time and (not front or b.workspace <= m.workspace)
        }
        if why:
            losses[m.algo] = why
    return losses


def remeasure(backend: Backend, problem: ConvProblem, micro: MicroConfig, *, reps: int, cache=None) -> MicroConfig:
    """`micro` (one algorithm at one size of `problem`) timed again with `reps` runs; the faster of the
    two medians is kept, and stored in the cache when it is the new one.

    Another process on the machine only ever adds time to a run, so the lower median is the better
    estimate of the kernel's own time.
    """
    part = problem.with_batch(micro.batch)
    accumulate = problem.kind == "bwd_filter" and micro.batch < problem.n  # as measure_table times it
    (again,) = backend.measure(part, [micro.algo], reps, accumulate=accumulate)
    if not (again.usable and again.time < micro.time):
        return micro
    if cache is not None:
        cache.store(problem_key=problem.key, micros=[again], replace=True, **device_key(backend, micro.algo))
    return again


def remeasure_understated(
    backend: Backend, problem: ConvProblem, table: dict[int, list[MicroConfig]], chosen, *, reps: int, cache=None
) -> bool:
    """Measure again each of the `chosen` micro-configs of `table` whose cached row records less workspace than
    its algorithm needs (damaged: a run would refuse it), replacing it in `table` and in the cache; whether any
    was. A solver's choice is checked so, a few calls, where `measure_table` (without a limit) did not."""
    found = False
    for micro in dict.fromkeys(chosen):
        why = understated(backend, problem, micro)
        if not why:
            continue
        if cache is not None:
            discard(cache, backend, problem, micro, why)
        accumulate = problem.kind == "bwd_filter" and micro.batch < problem.n  # as measure_table times it
        (again,) = backend.measure(problem.with_batch(micro.batch), [micro.algo], reps, accumulate=accumulate)
        if cache is not None:
            cache.store(problem_key=problem.key, micros=[again], **device_key(backend, micro.algo))
        table[micro.batch] = [again if m.algo == micro.algo else m for m in table[micro.batch]]
        found = True
    return found


# The clock `confirm_faster` times its real runs by, read at each call: a test puts a stand-in clock here.
run_clock: Callable[[], float] = time.perf_counter


def confirm_faster(
    backend: Backend,
    problem: ConvProblem,
    chosen: Configuration,
    baseline: MicroConfig | None,
    reps: int = 3,
    *,
    charge_ms: float = 0.0,
) -> Configuration:
    """`chosen` if it really runs faster than the undivided `baseline`, else the baseline.

    The solver adds up micro-batch times measured one size at a time; run back to back, the
    micro-batches can behave otherwise (caches, thread pools, allocation). So the two are run for
    real with `run_configuration`, interleaved rep by rep, and the faster median wins. `charge_ms`
    is a cost per call that `chosen`'s caller pays and the baseline's does not (`Handle.call_overhead`):
    `chosen` must win by more than it.
    """
    if baseline is None or chosen.micros == (baseline,):
        return chosen
    undivided = Configuration((baseline,))
    operands = backend.random_operands(problem)
    workspace = backend.empty_workspace(max(chosen.workspace, undivided.workspace))

    def runner(config: Configuration) -> Callable[[], None]:
        def run() -> None:
            run_configuration(backend, problem, config, workspace=workspace, **operands)
            backend.synchronize()

        return run

    times = interleaved_medians_ms({"chosen": runner(chosen), "undivided": runner(undivided)}, reps, clock=run_clock)
    return chosen if times["chosen"] + charge_ms < times["undivided"] else undivided


def interleaved_samples_ms(
    fns: Mapping[str, Callable[[], object]], reps: int, warmup: int = 1, clock: Callable[[], float] = time.perf_counter
) -> dict[str, list[float]]:
    """Times (ms, by `clock`: wall time by default) of each function, run in turn rep after rep, the order
    reversed every rep. ``clock=time.process_time`` counts this process's CPU time instead: on a loaded
    machine a one-thread run is charged only what it ran, not what it waited for the cores.

    Interleaving puts every contender under the same machine load at the same moments, so the
    comparison stays meaningful on a noisy machine even when absolute times drift; reversing the order
    keeps any contender from always running after the same one (its caches, its freed memory).
    """
    names = list(fns)
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    samples: dict[str, list[float]] = {name: [] for name in names}
    for rep in range(reps):
        for name in names if rep % 2 == 0 else names[::-1]:
            start = clock()
            fns[name]()
            samples[name].append((clock() - start) * 1e3)
    return samples


def interleaved_medians_ms(
    fns: Mapping[str, Callable[[], object]], reps: int, warmup: int = 1, clock: Callable[[], float] = time.perf_counter
) -> dict[str, float]:
    """Median time (ms) of each function, timed as `interleaved_samples_ms` does."""
    return {name: statistics.median(s) for name, s in interleaved_samples_ms(fns, reps, warmup, clock).items()}
