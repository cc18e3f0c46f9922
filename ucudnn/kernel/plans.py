"""One kernel's plan as it is stored and compared: its cache key, its JSON, its undivided baseline, its front.

Shared by the handle (which plans one layer's kernels) and the network optimiser (which plans them all).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence

from ucudnn.backends.base import Backend
from ucudnn.kernel.measure import device_key
from ucudnn.problem import ConvProblem
from ucudnn.solver import wr
from ucudnn.solver.types import Configuration, Infeasible, MicroConfig


def micro_to_json(m: MicroConfig) -> dict:
    """The JSON form of a micro-config, as in `ucudnn bench --json` and stored plans."""
    return {"algo": m.algo, "batch": m.batch, "time_ms": m.time, "workspace": m.workspace}


def micro_from_json(d: Mapping) -> MicroConfig:
    return MicroConfig(d["algo"], int(d["batch"]), float(d["time_ms"]), int(d["workspace"]))


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
