"""`with_plan(model, plan)` called eagerly: a module that runs the whole plan (keep, offload, recompute, the conv
budgets) through `execute_plan`'s executor, wherever the caller runs the backward pass, and leaves nothing
installed once a call returns or raises; `execute_plan`'s block leaves nothing either, however it ends."""

from __future__ import annotations

import copy
import inspect
import weakref

import pytest

torch = pytest.importorskip("torch")
from plain_training import assert_trains_alike, rounding_noise, train
from test_torch_memory import SmallNet, _data
from torch import nn
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

from ucudnn.errors import InvalidInput, UnsupportedProblem
from ucudnn.torch import PlannedModule, StepTracker, execute_plan, plan_memory, with_plan
from ucudnn.torch.running import compiled
from ucudnn.torch.running.offload import late_copies
from ucudnn.torch.running.prepared_plan import _prepared

BATCH = 8


def _batch(step: int):
    return _data(n=BATCH, seed=step)


def _loss(out, y):
    return nn.functional.cross_entropy(out, y)


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return SmallNet()


@pytest.fixture(scope="module")
def plan(model):
    """An H100 plan at 80% of the keep-everything peak, which offloads and recomputes (asserted)."""
    x, y = _batch(0)
    full = plan_memory(model, x, device="h100", loss=lambda out: _loss(out, y))
    made = plan_memory(model, x, memory_limit=int(0.8 * full.peak_bytes), device="h100", loss=lambda out: _loss(out, y))
    actions = {t.action for t in made.tensors}
    assert made.fits and {"offload", "recompute"} <= actions, actions
    return made


def _nothing_installed(*models: nn.Module) -> None:
    """No saved-tensor hooks, dispatch mode or module hook is left on."""
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None
    assert _get_current_dispatch_mode_stack() == []
    for m in models:
        for sub in m.modules():
            assert not sub._forward_hooks and not sub._forward_pre_hooks, type(sub).__name__


def _following() -> bool:
    return any(type(mode).__name__ == "_Follow" for mode in _get_current_dispatch_mode_stack())


def _grads(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.grad.flatten() for p in model.parameters()])


def _plain_grads(model: nn.Module, steps) -> torch.Tensor:
    """The gradients of one backward pass of the summed losses of ``steps`` (batch numbers) in plain PyTorch."""
    plain = copy.deepcopy(model)
    sum(_loss(plain(x), y) for x, y in map(_batch, steps)).backward()
    return _grads(plain)


def test_the_module_trains_eagerly_as_plain_pytorch_does_offloading_and_recomputing(model, plan):
    """`plain_training.train` of the planned module: the loss is computed and backpropagated after forward returned
    (as a trainer does), and the parameters land where plain training's do, within the model's rounding noise."""
    reference = train(copy.deepcopy(model), _batch)
    noise = rounding_noise(model, _batch, reference)
    planned = with_plan(trained := copy.deepcopy(model), plan)
    assert_trains_alike(train(planned, _batch), reference, noise)
    assert planned.stats is not None and planned.stats.offloaded > 0 and planned.stats.recomputed > 0
    _nothing_installed(trained)


def test_the_backward_pass_runs_after_forward_returned_with_nothing_installed_between(model, plan):
    planned = with_plan(inner := copy.deepcopy(model), plan)
    x, y = _batch(0)
    out = planned(x)
    _nothing_installed(inner)  # the saves hold what backward needs; no hook is left on between the passes
    _loss(out, y).backward()
    torch.testing.assert_close(_grads(inner), _plain_grads(model, [0]), rtol=1e-5, atol=1e-6)
    assert planned.stats.prefetched == planned.stats.offloaded > 0 and planned.stats.recomputed > 0


def test_each_calls_executor_goes_with_its_graph(model, plan, monkeypatch):
    """What a planned call leaves for its backward pass, its graph holds, and nothing else: the call's executor goes
    once the backward pass has consumed the graph, or with a graph dropped unused (nothing to tear down later)."""
    made = []

    class Recorded(compiled._Executor):
        def __init__(self, *args) -> None:
            super().__init__(*args)
            made.append(weakref.ref(self))

    monkeypatch.setattr(compiled, "_Executor", Recorded)
    planned = with_plan(copy.deepcopy(model), plan)
    x, y = _batch(0)
    loss = _loss(planned(x), y)
    assert made[0]() is not None
    loss.backward()
    del loss
    assert made[0]() is None
    out = planned(x)
    assert made[1]() is not None and planned.stats.offloaded > 0
    del out
    assert made[1]() is None


