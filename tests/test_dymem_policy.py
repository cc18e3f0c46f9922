"""Dymem as a policy: execution order, prefetch look-ahead, invariants and its allocation trace."""

import pytest
from memory_checks import assert_prefetched_before_use, assert_resident_when_used, assert_within_limit

from ucudnn.devices import load_profile
from ucudnn.errors import InvalidInput
from ucudnn.memory import dymem, gtbm, make_plan
from ucudnn.memory.graph import TrainingGraph, from_network
from ucudnn.memory.planner import baseline
from ucudnn.memory.simulate import simulate
from ucudnn.memory.vdnn import actions_for


def test_dfs_graph_keeps_the_zoo_order_and_regroups_interleaved_branches():
    graph = from_network("googlenet", 1)
    assert dymem.dfs_graph(graph) is graph
    # interleave the first inception block's branches breadth-first: DFS puts each branch back together
    ops = list(graph.ops)
    names = [op.name for op in ops]
    block = [k for k, n in enumerate(names) if n.startswith("inception3a.") and n != "inception3a.output"]
    by_depth = sorted(
        block,
        key=lambda k: (
            sum(
                1
                for j in block
                if j < k and names[j].split(".")[1].split("_")[0] == names[k].split(".")[1].split("_")[0]
            ),
            k,
        ),
    )
    shuffled = ops[: block[0]] + [ops[k] for k in by_depth] + ops[block[-1] + 1 :]
    interleaved = TrainingGraph(graph.network, graph.batch, tuple(shuffled))
    assert [op.name for op in interleaved.ops] != names
    assert [op.name for op in dymem.dfs_graph(interleaved).ops] == names


def test_prefetch_schedule_triggers_before_use_in_the_backward_pass():
    graph = from_network("resnet50", 2)
    actions = actions_for(graph, "all")
    schedule = dymem.prefetch_schedule(graph, actions)
    nf = graph.forward_steps
    assert set(schedule) == {s for s, a in actions.items() if a == "offload"}
    for s, at in schedule.items():
        use = graph.consumers(s, "bwd")[0]
        assert nf - 1 <= at < use
        convs_between = sum(1 for k in range(at + 1, use) if graph.op(graph.steps[k].op).type == "conv")
        assert convs_between <= 1  # the use lies within two convolutions of the trigger


@pytest.mark.parametrize("net", ["googlenet", "densenet40", "resnet50"])
def test_dymem_invariants_and_lower_stall_than_vdnn(net):
    graph = from_network(net, 32)
    device = load_profile("k40")
    costs = baseline(graph, device).costs
    keep_all = simulate(graph, device, costs).peak_bytes
    limit = int(keep_all * 0.4)
    plan = make_plan(graph, device, limit, "dymem")
    assert plan.policy == "dymem" and plan.fits and plan.peak_bytes <= limit
    actions = {t.name: t.action for t in plan.tensors}
    assert "offload" in actions.values()
    assert_resident_when_used(graph, actions)
    result = simulate(
        graph, device, costs, actions, memory_limit=limit, prefetch=dymem.prefetch_schedule(graph, actions)
    )
    assert result.fits
    assert_within_limit(result, limit)
    assert_prefetched_before_use(graph, actions, result)
    # the same offloads with vDNN's one-layer prefetch stall longer on these fork/join graphs
    vdnn = simulate(graph, device, costs, actions, memory_limit=limit, prefetch="layer")
    assert result.stall_ms < vdnn.stall_ms


def test_allocation_trace_matches_the_simulator_when_everything_stays():
    graph = from_network("googlenet", 2)
    device = load_profile("k40")
    costs = baseline(graph, device).costs
    actions = actions_for(graph, "none")
    trace = dymem.allocation_trace(graph, actions, costs)
    live = peak = 0
    sizes = {}
    for e in trace:
        if isinstance(e, gtbm.Alloc):
            sizes[e.name] = e.bytes
            live += e.bytes
            peak = max(peak, live)
        else:
            live -= sizes.pop(e.name)
    assert live == 0 and not sizes  # every request is freed
    assert peak + 2 * graph.weight_bytes == simulate(graph, device, costs, actions).peak_bytes


def test_allocation_trace_mobility():
    graph = from_network("googlenet", 2)
    costs = baseline(graph, load_profile("k40")).costs
    actions = actions_for(graph, "all")
    trace = dymem.allocation_trace(graph, actions, costs, dymem.prefetch_schedule(graph, actions))
    mobility = {e.name: e.mobility for e in trace if isinstance(e, gtbm.Alloc)}
    assert mobility["pool2"] == "temporary"  # the fork into inception3a's four branches
    assert mobility["inception3a.1x1"] == "temporary"  # waits for the join
    assert mobility["inception3a.3x3_reduce"] == "movable"  # read by the next op only, then offloaded
    assert mobility["fc"] == "reclaimed"
    assert any(name.endswith("@prefetch") for name in mobility)
    with pytest.raises(InvalidInput, match="no recompute"):
        dymem.allocation_trace(graph, {"pool2": "recompute"}, costs)


def _vdnn_all_mobility(net):
    graph = from_network(net, 2)
    costs = baseline(graph, load_profile("k40")).costs
    actions = actions_for(graph, "all")
    trace = dymem.allocation_trace(graph, actions, costs, dymem.prefetch_schedule(graph, actions))
    return graph, {e.name: e.mobility for e in trace if isinstance(e, gtbm.Alloc)}


@pytest.mark.parametrize(
    "net, summed, continued",
    [
        ("resnet50", "grad:maxpool", "grad:layer1.0.bn1"),  # block input; bn1 then ReLU in place
        ("densenet40", "grad:dense1.7.cat", "grad:dense1.7.bn"),  # a concatenation read by two layers
    ],
)
def test_a_gradient_summed_from_branches_is_temporary(net, summed, continued):
    # Algorithm 3: a tensor waiting for a join is temporary. In the backward pass a fork's gradient
    # waits for each branch to add to it; an in-place ReLU's backward only continues a write.
    graph, mobility = _vdnn_all_mobility(net)
    writers = [s.op for s in graph.steps if summed in s.writes]
    assert len(writers) == 2 and not any(graph.op(w).inplace for w in writers)
    assert mobility[summed] == "temporary"
    assert mobility[continued] == "movable"
    writers = [graph.op(s.op) for s in graph.steps if continued in s.writes]
    assert all(op.inplace for op in writers[1:])
