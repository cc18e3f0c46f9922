"""Models nobody here wrote, as a user plans them: converted, planned at halfway between the smallest plan and the
roomy peak (and at a limit that forces recomputation), executed, trained and counted (PyTorch's MemTracker plus the
convolutions' workspaces: `plain_training.memtracker_peak`; `check_plan`'s StepTracker).

- HF Whisper reads a scalar lifted to a tensor (its labels shifted right), which dies at once: the capture took
  the next storage made at its address for that constant (no feature map: a raw IndexError in `vdnn.actions_for`
  where a convolution's input went missing); its encoder's positions require no gradient (MemTracker hooked them).
- MONAI's DynUNet holds each block under two names (its skip layers too): a capture on fake tensors swapped each
  name's parameter and put the first swap's fake one back under the second, so the next real step fed a
  FakeTensor to NumPy (".numpy() is not supported for tensor subclasses"). Whisper, converted, with its encoder's
  positions frozen, planned for an H100 to offload and recompute, runs on this CPU (its offloads host copies).
- HF SegFormer's convolutions take channels-last maps (a transposed view) and give back channels-last gradients:
  a converted layer's planned kernels copy them into their layout, memory the plan did not count (1.22x).

Tiny configurations, a few seconds each; the HF tests skip where transformers is missing.
"""

from __future__ import annotations

import copy
import importlib.util

import pytest

torch = pytest.importorskip("torch")
from plain_training import assert_trains_alike, memtracker_peak, train
from torch import nn

from ucudnn.errors import UnsupportedProblem
from ucudnn.memory.plan import MemoryPlan
from ucudnn.torch import capture, check_plan, convert, plan_memory
from ucudnn.torch.converting.layer import ConvLayer, PlanBudgets

needs_transformers = pytest.mark.skipif(
    importlib.util.find_spec("transformers") is None, reason="needs transformers (pip install '.[models]')"
)
TOLERANCE = (0.97, 1.03)


def _converted(model, tmp_path, algos, workspace_limit=8 * 2**20):
    """`convert` with no trials and one measurement per kernel: every plan and its run rest on the cached
    measurements, not on this machine's load (`algos`: the kernels' candidates)."""
    return convert(
        model,
        backend="cpu",
        workspace_limit=workspace_limit,
        policy="undivided",
        reps=1,
        trial_runs=0,
        algos=algos,
        db=f"sqlite:///{tmp_path}/cache.db",
    )


