"""vDNN_dyn's profiling passes (Rhu et al., section 3.3): each branch of the search, reached on a small
graph with a limit chosen to force it; the greedy pass's downgrades; and trainability as pass (1) says."""

import pytest
from memory_checks import assert_resident_when_used, assert_within_limit

from ucudnn.devices import load_profile
from ucudnn.memory import vdnn
from ucudnn.memory.graph import from_network
from ucudnn.memory.simulate import simulate
from ucudnn.memory.timing import KernelOption, conv_fronts, step_costs

DEVICE = load_profile("k40")
GRAPH = from_network("resnet18", 8)
LATE = ("layer4.1.conv2", "fwd")  # runs when vDNN_conv still holds every conv output of the forward pass
EARLY = ("layer1.0.conv1", "fwd")  # runs when little is held


def peak(mode: str, workspace, fronts=None, limit=None):
    costs = step_costs(GRAPH, DEVICE, workspace=workspace, fronts=fronts)
    return simulate(GRAPH, DEVICE, costs, vdnn.actions_for(GRAPH, mode), memory_limit=limit, timeline=False)


def workspaces(plan):
    return {(c.layer, c.kind): c.bytes for c in plan.conv_workspace}


def test_the_passes_without_the_greedy_one():
    fronts = conv_fronts(GRAPH, DEVICE)
    assert any(len(o) > 1 for o in fronts.values())
    smallest = {k: o[0].workspace for k, o in fronts.items()}
    roomy = vdnn.plan(GRAPH, DEVICE, 2**40)
    assert roomy.search == "none" and roomy.fits and roomy.overhead == pytest.approx(0.0, abs=1e-9)
    assert workspaces(roomy) == {k: o[-1].workspace for k, o in fronts.items()}  # the fastest options
    expected = {"conv": peak("conv", None).peak_bytes, "all": peak("all", None).peak_bytes}
    assert expected["all"] < expected["conv"] < roomy.peak_bytes
    for mode, limit in expected.items():
        got = vdnn.plan(GRAPH, DEVICE, limit)
        assert got.search == mode and got.fits and got.peak_bytes <= limit
        offloaded = {t.name for t in got.tensors if t.action == "offload"}
        assert offloaded == {s for s, a in vdnn.actions_for(GRAPH, mode).items() if a == "offload"}
    # pass (1) fails: nothing can fit, and that plan (everything offloaded, memory-optimal) is the answer
    floor = peak("all", smallest).peak_bytes
    hopeless = vdnn.plan(GRAPH, DEVICE, floor // 2)
    assert hopeless.search == "all-memory-optimal" and not hopeless.fits
    assert workspaces(hopeless) == smallest


@pytest.fixture
def synthetic():
    """Fronts where only LATE and EARLY trade time for workspace; every other kernel has one option
    without workspace. W1 fits beside vDNN_all's maps at LATE, W2 overflows any limit below
    vDNN_conv's peak."""
    fronts = {k: (KernelOption(1.0, 0),) for k in conv_fronts(GRAPH, DEVICE)}
    zero = {k: 0 for k in fronts}
    p_all, p_conv = peak("all", zero, fronts).peak_bytes, peak("conv", zero, fronts).peak_bytes
    w1 = (p_conv - p_all) // 4
    fronts[LATE] = (KernelOption(4.0, 0), KernelOption(3.0, w1 // 2), KernelOption(2.0, w1), KernelOption(1.0, p_conv))
    fronts[EARLY] = (KernelOption(2.0, 0), KernelOption(1.0, w1))
    return fronts, p_all, p_conv, w1


def test_greedy_with_vdnn_all_downgrades_only_the_overflowing_layer_one_option_at_a_time(synthetic):
    fronts, p_all, p_conv, w1 = synthetic
    limit = (p_all + p_conv) // 2
    fast = {k: o[-1].workspace for k, o in fronts.items()}
    for mode in ("none", "conv", "all"):
        assert not peak(mode, fast, fronts, limit).fits  # pass (2) fails at this limit
    got = vdnn.plan(GRAPH, DEVICE, limit, fronts=fronts)
    assert got.search == "greedy-all" and got.fits and got.peak_bytes <= limit
    ws = workspaces(got)
    # LATE overflowed: stepped down from p_conv to w1, the first option that fits there, not further
    assert ws[LATE] == w1
    # EARLY did not overflow: it keeps its fastest option, as does every other kernel
    assert ws[EARLY] == w1 and all(ws[k] == 0 for k in ws if k not in (LATE, EARLY))
    actions = {t.name: t.action for t in got.tensors}
    assert_resident_when_used(GRAPH, actions)
    assert_within_limit(got.simulation, limit)
    # the kernels the greedy pass found overflowing under the fastest options: LATE's step alone
    costs = step_costs(GRAPH, DEVICE, workspace=fast, fronts=fronts)
    first = peak("all", fast, fronts, limit)
    over = vdnn.overflowing_kernels(GRAPH, costs, first)
    assert [GRAPH.steps[k].op for k in over] == [LATE[0]]
    assert w1 <= over[next(iter(over))] < p_conv


def test_greedy_with_vdnn_conv_comes_first(synthetic):
    fronts, _p_all, p_conv, w1 = synthetic
    limit = p_conv + w1
    got = vdnn.plan(GRAPH, DEVICE, limit, fronts=fronts)
    assert got.search == "greedy-conv" and got.fits and got.peak_bytes <= limit
    assert workspaces(got)[LATE] == w1
    offloaded = {t.name for t in got.tensors if t.action == "offload"}
    assert offloaded == {s for s, a in vdnn.actions_for(GRAPH, "conv").items() if a == "offload"}


def test_when_both_greedy_passes_fail_pass_one_is_the_answer(synthetic, monkeypatch):
    fronts, p_all, p_conv, _w1 = synthetic
    limit = (p_all + p_conv) // 2
    failed = []

    def stuck(graph, fronts_, fast, run):  # a greedy pass that cannot fit
        _, result = run(fast)
        failed.append(result.fits)
        return fast, result

    monkeypatch.setattr(vdnn, "_greedy", stuck)
    got = vdnn.plan(GRAPH, DEVICE, limit, fronts=fronts)
    assert failed == [False, False]  # tried with vDNN_conv, then vDNN_all
    assert got.search == "all-memory-optimal" and got.fits
    assert workspaces(got) == {k: o[0].workspace for k, o in fronts.items()}


@pytest.mark.parametrize("net,batch", [("resnet18", 8), ("alexnet", 32)])
def test_the_plan_fits_whenever_pass_one_fits(net, batch):
    graph = from_network(net, batch)
    fronts = conv_fronts(graph, DEVICE)
    smallest = {k: o[0].workspace for k, o in fronts.items()}
    costs = step_costs(graph, DEVICE, workspace=smallest, fronts=fronts)
    floor = simulate(graph, DEVICE, costs, vdnn.actions_for(graph, "all"), timeline=False).peak_bytes
    for fraction in (0.9, 0.97, 1.0, 1.02, 1.05, 1.1, 1.2, 1.4):
        limit = int(floor * fraction)
        one = simulate(graph, DEVICE, costs, vdnn.actions_for(graph, "all"), memory_limit=limit, timeline=False)
        got = vdnn.plan(graph, DEVICE, limit)
        assert got.fits == one.fits, (fraction, got.search)
        assert got.search in vdnn.SEARCH_PASSES
        if got.fits:
            assert_within_limit(got.simulation, limit)
