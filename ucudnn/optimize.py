"""From layers to an optimised report: measure every kernel, then solve WR (per kernel) or WD (network)."""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from ucudnn.backends.base import Backend, is_noisy
from ucudnn.benchmark import BenchStats, Policy, batch_sizes, device_key, measure_table, policy_name
from ucudnn.errors import InvalidInput
from ucudnn.problem import KINDS, ConvProblem
from ucudnn.solver import wr
from ucudnn.solver.types import Configuration, Infeasible, MicroConfig


def micro_to_json(m: MicroConfig) -> dict:
    """The JSON form of a micro-config, as in `ucudnn bench --json` and stored plans."""
    return {"algo": m.algo, "batch": m.batch, "time_ms": m.time, "workspace": m.workspace}


def micro_from_json(d: Mapping) -> MicroConfig:
    return MicroConfig(d["algo"], int(d["batch"]), float(d["time_ms"]), int(d["workspace"]))


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
    stats: BenchStats
    # WD only: the Pareto front of each distinct problem (by ConvProblem.key), for plots.
    fronts: Mapping[str, Sequence[Configuration]] = field(default_factory=dict)

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
            "device": self.device, "backend": self.backend, "policy": self.policy, "mode": self.mode,
            "workspace_limit": self.workspace_limit, "total_workspace": self.total_workspace,
            "batch": self.batch,
            "kernels": [{
                "layer": k.layer, "kind": k.problem.kind, "problem": k.problem.spec,
                "baseline": ({"algo": k.baseline.algo, "time_ms": k.baseline.time,
                              "workspace": k.baseline.workspace} if k.baseline else None),
                "config": [micro_to_json(m) for m in k.config.micros],
                "time_ms": k.config.time, "workspace": k.config.workspace, "speedup": finite(k.speedup),
                "batch": k.problem.n,
                "excluded": [{"algo": m.algo, "batch": m.batch, "reason": m.reason} for m in k.excluded],
            } for k in self.kernels],
            "total": {"baseline_ms": finite(self.baseline_ms), "time_ms": self.time_ms,
                      "speedup": finite(self.baseline_ms / self.time_ms), "workspace": self.workspace},
            "benchmark": {"measured": self.stats.measured, "cached": self.stats.cached,
                          "seconds": round(self.stats.seconds, 3)},
            "warnings": {"noisy_timings": len(self.noisy),
                         "wrong_results": sum(len(k.excluded) for k in self.kernels)},
            "noisy": [{"layer": k.layer, "kind": k.problem.kind, "problem": k.problem.spec, "algo": m.algo,
                       "batch": m.batch, "time_ms": m.time, "spread_ms": m.spread} for k, m in self.noisy],
        }


def expand_kernels(layers: Sequence[tuple[str, ConvProblem]], batch: int,
                   kinds: Sequence[str] = KINDS) -> list[tuple[str, ConvProblem]]:
    """Each layer at `batch`, once per kind, in layer order."""
    for kind in kinds:
        if kind not in KINDS:
            raise InvalidInput(f"unknown kind {kind!r}; choose among {', '.join(KINDS)}")
    return [(name, problem.with_batch(batch).with_kind(kind)) for name, problem in layers for kind in kinds]


def plan_key(backend: Backend, **parts) -> str:
    """A cache key for a solved plan: a hash of everything the plan was solved from."""
    text = json.dumps({**device_key(backend), **backend.settings(), **parts}, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def optimize(backend: Backend, kernels: Sequence[tuple[str, ConvProblem]], *, policy: Policy,
             workspace_limit: int | None = None, total_workspace: int | None = None, cache=None,
             algos: Sequence[str] | None = None, reps: int = 3, progress=None) -> Report:
    """Measure every kernel (each distinct problem once) and choose its configuration.

    WR (`workspace_limit`, or no limit): each kernel independently by `wr.solve`, each at its own
    batch size.
    WD (`total_workspace`): Pareto fronts per kernel, then `wd.solve` over all of them. The WD
    baseline is the undivided fastest algorithm within an equal share `total_workspace / K`, the
    division a framework without WD would make.
    """
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
    stats = BenchStats()
    for _, problem in kernels:
        if (problem.key, problem.n) not in tables:
            tables[problem.key, problem.n], s = measure_table(
                backend, problem, batch_sizes(policy, problem.n), cache=cache, algos=algos, reps=reps,
                workspace_limit=measure_limit, progress=progress)
            stats += s

    def table(p: ConvProblem) -> dict[int, list[MicroConfig]]:
        return tables[p.key, p.n]

    baseline_limit = total_workspace // len(kernels) if mode == "WD" else workspace_limit
    baselines = [undivided_baseline(table(p), p.n, baseline_limit) for _, p in kernels]
    fronts: dict[str, list[Configuration]] = {}
    if mode == "WR":
        configs = [wr.solve(table(p), p.n, workspace_limit) for _, p in kernels]
    else:
        batch = next(iter(batches))
        fronts = pareto_fronts([p for _, p in kernels], {p.key: table(p) for _, p in kernels}, batch,
                               total_workspace)
        configs = _solve_wd(kernels, fronts, total_workspace)
    plans = tuple(KernelPlan(name, p, b, c, *_findings(table(p)))
                  for (name, p), b, c in zip(kernels, baselines, configs, strict=True))
    return Report(device=backend.device.model, backend=backend.name, policy=policy_name(policy), mode=mode,
                  workspace_limit=workspace_limit, total_workspace=total_workspace,
                  batch=next(iter(batches)) if len(batches) == 1 else None,
                  kernels=plans, stats=stats, fronts=fronts)


def _findings(table: Mapping[int, Sequence[MicroConfig]]) -> tuple[tuple[MicroConfig, ...], tuple[MicroConfig, ...]]:
    """(candidates rejected as wrong, noisy measurements) of one kernel's table."""
    micros = [m for row in table.values() for m in row]
    return (tuple(m for m in micros if m.reason.startswith("wrong result")),
            tuple(m for m in micros if m.usable and is_noisy(m.time, m.spread)))


def undivided_baseline(table: Mapping[int, Sequence[MicroConfig]], batch: int, limit: int | None) -> MicroConfig | None:
    """cuDNN-style selection: the fastest algorithm at the whole batch within the limit."""
    return wr.fastest_within({batch: table.get(batch, [])}, limit).get(batch)


def pareto_fronts(problems: Sequence[ConvProblem], tables, batch: int, total_workspace: int) -> dict[str, list[Configuration]]:
    """One front per distinct problem (by key): kernels of the same shape share it."""
    from ucudnn.solver import pareto

    fronts: dict[str, list[Configuration]] = {}
    for p in problems:
        if p.key not in fronts:
            try:
                fronts[p.key] = pareto.front(tables[p.key], batch, total_workspace)
            except Infeasible as exc:
                raise Infeasible(f"{p.spec} ({p.kind}): {exc}") from exc
    return fronts


def _solve_wd(kernels, fronts, total_workspace: int) -> list[Configuration]:
    from ucudnn.solver import wd

    chosen = wd.solve({i: fronts[p.key] for i, (_, p) in enumerate(kernels)}, total_workspace)
    return [chosen[i] for i in range(len(kernels))]
