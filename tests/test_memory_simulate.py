"""The event simulator on small graphs whose answers are computed by hand."""

import dataclasses

import pytest

from ucudnn.devices import DeviceProfile
from ucudnn.errors import InvalidInput
from ucudnn.memory.graph import Op, TrainingGraph
from ucudnn.memory.simulate import StepCost, expand, simulate

MB = 10**6  # a feature map of (1, 250000) float32 holds 1 MB
# 1 GB/s each way: 1 MB copies in 1 ms
DEVICE = DeviceProfile(
    "toy",
    "toy",
    10**9,
    h2d_gbps=1.0,
    d2h_gbps=1.0,
    duplex_gbps=2.0,
    devices_per_link=1,
    fp32_tflops=1.0,
    memory_gbps=1.0,
)
W = 4  # each layer's weight: 4 bytes; weights and their gradients: 16 bytes resident throughout


def chain() -> TrainingGraph:
    """x -> a -> b -> loss; a reads x, b reads a, the loss reads b (each saved for backward)."""
    shape = (1, 250_000)
    return TrainingGraph(
        "chain",
        1,
        (
            Op("x", "input", (), shape),
            Op("a", "linear", ("x",), shape, saves=("x",), weight_bytes=W),
            Op("b", "linear", ("a",), shape, saves=("a",), weight_bytes=W),
            Op("loss", "loss", ("b",), (1,), saves=("b",)),
        ),
    )


# steps: fwd x, a, b, loss (0-3); bwd loss, b, a (4-6)
COSTS = [StepCost(0), StepCost(2), StepCost(2), StepCost(0), StepCost(0), StepCost(4), StepCost(4)]
# a copies out more slowly (0.5 GB/s: 2 ms) than b's forward, its last reader, runs (1 ms)
SLOW_OUT = DeviceProfile(
    "slow-out",
    "slow-out",
    10**9,
    h2d_gbps=1.0,
    d2h_gbps=0.5,
    duplex_gbps=2.0,
    devices_per_link=1,
    fp32_tflops=1.0,
    memory_gbps=1.0,
)
SLOW_OUT_COSTS = [StepCost(0), StepCost(2), StepCost(1), StepCost(2), StepCost(0), StepCost(4), StepCost(4)]


def test_steps_of_the_chain():
    g = chain()
    assert [(s.op, s.phase) for s in g.steps] == [
        ("x", "fwd"),
        ("a", "fwd"),
        ("b", "fwd"),
        ("loss", "fwd"),
        ("loss", "bwd"),
        ("b", "bwd"),
        ("a", "bwd"),
    ]
    assert g.steps[5].reads == ("a", "grad:b") and g.steps[5].writes == ("grad:a", "wgrad:b")
    assert g.steps[6].writes == ("wgrad:a",)  # the input needs no gradient


def test_everything_kept():
    r = simulate(chain(), DEVICE, COSTS)
    assert r.step_ms == pytest.approx(12.0)
    assert r.stall_ms == 0 and r.bytes_offloaded == 0
    # during b's backward: x, a, grad:b, grad:a (b was freed after the loss's backward) + weights
    assert r.peak_bytes == 4 * MB + 16
    assert r.fits


def test_offload_one_feature_map():
    # a is copied out 2->3 ms, freed at 4 when b's forward ends; copied back 4->5 when the loss's
    # backward starts (no conv/linear backward before its use), so b's backward waits 1 ms.
    r = simulate(chain(), DEVICE, COSTS, {"a": "offload"})
    assert r.step_ms == pytest.approx(13.0)
    assert r.stall_ms == pytest.approx(1.0)
    assert r.bytes_offloaded == MB and r.bytes_prefetched == MB
    d2h = [i for i in r.timeline if i.stream == "d2h"]
    h2d = [i for i in r.timeline if i.stream == "h2d"]
    assert [(i.start_ms, i.end_ms) for i in d2h] == [(2.0, 3.0)]
    assert [(round(i.start_ms, 9), round(i.end_ms, 9)) for i in h2d] == [(4.0, 5.0)]
    # an earlier prefetch hides the copy: issued when b's forward is next (after a's copy out ends at 3)
    early = simulate(chain(), DEVICE, COSTS, {"a": "offload"}, prefetch={"a": 2})
    assert early.step_ms == pytest.approx(12.0) and early.stall_ms == 0


