"""From layers to an optimised report: measure every kernel, then solve WR (per kernel) or WD (network)."""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from ucudnn.backends.base import NOISY_SPREAD_FRACTION, Backend, is_noisy
from ucudnn.errors import InvalidInput
from ucudnn.kernel.measure import PRUNED, BenchStats, Policy, batch_sizes, measure_table, policy_name, remeasure
from ucudnn.kernel.plans import micro_to_json, pareto_fronts, undivided_baseline
from ucudnn.problem import KINDS, ConvProblem
from ucudnn.solver import wr
from ucudnn.solver.types import Configuration, MicroConfig

# How a kernel's baseline was chosen (KernelPlan.baseline_rule; `chosen_by` in the JSON).
BASELINE_FASTEST = "fastest within the limit"
BASELINE_LEAST_WORKSPACE = "least workspace (none fits the limit)"
# A time a speedup rests on is measured again when it is noisy or, per sample, slower than the same
# algorithm at a smaller size by more than this: a larger micro-batch rarely costs more per sample,
# and a one-off stall during a measurement (another process, page faults) looks just like that.
OUTLIER_PER_SAMPLE_FACTOR = 2.0
# The second measurement takes this many times the --reps runs, so its median stands on more samples.
REMEASURE_REPS_FACTOR = 3
# A busy spell can outlast one re-measurement: try up to this many times, until the time no longer
# looks like an outlier, keeping the fastest median.
REMEASURE_ATTEMPTS = 3
# Re-measuring can change what the solver picks, which brings other times into a ratio: check those
# too, a bounded number of times (each time is re-measured at most once anyway).
MAX_REMEASURE_ROUNDS = 3
# The clock `optimize` reads its wall time and its re-measuring phase by, at each call: a test puts a stand-in here.
clock: Callable[[], float] = time.perf_counter


def configuration_notation(example: Configuration | None = None) -> str:
    """What a configuration's text means, in words, on `example` (one with several micro-batches reads best)."""
    text = example.describe() if example is not None else "4x1:native + 1x4:fft"
    first = example.micros[0] if example is not None else MicroConfig("native", 1, 0.0, 0)
    count = text.split("x", 1)[0]
    return (
        f"`{text}` means {count} micro-batch{'' if count == '1' else 'es'} of {first.batch} "
        f"sample{'' if first.batch == 1 else 's'} run by the algorithm {first.algo}"
        + (", then the groups after `+`" if " + " in text else "")
        + ", one after another; ms is their sum, workspace the largest (they share one buffer)"
    )


@dataclass(frozen=True, slots=True)
class KernelPlan:
    """One kernel of one layer: the undivided baseline and the chosen configuration."""

    layer: str
    problem: ConvProblem
    baseline: MicroConfig | None  # None when no algorithm fits undivided
    config: Configuration
    # Candidates verification rejected (`wrong result ...`), at every size measured: never chosen.
    excluded: tuple[MicroConfig, ...] = ()
    # Measurements whose interquartile range is a large fraction of their median (see is_noisy).
    noisy: tuple[MicroConfig, ...] = ()
    baseline_rule: str = BASELINE_FASTEST  # how the baseline was chosen (see choose_baseline)
    # The speedup rests on a time that still looks like an outlier (looks_like_outlier), re-measured or not.
    doubtful: bool = False
    # Algorithms the backend cannot run for this kernel at all, with its reason (`Backend.unsupported_reason`:
    # a dtype or layout it lacks, an algorithm without a 3-D form): (algo, reason), never measured.
    unsupported: tuple[tuple[str, str], ...] = ()
    # Candidates the benchmark limit kept from being timed (reason starting `PRUNED`), at every size.
    pruned: tuple[MicroConfig, ...] = ()

    @property
    def speedup(self) -> float:
        return self.baseline.time / self.config.time if self.baseline else math.inf


