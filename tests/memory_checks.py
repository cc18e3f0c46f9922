"""Invariants every memory plan must keep, checked on the simulator's expanded schedule.

Independent of the simulator's own bookkeeping: walks the compute stream's steps and says which
storages hold valid data at each one, from the plan's actions alone.
"""

from ucudnn.memory.simulate import expand


def assert_resident_when_used(graph, actions, schedule=None):
    """Every step reads only storages that hold data then: produced in the forward pass and kept,
    offloaded (prefetched back), or recomputed by an earlier step after the forward pass dropped it."""
    schedule = schedule if schedule is not None else expand(graph, actions)
    nf = graph.forward_steps
    valid = set()
    dropped = {s for s in graph.storages if actions.get(s, "keep") in ("recompute", "release")}
    for k, step in enumerate(schedule):
        if k == nf:
            valid -= dropped  # the forward pass is over: dropped storages no longer hold data
        for name in step.reads:
            if name.startswith("grad:"):
                continue
            assert name in valid, f"step {k} ({step.phase} {step.op}) reads {name!r}, which holds no data then"
        if k < nf or step.phase == "recompute":
            valid.update(step.writes)
        if step.phase == "recompute":
            assert k >= nf, f"recompute step {k} runs inside the forward pass"


def assert_within_limit(result, limit):
    """A result that fits never had more than `limit` bytes in use on any device."""
    if result.fits:
        for device in result.devices:
            assert max(b for _, b in device.memory) <= limit
            assert device.peak_bytes <= limit