def test_the_step_after_the_last_reader_waits_for_the_copy_out():
    # a copies out at 0.5 GB/s, 2->4 ms; b's forward, its last reader, ends at 3, and the loss's forward
    # waits for the copy (the compute stream waits on its event): 4->6. a comes back at the loss's
    # backward (6->7) and b's backward waits for it: 7->11, then a's backward 11->15. Stall 1 + 1 ms.
    r = simulate(chain(), SLOW_OUT, SLOW_OUT_COSTS, {"a": "offload"})
    assert [(i.label, i.start_ms, i.end_ms) for i in r.timeline if i.stream == "compute"][2:4] == [
        ("fwd b", 2.0, 3.0),
        ("fwd loss", 4.0, 6.0),
    ]
    assert r.step_ms == pytest.approx(15.0) and r.stall_ms == pytest.approx(2.0)


def test_each_device_has_its_own_prefetch_triggers():
    # two devices, each alone on its link, both offload a (out 2->3 ms). Device 0 prefetches at b's
    # forward (step 2): back 3->4, no stall, 12 ms. Device 1 at the loss's backward (vDNN's trigger):
    # back 4->5, b's backward waits 1 ms, 13 ms: each as on one device (test_offload_one_feature_map).
    r = simulate(chain(), DEVICE, COSTS, {"a": "offload"}, prefetch=[{"a": 2}, "layer"], devices=2, devices_per_link=1)
    assert [d.stall_ms for d in r.devices] == pytest.approx([0.0, 1.0])
    assert [d.step_ms for d in r.devices] == pytest.approx([12.0, 13.0])
    h2d = sorted((i.device, round(i.start_ms, 9), round(i.end_ms, 9)) for i in r.timeline if i.stream == "h2d")
    assert h2d == [(0, 3.0, 4.0), (1, 4.0, 5.0)]
    with pytest.raises(InvalidInput, match="prefetch: 1 entries for 2 devices"):
        simulate(chain(), DEVICE, COSTS, {"a": "offload"}, prefetch=["layer"], devices=2)


def test_memory_limit_makes_a_prefetch_wait():
    # x and a offloaded, limit 3 MB + 20 B. a comes back 4->5; b's backward (5->9) holds a, grad:b and
    # grad:a, so x's copy back waits for it: 9->10, and a's backward runs 10->14.
    limit = 3 * MB + 20
    kept = simulate(chain(), DEVICE, COSTS, memory_limit=limit)
    assert not kept.fits and kept.peak_bytes == 4 * MB + 16
    r = simulate(chain(), DEVICE, COSTS, {"x": "offload", "a": "offload"}, memory_limit=limit)
    assert r.fits and r.peak_bytes == 3 * MB + 16
    assert r.step_ms == pytest.approx(14.0)
    assert r.stall_ms == pytest.approx(2.0)
    assert r.bytes_offloaded == 2 * MB


def test_recompute_runs_the_forward_step_again_before_use():
    g = chain()
    sched = expand(g, {"a": "recompute"})
    phases = [(s.op, s.phase) for s in sched]
    assert phases.index(("a", "recompute")) == phases.index(("b", "bwd")) - 1
    r = simulate(g, DEVICE, COSTS, {"a": "recompute"})
    assert r.step_ms == pytest.approx(14.0) and r.recompute_ms == pytest.approx(2.0)
    assert r.peak_bytes == 4 * MB + 16  # x, a (again), grad:b, grad:a during b's backward


