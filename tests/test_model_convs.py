"""Models people train, with every convolution form, converted and trained against plain PyTorch: MONAI's 3-D
`BasicUNet` (Conv3d, ConvTranspose3d), MONAI's 2-D `UNet` (ConvTranspose2d), Hugging Face `Wav2Vec2` (a Conv1d
feature encoder and a grouped, weight-normed Conv1d positional embedding) and Hugging Face `EfficientNet`
(depthwise convolutions of an nn.Conv2d subclass), built from their configs.

Equality of training is judged against plain training's own rounding noise (`plain_training`)."""

from __future__ import annotations

import copy
import warnings

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
monai = pytest.importorskip("monai")
from monai.networks.nets import BasicUNet, UNet
from plain_training import assert_trains_alike, plain_runs, train
from torch import nn

from ucudnn.torch import convert
from ucudnn.torch.converting.layer import ConvLayer


def _basic_unet_3d():
    return BasicUNet(spatial_dims=3, in_channels=1, out_channels=2, features=(4, 4, 8, 16, 32, 4))


def _unet_2d():
    return UNet(spatial_dims=2, in_channels=1, out_channels=2, channels=(8, 16, 32), strides=(2, 2), num_res_units=1)


def _wav2vec2():
    config = transformers.Wav2Vec2Config(
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=64,
        conv_dim=(16, 16, 16),
        conv_kernel=(10, 3, 3),
        conv_stride=(5, 2, 2),
        num_conv_pos_embeddings=16,
        num_conv_pos_embedding_groups=4,
        mask_time_prob=0.0,
        layerdrop=0.0,
        num_labels=4,
    )
    return transformers.Wav2Vec2ForSequenceClassification(config)


def _efficientnet():
    config = transformers.EfficientNetConfig(
        image_size=32, width_coefficient=0.25, depth_coefficient=0.5, hidden_dim=320, num_labels=10
    )
    return transformers.EfficientNetForImageClassification(config)


# name -> (model, input shape, classes, labels per sample (else per voxel))
MODELS = {
    "monai-basic-unet-3d": (_basic_unet_3d, (2, 1, 32, 32, 32), 2, False),
    "monai-unet-transposed": (_unet_2d, (2, 1, 32, 32), 2, False),
    "hf-wav2vec2": (_wav2vec2, (2, 4000), 4, True),
    "hf-efficientnet": (_efficientnet, (2, 3, 32, 32), 10, True),
}

# handle options: WR and WD where the limit does not bind (what they pick depends on the machine's load), ucudnn's
# NumPy kernels forced in one-sample micro-batches (so that every converted kernel runs ucudnn's code rather than
# torch's), and the shifted GEMM forced (its sums round furthest from torch's: a load-slowed measurement let WR
# pick it once, and training equality must hold whichever algorithm is picked)
HANDLES = {
    "wr": {"workspace_limit": "64MiB"},
    "wd": {"total_workspace": "1GiB"},
    "numpy-micro": {"policy": (1,), "algos": ["im2col_gemm"], "call_overhead": 0},
    "shift-gemm": {"algos": ["shift_gemm"], "call_overhead": 0},
}


def _batch(name: str, step: int):
    _, shape, classes, per_sample = MODELS[name]
    g = torch.Generator().manual_seed(step)
    labels = (shape[0],) if per_sample else (shape[0], *shape[2:])
    return torch.randn(*shape, generator=g), torch.randint(0, classes, labels, generator=g)


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    return plain_runs(tmp_path_factory, lambda name: MODELS[name][0](), _batch)


@pytest.mark.parametrize("handle", list(HANDLES))
@pytest.mark.parametrize("name", list(MODELS))
def test_converted_and_trained_like_plain_pytorch(plain, name, handle):
    base, reference, noise, db = plain(name)
    model = copy.deepcopy(base)
    convs = [m for m in model.modules() if isinstance(m, nn.modules.conv._ConvNd)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing left to PyTorch
        convert(model, backend="cpu", reps=1, db=db, **HANDLES[handle])
    converted = [m for m in model.modules() if isinstance(m, nn.modules.conv._ConvNd)]
    assert len(converted) == len(convs) and all(isinstance(m, ConvLayer) for m in converted)
    assert_trains_alike(train(model, lambda step: _batch(name, step)), reference, noise)
    if handle == "numpy-micro":
        routed = {
            kind
            for m in converted
            for route in m._routes.values()
            for kind in ("fwd", "bwd_data", "bwd_filter")
            if getattr(route, kind) is not None
        }
        assert routed == {"fwd", "bwd_data", "bwd_filter"}
        assert all(c.config.describe().endswith("x1:im2col_gemm") for c in converted[0].handle.choices())
