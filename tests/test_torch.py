"""ucudnn.torch: Conv2d and convert() against plain PyTorch on a small ResNet-style model."""

from __future__ import annotations

import contextlib
import copy
import io
import warnings
from types import SimpleNamespace

import numpy as np
import pytest

torch = pytest.importorskip("torch")
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

import ucudnn
from ucudnn import InvalidInput, LateRegistrationWarning, UnsupportedProblem
from ucudnn.backends.cpu import CpuBackend
from ucudnn.torch import Conv2d, announce, convert

RTOL, ATOL = 1e-4, 1e-4
FAST = {"backend": "cpu", "policy": "undivided", "reps": 1, "db": "sqlite://"}


class BasicBlock(nn.Module):
    def __init__(self, c_in: int, c_out: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.downsample = None
        if stride != 1 or c_in != c_out:
            self.downsample = nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride=stride, bias=False), nn.BatchNorm2d(c_out))

    def forward(self, x):
        out = torch.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return torch.relu(out + (x if self.downsample is None else self.downsample(x)))


class SmallResNet(nn.Module):
    """ResNet-18-style, small: a stem, two basic blocks (the second strided, with a 1x1
    projection), then a dilated conv with bias, a grouped and a depthwise conv, a 1x7 conv."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(8)
        self.layer1 = BasicBlock(8, 8, 1)
        self.layer2 = BasicBlock(8, 16, 2)
        self.dilated = nn.Conv2d(16, 16, 3, padding=2, dilation=2)
        self.grouped = nn.Conv2d(16, 16, 3, padding=1, groups=4, bias=False)
        self.depthwise = nn.Conv2d(16, 16, 3, padding=1, groups=16)
        self.wide = nn.Conv2d(16, 12, (1, 7), padding=(0, 3))
        self.fc = nn.Linear(12, 10)

    def forward(self, x):
        x = torch.relu(self.bn1(self.conv1(x)))
        x = self.layer2(self.layer1(x))
        x = torch.relu(self.dilated(x))
        x = torch.relu(self.depthwise(self.grouped(x)))
        x = torch.relu(self.wide(x))
        return self.fc(x.mean((2, 3)))


CONV_NAMES = [
    "conv1",
    "layer1.conv1",
    "layer1.conv2",
    "layer2.conv1",
    "layer2.conv2",
    "layer2.downsample.0",
    "dilated",
    "grouped",
    "depthwise",
    "wide",
]


def _models(**options):
    torch.manual_seed(0)
    ref = SmallResNet()
    model = convert(copy.deepcopy(ref), **{**FAST, **options})
    return ref, model


def _batch(n=4, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 3, 16, 16, generator=g), torch.randint(0, 10, (n,), generator=g)


def _close(actual, expected):
    scale = max(1.0, float(expected.detach().abs().max()))
    torch.testing.assert_close(actual, expected, rtol=RTOL, atol=ATOL * scale)


def _forward_backward(model, x, y):
    x = x.clone().requires_grad_()
    out = model(x)
    loss = nn.functional.cross_entropy(out, y) + out.square().mean()
    loss.backward()
    return out, x.grad


def test_convert_swaps_every_conv_and_keeps_its_parameters():
    torch.manual_seed(0)
    model = SmallResNet()
    params = {name: p for name, p in model.named_parameters()}
    state = copy.deepcopy(model.state_dict())
    assert convert(model, **FAST) is model
    convs = {name: m for name, m in model.named_modules() if isinstance(m, nn.Conv2d)}
    assert list(convs) == CONV_NAMES
    assert all(type(m) is Conv2d for m in convs.values())
    assert {m.layer for m in convs.values()} == set(CONV_NAMES)
    assert len({id(m.handle) for m in convs.values()}) == 1  # one shared handle
    assert all(p is params[name] for name, p in model.named_parameters())  # the same Parameter objects
    assert model.state_dict().keys() == state.keys()
    for key, value in model.state_dict().items():
        assert torch.equal(value, state[key])


NUMPY_ALGOS = ["im2col_gemm", "shift_gemm", "fft", "winograd"]


@pytest.mark.parametrize("algos", [None, ["native"], NUMPY_ALGOS], ids=["all", "native", "numpy"])
def test_outputs_and_gradients_match_torch(algos):
    # native only: every kernel is torch's own undivided convolution, run by torch in place;
    # numpy only: every kernel runs through the handle and the CPU backend's own algorithms.
    ref, model = _models(algos=algos)
    x, y = _batch()
    out_ref, dx_ref = _forward_backward(ref, x, y)
    out, dx = _forward_backward(model, x, y)
    _close(out, out_ref)
    _close(dx, dx_ref)
    for (name, p), (_, q) in zip(ref.named_parameters(), model.named_parameters(), strict=True):
        assert q.grad is not None, name
        _close(q.grad, p.grad)
    handle = model.conv1.handle
    kernels = {(c.layer, c.kind) for c in handle.choices()}
    assert kernels == {(n, k) for n in CONV_NAMES for k in ("fwd", "bwd_data", "bwd_filter")}
    used = {m.algo for c in handle.choices() for m in c.config.micros}
    assert used <= set(algos or used)
    if algos == ["native"]:
        assert handle.peak_workspace == 0  # torch ran every kernel itself: no ucudnn workspace was held
    if algos == NUMPY_ALGOS:
        assert handle.peak_workspace > 0


def test_input_without_grad_skips_bwd_data_and_no_grad_runs_forward_only():
    _, model = _models()
    x, y = _batch()
    with torch.no_grad():
        model(x)
    handle = model.conv1.handle
    assert {c.kind for c in handle.choices()} == {"fwd"}
    nn.functional.cross_entropy(model(x), y).backward()  # the image needs no gradient
    kernels = {(c.layer, c.kind) for c in handle.choices()}
    assert kernels == {(n, k) for n in CONV_NAMES for k in ("fwd", "bwd_data", "bwd_filter")} - {("conv1", "bwd_data")}


def test_three_sgd_steps_give_the_same_weights():
    ref, model = _models(policy="powerOfTwo")
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-4)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-4)
    for step in range(3):
        x, y = _batch(seed=10 + step)
        for m, o in ((ref, opt_ref), (model, opt)):
            o.zero_grad()
            nn.functional.cross_entropy(m(x), y).backward()
            o.step()
    state_ref = ref.state_dict()
    for key, value in model.state_dict().items():
        if value.is_floating_point():
            _close(value, state_ref[key])
        else:
            assert torch.equal(value, state_ref[key])


def test_wd_training_step_stays_within_one_arena():
    total = 2 * 2**20
    ref, model = _models(policy="powerOfTwo", total_workspace=total)
    x, y = _batch()
    announce(model, x)
    handle = model.conv1.handle
    assert set(handle.layers) == set(CONV_NAMES)
    assert handle.layers["conv1"][1] == frozenset({"fwd", "bwd_filter"})  # the image needs no gradient
    assert all(m.training for m in model.modules())  # announce restores the training flags
    bn = model.bn1.running_mean.clone()
    assert handle.choices() == [] and handle.arena is None  # announcing measures nothing
    with warnings.catch_warnings():
        warnings.simplefilter("error", LateRegistrationWarning)
        out = model(x)  # a training step: the image needs no gradient, as announced
        nn.functional.cross_entropy(out, y).backward()
    out_ref = ref(x)
    nn.functional.cross_entropy(out_ref, y).backward()
    _close(out, out_ref)
    for p, q in zip(ref.parameters(), model.parameters(), strict=True):
        _close(q.grad, p.grad)
    assert not torch.equal(model.bn1.running_mean, bn)  # the real step did update it
    assert 0 < handle.peak_workspace <= total
    assert isinstance(handle.arena, np.ndarray) and handle.arena.nbytes == total
    choices = handle.choices()
    assert len(choices) == 3 * len(CONV_NAMES) - 1
    assert sum(c.config.workspace for c in choices) <= handle.peak_workspace <= total


def test_wd_late_layer_warns_and_resolves():
    _, model = _models(total_workspace="4MiB")
    x, y = _batch()
    announce(model, x)
    nn.functional.cross_entropy(model(x), y).backward()
    handle = model.conv1.handle
    extra = Conv2d(3, 4, 3, padding=1, handle=handle, layer="extra")
    with pytest.warns(LateRegistrationWarning, match="extra"):
        extra(x)
    assert "extra" in handle.layers and ("extra", "fwd") in {(c.layer, c.kind) for c in handle.choices()}
    assert handle.peak_workspace <= handle.total_workspace


def test_wr_small_limit_micro_batches_and_still_matches():
    batch = 8
    x, y = _batch(batch)
    # Discover the kernels, then pick a limit that admits im2col at 1 sample everywhere but not at 8.
    _, probe = _models()
    _forward_backward(probe, x, y)
    cpu = CpuBackend()
    problems = [c.problem for c in probe.conv1.handle.choices()]
    limit = max(cpu.workspace_size(p.with_batch(1), "im2col_gemm") for p in problems)
    assert any(cpu.workspace_size(p, "im2col_gemm") > limit for p in problems)

    ref, model = _models(policy="powerOfTwo", workspace_limit=limit, algos=["im2col_gemm"])
    out_ref, dx_ref = _forward_backward(ref, x, y)
    out, dx = _forward_backward(model, x, y)
    _close(out, out_ref)
    _close(dx, dx_ref)
    for p, q in zip(ref.parameters(), model.parameters(), strict=True):
        _close(q.grad, p.grad)
    handle = model.conv1.handle
    split = [c for c in handle.choices() if c.micro_batched]
    assert split, "no kernel was micro-batched"
    assert any(c.kind == "bwd_filter" for c in split) or any(c.kind == "fwd" for c in split)
    assert all(c.config.workspace <= limit for c in handle.choices())
    assert 0 < handle.peak_workspace <= limit


def test_state_dict_round_trips_both_ways_and_repr_is_identical():
    torch.manual_seed(0)
    for args, kwargs in [
        ((3, 8, 3), {"stride": 2, "padding": 1, "bias": False}),
        ((4, 8, (1, 7)), {"padding": (0, 3), "groups": 2, "dilation": (1, 2)}),
        ((6, 6, 3), {"padding": "same", "padding_mode": "reflect", "groups": 6}),
    ]:
        plain = nn.Conv2d(*args, **kwargs)
        ours = Conv2d(*args, **kwargs, handle=ucudnn.Handle(**FAST))
        assert repr(ours) == repr(plain)
        assert ours.state_dict().keys() == plain.state_dict().keys()
        ours.load_state_dict(plain.state_dict())
        for key, value in plain.state_dict().items():
            assert torch.equal(ours.state_dict()[key], value)
        torch.manual_seed(1)
        again = Conv2d(*args, **kwargs, handle=ours.handle)
        plain.load_state_dict(again.state_dict())
        for key, value in again.state_dict().items():
            assert torch.equal(plain.state_dict()[key], value)


def test_same_initialisation_as_nn_conv2d():
    torch.manual_seed(3)
    plain = nn.Conv2d(5, 7, 3, groups=1)
    torch.manual_seed(3)
    ours = Conv2d(5, 7, 3, handle=ucudnn.Handle(**FAST))
    assert torch.equal(plain.weight, ours.weight) and torch.equal(plain.bias, ours.bias)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"kernel_size": 3, "padding": 1, "padding_mode": "reflect"},
        {"kernel_size": 3, "padding": (1, 2), "padding_mode": "replicate"},
        {"kernel_size": 3, "padding": 1, "padding_mode": "circular", "stride": 2},
        {"kernel_size": 4, "padding": "same"},  # asymmetric: padded first
        {"kernel_size": (3, 5), "padding": "same", "dilation": 2},  # symmetric: padded in the kernel
        {"kernel_size": (2, 3), "padding": "same", "padding_mode": "reflect"},
        {"kernel_size": 3, "padding": "valid", "stride": 2},
    ],
    ids=lambda kw: "-".join(f"{k}={v}" for k, v in kw.items()),
)
def test_padding_modes_and_string_padding_match_torch(kwargs):
    torch.manual_seed(0)
    plain = nn.Conv2d(4, 6, **kwargs)
    ours = convert(copy.deepcopy(plain), **FAST)
    assert type(ours) is Conv2d
    x = torch.randn(2, 4, 9, 11)
    xs = [x.clone().requires_grad_() for _ in range(2)]
    outs = [m(xi) for m, xi in zip((plain, ours), xs)]
    _close(outs[1], outs[0])
    for out in outs:
        out.square().sum().backward()
    _close(xs[1].grad, xs[0].grad)
    _close(ours.weight.grad, plain.weight.grad)
    _close(ours.bias.grad, plain.bias.grad)


def test_unbatched_input_and_non_contiguous_input():
    torch.manual_seed(0)
    plain = nn.Conv2d(3, 5, 3, padding=1)
    ours = convert(copy.deepcopy(plain), **FAST)
    x = torch.randn(3, 10, 10)
    _close(ours(x), plain(x))
    xt = torch.randn(2, 10, 10, 3).permute(0, 3, 1, 2)  # channels-last memory
    _close(ours(xt), plain(xt))


@pytest.mark.parametrize("algos", [["native"], ["im2col_gemm"]], ids=["torch runs it", "routed"])
@pytest.mark.parametrize("path", ["eager", "operator"])
@pytest.mark.parametrize("layout", ["channels-last", "a channel slice of a channels-last map"])
def test_a_channels_last_input_gets_torchs_layout_back_on_every_route(algos, path, layout):
    # torch's own convolution takes a channels-last map (diffusers' VAE makes them after attention) as it is and
    # answers in that layout (made contiguous first, it cost a copy and NCHW kernels: 4-5% of the VAE's step).
    # Every route of a converted layer answers as torch does, the operator's (a captured step's) and its fake
    # one included: a plan follows the captured step's operations, which a layout changed midway would change
    from ucudnn.torch.converting.layer import through_operators

    torch.manual_seed(0)
    plain = nn.Conv2d(4, 5, 3, padding=1)
    ours = convert(copy.deepcopy(plain), **FAST, algos=algos)
    x = torch.randn(2, 8, 10, 10).to(memory_format=torch.channels_last)
    x = x[:, :4] if layout.startswith("a channel slice") else x[:, 4:].contiguous(memory_format=torch.channels_last)
    assert not x.is_contiguous()
    y = torch.randn(2, 5, 10, 10).softmax(1)
    with through_operators() if path == "operator" else contextlib.nullcontext():
        out, dx = _forward_backward(ours, x, y)
    out_ref, dx_ref = _forward_backward(plain, x, y)
    _close(out, out_ref)
    _close(dx, dx_ref)
    _close(ours.weight.grad, plain.weight.grad)
    if path == "eager":
        (route,) = ours._routes.values()
        assert route.direct == (algos == ["native"])
    assert out_ref.is_contiguous(memory_format=torch.channels_last)
    assert out.stride() == out_ref.stride() and dx.stride() == dx_ref.stride()
    with FakeTensorMode(allow_non_fake_inputs=True) as mode, through_operators():
        fake = ours(mode.from_tensor(x))
    assert fake.stride() == out_ref.stride()


def test_float64_runs_and_unsupported_dtypes_are_refused():
    torch.manual_seed(0)
    plain = nn.Conv2d(3, 4, 3).double()
    ours = convert(copy.deepcopy(plain), **FAST)
    x = torch.randn(2, 3, 6, 6, dtype=torch.float64)
    torch.testing.assert_close(ours(x), plain(x))
    with pytest.raises(ucudnn.UcudnnError, match="bfloat16"):
        convert(nn.Conv2d(3, 4, 3).bfloat16(), **FAST)(x.bfloat16())


def test_optimizer_built_before_convert_still_trains_the_model():
    torch.manual_seed(0)
    model = SmallResNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = model.wide.weight.detach().clone()
    convert(model, **FAST)
    x, y = _batch()
    nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
    assert not torch.equal(model.wide.weight, before)


def test_converted_models_copy_and_pickle():
    ref, model = _models()
    x, _ = _batch()
    clone = copy.deepcopy(model)
    assert clone.conv1.handle is not model.conv1.handle
    assert clone.conv1.handle is clone.wide.handle  # still one handle per model
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    with torch.no_grad():
        for m in (clone, loaded):
            _close(m(x), ref(x))


def test_convert_options():
    torch.manual_seed(0)
    handle = ucudnn.Handle(**FAST)
    model = convert(SmallResNet(), handle=handle)
    assert all(m.handle is handle for m in model.modules() if isinstance(m, Conv2d))
    with pytest.raises(InvalidInput, match="not both"):
        convert(SmallResNet(), handle=handle, policy="all")
    single = convert(nn.Conv2d(3, 4, 3), handle=handle)
    assert type(single) is Conv2d and single.layer == "conv"

    class Custom(nn.Conv2d):
        def forward(self, input):
            return super().forward(input) * 2

    with pytest.warns(UserWarning, match=r"left 1 convolution\(s\) to PyTorch: 0 \(.*Custom: overrides forward\)"):
        wrapped = convert(nn.Sequential(Custom(3, 4, 3)), handle=handle)
    assert type(wrapped[0]) is Custom
    with pytest.raises(InvalidInput, match="no ucudnn"):
        announce(nn.Sequential(nn.ReLU()), torch.zeros(1))


def test_standalone_conv2d_uses_its_id_as_layer():
    ours = Conv2d(3, 4, 3, handle=ucudnn.Handle(**FAST))
    ours(torch.randn(2, 3, 5, 5))
    assert {c.layer for c in ours.handle.choices()} == {f"conv@{id(ours):x}"}


def test_a_cuda_input_on_another_device_than_the_cudnn_backend_is_refused_before_planning():
    # Planned anyway, the backend's device measured its engines on the other device's memory (through
    # peer access, or failing inside CuPy) before the first run refused the operands.
    ours = Conv2d(3, 4, 3, handle=ucudnn.Handle(**FAST))
    ours.handle = SimpleNamespace(backend=SimpleNamespace(name="cudnn", device_id=0))  # a cudnn handle on cuda:0
    x = SimpleNamespace(device=torch.device("cuda", 1), dtype=torch.float32, shape=(2, 3, 5, 5))
    with pytest.raises(InvalidInput, match=r"input is on cuda:1.*runs on cuda:0.*set_device\(1\)"):
        ours._route(x, ours.weight, ours._geometry((0, 0)), "NCHW", True, True)


def test_planning_inside_cuda_graph_capture_is_refused_before_anything_is_measured(monkeypatch):
    # Planned under capture, every candidate's timing would fail (a capture forbids synchronising) and
    # be recorded in the cache as unusable.
    ours = Conv2d(3, 4, 3, handle=ucudnn.Handle(**FAST))
    registered = []
    ours.handle = SimpleNamespace(
        backend=SimpleNamespace(name="cudnn", device_id=0), register=lambda *a, **k: registered.append(a)
    )
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    x = SimpleNamespace(device=torch.device("cuda", 0), dtype=torch.float32, shape=(2, 3, 5, 5))
    with pytest.raises(UnsupportedProblem, match=r"inside CUDA graph capture.*warm-up"):
        ours._route(x, ours.weight, ours._geometry((0, 0)), "NCHW", True, True)
    assert registered == []


@pytest.mark.gpu
def test_cuda_tensors_through_the_cudnn_backend():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (torch.cuda.is_available() is False)")
    pytest.importorskip("cupy", reason="CUDA tensors go through CuPy")
    try:
        handle = ucudnn.Handle(backend="cudnn", policy="undivided", reps=1, db="sqlite://")
    except ucudnn.BackendUnavailable as exc:
        pytest.skip(f"cudnn backend unavailable: {exc}")
    torch.manual_seed(0)
    plain = nn.Conv2d(8, 16, 3, padding=1).cuda()
    ours = convert(copy.deepcopy(plain), handle=handle)
    x = torch.randn(4, 8, 12, 12, device="cuda")
    xs = [x.clone().requires_grad_() for _ in range(2)]
    outs = [m(xi) for m, xi in zip((plain, ours), xs)]

    def close(actual, expected):
        # Both sides may compute float32 on TF32 tensor cores (10-bit mantissa), each its own way:
        # the weight gradient sums 576 products, so they may differ by ~1e-3 of its largest value.
        torch.testing.assert_close(actual, expected, rtol=0, atol=5e-3 * float(expected.abs().max()))

    close(outs[1], outs[0])
    for out in outs:
        out.square().sum().backward()
    close(xs[1].grad, xs[0].grad)
    close(ours.weight.grad, plain.weight.grad)
    close(ours.bias.grad, plain.bias.grad)
