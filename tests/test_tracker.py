"""ucudnn.torch.checking.tracker and ucudnn.torch.checking.check: a step's memory counted from live storages, on hand-computed cases."""

from __future__ import annotations

import gc
import sys
import weakref
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
from torch import nn

from ucudnn import InvalidInput
from ucudnn.memory import available_policies
from ucudnn.memory.planner import OFFLOADING
from ucudnn.torch import (
    convert,
    plan_memory,
)
from ucudnn.torch.checking.check import check_plan
from ucudnn.torch.checking.tracker import StepTracker
from ucudnn.torch.running.labels import CATEGORIES, allocated_as
from ucudnn.torch.running.prepared_plan import _prepared

sys.path.insert(0, str(Path(__file__).parent))
from test_torch_memory import HAND_PLANS, SmallNet, _data, _hand_plan

F32 = 4


def _values(report):
    return [b for _, b in report.memory]


def test_a_chain_of_known_sizes_with_an_in_place_op_and_a_view():
    with StepTracker() as tracker:
        a = torch.ones(1000)  # 4000 bytes
        b = a * 2  # + 4000
        v = b.view(10, 100)  # a view: the same storage
        b.add_(1)  # in place: nothing new
        b.relu_()
        del a  # - 4000
        c = b + 1  # + 4000
        del b  # the view keeps b's storage
    r = tracker.report()
    assert _values(r) == [0, 4000, 8000, 4000, 8000]
    assert r.peak_bytes == 8000 and r.end_by_category["tensor"] == 8000
    assert r.peak_by_category == {**dict.fromkeys(CATEGORIES, 0), "tensor": 8000}
    times = [t for t, _ in r.memory]
    assert times == sorted(times) and times[0] >= 0
    assert v.sum().item() == 3000 and c.shape == (1000,)


def test_a_freed_view_frees_its_storage_and_the_tracker_keeps_nothing_alive():
    with StepTracker() as tracker:
        a = torch.ones(256)
        t = a[10:20]
        alive = weakref.ref(a.untyped_storage())
        del a
        mid = tracker._bytes["tensor"]
        del t
        gc.collect()
    assert mid == 1024
    assert alive() is None, "the tracker must not keep a storage alive"
    assert _values(tracker.report()) == [0, 1024, 0]


def test_an_out_argument_resized_by_the_operation_is_counted():
    a = torch.ones(100)
    out = torch.empty(0)
    with StepTracker() as tracker:
        tracker.track(out)  # alive before the block: 0 bytes
        torch.add(a, 1, out=out)  # resized to 400 bytes; `a` counts from its first read
    r = tracker.report()
    assert r.end_by_category["tensor"] == 400 + 400


def test_a_higher_order_operator_counts_as_one_operation_its_outputs_counted():
    """A compiled step that recomputes an operation drawing random numbers (attention or dropout, under a compiled
    plan: diffusers' UNet) runs it inside `run_and_save_rng_state`; the tracker counts what it returns (the
    generator's state, the result and the mask) where PyTorch would otherwise refuse the operator under the mode."""
    x = torch.randn(64, 64)
    with StepTracker() as tracker:
        state, (out, mask) = torch.ops.higher_order.run_and_save_rng_state(
            torch.ops.aten.native_dropout.default, x, 0.5, True
        )
    made = [t.untyped_storage().nbytes() for t in (x, state, out, mask)]
    assert mask.dtype == torch.bool and tracker.report().peak_bytes == sum(made) == 64 * 64 * (F32 + F32 + 1) + made[1]


def test_a_storage_resized_outside_dispatch_holds_its_new_bytes():
    """FSDP2 frees a gathered parameter by resizing its storage to 0 bytes (``UntypedStorage.resize_``, no operation
    of the dispatch), and gathers it again into the same storage resized back."""
    a = torch.ones(1000)  # 4000 bytes
    with StepTracker() as tracker:
        tracker.track(a)
        b = a * 2  # + 4000
        b.untyped_storage().resize_(0)  # freed: - 4000
        c = a + 1  # + 4000: no more than before
        b.untyped_storage().resize_(4000)  # gathered again: + 4000
        b.copy_(c)
        fresh = torch.UntypedStorage(0)  # a storage made and grown outside dispatch counts from its growth
        fresh.resize_(400)
    r = tracker.report()
    assert _values(r) == [0, 4000, 8000, 4000, 8000, 12000, 12400]
    assert r.peak_bytes == 12400
    assert "resize_" not in torch.UntypedStorage.__dict__  # the method is wrapped while a tracker counts only
    assert b.sum().item() == 2000


