"""Op times: measured H100 conv fronts shipped with the package, scaled fronts elsewhere, a roofline
otherwise, and a measurement cache's own numbers first."""

import itertools
import math

import pytest
from ucudnn.solver.types import MicroConfig

from ucudnn.devices import PROFILES
from ucudnn.memory.graph import from_network
from ucudnn.memory.timing import conv_fronts, kernel_front, step_costs
from ucudnn.network.zoo import layers
from ucudnn.problem import ConvProblem


def test_h100_convs_come_from_measurements_and_fronts_are_pareto():
    fronts = conv_fronts(from_network("vgg16", 128), PROFILES["h100"])
    assert len(fronts) == 13 * 3 - 1  # conv1_1 has no bwd_data
    for options in fronts.values():
        assert options[0].source == "measured"
        for a, b in itertools.pairwise(options):
            assert a.workspace < b.workspace and a.time_ms > b.time_ms


def test_other_devices_scale_the_h100_front_by_the_roofline_ratio():
    problem = layers("vgg16", 128)[3].problem.with_kind("bwd_filter")
    h100 = kernel_front(PROFILES["h100"], problem)
    k40 = kernel_front(PROFILES["k40"], problem)
    assert [o.workspace for o in k40] == [o.workspace for o in h100]
    ratios = {round(k.time_ms / h.time_ms, 9) for k, h in zip(k40, h100)}
    assert len(ratios) == 1 and ratios.pop() > 10  # one factor; a K40 is much slower
    assert k40[0].source == "scaled"


def test_an_unmeasured_problem_takes_the_roofline():
    problem = ConvProblem(n=8, c=7, h=9, w=9, k=5, r=3, s=3)
    (only,) = kernel_front(PROFILES["k40"], problem)
    assert only.source == "roofline" and only.workspace == 0
    traffic = 4 * (8 * 7 * 81 + 8 * 5 * 49 + 5 * 7 * 9)
    assert only.time_ms == pytest.approx(PROFILES["k40"].roofline_ms(problem.flops, traffic))


def test_larger_batches_run_as_equal_micro_batches():
    small = kernel_front(PROFILES["h100"], layers("vgg16", 128)[2].problem)
    large = kernel_front(PROFILES["h100"], layers("vgg16", 512)[2].problem)  # nothing measured at 512
    assert large and all(
        o.config.split("x")[0] in {"2", "4", "8", "16", "32", "64", "128", "256", "512"} for o in large
    )
    assert min(o.time_ms for o in large) <= 4 * min(o.time_ms for o in small) * 1.0001


def test_step_costs_follow_the_workspace_budget():
    g = from_network("vgg16", 128)
    fronts = conv_fronts(g, PROFILES["h100"])
    free = step_costs(g, PROFILES["h100"], fronts=fronts)
    tight = step_costs(g, PROFILES["h100"], workspace=0, fronts=fronts)
    assert sum(c.ms for c in tight) >= sum(c.ms for c in free)
    for step, cost in zip(g.steps, tight):
        if step.kernels:
            assert cost.workspace == max(fronts[(step.op, k)][0].workspace for k in step.kernels)
            assert cost.ms == pytest.approx(sum(fronts[(step.op, k)][0].time_ms for k in step.kernels))
        else:
            assert math.isfinite(cost.ms)


def test_a_measurement_cache_comes_first(tmp_path):
    from ucudnn.db import Cache

    problem = layers("alexnet", 16)[2].problem
    db = tmp_path / "m.db"
    cache = Cache(str(db))
    cache.store(
        device="Tesla K40 (sm_35)",
        backend="cudnn",
        versions="x",
        problem_key=problem.key,
        micros=[MicroConfig("slow_small", 16, 9.0, 0), MicroConfig("fast_big", 16, 1.0, 1 << 20)],
    )
    cache.close()
    fronts = conv_fronts(from_network("alexnet", 16), PROFILES["k40"], db=str(db))
    assert [(o.time_ms, o.workspace) for o in fronts[("conv3", "fwd")]] == [(9.0, 0), (1.0, 1 << 20)]
    assert fronts[("conv3", "bwd_data")][0].source != "measured"  # not in the cache: scaled from the H100


def test_an_op_measured_on_the_device_costs_what_was_measured_each_way():
    import dataclasses

    g = from_network("resnet18", 4)
    ops = tuple(
        dataclasses.replace(op, measured_ms=1.5, measured_bwd_ms=0.25)
        if op.type == "batchnorm"
        else dataclasses.replace(op, measured_ms=2.0)
        if op.type == "relu"
        else op
        for op in g.ops
    )
    costs = step_costs(dataclasses.replace(g, ops=ops), PROFILES["h100"])
    seen = set()
    for step, cost in zip(g.steps, costs):
        kind = g.op(step.op).type
        if kind == "batchnorm":
            assert cost.ms == (1.5 if step.phase == "fwd" else 0.25)
        elif kind == "relu":
            assert cost.ms == (2.0 if step.phase == "fwd" else 4.0)  # no backward measured: twice the forward
        seen.add((kind, step.phase))
    assert {("batchnorm", "fwd"), ("batchnorm", "bwd"), ("relu", "fwd"), ("relu", "bwd")} <= seen
