"""`ucudnn plan` and `ucudnn devices`: the JSON contract, exit codes, the plot and bad input."""

import json

import pytest
from ucudnn.cli.main import main

from ucudnn.memory.vdnn import SEARCH_PASSES

PLAN_KEYS = {
    "network",
    "batch",
    "device",
    "devices",
    "memory_limit",
    "policy",
    "fits",
    "peak_bytes",
    "average_bytes",
    "baseline_peak_bytes",
    "step_ms",
    "baseline_step_ms",
    "overhead",
    "stall_ms",
    "bytes_offloaded",
    "tensors",
    "device_tensors",
    "conv_workspace",
}


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_plan_json_follows_the_contract(capsys):
    code, out, err = run(
        capsys,
        "plan",
        "--network",
        "vgg16",
        "--batch",
        "32",
        "--device",
        "k40",
        "--memory",
        "3GiB",
        "--policy",
        "vdnn-all",
        "--json",
    )
    assert code == 0, err
    plan = json.loads(out)
    assert set(plan) == PLAN_KEYS
    assert plan["network"] == "vgg16" and plan["batch"] == 32 and plan["device"] == "k40"
    assert plan["memory_limit"] == 3 * 2**30 and plan["policy"] == "vdnn-all" and plan["fits"] is True
    assert plan["peak_bytes"] <= plan["memory_limit"] < plan["baseline_peak_bytes"]
    assert plan["overhead"] == pytest.approx(plan["step_ms"] / plan["baseline_step_ms"] - 1)
    assert {t["action"] for t in plan["tensors"]} <= {"keep", "offload", "recompute", "release"}
    assert plan["bytes_offloaded"] == sum(t["bytes"] for t in plan["tensors"] if t["action"] == "offload")
    assert {c["kind"] for c in plan["conv_workspace"]} == {"fwd", "bwd_data", "bwd_filter"}


def test_compare_lists_every_policy_and_the_table_reads(capsys):
    code, out, err = run(
        capsys,
        "plan",
        "--network",
        "alexnet",
        "--batch",
        "16",
        "--device",
        "k40",
        "--memory",
        "1GiB",
        "--compare",
        "--json",
    )
    assert code == 0, err
    policies = json.loads(out)["policies"]
    assert {"vdnn-all", "vdnn-conv", "vdnn-dyn", "optimal"} <= {p["policy"] for p in policies}
    assert all(set(p) - {"search"} == PLAN_KEYS for p in policies)
    dyn = next(p for p in policies if p["policy"] == "vdnn-dyn")
    assert dyn["search"] in SEARCH_PASSES  # the extension: which of vDNN_dyn's passes gave the plan
    code, out, _ = run(
        capsys, "plan", "--network", "alexnet", "--batch", "16", "--device", "k40", "--memory", "1GiB", "--compare"
    )
    assert code == 0 and "vdnn-dyn" in out and "overhead" in out


def test_nothing_fits_exits_1_naming_the_smallest_limit_that_would(capsys):
    code, out, err = run(
        capsys,
        "plan",
        "--network",
        "vgg16",
        "--batch",
        "32",
        "--device",
        "k40",
        "--memory",
        "64MiB",
        "--policy",
        "vdnn-all",
        "--json",
    )
    assert code == 1
    assert json.loads(out)["fits"] is False  # the plan is still printed
    assert "smallest limit that fits" in err and len(err.strip().splitlines()) == 1
    needed = int(err.split("(")[1].split(" bytes")[0])
    code, out, _ = run(
        capsys,
        "plan",
        "--network",
        "vgg16",
        "--batch",
        "32",
        "--device",
        "k40",
        "--memory",
        str(needed),
        "--policy",
        "vdnn-all",
        "--json",
    )
    assert code == 0 and json.loads(out)["fits"] is True
    code, _, _ = run(
        capsys,
        "plan",
        "--network",
        "vgg16",
        "--batch",
        "32",
        "--device",
        "k40",
        "--memory",
        str(int(needed * 0.97)),
        "--policy",
        "vdnn-all",
        "--json",
    )
    assert code == 1  # no much smaller limit would do


