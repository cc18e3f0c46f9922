"""Every convolution module PyTorch has, converted: Conv1d, Conv2d, Conv3d and the transposed three, run through
ucudnn's own kernels in micro-batches of one sample, against the float64 reference (`ucudnn.reference`) and
torch's own module on fresh random data; what `convert` swaps (subclasses whose forward is torch's own,
parametrized weights) and what it leaves to PyTorch, with one warning; copies, pickles, torch.compile and a
captured step."""

from __future__ import annotations

import copy
import io
import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")
from torch import nn
from torch.nn.utils import parametrize
from torch.nn.utils.parametrizations import weight_norm

from ucudnn.problem import ConvProblem
from ucudnn.reference import reference, relative_error
from ucudnn.torch import (
    Conv1d,
    Conv2d,
    Conv3d,
    ConvTranspose1d,
    ConvTranspose2d,
    ConvTranspose3d,
    capture,
    convert,
    execute_plan,
    plan_memory,
)
from ucudnn.torch.converting.layer import ConvLayer

# ucudnn's NumPy kernels only, each kernel in micro-batches of one sample: nothing falls back to torch
MICRO = {"backend": "cpu", "policy": (1,), "algos": ["im2col_gemm"], "reps": 1, "db": False, "call_overhead": 0}

# (torch module, input shape): grouped, strided, dilated, padded and output-padded forms of each kind
FORMS = {
    "conv1d": (lambda: nn.Conv1d(4, 6, 3, stride=2, padding=1, dilation=2, groups=2), (3, 4, 13)),
    "conv2d": (lambda: nn.Conv2d(4, 6, (3, 2), stride=(1, 2), padding=(1, 0), dilation=(2, 1), groups=2), (3, 4, 9, 8)),
    "conv3d": (lambda: nn.Conv3d(3, 4, (3, 2, 3), stride=(1, 2, 1), padding=(1, 0, 1)), (3, 3, 5, 6, 7)),
    "conv-transpose1d": (
        lambda: nn.ConvTranspose1d(4, 6, 4, stride=3, padding=1, output_padding=2, groups=2),
        (3, 4, 7),
    ),
    "conv-transpose2d": (
        lambda: nn.ConvTranspose2d(4, 3, 3, stride=(2, 1), padding=1, output_padding=(1, 0), dilation=(1, 2)),
        (3, 4, 5, 6),
    ),
    "conv-transpose3d": (lambda: nn.ConvTranspose3d(3, 4, 3, stride=2, padding=1, output_padding=1), (3, 3, 3, 4, 3)),
}


def _problem(conv: nn.Module, x: torch.Tensor, kind: str) -> ConvProblem:
    return ConvProblem.from_shapes(
        x.shape,
        conv.weight.shape,
        stride=conv.stride,
        padding=conv.padding,
        dilation=conv.dilation,
        groups=conv.groups,
        transposed=conv.transposed,
        output_padding=conv.output_padding,
        kind=kind,
        dtype="float64",
    )


def _reference_step(conv: nn.Module, x: torch.Tensor, dy: torch.Tensor) -> dict[str, np.ndarray]:
    """y, dx, dw and db of `conv` in float64 by direct summation (a 1-D form as 2-D of height 1)."""
    fwd = _problem(conv, x, "fwd")
    xs, ws, dys = (
        t.detach().numpy().reshape(shape)
        for t, shape in ((x, fwd.x_shape), (conv.weight, fwd.w_shape), (dy, fwd.y_shape))
    )
    bias = conv.bias.detach().numpy().reshape(1, -1, *[1] * (dy.dim() - 2))
    return {
        "y": reference(fwd, x=xs, w=ws).reshape(dy.shape) + bias,
        "dx": reference(fwd.with_kind("bwd_data"), w=ws, dy=dys).reshape(x.shape),
        "dw": reference(fwd.with_kind("bwd_filter"), x=xs, dy=dys).reshape(conv.weight.shape),
        "db": dys.sum(axis=tuple(i for i in range(dys.ndim) if i != 1)),
    }


