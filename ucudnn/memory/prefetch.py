"""When a copy back starts: the policies' prefetch triggers and the executor's (`ucudnn.memory.simulate`'s
``prefetch``), as the index of the step, in the simulator's expanded schedule (`sched`: its `SimStep`s), at whose
start it is issued."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from ucudnn.devices import DeviceProfile
from ucudnn.errors import InvalidInput
from ucudnn.memory.graph import TrainingGraph

__all__ = ["ahead", "trigger"]


def trigger(
    sched: Sequence, ms: Sequence[float], use: int, name: str, nbytes: int, device: DeviceProfile, prefetch
) -> int:
    """The step at which the copy back of storage `name` (`nbytes`, first used at step `use`) starts: see
    `ucudnn.memory.simulate` for the values of `prefetch`."""
    if prefetch == "ahead":
        return use  # (set with the others': `ahead`)
    if isinstance(prefetch, Mapping):
        if name in prefetch:
            at = int(prefetch[name])
            if not 0 <= at <= use:
                raise InvalidInput(f"prefetch of {name!r} at step {at}: must be between 0 and its use at {use}")
            return at
        prefetch = "layer"
    if prefetch == "layer":
        for k in range(use - 1, -1, -1):
            if sched[k].phase == "bwd" and any(w.startswith("wgrad:") for w in sched[k].writes):
                return k
        return max(use - 1, 0)
    if prefetch == "adaptive":
        need = device.copy_ms(nbytes, "h2d")
        left = 0.0
        for k in range(use - 1, -1, -1):
            left += ms[k]
            if left >= need or sched[k].phase == "fwd":
                return k
        return 0
    raise InvalidInput(
        f"prefetch must be 'layer', 'adaptive', 'ahead' or a mapping of storage to step, got {prefetch!r}"
    )


def ahead(graph: TrainingGraph, sched: Sequence, uses: Mapping[str, int]) -> dict[str, int]:
    """`ucudnn.torch.execute_plan`'s prefetch triggers (`_OffloadHooks.reached`, one map ahead): it looks at
    the start of the model's first backward step and wherever a backward step unpacks an offloaded or
    recomputed map (before that step's recomputation, which unpacks it); there it issues every map used by
    then and the next one. `uses`: each offloaded map's first use after the forward pass."""
    nf = graph.forward_steps
    late = set(uses) | {w for s in sched if s.phase == "recompute" for w in s.writes}
    points = []  # (the step at whose start the executor looks, the backward step it looks for)
    model_started = False
    for k in range(nf, len(sched)):
        s = sched[k]
        if s.phase != "bwd":
            continue
        start = k
        while start > nf and sched[start - 1].phase == "recompute":
            start -= 1
        first = not model_started and not (s.op.startswith("loss:") or graph.op(s.op).type == "loss")
        model_started |= first
        if first or any(r in late for r in s.reads):
            points.append((start, k))
    order = sorted(uses, key=lambda name: uses[name])
    at: dict[str, int] = {}
    i = 0
    for start, k in points:
        while i < len(order) and uses[order[i]] <= k:
            at[order[i]] = start
            i += 1
        if i < len(order) and not (i and uses[order[i - 1]] > k):  # one ahead
            at[order[i]] = start
            i += 1
    for name in order[i:]:  # (used where the executor does not look: issued at their use)
        at[name] = uses[name]
    return at
