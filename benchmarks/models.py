"""Models nobody here wrote, built from their configs (no weights), for the benchmarks: `build(name, batch, size)`
gives (model, input, target); `loss(output, target)`: cross-entropy against labels, mean squared error against a
floating target. Hugging Face transformers and MONAI come with the `models` extra, diffusers with `bench`.

    hf-resnet50          transformers' ResNet-50 (Conv2d)
    hf-mobilenet-v2      transformers' MobileNetV2 (depthwise Conv2d)
    hf-convnext          transformers' ConvNeXt-T at depths 1,1,2,1 (depthwise 7x7 Conv2d, LayerNorm)
    hf-regnet            transformers' RegNet-Y at depths 1,1,2,1 (grouped Conv2d, squeeze-excitation)
    hf-efficientnet      transformers' EfficientNet-B0 at width 0.5 and depth 0.5 (an nn.Conv2d subclass)
    hf-wav2vec2          transformers' Wav2Vec2 base-shaped encoder of 2 layers (a Conv1d feature encoder, a
                         grouped weight-normed Conv1d positional embedding); input: `size` x 160 audio samples
    hf-segformer         transformers' SegFormer of 4 stages at widths 16-128, one block each (overlapping patch
                         Conv2d, depthwise Conv2d on a transposed view: channels-last maps), its logits upsampled
                         to the input's size
    diffusers-unet       diffusers' UNet2DModel at widths 32-64 (attention, GroupNorm; denoising at timestep 10)
    diffusers-vae        diffusers' AutoencoderKL at widths 32-64 (reconstruction of its input)
    monai-unet           MONAI's 2-D UNet (Conv2d, ConvTranspose2d)
    monai-basic-unet-3d  MONAI's 3-D BasicUNet (Conv3d, ConvTranspose3d); input: size^3 voxels
"""

from __future__ import annotations

import torch
from torch import nn

NAMES = (
    "hf-resnet50",
    "hf-mobilenet-v2",
    "hf-convnext",
    "hf-regnet",
    "hf-efficientnet",
    "hf-wav2vec2",
    "hf-segformer",
    "diffusers-unet",
    "diffusers-vae",
    "monai-unet",
    "monai-basic-unet-3d",
    "monai-unet-3d",
)


class _Denoiser(nn.Module):
    """diffusers' UNet2DModel as a training step calls it: the noisy sample at one timestep, its `sample` out."""

    def __init__(self, unet: nn.Module) -> None:
        super().__init__()
        self.unet = unet

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.unet(x, 10).sample


class _Reconstruction(nn.Module):
    """diffusers' AutoencoderKL reconstructing its input (its `sample` output)."""

    def __init__(self, vae: nn.Module) -> None:
        super().__init__()
        self.vae = vae

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.vae(x).sample


class _Segmentation(nn.Module):
    """A semantic segmentation model's logits at its input's size (bilinear), as its own loss compares them."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.model(pixel_values=x).logits
        return nn.functional.interpolate(logits, size=x.shape[-2:], mode="bilinear", align_corners=False)


def _model(name: str, size: int) -> tuple[nn.Module, tuple[int, ...], int, bool]:
    """(model, one sample's input shape, classes (0: a target like the input), labels per sample (else per
    pixel))."""
    if name.startswith("diffusers-"):
        import diffusers

        widths = {"block_out_channels": (32, 64), "norm_num_groups": 8}
        if name == "diffusers-unet":
            unet = diffusers.UNet2DModel(
                sample_size=size,
                down_block_types=("DownBlock2D", "AttnDownBlock2D"),
                up_block_types=("AttnUpBlock2D", "UpBlock2D"),
                layers_per_block=1,
                **widths,
            )
            return _Denoiser(unet), (3, size, size), 0, False
        vae = diffusers.AutoencoderKL(
            down_block_types=("DownEncoderBlock2D",) * 2,
            up_block_types=("UpDecoderBlock2D",) * 2,
            sample_size=size,
            **widths,
        )
        return _Reconstruction(vae), (3, size, size), 0, False
    import transformers
    from monai.networks.nets import BasicUNet, UNet

    if name == "hf-convnext":
        config = transformers.ConvNextConfig(depths=[1, 1, 2, 1], num_labels=10)
        return transformers.ConvNextForImageClassification(config), (3, size, size), 10, True
    if name == "hf-regnet":
        config = transformers.RegNetConfig(depths=[1, 1, 2, 1], num_labels=10)
        return transformers.RegNetForImageClassification(config), (3, size, size), 10, True

    if name == "hf-resnet50":
        return (
            transformers.ResNetForImageClassification(transformers.ResNetConfig(num_labels=10)),
            (3, size, size),
            10,
            True,
        )
    if name == "hf-mobilenet-v2":
        config = transformers.MobileNetV2Config(num_labels=10, image_size=size)
        return transformers.MobileNetV2ForImageClassification(config), (3, size, size), 10, True
    if name == "hf-efficientnet":
        config = transformers.EfficientNetConfig(
            image_size=size, width_coefficient=0.5, depth_coefficient=0.5, hidden_dim=640, num_labels=10
        )
        return transformers.EfficientNetForImageClassification(config), (3, size, size), 10, True
    if name == "hf-segformer":
        config = transformers.SegformerConfig(
            num_encoder_blocks=4,
            depths=[1, 1, 1, 1],
            hidden_sizes=[16, 32, 64, 128],
            num_attention_heads=[1, 2, 4, 8],
            decoder_hidden_size=64,
            num_labels=10,
        )
        return _Segmentation(transformers.SegformerForSemanticSegmentation(config)), (3, size, size), 10, False
    if name == "hf-wav2vec2":
        config = transformers.Wav2Vec2Config(num_hidden_layers=2, mask_time_prob=0.0, layerdrop=0.0, num_labels=10)
        return transformers.Wav2Vec2ForSequenceClassification(config), (size * 160,), 10, True
    if name == "monai-unet":
        model = UNet(
            spatial_dims=2,
            in_channels=1,
            out_channels=2,
            channels=(16, 32, 64, 128),
            strides=(2, 2, 2),
            num_res_units=2,
        )
        return model, (1, size, size), 2, False
    if name == "monai-unet-3d":  # the 2-D UNet's layers in three dimensions (BasicUNet breaks Dynamo's graph)
        model = UNet(
            spatial_dims=3, in_channels=1, out_channels=2, channels=(8, 16, 32, 64), strides=(2, 2, 2), num_res_units=2
        )
        return model, (1, size, size, size), 2, False
    if name == "monai-basic-unet-3d":
        return BasicUNet(spatial_dims=3, in_channels=1, out_channels=2), (1, size, size, size), 2, False
    raise SystemExit(f"unknown model {name!r}: {', '.join(NAMES)}")


def build(name: str, batch: int, size: int) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    """(model, its input, its target), the same for the same arguments (seeded)."""
    torch.manual_seed(0)
    model, shape, classes, per_sample = _model(name, size)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(batch, *shape, generator=g)
    if classes == 0:
        return model, x, torch.randn(x.shape, generator=g)
    labels = (batch,) if per_sample else (batch, *shape[1:])
    return model, x, torch.randint(0, classes, labels, generator=g)


def loss(out, target) -> torch.Tensor:
    out = out.logits if hasattr(out, "logits") else out
    if target.is_floating_point():
        return nn.functional.mse_loss(out, target)
    return nn.functional.cross_entropy(out, target)
