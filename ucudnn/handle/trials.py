"""In-step trials: a kernel measured alone can win against torch's own convolution and lose inside a
training step, where caches and thread pools are shared; so a planned kernel takes turns with native
where the caller runs it, and the faster stays.

A trial times the calling thread's CPU time (`time.thread_time`), not wall time: it decides on 3 runs a
side, and on a loaded machine a run that waited for a core read 3-10x its work (a native dw of 6 ms
timed at 24-30 ms), which kept kernels that lose in the step. Both sides run on this thread (the CPU
backend's NumPy on one thread; torch's pool has this thread work its share), so on a quiet machine
it reads what wall time reads."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from ucudnn.backends.base import Backend
from ucudnn.backends.cpu import NATIVE
from ucudnn.handle.kernel import Turns, _Prepared, _prepared, _Trial, native_only
from ucudnn.solver.types import Configuration, MicroConfig

if TYPE_CHECKING:
    from ucudnn.problem import ConvProblem


class _Trials:
    """The Handle's trials (a mixin of `Handle`; `Handle(trial_runs=...)` asks for them)."""

    # the Handle's state it uses (`Handle.__init__` says what each is)
    _backend: Backend
    _trial_runs: int
    _call_overhead: float
    _trials_kept: set[tuple[str, int, Configuration]]
    _prepared: dict[tuple, _Prepared]
    _generation: int

    if TYPE_CHECKING:  # its planning's (`_Planning`) and launch's (`_Launching`)

        def _candidates(self, problem: ConvProblem) -> list[str]: ...

        def _run(
            self, prep: _Prepared, *, x: Any = None, w: Any = None, dy: Any = None, out: Any, alpha: float, beta: float
        ) -> None: ...

    def _with_trial(self, prep: _Prepared, limit: int | None) -> _Prepared:
        """`prep` with a trial against native undivided, where trials are asked for and native can
        run this problem within `limit` (the trial runs it)."""
        problem = prep.problem
        if (
            not self._trial_runs
            or native_only(prep.config)
            or NATIVE not in self._candidates(problem)
            or self._backend.unsupported_reason(problem, NATIVE) is not None
            or (problem.key, problem.n, prep.config) in self._trials_kept
        ):  # (a memory plan's budget asks
            return prep  # for it again: won already)
        workspace = self._backend.workspace_size(problem, NATIVE)
        if limit is not None and workspace > limit:
            return prep
        native = _prepared(
            self._backend, problem, Configuration((MicroConfig(NATIVE, problem.n, 0.0, workspace),)), None, prep.budget
        )
        return dataclasses.replace(prep, trial=_Trial(prep, native, Turns(self._trial_runs)))

    def _kept_within(self, problem, limit: int | None) -> Configuration | None:
        """The fastest configuration of `problem` that won its in-step trial and fits `limit`: a memory plan's
        budget that holds it runs it (solved again from measurements alone, the budget could pick another, even
        native, which lost that trial, and hold less than the plan charged)."""
        kept = [
            config
            for key, n, config in self._trials_kept
            if key == problem.key and n == problem.n and (limit is None or config.workspace <= limit)
        ]
        return min(kept, key=lambda config: config.time, default=None)

    def _run_trial(self, prep: _Prepared, trial: _Trial, **call: Any) -> None:
        """One run of a trial (see `trial_runs`): the plan and native take turns, the first run of
        each untimed (it is checked, and may re-plan); at the end native replaces the plan unless
        the plan's median won by more than the call overhead."""
        trial.turns.take(lambda: self._run(trial.planned, **call), lambda: self._run(trial.native, **call))
        if trial.open:
            return
        if trial.turns.first_won_by(self._call_overhead):
            self._trials_kept.add((prep.problem.key, prep.problem.n, prep.config))
        else:
            self._switch(prep, trial.native)

    def _switch(self, old: _Prepared, new: _Prepared) -> None:
        """Every call planned as `old` runs `new` from now on; kernels made before are stale."""
        for signature, prep in list(self._prepared.items()):
            if prep is old:
                self._prepared[signature] = new
        self._generation += 1