def _halfway(model, x, loss):
    everything = plan_memory(model, x, memory_limit=2**40, loss=loss)
    smallest = plan_memory(model, x, memory_limit=1, loss=loss)
    assert smallest.peak_bytes < everything.peak_bytes
    return plan_memory(model, x, memory_limit=(everything.peak_bytes + smallest.peak_bytes) // 2, loss=loss), smallest


# ---- the capture: a storage made where a dead constant was -------------------------------------------------------
class _Shifting(nn.Module):
    """Labels shifted right as HF's seq2seq models shift them: ``s[:, 0] = start`` lifts the scalar to a tensor
    outside the step's dispatch, read by ``fill_`` and dead after it; the comparison after it is a new storage."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(16, 8)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        out = 0
        for k in range(6):
            shifted = ids.new_zeros(ids.shape)
            shifted[:, 0] = k + 1
            shifted = shifted.masked_fill(shifted == 0, 2)
            out = out + self.embedding(shifted).sum()
        return out


@pytest.mark.parametrize("fake", [True, False], ids=["fake", "real"])
def test_a_storage_made_where_a_dead_constant_was_is_a_feature_map(fake):
    step = capture(_Shifting(), torch.randint(0, 16, (2, 5)), fake=fake)
    names = [op.name for op in step.graph.ops]
    for short in ("eq", "masked_fill", "embedding"):
        assert sum(name.split(":")[-1].split("#")[0] == short for name in names) == 6, (short, names)


# ---- HF Whisper ----------------------------------------------------------------------------------------------------
def _whisper():
    import transformers

    torch.manual_seed(0)
    config = transformers.WhisperConfig(
        d_model=64,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=2,
        decoder_attention_heads=2,
        encoder_ffn_dim=128,
        decoder_ffn_dim=128,
        num_mel_bins=80,
        max_source_positions=50,
        max_target_positions=16,
        vocab_size=128,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        decoder_start_token_id=1,
    )
    return transformers.WhisperForConditionalGeneration(config)


def _speech(step: int):
    """(the model's keyword arguments, its labels): 100 frames of 80 mel bins and 8 tokens, batch 2; the model
    shifts the labels right into its decoder's input and computes its loss."""
    g = torch.Generator().manual_seed(step)
    labels = torch.randint(3, 128, (2, 8), generator=g)
    return {"input_features": torch.randn(2, 80, 100, generator=g), "labels": labels}, labels


def _model_loss(out, _labels=None):
    return out.loss


@needs_transformers
def test_whisper_converted_and_planned_to_recompute_trains_like_plain_and_counts_what_it_predicts(tmp_path):
    base = _whisper()
    reference = train(copy.deepcopy(base), _speech, loss=_model_loss)
    noise = (reference - train(copy.deepcopy(base), _speech, threads=2, loss=_model_loss)).norm().item()
    model = _converted(copy.deepcopy(base), tmp_path, ["native"])
    x, y = _speech(0)
    # halfway between the smallest plan and every map kept (vdnn-dyn's smallest on this CPU, which cannot
    # offload): a plan must recompute
    smallest = plan_memory(model, x, memory_limit=1, loss=_model_loss)
    every_map = plan_memory(model, x, memory_limit=1, policy="vdnn-dyn", loss=_model_loss).peak_bytes
    assert smallest.peak_bytes < every_map
    plan = plan_memory(model, x, memory_limit=(smallest.peak_bytes + every_map) // 2, loss=_model_loss)
    assert plan.fits and any(t.action == "recompute" for t in plan.tensors)
    assert plan.conv_workspace
    ratio = memtracker_peak(model, plan, x, y, loss=_model_loss) / plan.peak_bytes
    assert TOLERANCE[0] <= ratio <= TOLERANCE[1], ratio
    assert_trains_alike(train(model, _speech, plan, loss=_model_loss), reference, noise)


def _acts(plan) -> set[str]:
    return {t.action for t in plan.tensors}


def _offloading_and_recomputing(model, x, loss):
    """A plan for an H100 (whose memory is not the host's, so that it may offload) at the first limit, from
    the smallest plan up to every map kept, where it both offloads and recomputes; on this CPU its offloads are
    copies in host memory. The converted layers run torch's own kernel (`_converted` with ``native``): one
    plain step first settles that, and the plan's kernel budgets (the H100's figures) then leave them to it."""
    smallest = plan_memory(model, x, memory_limit=1, loss=loss, device="h100")
    every_map = plan_memory(model, x, memory_limit=2**40, loss=loss, device="h100")
    for tenth in range(1, 10):
        limit = smallest.peak_bytes + tenth * (every_map.peak_bytes - smallest.peak_bytes) // 10
        plan = plan_memory(model, x, memory_limit=limit, loss=loss, device="h100")
        if {"offload", "recompute"} <= _acts(plan):
            return plan
    raise AssertionError("no limit makes a plan that both offloads and recomputes")


def _planned_offloading_trains_like_plain(base, batch, loss, tmp_path):
    """Converted, one plain step, planned to offload and recompute, executed (StepTracker's count against the
    prediction), then trained under the plan against plain PyTorch's parameters and their 1-vs-2-thread noise."""
    reference = train(copy.deepcopy(base), batch, loss=loss)
    noise = (reference - train(copy.deepcopy(base), batch, threads=2, loss=loss)).norm().item()
    model = _converted(copy.deepcopy(base), tmp_path, ["native"], workspace_limit=64 * 2**20)
    x, y = batch(0)
    loss(model(**x) if isinstance(x, dict) else model(x), y).backward()
    model.zero_grad(set_to_none=True)
    plan = _offloading_and_recomputing(model, x, lambda out: loss(out, y))
    assert plan.fits
    checked = check_plan(model, plan, x, loss=lambda out: loss(out, y), steps=1)
    assert checked.bytes_moved > 0  # the offloads ran
    assert TOLERANCE[0] <= checked.peak_ratio <= TOLERANCE[1], (checked.peak_bytes, plan.peak_bytes)
    assert_trains_alike(train(model, batch, plan, loss=loss), reference, noise)


@needs_transformers
def test_whisper_converted_planned_to_offload_and_recompute_runs_counts_and_trains_like_plain(tmp_path):
    """Its decoder's input given as well as its labels; its encoder's positions require no gradient (PyTorch's
    MemTracker refuses such a parameter a hook, ucudnn's StepTracker counts it as a weight)."""

    def batch(step: int):
        x, labels = _speech(step)
        return dict(x, decoder_input_ids=torch.roll(labels, 1, dims=1)), labels

    base = _whisper()
    assert any(not p.requires_grad for p in base.parameters())
    _planned_offloading_trains_like_plain(base, batch, _model_loss, tmp_path)


# ---- MONAI DynUNet in 3-D -------------------------------------------------------------------------------------
needs_monai = pytest.mark.skipif(
    importlib.util.find_spec("monai") is None, reason="needs monai (pip install '.[models]')"
)


def _dynunet():
    from monai.networks.nets import DynUNet

    torch.manual_seed(0)
    return DynUNet(
        spatial_dims=3,
        in_channels=1,
        out_channels=2,
        kernel_size=[3, 3, 3],
        strides=[1, 2, 2],
        upsample_kernel_size=[2, 2],
        filters=[4, 8, 16],
    )


def _volumes(step: int, meta: bool = False):
    """A batch of two 8^3 volumes and their voxels' labels; `meta`: as MONAI's transforms give them (MetaTensor)."""
    g = torch.Generator().manual_seed(step)
    x = torch.randn(2, 1, 8, 8, 8, generator=g)
    if meta:
        from monai.data import MetaTensor

        x = MetaTensor(x)
    return x, torch.randint(0, 2, (2, 8, 8, 8), generator=g)


def _voxel_loss(out, y):
    return nn.functional.cross_entropy(out, y)


@needs_monai
@pytest.mark.parametrize("meta", [False, True], ids=["tensor", "metatensor"])
def test_dynunet_3d_converted_planned_to_offload_and_recompute_runs_counts_and_trains_like_plain(tmp_path, meta):
    """DynUNet holds its blocks under two names each (its skip layers too): a capture on fake tensors that left
    the second name's fake parameter in the model fed it to the next real step (".numpy() is not supported for
    tensor subclasses" in a converted layer's backward). Its input as MONAI's transforms give it, a MetaTensor,
    is captured on the real step (on fake tensors it is a plain tensor, whose step makes other autograd nodes)."""
    _planned_offloading_trains_like_plain(_dynunet(), lambda step: _volumes(step, meta), _voxel_loss, tmp_path)


# ---- the classes of those failures, without transformers or monai ----------------------------------------------
class _TwoPaths(nn.Module):
    """A block under two names (as DynUNet's skip layers hold its blocks) and a weight two modules share."""

    def __init__(self) -> None:
        super().__init__()
        self.block = nn.Sequential(nn.Conv2d(2, 4, 3, padding=1), nn.BatchNorm2d(4))
        self.skip = nn.ModuleList([self.block])
        self.head = nn.Linear(4, 4)
        self.tail = nn.Linear(4, 4)
        self.tail.weight = self.head.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tail(self.head(self.skip[0](x).mean((2, 3)))).sum()


@pytest.mark.parametrize("converted", [False, True], ids=["plain", "converted"])
def test_a_fake_capture_leaves_every_parameter_and_buffer_in_place(tmp_path, converted):
    from torch._subclasses.fake_tensor import FakeTensor

    torch.manual_seed(0)
    model = _TwoPaths()
    if converted:
        model = _converted(model, tmp_path, ["im2col_gemm"])
    before = {name: t for name, t in (*model.named_parameters(), *model.named_buffers())}
    step = capture(model, torch.randn(2, 2, 6, 6), fake=True)
    assert step.fake
    after = {name: t for name, t in (*model.named_parameters(), *model.named_buffers())}
    assert after.keys() == before.keys()
    assert all(after[name] is t and not isinstance(t, FakeTensor) for name, t in before.items())
    assert model.tail.weight is model.head.weight
    model(torch.randn(2, 2, 6, 6)).backward()  # a real step after it


@needs_monai
def test_a_converted_layer_runs_a_metatensor_as_torch_does(tmp_path):
    from monai.data import MetaTensor

    torch.manual_seed(0)
    layer = _converted(nn.Conv2d(3, 4, 3, padding=1), tmp_path, ["im2col_gemm"])
    reference = nn.Conv2d(3, 4, 3, padding=1)
    reference.load_state_dict(layer.state_dict())
    x = torch.randn(2, 3, 6, 6)
    meta, plain = MetaTensor(x.clone()).requires_grad_(), x.clone().requires_grad_()
    out, expected = layer(meta), reference(plain)
    assert layer._routes and all(r.fwd is not None for r in layer._routes.values())  # through the handle's kernels
    dy = torch.randn_like(expected)
    out.backward(dy)
    expected.backward(dy)
    assert torch.allclose(out, expected, atol=1e-5)
    assert torch.allclose(meta.grad, plain.grad, atol=1e-5)
    assert torch.allclose(layer.weight.grad, reference.weight.grad, atol=1e-4)


def test_a_tensor_without_data_at_a_converted_kernel_is_refused_in_one_line(tmp_path):
    """A parameter a capture on fake tensors left fake (as DynUNet's second names did) reached NumPy raw."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    torch.manual_seed(0)
    layer = _converted(nn.Conv2d(3, 4, 3, padding=1), tmp_path, ["im2col_gemm"])
    layer(torch.randn(2, 3, 6, 6))  # routed through the handle's kernels
    assert all(r.fwd is not None for r in layer._routes.values())
    layer.weight = nn.Parameter(FakeTensorMode().from_tensor(layer.weight.detach()))
    with pytest.raises(UnsupportedProblem, match="fake tensor") as info:
        layer(torch.randn(2, 3, 6, 6))
    assert "\n" not in str(info.value)


# ---- HF SegFormer --------------------------------------------------------------------------------------------------
def _segformer():
    import transformers

    torch.manual_seed(0)
    config = transformers.SegformerConfig(
        num_encoder_blocks=2,
        depths=[1, 1],
        sr_ratios=[8, 4],
        hidden_sizes=[16, 32],
        num_attention_heads=[1, 2],
        patch_sizes=[7, 3],
        strides=[4, 2],
        mlp_ratios=[4, 4],
        decoder_hidden_size=32,
        num_labels=5,
    )
    return transformers.SegformerForSemanticSegmentation(config)


@needs_transformers
def test_segformer_converted_counts_what_its_plans_predict(tmp_path):
    """Its depthwise and sequence-reduction convolutions take channels-last maps and every one of its convolutions
    gets a channels-last gradient: NumPy's im2col kernels (one algorithm, so that nothing rests on timings) copy
    them into NCHW, and the plans hold those copies (`Op.layout_copies`)."""
    model = _converted(_segformer(), tmp_path, ["im2col_gemm"])
    g = torch.Generator().manual_seed(1)
    x = {
        "pixel_values": torch.randn(2, 3, 64, 64, generator=g),
        "labels": torch.randint(0, 5, (2, 64, 64), generator=g),
    }
    halfway, smallest = _halfway(model, x, _model_loss)
    convs = {op.module: op for op in halfway.capture.graph.conv_ops}
    assert any(
        kind == "fwd" and copied
        for kind, copied, _ in convs["segformer.stages.0.blocks.0.mlp.dwconv.dwconv"].layout_copies
    )
    assert all(any(kind == "bwd_filter" and copied for kind, copied, _ in op.layout_copies) for op in convs.values())
    for plan in (halfway, smallest):
        ratio = memtracker_peak(model, plan, x, None, loss=_model_loss) / plan.peak_bytes
        assert TOLERANCE[0] <= ratio <= TOLERANCE[1], (plan.memory_limit, ratio)
        assert TOLERANCE[0] <= check_plan(model, plan, x, loss=_model_loss, steps=1).peak_ratio <= TOLERANCE[1]


# ---- the pieces, without transformers ------------------------------------------------------------------------------
class _TokensToMap(nn.Module):
    """Tokens mixed by a Linear, then a depthwise convolution of them as a map: a transposed view, channels-last
    strides (as SegFormer's MixFFN), and a gradient that comes back channels-last."""

    def __init__(self) -> None:
        super().__init__()
        self.mix = nn.Linear(8, 32)
        self.dw = nn.Conv2d(32, 32, 3, padding=1, groups=32)
        self.head = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (n, 64 tokens, 8)
        h = self.mix(x).transpose(1, 2).view(x.shape[0], 32, 8, 8)
        return self.head(torch.relu(self.dw(h)).flatten(2).transpose(1, 2)).mean(1)


def test_a_converted_conv_on_a_channels_last_map_plans_the_copies_its_kernels_make(tmp_path):
    torch.manual_seed(0)
    model = _converted(_TokensToMap(), tmp_path, ["im2col_gemm"])
    x, y = torch.randn(4, 64, 8), torch.randint(0, 4, (4,))

    def loss(out):
        return nn.functional.cross_entropy(out, y)

    plan = plan_memory(model, x, memory_limit=2**40, loss=loss)
    (op,) = plan.capture.graph.conv_ops
    copies = {kind: (copied, converted) for kind, copied, converted in op.layout_copies}
    map_bytes = 4 * 32 * 8 * 8 * 4
    # in: x (and dy) copied into NCHW; out: the result made channels-last again (dx where one operation gives both)
    assert copies == {
        "fwd": (map_bytes, map_bytes),
        "bwd_data": (map_bytes, map_bytes),
        "bwd_filter": (2 * map_bytes, 0),
    }
    assert check_plan(model, plan, x, loss=loss, steps=1).peak_ratio == pytest.approx(1.0, abs=1e-9)
    reference = _TokensToMap()
    reference.load_state_dict(model.state_dict())
    with torch.no_grad():
        assert torch.allclose(model(x), reference(x), atol=1e-6)


def test_a_kernel_whose_option_is_torchs_own_runs_torchs_own_within_its_budget(tmp_path):
    """The plan's option for a kernel is torch's own convolution (which holds nothing the plan counts) with a
    budget of its measured workspace: the layer runs torch's kernel there, not another configuration of its
    handle's that the budget would hold."""
    from ucudnn.memory.plan import ConvWorkspace
    from ucudnn.memory.planner import _torch_own_marked
    from ucudnn.memory.timing import KernelOption

    fronts = {
        ("c", "fwd"): (
            KernelOption(2.0, 100, "1x4:im2col_gemm", held=None),
            KernelOption(1.0, 1000, "1x4:native", held=0),
        ),
        ("c", "bwd_data"): (KernelOption(1.0, 100, "1x4:im2col_gemm", held=None),),
    }
    plan = MemoryPlan(
        "net",
        4,
        "host",
        1,
        2**30,
        "optimal",
        True,
        0,
        0,
        0,
        1.0,
        1.0,
        0.0,
        0,
        (),
        (ConvWorkspace("c", "fwd", 1000), ConvWorkspace("c", "bwd_data", 100)),
    )
    marked = _torch_own_marked(plan, fronts)
    assert [c.torch_own for c in marked.conv_workspace] == [True, False]
    assert MemoryPlan.from_json(marked.to_json()).conv_workspace == marked.conv_workspace

    torch.manual_seed(0)
    layer = _converted(nn.Conv2d(4, 4, 3, padding=1), tmp_path, ["im2col_gemm", "native"])
    assert isinstance(layer, ConvLayer)
    x = torch.randn(2, 4, 8, 8, requires_grad=True)
    layer._budgets = PlanBudgets(
        {"fwd": 2**30, "bwd_data": 2**30, "bwd_filter": 2**30}, frozenset({"fwd", "bwd_data", "bwd_filter"})
    )
    try:
        layer(x).sum().backward()
    finally:
        layer._budgets = None
    (route,) = [r for r in layer._routes.values() if r.budgets is not None]
    assert route.direct and route.fwd is None and route.bwd_data is None and route.bwd_filter is None
