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


def assert_prefetched_before_use(graph, actions, result, device=0):
    """Every offloaded storage the backward pass reads is copied out, then back, before that read."""
    compute = {}
    copies = {}
    for i in result.timeline:
        if i.device != device:
            continue
        if i.stream == "compute":
            compute.setdefault(i.label, i)
        elif i.stream in ("d2h", "h2d"):
            copies.setdefault((i.stream, i.label), i)
    nf = graph.forward_steps
    for s, action in actions.items():
        if action != "offload":
            continue
        readers = [st for st in graph.steps[nf:] if s in st.reads]
        if not readers:
            continue
        use = compute[f"bwd {readers[0].op}"]
        out, back = copies[("d2h", s)], copies[("h2d", s)]
        assert out.end_ms <= back.start_ms + 1e-9, f"{s!r} copied back before its copy out ended"
        assert back.end_ms <= use.start_ms + 1e-9, f"{s!r} read at {use.start_ms} before its prefetch ended"
