"""Kim et al.'s multi-GPU swapping: the staggered layer choice, the trigger search, invariants."""

import pytest
from memory_checks import assert_prefetched_before_use, assert_resident_when_used, assert_within_limit

from ucudnn.devices import load_profile
from ucudnn.errors import InvalidInput
from ucudnn.memory import make_plan, swap_multi
from ucudnn.memory.graph import from_network
from ucudnn.memory.plan import MemoryPlan
from ucudnn.memory.planner import baseline
from ucudnn.memory.simulate import simulate


def test_staggered_layers_follow_section_3a():
    # a = 12 layers, b = 3 swapped: x = 4; GPU i swaps i % 4 + 4 j
    assert swap_multi.staggered_layers(0, 12, 3) == (0, 4, 8)
    assert swap_multi.staggered_layers(1, 12, 3) == (1, 5, 9)
    assert swap_multi.staggered_layers(5, 12, 3) == (1, 5, 9)
    # a / b not whole: x = floor(13 / 4) = 3, the last layer is never swapped
    assert swap_multi.staggered_layers(2, 13, 4) == (2, 5, 8, 11)
    # everything swapped: x = 1, every GPU swaps every layer
    assert swap_multi.staggered_layers(3, 5, 5) == (0, 1, 2, 3, 4)
    assert swap_multi.staggered_layers(0, 5, 0) == ()
    with pytest.raises(InvalidInput, match="cannot exceed"):
        swap_multi.staggered_layers(0, 3, 4)
    with pytest.raises(InvalidInput, match="gpu"):
        swap_multi.staggered_layers(-1, 3, 1)


def test_device_actions_stagger_within_a_switch_group():
    graph = from_network("vgg16", 1)
    layers = swap_multi.swappable(graph)
    staggered = swap_multi.device_actions(graph, 3, 4, 2)
    offloaded = [{s for s, a in acts.items() if a == "offload"} for acts in staggered]
    assert all(len(o) == 3 for o in offloaded)
    assert offloaded[0] != offloaded[1]  # neighbours on one switch swap different layers
    assert offloaded[0] == offloaded[2]  # GPU 2 is GPU 0's place on the second switch
    assert offloaded[0] == {layers[k] for k in swap_multi.staggered_layers(0, len(layers), 3)}
    same = swap_multi.device_actions(graph, 3, 4, 2, stagger=False)
    assert all(acts == same[0] for acts in same)


@pytest.fixture(scope="module")
def vgg_case():
    graph = from_network("vgg16", 64)
    device = load_profile("p100")
    costs = baseline(graph, device).costs
    limit = int(simulate(graph, device, costs).peak_bytes * 0.8)
    return graph, device, costs, limit


def test_plan_fits_and_keeps_the_invariants_on_every_gpu(vgg_case):
    graph, device, costs, limit = vgg_case
    plan = swap_multi.plan(graph, device, limit, devices=4, devices_per_link=4)
    assert plan.fits and plan.peak_bytes <= limit and plan.devices == 4 and plan.policy == "swap-multi"
    swapped = sum(1 for t in plan.tensors if t.action == "offload")
    assert 0 < swapped < len(swap_multi.swappable(graph))  # fewer than vDNN_all: the smallest b that fits
    actions = swap_multi.device_actions(graph, swapped, 4, 4)
    assert {t.name: t.action for t in plan.tensors} == actions[0]
    _triggers, result = swap_multi.adapt_triggers(graph, device, costs, actions, limit, 4)
    assert result.fits and result.step_ms == pytest.approx(plan.step_ms)
    assert_within_limit(result, limit)
    for d, acts in enumerate(actions):
        assert_resident_when_used(graph, acts)
        assert_prefetched_before_use(graph, acts, result, device=d)
    # one fewer swapped layer per GPU does not fit (b is the smallest)
    fewer = swap_multi.device_actions(graph, swapped - 1, 4, 4)
    assert not simulate(graph, device, costs, fewer, memory_limit=limit, devices=4, devices_per_link=4).fits