@dataclass(frozen=True, slots=True)
class Report:
    """The result of `ucudnn bench`; `to_json()` gives the DESIGN JSON."""

    device: str
    backend: str
    policy: str
    mode: str  # "WR" or "WD"
    workspace_limit: int | None
    total_workspace: int | None
    batch: int | None  # None when WR kernels have different batch sizes (each kernel's problem has its n)
    kernels: tuple[KernelPlan, ...]
    stats: BenchStats  # its `seconds`: the wall time of `optimize`, measuring, re-measuring and solving
    # WD only: the Pareto front of each distinct problem (by ConvProblem.key), for plots.
    fronts: Mapping[str, Sequence[Configuration]] = field(default_factory=dict)
    baseline_limit: int | None = None  # the limit baselines were chosen within (WD: the equal share)
    remeasured: int = 0  # times a ratio rests on that were measured again (looks_like_outlier)
    remeasure_seconds: float = 0.0  # the wall time of measuring them again, a part of `stats.seconds`
    noisy_now: int = 0  # noisy timings among those measured by this run (the rest came from the cache)
    reps: int = 3  # timed runs per measurement

    @property
    def example_configuration(self) -> Configuration | None:
        """A chosen configuration to explain the notation on: the first with the most micro-batch groups."""
        return max(
            (k.config for k in self.kernels),
            key=lambda c: (len(c.describe().split(" + ")), len(c.micros)),
            default=None,
        )

    @property
    def baseline_text(self) -> str:
        """How the baselines were chosen, in words (the table's legend and the JSON's `legend`)."""
        from ucudnn.sizes import format_size

        if self.baseline_limit is None:
            within = "with no workspace limit"
        elif self.mode == "WD":
            within = (
                f"within an equal share of the total, {format_size(self.baseline_limit)} "
                f"({format_size(self.total_workspace)} / {len(self.kernels)} kernels)"
            )
        else:
            within = f"within the limit, {format_size(self.baseline_limit)}"
        return (
            f"what framework-style selection runs: the fastest algorithm on the undivided batch {within}; "
            f"where none fits, the undivided algorithm needing the least workspace, as frameworks fall back"
        )

    @property
    def noise_text(self) -> str:
        """What this run's noisy timings and re-measurements were, and what to do; "" when there were none.

        Each sentence is there only when its count is not 0."""
        parts = []
        if self.noisy_now:
            were = "was" if self.noisy_now == 1 else "were"
            parts.append(
                f"{self.noisy_now} of the {self.stats.measured} timings taken now {were} noisy (spread "
                f"over {NOISY_SPREAD_FRACTION:.0%} of the median: the machine was busy)."
            )
        if self.remeasured:
            one = self.remeasured == 1
            parts.append(
                f"{self.remeasured} {'timing' if one else 'timings'} that a speedup rests on "
                f"looked like {'an outlier' if one else 'outliers'} and "
                f"{'was' if one else 'were'} measured again ({REMEASURE_REPS_FACTOR * self.reps} runs, "
                f"up to {REMEASURE_ATTEMPTS} times); the fastest median is kept."
            )
        if not parts:
            return ""
        parts.append(
            f"For steadier figures run on a quiet machine or raise --reps (now {self.reps}), after "
            f"`ucudnn db prune --device '{self.device}'` drops the cached timings."
        )
        return " ".join(parts)

    @property
    def baseline_ms(self) -> float:
        return sum(k.baseline.time if k.baseline else math.inf for k in self.kernels)

    @property
    def time_ms(self) -> float:
        return sum(k.config.time for k in self.kernels)

    @property
    def workspace(self) -> int:
        """WR kernels reuse one buffer (the max); WD kernels each own a segment (the sum)."""
        sizes = [k.config.workspace for k in self.kernels]
        return (sum(sizes) if self.mode == "WD" else max(sizes)) if sizes else 0

    @property
    def baseline_workspace(self) -> int:
        """The baselines' workspace, added up (WD) or the largest (WR), as `workspace` is."""
        sizes = [k.baseline.workspace for k in self.kernels if k.baseline]
        return (sum(sizes) if self.mode == "WD" else max(sizes)) if sizes else 0

    @property
    def noisy(self) -> list[tuple[KernelPlan, MicroConfig]]:
        """Noisy measurements, once per distinct problem (kernels of one shape share a table)."""
        seen, found = set(), []
        for k in self.kernels:
            if (k.problem.key, k.problem.n) not in seen:
                seen.add((k.problem.key, k.problem.n))
                found += [(k, m) for m in k.noisy]
        return found

    def to_json(self) -> dict:
        def finite(x: float) -> float | None:  # JSON has no infinity
            return x if math.isfinite(x) else None

        return {
            "device": self.device,
            "backend": self.backend,
            "policy": self.policy,
            "mode": self.mode,
            "workspace_limit": self.workspace_limit,
            "total_workspace": self.total_workspace,
            "batch": self.batch,
            "kernels": [
                {
                    "layer": k.layer,
                    "kind": k.problem.kind,
                    "problem": k.problem.spec,
                    "baseline": (
                        {
                            "algo": k.baseline.algo,
                            "time_ms": k.baseline.time,
                            "workspace": k.baseline.workspace,
                            "chosen_by": k.baseline_rule,
                        }
                        if k.baseline
                        else None
                    ),
                    "config": [micro_to_json(m) for m in k.config.micros],
                    "configuration": k.config.describe(),
                    "time_ms": k.config.time,
                    "workspace": k.config.workspace,
                    "speedup": finite(k.speedup),
                    "doubtful": k.doubtful,
                    "batch": k.problem.n,
                    "excluded": [{"algo": m.algo, "batch": m.batch, "reason": m.reason} for m in k.excluded],
                    "unsupported": [{"algo": algo, "reason": reason} for algo, reason in k.unsupported],
                    "pruned": [{"algo": m.algo, "batch": m.batch, "reason": m.reason} for m in k.pruned],
                }
                for k in self.kernels
            ],
            "total": {
                "baseline_ms": finite(self.baseline_ms),
                "time_ms": self.time_ms,
                "speedup": finite(self.baseline_ms / self.time_ms),
                "workspace": self.workspace,
                "baseline_workspace": self.baseline_workspace,
            },
            "benchmark": {
                "measured": self.stats.measured,
                "cached": self.stats.cached,
                "seconds": round(self.stats.seconds, 3),
                "candidates": self.stats.candidates,
                "over_limit": self.stats.over_limit,
                "pruned": self.stats.pruned,
                "remeasured": self.remeasured,
                "remeasure_seconds": round(self.remeasure_seconds, 3),
            },
            "legend": {
                "configuration": configuration_notation(self.example_configuration),
                "baseline": self.baseline_text,
                "speedup": "the baseline's time divided by the configuration's; the total's is the sum "
                "of the baselines' times over the sum of the configurations' times; "
                "doubtful: it rests on a time that still looks like an outlier (noisy, or "
                "over 2x slower per sample than at a smaller size) after re-measuring",
            },
            "warnings": {
                "noisy_timings": len(self.noisy),
                "wrong_results": sum(len(k.excluded) for k in self.kernels),
                "unsupported": sum(len(k.unsupported) for k in self.kernels),
                "noisy_measured_now": self.noisy_now,
                "advice": self.noise_text,
            },
            "noisy": [
                {
                    "layer": k.layer,
                    "kind": k.problem.kind,
                    "problem": k.problem.spec,
                    "algo": m.algo,
                    "batch": m.batch,
                    "time_ms": m.time,
                    "spread_ms": m.spread,
                }
                for k, m in self.noisy
            ],
        }


