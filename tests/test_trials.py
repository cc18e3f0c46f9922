"""A kernel planned from measurements taken alone is confirmed where it runs: `Handle(trial_runs=N)`.

A backend whose measurements say one thing and whose runs do another (as a kernel timed alone and
the same kernel inside a training step can): the trial alternates the plan with native undivided on
the caller's own calls and keeps the one that is faster there.
"""

import time

import numpy as np
import pytest

from ucudnn.backends.cpu import NATIVE, CpuBackend
from ucudnn.handle import Handle
from ucudnn.problem import ConvProblem

PROBLEM = ConvProblem.parse("n=2,c=3,h=8,w=8,k=4,r=3,s=3,pad=1")
CONV = {"padding": 1, "layer": "conv"}


def spin_until(end: float) -> None:
    """Work (not sleep) until this thread's CPU time reaches `end`: the trials time CPU time."""
    while time.thread_time() < end:
        pass


class Staged(CpuBackend):
    """Measured times are given; a prepared launch (what a step runs) takes at least its given run
    time of this thread's CPU, and a checked `run` (WR's re-timing, a first run) its measured time (ms by
    algorithm)."""

    def __init__(self, measured: dict[str, float], runs: dict[str, float]) -> None:
        self.measured, self.runs, self.ran = measured, runs, []

    def time_run_ms(self, problem, algo, operands, workspace, reps, beta=0.0):
        return [self.measured[algo]] * reps

    def run(self, problem, algo, **kwargs):
        end = time.thread_time() + self.measured[algo] / 1e3
        super().run(problem, algo, **kwargs)
        spin_until(end)

    def prepare_run(self, problem, algo):
        launch = super().prepare_run(problem, algo)

        def slowed(*args):
            end = time.thread_time() + self.runs[algo] / 1e3
            launch(*args)
            self.ran.append(algo)
            spin_until(end)

        return slowed


def _operands():
    rng = np.random.default_rng(0)
    return (
        rng.standard_normal(PROBLEM.x_shape, dtype=np.float32),
        rng.standard_normal(PROBLEM.w_shape, dtype=np.float32),
    )


@pytest.mark.parametrize(
    "runs, kept", [({"im2col_gemm": 30.0, NATIVE: 5.0}, NATIVE), ({"im2col_gemm": 5.0, NATIVE: 30.0}, "im2col_gemm")]
)
def test_a_trial_keeps_what_is_faster_where_it_runs(runs, kept):
    backend = Staged({"im2col_gemm": 1.0, NATIVE: 10.0}, runs)  # alone, im2col looks 10x faster
    handle = Handle(backend=backend, policy="undivided", algos=["im2col_gemm", NATIVE], db=False, reps=1, trial_runs=2)
    x, w = _operands()
    kernel = handle.kernel("fwd", x.shape, w.shape, **CONV)
    assert kernel.config.micros[0].algo == "im2col_gemm"  # the measurements' choice
    generation = handle.generation
    backend.ran.clear()
    results = []
    for _ in range(2 * (2 + 1)):  # the trial: each side once untimed, then twice timed
        out = np.zeros(PROBLEM.out_shape, np.float32)
        kernel.run(x=x, w=w, out=out)
        results.append(out)
    # the timed runs (the first of each side is the checked run, through `run`) take turns
    assert backend.ran == ["im2col_gemm", NATIVE] * 2
    for out in results:  # every run of the trial computed the convolution, whichever ran it
        np.testing.assert_allclose(out, results[0], rtol=1e-5, atol=1e-5)
    after = handle.kernel("fwd", x.shape, w.shape, **CONV)
    assert after.config.micros[0].algo == kept
    assert (handle.generation != generation) == (kept == NATIVE)  # a switch makes older kernels stale
    backend.ran.clear()
    after.run(x=x, w=w, out=np.zeros(PROBLEM.out_shape, np.float32))
    assert backend.ran == [kept]  # the trial is over: one run, of the winner


