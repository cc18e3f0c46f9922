"""ucudnn.torch under torch.compile and torch.export: the converted convolutions are the operators of
ucudnn.torch.converting.ops, traced without graph breaks and planned when the graph runs, on real tensors.

References are torch's own nn.Conv2d (independent of ucudnn) on fresh random data. Most compiles use
the "aot_eager" backend (Dynamo, the operators' fake implementations and AOTAutograd, without
Inductor's code generation, which takes tens of seconds on 2 cores); one test runs Inductor itself.
"""

from __future__ import annotations

import copy
import warnings

import pytest

torch = pytest.importorskip("torch")
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

import ucudnn
from ucudnn import Handle, InvalidInput, LateRegistrationWarning
from ucudnn.torch import Conv2d, convert
from ucudnn.torch.converting import ops

RTOL, ATOL = 1e-4, 1e-4
# ucudnn's own NumPy kernels (no `native`): every kernel of every layer runs through the handle
NUMPY = {"backend": "cpu", "policy": "undivided", "algos": ["im2col_gemm"], "reps": 1, "db": False}
# micro-batches of one sample each, to run the handle's micro-batch sequencing inside the operators
MICRO = {**NUMPY, "policy": (1,)}


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Each test compiles new modules with the same code: without a reset, Dynamo's per-code
    recompile limit (8) would be reached across tests."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _rand(*shape, seed, requires_grad=False):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).requires_grad_(requires_grad)


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