def _step(conv: nn.Module, x: torch.Tensor, dy: torch.Tensor) -> dict[str, np.ndarray]:
    conv.zero_grad()
    x = x.detach().requires_grad_()
    y = conv(x)
    y.backward(dy)
    return {"y": y.detach().numpy(), "dx": x.grad.numpy(), "dw": conv.weight.grad.numpy(), "db": conv.bias.grad.numpy()}


def _routed_kinds(model: nn.Module) -> set[str]:
    return {
        kind
        for m in model.modules()
        if isinstance(m, ConvLayer)
        for route in m._routes.values()
        for kind in ("fwd", "bwd_data", "bwd_filter")
        if getattr(route, kind) is not None
    }


@pytest.mark.parametrize("dtype, tolerance", [(torch.float64, 1e-12), (torch.float32, 2e-5)])
@pytest.mark.parametrize("form", list(FORMS))
def test_each_form_micro_batched_equals_the_float64_reference_and_torch(form, dtype, tolerance):
    make, shape = FORMS[form]
    torch.manual_seed(0)
    plain = make().to(dtype)
    ours = convert(copy.deepcopy(plain), **MICRO)
    assert isinstance(ours, ConvLayer) and ours.transposed == plain.transposed
    for seed in (1, 2):  # fresh data each time: a second call runs the prepared route
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(shape, generator=g, dtype=dtype)
        dy = torch.randn(plain(x).shape, generator=g, dtype=dtype)
        got, torch_own = _step(ours, x, dy), _step(plain, x, dy)
        expected = _reference_step(plain, x.double(), dy.double())
        for name in ("y", "dx", "dw", "db"):
            assert relative_error(got[name].astype(np.float64), expected[name]) <= tolerance, (name, seed)
            assert relative_error(got[name].astype(np.float64), torch_own[name].astype(np.float64)) <= tolerance
    assert _routed_kinds(ours) == {"fwd", "bwd_data", "bwd_filter"}  # ucudnn's kernels ran every kind
    assert {c.config.describe() for c in ours.handle.choices()} == {f"{shape[0]}x1:im2col_gemm"}


def test_unbatched_inputs_and_a_transposed_output_size_are_taken_as_torch_takes_them():
    torch.manual_seed(0)
    for plain, x in (
        (nn.Conv1d(2, 3, 3), torch.randn(2, 9)),
        (nn.Conv3d(2, 3, 2), torch.randn(2, 4, 4, 4)),
        (nn.ConvTranspose2d(2, 3, 3, stride=2), torch.randn(2, 5, 5)),
    ):
        ours = convert(copy.deepcopy(plain), **MICRO)
        torch.testing.assert_close(ours(x), plain(x), rtol=1e-5, atol=1e-6)
    plain = nn.ConvTranspose2d(2, 3, 3, stride=2)
    ours = convert(copy.deepcopy(plain), **MICRO)
    x = torch.randn(1, 2, 5, 5)
    for size in ((11, 11), (12, 11), [1, 3, 12, 12]):
        torch.testing.assert_close(ours(x, output_size=size), plain(x, output_size=size), rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="zeros"):
        ConvTranspose2d(2, 3, 3, padding_mode="reflect", handle=ours.handle)(x)


def test_padding_modes_and_same_padding_in_1d_and_3d():
    torch.manual_seed(0)
    for plain, shape in (
        (nn.Conv1d(2, 3, 4, padding="same", padding_mode="circular"), (2, 2, 9)),
        (nn.Conv3d(2, 3, (2, 3, 3), padding="same"), (2, 2, 5, 5, 5)),
        (nn.Conv3d(2, 3, 3, padding=1, padding_mode="replicate"), (2, 2, 4, 5, 6)),
    ):
        ours = convert(copy.deepcopy(plain), **MICRO)
        x = torch.randn(shape)
        torch.testing.assert_close(ours(x), plain(x), rtol=1e-5, atol=1e-6)


