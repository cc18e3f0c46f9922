"""Planning several limits in one pass (`ucudnn.memory.planner.frontier`, `ucudnn.torch.plan_frontier`): the same
plans as each limit planned alone, each reused simulation the answer a fresh one gives, the heuristics that
`optimal` compares itself with computed once, the copy-less path of the simulator its event loop's answer; the
progress bar of ``ucudnn plan`` kept off stderr under ``--json``."""

from __future__ import annotations

import json
import random
import sys

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from ucudnn.cli.main import main

from ucudnn.devices import PROFILES
from ucudnn.errors import InvalidInput
from ucudnn.memory import optimal, reuse
from ucudnn.memory.graph import from_network
from ucudnn.memory.planner import POLICIES, frontier, make_executed_plan, make_plan
from ucudnn.memory.reuse import PlanCache
from ucudnn.memory.simulate import simulate
from ucudnn.memory.timing import step_costs
from ucudnn.memory.vdnn import actions_for
from ucudnn.torch import plan_frontier, plan_memory, zoo

H100, V100 = PROFILES["h100"], PROFILES["v100"]


@pytest.fixture(autouse=True)
def _solved_to_their_gap(monkeypatch):
    """HiGHS stops at its gap, never at the wall-time limit a busy machine can reach first: the plans compared are
    then a function of their inputs alone."""
    monkeypatch.setitem(optimal.plan.__kwdefaults__, "time_limit_s", 600.0)


FRACTIONS = (1.0, 0.5, 0.25)  # of the everything-resident peak: from nothing to do to recomputing most maps


def _figures(plan) -> tuple:
    return (
        plan.policy,
        plan.fits,
        plan.peak_bytes,
        plan.average_bytes,
        plan.step_ms,
        plan.stall_ms,
        plan.bytes_offloaded,
        plan.search,
        plan.tensors,
        plan.conv_workspace,
        plan.device_tensors,
    )


def _limits(graph, device) -> list[int]:
    top = make_plan(graph, device, 2**62, "vdnn-all").baseline_peak_bytes
    return [int(top * f) for f in FRACTIONS] + [1]  # 1: below every plan, the smallest there is


@pytest.mark.parametrize(
    ("network", "batch", "device", "devices"), [("resnet18", 16, H100, 1), ("alexnet", 64, V100, 2)]
)
def test_a_frontier_makes_the_plans_each_limit_makes_alone(network, batch, device, devices):
    """Every policy, at limits from keeping everything to below every plan: the frontier's plans (one cache for
    all) are those each limit gives planned alone (a cache of its own, nothing reused from another limit)."""
    graph = from_network(network, batch)
    limits = _limits(graph, device)
    for policy in POLICIES:
        together = frontier(graph, device, limits, policy, devices=devices)
        alone = [make_plan(graph, device, limit, policy, devices=devices, cache=PlanCache()) for limit in limits]
        assert [_figures(p) for p in together] == [_figures(p) for p in alone], policy
    assert any(not p.fits for p in together) and any(p.fits for p in together)  # (the limits span both)


