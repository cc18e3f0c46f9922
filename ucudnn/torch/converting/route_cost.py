"""The handle a converted layer makes for itself (`_new_handle`), and what it is made with on the CPU: the host
cost of routing a kernel through ucudnn (`route_overhead_ms`, measured once per process, charged as
``Handle(call_overhead=...)``), and the length of the in-step trials against torch's own convolution
(`TRIAL_RUNS`, `TRIAL_STEPS`)."""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F

from ucudnn.backends import get_backend
from ucudnn.backends.cpu import NATIVE, CpuBackend
from ucudnn.handle import Handle
from ucudnn.kernel.measure import interleaved_medians_ms
from ucudnn.torch.converting.launch import Geometry
from ucudnn.torch.converting.route import _ConvFunction, _Route

__all__ = ["TRIAL_RUNS", "TRIAL_STEPS", "route_overhead_ms"]

# Timed runs of each side in a kernel's in-step trial against torch's own convolution (CPU handles)
TRIAL_RUNS = 3
# Training steps until every trial of a converted model has closed: the kernels' (each side's first run
# untimed), then the layers' backward passes (`_BackwardTrial`) as many again
TRIAL_STEPS = 4 * (TRIAL_RUNS + 1)


@functools.cache
def route_overhead_ms() -> float:
    """Host time (ms) that routing one kernel of a CPU convolution through ucudnn costs beyond
    torch running it itself, measured once per process on a tiny layer (forward and backward,
    the three contenders alternately, medians):

    - direct: plain F.conv2d;
    - function: the layer as ucudnn's autograd Function with torch running every kernel in it;
    - routed: the same with all three kernels `native` through the handle (NumPy views, output
      tensors, the handle's launch, the launcher's copy).

    A kernel routed through ucudnn takes its layer off F.conv2d onto the Function, so it is
    charged the Function's whole cost plus one kernel's share of routing: (function - direct) +
    (routed - function) / 3. That is its marginal cost where torch runs the layer's other kernels
    (a layer with several routed kernels pays the Function once, so there it is charged more than
    it pays: the charge errs towards torch's own convolution). Rounded to 10 us, so that plans
    keyed by it recur across processes. Handles made by this module charge it
    (`Handle(call_overhead=...)`)."""
    # the probe needs autograd in float32, whatever mode its caller is in (convert under no_grad, ...)
    with torch.inference_mode(False), torch.enable_grad(), torch.autocast("cpu", enabled=False):
        times = _probe_route()
    function = max(0.0, times["function"] - times["direct"])
    return round(function + max(0.0, times["routed"] - times["function"]) / 3, 2)


def _probe_route() -> dict[str, float]:
    """Median ms of `route_overhead_ms`'s three contenders (forward and backward, alternately)."""
    handle = Handle(backend="cpu", policy="undivided", algos=[NATIVE], reps=1, db=False)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 4, 6, 6, generator=g, requires_grad=True)
    w = torch.randn(4, 4, 3, 3, generator=g, requires_grad=True)
    dy = torch.randn(1, 4, 6, 6, generator=g)
    fwd, bwd_data, bwd_filter = (
        handle.kernel(
            kind,
            tuple(x.shape),
            tuple(w.shape),
            stride=(1, 1),
            padding=(1, 1),
            dilation=(1, 1),
            groups=1,
            dtype="float32",
            layer="probe",
        )
        for kind in ("fwd", "bwd_data", "bwd_filter")
    )
    routes = {
        "function": _Route(handle, handle.generation, "cpu", "NCHW", None, None, None, direct=False),
        "routed": _Route(handle, handle.generation, "cpu", "NCHW", fwd, bwd_data, bwd_filter, direct=False),
    }
    geometry = Geometry((1, 1), (1, 1), (1, 1), False, (0, 0), 1)

    def through(route: _Route):
        return lambda: _ConvFunction.apply(x, w, None, route, geometry).backward(dy)

    return interleaved_medians_ms(
        {
            "direct": lambda: F.conv2d(x, w, None, 1, 1, 1, 1).backward(dy),
            **{name: through(route) for name, route in routes.items()},
        },
        reps=51,
        warmup=5,
    )


def _new_handle(**options: Any) -> Handle:
    """A Handle for torch layers. On the CPU its NumPy algorithms run on one thread (they run
    between torch's operations, whose thread pool owns the cores: `CpuBackend`'s docstring says
    why), each kernel planned as one of them is confirmed against torch's own convolution inside
    the first training steps (`Handle`'s ``trial_runs``), and it charges the measured
    `route_overhead_ms` unless the options give a `call_overhead` themselves."""
    backend = options.get("backend", "auto")
    if isinstance(backend, str):
        backend = get_backend(backend)
        if backend.name == "cpu":
            backend = CpuBackend(numpy_threads=1)
        options = {**options, "backend": backend}
    if backend.name != "cpu":
        return Handle(**options)
    # kernels measured alone are confirmed in the step: see Handle's trial_runs
    options = {"trial_runs": TRIAL_RUNS, **options}
    if "call_overhead" not in options:
        options["call_overhead"] = route_overhead_ms()
    return Handle(**options)