def test_gradient_accumulation_plans_each_forward_pass_as_a_step(model, plan):
    """One backward per forward (Lightning's and the HF Trainer's accumulation), and two forward passes before one
    backward: each forward pass is a step of the plan with its own saves; the gradients are plain PyTorch's."""
    planned = with_plan(inner := copy.deepcopy(model), plan)
    for x, y in map(_batch, (0, 1)):
        _loss(planned(x), y).backward()
    torch.testing.assert_close(_grads(inner), _plain_grads(model, [0, 1]), rtol=1e-5, atol=1e-6)
    inner.zero_grad()
    (x0, y0), (x1, y1) = _batch(0), _batch(1)
    first = _loss(planned(x0), y0)
    stats = planned.stats
    (first + _loss(planned(x1), y1)).backward()
    assert stats is not planned.stats and stats.recomputed == planned.stats.recomputed > 0
    torch.testing.assert_close(_grads(inner), _plain_grads(model, [0, 1]), rtol=1e-5, atol=1e-6)


def test_evaluation_between_steps_is_not_planned_and_training_goes_on_as_plain(model, plan):
    """`eval()` under `no_grad` or `inference_mode` between training steps runs the model as it is (the plain
    model's outputs), and the next training step is planned again."""
    plain, inner = copy.deepcopy(model), copy.deepcopy(model)
    planned = with_plan(inner, plan)
    for step in range(2):
        x, y = _batch(step)
        _loss(plain(x), y).backward()
        _loss(planned(x), y).backward()
        stats = planned.stats
        plain.eval(), planned.eval()
        for evaluating in (torch.no_grad, torch.inference_mode):
            with evaluating():
                torch.testing.assert_close(planned(x), plain(x))
        torch.testing.assert_close(planned(x), plain(x))  # eval() with gradients on: not a training step either
        assert planned.stats is stats
        plain.train(), planned.train()
    torch.testing.assert_close(_grads(inner), _grads(plain), rtol=1e-5, atol=1e-6)
    for b, c in zip(plain.buffers(), inner.buffers(), strict=True):
        torch.testing.assert_close(c, b)  # batch-norm's running statistics moved once per training step


def test_the_eager_steps_counted_peak_is_the_plans_prediction(model, plan):
    """Copies that finish as late as a GPU's streams may (`late_copies`): the step StepTracker counts, forward and
    backward apart as a trainer runs them, lies within 10% of the plan's peak."""
    planned = with_plan(inner := copy.deepcopy(model), plan)
    x, y = _batch(0)
    with late_copies():
        _loss(planned(x), y).backward()  # warm-up: the host buffers are allocated
        inner.zero_grad(set_to_none=True)
        with StepTracker(inner) as tracker:
            tracker.track(x, "tensor")
            tracker.track(y, "tensor")
            for _, pool in _prepared(inner, plan).copies.values():
                for host in pool.held():
                    tracker.track(host, "host")
            out = planned(x)
            loss = _loss(out, y)
            del out
            loss.backward()
            del loss
    assert planned.stats.offloaded > 0 and planned.stats.recomputed > 0
    counted = tracker.report().peak_bytes
    assert 0.90 <= counted / plan.peak_bytes <= 1.10, (counted, plan.peak_bytes)


def test_the_module_keeps_the_models_signature_and_reads_through_to_its_attributes():
    class Keywords(SmallNet):
        def forward(self, pixel_values, labels=None):
            return super().forward(pixel_values)

    torch.manual_seed(0)
    keywords = Keywords()
    keywords.config = {"num_labels": 10}
    x, y = _batch(0)
    plan = plan_memory(keywords, {"pixel_values": x}, memory_limit=1, device="h100", loss=lambda out: _loss(out, y))
    planned = with_plan(keywords, plan)
    assert list(inspect.signature(planned.forward).parameters) == ["pixel_values", "labels"]
    assert planned.config is keywords.config and planned.module is keywords
    assert isinstance(planned, PlannedModule) and list(planned.parameters()) == list(keywords.parameters())
    assert not hasattr(planned, "no_such_attribute")
    _loss(planned(pixel_values=x), y).backward()
    assert planned.stats.recomputed > 0
    copied = copy.deepcopy(planned)  # a copy's forward is its own
    _loss(copied(x), y).backward()
    assert copied.stats is not planned.stats and all(p.grad is not None for p in copied.module.parameters())