def test_a_recompute_step_also_costs_what_replaying_it_costs_the_host():
    g = dataclasses.replace(chain(), replay_host_ms=0.5)  # the executor's host time per replayed op
    r = simulate(g, DEVICE, COSTS, {"a": "recompute"})
    assert r.step_ms == pytest.approx(14.5) and r.recompute_ms == pytest.approx(2.5)
    assert simulate(g, DEVICE, COSTS).step_ms == pytest.approx(12.0)  # nothing replayed: nothing charged
    for bad in (-1.0, float("inf"), True, "1"):
        with pytest.raises(InvalidInput, match="replay_host_ms"):
            dataclasses.replace(chain(), replay_host_ms=bad)


def test_two_devices_on_one_link_share_its_bandwidth():
    # both copy a out at half speed (2->4) and back at half speed (4->6): b's backward waits 2 ms
    shared = simulate(chain(), DEVICE, COSTS, {"a": "offload"}, devices=2, devices_per_link=2)
    assert shared.step_ms == pytest.approx(14.0) and shared.stall_ms == pytest.approx(2.0)
    apart = simulate(chain(), DEVICE, COSTS, {"a": "offload"}, devices=2, devices_per_link=1)
    assert apart.step_ms == pytest.approx(13.0)
    # staggered: only device 1 swaps; it has the link alone
    staggered = simulate(chain(), DEVICE, COSTS, [{}, {"a": "offload"}], devices=2, devices_per_link=2)
    assert staggered.step_ms == pytest.approx(13.0) and staggered.devices[0].step_ms == pytest.approx(12.0)


def test_both_directions_share_the_duplex_bandwidth():
    # duplex 1 GB/s: while x goes out (0->) a cannot... x out 0->1 alone; a out 2->3 alone. Prefetching x
    # at step 2 (while a copies out) runs both ways at once at 0.5 GB/s each.
    slow = DeviceProfile(
        "duplex",
        "duplex",
        10**9,
        h2d_gbps=1.0,
        d2h_gbps=1.0,
        duplex_gbps=1.0,
        devices_per_link=1,
        fp32_tflops=1.0,
        memory_gbps=1.0,
    )
    r = simulate(chain(), slow, COSTS, {"x": "offload", "a": "offload"}, prefetch={"x": 2, "a": 4})
    d2h_a = next(i for i in r.timeline if i.stream == "d2h" and i.label == "a")
    h2d_x = next(i for i in r.timeline if i.stream == "h2d" and i.label == "x")
    # both start at 2 and share: each has moved 0.5 MB at 3; then x... both end at 4
    assert d2h_a.start_ms == pytest.approx(2.0) and d2h_a.end_ms == pytest.approx(4.0)
    assert h2d_x.start_ms == pytest.approx(2.0) and h2d_x.end_ms == pytest.approx(4.0)


def test_bad_actions():
    g = chain()
    with pytest.raises(InvalidInput, match="released"):
        simulate(g, DEVICE, COSTS, {"a": "release"})
    with pytest.raises(InvalidInput, match="not a storage"):
        simulate(g, DEVICE, COSTS, {"zz": "keep"})
    with pytest.raises(InvalidInput, match="input"):
        simulate(g, DEVICE, COSTS, {"x": "recompute"})
    with pytest.raises(InvalidInput, match="costs"):
        simulate(g, DEVICE, COSTS[:3])


def test_the_allocation_trace_replays_to_the_memory_curve():
    r = simulate(chain(), DEVICE, COSTS, {"x": "offload", "a": "offload"}, memory_limit=3 * MB + 20)
    d = r.devices[0]
    used = 2 * W * 2  # weights and weight gradients are resident throughout, outside the trace
    live: dict[str, int] = {}
    for t, name, delta in d.allocations:
        used += delta
        live[name] = live.get(name, 0) + delta
        assert live[name] >= 0
    assert used == d.memory[-1][1] and all(v == 0 for v in live.values())
    # x and a were each allocated twice (produced, then copied back)
    assert [n for _, n, delta in d.allocations if delta > 0].count("a") == 2