def test_swap_multi_plan_says_what_every_gpu_does(capsys):
    from ucudnn.memory import swap_multi
    from ucudnn.memory.graph import from_network

    argv = [
        "plan",
        "--network",
        "resnet50",
        "--batch",
        "16",
        "--device",
        "h100",
        "--memory",
        "1200MiB",
        "--policy",
        "swap-multi",
        "--devices",
        "4",
        "--devices-per-link",
        "4",
    ]
    code, out, err = run(capsys, *argv, "--json")
    assert code == 0, err
    plan = json.loads(out)
    assert set(plan) == PLAN_KEYS and plan["devices"] == 4 and plan["fits"]
    per_device = plan["device_tensors"]
    assert len(per_device) == 4 and per_device[0] == plan["tensors"]  # `tensors` keeps meaning GPU 0's
    offloaded = [[t["name"] for t in ts if t["action"] == "offload"] for ts in per_device]
    # the four GPUs of the switch swap the layers section III.A gives each (i % x + j x), not GPU 0's
    graph = from_network("resnet50", 16)
    layers = swap_multi.swappable(graph)
    b = len(offloaded[0])
    assert 0 < b and all(len(o) == b for o in offloaded)
    for d, names in enumerate(offloaded):
        assert set(names) == {layers[k] for k in swap_multi.staggered_layers(d, len(layers), b)}
    assert len({tuple(o) for o in offloaded}) > 1
    assert plan["bytes_offloaded"] == max(sum(t["bytes"] for t in ts if t["action"] == "offload") for ts in per_device)
    code, out, err = run(capsys, *argv)
    assert code == 0, err
    lines = [line for line in out.splitlines() if line.strip().startswith("device ")]
    assert len(lines) == 4
    for d, names in enumerate(offloaded):
        assert lines[d].strip().startswith(f"device {d}: offloads {b} ") and lines[d].endswith(", ".join(names))


def test_plot_draws_a_png(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    path = tmp_path / "timeline.png"
    code, _, err = run(
        capsys,
        "plan",
        "--network",
        "vgg16",
        "--batch",
        "16",
        "--device",
        "k40",
        "--memory",
        "2GiB",
        "--policy",
        "vdnn-conv",
        "--plot",
        str(path),
    )
    assert code == 0, err
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_user_device_profile_from_json(tmp_path, capsys):
    profile = {
        "name": "mygpu",
        "model": "My GPU",
        "memory_bytes": 4 * 2**30,
        "h2d_gbps": 10.0,
        "d2h_gbps": 10.0,
        "duplex_gbps": 16.0,
        "devices_per_link": 1,
        "fp32_tflops": 5.0,
        "memory_gbps": 300.0,
    }
    path = tmp_path / "mygpu.json"
    path.write_text(json.dumps(profile))
    code, out, err = run(
        capsys,
        "plan",
        "--network",
        "alexnet",
        "--batch",
        "16",
        "--device",
        str(path),
        "--policy",
        "vdnn-conv",
        "--json",
    )
    assert code == 0, err
    plan = json.loads(out)
    assert plan["device"] == "mygpu" and plan["memory_limit"] == 4 * 2**30


def test_devices_lists_the_profiles(capsys):
    code, out, _ = run(capsys, "devices", "--json")
    assert code == 0
    names = {d["name"]: d for d in json.loads(out)["devices"]}
    assert {"k40", "p100", "v100", "h100"} <= set(names)
    assert names["h100"]["h2d_gbps"] == 54.9 and names["h100"]["conv_timings"] == "measured"
    code, out, _ = run(capsys, "devices")
    assert code == 0 and "Tesla K40" in out


@pytest.mark.parametrize(
    "argv,words",
    [
        (["--network", "nope"], "unknown network"),
        (["--network", "vgg16", "--batch", "0"], "batch"),
        (["--network", "vgg16", "--memory", "lots"], "size"),
        (["--network", "vgg16", "--device", "k99"], "unknown device"),
        (["--network", "vgg16", "--policy", "magic"], "available"),
        (["--network", "vgg16", "--devices", "0"], "devices"),
        (["--network", "vgg16", "--devices-per-link", "0"], "devices-per-link"),
        (["--network", "vgg16", "--memory", "0"], "memory"),
    ],
)
def test_bad_input_exits_2_with_one_line(argv, words, capsys):
    code, _out, err = run(capsys, "plan", *argv)
    assert code == 2
    assert words in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err
