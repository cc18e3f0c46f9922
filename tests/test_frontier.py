"""Planning several limits in one pass (`ucudnn.memory.planner.frontier`, `ucudnn.torch.plan_frontier`): the same
plans as each limit planned alone, each reused simulation the answer a fresh one gives, the heuristics that
`optimal` compares itself with computed once, the copy-less path of the simulator its event loop's answer; the
progress bar of ``ucudnn plan`` kept off stderr under ``--json``."""

from __future__ import annotations

import dataclasses
import json
import random
import sys

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from ucudnn.cli.main import main
from ucudnn.solver import memplan

from ucudnn.devices import PROFILES
from ucudnn.errors import InvalidInput
from ucudnn.memory import dymem, optimal, reuse
from ucudnn.memory.graph import from_network
from ucudnn.memory.planner import POLICIES, frontier, make_executed_plan, make_plan
from ucudnn.memory.reuse import PlanCache
from ucudnn.memory.simulate import simulate
from ucudnn.memory.timing import fastest, step_costs
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
    segmentations, the program's tables and its relaxation's bound) once, and its plans are theirs."""
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
    for kind in ("baseline", "checkpoint segmentations", "optimal tables", "optimal peak bound"):
        assert cache.counts[f"made:{kind}"] == 1, kind
    assert cache.counts["reused"] > 0 and len(calls) < simulated_apart, (len(calls), simulated_apart)


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


# Below every plan (a limit nothing fits): the smallest plan, made without the searches that cannot give it.

HOST = dataclasses.replace(H100, shares_host_memory=True)  # nothing offloaded: the program recomputes or keeps


def _mip_solves(monkeypatch) -> list:
    calls: list = []
    solve = memplan.solve

    def counting(*args, **kwargs):
        if not kwargs.get("relaxed"):
            calls.append(kwargs.get("minimise_peak", False))
        return solve(*args, **kwargs)

    monkeypatch.setattr(memplan, "solve", counting)
    return calls


@pytest.mark.parametrize(
    ("network", "batch", "device"),
    [("resnet50", 32, H100), ("alexnet", 64, V100), ("googlenet", 16, H100), ("resnet18", 16, HOST)],
)
def test_below_every_plan_the_smallest_plan_is_the_one_the_whole_search_gives(monkeypatch, network, batch, device):
    """At a limit below every plan, `optimal` (and as executed) gives the plan it gives when the program is always
    searched for its least peak (`PROGRAM_REACH` unbounded): leaving the program out where its relaxation's bound
    is far above a static plan or a heuristic's loses nothing; and the bound is below the program's least peak."""
    graph = from_network(network, batch)
    solves = _mip_solves(monkeypatch)
    quick = [make_plan(graph, device, 1, "optimal"), make_executed_plan(graph, device, 1, "optimal")]
    skipped = not solves
    monkeypatch.setattr(optimal, "PROGRAM_REACH", float("inf"))
    solves.clear()
    whole = [make_plan(graph, device, 1, "optimal"), make_executed_plan(graph, device, 1, "optimal")]
    assert solves  # (the whole search solves the program)
    assert [_figures(p) for p in quick] == [_figures(p) for p in whole]
    cache = PlanCache()
    found = optimal.search(graph, device, 1, cache=cache)
    bound = next(v for k, v in cache._values.items() if k[0] == "optimal peak bound")
    least = next(v for k, v in cache._values.items() if k[0] == "optimal least peak")
    assert 0 < bound <= least[0].peak_bytes
    assert not found.plan.fits
    if device is HOST:
        assert not skipped  # no static plan offloads there: the program's recomputation is searched


def test_below_every_plan_the_program_is_left_out_where_a_heuristic_is_far_smaller(monkeypatch):
    """ResNet-50 on the H100 at a limit nothing fits: a vDNN plan is half the least peak the program allows (its
    copies must hide behind compute), so no 0-1 program is solved, and the plan is a static or heuristic one."""
    graph = from_network("resnet50", 32)
    solves = _mip_solves(monkeypatch)
    found = optimal.search(graph, H100, 1, cache=PlanCache())
    assert solves == []
    assert found.chosen != "program" and found.rounds == 0 and not found.plan.fits


def test_below_every_plan_dymem_and_swap_multi_give_their_smallest_without_searching(monkeypatch):
    """Where even the least a heuristic holds does not fit: Dymem's plan is the closest to the limit of every
    configuration it tries (offloading and look-ahead, fastest and smallest workspaces), simulated apart; swap-multi
    moves no prefetch earlier (an earlier one holds its map longer): its simulations are its bisection's and the
    two triggers it starts from."""
    graph = from_network("resnet18", 16)
    cache = PlanCache()
    fronts = cache.fronts(graph, H100)
    planned = make_plan(graph, H100, 1, "dymem", cache=PlanCache())
    peaks = []
    fast = {k: fastest(v).workspace for k, v in fronts.items()}
    for workspace in (fast, {k: v[0].workspace for k, v in fronts.items()}):
        costs = step_costs(graph, H100, workspace=workspace, fronts=fronts)
        for mode in ("none", "conv", "all"):
            actions = actions_for(graph, mode)
            for lookahead in (1, 2):
                prefetch = dymem.prefetch_schedule(graph, actions, conv_lookahead=lookahead)
                peaks.append(simulate(graph, H100, costs, actions, memory_limit=1, prefetch=prefetch).peak_bytes)
    assert not planned.fits and planned.peak_bytes == min(peaks)
    calls = _counted(monkeypatch)
    swapped = make_plan(graph, H100, 1, "swap-multi", cache=PlanCache())
    assert not swapped.fits
    assert len(calls) <= 4, len(calls)  # everything swapped (its bisection's first try), then the two triggers


@pytest.mark.parametrize(
    ("network", "batch", "device", "devices"), [("resnet18", 16, H100, 1), ("alexnet", 64, V100, 2)]
)
def test_where_everything_kept_fits_it_is_the_plan_unsearched(monkeypatch, network, batch, device, devices):
    """At a limit the baseline fits (and at none): no 0-1 program is solved, the plan keeps everything at the
    baseline's step, and no other policy's plan there is faster."""
    graph = from_network(network, batch)
    solves = _mip_solves(monkeypatch)
    top = make_plan(graph, device, 2**62, "vdnn-all", devices=devices).baseline_peak_bytes
    for limit in (2**62, top):
        plan = make_plan(graph, device, limit, "optimal", devices=devices, cache=PlanCache())
        assert plan.fits and plan.step_ms == plan.baseline_step_ms and plan.bytes_offloaded == 0
        assert all(t.action in ("keep", "release") for t in plan.tensors)
        for name in POLICIES:
            assert make_plan(graph, device, limit, name, devices=devices).step_ms >= plan.step_ms, name
    assert solves == []
