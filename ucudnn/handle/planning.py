"""Planning a kernel: measuring its candidates (through the cache), then solving WR (each kernel the
fastest within its limit, memoised) or WD (the whole network's division of one arena), loading a
stored plan where the cache has one."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ucudnn.backends.base import Backend
from ucudnn.errors import InvalidInput
from ucudnn.handle.arena import _place_segments
from ucudnn.kernel.call_overhead import charged_fronts, native_undivided
from ucudnn.kernel.measure import (
    PRUNED,
    BenchStats,
    Policy,
    batch_sizes,
    confirm_faster,
    measure_table,
    policy_name,
    remeasure_understated,
)
from ucudnn.kernel.plans import (
    DamagedPlan,
    config_from_json,
    micro_from_json,
    micro_to_json,
    pareto_fronts,
    plan_key,
    undivided_baseline,
)
from ucudnn.kernel.resources import check_can_run
from ucudnn.problem import ConvProblem
from ucudnn.solver import wr
from ucudnn.solver.types import Configuration, Infeasible, MicroConfig

# Seconds of measuring before the progress bar shows: a kernel served by the cache shows none.
PROGRESS_DELAY_S = 2.0
# Databases spelled as "keep nothing across processes": mapped to SQLAlchemy's in-memory SQLite.
_IN_MEMORY_DB = (":memory:", "sqlite://", "sqlite:///:memory:")


@dataclass(frozen=True, slots=True)
class _Plan:
    """A kernel's solved configuration, its baseline and (WD) its arena offset."""

    config: Configuration
    baseline: MicroConfig | None
    offset: int | None = None


def _pruned(table: dict[int, list[MicroConfig]]) -> list[list]:
    """What the benchmark limit kept from being timed, `[algo, micro-batch size, reason]`, for the stored plan."""
    return [[m.algo, m.batch, m.reason] for row in table.values() for m in row if m.reason.startswith(PRUNED)]


