"""A plan beside the tools people run around a training step: trackers, profilers, hooks, dispatch modes, autocast,
gradient accumulation, evaluation between steps, an input that requires grad, retain_graph.

Each runs under a plan that recomputes (made by `plan_memory` at a limit that forces it) and one that offloads every
map (on the CPU, with copies that finish as late as a GPU's may: `late_copies`), and trains like plain PyTorch, or
is refused in one line that names the reason. Observers add autograd nodes of their own (a full backward hook's
`BackwardHookFunction`), which are not the model's: the plan's check of the step must not count them."""

from __future__ import annotations

import contextlib
from collections import Counter

import pytest
import torch
from torch import nn
from torch.distributed._tools.mem_tracker import MemTracker
from torch.utils.flop_counter import FlopCounterMode

from ucudnn.errors import UnsupportedProblem
from ucudnn.memory.plan import MemoryPlan, TensorAction
from ucudnn.torch import StepTracker, capture, execute_plan, plan_memory
from ucudnn.torch.running.offload import late_copies

STEPS = 2


def _chain() -> nn.Module:
    torch.manual_seed(0)
    convs = [m for c in (3, 16, 16, 16) for m in (nn.Conv2d(c, 16, 3, padding=1), nn.ReLU())]
    return nn.Sequential(*convs, nn.AdaptiveAvgPool2d(4), nn.Flatten(), nn.Linear(16 * 16, 10))


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(4, 3, 32, 32, generator=g), torch.randint(0, 10, (4,), generator=g)


def _loss(out, y):
    return nn.functional.cross_entropy(out, y)


def _recomputing(model: nn.Module, forced: str = "recompute") -> MemoryPlan:
    x = _batch(0)[0]
    roomy = plan_memory(model, x, memory_limit="64GiB", device="k40")
    plan = plan_memory(model, x, memory_limit=int(0.7 * roomy.peak_bytes), device="k40")
    assert Counter(t.action for t in plan.tensors)[forced] >= 2, f"the limit forces {forced}"
    return plan


def _offloading(model: nn.Module) -> MemoryPlan:
    step = capture(model, _batch(0)[0])
    graph = step.graph
    tensors = tuple(
        TensorAction(s, graph.bytes_of(s), "offload" if graph.op(s).type not in ("input", "loss") else "keep")
        for s in graph.storages
    )
    return MemoryPlan(
        graph.network, graph.batch, "host", 1, 2**30, "hand", True, 0, 0, 0, 1.0, 1.0, 0.0, 0, tensors, (), capture=step
    )


PLANS = {"recompute": _recomputing, "offload": _offloading}


def _train(
    model: nn.Module, plan: MemoryPlan | None, around=contextlib.nullcontext, step_fn=None, threads: int = 1
) -> torch.Tensor:
    """Every parameter after `STEPS` SGD steps, each step inside `around()` and (given a plan) `execute_plan`."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        for step in range(STEPS):
            x, y = _batch(step)
            opt.zero_grad()
            with around(), late_copies():
                if step_fn is not None:
                    step_fn(model, plan, x, y)
                else:
                    with execute_plan(model, plan) if plan is not None else contextlib.nullcontext():
                        _loss(model(x), y).backward()
            opt.step()
    finally:
        torch.set_num_threads(before)
    return torch.cat([p.detach().flatten() for p in model.parameters()])


@pytest.fixture(scope="module")
def plain():
    """Plain training's parameters and their rounding noise (one thread against two)."""
    reference = _train(_chain(), None)
    noise = (reference - _train(_chain(), None, threads=2)).norm().item()
    return reference, noise


def _assert_alike(trained: torch.Tensor, plain) -> None:
    reference, noise = plain
    assert (trained - reference).norm().item() <= 2 * noise + 1e-6 * reference.norm().item()


def _backward_hooked(model: nn.Module) -> list:
    """Full backward hooks (as Captum and gradient loggers register) on the first conv and on a ReLU whose output a
    recomputing plan drops, and forward hooks on every conv; what the backward hooks saw."""
    seen = []
    model[0].register_full_backward_hook(lambda m, gi, go: seen.append(go[0].norm().item()))
    model[3].register_full_backward_hook(lambda m, gi, go: seen.append(gi[0].norm().item()))
    for m in model:
        if isinstance(m, nn.Conv2d):
            m.register_forward_pre_hook(lambda m, args: None)
            m.register_forward_hook(lambda m, args, out: None)
    return seen


def _profiled():
    return torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])


AROUND = {
    "memtracker": MemTracker,
    "profiler": _profiled,
    "anomaly": lambda: torch.autograd.set_detect_anomaly(True),
    "flop-counter": lambda: FlopCounterMode(display=False),
    "step-tracker": StepTracker,
}


@pytest.mark.parametrize("policy", PLANS)
@pytest.mark.parametrize("around", AROUND)
def test_a_plan_runs_and_trains_like_plain_under_the_tools_that_watch_a_step(plain, policy, around):
    model = _chain()
    plan = PLANS[policy](model)
    _assert_alike(_train(model, plan, AROUND[around]), plain)


