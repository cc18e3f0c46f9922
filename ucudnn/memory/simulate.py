"""The event simulator: one training step on one or more devices, with copy streams and an allocator.

How a policy drives it. A policy is a module with one function
``plan(graph, device, memory_limit, *, devices=1, db=None, ...) -> MemoryPlan``. It decides, per
storage of the graph (`TrainingGraph.storages`), an action (`keep`, `offload`, `recompute`,
`release`; see `ucudnn.memory.plan.ACTIONS`) and, per conv kernel, a workspace budget; takes each
step's time and workspace from `ucudnn.memory.timing.step_costs`; runs `simulate` on them (as often
as its search needs); and turns the last result into a `MemoryPlan` with `ucudnn.memory.planner.to_plan`.
Every policy goes through this one simulator, so their figures compare.

What is simulated, per device:

- **The compute stream** runs the steps of `expand(graph, actions)` in order: the forward steps, then
  the backward steps with recomputation inserted (a `recompute` storage is rebuilt, from its
  producing ops' forward steps, right before the first step that reads it again; storages it needs
  that are themselves `recompute` are rebuilt first and kept until their own backward use).
  A step starts when the step before it has ended, everything it reads is resident, and its new
  tensors and workspace fit; time spent waiting is *stall*.
- **Two copy streams**, device-to-host and host-to-device, each running its copies one after another.
  An `offload` storage is copied out after its last forward writer ends; the step after its last
  forward reader waits for that copy, and the storage is freed (vDNN synchronises its memory stream
  at the end of a layer; `ucudnn.torch.execute_plan` makes the compute stream wait for the copy's
  event, as the GPU's allocator can hand the memory out in stream order only then). It is copied
  back at a prefetch trigger (`prefetch`, below), allocated when its copy starts (or, under
  ``"ahead"``, when it is issued, as the executor's copy back is), and the step that reads it waits
  for the copy.
- **Bandwidth** comes from the `DeviceProfile`: a copy alone on its link gets the direction's
  bandwidth; while both directions copy, each gets half the duplex figure; copies of several devices
  on one link (`devices_per_link`) share it equally (a fluid model: rates change whenever a copy
  starts or ends).
- **The allocator** holds weights for the whole step, weight gradients as the graph's `weight_grads`
  says (the whole step, or from their first backward write), each feature map from its first writer
  to its last reader (per life: an offloaded or recomputed storage has two), each gradient buffer as
  autograd holds it and what an op saves beyond feature maps (`ucudnn.memory.gradients`), and a conv
  step's workspace while it runs. With
  a `memory_limit`, an allocation that does not fit waits for pending offloads to free memory; when
  nothing can free any, it goes ahead and the result records the overflow (`fits` is False).

`prefetch` says when a copy back starts: ``"layer"`` (vDNN: at the start of the last conv or
linear backward step before its first use), ``"adaptive"`` (the latest step from which the compute
left before the use is at least the copy's time alone on the link; Kim et al.'s trigger),
``"ahead"`` (`ucudnn.torch.execute_plan`'s rule: at the model's first backward step and at each
backward step that unpacks an offloaded or recomputed map, every map used by then and the next one
are issued; each holds its memory from its issue, whatever the limit), or a mapping from storage to
the index, in the expanded schedule, of the step at whose start it begins; or a sequence of these,
one per device (each device sets its own triggers from its own timings). The policies time their
copies by their own triggers; the figures of a plan for a PyTorch model are its step under
``"ahead"`` (`ucudnn.memory.planner.as_executed`).

`simulate_bounded` also says at which limits its answer holds (`Bounded`), for `ucudnn.memory.reuse.PlanCache`. A
plan that copies nothing, its devices alike, runs each device's steps in a row, without the event loop.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from ucudnn.devices import DeviceProfile
from ucudnn.errors import InvalidInput
from ucudnn.memory.gradients import gradient_lives
from ucudnn.memory.graph import TrainingGraph
from ucudnn.memory.plan import ACTIONS
from ucudnn.memory.prefetch import ahead, trigger
from ucudnn.memory.sim_types import Bounded, DeviceResult, Interval, SimResult, SimStep, StepCost

__all__ = [
    "Bounded",
    "DeviceResult",
    "Interval",
    "SimResult",
    "SimStep",
    "StepCost",
    "expand",
    "network_wide_bytes",
    "simulate",
    "simulate_bounded",
]

_GB = 1e9
_EPS_MS = 1e-9


def _check_actions(graph: TrainingGraph, actions: Mapping[str, str] | None) -> dict[str, str]:
    out = {s: "keep" for s in graph.storages}
    for name, action in (actions or {}).items():
        if name not in out:
            raise InvalidInput(f"action for {name!r}: not a storage of graph {graph.network!r}")
        if action not in ACTIONS:
            raise InvalidInput(f"action for {name!r} must be one of {', '.join(ACTIONS)}, got {action!r}")
        out[name] = action
    backward = {r for s in graph.steps if s.phase == "bwd" for r in s.reads}
    for name, action in out.items():
        if action == "release" and name in backward:
            raise InvalidInput(f"{name!r} cannot be released: the backward pass reads it (offload or recompute it)")
        if action == "recompute" and graph.op(name).type == "input":
            raise InvalidInput(f"{name!r} is the input: it cannot be recomputed (keep or offload it)")
        if action in ("offload", "recompute") and graph.captured is not None and name in graph.captured.pinned:
            raise InvalidInput(
                f"{name!r} is kept by every plan (the program holds it, or only its operation makes it): keep it"
            )
    return out


def expand(graph: TrainingGraph, actions: Mapping[str, str] | None = None) -> tuple[SimStep, ...]:
    """The compute stream's schedule: forward steps, then backward steps with recomputation inserted."""
    acts = _check_actions(graph, actions)
    steps = graph.steps
    nf = graph.forward_steps
    out = [SimStep(s.index, s.op, "fwd", s.reads, s.writes) for s in steps[:nf]]
    rebuilt: set[str] = set()

    def rebuild(storage: str) -> None:
        # the storage's producing ops run forward again; inputs that are recomputed are rebuilt first
        producers = graph.producers(storage)
        for op in producers:
            for i in op.inputs:
                src = graph.storage_of(i)
                # a source that is not resident (recomputed or released) is rebuilt first
                if src != storage and acts[src] in ("recompute", "release") and src not in rebuilt:
                    rebuild(src)
        rebuilt.add(storage)
        for op in producers:
            fwd = steps[graph.op_index[op.name]]
            out.append(SimStep(fwd.index, fwd.op, "recompute", fwd.reads, fwd.writes))

    for s in steps[nf:]:
        for r in s.reads:
            if acts.get(r) == "recompute" and r not in rebuilt:
                rebuild(r)
        out.append(SimStep(s.index, s.op, "bwd", s.reads, s.writes))
    return tuple(out)


