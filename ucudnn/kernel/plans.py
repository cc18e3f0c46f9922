"""One kernel's plan as it is stored and compared: its cache key, its JSON, its undivided baseline, its front.

Shared by the handle (which plans one layer's kernels) and the network optimiser (which plans them all).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence

from ucudnn.backends.base import Backend
from ucudnn.kernel.measure import device_key, understated
from ucudnn.problem import ConvProblem
from ucudnn.solver import wr
from ucudnn.solver.types import Configuration, Infeasible, MicroConfig


def micro_to_json(m: MicroConfig) -> dict:
    """The JSON form of a micro-config, as in `ucudnn bench --json` and stored plans."""
    return {"algo": m.algo, "batch": m.batch, "time_ms": m.time, "workspace": m.workspace}


class DamagedPlan(ValueError):
    """A stored plan that breaks a rule a fresh one keeps; the message is the rule. Treated as no plan."""


def micro_from_json(d: object) -> MicroConfig:
    """The micro-config of a stored plan; DamagedPlan where a field is missing, mistyped or out of range."""
    from ucudnn.db.rows import micro_json_error  # where a plan is stored, the cache (SQLAlchemy) is loaded

    error = micro_json_error(d)
    if error:
        raise DamagedPlan(error)
    assert isinstance(d, dict)
    return MicroConfig(d["algo"], d["batch"], float(d["time_ms"]), d["workspace"])


def config_from_json(
    items: object, backend: Backend, problem: ConvProblem, algos: Sequence[str], limit: int | None
) -> Configuration:
    """A stored plan's configuration for `problem`, checked as a fresh one would be: fields, batches summing to
    the kernel's, known algorithms (`algos`), the workspace each needs, within `limit`. DamagedPlan otherwise."""
    from ucudnn.db.rows import config_json_error

    error = config_json_error(items, problem.n)
    if error:
        raise DamagedPlan(error)
    assert isinstance(items, list)
    config = Configuration(tuple(micro_from_json(d) for d in items))
    for m in config.micros:
        why = f"{m.algo!r:.80} is not among the algorithms {', '.join(algos)}" if m.algo not in algos else None
        why = why or understated(backend, problem, m)
        if why:
            raise DamagedPlan(why)
    if limit is not None and config.workspace > limit:
        raise DamagedPlan(f"the configuration needs {config.workspace} B of workspace, over the limit {limit} B")
    return config


def plan_key(backend: Backend, **parts) -> str:
    """A cache key for a solved plan: a hash of everything the plan was solved from."""
    text = json.dumps({**device_key(backend), **backend.settings(), **parts}, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def undivided_baseline(table: Mapping[int, Sequence[MicroConfig]], batch: int, limit: int | None) -> MicroConfig | None:
    """cuDNN-style selection: the fastest algorithm at the whole batch within the limit."""
    return wr.fastest_within({batch: table.get(batch, [])}, limit).get(batch)


def pareto_fronts(
    problems: Sequence[ConvProblem], tables, batch: int, total_workspace: int
) -> dict[str, list[Configuration]]:
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