def test_an_output_padding_the_kernels_cannot_express_runs_as_torch_with_one_warning():
    # torch allows an output padding below the stride or the dilation; ucudnn's lowering needs it below the stride
    plain = nn.ConvTranspose2d(2, 3, 3, stride=1, dilation=3, output_padding=2)
    ours = convert(copy.deepcopy(plain), **MICRO)
    x = torch.randn(2, 2, 5, 5, requires_grad=True)
    with pytest.warns(UserWarning, match=r"output_padding \(2, 2\) not below its stride \(1, 1\)"):
        y = ours(x)
    torch.testing.assert_close(y, plain(x))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ours(x).sum().backward()  # once
    assert not _routed_kinds(ours) and not ours.handle.choices()


class Depthwise(nn.Conv2d):
    """A library's subclass that only adds an `__init__` (HF EfficientNet's depthwise convolution is one)."""

    def __init__(self, channels: int) -> None:
        super().__init__(channels, channels, 3, padding=1, groups=channels, bias=False)


class Doubled(nn.Conv2d):
    def forward(self, input):
        return super().forward(input) * 2


class OwnConvForward(nn.Conv1d):
    def _conv_forward(self, input, weight, bias):
        return super()._conv_forward(input, weight.flip(-1), bias)


def test_convert_swaps_every_kind_keeps_parametrizations_and_names_what_it_leaves_in_one_warning():
    torch.manual_seed(0)
    model = nn.ModuleDict(
        {
            "a": nn.Conv1d(2, 4, 3),
            "b": nn.Conv2d(2, 4, 3),
            "c": nn.Conv3d(2, 4, 3),
            "d": nn.ConvTranspose1d(2, 4, 3),
            "e": nn.ConvTranspose2d(2, 4, 3),
            "f": nn.ConvTranspose3d(2, 4, 3),
            "depthwise": Depthwise(4),
            "normed": weight_norm(nn.Conv1d(4, 4, 5, padding=2, groups=2), dim=2),
            "doubled": Doubled(2, 4, 3),
            "own": OwnConvForward(2, 2, 3),
            "lazy": nn.LazyConv2d(4, 3),
        }
    )
    params = {name: list(m.parameters()) for name, m in model.items()}
    with pytest.warns(UserWarning) as caught:
        convert(model, **MICRO)
    (warning,) = caught
    assert str(warning.message) == (
        "ucudnn.torch.convert left 3 convolution(s) to PyTorch: doubled (Doubled: overrides forward); own "
        "(OwnConvForward: overrides _conv_forward); lazy (LazyConv2d: a lazy module, not yet initialised (convert "
        "after its first forward pass))"
    )
    kinds = {
        "a": Conv1d,
        "b": Conv2d,
        "c": Conv3d,
        "d": ConvTranspose1d,
        "e": ConvTranspose2d,
        "f": ConvTranspose3d,
        "depthwise": Conv2d,
        "normed": Conv1d,
    }
    for name, cls in kinds.items():
        assert isinstance(model[name], cls) and model[name].layer == name, name
        assert list(model[name].parameters()) == params[name]  # the same Parameter objects
    assert isinstance(model["depthwise"], Depthwise) and model["depthwise"].groups == 4
    assert parametrize.is_parametrized(model["normed"], "weight")
    for name in ("doubled", "own", "lazy"):
        assert not isinstance(model[name], ConvLayer)


def test_a_parametrized_weight_trains_through_its_parametrization():
    torch.manual_seed(0)
    plain = weight_norm(nn.Conv1d(4, 6, 5, padding=2, groups=2), dim=2)
    ours = convert(copy.deepcopy(plain), **MICRO)
    x, dy = torch.randn(3, 4, 20, requires_grad=True), torch.randn(3, 6, 20)
    for m in (plain, ours):
        m(x).backward(dy)
    for (name, p), q in zip(plain.named_parameters(), ours.parameters()):
        assert q.grad is not None, name  # original0 (g) and original1 (v): the gradient reached both
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-5, atol=1e-6)
    assert _routed_kinds(ours) == {"fwd", "bwd_data", "bwd_filter"}