def network_wide_bytes(graph: TrainingGraph, workspace: int = 0) -> int:
    """vDNN's baseline: every feature map and gradient allocated for the whole step, plus weights,
    weight gradients and the largest conv workspace."""
    grads = sum(t.bytes for t in graph.tensors.values() if t.kind == "gradient")
    return graph.feature_map_bytes + grads + 2 * graph.weight_bytes + workspace


# ---- lives: when each tensor is allocated and freed on the expanded schedule ---------------------------------
@dataclass(slots=True)
class _Plan:
    """Per device: what the event loop needs, prepared once."""

    sched: tuple[SimStep, ...]
    ms: list[float]
    workspace: list[int]
    alloc_at: dict[int, list[tuple[str, int]]]  # step -> tensors allocated at its start
    free_after: dict[int, list[str]]  # step -> tensors freed at its end
    offload_after: dict[int, list[str]]  # step -> storages whose copy out starts at its end
    offload_free_at: dict[int, list[str]]  # step -> offloaded storages it is the last forward reader of
    prefetches: list[tuple[int, int, str]]  # (trigger step, first use step, storage)
    waits_for: dict[int, list[str]]  # step -> prefetched storages it needs
    nbytes: dict[str, int]
    persistent: int
    allocate_at_issue: bool  # a copy back holds its memory from its trigger (else: its start)
    steps: int  # len(sched)
    workspace_label: list[str]  # each step's workspace, as the allocation trace names it


