"""Device profiles: built-ins, user JSON files, and the estimates derived from them."""

import json

import pytest

from ucudnn.devices import PROFILES, DeviceProfile, load_profile
from ucudnn.errors import InvalidInput
from ucudnn.memory.plan import ConvWorkspace, MemoryPlan, TensorAction


def test_every_builtin_round_trips_through_json():
    for name, profile in PROFILES.items():
        assert profile.name == name
        assert DeviceProfile.from_json(json.loads(json.dumps(profile.to_json()))) == profile


def test_names_are_case_insensitive():
    assert load_profile("H100") is PROFILES["h100"]


def test_h100_host_link_is_the_measured_one():
    h100 = load_profile("h100")
    # 1 GB at 54.9 GB/s one way; at 91 GB/s shared by both directions, 45.5 GB/s each
    assert h100.copy_ms(10**9, "h2d") == pytest.approx(1e3 / 54.9)
    assert h100.copy_ms(10**9, "d2h", concurrent=True) == pytest.approx(1e3 / 45.5)


def test_roofline_takes_the_slower_of_compute_and_memory():
    k40 = load_profile("k40")
    compute_bound = k40.roofline_ms(flops=4.29e12, bytes_moved=1.0)
    memory_bound = k40.roofline_ms(flops=1.0, bytes_moved=288e9)
    assert compute_bound == pytest.approx(2e3)  # one second of peak at half efficiency
    assert memory_bound == pytest.approx(2e3)
    assert k40.roofline_ms(4.29e12, 288e9 * 2) == pytest.approx(4e3)


def test_user_profile_from_json(tmp_path):
    data = PROFILES["v100"].to_json() | {"name": "my_gpu", "memory_bytes": 3 * 2**30}
    path = tmp_path / "my_gpu.json"
    path.write_text(json.dumps(data))
    profile = load_profile(str(path))
    assert profile.name == "my_gpu" and profile.memory_bytes == 3 * 2**30


@pytest.mark.parametrize(
    "text, words",
    [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "JSON object"),
        ('{"name": "x"}', "missing field"),
    ],
)
def test_bad_user_profiles_are_refused(tmp_path, text, words):
    path = tmp_path / "bad.json"
    path.write_text(text)
    with pytest.raises(InvalidInput, match=words):
        load_profile(str(path))


def test_unknown_fields_and_bad_numbers_are_refused():
    data = PROFILES["k40"].to_json()
    with pytest.raises(InvalidInput, match="unknown field"):
        DeviceProfile.from_json(data | {"colour": "green"})
    with pytest.raises(InvalidInput, match="positive finite"):
        DeviceProfile.from_json(data | {"h2d_gbps": 0})
    with pytest.raises(InvalidInput, match="positive finite"):
        DeviceProfile.from_json(data | {"fp32_tflops": float("inf")})


def test_unknown_device_names_the_choices():
    with pytest.raises(InvalidInput, match="k40"):
        load_profile("voodoo2")


def test_memory_plan_json_round_trip():
    plan = MemoryPlan(
        network="vgg16",
        batch=256,
        device="k40",
        devices=1,
        memory_limit=12 * 2**30,
        policy="vdnn-all",
        fits=True,
        peak_bytes=5,
        average_bytes=3,
        baseline_peak_bytes=9,
        step_ms=12.0,
        baseline_step_ms=10.0,
        stall_ms=1.0,
        bytes_offloaded=7,
        tensors=(TensorAction("conv1_1", 4, "offload"),),
        conv_workspace=(ConvWorkspace("conv1_1", "fwd", 1024),),
    )
    data = json.loads(json.dumps(plan.to_json()))
    assert data["overhead"] == pytest.approx(0.2)
    assert MemoryPlan.from_json(data) == plan
    assert plan.action("conv1_1") == "offload" and plan.action("elsewhere") == "keep"
    with pytest.raises(InvalidInput, match="action"):
        TensorAction("x", 1, "teleport")
    with pytest.raises(InvalidInput, match="not a memory plan"):
        MemoryPlan.from_json({"network": "vgg16"})