def test_a_swapped_subclass_copies_and_pickles_as_itself():
    model = convert(nn.Sequential(Depthwise(3), nn.ReLU()), **MICRO)
    x = torch.randn(2, 3, 6, 6)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    for other in (copy.deepcopy(model), torch.load(buffer, weights_only=False)):
        assert type(other[0]) is type(model[0]) and isinstance(other[0], Depthwise)
        assert other[0]._key != model[0]._key  # another layer to the operators
        torch.testing.assert_close(other(x), model(x))


def test_compiled_forms_trace_to_ucudnn_operators_without_a_break_and_equal_eager():
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Conv3d(2, 4, 3, padding=1), nn.ReLU(), nn.ConvTranspose3d(4, 2, 2, stride=2))
    ours = convert(copy.deepcopy(plain), **MICRO)
    x = torch.randn(2, 2, 4, 4, 4)
    explanation = torch._dynamo.explain(ours)(x)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    (graph,) = explanation.graphs
    assert sum(n.target is torch.ops.ucudnn.convolution.default for n in graph.graph.nodes) == 2
    compiled = torch.compile(ours, backend="aot_eager", fullgraph=True)
    for seed in (1, 2):
        ours.zero_grad(), plain.zero_grad()
        x = torch.randn(2, 2, 4, 4, 4, generator=torch.Generator().manual_seed(seed), requires_grad=True)
        y = compiled(x)
        y.sum().backward()  # each layer's dx and dw by one operator
        ref = x.detach().requires_grad_()
        plain(ref).sum().backward()
        torch.testing.assert_close(y, plain(x), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(x.grad, ref.grad, rtol=1e-5, atol=1e-5)
        for a, b in zip(ours.parameters(), plain.parameters()):
            torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-5)
    assert _routed_kinds(ours) == {"fwd", "bwd_data", "bwd_filter"}


@pytest.mark.parametrize("converted", [False, True], ids=["plain", "converted"])
def test_a_captured_step_plans_every_form_as_a_convolution(converted):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv1d(2, 4, 3, padding=1), nn.ReLU(), nn.ConvTranspose1d(4, 2, 2, stride=2))
    if converted:
        model = convert(model, **MICRO)
    step = capture(model, torch.randn(2, 2, 8))
    problems = [op.conv for op in step.graph.conv_ops]
    assert [(p.h, p.w, p.transposed) for p in problems] == [(1, 8, False), (1, 8, True)]
    assert [op.module for op in step.graph.conv_ops] == ["0", "2"]


class _ChannelsLastNorm(nn.Module):
    """ConvNeXt's pattern: a layer norm over channels through permutes, so the next conv reads a tensor that is
    not contiguous (its converted layer copies it first, captured and timed alike)."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(channels)

    def forward(self, x):
        return self.norm(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)


def test_a_converted_conv_reading_a_permuted_tensor_plans_and_trains_like_torch():
    torch.manual_seed(0)
    plain = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        _ChannelsLastNorm(8),
        nn.Conv2d(8, 8, 3, padding=1, groups=8),
        nn.ReLU(),
        nn.Conv2d(8, 4, 1),
    )
    model = convert(copy.deepcopy(plain), **MICRO)
    x = torch.randn(2, 3, 12, 12)
    everything = plan_memory(model, x, memory_limit=2**40, policy="checkpoint")
    smallest = plan_memory(model, x, memory_limit=1, policy="checkpoint")
    assert smallest.peak_bytes < everything.peak_bytes
    assert any(t.action == "recompute" for t in smallest.tensors)
    for net, plan in ((plain, None), (model, smallest)):
        with execute_plan(net, plan) if plan is not None else torch.enable_grad():
            net(x).square().sum().backward()
    for ours, theirs in zip(model.parameters(), plain.parameters()):
        torch.testing.assert_close(ours.grad, theirs.grad, rtol=1e-4, atol=1e-5)