def test_the_plan_must_win_by_more_than_the_call_overhead(monkeypatch):
    from ucudnn.kernel import measure

    # WR re-times im2col against native with checked runs, which take their time in this thread's CPU: read
    # there too (wall time on a loaded machine adds whatever the scheduler makes a run wait)
    monkeypatch.setattr(measure, "run_clock", time.thread_time)
    backend = Staged({"im2col_gemm": 1.0, NATIVE: 40.0}, {"im2col_gemm": 15.0, NATIVE: 30.0})
    handle = Handle(
        backend=backend,
        policy="undivided",
        algos=["im2col_gemm", NATIVE],
        db=False,
        reps=3,
        trial_runs=1,
        call_overhead=20.0,
    )
    x, w = _operands()
    kernel = handle.kernel("fwd", x.shape, w.shape, **CONV)
    assert kernel.config.micros[0].algo == "im2col_gemm"  # 39 ms ahead alone, charged 20: kept
    for _ in range(4):
        kernel.run(x=x, w=w, out=np.zeros(PROBLEM.out_shape, np.float32))
    # in the step it won by 15 ms, less than the 20 ms its caller pays per call
    assert handle.kernel("fwd", x.shape, w.shape, **CONV).config.micros[0].algo == NATIVE


@pytest.mark.parametrize(
    "runs, tried_again", [({"im2col_gemm": 5.0, NATIVE: 30.0}, False), ({"im2col_gemm": 30.0, NATIVE: 5.0}, True)]
)
def test_a_configuration_that_won_its_trial_is_not_tried_again_within_a_budget(runs, tried_again):
    # a memory plan asks for a layer's kernels again within its budgets: the configuration that already won
    # its trial runs without another (each trial runs torch's kernel on every other call of the step); one
    # that lost is tried again where it is asked for (native may not fit the budget: then it runs as planned)
    backend = Staged({"im2col_gemm": 1.0, NATIVE: 10.0}, runs)
    handle = Handle(backend=backend, policy="undivided", algos=["im2col_gemm", NATIVE], db=False, reps=1, trial_runs=2)
    x, w = _operands()
    kernel = handle.kernel("fwd", x.shape, w.shape, **CONV)
    for _ in range(2 * (2 + 1)):
        kernel.run(x=x, w=w, out=np.zeros(PROBLEM.out_shape, np.float32))
    within = handle.kernel("fwd", x.shape, w.shape, budget=2**30, **CONV)
    assert within.config == kernel.config  # the measurements' choice within the budget
    assert within.against_native == tried_again


def test_no_trial_without_trial_runs_or_where_native_cannot_run():
    backend = Staged({"im2col_gemm": 1.0, NATIVE: 10.0}, {"im2col_gemm": 1.0, NATIVE: 1.0})
    x, w = _operands()
    for options in ({}, {"trial_runs": 2, "algos": ["im2col_gemm"]}):
        options = {"algos": ["im2col_gemm", NATIVE], **options}
        handle = Handle(backend=backend, policy="undivided", db=False, reps=1, **options)
        kernel = handle.kernel("fwd", x.shape, w.shape, **CONV)
        backend.ran.clear()
        for _ in range(4):
            kernel.run(x=x, w=w, out=np.zeros(PROBLEM.out_shape, np.float32))
        assert backend.ran == ["im2col_gemm"] * 3  # the plan, every time (the first run is checked by `run`)


def test_bad_trial_runs_are_refused():
    from ucudnn.errors import InvalidInput

    for bad in (-1, 1.5, True):
        with pytest.raises(InvalidInput, match="trial_runs"):
            Handle(backend="cpu", trial_runs=bad, db=False)


