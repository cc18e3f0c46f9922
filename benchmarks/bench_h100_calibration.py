"""The H100 profile's predicted everything-resident step against the PyTorch steps recorded on that H100.

The recorded steps (the H100 run of 2026-11-22, torchvision models, SGD, TF32 default) ship in
``ucudnn/memory/data/h100_steps.json``; the prediction is `ucudnn.memory.planner.baseline` on the zoo
graph with the H100 profile, calibrated (``ucudnn.memory.timing.CALIBRATIONS``) and not. No GPU needed.

    python benchmarks/bench_h100_calibration.py
"""

from __future__ import annotations

import json
import os
import sys
from importlib import resources
from unittest import mock

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import table  # noqa: E402

from ucudnn.devices import PROFILES  # noqa: E402
from ucudnn.memory import timing  # noqa: E402
from ucudnn.memory.graph import from_network  # noqa: E402
from ucudnn.memory.planner import baseline  # noqa: E402


def parts(graph, device) -> tuple[float, float]:
    fronts = timing.conv_fronts(graph, device)
    costs = timing.step_costs(graph, device, fronts=fronts)
    conv = sum(c.ms for st, c in zip(graph.steps, costs) if st.kernels)
    return conv, sum(c.ms for c in costs) - conv


def main() -> None:
    device = PROFILES["h100"]
    recorded = json.loads(resources.files("ucudnn.memory").joinpath("data", "h100_steps.json").read_text("utf-8"))
    rows = []
    for s in recorded["steps"]:
        try:
            graph = from_network(s["network"], s["batch"])
        except Exception:  # noqa: BLE001 - a network the zoo lacks (DenseNet-121)
            rows.append([s["network"], s["batch"], s["step_ms"], "-", "-", "-", "-", "not in the zoo"])
            continue
        with mock.patch.dict(timing.CALIBRATIONS, clear=True):
            raw = baseline(graph, device).step_ms
            raw_conv, raw_other = parts(graph, device)
        cal = baseline(graph, device).step_ms
        cal_conv, cal_other = parts(graph, device)
        sources = {o.source for opts in timing.conv_fronts(graph, device).values() for o in opts}
        fitted = (s["network"], s["batch"]) in {("resnet50", 128), ("vgg16", 128)}
        rows.append([s["network"], s["batch"], s["step_ms"], f"{raw:.1f} ({raw_conv:.1f}+{raw_other:.1f})",
                     f"{raw / s['step_ms'] - 1:+.1%}", f"{cal:.1f} ({cal_conv:.1f}+{cal_other:.1f})",
                     f"{cal / s['step_ms'] - 1:+.1%}",
                     ("fitted" if fitted else "held out") + ("" if sources == {"measured"} else ", some convs roofline")])
    print(table(["network", "batch", "recorded ms", "uncalibrated ms (conv+other)", "vs recorded",
                 "calibrated ms (conv+other)", "vs recorded", "role"], rows))


if __name__ == "__main__":
    main()
