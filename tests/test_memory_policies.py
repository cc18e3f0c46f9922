"""Every policy's invariants: what a step reads is resident, memory stays within the limit when the plan
fits, recomputation comes before use; and each policy's own promises."""

import pytest

from ucudnn.devices import PROFILES
from ucudnn.errors import InvalidInput
from ucudnn.memory import available_policies, make_plan
from ucudnn.memory.graph import from_network
from ucudnn.memory.optimal import search
from ucudnn.memory.plan import MemoryPlan
from ucudnn.memory.planner import baseline
from ucudnn.memory.simulate import simulate

MINE = ["vdnn-all", "vdnn-conv", "vdnn-dyn", "optimal"]
GIB = 2**30


def check_invariants(graph, plan: MemoryPlan) -> None:
    result = plan.simulation
    for d in result.devices:
        assert d.missing == (), d.missing[:5]  # every read was resident when its step started
    if plan.fits:
        for d in result.devices:
            assert max(b for _, b in d.memory) <= plan.memory_limit
        assert plan.peak_bytes <= plan.memory_limit
    actions = {t.name: t.action for t in plan.tensors}
    assert set(actions) == set(graph.storages)
    backward_reads = {r for s in graph.steps if s.phase == "bwd" for r in s.reads}
    for name, action in actions.items():
        if action == "release":
            assert name not in backward_reads
    for sched in result.schedule:
        rebuilt: set[str] = set()
        for step in sched:
            if step.phase == "recompute":
                rebuilt.update(step.writes)
            if step.phase == "bwd":
                for r in step.reads:
                    if actions.get(r) == "recompute":
                        assert r in rebuilt, f"{step.op} reads {r} before it is recomputed"
    # the plan's JSON reads back as the same plan
    assert MemoryPlan.from_json(plan.to_json()) == plan


@pytest.mark.parametrize("policy", MINE)
@pytest.mark.parametrize(
    "network,batch,device,limit_gib",
    [("vgg16", 64, "k40", 4), ("resnet50", 32, "h100", 2), ("googlenet", 32, "k40", 1)],
)
def test_policy_invariants(policy, network, batch, device, limit_gib):
    g = from_network(network, batch)
    plan = make_plan(g, device, int(limit_gib * GIB), policy)
    assert plan.policy == policy and plan.network == network and plan.batch == batch
    check_invariants(g, plan)


def test_vdnn_static_modes_offload_what_they_say():
    g = from_network("vgg16", 32)
    all_plan = make_plan(g, "k40", 12 * GIB, "vdnn-all")
    conv_plan = make_plan(g, "k40", 12 * GIB, "vdnn-conv")
    offloaded_all = {t.name for t in all_plan.tensors if t.action == "offload"}
    offloaded_conv = {t.name for t in conv_plan.tensors if t.action == "offload"}
    conv_inputs = {g.storage_of(op.inputs[0]) for op in g.conv_ops}
    assert offloaded_conv == conv_inputs
    assert offloaded_conv < offloaded_all
    # VGG's peak sits at conv1's backward for both; over the step, vDNN_all holds less
    assert all_plan.peak_bytes <= conv_plan.peak_bytes < all_plan.baseline_peak_bytes
    assert all_plan.average_bytes < conv_plan.average_bytes
    assert all_plan.bytes_offloaded == sum(t.bytes for t in all_plan.tensors if t.action == "offload")


def test_vdnn_dyn_keeps_everything_when_it_fits_and_offloads_when_not():
    g = from_network("vgg16", 32)
    roomy = make_plan(g, "k40", 12 * GIB, "vdnn-dyn")
    assert roomy.fits and all(t.action in ("keep", "release") for t in roomy.tensors)
    assert roomy.overhead == pytest.approx(0.0, abs=1e-9)
    floor = make_plan(g, "k40", 12 * GIB, "vdnn-all").peak_bytes
    assert floor < roomy.peak_bytes
    tight_limit = (floor + roomy.peak_bytes) // 2
    tight = make_plan(g, "k40", tight_limit, "vdnn-dyn")
    assert tight.fits and any(t.action == "offload" for t in tight.tensors)


def test_optimal_is_no_slower_than_vdnn_where_both_fit():
    g = from_network("resnet50", 32)
    limit = int(0.6 * simulate(g, PROFILES["h100"], baseline(g, PROFILES["h100"]).costs).peak_bytes)
    found = search(g, PROFILES["h100"], limit)
    vdnn = make_plan(g, "h100", limit, "vdnn-dyn")
    assert found.plan.fits
    check_invariants(g, found.plan)
    if vdnn.fits:
        assert found.plan.step_ms <= vdnn.step_ms * 1.001
    assert 0 <= found.mip_gap < 0.05
    # the budgets handed to the WD solver are options of each kernel's front
    assert {(c.layer, c.kind) for c in found.plan.conv_workspace} == {(s.op, k) for s in g.steps for k in s.kernels}


def test_nothing_fits_says_so():
    g = from_network("vgg16", 64)
    for policy in MINE:
        plan = make_plan(g, "k40", 64 * 2**20, policy)
        assert not plan.fits
        check_invariants(g, plan)


def test_make_plan_rejects_bad_input():
    g = from_network("alexnet", 8)
    with pytest.raises(InvalidInput, match="available: vdnn-all"):
        make_plan(g, "k40", GIB, "nope")
    with pytest.raises(InvalidInput, match="memory_limit"):
        make_plan(g, "k40", 0, "vdnn-all")
    with pytest.raises(InvalidInput, match="unknown device"):
        make_plan(g, "k99", GIB, "vdnn-all")
    with pytest.raises(InvalidInput, match="devices"):
        make_plan(g, "k40", GIB, "vdnn-all", devices=0)
    assert set(MINE) <= set(available_policies())


def test_the_program_charges_an_offload_what_its_copy_out_does_not_hide():
    # The chain of tests/test_memory_simulate.py: a's copy out starts after its forward (step 1) and the
    # step after b's forward (its last reader, 1 ms) waits for it: 2 ms at 0.5 GB/s, 1 ms unhidden.
    import dataclasses

    from test_memory_simulate import SLOW_OUT, SLOW_OUT_COSTS, chain

    from ucudnn.memory.optimal import _tables

    tensors = {t.name: t for t in _tables(chain(), SLOW_OUT, SLOW_OUT_COSTS, {})[0]}
    assert tensors["a"].cost_ms["offload"] == pytest.approx(1.0, abs=1e-5)
    assert tensors["a"].cost_ms["keep"] == 0.0
    fast_out = dataclasses.replace(SLOW_OUT, d2h_gbps=4.0, duplex_gbps=4.0)
    tensors = {t.name: t for t in _tables(chain(), fast_out, SLOW_OUT_COSTS, {})[0]}
    assert tensors["a"].cost_ms["offload"] == pytest.approx(0.0, abs=1e-5)  # 0.25 ms, hidden by b's forward