def _trained_layer(backend, steps):
    """A converted 3x3 layer on `backend` (every kernel planned as im2col_gemm, each kernel's trial keeping
    it) trained `steps` steps beside torch's own layer on the same weights: the layer, and the largest
    difference between their gradients in any step."""
    import torch

    from ucudnn.torch import Conv2d

    handle = Handle(backend=backend, policy="undivided", algos=["im2col_gemm", NATIVE], db=False, reps=1, trial_runs=2)
    torch.manual_seed(0)
    reference = torch.nn.Conv2d(3, 4, 3, padding=1)
    layer = Conv2d.from_conv(reference, handle=handle, layer="conv")
    x = torch.randn(*PROBLEM.x_shape, requires_grad=True)
    worst = 0.0
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as in a converted model's step: one pool (this backend's BLAS is left as it is)
    try:
        for _ in range(steps):
            grads = []
            for module in (layer, reference):
                module.zero_grad(set_to_none=True)
                x.grad = None
                module(x).square().sum().backward()
                grads.append(torch.cat([x.grad.flatten(), module.weight.grad.flatten(), module.bias.grad.flatten()]))
            worst = max(worst, (grads[0] - grads[1]).abs().max().item())
    finally:
        torch.set_num_threads(threads)
    return layer, worst


# the kernels' trials (each side's first run untimed, two timed), then the layer's backward pass trial
TRIAL_STEPS_OF_2 = 4 * (2 + 1)


def test_a_layers_backward_pass_is_tried_against_torchs_fused_one():
    # im2col wins each kernel's trial against torch's kernel of its kind alone (5 ms against 30), and loses
    # the layer's backward pass against torch's one call computing both gradients (no 30 ms there)
    backend = Staged({"im2col_gemm": 1.0, NATIVE: 10.0}, {"im2col_gemm": 5.0, NATIVE: 30.0})
    layer, worst = _trained_layer(backend, TRIAL_STEPS_OF_2)
    assert worst < 1e-4  # every pass of both trials computed the gradients
    (route,) = layer._routes.values()
    assert route.fwd.config.micros[0].algo == "im2col_gemm"  # its kernel's trial kept it
    assert route.bwd_data is None and route.bwd_filter is None and route.trial is None  # torch's backward pass
    backend.ran.clear()
    layer(torch_input()).sum().backward()
    assert backend.ran == ["im2col_gemm"]  # the forward kernel only


def torch_input():
    import torch

    return torch.randn(*PROBLEM.x_shape, requires_grad=True)


def test_a_backward_pass_that_wins_in_the_step_keeps_its_kernels(monkeypatch):
    from ucudnn.torch.converting import launch

    fused = launch.Geometry.torch_backward

    def slow_when_fused(self, dy, x, w, dx, dw):
        if dx and dw:
            spin_until(time.thread_time() + 0.05)
        return fused(self, dy, x, w, dx, dw)

    monkeypatch.setattr(launch.Geometry, "torch_backward", slow_when_fused)
    backend = Staged({"im2col_gemm": 1.0, NATIVE: 10.0}, {"im2col_gemm": 5.0, NATIVE: 30.0})
    layer, worst = _trained_layer(backend, TRIAL_STEPS_OF_2)
    assert worst < 1e-4
    (route,) = layer._routes.values()
    assert route.bwd_data is not None and route.bwd_filter is not None  # 10 ms against 50: kept
    assert route.trial is not None and not route.trial.open
    backend.ran.clear()
    layer(torch_input()).sum().backward()
    assert backend.ran == ["im2col_gemm"] * 3


