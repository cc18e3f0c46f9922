"""Recovery from a planned algorithm that cannot run: the first run of each configuration is checked,
and a failure is recorded as unusable (in the cache and for the session) and the kernel planned again,
so a backend's gaps cost one warning, not the call."""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ucudnn.backends.base import Backend, one_line
from ucudnn.errors import UnsupportedProblem
from ucudnn.handle.kernel import _Prepared, _prepared
from ucudnn.kernel.measure import Policy, batch_sizes, device_key
from ucudnn.solver.types import MicroConfig

if TYPE_CHECKING:
    from ucudnn.handle.planning import _Plan
    from ucudnn.problem import ConvProblem


class PlanFailureWarning(UserWarning):
    """A planned algorithm could not run; it was recorded as unusable and the kernel re-planned."""


# Re-plans of one call before giving up. Each records at least one more unusable (algorithm,
# micro-batch), so this only bounds a backend whose failures move from size to size.
_MAX_REPLANS = 16


class _Recovery:
    """The Handle's re-planning (a mixin of `Handle`, whose plans it replaces)."""

    # the Handle's state it uses (`Handle.__init__` says what each is)
    _backend: Backend
    _policy: Policy
    _failed: dict[tuple[str, str, int], MicroConfig]
    _warned_failure: bool
    _prepared: dict[tuple, _Prepared]
    _generation: int
    _wr_plans: dict[tuple[str, int, int | None], _Plan]
    _wd_plans: dict[int, dict[tuple[str, str], tuple[ConvProblem, _Plan]]]

    if TYPE_CHECKING:  # the Handle's, its planning's (`_Planning`) and its launch's (`_Launching`)

        @property
        def mode(self) -> str: ...

        def _open_cache(self) -> Any: ...

        def _wr_limit(self, budget: int | None) -> int | None: ...

        def _plan_wr(self, problem: ConvProblem, fresh: bool = False, budget: int | None = None) -> _Plan: ...

        def _solve_wd(self, batch: int, fresh: bool = False) -> dict[tuple[str, str], tuple[ConvProblem, _Plan]]: ...

        def _run_kernels(self, prep: _Prepared, **operands: Any) -> None: ...

    def _candidate_failures(self) -> tuple[type[BaseException], ...]:
        return (UnsupportedProblem, MemoryError, *self._backend.candidate_failures())

    def _run_first(self, prep: _Prepared, *, out: Any, beta: float, **operands: Any) -> None:
        """Run a configuration that has not run before: one that cannot run is recorded and re-planned.

        Every micro-batch's algorithm is checked before anything is written; for a failure while
        running, `out` is restored from a copy taken first when beta != 0 reads it.
        """
        for _ in range(_MAX_REPLANS):
            failures = [
                MicroConfig(m.algo, m.batch, float("inf"), 0, reason=reason)
                for m in dict.fromkeys(prep.config.micros)
                if (reason := self._backend.unsupported_reason(prep.problem.with_batch(m.batch), m.algo))
            ]
            if failures:
                prep = self._replan(prep, UnsupportedProblem(failures[0].reason), failures)
                continue
            saved = out.copy() if beta != 0 else None
            try:
                self._run_kernels(prep, out=out, beta=beta, **operands)
            except self._candidate_failures() as exc:
                if saved is not None:
                    out[...] = saved
                prep = self._replan(prep, exc)
                continue
            return
        raise UnsupportedProblem(
            f"{prep.problem.spec} ({prep.problem.kind}): no runnable configuration after {_MAX_REPLANS} re-plans"
        )

    def _replan(self, prep: _Prepared, exc: BaseException, failures: Sequence[MicroConfig] = ()) -> _Prepared:
        """Record the failed algorithms as unusable (cache and this session), solve again, warn once."""
        problem = prep.problem
        sizes = batch_sizes(self._policy, problem.n)
        if failures:  # did not build: so at every other size where it does not build either
            failures = [
                MicroConfig(algo, size, float("inf"), 0, reason=reason)
                for algo in dict.fromkeys(m.algo for m in failures)
                for size in sizes
                if (reason := self._backend.unsupported_reason(problem.with_batch(size), algo))
            ]
        else:  # failed while running: the plan's algorithms are suspect at every size
            failures = [
                MicroConfig(algo, size, float("inf"), 0, reason=f"failed to run: {one_line(exc)}")
                for algo in dict.fromkeys(m.algo for m in prep.config.micros)
                for size in sizes
            ]
        for m in failures:
            self._failed[problem.key, m.algo, m.batch] = m
        cache = self._open_cache()
        if cache is not None and not isinstance(exc, MemoryError):  # out of memory says nothing lasting
            cache.store(problem_key=problem.key, micros=failures, replace=True, **device_key(self._backend))
        if not self._warned_failure:
            self._warned_failure = True
            warnings.warn(
                PlanFailureWarning(
                    f"{', '.join(m.algo for m in failures)} could not run {problem.spec} ({problem.kind}): "
                    f"{failures[0].reason}; recorded as unusable and re-planned (later failures are not warned)"
                ),
                stacklevel=5,
            )
        self._prepared.clear()
        self._generation += 1  # Kernel objects holding the failed plan are stale
        if prep.budget is not None or self.mode == "WR":
            self._wr_plans.pop((problem.key, problem.n, self._wr_limit(prep.budget)), None)
            return _prepared(
                self._backend, problem, self._plan_wr(problem, fresh=True, budget=prep.budget).config, None, prep.budget
            )
        self._wd_plans.pop(problem.n, None)
        plans = self._solve_wd(problem.n, fresh=True)
        plan = next(plan for p, plan in plans.values() if p == problem)
        return _prepared(self._backend, problem, plan.config, plan.offset)
