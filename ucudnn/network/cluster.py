"""Batch sizes for a heterogeneous cluster: each device's step time t[g,b], then the min-max assignment.

t[g,b] is the time of one training step's convolutions (forward, backward data, backward filter) of a
network at batch b on device g:

- **measured**, where the measurement cache holds the network's kernels for that device model: each
  kernel's WR optimum at b within the workspace limit (`ucudnn.solver.wr`, from the cached micro-batch
  measurements), summed over the network's kernels. This is the paper's route (§IV-C): every device
  benchmarks the network once (`ucudnn bench --network N`), the caches meet in one database.
- **estimated** otherwise, from a device profile (`ucudnn.devices`): the roofline time of each conv
  kernel from its FLOPs and the bytes of its operands (x, w, y) at b. This is a convolutions-only
  estimate; pooling, normalisation and the classifier are left out on both routes alike.

`best_batch_size(mb, gpus, network=...)` is the paper's Fig. 7 interface; `plan_cluster` gives the
same answer with the figures the CLI reports.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from ucudnn.devices import PROFILES, DeviceProfile, load_profile
from ucudnn.errors import InvalidInput
from ucudnn.kernel.measure import Policy, batch_sizes, parse_policy
from ucudnn.network.zoo import canonical_name, kernels
from ucudnn.problem import ConvProblem
from ucudnn.solver import cluster, wr
from ucudnn.solver.types import Infeasible, MicroConfig

__all__ = ["DEFAULT_WORKSPACE_LIMIT", "ClusterPlan", "DeviceStep", "best_batch_size", "candidate_sizes", "plan_cluster"]

# The paper's heterogeneous-cluster run used WR with 64 MiB per kernel (Table III).
DEFAULT_WORKSPACE_LIMIT = 64 * 2**20
# More candidate sizes than this per device and the sizes become multiples of a power of two (the
# paper: "reasonable to restrict b to be a multiple of a power of two"), which keeps a measured
# device's WR tables cheap; up to this batch every size is a candidate.
MAX_CANDIDATES = 64
_DTYPE_BYTES = {"float32": 4, "float64": 8, "float16": 2, "bfloat16": 2}


@dataclass(frozen=True, slots=True)
class DeviceStep:
    """One device of the cluster: its name, where its times come from, and its batch and time."""

    device: str
    source: str  # "measured: <model> (<backend>)" or "estimated: <profile> roofline"
    batch: int  # 0 = unused
    time_ms: float  # 0.0 when unused


@dataclass(frozen=True, slots=True)
class ClusterPlan:
    """The optimal split of a batch, with the two references the paper compares against."""

    network: str
    batch: int
    devices: tuple[DeviceStep, ...]
    makespan_ms: float
    best_single: DeviceStep | None  # the fastest device alone at the whole batch (None: none can)
    even: tuple[DeviceStep, ...]  # the batch split as evenly as possible over all devices
    candidate_sizes: tuple[int, ...]

    @property
    def even_makespan_ms(self) -> float:
        return max(d.time_ms for d in self.even)

    @property
    def speedup_vs_best_single(self) -> float:
        return self.best_single.time_ms / self.makespan_ms if self.best_single else math.inf

    @property
    def speedup_vs_even(self) -> float:
        return self.even_makespan_ms / self.makespan_ms

    def to_json(self) -> dict:
        def finite(x: float) -> float | None:  # JSON has no infinity
            return x if math.isfinite(x) else None

        def step(d: DeviceStep) -> dict:
            return {"device": d.device, "batch": d.batch, "time_ms": finite(d.time_ms), "source": d.source}

        return {
            "network": self.network,
            "batch": self.batch,
            "devices": [step(d) for d in self.devices],
            "makespan_ms": self.makespan_ms,
            "speedup_vs_best_single": finite(self.speedup_vs_best_single) if self.best_single else None,
            "speedup_vs_even": finite(self.speedup_vs_even),
            "best_single": step(self.best_single) if self.best_single else None,
            "even": {"devices": [step(d) for d in self.even], "makespan_ms": finite(self.even_makespan_ms)},
            "candidate_sizes": list(self.candidate_sizes),
        }


def candidate_sizes(batch: int) -> list[int]:
    """The batch sizes a device may get: 1..B, or multiples of the smallest power of two giving <= 64."""
    step = 1
    while batch // step > MAX_CANDIDATES:
        step *= 2
    return sorted(set(range(step, batch + 1, step)) | {batch})


def best_batch_size(
    mb: int,
    gpus: Sequence[str],
    *,
    network: str,
    db=None,
    policy: str | Policy = "powerOfTwo",
    workspace_limit: int | None = DEFAULT_WORKSPACE_LIMIT,
    sizes: Iterable[int] | None = None,
) -> list[int]:
    """One batch per entry of `gpus` (0 = unused), summing to `mb`, that minimises the slowest step.

    `gpus` names device models as stored in the measurement cache, or device profiles (`gk210`, `h100`,
    a JSON file); a name may repeat. `db` is the cache (a URL, a path, an open `ucudnn.db.Cache`, or
    None for the default cache). `policy` names the micro-batch sizes WR may use from the cached
    measurements, as in `ucudnn bench`; `sizes` the batches a device may get (default
    `candidate_sizes(mb)`). Raises `InvalidInput` for unknown devices or networks and `Infeasible`
    when no split exists.
    """
    return [
        d.batch
        for d in plan_cluster(
            mb, gpus, network=network, db=db, policy=policy, workspace_limit=workspace_limit, sizes=sizes
        ).devices
    ]


def plan_cluster(
    mb: int,
    gpus: Sequence[str],
    *,
    network: str,
    db=None,
    policy: str | Policy = "powerOfTwo",
    workspace_limit: int | None = DEFAULT_WORKSPACE_LIMIT,
    sizes: Iterable[int] | None = None,
) -> ClusterPlan:
    """`best_batch_size` with every figure: each device's time, the makespan and both references."""
    if not isinstance(mb, int) or isinstance(mb, bool) or mb < 1:
        raise InvalidInput(f"mb (the global batch) must be a positive integer, got {mb!r}")
    if isinstance(gpus, str) or not gpus or not all(isinstance(g, str) and g.strip() for g in gpus):
        raise InvalidInput(f"gpus must be a non-empty list of device names, got {gpus!r}")
    gpus = [g.strip() for g in gpus]
    if isinstance(policy, str):
        policy = parse_policy(policy)
    candidates = _check_sizes(sizes, mb) if sizes is not None else candidate_sizes(mb)
    network = canonical_name(network)
    net_kernels = kernels(network, 1, skip_first_bwd_data=True)

    models = _open_models(dict.fromkeys(gpus), net_kernels, db, policy, workspace_limit)
    tables = {name: model(candidates) for name, (_, model) in models.items()}
    # The solver needs distinct keys; the same model may stand for several devices.
    keyed = {f"{i}:{g}": tables[g] for i, g in enumerate(gpus)}
    chosen = cluster.best_batch_sizes(keyed, mb)

    def step(g: str, b: int, table: dict[int, float]) -> DeviceStep:
        return DeviceStep(g, models[g][0], b, table[b] if b else 0.0)

    devices = tuple(step(g, chosen[f"{i}:{g}"], tables[g]) for i, g in enumerate(gpus))
    singles = [step(g, mb, models[g][1]([mb])) for g in dict.fromkeys(gpus)]
    singles = [s for s in singles if math.isfinite(s.time_ms)]
    even_sizes = [mb // len(gpus) + (1 if i < mb % len(gpus) else 0) for i in range(len(gpus))]
    even = tuple(step(g, b, models[g][1]([b]) if b else {}) for g, b in zip(gpus, even_sizes))
    return ClusterPlan(
        network=network,
        batch=mb,
        devices=devices,
        makespan_ms=cluster.makespan(keyed, chosen),
        best_single=min(singles, key=lambda s: s.time_ms, default=None),
        even=even,
        candidate_sizes=tuple(candidates),
    )


def _check_sizes(sizes: Iterable[int], mb: int) -> list[int]:
    out = sorted(set(sizes))
    if not out or any(not isinstance(b, int) or isinstance(b, bool) or not 1 <= b <= mb for b in out):
        raise InvalidInput(f"sizes must be batch sizes between 1 and mb={mb}, got {out}")
    return out


# ---- t[g, b]: one function per device name, sizes -> {size: ms} (inf where the device cannot run b) ----

TimeModel = Callable[[Iterable[int]], dict[int, float]]


def _open_models(
    names: Iterable[str], net_kernels, db, policy: Policy, workspace_limit: int | None
) -> dict[str, tuple[str, TimeModel]]:
    """Each distinct device name's (source, time model): measured where the cache has it, else a profile."""
    from ucudnn.db import Cache, default_url

    if db is None and _missing_sqlite_file(default_url()):  # no cache yet: every device from its profile
        return {name: _profile_model(name, net_kernels, default_url(), []) for name in names}
    cache = db if isinstance(db, Cache) else Cache(db, readonly=True)
    try:
        facts = cache.info()
        identities = facts["by_device"]
        out = {}
        for name in names:
            measured = _measured_model(cache, identities, name, net_kernels, policy, workspace_limit)
            out[name] = (
                measured
                if measured is not None
                else _profile_model(name, net_kernels, facts["url"], [d["device"] for d in identities])
            )
        return out
    finally:
        if cache is not db:
            cache.close()


def _unknown_device(name: str, url: str, cached: list[str]) -> InvalidInput:
    """A device that is neither in the cache nor a profile: say both places looked in."""
    held = ", ".join(repr(d) for d in dict.fromkeys(cached)) or "no device"
    return InvalidInput(
        f"unknown device {name!r}: the measurement cache {url} holds {held} (`ucudnn bench` on a "
        f"device puts it there), and the profiles are {', '.join(PROFILES)} (or a profile's JSON file)"
    )


def _missing_sqlite_file(url: str) -> bool:
    """A default cache that is a SQLite file not created yet (a URL or, as $UCUDNN_DB may be, a path)."""
    if "://" not in url:
        return not Path(url).expanduser().exists()
    return url.startswith("sqlite:///") and not Path(url.removeprefix("sqlite:///")).exists()


def _measured_model(
    cache, identities: list[dict], name: str, net_kernels, policy: Policy, workspace_limit: int | None
) -> tuple[str, TimeModel] | None:
    """The WR step time from cached measurements, or None when the cache has no complete set for `name`."""
    model_name = PROFILES[name.lower()].model if name.lower() in PROFILES else name
    matches = [d for d in identities if d["device"] in (name, model_name) and d["measurements"]]
    # The identity (backend, library versions) with the most measurements stands for the model.
    for ident in sorted(matches, key=lambda d: (-d["measurements"], d["backend"], d["versions"])):
        tables = {}
        for _, problem in net_kernels:
            if problem.key not in tables:
                found = cache.lookup(
                    device=ident["device"],
                    backend=ident["backend"],
                    versions=ident["versions"],
                    problem_key=problem.key,
                    batches=None,
                )
                if not found:
                    break
                tables[problem.key] = _bench_table(found)
        else:
            source = f"measured: {ident['device']} ({ident['backend']})"
            return source, _wr_model(tables, [p for _, p in net_kernels], policy, workspace_limit)
    if matches and name.lower() not in PROFILES:
        raise InvalidInput(
            f"the cache holds measurements of {name!r} but not of every kernel of the network; "
            f"run `ucudnn bench --network ...` on that device, or name a device profile"
        )
    return None


def _bench_table(found: dict[tuple[str, int], MicroConfig]) -> dict[int, list[MicroConfig]]:
    table: dict[int, list[MicroConfig]] = {}
    for (_, size), m in sorted(found.items()):
        table.setdefault(size, []).append(m)
    return table


def _wr_model(
    tables: dict[str, dict[int, list[MicroConfig]]],
    problems: list[ConvProblem],
    policy: Policy,
    workspace_limit: int | None,
) -> TimeModel:
    def times(sizes: Iterable[int]) -> dict[int, float]:
        out = {}
        for b in sizes:
            allowed = set(batch_sizes(policy, b))
            per_key = {}
            try:
                for key, table in tables.items():
                    sub = {s: ms for s, ms in table.items() if s in allowed}
                    per_key[key] = wr.solve(sub, b, workspace_limit).time
            except Infeasible:  # no division of b into measured sizes fits: this device cannot take b
                out[b] = math.inf
                continue
            out[b] = sum(per_key[p.key] for p in problems)
        return out

    return times


def _profile_model(name: str, net_kernels, url: str, cached: list[str]) -> tuple[str, TimeModel]:
    if name.lower() not in PROFILES and not name.endswith(".json") and not Path(name).exists():
        raise _unknown_device(name, url, cached)
    profile: DeviceProfile = load_profile(name)
    # Per kernel: FLOPs and activation bytes per sample, weight bytes per step (x, w read; y written).
    per_kernel = []
    for _, p in net_kernels:
        one = p.with_batch(1)
        nbytes = _DTYPE_BYTES[p.dtype]
        activations = (math.prod(one.x_shape) + math.prod(one.y_shape)) * nbytes
        per_kernel.append((one.flops, activations, math.prod(one.w_shape) * nbytes))

    def times(sizes: Iterable[int]) -> dict[int, float]:
        return {
            b: sum(profile.roofline_ms(b * flops, b * act + weights) for flops, act, weights in per_kernel)
            for b in sizes
        }

    return f"estimated: {profile.name} roofline", times