def test_under_a_plans_budgets_a_layer_keeps_what_its_trials_settled():
    # a memory plan gives each converted kernel a workspace budget, and the layer asks its handle again within
    # them: what its trials settled stays, and is not tried again. Kinds torch runs for the layer (here its
    # backward pass, fused) stay torch's: they hold no workspace the plan counts, so they are within every
    # budget, where the handle, asked within one, picks by measurements taken alone. (Before, a converted HF
    # MobileNetV2 ran 1.10x its own step under a plan that drops nothing, 12 of its 52 layers on other
    # kernels than their own, and 1.2-1.3x for its first 8 planned steps while 13 trials ran again.)
    import torch
    import torch.nn.functional as F

    backend = Staged({"im2col_gemm": 1.0, NATIVE: 10.0}, {"im2col_gemm": 5.0, NATIVE: 30.0})
    layer, _ = _trained_layer(backend, TRIAL_STEPS_OF_2)
    x = torch_input()
    layer._budgets = {kind: 2**30 for kind in ("fwd", "bwd_data", "bwd_filter")}  # as execute_plan sets them
    try:
        layer(x).sum().backward()  # the first run of a kernel prepared within a budget is a checked one
        backend.ran.clear()
        out = layer(x)
        dx, dw = torch.autograd.grad(out.square().sum(), (x, layer.weight))
    finally:
        layer._budgets = None
    assert backend.ran == ["im2col_gemm"]  # the forward kernel, once: no trial, torch's backward pass
    route = next(r for r in layer._routes.values() if r.budgets is not None)
    assert route.bwd_data is None and route.bwd_filter is None and route.trial is None
    assert (
        not route.fwd.against_native
        and route.fwd.config == next(r for r in layer._routes.values() if r.budgets is None).fwd.config
    )
    ref = F.conv2d(x, layer.weight, layer.bias, padding=1)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    for ours, theirs in zip((dx, dw), torch.autograd.grad(ref.square().sum(), (x, layer.weight))):
        torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)


def test_a_budget_that_holds_a_kernel_that_won_its_trial_runs_that_kernel():
    # a memory plan's budget makes the handle solve the kernel again, from measurements alone: measured again
    # (on a loaded machine, say) native may read faster, though it lost the kernel's trial in the step. Where the
    # budget holds the configuration that won, that one runs (before, torch ran it: a converted HF MobileNetV2's
    # halfway plan charged the winner's 686144 B that nothing held, counted 0.9927 of its prediction)
    backend = Staged({"im2col_gemm": 1.0, NATIVE: 10.0}, {"im2col_gemm": 5.0, NATIVE: 30.0})
    layer, _ = _trained_layer(backend, TRIAL_STEPS_OF_2)
    won = next(r for r in layer._routes.values() if r.budgets is None).fwd.config
    assert won.micros[0].algo == "im2col_gemm"
    backend.measured = {"im2col_gemm": 10.0, NATIVE: 1.0}
    layer._budgets = {kind: won.workspace for kind in ("fwd", "bwd_data", "bwd_filter")}  # as execute_plan sets them
    try:
        layer(torch_input()).sum().backward()
    finally:
        layer._budgets = None
    route = next(r for r in layer._routes.values() if r.budgets is not None)
    assert route.fwd is not None and route.fwd.config == won


def test_a_plan_offers_the_kinds_a_layer_leaves_to_torch_torchs_option_alone():
    # under a plan's budgets a kind the layer's own route leaves to torch stays torch's
    # (test_under_a_plans_budgets_a_layer_keeps_what_its_trials_settled): the planner's options for it are
    # torch's alone, no workspace held, so that it charges what runs (before, it could pick a workspace option
    # that nothing held: a converted HF ResNet-50's plans counted 0.9944-0.9980 of their predictions)
    import torch

    from ucudnn.torch import capture
    from ucudnn.torch.planning import planner as planning

    backend = Staged({"im2col_gemm": 1.0, NATIVE: 10.0}, {"im2col_gemm": 5.0, NATIVE: 30.0})
    layer, _ = _trained_layer(backend, TRIAL_STEPS_OF_2)  # its backward pass: torch's fused call
    model = torch.nn.Sequential(layer)
    graph = capture(model, torch_input()).graph
    (op,) = graph.conv_ops
    fronts = planning._conv_fronts(model, graph, None)
    for kind in ("bwd_data", "bwd_filter"):
        (option,) = fronts[(op.name, kind)]
        assert option.config == f"1x{PROBLEM.n}:{NATIVE}" and option.held == 0
    assert any("im2col_gemm" in option.config for option in fronts[(op.name, "fwd")])  # its forward kernel's


def test_trial_steps_hold_both_trials():
    from ucudnn.torch.converting.route_cost import TRIAL_RUNS, TRIAL_STEPS

    assert TRIAL_STEPS == 4 * (TRIAL_RUNS + 1)