def test_refusals_are_one_line_and_leave_nothing_installed(model, plan):
    x, _ = _batch(0)
    inner = copy.deepcopy(model)
    planned = with_plan(inner, plan)
    with pytest.raises(InvalidInput, match="batch 8, the input has batch 4") as batch:
        planned(x[:4])
    _nothing_installed(inner)
    other = nn.Sequential(nn.Conv2d(3, 8, 3), nn.Flatten(), nn.Linear(8 * 6 * 6, 10))
    with pytest.raises(InvalidInput, match="another model") as another:
        with_plan(other, plan)
    _nothing_installed(other)
    extra = inner.layer1[0].register_forward_hook(lambda module, args, output: output * 1.0)  # another step
    with pytest.raises(UnsupportedProblem, match="diverged") as diverged:
        planned(x)
    extra.remove()
    _nothing_installed(inner)
    inner.layer1[1].conv2 = nn.Sequential(nn.Conv2d(8, 8, 3, padding=1))  # a module replaced since the plan
    with pytest.raises(InvalidInput, match="another model") as replaced:
        planned(x)
    _nothing_installed(inner)
    for info in (batch, another, diverged, replaced):
        assert "\n" not in str(info.value)


@pytest.mark.parametrize("interrupt", [KeyboardInterrupt, SystemExit])
@pytest.mark.parametrize("form", ["execute_plan", "with_plan"])
def test_an_interrupt_in_a_planned_forward_leaves_nothing_installed(model, plan, form, interrupt):
    """An interrupt raised from a forward hook inside a call where the plan acts (saved-tensor hooks and the
    executor's dispatch mode on): the
    module hooks that run for an Exception do not run for it, and nothing the plan installed is left; a plain
    step after it computes a fresh copy's gradients."""
    inner = copy.deepcopy(model)
    seen = []

    def hook(module, args, output):
        seen.append((torch._C._autograd._top_saved_tensors_default_hooks(False) is not None, _following()))
        raise interrupt()

    handle = inner.layer1[0].conv2.register_forward_hook(hook)  # a call the plan follows: a map made there is dropped
    x, y = _batch(0)
    with pytest.raises(interrupt):
        if form == "execute_plan":
            with execute_plan(inner, plan):
                _loss(inner(x), y).backward()
        else:
            _loss(with_plan(inner, plan)(x), y).backward()
    handle.remove()
    assert seen == [(True, True)]
    _nothing_installed(inner)
    inner.zero_grad(set_to_none=True)
    _loss(inner(x), y).backward()
    fresh = copy.deepcopy(model)
    _loss(fresh(x), y).backward()
    torch.testing.assert_close(_grads(inner), _grads(fresh), rtol=1e-5, atol=1e-6)


def test_parameters_replaced_since_the_plan_are_prepared_again_or_refused(model, plan):
    """A parameter replaced by one of its kind (a state dict loaded with ``assign=True``) is the model's now: the
    run is prepared again and trains as plain PyTorch; one of another dtype (a wrapper converting or sharding the
    parameters) is refused in one line, with nothing installed."""
    planned = with_plan(inner := copy.deepcopy(model), plan)
    x, y = _batch(0)
    _loss(planned(x), y).backward()
    inner.load_state_dict(copy.deepcopy(model).state_dict(), assign=True)
    inner.zero_grad()
    _loss(planned(x), y).backward()
    assert _prepared(inner, plan).params == {p.untyped_storage()._cdata for p in inner.parameters()}
    torch.testing.assert_close(_grads(inner), _plain_grads(model, [0]), rtol=1e-5, atol=1e-6)
    inner.fc.weight = nn.Parameter(inner.fc.weight.detach().double())
    for _ in range(2):  # (and again: the refusal stands)
        with pytest.raises(UnsupportedProblem, match="fc.weight was replaced") as info:
            planned(x)
    assert "\n" not in str(info.value)
    _nothing_installed(inner)