def test_plan_frontier_plans_a_pytorch_model_as_plan_memory_does_limit_by_limit():
    """A model captured on fake tensors for the H100's profile: `plan_frontier`'s plans (one capture, one cache)
    are those of `plan_memory` at each limit on a fresh copy of the model (a capture and a cache of its own)."""

    def model():
        torch.manual_seed(0)
        return zoo.build("resnet18", num_classes=10)

    with FakeTensorMode() as mode:
        x = mode.from_tensor(torch.randn(16, 3, 64, 64))
    everything = plan_memory(model(), x, memory_limit=2**40, device="h100")
    smallest = plan_memory(model(), x, memory_limit=1, device="h100")
    limits = [2**40, (everything.peak_bytes + smallest.peak_bytes) // 2, 1]
    together = plan_frontier(model(), x, limits, device="h100")
    alone = [plan_memory(model(), x, memory_limit=limit, device="h100") for limit in limits]
    assert [_figures(p) for p in together] == [_figures(p) for p in alone]
    assert together[1].fits and any(t.action != "keep" for t in together[1].tensors if t.action != "release")


@pytest.mark.parametrize("limits", [[], "2GiB", ["2GiB", "two"], [2**30, 0]])
def test_plan_frontier_refuses_limits_that_are_not_a_list_of_sizes(limits):
    with pytest.raises(InvalidInput, match=r"memory_limits"):
        plan_frontier(zoo.build("resnet18", num_classes=10), torch.randn(2, 3, 32, 32), limits, device="h100")


def test_a_reused_simulation_is_what_a_fresh_one_gives_at_that_limit():
    """Plans that offload (one device; two devices that act differently) and one that copies nothing, simulated
    through one cache at limits in random order: each answer equals a fresh simulation at its limit, and some
    were answered from a run at another limit (so that the check covers reuse)."""
    graph = from_network("resnet18", 32)
    costs = step_costs(graph, H100)
    offload, keep = actions_for(graph, "all"), actions_for(graph, "none")
    half = dict(keep, **{s: "offload" for s, a in list(offload.items())[::2] if a == "offload"})
    questions = [
        ({"actions": offload, "prefetch": "layer"}, 1),
        ({"actions": offload, "prefetch": "adaptive"}, 1),
        ({"actions": [offload, half], "prefetch": "layer"}, 2),
        ({"actions": keep}, 1),
    ]
    peak = simulate(graph, H100, costs, keep).peak_bytes
    rng = random.Random(0)
    limits = [None, *(rng.randint(peak // 10, 2 * peak) for _ in range(12)), peak, peak - 1]
    cache = PlanCache()
    for limit in rng.sample(limits, len(limits)):
        for kwargs, devices in questions:
            got = cache.simulate(graph, H100, costs, memory_limit=limit, devices=devices, **kwargs)
            assert got == simulate(graph, H100, costs, memory_limit=limit, devices=devices, **kwargs)
    assert cache.counts["reused"] > len(limits)  # the plan that copies nothing: one run for every limit at least


def test_the_copyless_path_is_the_event_loops_answer():
    """A plan that copies nothing runs each device's steps in a row (the devices given one mapping); given a
    mapping each (equal, not the same object), the devices go through the event loop: the same figures."""
    graph = from_network("googlenet", 16)
    costs = step_costs(graph, H100)
    keep = actions_for(graph, "none")
    recompute = {s: ("recompute" if a == "keep" and i % 3 == 1 else a) for i, (s, a) in enumerate(keep.items())}
    for actions in (keep, recompute):
        peak = simulate(graph, H100, costs, actions).peak_bytes
        for limit in (None, peak, peak // 2):
            shared = simulate(graph, H100, costs, actions, memory_limit=limit, devices=2)
            each = simulate(graph, H100, costs, [dict(actions), dict(actions)], memory_limit=limit, devices=2)
            assert shared == each
            assert shared.fits == (limit is None or limit >= peak)


def _counted(monkeypatch) -> list:
    calls: list = []
    run = reuse.simulate_bounded

    def counting(graph, device, costs, actions=None, **kwargs):
        calls.append((actions, kwargs.get("memory_limit")))
        return run(graph, device, costs, actions, **kwargs)

    monkeypatch.setattr(reuse, "simulate_bounded", counting)
    return calls


def test_a_frontier_computes_the_heuristics_once(monkeypatch):
    """Three limits (everything, halfway, the smallest), `optimal` as executed: the frontier runs the simulator
    fewer times than the three plans made apart, the work that no limit changes (the baseline, checkpoint's
    segmentations) once, and its plans are theirs."""
    graph = from_network("resnet18", 16)
    ends = [make_plan(graph, H100, limit, "optimal").peak_bytes for limit in (2**62, 1)]
    limits = [2**62, sum(ends) // 2, 1]
    calls = _counted(monkeypatch)
    apart = [make_executed_plan(graph, H100, limit, "optimal", cache=PlanCache()) for limit in limits]
    simulated_apart = len(calls)
    calls.clear()
    cache = PlanCache()
    together = frontier(graph, H100, limits, "optimal", executed=True, cache=cache)
    assert [_figures(p) for p in together] == [_figures(p) for p in apart]
    assert len(calls) == cache.counts["simulated"]
    baselines = [c for c in calls if c == (None, None)]
    assert len(baselines) == 1  # everything resident, no limit: the baseline, simulated once for all three
    assert cache.counts["made:baseline"] == 1 and cache.counts["made:checkpoint segmentations"] == 1
    assert len(calls) < 0.8 * simulated_apart, (len(calls), simulated_apart)


@pytest.mark.parametrize("as_json", [True, False])
def test_plan_shows_its_progress_on_a_terminal_and_never_under_json(monkeypatch, capsys, as_json):
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    argv = ["plan", "--network", "alexnet", "--batch", "32", "--memory", "8GiB", "--compare"]
    code = main([*argv, "--json"] if as_json else argv)
    out, err = capsys.readouterr()
    assert code == 0, err
    assert ("planning" in err) is not as_json
    if as_json:
        assert len(json.loads(out)["policies"]) == len(POLICIES)  # stdout is the JSON alone
