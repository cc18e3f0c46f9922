"""Chen et al.'s checkpointing as a policy: invariants through the shared simulator."""

import pytest
from memory_checks import assert_resident_when_used, assert_within_limit

from ucudnn.devices import load_profile
from ucudnn.errors import InvalidInput
from ucudnn.memory import checkpoint, make_plan
from ucudnn.memory.graph import from_network
from ucudnn.memory.planner import baseline
from ucudnn.memory.simulate import expand, simulate
from ucudnn.memory.timing import step_costs


def test_articulation_storages_of_a_residual_network():
    graph = from_network("resnet18", 2)
    cuts = checkpoint.articulation_storages(graph)
    # the output of every residual block (its ReLU writes in place into the addition's storage)
    for stage, count in ((1, 2), (2, 2), (3, 2), (4, 2)):
        for i in range(count):
            assert f"layer{stage}.{i}.add" in cuts
    # a block's inner maps are not cuts: the shortcut carries the block input across them
    assert "layer1.0.bn1" not in cuts and "layer1.0.conv1" not in cuts
    assert "input" not in cuts


def test_articulation_storages_of_googlenet_are_block_outputs():
    cuts = set(checkpoint.articulation_storages(from_network("googlenet", 1)))
    assert "inception3a.output" in cuts and "inception4e.output" in cuts
    assert not any(c.startswith("inception3a.") and c != "inception3a.output" for c in cuts)


@pytest.mark.parametrize("net", ["vgg16", "resnet50", "googlenet", "densenet40"])
@pytest.mark.parametrize("search", ["sqrt", "greedy", "optimal"])
def test_recompute_before_use_and_at_most_one_forward_pass(net, search):
    graph = from_network(net, 4)
    device = load_profile("k40")
    p = checkpoint.plan(graph, device, 10**12, search=search)
    actions = {t.name: t.action for t in p.tensors}
    assert set(actions.values()) <= {"keep", "recompute", "release"}
    assert "recompute" in actions.values()
    assert_resident_when_used(graph, actions)
    costs = step_costs(graph, device)
    result = simulate(graph, device, costs, actions)
    assert result.recompute_ms <= checkpoint.forward_ms(graph, costs) * (1 + 1e-9)
    # each op is recomputed at most once
    ops = [s.op for s in result.schedule[0] if s.phase == "recompute"]
    assert len(ops) == len(set(ops))
    # checkpointing saves memory against keeping everything
    keep_all = simulate(graph, device, costs)
    assert result.peak_bytes < keep_all.peak_bytes


def test_optimal_search_peaks_no_higher_than_sqrt_on_resnet152():
    graph = from_network("resnet152", 2)
    device = load_profile("h100")
    peaks = {s: checkpoint.plan(graph, device, 10**12, search=s).peak_bytes for s in ("sqrt", "optimal")}
    # the exact search minimises the chain model, and the simulator agrees on this graph
    assert peaks["optimal"] <= peaks["sqrt"]


def test_auto_keeps_everything_when_it_fits_and_fits_a_tight_limit():
    graph = from_network("resnet50", 8)
    device = load_profile("h100")
    roomy = make_plan(graph, device, 80 * 2**30, "checkpoint")
    assert roomy.fits and all(t.action in ("keep", "release") for t in roomy.tensors)
    base = baseline(graph, device)
    keep_all = simulate(graph, device, base.costs).peak_bytes
    limit = int(keep_all * 0.6)
    tight = make_plan(graph, device, limit, "checkpoint")
    assert tight.fits and tight.peak_bytes <= limit
    assert tight.policy == "checkpoint"
    actions = {t.name: t.action for t in tight.tensors}
    assert_resident_when_used(graph, actions)
    assert_within_limit(simulate(graph, device, base.costs, actions, memory_limit=limit), limit)
    # far too little memory: no plan fits, the smallest-peak one is returned
    assert not make_plan(graph, device, 2**20, "checkpoint").fits


def test_bad_search():
    with pytest.raises(InvalidInput, match="search"):
        checkpoint.plan(from_network("vgg16", 1), load_profile("k40"), 2**30, search="best")


def test_the_residency_check_catches_a_missing_recompute():
    graph = from_network("vgg16", 1)
    p = checkpoint.plan(graph, load_profile("k40"), 10**12, search="sqrt")
    actions = {t.name: t.action for t in p.tensors}
    kept = next(s for s in checkpoint.articulation_storages(graph) if actions[s] == "keep")
    dropped = dict(actions, **{kept: "recompute"})
    assert_resident_when_used(graph, dropped)  # the simulator's schedule rebuilds it before use
    # a schedule without its rebuild (the one for keeping it) reads it after the forward pass dropped it
    with pytest.raises(AssertionError, match="holds no data"):
        assert_resident_when_used(graph, dropped, schedule=expand(graph, actions))


def test_a_looser_limit_buys_less_recompute():
    # Between the smallest peak and keeping everything, the policy trades memory for recompute as
    # checkpoint_sequential does with fewer segments: it recomputes less than the smallest-peak plan.
    graph, device = from_network("resnet50", 64), load_profile("k40")
    tightest = checkpoint.plan(graph, device, 1, search="optimal")
    everything = checkpoint.plan(graph, device, 2**62).peak_bytes  # nothing recomputed
    limit = (tightest.peak_bytes + everything) // 2
    looser = checkpoint.plan(graph, device, limit)
    assert looser.fits and looser.peak_bytes <= limit

    def recomputed(plan):
        return sum(t.action == "recompute" for t in plan.tensors)

    assert 0 < recomputed(looser) < recomputed(tightest)
    assert looser.step_ms < tightest.step_ms


def test_plans_at_several_limits_search_the_chain_s_frontier_once(monkeypatch):
    """The frontier of equation 1 does not depend on the limit: a sweep of limits computes it once."""
    graph = from_network("resnet50", 8)
    device = load_profile("h100")
    keep_all = simulate(graph, device, baseline(graph, device).costs).peak_bytes
    checkpoint._frontier.cache_clear()
    calls = []
    frontier = checkpoint.chain.frontier
    monkeypatch.setattr(checkpoint.chain, "frontier", lambda *a, **k: calls.append(1) or frontier(*a, **k))
    plans = [checkpoint.plan(graph, device, int(keep_all * f), search="frontier") for f in (0.5, 0.6, 0.7)]
    assert len(calls) == 1
    assert all(p.fits for p in plans) and plans[0].step_ms >= plans[2].step_ms  # each limit its own plan