def test_numpy_memory_wrapped_again_is_an_alias_and_new_numpy_memory_counts():
    # a converted conv hands micro-batches of its operands to PyTorch's kernel as torch.from_numpy of
    # NumPy views: new storages over memory a live tensor holds
    with StepTracker() as tracker:
        a = torch.ones(8, 250)  # 8000 bytes
        half = torch.from_numpy(a.numpy()[4:])  # a view of a's memory: no bytes of its own
        doubled = half * 2  # 4000 new bytes
        fresh = torch.from_numpy(doubled.numpy().copy())  # NumPy's own new memory: 4000 bytes
    r = tracker.report()
    assert r.peak_bytes == 8000 + 4000 + 4000
    assert half.untyped_storage().data_ptr() == a.untyped_storage().data_ptr() + 4000 and fresh.shape == (4, 250)


def test_a_training_step_of_a_small_mlp_by_hand():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64, bias=False), nn.ReLU(), nn.Linear(64, 8, bias=False))
    x = torch.randn(16, 32)
    with StepTracker(model) as tracker:
        model(x).square().sum().backward()
    r = tracker.report()
    w1, w2 = 64 * 32 * F32, 8 * 64 * F32  # 8192, 2048
    assert r.max_by_category["weight"] == w1 + w2
    assert r.end_by_category["weight_grad"] == w1 + w2
    # The peak, in the first Linear's backward (its weight gradient is being made): the weights, the
    # second layer's weight gradient, the input x (16x32), the ReLU's output (16x64, saved for its
    # backward), the gradient reaching it (16x64) and the one leaving the ReLU (16x64), the scalar
    # loss and its seed gradient (4 bytes each); or, with the same total, the first layer's weight
    # gradient (8192) in place of the ReLU's output and the gradient reaching it.
    peak = w1 + w2 + w2 + 16 * 32 * F32 + 3 * 16 * 64 * F32 + 2 * F32
    assert r.peak_bytes == peak == 26632
    assert r.peak_by_category["weight"] == w1 + w2
    assert sum(r.peak_by_category[c] for c in ("weight", "weight_grad", "tensor", "workspace")) == r.peak_bytes


def test_a_host_copy_is_its_own_category_outside_the_device_peak():
    with StepTracker() as tracker:
        dev = torch.ones(1000)
        with allocated_as("host"):
            host = torch.empty_like(dev)
        host.copy_(dev)
        del dev
    r = tracker.report()
    assert r.host_peak_bytes == 4000 and r.end_by_category["host"] == 4000
    assert r.peak_bytes == 4000 and r.end_by_category["tensor"] == 0
    assert [b for _, b in r.host_memory] == [0, 4000]
    with pytest.raises(InvalidInput, match="category must be one of"), allocated_as("gpu"):
        pass


def test_the_executors_host_copies_are_counted_as_host():
    model = SmallNet()
    x, y = _data(n=8)

    def loss(out):
        return nn.functional.cross_entropy(out, y)

    offload = _hand_plan(model, x, HAND_PLANS["offload-all"], loss=loss)
    keep = _hand_plan(model, x, HAND_PLANS["keep"], loss=loss)
    checked = check_plan(model, offload, x, y, steps=1)
    buffers = [h for _, pool in _prepared(model, offload).copies.values() for h in pool.held()]
    assert buffers, "the plan offloads: the executor holds host buffers"
    assert checked.host_peak_bytes == sum(h.untyped_storage().nbytes() for h in buffers)
    assert checked.tracker.peak_by_category["host"] == checked.host_peak_bytes
    assert checked.bytes_moved > 0
    # the offloaded feature maps leave the device's count
    assert checked.peak_bytes < check_plan(model, keep, x, y, steps=1).peak_bytes


def test_a_handles_workspace_is_its_own_category():
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1))
    model = convert(plain, backend="cpu", policy="undivided", reps=1, db="sqlite://", total_workspace="1MiB")
    x = torch.randn(2, 3, 8, 8)
    model(x)  # the WD arena is taken at the first solve
    with StepTracker(model) as tracker:
        model(x).sum().backward()
    r = tracker.report()
    handle = next(m.handle for m in model.modules() if hasattr(m, "handle"))
    assert handle.workspace_bytes == 2**20
    assert r.max_by_category["workspace"] == r.end_by_category["workspace"] == 2**20
    assert r.peak_by_category["workspace"] == 2**20