class _Planning:
    """The Handle's planning (a mixin of `Handle`, whose plans and cache it keeps)."""

    # the Handle's state it uses (`Handle.__init__` says what each is)
    _backend: Backend
    _algos: tuple[str, ...] | None
    _policy: Policy
    _reps: int
    _benchmark_limit: int
    _call_overhead: float
    _workspace_limit: int | None
    _total_workspace: int | None
    _db: str | bool | None
    _cache: Any
    _cache_open: bool
    _stats: BenchStats
    _failed: dict[tuple[str, str, int], MicroConfig]
    _wr_plans: dict[tuple[str, int, int | None], _Plan]
    _layers: dict[str, tuple[ConvProblem, frozenset[str]]]
    _wd_plans: dict[int, dict[tuple[str, str], tuple[ConvProblem, _Plan]]]
    _wd_solved: bool
    _arena: Any
    _peak_bytes: int

    if TYPE_CHECKING:  # the Handle's

        def front(self, problem: ConvProblem) -> list[Configuration]: ...

    def _candidates(self, problem: ConvProblem) -> list[str]:
        if self._algos is None:
            return self._backend.algorithms(problem)
        known = self._backend.algorithms(problem)
        unknown = [a for a in self._algos if a not in known]
        if unknown:
            raise InvalidInput(
                f"unknown algorithm(s) {', '.join(unknown)} for backend {self._backend.name} "
                f"({problem.kind}); known: {', '.join(known)}"
            )
        return list(self._algos)

    def _open_cache(self):
        if not self._cache_open:
            self._cache_open = True
            if self._db is not False:
                from ucudnn.db import Cache

                url = self._db
                if isinstance(url, str) and url in _IN_MEMORY_DB:
                    url = "sqlite://"
                elif url is not None:
                    url = str(url)
                self._cache = Cache(url)
        return self._cache

    def _measure(self, problem: ConvProblem, limit: int | None, front: bool = False) -> dict[int, list[MicroConfig]]:
        """The kernel's table at the policy's sizes; pruned by the benchmark limit (`front`: the caller
        needs a Pareto front of time and workspace, not only the fastest within `limit`)."""
        import sys

        from tqdm import tqdm

        candidates = self._candidates(problem)
        check_can_run(self._backend, problem, algos=candidates, workspace_limit=limit)
        sizes = batch_sizes(self._policy, problem.n)
        # shown on a terminal only, and only once measuring has taken a while (most kernels come from the cache)
        with tqdm(
            total=len(sizes) * len(candidates),
            desc=f"ucudnn: measuring {problem.kind} {problem.spec}",
            unit="candidate",
            file=sys.stderr,
            disable=None,
            delay=PROGRESS_DELAY_S,
            leave=False,
        ) as progress:
            table, stats = measure_table(
                self._backend,
                problem,
                sizes,
                cache=self._open_cache(),
                algos=candidates,
                reps=self._reps,
                workspace_limit=limit,
                progress=progress,
                benchmark_limit=self._benchmark_limit,
                front=front,
            )
        self._stats += stats
        if self._failed:  # algorithms that failed in a plan this session, also without a cache
            table = {
                size: [self._failed.get((problem.key, m.algo, size), m) for m in row] for size, row in table.items()
            }
        return table

    def _plan_key(self, **parts) -> str:
        if self._call_overhead:  # charged plans differ; uncharged ones keep their old keys
            parts["call_overhead_ms"] = round(self._call_overhead, 3)
        if self._benchmark_limit:  # a plan from pruned tables may differ; exhaustive ones keep their old keys
            parts["benchmark_limit"] = self._benchmark_limit
        return plan_key(self._backend, policy=policy_name(self._policy), algos=self._algos, **parts)

    def _wr_limit(self, budget: int | None) -> int | None:
        """The limit a WR plan is solved within: the handle's own, or a memory plan's `budget` capped
        by it (a WD handle has none: the plan's budgets are what replace its division)."""
        if budget is None:
            return self._workspace_limit
        return budget if self._workspace_limit is None else min(self._workspace_limit, budget)

    def _front_within(self, problem: ConvProblem, limit: int | None) -> Configuration | None:
        """The configuration a memory planner picked on this kernel's `front` (`Handle.front`) with `limit` as its
        budget: the fastest there within it (None: none fits). A WR solve within the budget instead re-times its
        choice against undivided ones (`confirm_faster`) and may run another, holding more or less than the plan
        counted (a converted HF SegFormer's roomy plan counted 0.96 of its prediction)."""
        try:
            front = self.front(problem)
        except Infeasible:
            return None
        return min((c for c in front if limit is None or c.workspace <= limit), key=lambda c: c.time, default=None)

    def _plan_wr(self, problem: ConvProblem, fresh: bool = False, budget: int | None = None) -> _Plan:
        """WR: the fastest configuration within `_wr_limit(budget)`."""
        limit = self._wr_limit(budget)
        memo = (problem.key, problem.n, limit)
        plan = self._wr_plans.get(memo)
        if plan is not None:
            return plan
        key = self._plan_key(mode="WR", workspace_limit=limit, problem=problem.key, batch=problem.n)
        cache = self._open_cache()
        plan = self._stored_wr(cache, key, problem, limit) if cache is not None and not fresh else None
        if plan is None:
            table = self._measure(problem, limit)
            while True:  # again where the choice rests on a damaged row (measured again by the check)
                try:
                    config = wr.solve(table, problem.n, limit)
                except Infeasible as exc:
                    raise Infeasible(f"{problem.spec} ({problem.kind}): {exc}") from exc
                baseline = undivided_baseline(table, problem.n, limit)
                chosen = [*config.micros, *([baseline] if baseline else [])]
                if not remeasure_understated(self._backend, problem, table, chosen, reps=self._reps, cache=cache):
                    break
            native = native_undivided(table, problem.n, limit) if self._call_overhead else None
            if native is None or native.micros != (baseline,):
                config = confirm_faster(self._backend, problem, config, baseline, self._reps)
            if native is not None:  # the caller runs native undivided itself: others must win by the charge
                config = confirm_faster(
                    self._backend, problem, config, native.micros[0], self._reps, charge_ms=self._call_overhead
                )
            plan = _Plan(config, baseline)
            if cache is not None:
                cache.put_plan(
                    key,
                    {
                        "mode": "WR",
                        "problem": problem.key,
                        "batch": problem.n,
                        "config": [micro_to_json(m) for m in config.micros],
                        "baseline": micro_to_json(baseline) if baseline else None,
                        "pruned": _pruned(table),
                    },
                )
        self._wr_plans[memo] = plan
        return plan

    def _stored_wr(self, cache: Any, key: str, problem: ConvProblem, limit: int | None) -> _Plan | None:
        """The WR plan stored under `key`, checked as a fresh one; None where there is none or it is damaged."""
        stored = cache.get_plan(key)
        if stored is None:
            return None
        try:
            config = config_from_json(stored.get("config"), self._backend, problem, self._candidates(problem), limit)
            baseline = micro_from_json(stored["baseline"]) if stored.get("baseline") else None
        except DamagedPlan as exc:
            cache.damaged("plan", f"{key[:12]} (WR, {problem.kind} {problem.spec})", str(exc))
            return None
        return _Plan(config, baseline)

    def _stored_wd(
        self, cache: Any, key: str, problems: list[ConvProblem], total: int
    ) -> tuple[list[Configuration], list[MicroConfig | None]] | None:
        """The WD plan stored under `key` for `problems`, each kernel checked as a fresh one and the whole
        placed within `total`; None where there is none or it is damaged."""
        stored = cache.get_plan(key)
        if stored is None:
            return None
        try:
            kernels = stored.get("kernels")
            if not isinstance(kernels, list) or len(kernels) != len(problems):
                raise DamagedPlan(f"it holds no list of {len(problems)} kernels")
            configs, baselines = [], []
            for i, (k, p) in enumerate(zip(kernels, problems, strict=True)):
                if not isinstance(k, dict) or k.get("problem") != p.key:
                    raise DamagedPlan(f"kernel {i} is not the plan of {p.key!r}")
                configs.append(config_from_json(k.get("config"), self._backend, p, self._candidates(p), total))
                baselines.append(micro_from_json(k["baseline"]) if k.get("baseline") else None)
            end = _place_segments(configs)[1]
            if end > total:
                raise DamagedPlan(f"its segments need {end} B of arena, over the total {total} B")
        except DamagedPlan as exc:
            cache.damaged("plan", f"{key[:12]} (WD, {len(problems)} kernels at batch {problems[0].n})", str(exc))
            return None
        return configs, baselines

    def _solve_wd(self, batch: int, fresh: bool = False) -> dict[tuple[str, str], tuple[ConvProblem, _Plan]]:
        """Solve (or load) the workspace division of every registered kernel at this batch."""
        total = self._total_workspace
        assert total is not None
        # A canonical kernel order, so that networks with the same multiset of kernels share a plan.
        kernels = sorted(
            (
                (layer, kind, template.with_batch(batch).with_kind(kind))
                for layer, (template, kinds) in self._layers.items()
                for kind in kinds
            ),
            key=lambda t: (t[2].key, t[0]),
        )
        problem_keys = [p.key for _, _, p in kernels]
        key = self._plan_key(mode="WD", total_workspace=total, batch=batch, kernels=problem_keys)
        cache = self._open_cache()
        problems = [p for _, _, p in kernels]
        stored = self._stored_wd(cache, key, problems, total) if cache is not None and not fresh else None
        if stored is not None:
            configs, baselines = stored
            offsets, end = _place_segments(configs)
        else:
            configs, baselines, offsets, end, tables = self._solve_wd_fresh(problems, total)
            if cache is not None:
                cache.put_plan(
                    key,
                    {
                        "mode": "WD",
                        "total_workspace": total,
                        "batch": batch,
                        "kernels": [
                            {
                                "problem": p,
                                "config": [micro_to_json(m) for m in c.micros],
                                "baseline": micro_to_json(b) if b else None,
                                "pruned": _pruned(tables[p]),
                            }
                            for p, c, b in zip(problem_keys, configs, baselines, strict=True)
                        ],
                    },
                )
        if self._arena is None and not self._backend.workspace_per_run:
            self._arena = self._backend.empty_workspace(total)
        self._peak_bytes = max(self._peak_bytes, end)
        plans = {
            (layer, kind): (p, _Plan(c, b, o))
            for (layer, kind, p), c, b, o in zip(kernels, configs, baselines, offsets, strict=True)
        }
        self._wd_plans[batch] = plans
        self._wd_solved = True
        return plans

    def _solve_wd_fresh(self, problems: list[ConvProblem], total: int):
        from ucudnn.solver import wd

        batch = problems[0].n
        tables: dict[str, dict[int, list[MicroConfig]]] = {}
        for p in problems:
            if p.key not in tables:
                tables[p.key] = self._measure(p, total, front=True)
        fronts = pareto_fronts(problems, tables, batch, total)
        originals: dict[int, Configuration] = {}
        if self._call_overhead:
            fronts, originals = charged_fronts(fronts, tables, batch, total, self._call_overhead)
        share = total // len(problems)  # the baseline: an equal share, what a framework without WD gives
        baselines = [undivided_baseline(tables[p.key], batch, share) for p in problems]
        # Aligning segment starts can push the placed span past the total by up to K * align bytes;
        # solve again with the overshoot taken off the budget until the placement fits.
        budget = total
        while True:
            chosen = wd.solve({i: fronts[p.key] for i, p in enumerate(problems)}, budget)
            configs = [originals.get(id(chosen[i]), chosen[i]) for i in range(len(problems))]
            offsets, end = _place_segments(configs)
            if end <= total:
                return configs, baselines, offsets, end, tables
            budget -= end - total
            if budget < 0:
                raise Infeasible(f"aligned WD segments do not fit the total workspace {total} B")