def _prepare(
    graph: TrainingGraph, costs: Sequence[StepCost], actions: Mapping[str, str] | None, device: DeviceProfile, prefetch
) -> _Plan:
    acts = _check_actions(graph, actions)
    sched = expand(graph, acts)
    nbytes = {name: t.bytes for name, t in graph.tensors.items() if t.kind in ("feature", "gradient")}
    nf = graph.forward_steps
    first_write: dict[str, int] = {}
    last_use: dict[str, int] = {}
    last_fwd_use: dict[str, int] = {}
    last_fwd_write: dict[str, int] = {}
    first_late_use: dict[str, int] = {}  # first use after the forward pass (recompute or backward)
    rebuilt_at: dict[str, int] = {}
    for k, s in enumerate(sched):
        for name in s.writes:
            if s.phase == "recompute":
                rebuilt_at.setdefault(name, k)
            first_write.setdefault(name, k)
            if k < nf:
                last_fwd_write[name] = k
        for name in (*s.reads, *s.writes):
            last_use[name] = k
            if k < nf:
                last_fwd_use[name] = k
        if k >= nf:
            for name in s.reads:
                if name not in rebuilt_at or rebuilt_at[name] > k:
                    first_late_use.setdefault(name, k)
    alloc_at: dict[int, list[tuple[str, int]]] = {}
    free_after: dict[int, list[str]] = {}
    offload_after: dict[int, list[str]] = {}
    offload_free_at: dict[int, list[str]] = {}
    prefetches: list[tuple[int, int, str]] = []
    waits_for: dict[int, list[str]] = {}
    # a recompute step costs its op's forward time and what running it again costs the host (`replay_host_ms`)
    ms = [costs[s.step].ms + (graph.replay_host_ms if s.phase == "recompute" else 0.0) for s in sched]
    for name, k in first_write.items():
        if name not in nbytes or name.startswith("grad:"):
            continue  # weight gradients: persistent, or below; gradients: below
        action = acts.get(name, "keep")
        alloc_at.setdefault(k, []).append((name, nbytes[name]))
        if action == "keep":
            free_after.setdefault(last_use[name], []).append(name)
        elif action in ("release", "recompute"):
            free_after.setdefault(last_fwd_use[name], []).append(name)
            if name in rebuilt_at:
                alloc_at.setdefault(rebuilt_at[name], []).append((name, nbytes[name]))
                free_after.setdefault(last_use[name], []).append(name)
        elif action == "offload":
            offload_after.setdefault(last_fwd_write[name], []).append(name)
            offload_free_at.setdefault(last_fwd_use[name], []).append(name)
            if name in first_late_use:
                use = first_late_use[name]
                prefetches.append((trigger(sched, ms, use, name, nbytes[name], device, prefetch), use, name))
                waits_for.setdefault(use, []).append(name)
                free_after.setdefault(last_use[name], []).append(name)
    for label, b, start, end in gradient_lives(graph, sched):
        nbytes[label] = b
        alloc_at.setdefault(start, []).append((label, b))
        free_after.setdefault(end, []).append(label)
    if prefetch == "ahead":
        at = ahead(graph, sched, {name: use for _, use, name in prefetches})
        prefetches = [(at[name], use, name) for _, use, name in prefetches]
    prefetches.sort()
    persistent = graph.persistent_bytes
    workspace = [costs[s.step].workspace for s in sched]
    return _Plan(
        sched,
        ms,
        workspace,
        alloc_at,
        free_after,
        offload_after,
        offload_free_at,
        prefetches,
        waits_for,
        nbytes,
        persistent,
        prefetch == "ahead",
        len(sched),
        [f"workspace:{s.op}" for s in sched],
    )


# ---- the event loop ----------------------------------------------------------------------------------------
@dataclass(slots=True)
class _Copy:
    device: int
    direction: str  # "h2d" or "d2h"
    name: str
    remaining: float  # bytes
    total: int
    start_ms: float


