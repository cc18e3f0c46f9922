"""Nothing a StepTracker installs outlives its block, whatever leaves it (issue 51): an exception, a
KeyboardInterrupt or a SystemExit raised in the forward pass, the backward pass, or while the tracker installs
itself. Afterwards no dispatch mode, gradient hook, workspace listener, buffer or storage-resize watch is left, and a plain step
gives the gradients a fresh copy of the model gives."""

from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch")
from torch import nn

from ucudnn.torch import convert
from ucudnn.torch.checking import tracker as tracker_module
from ucudnn.torch.checking.tracker import StepTracker
from ucudnn.torch.running import labels

LEAVERS = (KeyboardInterrupt, SystemExit, RuntimeError)


def _model() -> nn.Module:
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, 2, 3, padding=1))
    # one algorithm at the whole batch: the copy runs exactly what the model runs, so gradients compare bitwise
    return convert(plain, backend="cpu", db=False, reps=1, policy="undivided", algos=["im2col_gemm"])


def _nothing_left(model: nn.Module) -> None:
    assert torch._C._len_torch_dispatch_stack() == 0
    assert labels._WATCHERS == []
    assert tracker_module._RESIZE_WATCHERS == [] and "resize_" not in torch.UntypedStorage.__dict__
    for p in model.parameters():
        assert not getattr(p, "_post_accumulate_grad_hooks", None), "a gradient hook outlived the block"
    for m in model.modules():
        handle = getattr(m, "handle", None)
        assert handle is None or handle.workspace_listener is None


def _plain_step_equals_a_fresh_copys(model: nn.Module, fresh: nn.Module) -> None:
    x = torch.randn(2, 3, 6, 6)
    for m in (model, fresh):
        m.zero_grad(set_to_none=True)
        m(x).square().sum().backward()
    got = torch.cat([p.grad.flatten() for p in model.parameters()])
    want = torch.cat([p.grad.flatten() for p in fresh.parameters()])
    torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize("leaver", LEAVERS)
@pytest.mark.parametrize("where", ["forward hook", "backward"])
def test_whatever_leaves_the_block_takes_the_tracker_with_it(leaver: type[BaseException], where: str) -> None:
    model = _model()
    fresh = copy.deepcopy(model)
    x = torch.randn(2, 3, 6, 6)

    def stop(*_: object) -> None:
        raise leaver("stopped")

    hook = model[1].register_forward_hook(stop) if where == "forward hook" else None
    with pytest.raises(leaver), StepTracker(model):
        y = model(x)
        if where == "backward":
            y.register_hook(stop)
        y.square().sum().backward()
    if hook is not None:
        hook.remove()
    _nothing_left(model)
    _plain_step_equals_a_fresh_copys(model, fresh)


@pytest.mark.parametrize("leaver", LEAVERS)
def test_an_interrupt_while_the_tracker_installs_leaves_nothing(
    leaver: type[BaseException], monkeypatch: pytest.MonkeyPatch
) -> None:
    model = _model()

    def interrupted(_callback: object) -> None:
        raise leaver("stopped")

    monkeypatch.setattr(tracker_module, "watching", interrupted)  # the last thing __enter__ installs
    with pytest.raises(leaver), StepTracker(model):
        pytest.fail("the block must not run")
    _nothing_left(model)