def test_plan_lists_every_gpus_actions_and_its_json_reads_back(vgg_case):
    graph, device, _costs, limit = vgg_case
    plan = swap_multi.plan(graph, device, limit, devices=4, devices_per_link=2)
    b = sum(t.action == "offload" for t in plan.tensors)
    expected = swap_multi.device_actions(graph, b, 4, 2)
    per_device = plan.device_actions()
    assert len(per_device) == 4 and per_device[0] == plan.tensors
    assert [{t.name: t.action for t in ts} for ts in per_device] == expected
    assert per_device[1] != per_device[0] and per_device[2] == per_device[0]  # GPU 2 leads the second switch
    data = plan.to_json()
    assert len(data["device_tensors"]) == 4
    assert MemoryPlan.from_json(data) == plan
    # a plan written before device_tensors existed: every device does what `tensors` says
    del data["device_tensors"]
    old = MemoryPlan.from_json(data)
    assert old.device_tensors == () and old.device_actions() == (plan.tensors,) * 4
    with pytest.raises(InvalidInput, match="device_tensors"):
        MemoryPlan.from_json(plan.to_json() | {"devices": 3})
    with pytest.raises(InvalidInput, match="first list"):
        MemoryPlan.from_json(plan.to_json() | {"tensors": plan.to_json()["device_tensors"][1]})


def test_staggering_spreads_each_layer_over_fewer_gpus():
    graph = from_network("resnet50", 1)
    layers = swap_multi.swappable(graph)
    b = len(layers) // 4  # x = 4: the four GPUs of a switch swap disjoint layers
    staggered = swap_multi.device_actions(graph, b, 4, 4)
    at_once = swap_multi.device_actions(graph, b, 4, 4, stagger=False)
    for s in layers:
        assert sum(acts[s] == "offload" for acts in staggered) <= 1
        assert sum(acts[s] == "offload" for acts in at_once) in (0, 4)

    # at once with each GPU's layer set in turn moves, over the four runs, what the staggered run moves
    # four times over: the comparison at equal swapped bytes
    def offloaded(acts):
        return sum(graph.bytes_of(s) for a in acts for s, act in a.items() if act == "offload")

    runs = [swap_multi.device_actions(graph, b, 4, 4, stagger=False, as_gpu=g) for g in range(4)]
    assert all(run[0] == run[3] == staggered[g] for g, run in enumerate(runs))
    assert sum(offloaded(run) for run in runs) == 4 * offloaded(staggered)
    assert offloaded(runs[0]) != offloaded(staggered)  # GPU 0's layers alone are not equal bytes
    # a larger b (x = 2): pairs of GPUs share their layers
    staggered = swap_multi.device_actions(graph, len(layers) // 2, 4, 4)
    assert max(sum(acts[s] == "offload" for acts in staggered) for s in layers) == 2


def test_adaptive_trigger_never_loses_to_vdnn_trigger(vgg_case):
    graph, device, costs, limit = vgg_case
    actions = swap_multi.device_actions(graph, 6, 4, 4)
    layer = simulate(graph, device, costs, actions, memory_limit=limit, devices=4, devices_per_link=4)
    triggers, result = swap_multi.adapt_triggers(graph, device, costs, actions, limit, 4)
    assert result.step_ms <= layer.step_ms + 1e-9
    if triggers != "layer":
        nf = graph.forward_steps
        for per_device in triggers:
            for s, at in per_device.items():
                assert nf - 1 <= at < graph.consumers(s, "bwd")[0]


def test_each_gpu_sets_its_own_triggers_from_its_own_transfers():
    # 3 GPUs, 2 to a switch: GPU 2 swaps GPU 0's layers (it leads the second switch) but copies alone,
    # so its measured transfers are shorter and its prefetches need not start as early as GPU 0's
    # (at batch 32: at vgg_case's batch 64 vDNN's one-layer trigger is not beaten)
    graph = from_network("vgg16", 32)
    device = load_profile("p100")
    costs = baseline(graph, device).costs
    limit = int(simulate(graph, device, costs).peak_bytes * 0.8)
    b = sum(t.action == "offload" for t in swap_multi.plan(graph, device, limit, devices=3, devices_per_link=2).tensors)
    actions = swap_multi.device_actions(graph, b, 3, 2)
    assert actions[2] == actions[0]
    triggers, result = swap_multi.adapt_triggers(graph, device, costs, actions, limit, 2)
    assert triggers != "layer" and result.fits
    assert triggers[2].keys() == triggers[0].keys()
    assert all(triggers[2][s] >= triggers[0][s] for s in triggers[0])
    assert triggers[2] != triggers[0]
    assert result.devices[2].stall_ms < result.devices[0].stall_ms


def test_make_plan_dispatches_and_checks_devices_per_link():
    graph = from_network("vgg16", 2)
    plan = make_plan(graph, "k40", 12 * 2**30, "swap-multi", devices=2)
    assert plan.fits and all(t.action != "offload" for t in plan.tensors)  # room for everything: b = 0
    with pytest.raises(InvalidInput, match="devices_per_link"):
        swap_multi.plan(graph, load_profile("k40"), 2**30, devices_per_link=0)
