"""Models nobody here wrote (Hugging Face transformers, MONAI), built from their configs: captured, planned,
executed and trained under `checkpoint` and `optimal`, converted and not, against plain training and against
PyTorch's own memory tracker (`torch.distributed._tools.mem_tracker.MemTracker`).

Equality of training is judged as the model's own rounding noise allows: the norm of all parameters'
difference from plain training, against the difference plain training itself shows between one thread
and two (batch-norm over small maps amplifies rounding; a single tensor's difference says nothing: a bias
before a normalisation has a gradient that is zero in exact arithmetic and holds only noise)."""

from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
monai = pytest.importorskip("monai")
from monai.networks.nets import UNet  # noqa: E402
from torch.distributed._tools.mem_tracker import MemTracker  # noqa: E402
from torch.nn import functional as F  # noqa: E402

from ucudnn.torch import convert, execute_plan, plan_memory  # noqa: E402

STEPS = 2


def _hf_resnet():
    config = transformers.ResNetConfig(depths=[1, 1, 1, 1], hidden_sizes=[32, 64, 128, 256], embedding_size=16,
                                       layer_type="bottleneck", num_labels=10)
    return transformers.ResNetForImageClassification(config)


def _hf_mobilenet_v2():
    config = transformers.MobileNetV2Config(num_labels=10, depth_multiplier=0.35, image_size=32,
                                            classifier_dropout_prob=0.2)
    return transformers.MobileNetV2ForImageClassification(config)


def _monai_unet():  # instance norm, PReLU, transposed convolutions, residual units
    return UNet(spatial_dims=2, in_channels=1, out_channels=2, channels=(8, 16, 32), strides=(2, 2),
                num_res_units=2)


# name -> (model, input shape, classifies: labels per sample, else per pixel)
MODELS = {"hf-resnet": (_hf_resnet, (4, 3, 32, 32), True),
          "hf-mobilenet-v2": (_hf_mobilenet_v2, (4, 3, 32, 32), True),
          "monai-unet": (_monai_unet, (2, 1, 32, 32), False)}


def _batch(name: str, step: int):
    _, shape, classifies = MODELS[name]
    g = torch.Generator().manual_seed(step)
    x = torch.randn(*shape, generator=g)
    y = torch.randint(0, 10 if classifies else 2, (shape[0],) if classifies else (shape[0], *shape[2:]), generator=g)
    return x, y


def _loss(out, y):
    return F.cross_entropy(out.logits if hasattr(out, "logits") else out, y)


def _train(model, name: str, plan=None, threads: int = 1) -> torch.Tensor:
    """Every parameter, flattened, after `STEPS` SGD steps (dropout drawing the same masks every run)."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        torch.manual_seed(1)
        for step in range(STEPS):
            x, y = _batch(name, step)
            opt.zero_grad()
            with execute_plan(model, plan) if plan is not None else torch.enable_grad():
                _loss(model(x), y).backward()
            opt.step()
    finally:
        torch.set_num_threads(before)
    return torch.cat([p.detach().flatten() for p in model.parameters()])


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    """Per model, made once: the model, plain training's parameters, their rounding noise (one thread
    against two), and a measurement cache its converted copies share."""
    made = {}

    def get(name):
        if name not in made:
            torch.manual_seed(0)
            model = MODELS[name][0]()
            reference = _train(copy.deepcopy(model), name)
            noise = (reference - _train(copy.deepcopy(model), name, threads=2)).norm().item()
            made[name] = (model, reference, noise, f"sqlite:///{tmp_path_factory.mktemp(name)}/cache.db")
        return made[name]

    return get


def _memtracker_peak(model, plan, x, y) -> int:
    """PyTorch's MemTracker's count of one step under `plan` (after a warm-up step), gradients freed before."""
    for _ in range(2):
        for p in model.parameters():
            p.grad = None
        tracker = MemTracker()
        tracker.track_external(model, x)
        with tracker:
            with execute_plan(model, plan):
                _loss(model(x), y).backward()
    return tracker.get_tracker_snapshot("peak")[x.device]["Total"]


@pytest.mark.parametrize("converted", [False, True], ids=["plain", "converted"])
@pytest.mark.parametrize("policy", ["checkpoint", "optimal"])
@pytest.mark.parametrize("name", list(MODELS))
def test_planned_executed_and_trained_like_plain_pytorch_and_as_memtracker_counts(plain, name, policy, converted):
    base, reference, noise, db = plain(name)
    model = copy.deepcopy(base)
    if converted:
        model = convert(model, backend="cpu", workspace_limit=8 * 2**20, policy="undivided", reps=1, db=db)
    x, y = _batch(name, 0)

    def loss(out):
        return _loss(out, y)

    everything = plan_memory(model, x, memory_limit=2**40, policy=policy, loss=loss)
    smallest = plan_memory(model, x, memory_limit=1, policy=policy, loss=loss)
    assert smallest.peak_bytes < everything.peak_bytes
    plan = plan_memory(model, x, memory_limit=(everything.peak_bytes + smallest.peak_bytes) // 2, policy=policy,
                       loss=loss)
    assert plan.fits and any(t.action == "recompute" for t in plan.tensors)
    if converted:
        assert plan.conv_workspace
    # PyTorch's own count of a real step, at the halfway limit and at the smallest peak
    for checked in (plan, smallest):
        ratio = _memtracker_peak(model, checked, x, y) / checked.peak_bytes
        assert 0.9 <= ratio <= 1.1, (checked.memory_limit, ratio)
    trained = _train(model, name, plan)
    assert (trained - reference).norm().item() <= 2 * noise + 1e-6 * reference.norm().item(), noise