class _Device:
    """One device's mutable state during a simulation."""

    def __init__(self, index: int, plan: _Plan, limit: int | None) -> None:
        self.index = index
        self.p = plan
        self.limit = limit
        self.next = 0  # next step of the compute stream
        self.running: int | None = None  # step running, and when it ends
        self.ends_at = 0.0
        self.idle_since = 0.0
        self.stall = 0.0
        self.recompute_ms = 0.0
        self.used = plan.persistent
        self.peak = self.used
        self.top = 0  # the most in use after any allocation or free (what `overflow` is judged on)
        self.overflow = False
        # the limits this run's course holds for: each check that passed asked for `passed` bytes at most and each
        # that failed for `failed` at least, so any limit from `passed` up to below `failed` runs the same course
        self.passed = 0
        self.failed = math.inf
        self.memory: list[tuple[float, int]] = [(0.0, self.used)]
        self.resident: dict[str, int] = {}
        self.pending_free: set[str] = set()  # offloaded, freed when their copy out ends
        self.offloaded: set[str] = set()  # copy out finished (a host copy exists)
        self.d2h_queue: list[str] = []
        self.h2d_queue: list[str] = []  # issued prefetches, FIFO
        self.h2d_done: set[str] = set()
        self.d2h: _Copy | None = None
        self.h2d: _Copy | None = None
        self.trigger_pos = 0  # next prefetch (plan.prefetches) to issue
        self.bytes_offloaded = 0
        self.bytes_prefetched = 0
        self.done_at = 0.0
        self.missing: list[str] = []
        self.events: list[tuple[float, str, int]] = []

    def set_used(self, t: float, delta: int, name: str) -> None:
        self.used += delta
        self.events.append((t, name, delta))
        if self.used > self.top:
            self.top = self.used
            self.peak = max(self.peak, self.used)
            if self.limit is not None and self.used > self.limit:
                self.overflow = True
        if self.memory[-1][0] == t:
            self.memory[-1] = (t, self.used)
        else:
            self.memory.append((t, self.used))

    def fits(self, extra: int) -> bool:
        need = self.used + extra
        if self.limit is None or need <= self.limit:
            self.passed = max(self.passed, need)
            return True
        self.failed = min(self.failed, need)
        return False

    def can_free_soon(self) -> bool:
        """Memory will come back without the compute stream moving: an offload still copying out."""
        return bool(self.pending_free) and (self.d2h is not None or bool(self.d2h_queue))

    def step_needs(self, k: int) -> int:
        p = self.p
        return sum(b for name, b in p.alloc_at.get(k, ()) if name not in self.resident) + p.workspace[k]


def simulate(
    graph: TrainingGraph,
    device: DeviceProfile,
    costs: Sequence[StepCost],
    actions: Mapping[str, str] | Sequence[Mapping[str, str]] | None = None,
    **options,
) -> SimResult:
    """Simulate one training step of `graph` on `devices` copies of `device` (data parallel: the same
    steps; `actions` is one mapping for all, or one per device, and so is `prefetch`). See the module docstring;
    `options` are `simulate_bounded`'s: memory_limit, prefetch, devices, devices_per_link, timeline."""
    return simulate_bounded(graph, device, costs, actions, **options).result


