"""The caller's per-call cost charged when choosing plans (issue 10): a NumPy algorithm is chosen
only where it beats `native` on the whole batch by more than `call_overhead`; charged plans are
cached apart from uncharged ones; ucudnn.torch measures the charge and its layers then run torch's
own convolution where that wins, with results equal to F.conv2d's."""

from __future__ import annotations

import math

import numpy as np
import pytest
from ucudnn.solver import wd
from ucudnn.solver.types import Configuration, MicroConfig

from ucudnn import Handle, InvalidInput
from ucudnn.backends.cpu import NATIVE, CpuBackend
from ucudnn.kernel import measure
from ucudnn.kernel.call_overhead import charged_fronts, native_undivided
from ucudnn.problem import ConvProblem

PROBLEM = ConvProblem.parse("n=2,c=3,h=6,w=6,k=4,r=3,s=3,pad=1")
CONV = {"padding": 1}


class StandInClock:
    """The clock WR's re-timing reads (`measure.run_clock`, set for every test here): seconds that pass only
    when a scripted run says so, so that a run takes exactly its given time, however loaded the machine."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def __call__(self) -> float:
        return self.seconds


CLOCK = StandInClock()


@pytest.fixture(autouse=True)
def _stand_in_clock(monkeypatch):
    monkeypatch.setattr(measure, "run_clock", CLOCK)


class Scripted(CpuBackend):
    """The cpu backend whose timings are given (ms by algorithm and micro-batch size): the
    kernels still run and are verified; measurements report the given times, and a run takes
    its given time on the stand-in clock (WR re-times its choice with real runs, read on that clock)."""

    def __init__(self, times: dict[tuple[str, int], float], run_times: dict | None = None) -> None:
        self.times = times
        self.run_times = times if run_times is None else run_times  # what runs take, if not what was measured

    def time_run_ms(self, problem, algo, operands, workspace, reps, beta=0.0):
        return [self.times[algo, problem.n]] * reps

    def run(self, problem, algo, **kwargs):
        super().run(problem, algo, **kwargs)
        CLOCK.seconds += self.run_times.get((algo, problem.n), 0.0) / 1e3


def _plan(times, overhead, *, policy="undivided", db=False, **options) -> Configuration:
    handle = Handle(
        backend=Scripted(times),
        policy=policy,
        algos=["im2col_gemm", NATIVE],
        db=db,
        reps=5,
        call_overhead=overhead,
        **options,
    )
    return handle.prepare("fwd", PROBLEM.x_shape, PROBLEM.w_shape, **CONV)


def _algos(config: Configuration) -> list[tuple[str, int]]:
    return [(m.algo, m.batch) for m in config.micros]


# ---- WR -----------------------------------------------------------------------------------------
# im2col wins by 3 ms, measured and run (WR re-times the two with real runs, interleaved, each taking its
# given time on the stand-in clock: the charge decides, not the scheduler)
UNDIVIDED = {("native", 2): 20.0, ("im2col_gemm", 2): 17.0}


@pytest.mark.parametrize("overhead, algo", [(0.0, "im2col_gemm"), (1.0, "im2col_gemm"), (6.0, NATIVE)])
def test_wr_picks_numpy_only_when_it_wins_by_more_than_the_charge(overhead, algo):
    assert _algos(_plan(UNDIVIDED, overhead)) == [(algo, 2)]


def test_wr_decides_on_real_runs_not_on_a_noisy_table():
    # measured under a load spike: native looked 15 ms slower; run side by side it is 1 ms slower
    backend = Scripted(
        {("native", 2): 20.0, ("im2col_gemm", 2): 5.0}, run_times={("native", 2): 20.0, ("im2col_gemm", 2): 19.0}
    )
    handle = Handle(
        backend=backend, policy="undivided", algos=["im2col_gemm", NATIVE], db=False, reps=5, call_overhead=4.0
    )
    assert _algos(handle.prepare("fwd", PROBLEM.x_shape, PROBLEM.w_shape, **CONV)) == [(NATIVE, 2)]


def test_wr_keeps_the_measured_times_of_the_chosen_plan():
    config = _plan(UNDIVIDED, 1.0)
    assert config.time == pytest.approx(17.0)  # the charge decides; it is not stored


def test_wr_charge_respects_the_workspace_limit():
    # native's declared workspace (its result plus unfolded columns) over the limit: it cannot be chosen
    shift_bytes = CpuBackend().workspace_size(PROBLEM, "shift_gemm")
    assert shift_bytes < CpuBackend().workspace_size(PROBLEM, NATIVE)
    handle = Handle(
        backend=Scripted({("native", 2): 1.0, ("shift_gemm", 2): 0.9}),
        policy="undivided",
        algos=["shift_gemm", NATIVE],
        db=False,
        call_overhead=10.0,
        workspace_limit=shift_bytes,
    )
    # (native does not fit: nothing to re-time against, so the 10 ms charge changes nothing)
    assert _algos(handle.prepare("fwd", PROBLEM.x_shape, PROBLEM.w_shape, **CONV)) == [("shift_gemm", 2)]


def test_charged_and_uncharged_plans_are_cached_apart(tmp_path):
    db = str(tmp_path / "cache.db")
    assert _algos(_plan(UNDIVIDED, 0.0, db=db)) == [("im2col_gemm", 2)]
    assert _algos(_plan(UNDIVIDED, 6.0, db=db)) == [(NATIVE, 2)]  # not the cached uncharged plan
    assert _algos(_plan(UNDIVIDED, 0.0, db=db)) == [("im2col_gemm", 2)]  # the old key still finds it


# ---- WD -----------------------------------------------------------------------------------------
# 2 x native at batch 1 (0.7 ms) beats native undivided (1.0) and im2col undivided (0.95) measured.
MICRO = {("native", 2): 1.0, ("native", 1): 0.35, ("im2col_gemm", 2): 0.95, ("im2col_gemm", 1): 0.5}


def _wd_plan(overhead) -> Configuration:
    handle = Handle(
        backend=Scripted(MICRO),
        policy="powerOfTwo",
        algos=["im2col_gemm", NATIVE],
        db=False,
        total_workspace="64MiB",
        call_overhead=overhead,
    )
    handle.register("a", PROBLEM, kinds=["fwd", "bwd_filter"])
    config = handle.prepare("fwd", PROBLEM.x_shape, PROBLEM.w_shape, layer="a", **CONV)
    assert {c.kind for c in handle.choices()} == {"fwd", "bwd_filter"}
    return config


@pytest.mark.parametrize(
    "overhead, expected",
    [
        (0.0, [(NATIVE, 1), (NATIVE, 1)]),
        (0.2, [(NATIVE, 1), (NATIVE, 1)]),  # wins by 0.3 > 0.2
        (0.4, [(NATIVE, 2)]),
    ],
)  # 0.7 + 0.4 > 1.0
def test_wd_charges_every_configuration_but_native_undivided(overhead, expected):
    assert _algos(_wd_plan(overhead)) == expected


def test_charged_fronts_map_the_solvers_choice_back_to_the_measured_configuration():
    native2, native1 = MicroConfig(NATIVE, 2, 1.0, 100), MicroConfig(NATIVE, 1, 0.35, 50)
    table = {1: [native1], 2: [native2]}
    micro = Configuration((native1, native1))
    # the uncharged front lacks native undivided: dominated by the micro-batched configuration
    fronts, originals = charged_fronts({"k": [micro]}, {"k": table}, 2, None, 0.4)
    chosen = wd.solve(fronts, 1000)["k"]
    assert originals.get(id(chosen), chosen).micros == (native2,)
    fronts, originals = charged_fronts({"k": [micro]}, {"k": table}, 2, None, 0.1)
    chosen = wd.solve(fronts, 1000)["k"]
    assert originals[id(chosen)] is micro and chosen.time == pytest.approx(0.8)


def test_native_undivided_needs_a_usable_measurement_within_the_limit():
    ok, broken = MicroConfig(NATIVE, 2, 1.0, 100), MicroConfig(NATIVE, 2, math.inf, 0, reason="x")
    assert native_undivided({2: [ok]}, 2, None).micros == (ok,)
    assert native_undivided({2: [ok]}, 2, 99) is None
    assert native_undivided({2: [broken], 1: [MicroConfig(NATIVE, 1, 0.1, 0)]}, 2, None) is None


@pytest.mark.parametrize("bad", [-0.1, math.nan, math.inf, True, "1ms", None])
def test_call_overhead_is_validated(bad):
    with pytest.raises(InvalidInput, match="call_overhead"):
        Handle(backend="cpu", db=False, call_overhead=bad)


def test_a_copied_handle_keeps_its_charge():
    import copy

    assert copy.deepcopy(Handle(backend="cpu", db=False, call_overhead=0.25)).call_overhead == 0.25


# ---- ucudnn.torch ----------------------------------------------------------------------------------
torch = pytest.importorskip("torch")


@pytest.fixture
def scripted_probe(monkeypatch):
    """`route_overhead_ms` with its timer replaced: each contender runs once, forward and backward (as the probe
    runs it), and the given medians come back, so that the charge's arithmetic and the probe's grad mode are
    checked whatever the load (measured, the host cost of a tiny layer is microseconds that a busy machine can
    invert). Returns, per contender, whether autograd was on when it ran; the real measurement comes back after."""
    from ucudnn.torch.converting import route_cost

    ran: dict[str, bool] = {}
    given: dict[str, float] = {}

    def medians(fns, reps, warmup=1, clock=None):
        for name, fn in fns.items():
            fn()  # its backward raises where autograd is off
            ran[name] = torch.is_grad_enabled()
        return dict(given)

    def script(times: dict[str, float]) -> dict[str, bool]:
        given.update(times)
        return ran

    monkeypatch.setattr(route_cost, "interleaved_medians_ms", medians)
    route_cost.route_overhead_ms.cache_clear()
    yield script
    route_cost.route_overhead_ms.cache_clear()


@pytest.mark.parametrize(
    "times, charge",
    [
        ({"direct": 1.0, "function": 1.25, "routed": 1.55}, 0.35),  # the Function's cost + a third of routing
        ({"direct": 1.0, "function": 0.9, "routed": 0.8}, 0.0),  # noise that inverts the order charges nothing
        ({"direct": 1.0, "function": 1.0, "routed": 1.004}, 0.0),  # rounded to 10 us, so plans recur
    ],
)
def test_the_route_charge_is_the_functions_cost_and_a_third_of_routing(scripted_probe, times, charge):
    from ucudnn.torch.converting.conv import route_overhead_ms

    scripted_probe(times)
    assert route_overhead_ms() == charge


def test_torch_handles_charge_the_measured_route_cost():
    from ucudnn.torch import Conv2d, convert
    from ucudnn.torch.converting.conv import route_overhead_ms

    overhead = route_overhead_ms()  # measured: its size is the machine's (the test above checks the arithmetic)
    model = convert(torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3)), backend="cpu", db=False)
    assert model[0].handle.call_overhead == overhead
    default = Conv2d(3, 4, 3).handle  # backend "auto": cudnn where a GPU is usable, and CUDA is not charged
    assert default.call_overhead == (overhead if default.backend.name == "cpu" else 0)
    assert convert(torch.nn.Conv2d(3, 4, 3), backend="cpu", db=False, call_overhead=0).handle.call_overhead == 0
    given = Handle(backend="cpu", db=False)
    assert convert(torch.nn.Conv2d(3, 4, 3), handle=given).handle.call_overhead == 0  # a given handle is left as is


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
def test_the_route_is_measured_whatever_grad_mode_convert_runs_in(mode, scripted_probe):
    from ucudnn.torch import convert

    ran = scripted_probe({"direct": 1.0, "function": 1.25, "routed": 1.55})
    with getattr(torch, mode)():
        model = convert(torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3)), backend="cpu", db=False)
    # every contender ran forward and backward with autograd on, inside the caller's mode, and the layer charges it
    assert ran == {"direct": True, "function": True, "routed": True}
    assert model[0].handle.call_overhead == 0.35


@pytest.mark.parametrize("numpy_ms, routed", [(19.0, False), (8.0, True)])
def test_a_layer_routes_through_ucudnn_only_where_numpy_wins_by_more_than_the_charge(numpy_ms, routed):
    from ucudnn.torch import convert

    backend = Scripted({(NATIVE, 2): 20.0, ("im2col_gemm", 2): numpy_ms})
    conv = torch.nn.Conv2d(3, 4, 3, padding=1)
    reference = torch.nn.Conv2d(3, 4, 3, padding=1)
    reference.load_state_dict(conv.state_dict())
    # no in-step trial: the scripted times hold for measurements and checked runs, not for launches
    layer = convert(
        conv,
        backend=backend,
        policy="undivided",
        algos=["im2col_gemm", NATIVE],
        db=False,
        reps=5,
        call_overhead=4.0,
        trial_runs=0,
    )
    rng = np.random.default_rng(0)
    checked_runs = []
    original_run = backend.run

    def counting_run(*args, **kwargs):
        checked_runs.append(args[1])
        return original_run(*args, **kwargs)

    for step in range(3):
        x = torch.tensor(rng.standard_normal(PROBLEM.x_shape), dtype=torch.float32, requires_grad=True)
        x_ref = x.detach().clone().requires_grad_()
        dy = torch.tensor(rng.standard_normal((2, 4, 6, 6)), dtype=torch.float32)
        layer(x).backward(dy)
        reference(x_ref).backward(dy)
        torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-4, atol=1e-4)
        if step == 0:  # planned, measured and checked: from now on count the checked runs
            backend.run = counting_run
    torch.testing.assert_close(conv.weight.grad, reference.weight.grad, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(conv.bias.grad, reference.bias.grad, rtol=1e-4, atol=1e-4)
    (route,) = layer._routes.values()
    assert route.direct is not routed
    assert all((kernel is not None) is routed for kernel in (route.fwd, route.bwd_data, route.bwd_filter))
    assert [c.config.micros[0].algo for c in layer.handle.choices()] == ["im2col_gemm" if routed else NATIVE] * 3
    assert checked_runs == []  # operands were checked once per kernel, in the first step only