class ResNet18(nn.Module):
    """ResNet-18's layer shapes (7x7/2 stem, max-pool, basic blocks [2, 2, 2, 2], 1x1 projections),
    with the channel widths divided by `width_div` so that a CPU test stays fast."""

    def __init__(self, width_div: int = 1, num_classes: int = 10) -> None:
        super().__init__()
        w = [c // width_div for c in (64, 128, 256, 512)]
        self.conv1 = nn.Conv2d(3, w[0], 7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(w[0])
        blocks, c_in = [], w[0]
        for i, c in enumerate(w):
            blocks += [BasicBlock(c_in, c, 1 if i == 0 else 2), BasicBlock(c, c, 1)]
            c_in = c
        self.layers = nn.Sequential(*blocks)
        self.fc = nn.Linear(w[-1], num_classes)

    def forward(self, x):
        x = nn.functional.max_pool2d(torch.relu(self.bn1(self.conv1(x))), 3, 2, 1)
        return self.fc(self.layers(x).mean((2, 3)))


class Mixed(nn.Module):
    """Every geometry at once: strided, dilated with bias, grouped, depthwise, 'same' (odd and
    even kernels: the even one pads asymmetrically with F.pad), reflect padding, a 1x7 kernel."""

    def __init__(self) -> None:
        super().__init__()
        self.strided = nn.Conv2d(3, 8, 3, stride=2, padding=1, bias=False)
        self.dilated = nn.Conv2d(8, 8, 3, padding=2, dilation=2)
        self.grouped = nn.Conv2d(8, 8, 3, padding=1, groups=4, bias=False)
        self.depthwise = nn.Conv2d(8, 8, 3, padding="same", groups=8)
        self.even_same = nn.Conv2d(8, 8, 4, padding="same", bias=False)
        self.reflect = nn.Conv2d(8, 8, 3, padding=1, padding_mode="reflect")
        self.wide = nn.Conv2d(8, 6, (1, 7), padding=(0, 3))

    def forward(self, x):
        for conv in (self.strided, self.dilated, self.grouped, self.depthwise, self.even_same, self.reflect):
            x = torch.relu(conv(x))
        return self.wide(x)


LAYERS = {
    "strided": {"in_channels": 4, "out_channels": 6, "kernel_size": 3, "stride": 2, "padding": 1},
    "dilated": {"in_channels": 4, "out_channels": 6, "kernel_size": 3, "padding": 2, "dilation": 2},
    "grouped": {"in_channels": 4, "out_channels": 6, "kernel_size": 3, "padding": 1, "groups": 2},
    "same": {"in_channels": 4, "out_channels": 6, "kernel_size": 3, "padding": "same"},
    "same-even": {"in_channels": 4, "out_channels": 6, "kernel_size": (2, 4), "padding": "same"},
    "strided-dilated-1x1": {"in_channels": 4, "out_channels": 8, "kernel_size": 1, "stride": (2, 1)},
}


def _step(model, x, dy):
    """Forward and backward: the output, the input's gradient and the parameters' gradients."""
    x = x.detach().clone().requires_grad_()
    y = model(x)
    y.backward(dy)
    return y.detach(), x.grad, [p.grad.clone() for p in model.parameters()]


def _assert_step_close(ours, ref):
    torch.testing.assert_close(ours[0], ref[0], rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(ours[1], ref[1], rtol=RTOL, atol=ATOL)
    assert len(ours[2]) == len(ref[2])
    for a, b in zip(ours[2], ref[2]):
        torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL)


def _routed_kinds(model) -> set[str]:
    """The kernel kinds that ran through a handle (not torch) in some layer's route."""
    kinds = set()
    for m in model.modules():
        if isinstance(m, Conv2d):
            for route in m._routes.values():
                kinds |= {k for k in ("fwd", "bwd_data", "bwd_filter") if getattr(route, k) is not None}
    return kinds


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
@pytest.mark.parametrize("name", list(LAYERS))
def test_a_compiled_layer_equals_torch_forward_and_backward(name, bias):
    torch.manual_seed(0)
    plain = nn.Conv2d(**LAYERS[name], bias=bias)
    ours = convert(copy.deepcopy(plain), **MICRO)
    compiled = torch.compile(ours, backend="aot_eager", fullgraph=True)
    for seed in range(2):  # the second call runs the prepared kernels
        for m in (plain, ours):
            m.zero_grad()
        x = _rand(3, 4, 9, 10, seed=seed)
        dy = _rand(*plain(x).shape, seed=seed + 100)
        _assert_step_close(_step(compiled, x, dy), _step(plain, x, dy))
    assert _routed_kinds(ours) == {"fwd", "bwd_data", "bwd_filter"}
    (route,) = ours._routes.values()
    assert all(len(k.config.micros) == 3 for k in (route.fwd, route.bwd_data, route.bwd_filter))  # 3 micro-batches


def test_compiled_and_eager_share_the_prepared_route():
    torch.manual_seed(0)
    ours = convert(nn.Conv2d(4, 6, 3, padding=1), **NUMPY)
    x, dy = _rand(2, 4, 8, 8, seed=1), _rand(2, 6, 8, 8, seed=2)
    eager = _step(ours, x, dy)
    (route,) = ours._routes.values()
    ours.zero_grad()
    compiled = _step(torch.compile(ours, backend="aot_eager", fullgraph=True), x, dy)
    _assert_step_close(compiled, eager)
    assert list(ours._routes.values()) == [route]  # planned once, in eager mode; the operators found it


def test_inductor_compiles_without_graph_breaks_and_equals_torch():
    torch.manual_seed(0)
    plain = Mixed()
    ours = convert(copy.deepcopy(plain), **NUMPY)
    compiled = torch.compile(ours, fullgraph=True)  # Inductor
    for seed in range(2):
        for m in (plain, ours):
            m.zero_grad()
        x = _rand(2, 3, 16, 16, seed=seed)
        dy = _rand(*plain(x).shape, seed=seed + 10)
        _assert_step_close(_step(compiled, x, dy), _step(plain, x, dy))
    assert _routed_kinds(ours) == {"fwd", "bwd_data", "bwd_filter"}


def _maps_of_both_formats():
    """Inputs and layers where a map is both contiguous and channels-last-contiguous (a dim of size 1), so that
    only its strides (`Tensor.suggest_memory_format`) say which format torch's convolution answers in."""
    g = torch.Generator().manual_seed(0)
    nhwc = torch.randn(2, 3, 3, 8, generator=g).permute(0, 3, 1, 2)  # channels-last strides, as ConvNeXt's maps
    return {
        "pooled-channels-last": (nn.functional.adaptive_avg_pool2d(nhwc, 1), nn.Conv2d(8, 4, 1)),  # strides 8,1,8,8
        "pooled-contiguous": (nn.functional.adaptive_avg_pool2d(nhwc.contiguous(), 1), nn.Conv2d(8, 4, 1)),
        "one-output-channel": (nhwc, nn.Conv2d(8, 1, 3, padding=1)),
        "one-input-channel": (torch.randn(2, 5, 5, 1, generator=g).permute(0, 3, 1, 2), nn.Conv2d(1, 4, 3)),
        "1x1-output": (nhwc, nn.Conv2d(8, 4, 3)),
    }


@pytest.mark.parametrize("name", list(_maps_of_both_formats()))
def test_a_map_of_both_formats_gets_the_strides_torchs_convolution_gives(name):
    # torch's convolution gives a pooled channels-last N x C x 1 x 1 map (strides C, 1, C, C) a channels-last
    # output and input gradient; the layer gave contiguous strides (Tensor.is_contiguous holds for both formats,
    # and .contiguous(channels_last) keeps such a tensor as it is), and in UperNet the contiguous strides carried
    # on through the head's concatenation, so that Inductor vectorized the bilinear upsampling's backward (a
    # scatter-add into the 1x1 map) along a dim its index does not depend on and failed an assert
    x, plain = _maps_of_both_formats()[name]
    torch.manual_seed(0)
    plain = plain.requires_grad_(False)  # dx alone, so that the compiled backward is convolution_backward_data
    ours = convert(copy.deepcopy(plain), **NUMPY)
    x = x.detach().requires_grad_()
    y = plain(x)
    dy = _rand(*y.shape, seed=1)
    (dx,) = torch.autograd.grad(y, x, dy)
    compiled = torch.compile(ours, backend="aot_eager", fullgraph=True)
    for model in (ours, compiled):  # the eager route (_ConvFunction) and the operators
        out = model(x)
        (grad,) = torch.autograd.grad(out, x, dy)
        assert (out.stride(), grad.stride()) == (y.stride(), dx.stride())
        torch.testing.assert_close((out, grad), (y, dx), rtol=RTOL, atol=ATOL)
    ours.weight.requires_grad_(True)  # dx and dw by one operator
    out = torch.compile(ours, backend="aot_eager", fullgraph=True)(x)
    assert torch.autograd.grad(out, x, dy)[0].stride() == dx.stride()
    assert _routed_kinds(ours) >= {"fwd", "bwd_data"}
    key, conv = (
        ops.layer_key(ours),
        {
            "stride": list(plain.stride),
            "padding": list(plain.padding),
            "dilation": list(plain.dilation),
            "transposed": False,
            "output_padding": [0, 0],
            "groups": 1,
            "layout": "NCHW",
        },
    )
    with FakeTensorMode() as mode:  # the fake implementations, against torch's meta convolution
        fx, fw = mode.from_tensor(x), mode.from_tensor(plain.weight)
        fy = torch.ops.ucudnn.convolution(fx, fw, key, **conv, need_dx=True, need_dw=True)
        assert fy.stride() == nn.functional.conv2d(fx, fw, None, plain.stride, plain.padding).stride() == y.stride()
        fdx, _ = torch.ops.ucudnn.convolution_backward(mode.from_tensor(dy), fx, fw, key, **conv)
        assert fdx.stride() == dx.stride()


def _uncached():
    """Inductor without its compiled-graph caches: their keys do not hold the strides an operator's fake
    implementation gives, so that a graph compiled before a change to them (another run's, on this machine)
    would be reused as it was."""
    return torch._inductor.config.patch(force_disable_caches=True)


class _PooledBranch(nn.Module):
    """UperNet's pyramid pooling on a ConvNeXt map, cut down: the map's global average (1x1) through a 1x1
    convolution, upsampled bilinearly back to the map and concatenated with it, then a 3x3 convolution."""

    def __init__(self) -> None:
        super().__init__()
        self.pooled = nn.Conv2d(8, 4, 1)
        self.fuse = nn.Conv2d(12, 4, 3, padding=1)

    def forward(self, x):
        x = x.permute(0, 3, 1, 2)  # NHWC as NCHW: channels-last strides
        p = self.pooled(nn.functional.adaptive_avg_pool2d(x, 1))
        p = nn.functional.interpolate(p, size=x.shape[2:], mode="bilinear", align_corners=False)
        return self.fuse(torch.cat([x, p], 1))


def test_inductor_compiles_a_pooled_channels_last_branch_as_torch_does():
    # with a contiguous 1x1 output here, Inductor's CPU code generation failed with an empty AssertionError
    # (cpp.py, atomic_add of a vectorized store) on the upsampling's backward, where plain PyTorch compiles
    torch.manual_seed(0)
    plain = _PooledBranch()
    ours = convert(copy.deepcopy(plain), **NUMPY)
    compiled = torch.compile(ours, fullgraph=True)  # Inductor
    with _uncached():
        for seed in range(2):
            for m in (plain, ours):
                m.zero_grad()
            x = _rand(2, 2, 2, 8, seed=seed)
            dy = _rand(2, 4, 2, 2, seed=seed + 10)
            _assert_step_close(_step(compiled, x, dy), _step(plain, x, dy))
    assert _routed_kinds(ours) == {"fwd", "bwd_data", "bwd_filter"}


def _upernet():
    """HF UperNet on a two-stage ConvNeXt, from configs (no weights): its last map (2x2 for a 16x16 image) is
    channels-last-strided and pooled to 1x1 by the pyramid's first scale. (The default pool scales: with (1, 2)
    at this size, plain PyTorch's Inductor gives every parameter a zero gradient, torch 2.13.)"""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    backbone = transformers.ConvNextConfig(
        num_stages=2, hidden_sizes=[8, 16], depths=[1, 1], out_features=["stage1", "stage2"]
    )
    config = transformers.UperNetConfig(backbone_config=backbone, hidden_size=8, num_labels=3, use_auxiliary_head=False)
    return transformers.UperNetForSemanticSegmentation(config)


def _train(model, steps: int = 2, compile: bool = False, threads: int | None = None):
    """SGD steps on fixed batches of two 16x16 images: the losses and every parameter, flattened."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads or before)
    try:
        step = torch.compile(model) if compile else model
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        g = torch.Generator().manual_seed(1)
        losses = []
        for _ in range(steps):
            x = torch.randn(2, 3, 16, 16, generator=g)
            labels = torch.randint(0, 3, (2, 16, 16), generator=g)
            optimizer.zero_grad()
            loss = step(pixel_values=x, labels=labels).loss
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
    finally:
        torch.set_num_threads(before)
    return losses, torch.cat([p.detach().flatten() for p in model.parameters()])


@pytest.mark.slow
def test_a_compiled_upernet_trains_as_plain_compiled():
    # Inductor on both (about a minute each on 2 cores): the converted model failed to compile, with the empty
    # AssertionError above, where plain PyTorch compiles and trains
    plain = _upernet()
    start = torch.cat([p.detach().flatten() for p in plain.parameters()])
    _, one = _train(copy.deepcopy(plain), threads=1)
    _, two = _train(copy.deepcopy(plain), threads=2)
    losses, params = _train(copy.deepcopy(plain), compile=True)
    torch._dynamo.reset()
    ours = convert(copy.deepcopy(plain), **NUMPY)
    with _uncached():
        our_losses, our_params = _train(ours, compile=True)
    assert _routed_kinds(ours) == {"fwd", "bwd_data", "bwd_filter"}
    noise = (one - two).norm()  # plain eager, 1 thread against 2: float32's reduction orders
    update = (params - start).norm()
    assert update > 1e-3  # it trained
    # within rounding: ten times the threads' noise, or 1e-5 of the update (float32's 6e-8 a rounding, through a few
    # hundred operations and sums of hundreds of terms); measured: 3.0e-8 against plain compiled, threads 2.4e-8,
    # update 0.017; a wrong gradient would be of the update's order
    assert (our_params - params).norm() <= max(10 * noise, 1e-5 * update), ((our_params - params).norm(), noise)
    torch.testing.assert_close(our_losses, losses, rtol=1e-5, atol=0)


def test_a_compiled_resnet18_trains_as_torch_does():
    torch.manual_seed(0)
    plain = ResNet18(width_div=16)
    ours = convert(copy.deepcopy(plain), **NUMPY)
    compiled = torch.compile(ours, backend="aot_eager", fullgraph=True)
    for seed in range(2):
        for m in (plain, ours):
            m.zero_grad()
        x = _rand(4, 3, 64, 64, seed=seed)
        dy = _rand(4, 10, seed=seed + 10)
        _assert_step_close(_step(compiled, x, dy), _step(plain, x, dy))
    assert _routed_kinds(ours) == {"fwd", "bwd_data", "bwd_filter"}


@pytest.mark.parametrize("model", [lambda: ResNet18(width_div=8), Mixed], ids=["resnet18", "mixed"])
def test_no_graph_break_at_a_converted_convolution(model):
    torch.manual_seed(0)
    converted = convert(model(), backend="cpu", policy="undivided", reps=1, db=False)
    explanation = torch._dynamo.explain(converted)(_rand(2, 3, 64, 64, seed=0))
    assert explanation.graph_break_count == 0, explanation.break_reasons
    assert explanation.graph_count == 1
    (graph,) = explanation.graphs
    convs = sum(isinstance(m, Conv2d) for m in converted.modules())
    traced = [n for n in graph.graph.nodes if n.target is torch.ops.ucudnn.convolution.default]
    assert len(traced) == convs


def test_a_new_shape_recompiles_and_plans_on_real_tensors(monkeypatch):
    torch.manual_seed(0)
    plain = Mixed()
    ours = convert(copy.deepcopy(plain), **NUMPY)
    planned = []
    route = Conv2d._route

    def spy(self, input, weight, *args):
        fake = isinstance(input, FakeTensor) or isinstance(weight, FakeTensor)
        planned.append((self.layer_id, tuple(input.shape), fake))
        return route(self, input, weight, *args)

    monkeypatch.setattr(Conv2d, "_route", spy)
    compiled = torch.compile(ours, backend="aot_eager", fullgraph=True)
    for n, size in ((2, 16), (3, 16), (2, 20)):
        x = _rand(n, 3, size, size, seed=n + size)
        for m in (plain, ours):
            m.zero_grad()
        dy = _rand(*plain(x).shape, seed=7)
        _assert_step_close(_step(compiled, x, dy), _step(plain, x, dy))
    assert not any(fake for _, _, fake in planned)
    # each layer planned once per input shape (its first kernel plans its route; the others find it)
    layers = [m.layer_id for m in ours.modules() if isinstance(m, Conv2d)]
    assert sorted(planned) == sorted(set(planned))
    assert {layer for layer, _, _ in planned} == set(layers)
    assert len(planned) == 3 * len(layers)


def test_one_dynamic_graph_plans_each_shape_when_it_runs():
    from torch._dynamo.testing import CompileCounterWithBackend

    torch.manual_seed(0)
    plain = nn.Sequential(
        nn.Conv2d(3, 8, 3, stride=2, padding=1), nn.ReLU(), nn.Conv2d(8, 4, 3, padding="same", groups=4)
    )
    ours = convert(copy.deepcopy(plain), **NUMPY)
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(ours, backend=counter, dynamic=True, fullgraph=True)
    for n, size in ((2, 10), (3, 12), (5, 9)):
        for m in (plain, ours):
            m.zero_grad()
        x = _rand(n, 3, size, size, seed=n)
        dy = _rand(*plain(x).shape, seed=size)
        _assert_step_close(_step(compiled, x, dy), _step(plain, x, dy))
    assert counter.frame_count == 1  # one graph with a symbolic shape
    assert [len(m._routes) for m in ours.modules() if isinstance(m, Conv2d)] == [3, 3]  # a route per shape


def test_the_operators_use_the_layers_current_handle():
    """execute_plan swaps a layer's handle for a block: a compiled graph must not have baked the old one in."""
    torch.manual_seed(0)
    ours = convert(nn.Conv2d(4, 6, 3, padding=1), **NUMPY)
    compiled = torch.compile(ours, backend="aot_eager", fullgraph=True)
    x, dy = _rand(2, 4, 8, 8, seed=1), _rand(2, 6, 8, 8, seed=2)
    first = _step(compiled, x, dy)
    swapped = Handle(**{**NUMPY, "algos": ["shift_gemm"]})
    ours.handle, original = swapped, ours.handle
    ours.zero_grad()
    _assert_step_close(_step(compiled, x, dy), first)
    assert {c.config.micros[0].algo for c in swapped.choices()} == {"shift_gemm"}
    assert len(swapped.choices()) == 3
    ours.handle = original
    assert len(original.choices()) == 3


def test_wd_learns_when_the_model_is_compiled_before_its_first_call():
    torch.manual_seed(0)
    plain = Mixed()
    handle = Handle(backend="cpu", policy="undivided", reps=1, db=False, total_workspace="1MiB")
    ours = convert(copy.deepcopy(plain), handle=handle)
    compiled = torch.compile(ours, backend="aot_eager", fullgraph=True)
    layers = {m.layer_id for m in ours.modules() if isinstance(m, Conv2d)}
    with warnings.catch_warnings():
        warnings.simplefilter("error", LateRegistrationWarning)  # every layer registered before the solve
        for seed in range(3):
            for m in (plain, ours):
                m.zero_grad()
            x = _rand(2, 3, 16, 16, seed=seed)
            dy = _rand(*plain(x).shape, seed=seed + 1)
            _assert_step_close(_step(compiled, x, dy), _step(plain, x, dy))
            if seed == 0:
                assert set(handle.layers) == layers  # the first forward pass registered every layer
    assert handle.wd_solved
    assert {c.layer for c in handle.choices()} == layers


def test_export_gives_ucudnn_operator_nodes_that_run_and_equal_eager():
    torch.manual_seed(0)
    plain = ResNet18(width_div=16).eval()
    ours = convert(copy.deepcopy(plain), **NUMPY).eval()
    x = _rand(2, 3, 32, 32, seed=4)
    program = torch.export.export(ours, (x,))
    nodes = [n for n in program.graph.nodes if n.op == "call_function"]
    convs = sum(isinstance(m, Conv2d) for m in ours.modules())
    assert sum(n.target is torch.ops.ucudnn.convolution.default for n in nodes) == convs
    assert not any(
        n.target is torch.ops.aten.conv2d.default or n.target is torch.ops.aten.convolution.default for n in nodes
    )
    with torch.no_grad():
        for seed in (5, 6):  # fresh data, not the example the program was traced with
            x = _rand(2, 3, 32, 32, seed=seed)
            torch.testing.assert_close(program.module()(x), plain(x), rtol=RTOL, atol=ATOL)
    assert "fwd" in _routed_kinds(ours)


def test_fake_implementations_give_shapes_and_strides_without_planning():
    ours = convert(nn.Conv2d(6, 8, (3, 5), stride=(2, 1), padding=(1, 2), dilation=(1, 2), groups=2), **NUMPY)
    key = ops.layer_key(ours)
    conv = {
        "stride": [2, 1],
        "padding": [1, 2],
        "dilation": [1, 2],
        "transposed": False,
        "output_padding": [0, 0],
        "groups": 2,
    }
    with FakeTensorMode():
        x, w = torch.empty(5, 6, 11, 13), torch.empty(8, 3, 3, 5)
        y = torch.ops.ucudnn.convolution(x, w, key, **conv, layout="NCHW", need_dx=True, need_dw=True)
        assert isinstance(y, FakeTensor)
        assert y.shape == (5, 8, 6, 9) and y.is_contiguous()
        dx = torch.ops.ucudnn.convolution_backward_data(y, w, key, [5, 6, 11, 13], **conv, layout="NCHW", need_dw=True)
        assert dx.shape == x.shape and dx.is_contiguous()
        dw = torch.ops.ucudnn.convolution_backward_filter(x, y, w, key, **conv, layout="NCHW", need_dx=True)
        assert dw.shape == w.shape
        dx, dw = torch.ops.ucudnn.convolution_backward(y, x, w, key, **conv, layout="NCHW")
        assert dx.shape == x.shape and dx.is_contiguous() and dw.shape == w.shape
        dx, _ = torch.ops.ucudnn.convolution_backward(
            y, x.to(memory_format=torch.channels_last), w, key, **conv, layout="NCHW"
        )
        assert dx.is_contiguous(memory_format=torch.channels_last)  # as torch's convolution answers it
        nhwc = torch.ops.ucudnn.convolution(x, w, key, **conv, layout="NHWC", need_dx=False, need_dw=False)
        assert nhwc.shape == (5, 8, 6, 9) and nhwc.is_contiguous(memory_format=torch.channels_last)
        with pytest.raises(RuntimeError, match="channels"):
            torch.ops.ucudnn.convolution(
                torch.empty(5, 4, 11, 13), w, key, **conv, layout="NCHW", need_dx=False, need_dw=False
            )
        with pytest.raises(RuntimeError, match="smaller than the dilated filter"):
            torch.ops.ucudnn.convolution(
                torch.empty(5, 6, 11, 1), w, key, **conv, layout="NCHW", need_dx=False, need_dw=False
            )
    assert not ours._routes and not ours.handle.choices()  # nothing was planned or measured


def _samples(layer: Conv2d, seed: int):
    x = _rand(2, 4, 7, 6, seed=seed, requires_grad=True)
    w = layer.weight.detach().clone().requires_grad_()
    conv = {
        "stride": list(layer.stride),
        "padding": list(layer.padding),
        "dilation": list(layer.dilation),
        "transposed": False,
        "output_padding": [0, 0],
        "groups": layer.groups,
        "layout": "NCHW",
    }
    y_shape = nn.functional.conv2d(x, w, None, layer.stride, layer.padding, layer.dilation, layer.groups).shape
    dy = _rand(*y_shape, seed=seed + 1)
    key = ops.layer_key(layer)
    return [
        (torch.ops.ucudnn.convolution.default, (x, w, key), dict(**conv, need_dx=True, need_dw=True)),
        (
            torch.ops.ucudnn.convolution_backward_data.default,
            (dy, w.detach(), key, list(x.shape)),
            dict(**conv, need_dw=True),
        ),
        (
            torch.ops.ucudnn.convolution_backward_filter.default,
            (x.detach(), dy, w.detach(), key),
            dict(**conv, need_dx=True),
        ),
        (torch.ops.ucudnn.convolution_backward.default, (dy, x.detach(), w.detach(), key), conv),
    ]


@pytest.mark.parametrize("options", [NUMPY, {**NUMPY, "algos": ["native"]}], ids=["numpy", "native"])
def test_opcheck_passes_on_the_operators(options):
    layer = convert(nn.Conv2d(4, 6, 3, stride=(1, 2), padding=1, dilation=(2, 1), groups=2, bias=False), **options)
    for op, args, kwargs in _samples(layer, seed=0):
        torch.library.opcheck(op, args, kwargs)


def test_the_real_implementations_equal_torch():
    """Each operator against torch's convolution and its autograd gradients, one kernel at a time."""
    layer = convert(nn.Conv2d(4, 6, 3, padding=1, groups=2, bias=False), **MICRO)
    (fwd, args_f, kw_f), (bwd_data, args_d, kw_d), (bwd_filter, args_w, kw_w), (bwd, args_b, kw_b) = _samples(
        layer, seed=3
    )
    x, w = args_f[0], args_f[1]
    y = nn.functional.conv2d(x, w, None, 1, 1, 1, 2)
    dy = args_d[0]
    dx, dw = torch.autograd.grad(y, (x, w), dy)
    torch.testing.assert_close(fwd(*args_f, **kw_f), y.detach(), rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(bwd_data(*args_d, **kw_d), dx, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(bwd_filter(*args_w, **kw_w), dw, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(bwd(*args_b, **kw_b), (dx, dw), rtol=RTOL, atol=ATOL)
    assert _routed_kinds(layer) == {"fwd", "bwd_data", "bwd_filter"}


def test_a_compiled_backward_asks_a_layer_for_both_gradients_at_once():
    # where torch runs both backward kernels it computes them in one fused call (cheaper than two on the CPU), and
    # a routed layer's backward trial times its kernels against that call: the compiled backward asks a layer
    # for dx and dw by one operator, as eager autograd does; a layer whose input needs no gradient, for dw alone
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    torch.manual_seed(0)
    plain = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, 4, 3, padding=1, bias=False))
    ours = convert(copy.deepcopy(plain), **NUMPY)
    graphs = []

    def keep(gm, example_inputs):
        graphs.append(gm)
        return make_boxed_func(gm.forward)

    compiled = torch.compile(ours, backend=aot_autograd(fw_compiler=keep, bw_compiler=keep), fullgraph=True)
    x, dy = _rand(2, 3, 8, 8, seed=1), _rand(2, 4, 8, 8, seed=2)
    for model in (compiled, plain):
        model(x).backward(dy)
    for a, b in zip(ours.parameters(), plain.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=RTOL, atol=ATOL)
    _forward, backward = graphs
    targets = [n.target for n in backward.graph.nodes if n.op == "call_function"]
    assert targets.count(torch.ops.ucudnn.convolution_backward.default) == 1  # the second layer's dx and dw
    assert targets.count(torch.ops.ucudnn.convolution_backward_filter.default) == 1  # the first layer's dw
    assert torch.ops.ucudnn.convolution_backward_data.default not in targets
    assert _routed_kinds(ours) == {"fwd", "bwd_data", "bwd_filter"}


class _Convolutions(TorchDispatchMode):
    """A dispatch mode that notes the convolution operators it sees."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if "convolution" in func.name():
            self.seen.append(func)
        return func(*args, **(kwargs or {}))


def test_through_the_operators_a_layer_torch_runs_is_torchs_own_convolution():
    # inside a capture or a plan's followed calls a converted layer is one operation; where its route is torch's
    # own kernel of every kind, that operation is torch's aten.convolution with torch's autograd (the operators'
    # Python autograd and dispatch cost about 60 us more per layer on the CPU); a routed layer stays ucudnn's
    from ucudnn.torch.converting.layer import through_operators

    for algos, op, node in (
        (["native"], torch.ops.aten.convolution.default, "ConvolutionBackward0"),
        (["im2col_gemm"], torch.ops.ucudnn.convolution.default, "_ConvolutionBackward"),
    ):
        torch.manual_seed(0)
        plain = nn.Conv2d(4, 6, 3, padding=1)
        ours = convert(copy.deepcopy(plain), **{**NUMPY, "algos": algos})
        x, dy = _rand(2, 4, 8, 8, seed=1), _rand(2, 6, 8, 8, seed=2)
        _step(ours, x, dy)  # eager: plans the layer
        ours.zero_grad()
        with through_operators(), _Convolutions() as mode:
            out = ours(x.detach().requires_grad_())
        assert mode.seen == [op] and type(out.grad_fn).__name__ == node
        out.backward(dy)
        y, _, grads = _step(plain, x, dy)
        torch.testing.assert_close(out.detach(), y, rtol=RTOL, atol=ATOL)
        for p, grad in zip(ours.parameters(), grads):
            torch.testing.assert_close(p.grad, grad, rtol=RTOL, atol=ATOL)


def test_a_planned_layer_called_through_its_operator_runs_its_eager_function_where_no_mode_is_active():
    # the operator's autograd kernel takes a planned layer's eager route on real tensors (its Function, whose
    # backward runs the route): the forward and backward operators below it cost two dispatches to Python more
    # (34 us a tiny layer); a dispatch mode (a capture, a plan's followed calls) still sees the operator
    from ucudnn.torch.converting.layer import through_operators

    torch.manual_seed(0)
    plain = nn.Conv2d(4, 6, 3, padding=1)
    ours = convert(copy.deepcopy(plain), **NUMPY)
    x, dy = _rand(2, 4, 8, 8, seed=1), _rand(2, 6, 8, 8, seed=2)
    ours(x.requires_grad_()).backward(dy)  # eager: plans the layer
    ours.zero_grad()
    x.grad = None
    with through_operators():
        out = ours(x)
    assert type(out.grad_fn).__name__ == "_ConvFunctionBackward"
    out.backward(dy)
    y, dx, grads = _step(plain, x.detach(), dy)
    torch.testing.assert_close(out.detach(), y, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(x.grad, dx, rtol=RTOL, atol=ATOL)
    for p, grad in zip(ours.parameters(), grads):
        torch.testing.assert_close(p.grad, grad, rtol=RTOL, atol=ATOL)
    # without autograd (a compiled graph's forward) the implementation runs itself; a mode still sees the operator
    with torch.no_grad(), through_operators():
        torch.testing.assert_close(ours(x), y, rtol=RTOL, atol=ATOL)
        with _Convolutions() as mode:
            ours(x)
    assert mode.seen == [torch.ops.ucudnn.convolution.default]


class _Branching(nn.Module):
    """A block whose Python reads a value (a graph break inside it, as MONAI's UpCat has one)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(4, 4, 3, padding=1)

    def forward(self, x):
        y = self.conv(x)
        if y.sum().item() > 1e9:
            y = y * 2
        return torch.relu(y)


@torch._dynamo.config.patch(allow_unspec_int_on_nn_module=True)
def test_repeated_blocks_with_a_graph_break_share_their_graphs_when_module_ints_are_inputs():
    # Dynamo compiles a block's frame once for every block of its shape; the layer key a converted conv passes
    # its operators is a module int, which Dynamo bakes in and guards on: one frame per block (past its recompile
    # limit, 8, the frames run eagerly). With module ints as the graph's inputs the key is one (a SymInt in the
    # operators' schema), and the converted blocks share their graphs as plain PyTorch's do.
    import torch._dynamo.utils as dynamo_utils

    torch.manual_seed(0)
    plain = nn.Sequential(*[_Branching() for _ in range(5)])
    ours = convert(copy.deepcopy(plain), **NUMPY)
    graphs = {}
    for name, model in (("plain", plain), ("ours", ours)):
        torch._dynamo.reset()
        dynamo_utils.counters.clear()
        compiled = torch.compile(model, backend="aot_eager")
        x = _rand(2, 4, 8, 8, seed=1)
        for _ in range(2):
            model.zero_grad()
            y = compiled(x)
            y.sum().backward()
        graphs[name] = dynamo_utils.counters["stats"]["unique_graphs"]
    assert graphs["ours"] == graphs["plain"]
    for a, b in zip(ours.parameters(), plain.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=RTOL, atol=ATOL)
    assert _routed_kinds(ours) == {"fwd", "bwd_data", "bwd_filter"}


def test_copies_are_other_layers_to_the_operators():
    model = convert(nn.Sequential(nn.Conv2d(3, 4, 3)), **NUMPY)
    clone = copy.deepcopy(model)
    assert ops.layer_key(clone[0]) != ops.layer_key(model[0])
    assert ops._layer(ops.layer_key(clone[0])) is clone[0]
    assert ops._layer(ops.layer_key(model[0])) is model[0]
    taken = Conv2d.from_conv(model[0], handle=model[0].handle)  # shares parameters, not the key
    assert ops._layer(ops.layer_key(taken)) is taken and ops.layer_key(taken) != ops.layer_key(model[0])
    key = ops.layer_key(clone[0])
    del clone
    import gc

    gc.collect()
    with pytest.raises(InvalidInput, match=f"no live converted convolution has key {key}"):
        torch.ops.ucudnn.convolution(
            torch.randn(1, 3, 5, 5),
            torch.randn(4, 3, 3, 3),
            key,
            [1, 1],
            [0, 0],
            [1, 1],
            False,
            [0, 0],
            1,
            "NCHW",
            False,
            False,
        )


@pytest.mark.gpu
def test_reduce_overhead_captures_the_converted_convolutions_in_cuda_graphs():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device visible to torch")
    try:
        import cupy  # noqa: F401

        from ucudnn.backends.cudnn import CudnnBackend

        CudnnBackend()
    except (ImportError, ucudnn.BackendUnavailable) as exc:
        pytest.skip(f"the cudnn backend cannot run here: {exc}")
    torch.manual_seed(0)
    ours = convert(ResNet18(width_div=8).cuda(), backend="cudnn", reps=1, db=False)
    torch._dynamo.utils.counters.clear()
    compiled = torch.compile(ours, mode="reduce-overhead", fullgraph=True)
    # cudagraph trees run each new graph once as a warm-up (planning every kernel in the operators,
    # outside any capture, its workspaces taken and let go in their private pool), then record it and
    # replay it. The reference is the same layers eager (the autograd Function, the same planned
    # kernels), run after the compiled step each time. A graph Inductor would leave uncaptured raises,
    # saying why (cudagraph_or_error), instead of only counting a skip.
    with torch._inductor.config.patch({"triton.cudagraph_or_error": True}):
        for seed in range(5):
            x = _rand(4, 3, 64, 64, seed=seed).cuda()
            dy = _rand(4, 10, seed=seed + 1).cuda()
            ours.zero_grad()
            got = _step(compiled, x, dy)
            got = (got[0].clone(), got[1], got[2])  # the graph's output buffer is reused by the next replay
            ours.zero_grad()
            _assert_step_close(got, _step(ours, x, dy))
    from torch._dynamo.utils import counters
    from torch._inductor.cudagraph_trees import get_container

    assert counters["inductor"]["cudagraph_skips"] == 0  # Inductor kept every graph (forward and backward)
    manager = get_container(torch.cuda.current_device()).tree_manager
    assert manager is not None and sum(len(nodes) for nodes in manager.roots.values()) > 0, "nothing was recorded"
    assert _routed_kinds(ours) == {"fwd", "bwd_data", "bwd_filter"}