def simulate_bounded(
    graph: TrainingGraph,
    device: DeviceProfile,
    costs: Sequence[StepCost],
    actions: Mapping[str, str] | Sequence[Mapping[str, str]] | None = None,
    *,
    memory_limit: int | None = None,
    prefetch="layer",
    devices: int = 1,
    devices_per_link: int | None = None,
    timeline: bool = True,
) -> Bounded:
    """`simulate`, with the limits its result holds for (`Bounded`). `memory_limit`: bytes per device (None: no
    limit); `prefetch`: when copies back start (the module docstring); `devices_per_link`: devices sharing one host
    link (default: the profile's); `timeline`: whether the result holds each stream's intervals."""
    if not isinstance(devices, int) or isinstance(devices, bool) or devices < 1:
        raise InvalidInput(f"devices must be a positive integer, got {devices!r}")
    if len(costs) != len(graph.steps):
        raise InvalidInput(f"costs: {len(costs)} entries for {len(graph.steps)} steps of {graph.network!r}")
    if memory_limit is not None and (not isinstance(memory_limit, int) or memory_limit <= 0):
        raise InvalidInput(f"memory_limit must be a positive number of bytes, got {memory_limit!r}")
    per_device = (
        list(actions)
        if isinstance(actions, Sequence) and not isinstance(actions, (str, Mapping))
        else [actions] * devices
    )
    if len(per_device) != devices:
        raise InvalidInput(f"actions: {len(per_device)} mappings for {devices} devices")
    per_prefetch = (
        list(prefetch) if isinstance(prefetch, Sequence) and not isinstance(prefetch, str) else [prefetch] * devices
    )
    if len(per_prefetch) != devices:
        raise InvalidInput(f"prefetch: {len(per_prefetch)} entries for {devices} devices")
    share = devices_per_link if devices_per_link is not None else device.devices_per_link
    if not isinstance(share, int) or share < 1:
        raise InvalidInput(f"devices_per_link must be a positive integer, got {share!r}")
    plans = {}
    devs = []
    for d, (acts, trig) in enumerate(zip(per_device, per_prefetch)):
        key = (id(acts), id(trig))  # devices given the same objects share one preparation
        if key not in plans:
            plans[key] = _prepare(graph, costs, acts, device, trig)
        devs.append(_Device(d, plans[key], memory_limit))
    intervals: list[Interval] = []
    t = 0.0

    def try_start_compute(dv: _Device, force: bool = False) -> bool:
        p = dv.p
        k = dv.next
        if dv.running is not None or k >= p.steps or dv.pending_free:
            return False  # (an offloaded storage past its last reader: the compute stream waits for its copy)
        # the prefetches this step triggers queue on the copy stream as soon as it is next
        while dv.trigger_pos < len(p.prefetches) and p.prefetches[dv.trigger_pos][0] <= k:
            name = p.prefetches[dv.trigger_pos][2]
            dv.h2d_queue.append(name)
            dv.trigger_pos += 1
            if p.allocate_at_issue and name not in dv.resident:
                dv.resident[name] = p.nbytes[name]
                dv.set_used(t, p.nbytes[name], name)
        for name in p.waits_for.get(k, ()):
            if name not in dv.h2d_done:
                return False
        need = dv.step_needs(k)
        if not dv.fits(need) and not force:
            return False
        if t > dv.idle_since:
            dv.stall += t - dv.idle_since
        resident = dv.resident
        for name, b in p.alloc_at.get(k, ()):
            if name not in resident:
                resident[name] = b
                dv.set_used(t, b, name)
        if p.workspace[k]:
            dv.set_used(t, p.workspace[k], p.workspace_label[k])
        # the invariant every plan must keep: what a step reads is on the device when it starts
        for name in p.sched[k].reads:
            if name not in resident and not name.startswith("grad:"):  # gradients: by construction
                s = p.sched[k]
                dv.missing.append(f"{k} {s.phase} {s.op}: {name}")
        dv.running = k
        dv.ends_at = t + p.ms[k]
        return True

    def finish_compute(dv: _Device) -> None:
        p = dv.p
        k = dv.running
        assert k is not None
        s = p.sched[k]
        if timeline:
            stream = "recompute" if s.phase == "recompute" else "compute"
            intervals.append(Interval(dv.index, stream, t - p.ms[k], t, f"{s.phase} {s.op}"))
        if s.phase == "recompute":
            dv.recompute_ms += p.ms[k]
        if p.workspace[k]:
            dv.set_used(t, -p.workspace[k], p.workspace_label[k])
        for name in p.offload_after.get(k, ()):
            dv.d2h_queue.append(name)
        for name in p.free_after.get(k, ()):
            if name in dv.resident:
                dv.set_used(t, -dv.resident.pop(name), name)
        for name in p.offload_free_at.get(k, ()):
            if name in dv.resident:
                if name in dv.offloaded:
                    dv.set_used(t, -dv.resident.pop(name), name)
                else:
                    dv.pending_free.add(name)
        dv.running = None
        dv.next = k + 1
        dv.idle_since = t
        dv.done_at = t

    def try_start_copies(dv: _Device, force: bool = False) -> bool:
        started = False
        if dv.d2h is None and dv.d2h_queue:
            name = dv.d2h_queue.pop(0)
            dv.d2h = _Copy(dv.index, "d2h", name, dv.p.nbytes[name], dv.p.nbytes[name], t)
            started = True
        if dv.h2d is None and dv.h2d_queue:
            name = dv.h2d_queue[0]
            b = dv.p.nbytes[name]
            # a prefetch leaves room for the next step's own allocations unless that step waits for it
            k = dv.next
            reserve = 0
            if dv.running is None and k < dv.p.steps and name not in dv.p.waits_for.get(k, ()):
                reserve = dv.step_needs(k)
            if name in dv.offloaded and (dv.p.allocate_at_issue or dv.fits(b + reserve) or force):
                dv.h2d_queue.pop(0)
                if name not in dv.resident:
                    dv.resident[name] = b
                    dv.set_used(t, b, name)
                dv.h2d = _Copy(dv.index, "h2d", name, b, b, t)
                started = True
        return started

    def copy_rate(direction: str, both: bool) -> float:  # bytes per ms of one device's copy, as `rates` has it
        return (device.duplex_gbps / 2 if both else getattr(device, f"{direction}_gbps")) * _GB / 1e3 / 1

    single = {(d, both): copy_rate(d, both) for d in ("h2d", "d2h") for both in (False, True)}

    def rates(active: list[_Copy]) -> list[float]:
        """Bytes per ms of each active copy (fluid sharing of each link)."""
        if len(devs) == 1:  # one device: at most one copy each way
            both = len(active) == 2
            return [single[(c.direction, both)] for c in active]
        by_link: dict[int, list[_Copy]] = {}
        for c in active:
            by_link.setdefault(c.device // share, []).append(c)
        out = {}
        for group in by_link.values():
            h2d = [c for c in group if c.direction == "h2d"]
            d2h = [c for c in group if c.direction == "d2h"]
            both = bool(h2d) and bool(d2h)
            for copies, alone in ((h2d, device.h2d_gbps), (d2h, device.d2h_gbps)):
                gbps = device.duplex_gbps / 2 if both else alone
                for c in copies:
                    out[id(c)] = gbps * _GB / 1e3 / len(copies)
        return [out[id(c)] for c in active]

    def finish_copy(c: _Copy) -> None:
        dv = devs[c.device]
        if timeline:
            intervals.append(Interval(c.device, c.direction, c.start_ms, t, c.name))
        if c.direction == "d2h":
            dv.d2h = None
            dv.offloaded.add(c.name)
            dv.bytes_offloaded += dv.p.nbytes[c.name]
            if c.name in dv.pending_free:
                dv.pending_free.discard(c.name)
                dv.set_used(t, -dv.resident.pop(c.name), c.name)
        else:
            dv.h2d = None
            dv.h2d_done.add(c.name)
            dv.bytes_prefetched += dv.p.nbytes[c.name]

    alike = len(plans) == 1  # every device given the same plan: they run alike
    copies = not alike or bool(devs[0].p.offload_after)
    if not copies:
        # nothing is copied: steps run one after another, one that does not fit at once (nothing can free memory)
        for dv in devs:
            t = 0.0
            for _ in range(dv.p.steps):
                try_start_compute(dv, force=True)
                t = dv.ends_at
                finish_compute(dv)
    else:
        while True:
            progress = True
            while progress:
                progress = False
                for dv in devs:  # the compute stream allocates first: a prefetch must not starve it
                    progress |= try_start_compute(dv)
                    progress |= try_start_copies(dv)
            if all(
                dv.next >= dv.p.steps and dv.running is None and dv.d2h is None and dv.h2d is None and not dv.d2h_queue
                for dv in devs
            ):
                break
            active = [c for dv in devs for c in (dv.d2h, dv.h2d) if c is not None]
            running = [dv for dv in devs if dv.running is not None]
            if not active and not running:
                # nothing in flight can free memory: the blocked allocation goes over the limit
                forced = False
                for dv in devs:
                    p = dv.p
                    k = dv.next
                    waiting = [n for n in p.waits_for.get(k, ()) if n not in dv.h2d_done]
                    if waiting and dv.h2d is None and dv.h2d_queue:
                        forced |= try_start_copies(dv, force=True)
                    elif not waiting:
                        forced |= try_start_compute(dv, force=True)
                if not forced:
                    raise AssertionError("simulator deadlock: a prefetch was never issued before its use")
                continue
            r = rates(active)
            t_next = min([dv.ends_at for dv in running] + [t + c.remaining / rate for c, rate in zip(active, r)])
            dt = t_next - t
            for c, rate in zip(active, r):
                c.remaining -= rate * dt
            t = t_next
            for c in active:
                if c.remaining <= 1e-9 * c.total + 1e-6:
                    finish_copy(c)
            for dv in running:
                if dv.ends_at <= t + _EPS_MS:
                    finish_compute(dv)

    results = []
    for dv in devs:
        end = max(dv.done_at, mem_end := dv.memory[-1][0])
        mem = dv.memory
        area = sum((mem[i + 1][0] - mem[i][0]) * mem[i][1] for i in range(len(mem) - 1))
        area += (end - mem_end) * mem[-1][1]
        average = int(area / end) if end > 0 else dv.used
        results.append(
            DeviceResult(
                dv.peak,
                average,
                end,
                dv.stall,
                dv.bytes_offloaded,
                dv.bytes_prefetched,
                dv.recompute_ms,
                dv.overflow,
                tuple(dv.missing),
                tuple(mem),
                tuple(dv.events),
            )
        )
    result = SimResult(
        memory_limit=memory_limit,
        timeline=tuple(sorted(intervals, key=lambda i: (i.device, i.start_ms))),
        devices=tuple(results),
        schedule=tuple(dv.p.sched for dv in devs),
        costs=tuple(costs),
    )
    tops = tuple(dv.top for dv in devs)
    if not copies:
        # no copies, and the devices alike: an allocation that does not fit goes ahead at once (nothing in flight
        # can free memory), as one that fits does, so every limit runs this course
        return Bounded(result, 0, math.inf, tops)
    return Bounded(result, max(dv.passed for dv in devs), min(dv.failed for dv in devs), tops)
