"""The H100 profile's calibration against the PyTorch steps recorded on that H100 (ucudnn/memory/data/h100_steps.json)."""

from __future__ import annotations

import dataclasses
import json
from importlib import resources

import pytest

from ucudnn.devices import PROFILES, ROOFLINE_EFFICIENCY
from ucudnn.memory.graph import from_network
from ucudnn.memory.planner import baseline
from ucudnn.memory.timing import (
    CALIBRATIONS,
    _measured_front,
    _problem_key,
    calibration,
    conv_fronts,
    kernel_front,
    other_ms,
)

H100 = PROFILES["h100"]
TOLERANCE = 0.15  # the target for a predicted step against a measured one


def _recorded() -> dict:
    return json.loads(resources.files("ucudnn.memory").joinpath("data", "h100_steps.json").read_text(encoding="utf-8"))


def _steps():
    return [(s["network"], s["batch"], s["step_ms"]) for s in _recorded()["steps"]]


@pytest.mark.parametrize("network,batch", [("resnet50", 128), ("vgg16", 128)])
def test_the_fitted_steps_are_predicted_within_fifteen_percent(network, batch):
    measured = next(ms for n, b, ms in _steps() if (n, b) == (network, batch))
    step = baseline(from_network(network, batch), H100).step_ms
    assert abs(step / measured - 1) <= TOLERANCE, (network, batch, step, measured)


@pytest.mark.parametrize(
    "network,batch,measured", [s for s in _steps() if s[:2] not in {("resnet50", 128), ("vgg16", 128)}]
)
def test_steps_not_fitted_are_predicted_within_fifteen_percent_where_the_convs_were_measured(network, batch, measured):
    try:
        graph = from_network(network, batch)
    except Exception:  # noqa: BLE001 - any failure: not in the zoo
        pytest.skip(f"{network} is not in the zoo")
    fronts = conv_fronts(graph, H100)
    if any(o.source != "measured" for options in fronts.values() for o in options):
        pytest.skip(f"{network}: some conv kernels have no H100 measurement (roofline): not what was calibrated")
    step = baseline(graph, H100, fronts).step_ms
    assert abs(step / measured - 1) <= TOLERANCE, (network, batch, step, measured)


def test_the_calibration_scales_the_h100s_own_measurements_and_its_other_operations():
    cal = calibration(H100)
    assert cal is CALIBRATIONS["h100"] and 0 < cal.conv_scale < 1 and cal.other_efficiency > ROOFLINE_EFFICIENCY
    graph = from_network("resnet50", 8)
    layer = graph.conv_ops[0]
    problem = layer.conv.with_kind("fwd")
    raw = _measured_front("h100", _problem_key(problem), "fwd", problem.n)
    got = kernel_front(H100, problem)
    assert [o.time_ms for o in got] == pytest.approx([o.time_ms * cal.conv_scale for o in raw])
    assert [o.workspace for o in got] == [o.workspace for o in raw]
    assert other_ms(H100, 1e9, 1e9) == pytest.approx(
        H100.roofline_ms(1e9, 1e9) * ROOFLINE_EFFICIENCY / cal.other_efficiency
    )
    # another link (the CLI's --devices-per-link) computes as the measured device did: still calibrated
    linked = dataclasses.replace(H100, devices_per_link=2)
    assert calibration(linked) is cal and kernel_front(linked, problem) == got


def test_other_devices_and_edited_profiles_are_not_calibrated():
    problem = from_network("resnet50", 8).conv_ops[0].conv.with_kind("fwd")
    raw = _measured_front("h100", _problem_key(problem), "fwd", problem.n)
    v100 = PROFILES["v100"]  # no TF32: its fronts scale the H100's raw float32 measurements
    assert calibration(v100) is None
    scaled = kernel_front(v100, problem)
    assert all(o.source == "scaled" for o in scaled)
    ratio = scaled[0].time_ms / raw[0].time_ms
    assert [o.time_ms for o in scaled] == pytest.approx([o.time_ms * ratio for o in raw])
    faster = dataclasses.replace(H100, fp32_tflops=2 * H100.fp32_tflops)
    assert calibration(faster) is None
    assert other_ms(faster, 1e9, 1e12) == faster.roofline_ms(1e9, 1e12)