def expand_kernels(
    layers: Sequence[tuple[str, ConvProblem]], batch: int, kinds: Sequence[str] = KINDS
) -> list[tuple[str, ConvProblem]]:
    """Each layer at `batch`, once per kind, in layer order."""
    for kind in kinds:
        if kind not in KINDS:
            raise InvalidInput(f"unknown kind {kind!r}; choose among {', '.join(KINDS)}")
    return [(name, problem.with_batch(batch).with_kind(kind)) for name, problem in layers for kind in kinds]


def optimize(
    backend: Backend,
    kernels: Sequence[tuple[str, ConvProblem]],
    *,
    policy: Policy,
    workspace_limit: int | None = None,
    total_workspace: int | None = None,
    cache=None,
    algos: Sequence[str] | None = None,
    reps: int = 3,
    progress=None,
    benchmark_limit: int | None = None,
) -> Report:
    """Measure every kernel (each distinct problem once) and choose its configuration.

    WR (`workspace_limit`, or no limit): each kernel independently by `wr.solve`, each at its own
    batch size.
    WD (`total_workspace`): Pareto fronts per kernel, then `wd.solve` over all of them. The WD
    baseline is the undivided fastest algorithm within an equal share `total_workspace / K`, the
    division a framework without WD would make.

    `benchmark_limit` prunes candidates before they are timed (`measure_table`; None or 0: none).

    Every kernel has a baseline (`choose_baseline`). A time measured now that a speedup rests on
    (the baseline's, or one of the chosen configuration's) and that looks like an outlier
    (`looks_like_outlier`) is measured again before the ratio is taken, and the solve is redone.
    `progress` (a tqdm bar) is advanced once per candidate, and once per re-measurement, its total
    growing by each; the report's `stats.seconds` is the wall time of all of it.
    """
    start = clock()
    if not kernels:
        raise InvalidInput("no kernels to optimise")
    if workspace_limit is not None and total_workspace is not None:
        raise InvalidInput("give a per-kernel workspace limit (WR) or a total workspace (WD), not both")
    mode = "WD" if total_workspace is not None else "WR"
    batches = {p.n for _, p in kernels}
    if mode == "WD" and len(batches) != 1:
        raise InvalidInput(f"WD divides one workspace among kernels of one batch size, got {sorted(batches)}")
    measure_limit = total_workspace if mode == "WD" else workspace_limit

    # Keyed by (problem key, n): the key leaves the batch size out, and WR kernels may differ in it.
    tables: dict[tuple[str, int], dict[int, list[MicroConfig]]] = {}
    fresh: dict[tuple[str, int], set[tuple[str, int]]] = {}  # (algo, size) measured by this run
    problem_of: dict[tuple[str, int], ConvProblem] = {}
    stats: dict[tuple[str, int], BenchStats] = {}  # per table

    def measured_table(
        tk: tuple[str, int], progress=progress, known: Mapping[tuple[str, int], MicroConfig] | None = None
    ) -> tuple[dict[int, list[MicroConfig]], BenchStats]:
        return measure_table(
            backend,
            problem_of[tk],
            batch_sizes(policy, tk[1]),
            cache=cache,
            algos=algos,
            reps=reps,
            workspace_limit=measure_limit,
            progress=progress,
            fresh=fresh[tk],
            benchmark_limit=benchmark_limit,
            front=mode == "WD",
            known=known,
        )

    for _, problem in kernels:
        tk = (problem.key, problem.n)
        if tk not in tables:
            fresh[tk], problem_of[tk] = set(), problem
            tables[tk], stats[tk] = measured_table(tk)

    baseline_limit = total_workspace // len(kernels) if total_workspace is not None else workspace_limit
    batch = next(iter(batches))
    for tk, table in tables.items():  # a fallback baseline the benchmark skipped: measure it without the limit
        algo = _least_workspace_unmeasured(table, tk[1], baseline_limit)
        if algo is not None:
            new, s = measure_table(
                backend, problem_of[tk], [tk[1]], cache=cache, algos=[algo], reps=reps, fresh=fresh[tk]
            )
            table[tk[1]] = [new[tk[1]][0] if m.algo == algo else m for m in table[tk[1]]]
            # The candidate moves from "over the limit" to measured or cached: the total stays the bar's.
            stats[tk] += dataclasses.replace(s, over_limit=-1)

    def solve():
        chosen_baselines = {tk: choose_baseline(table, tk[1], baseline_limit) for tk, table in tables.items()}
        if mode == "WR":
            fronts_: dict[str, list[Configuration]] = {}
            configs_ = [wr.solve(tables[p.key, p.n], p.n, workspace_limit) for _, p in kernels]
        else:
            fronts_ = pareto_fronts(
                [p for _, p in kernels], {p.key: tables[p.key, p.n] for _, p in kernels}, batch, total_workspace
            )
            configs_ = _solve_wd(kernels, fronts_, total_workspace)
        return chosen_baselines, configs_, fronts_

    noisy_now = sum(
        1
        for tk, table in tables.items()
        for row in table.values()
        for m in row
        if (m.algo, m.batch) in fresh[tk] and m.usable and is_noisy(m.time, m.spread)
    )
    # A ratio is only as good as its two times: re-measure the suspicious ones it rests on, then solve
    # again (a re-measured time can change what is fastest). Each time gets one round of tries.
    remeasured: set[tuple[tuple[str, int], str, int]] = set()
    remeasure_seconds = 0.0
    for _ in range(MAX_REMEASURE_ROUNDS):
        baselines, configs, fronts = solve()
        suspects = {}
        for (_, p), config in zip(kernels, configs, strict=True):
            tk = (p.key, p.n)
            base = baselines[tk][0]
            for m in ((base,) if base else ()) + config.micros:
                key = (tk, m.algo, m.batch)
                if (m.algo, m.batch) in fresh[tk] and key not in remeasured and looks_like_outlier(m, tables[tk]):
                    suspects[key] = m
        if not suspects:
            break
        began = clock()
        replaced: set[tuple[str, int]] = set()  # tables a re-measurement changed a row of
        if progress is not None:  # one step per re-measurement, so that the bar moves while they run
            progress.total += len(suspects)
            progress.set_description(f"re-measuring {len(suspects)} outliers")
        for key, m in suspects.items():
            tk = key[0]
            for attempt in range(REMEASURE_ATTEMPTS):
                if attempt and progress is not None:
                    progress.total += 1
                again = remeasure(backend, problem_of[tk], m, reps=REMEASURE_REPS_FACTOR * reps, cache=cache)
                if again is not m:  # (the faster time: kept, and in the cache)
                    row = tables[tk][m.batch]
                    tables[tk][m.batch] = [again if (x.algo, x.batch) == (m.algo, m.batch) else x for x in row]
                    replaced.add(tk)
                m = again
                if progress is not None:
                    progress.update(1)
                if not looks_like_outlier(m, tables[tk]):
                    break
            remeasured.add(key)
        # what was pruned rested on the times replaced: pruned anew from the rows as they are now, as a rerun
        # from the cache prunes them (a candidate no longer pruned is measured)
        for tk in replaced if benchmark_limit else ():
            known = {(x.algo, x.batch): x for row in tables[tk].values() for x in row if (x.algo, x.batch) in fresh[tk]}
            tables[tk], stats[tk] = measured_table(tk, progress=None, known=known)
        remeasure_seconds += clock() - began
    else:
        baselines, configs, fronts = solve()

    unsupported = {tk: _unsupported(backend, problem_of[tk], table) for tk, table in tables.items()}
    plans = []
    for (name, p), config in zip(kernels, configs, strict=True):
        base, rule = baselines[p.key, p.n]
        excluded, noisy = _findings(tables[p.key, p.n])
        doubtful = any(looks_like_outlier(m, tables[p.key, p.n]) for m in ((base,) if base else ()) + config.micros)
        pruned = tuple(m for row in tables[p.key, p.n].values() for m in row if m.reason.startswith(PRUNED))
        plans.append(
            KernelPlan(
                name,
                p,
                base,
                config,
                excluded,
                noisy,
                baseline_rule=rule,
                doubtful=doubtful,
                unsupported=unsupported[p.key, p.n],
                pruned=pruned,
            )
        )
    return Report(
        device=backend.device.model,
        backend=backend.name,
        policy=policy_name(policy),
        mode=mode,
        workspace_limit=workspace_limit,
        total_workspace=total_workspace,
        batch=batch if len(batches) == 1 else None,
        kernels=tuple(plans),
        stats=dataclasses.replace(sum(stats.values(), BenchStats()), seconds=clock() - start),
        fronts=fronts,
        baseline_limit=baseline_limit,
        remeasured=len(remeasured),
        remeasure_seconds=remeasure_seconds,
        noisy_now=noisy_now,
        reps=reps,
    )