@pytest.mark.parametrize("policy", PLANS)
def test_a_plan_runs_beside_full_backward_hooks_and_the_hooks_see_plain_gradients(plain, policy):
    plain_model = _chain()
    plain_seen = _backward_hooked(plain_model)
    _train(plain_model, None)
    model = _chain()
    plan = PLANS[policy](model)  # planned without the hooks: they add nodes of their own, not the model's
    seen = _backward_hooked(model)
    _assert_alike(_train(model, plan), plain)
    assert len(seen) == len(plain_seen) == 2 * STEPS
    torch.testing.assert_close(seen, plain_seen, rtol=1e-5, atol=1e-7)


def test_a_plan_made_beside_backward_hooks_runs_without_them(plain):
    model = _chain()
    handle = model[0].register_full_backward_hook(lambda m, gi, go: None)
    plan = _recomputing(model)
    handle.remove()
    _assert_alike(_train(model, plan), plain)


@pytest.mark.parametrize("policy", PLANS)
def test_an_input_that_requires_grad_gets_plain_pytorchs_gradient_under_memtracker(policy):
    """Adversarial training reads the input's gradient; MemTracker watching such an input added a node."""

    def grads(make_plan):
        model = _chain()
        plan = make_plan(model) if make_plan else None
        x, y = _batch(0)
        x.requires_grad_()
        with MemTracker(), late_copies(), execute_plan(model, plan) if plan else contextlib.nullcontext():
            _loss(model(x), y).backward()
        return x.grad

    torch.testing.assert_close(grads(PLANS[policy]), grads(None), rtol=1e-5, atol=1e-7)


def _accumulate(model, plan, x, y):
    """Gradient accumulation: two micro-steps (the plan's batch each, half the loss), each under the plan, their
    gradients summed into the step's."""
    for _ in range(2):
        with execute_plan(model, plan):
            (_loss(model(x), y) / 2).backward()


def _evaluate_between(model, plan, x, y):
    """An evaluation under no_grad, outside the plan and inside its block, then the training step."""
    with torch.no_grad():
        outside = model(x)
    with execute_plan(model, plan):
        with torch.no_grad():
            inside = model(x)
        _loss(model(x), y).backward()
    torch.testing.assert_close(inside, outside)


STEP_FNS = {"grad-accumulation": _accumulate, "no-grad-evaluation": _evaluate_between}


@pytest.mark.parametrize("policy", PLANS)
@pytest.mark.parametrize("kind", STEP_FNS)
def test_a_plan_trains_like_plain_in_the_steps_users_write(plain, policy, kind):
    model = _chain()
    plan = PLANS[policy](model)
    _assert_alike(_train(model, plan, step_fn=STEP_FNS[kind]), plain)


def test_a_plan_made_outside_autocast_is_refused_inside_it_in_one_line_that_says_so():
    model = _chain()
    plan = _recomputing(model)
    x, y = _batch(0)
    with (
        pytest.raises(UnsupportedProblem, match="autocast") as err,
        torch.autocast("cpu", dtype=torch.bfloat16),
        execute_plan(model, plan),
    ):
        _loss(model(x), y).backward()
    assert "\n" not in str(err.value)


def test_a_plan_made_inside_autocast_runs_inside_it_and_trains_like_plain_autocast():
    def run(planned: bool) -> torch.Tensor:
        model = _chain()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            plan = _recomputing(model, "offload") if planned else None  # in bfloat16 it offloads
        return _train(model, plan, lambda: torch.autocast("cpu", dtype=torch.bfloat16))

    reference = run(False)
    torch.testing.assert_close(run(True), reference, rtol=0, atol=0)


@pytest.mark.parametrize("policy", PLANS)
def test_a_second_backward_through_a_retained_graph_is_refused_in_one_line_that_names_retain_graph(policy):
    """A recomputed map is rebuilt for one backward pass and an offloaded one fetched for one: what a plan saves is
    that the step holds neither beyond it. (PyTorch's own checkpoint recomputes again; a plan cannot know at the
    forward pass that a graph will be retained.)"""
    model = _chain()
    plan = PLANS[policy](model)
    x, y = _batch(0)
    with pytest.raises(UnsupportedProblem, match="retain_graph") as err, late_copies(), execute_plan(model, plan):
        loss = _loss(model(x), y)
        loss.backward(retain_graph=True)
        loss.backward()
    assert "\n" not in str(err.value)
    assert not model._forward_pre_hooks and not model._forward_hooks


@pytest.mark.parametrize("policy", PLANS)
def test_a_plan_trains_like_plain_inside_distributed_data_parallel_with_its_gradient_hooks(plain, policy, tmp_path):
    """DDP (one process, gloo) reduces gradients from hooks of its own; the plan is made for the wrapped module and
    run on it, around DDP's forward and backward (planning the DDP itself is refused: test_trainers_distributed)."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        model = _chain()
        ddp = DistributedDataParallel(model)
        plan = PLANS[policy](model)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
        for step in range(STEPS):
            x, y = _batch(step)
            opt.zero_grad()
            with late_copies(), execute_plan(model, plan):
                _loss(ddp(x), y).backward()
            opt.step()
        # DDP goes before the group: its reducer, dropping the group's last reference, would destroy the group
        # holding the GIL, while gloo's worker, dropping a finished allreduce that holds the step's Python hooks
        # (its thread-local state), waits for the GIL: a hang seen once in CI (PyTorch's issue 56297)
        del ddp
    finally:
        dist.destroy_process_group()
    _assert_alike(torch.cat([p.detach().flatten() for p in model.parameters()]), plain)