def test_check_plan_reports_every_field_and_leaves_the_model_as_it_was():
    torch.manual_seed(0)
    model = SmallNet()
    x, y = _data(n=16)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    plan = plan_memory(
        model, x, memory_limit=2**30, policy="checkpoint", loss=lambda out: nn.functional.cross_entropy(out, y)
    )
    checked = check_plan(model, plan, x, y, steps=2)
    assert checked.policy == "checkpoint" and checked.device == "cpu"
    assert checked.predicted_peak_bytes == plan.peak_bytes and checked.predicted_step_ms == plan.step_ms
    assert len(checked.step_ms_samples) == 2 and checked.step_ms > 0
    assert checked.peak_bytes == checked.tracker.peak_bytes > 0
    assert checked.peak_ratio == checked.peak_bytes / plan.peak_bytes
    assert checked.bytes_moved == checked.predicted_bytes_moved == 0
    data = checked.to_json()
    assert set(data) == {
        "policy",
        "device",
        "plan_device",
        "memory_limit",
        "fits",
        "predicted",
        "achieved",
        "peak_ratio",
        "step_ratio",
    }
    assert data["memory_limit"] == 2**30 and data["fits"] is plan.fits and checked.plan is plan
    assert data["achieved"]["peak_bytes"] == checked.peak_bytes
    assert all(p.grad is None for p in model.parameters())
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    with pytest.raises(InvalidInput, match="steps must be"):
        check_plan(model, plan, x, y, steps=0)


class Chain(nn.Module):
    """Convs and ReLUs on 32x32 maps: feature maps dwarf what a plan does not model (labels, the loss)."""

    def __init__(self, layers: int = 8, channels: int = 16) -> None:
        super().__init__()
        mods = [nn.Conv2d(3, channels, 3, padding=1), nn.ReLU()]
        for _ in range(layers - 1):
            mods += [nn.Conv2d(channels, channels, 3, padding=1), nn.ReLU()]
        self.body = nn.Sequential(*mods, nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.fc = nn.Linear(channels, 10)

    def forward(self, x):
        return self.fc(self.body(x))


@pytest.mark.parametrize("policy", available_policies())
def test_every_policy_fits_and_reaches_its_predicted_peak(policy):
    """Planned for this CPU: checkpoint and optimal, at a limit halfway between their smallest peak and
    keeping everything, fit, recompute, and a real step reaches the predicted peak. The offloading
    policies cannot offload where the device's memory is the host's: they plan as vdnn-dyn does there
    (keep every map), fit the peak of keeping everything, and reach it. (Their offloads are checked
    against a real step on a GPU: tests/test_torch_memory.py::test_gpu_peak_memory_follows_the_plan.)"""
    torch.manual_seed(0)
    model = Chain()
    x = torch.randn(8, 3, 32, 32)
    y = torch.randint(0, 10, (8,))
    loss = lambda out: nn.functional.cross_entropy(out, y)
    everything = plan_memory(model, x, memory_limit=2**40, policy=policy, loss=loss).peak_bytes
    if policy in OFFLOADING:
        plan = plan_memory(model, x, memory_limit=everything, policy=policy, loss=loss)
        dyn = plan_memory(model, x, memory_limit=everything, policy="vdnn-dyn", loss=loss)
        assert plan.tensors == dyn.tensors and all(t.action in ("keep", "release") for t in plan.tensors)
    else:
        smallest = plan_memory(model, x, memory_limit=1, policy=policy, loss=loss).peak_bytes
        assert smallest < 0.8 * everything
        plan = plan_memory(model, x, memory_limit=(everything + smallest) // 2, policy=policy, loss=loss)
        assert any(t.action == "recompute" for t in plan.tensors)
    assert plan.fits
    checked = check_plan(model, plan, x, y, steps=1)
    assert abs(checked.peak_ratio - 1) <= 0.02, (policy, checked.peak_bytes, plan.peak_bytes)


@pytest.mark.gpu
def test_the_count_agrees_with_the_caching_allocator_on_cuda():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device: the allocator witness needs one")
    torch.manual_seed(0)
    model = Chain().cuda()
    x = torch.randn(8, 3, 32, 32, device="cuda")
    model(x).sum().backward()
    with StepTracker(model) as tracker:
        model(x).sum().backward()
    r = tracker.report()
    # the allocator also sees what kernels allocate inside themselves (cuDNN workspaces): never less
    assert r.allocator_peak_bytes is not None and r.allocator_peak_bytes >= r.peak_bytes - 2**20


def test_a_tensor_first_read_inside_a_host_label_is_not_filed_as_host():
    dev = torch.ones(100)  # made before the block
    with StepTracker() as tracker, allocated_as("host"):
        host = torch.empty_like(dev)  # reads `dev` first: it stays a device tensor
    r = tracker.report()
    assert r.end_by_category["host"] == 400 and r.end_by_category["tensor"] == 400
    assert host.shape == dev.shape