def looks_like_outlier(m: MicroConfig, table: Mapping[int, Sequence[MicroConfig]]) -> bool:
    """Noisy (`is_noisy`), or slower per sample than the same algorithm at a smaller measured size by
    more than OUTLIER_PER_SAMPLE_FACTOR: a larger micro-batch rarely costs more per sample."""
    if is_noisy(m.time, m.spread):
        return True
    per_sample = [
        x.time / x.batch
        for size, row in table.items()
        if size < m.batch
        for x in row
        if x.algo == m.algo and x.usable and x.time > 0
    ]
    return bool(per_sample) and m.time / m.batch > OUTLIER_PER_SAMPLE_FACTOR * min(per_sample)


def choose_baseline(
    table: Mapping[int, Sequence[MicroConfig]], batch: int, limit: int | None
) -> tuple[MicroConfig | None, str]:
    """The kernel's baseline and the rule that chose it (BASELINE_FASTEST or BASELINE_LEAST_WORKSPACE).

    What framework-style selection runs: the fastest algorithm at the undivided batch within `limit`;
    where none fits, the measured undivided algorithm that needs the least workspace, which is what a
    framework falls back to (cuDNN's implicit GEMM needs none). None only when no algorithm ran the
    undivided batch at all.
    """
    best = undivided_baseline(table, batch, limit)
    if best is not None:
        return best, BASELINE_FASTEST
    ran = [m for m in table.get(batch, []) if m.usable]
    if not ran:
        return None, ""
    return min(ran, key=lambda m: (m.workspace, m.time)), BASELINE_LEAST_WORKSPACE


def _least_workspace_unmeasured(
    table: Mapping[int, Sequence[MicroConfig]], batch: int, limit: int | None
) -> str | None:
    """The algorithm `choose_baseline` would fall back to when the benchmark skipped it (over its
    limit), so that it can be measured; None when nothing needs measuring."""
    if undivided_baseline(table, batch, limit) is not None:
        return None
    candidates = [m for m in table.get(batch, []) if m.usable or m.reason.startswith("needs ")]
    if not candidates:
        return None
    least = min(candidates, key=lambda m: (m.workspace, m.time))
    return None if least.usable else least.algo


def _findings(table: Mapping[int, Sequence[MicroConfig]]) -> tuple[tuple[MicroConfig, ...], tuple[MicroConfig, ...]]:
    """(candidates rejected as wrong, noisy measurements) of one kernel's table."""
    micros = [m for row in table.values() for m in row]
    return (
        tuple(m for m in micros if m.reason.startswith("wrong result")),
        tuple(m for m in micros if m.usable and is_noisy(m.time, m.spread)),
    )


def _unsupported(
    backend: Backend, problem: ConvProblem, table: Mapping[int, Sequence[MicroConfig]]
) -> tuple[tuple[str, str], ...]:
    """The algorithms of a kernel's table that the backend cannot run at the undivided batch, with
    its reason. Only those that ran at no size are asked (the rest can run), so a cached table costs
    a question per algorithm that never ran, none per one that did."""
    never_ran = [
        m.algo
        for m in table.get(problem.n, [])
        if not any(x.usable or x.reason.startswith("needs ") for row in table.values() for x in row if x.algo == m.algo)
    ]
    found = []
    for algo in never_ran:
        reason = backend.unsupported_reason(problem, algo)
        if reason is not None:
            found.append((algo, reason))
    return tuple(found)


def _solve_wd(kernels, fronts, total_workspace: int) -> list[Configuration]:
    from ucudnn.solver import wd

    chosen = wd.solve({i: fronts[p.key] for i, (_, p) in enumerate(kernels)}, total_workspace)
    return [chosen[i] for i in range(len(kernels))]
