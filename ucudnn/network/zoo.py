"""The network zoo: the convolution layers of well-known CNNs as `ConvProblem`s.

Each network is a list of `Layer`s in network (forward) order. Only convolutions are listed:
pooling, normalisation, activations and fully connected layers run no convolution kernel, but
they change the shapes between convolutions, and those changes are applied here. Sources:

- ``alexnet``: Krizhevsky, Sutskever and Hinton, NIPS 2012, with the exact shapes of Caffe's
  ``models/bvlc_alexnet/deploy.prototxt``: 227x227x3 input; conv1 96 11x11 stride 4;
  max-pool 3x3/2; conv2 256 5x5 pad 2 groups 2; max-pool 3x3/2; conv3 384 3x3 pad 1;
  conv4 384 3x3 pad 1 groups 2; conv5 256 3x3 pad 1 groups 2. The groups are the paper's split
  across two GPUs. (Not the single-GPU 64-192-384-256-256 variant of torchvision.)
- ``vgg16``: Simonyan and Zisserman, ICLR 2015, configuration D: 13 3x3 pad-1 convolutions
  in five stages of 64, 128, 256, 512, 512 channels with a 2x2/2 max-pool between stages,
  224x224x3 input (conv5_3 writes 14x14x512).
- ``resnet18``, ``resnet50``, ``resnet152``: He, Zhang, Ren and Sun, CVPR 2016, Table 1
  (ImageNet, 224x224x3): conv1 64 7x7/2 pad 3, max-pool 3x3/2 pad 1, then four stages at
  56, 28, 14, 7. ResNet-18 uses basic blocks [2, 2, 2, 2]; ResNet-50 and ResNet-152 use
  bottleneck blocks [3, 4, 6, 3] and [3, 8, 36, 3]. As in the original paper (and its Caffe
  models), a stage's stride 2 sits on the block's *first 1x1* convolution and on its
  projection shortcut, not on the 3x3 as in torchvision's "v1.5". Shortcuts that change the
  shape are 1x1 projections (the paper's option B) and appear as layers named
  ``layerS.B.downsample``, listed after the block's main-path convolutions.
- ``densenet40``: Huang, Liu, van der Maaten and Weinberger, CVPR 2017, the CIFAR DenseNet of
  depth 40 (32x32x3 input): conv0 3x3 to 16 channels, three dense blocks of 12 basic layers
  (BN-ReLU-3x3 conv pad 1, each adding the growth rate k channels), and between blocks a
  transition (1x1 conv keeping the channel count, no compression, then 2x2/2 average pool).
  **Growth rate k = 40**, as this project's issue asks ("DenseNet-40 (CIFAR, k=40)"); the
  paper's own DenseNet-40 uses k = 12 (see `DENSENET40_GROWTH`).
- ``googlenet``: Szegedy et al., CVPR 2015, Table 1 (Inception v1, 224x224x3): the stem
  conv1 7x7/2, conv2 3x3 reduce (1x1, 64) and conv2 3x3 (192), and the nine inception blocks
  3a..5b, each with its 1x1, 3x3 reduce, 3x3, 5x5 reduce, 5x5 and pool-proj convolutions at
  the table's channel counts. Max-pools round up (Caffe's ``bvlc_googlenet``), which gives the
  table's 56, 28, 14 and 7. The two auxiliary classifiers (training only) are left out.
- ``unet3d``: Çiçek, Abdulkadir, Lienkamp, Brox and Ronneberger, "3D U-Net: Learning Dense
  Volumetric Segmentation from Sparse Annotation", MICCAI 2016, Fig. 1 and Sec. 2: a 132x132x116
  voxel tile with 3 channels; in the analysis path each of four levels has two unpadded 3x3x3
  convolutions (3 -> 32 -> 64, 64 -> 64 -> 128, 128 -> 128 -> 256, 256 -> 256 -> 512: channels
  doubled before each max-pool) and a 2x2x2 max-pool of stride 2; in the synthesis path each of
  three levels has a 2x2x2 up-convolution of stride 2 (a transposed convolution keeping the
  channels, 512, 256, 128), the concatenation with the analysis path's cropped maps of that level
  (768, 384, 192 channels) and two unpadded 3x3x3 convolutions (to 256, 128, 64); a final 1x1x1
  convolution to the 3 labels writes 44x44x28. Spatial axes are (d, h, w) = (z, y, x): 116, 132,
  132 in, 28, 44, 44 out, as the paper's "44 x 44 x 28 voxels in x, y and z". The paper states no
  batch size; the default is one tile (`--batch` sets more).
- ``deepbench``: Baidu DeepBench, ``code/kernels/conv_problems.h``, the full ``training_set``
  (94 problems, some repeated). These are independent problems, not a network: each keeps
  DeepBench's own batch size unless a batch is given.

Layer names: ``conv1``..``conv5`` (AlexNet); ``conv1_1``..``conv5_3`` (VGG);
``conv1``, ``layer1.0.conv1``, ``layer2.0.downsample`` (ResNets, block indices from 0);
``conv1``, ``conv2.3x3_reduce``, ``conv2.3x3``, ``inception3a.1x1``, ``inception3a.pool_proj``
(GoogLeNet); ``conv0``, ``dense1.0``..``dense1.11``, ``trans1`` (DenseNet, layer indices from 0);
``down1.conv1``..``down4.conv2``, ``up3.upconv``, ``up3.conv1``..``up1.conv2``, ``final`` (3-D U-Net,
levels numbered as the paper's from the top); ``deepbench.0``..``deepbench.93``.

When no batch is given, a network uses the mini-batch its source trains with
(`DEFAULT_BATCH`); DeepBench problems use their own.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from ucudnn.errors import InvalidInput
from ucudnn.problem import KINDS, ConvProblem

__all__ = [
    "DEFAULT_BATCH",
    "DENSENET40_GROWTH",
    "NETWORKS",
    "Layer",
    "canonical_name",
    "kernels",
    "layers",
    "unique_problems",
]


@dataclass(frozen=True, slots=True)
class Layer:
    """One convolution layer of a network: its name and its forward problem (``kind="fwd"``)."""

    name: str
    problem: ConvProblem


NETWORKS: dict[str, str] = {
    "alexnet": "AlexNet (Krizhevsky 2012; Caffe bvlc_alexnet shapes, grouped conv2/4/5), 227x227",
    "vgg16": "VGG-16 (Simonyan & Zisserman 2015, config D), 13 3x3 convs, 224x224",
    "resnet18": "ResNet-18 (He 2016), basic blocks [2,2,2,2] + projection shortcuts, 224x224",
    "resnet50": "ResNet-50 (He 2016), bottlenecks [3,4,6,3], stride on the first 1x1, 224x224",
    "resnet152": "ResNet-152 (He 2016), bottlenecks [3,8,36,3], stride on the first 1x1, 224x224",
    "densenet40": "DenseNet-40 (Huang 2017), CIFAR 32x32, 3x12 3x3 layers, growth 40, no compression",
    "googlenet": "GoogLeNet / Inception v1 (Szegedy 2015), 3 stem convs + 9 inception blocks, 224x224",
    "unet3d": "3-D U-Net (Cicek 2016), 132x132x116 tile, 3x3x3 convs, 2x2x2 up-convolutions, 3-D",
    "deepbench": "Baidu DeepBench conv training set, 94 independent problems with their own batch",
}

# The mini-batch each source trains with; `None` means every problem carries its own.
DEFAULT_BATCH: dict[str, int | None] = {
    "alexnet": 128,  # Krizhevsky et al. 2012, section 5
    "vgg16": 256,  # Simonyan & Zisserman 2015, section 3.1
    "resnet18": 256,  # He et al. 2016, section 3.4
    "resnet50": 256,
    "resnet152": 256,
    "densenet40": 64,  # Huang et al. 2017, section 4.2
    "googlenet": 32,  # the paper states none; Caffe's bvlc_googlenet train_val.prototxt uses 32
    "unet3d": 1,  # the paper states none; one 132x132x116 tile
    "deepbench": None,
}

DENSENET40_GROWTH = 40  # the k; the paper's DenseNet-40 has k = 12
_DENSENET40_LAYERS_PER_BLOCK = 12  # (depth 40 - conv0 - 2 transitions - classifier) / 3 blocks
_DENSENET40_INITIAL_CHANNELS = 16

# Two spellings of one name should not be two networks: "ResNet-50" and "resnet_50" mean resnet50.
_NAME_JUNK = str.maketrans("", "", "-_ ")


def _pooled(size: int, kernel: int, stride: int, pad: int = 0, *, ceil: bool = False) -> int:
    """Output size of a pooling window (floor like PyTorch's default, or ceil like Caffe)."""
    span = size + 2 * pad - kernel
    return (math.ceil(span / stride) if ceil else span // stride) + 1


def _conv(
    name: str, n: int, c: int, hw: int, k: int, rs: int, *, pad: int = 0, stride: int = 1, groups: int = 1
) -> Layer:
    """A square convolution on a square input."""
    return Layer(
        name,
        ConvProblem(
            n=n, c=c, h=hw, w=hw, k=k, r=rs, s=rs, pad_h=pad, pad_w=pad, stride_h=stride, stride_w=stride, groups=groups
        ),
    )


def _alexnet(n: int) -> list[Layer]:
    conv1 = _conv("conv1", n, 3, 227, 96, 11, stride=4)  # -> 55x55x96
    hw = _pooled(conv1.problem.out_h, 3, 2)  # 27
    conv2 = _conv("conv2", n, 96, hw, 256, 5, pad=2, groups=2)  # -> 27x27x256
    hw = _pooled(conv2.problem.out_h, 3, 2)  # 13
    return [
        conv1,
        conv2,
        _conv("conv3", n, 256, hw, 384, 3, pad=1),
        _conv("conv4", n, 384, hw, 384, 3, pad=1, groups=2),
        _conv("conv5", n, 384, hw, 256, 3, pad=1, groups=2),
    ]  # -> 13x13x256


def _vgg16(n: int) -> list[Layer]:
    out: list[Layer] = []
    c, hw = 3, 224
    for stage, (k, count) in enumerate([(64, 2), (128, 2), (256, 3), (512, 3), (512, 3)], start=1):
        if stage > 1:
            hw = _pooled(hw, 2, 2)
        for i in range(1, count + 1):
            out.append(_conv(f"conv{stage}_{i}", n, c, hw, k, 3, pad=1))
            c = k
    return out


def _resnet_stem(n: int) -> tuple[list[Layer], int]:
    conv1 = _conv("conv1", n, 3, 224, 64, 7, pad=3, stride=2)  # -> 112x112x64
    return [conv1], _pooled(conv1.problem.out_h, 3, 2, 1)  # 56


def _resnet_basic(n: int, blocks: Sequence[int]) -> list[Layer]:
    out, hw = _resnet_stem(n)
    c = 64
    for stage, count in enumerate(blocks, start=1):
        width = 64 * 2 ** (stage - 1)
        for b in range(count):
            stride = 2 if stage > 1 and b == 0 else 1
            prefix = f"layer{stage}.{b}"
            conv1 = _conv(f"{prefix}.conv1", n, c, hw, width, 3, pad=1, stride=stride)
            hw_out = conv1.problem.out_h
            out += [conv1, _conv(f"{prefix}.conv2", n, width, hw_out, width, 3, pad=1)]
            if stride != 1 or c != width:
                out.append(_conv(f"{prefix}.downsample", n, c, hw, width, 1, stride=stride))
            c, hw = width, hw_out
    return out


def _resnet_bottleneck(n: int, blocks: Sequence[int]) -> list[Layer]:
    out, hw = _resnet_stem(n)
    c = 64
    for stage, count in enumerate(blocks, start=1):
        width = 64 * 2 ** (stage - 1)
        expanded = 4 * width
        for b in range(count):
            stride = 2 if stage > 1 and b == 0 else 1
            prefix = f"layer{stage}.{b}"
            # The original paper strides the first 1x1 (torchvision v1.5 strides the 3x3).
            conv1 = _conv(f"{prefix}.conv1", n, c, hw, width, 1, stride=stride)
            hw_out = conv1.problem.out_h
            out += [
                conv1,
                _conv(f"{prefix}.conv2", n, width, hw_out, width, 3, pad=1),
                _conv(f"{prefix}.conv3", n, width, hw_out, expanded, 1),
            ]
            if stride != 1 or c != expanded:
                out.append(_conv(f"{prefix}.downsample", n, c, hw, expanded, 1, stride=stride))
            c, hw = expanded, hw_out
    return out


def _densenet40(n: int) -> list[Layer]:
    k = DENSENET40_GROWTH
    c, hw = _DENSENET40_INITIAL_CHANNELS, 32
    out = [_conv("conv0", n, 3, hw, c, 3, pad=1)]
    for block in range(1, 4):
        if block > 1:
            out.append(_conv(f"trans{block - 1}", n, c, hw, c, 1))  # no compression
            hw = _pooled(hw, 2, 2)
        for i in range(_DENSENET40_LAYERS_PER_BLOCK):
            out.append(_conv(f"dense{block}.{i}", n, c, hw, k, 3, pad=1))
            c += k  # concatenation
    return out


# Szegedy et al. 2015, Table 1: #1x1, #3x3 reduce, #3x3, #5x5 reduce, #5x5, pool proj.
_INCEPTION: dict[str, tuple[int, int, int, int, int, int]] = {
    "3a": (64, 96, 128, 16, 32, 32),
    "3b": (128, 128, 192, 32, 96, 64),
    "4a": (192, 96, 208, 16, 48, 64),
    "4b": (160, 112, 224, 24, 64, 64),
    "4c": (128, 128, 256, 24, 64, 64),
    "4d": (112, 144, 288, 32, 64, 64),
    "4e": (256, 160, 320, 32, 128, 128),
    "5a": (256, 160, 320, 32, 128, 128),
    "5b": (384, 192, 384, 48, 128, 128),
}


def _googlenet(n: int) -> list[Layer]:
    conv1 = _conv("conv1", n, 3, 224, 64, 7, pad=3, stride=2)  # -> 112x112x64
    hw = _pooled(conv1.problem.out_h, 3, 2, ceil=True)  # 56
    out = [conv1, _conv("conv2.3x3_reduce", n, 64, hw, 64, 1), _conv("conv2.3x3", n, 64, hw, 192, 3, pad=1)]
    c = 192
    for block, (b1, b3r, b3, b5r, b5, pp) in _INCEPTION.items():
        if block in ("3a", "4a", "5a"):
            hw = _pooled(hw, 3, 2, ceil=True)  # 28, 14, 7
        p = f"inception{block}"
        out += [
            _conv(f"{p}.1x1", n, c, hw, b1, 1),
            _conv(f"{p}.3x3_reduce", n, c, hw, b3r, 1),
            _conv(f"{p}.3x3", n, b3r, hw, b3, 3, pad=1),
            _conv(f"{p}.5x5_reduce", n, c, hw, b5r, 1),
            _conv(f"{p}.5x5", n, b5r, hw, b5, 5, pad=2),
            # the pool branch: 3x3/1 pad-1 max-pool keeps the block input's shape
            _conv(f"{p}.pool_proj", n, c, hw, pp, 1),
        ]
        c = b1 + b3 + b5 + pp  # concatenation
    return out


# Çiçek et al. 2016, Fig. 1: the analysis path's channels per level (first conv, second conv).
_UNET3D_DOWN = ((32, 64), (64, 128), (128, 256), (256, 512))
_UNET3D_TILE = (116, 132, 132)  # (z, y, x) voxels
_UNET3D_LABELS = 3


def _unet3d(n: int) -> list[Layer]:
    def conv(name: str, c: int, dhw: tuple[int, ...], k: int, size: int) -> Layer:
        d, h, w = dhw
        return Layer(name, ConvProblem(n=n, c=c, d=d, h=h, w=w, k=k, t=size, r=size, s=size))

    out: list[Layer] = []
    dhw: tuple[int, ...]  # (z, y, x): the tile, then each level's output
    c, dhw = 3, _UNET3D_TILE
    skips = []
    for level, (k1, k2) in enumerate(_UNET3D_DOWN, start=1):
        first = conv(f"down{level}.conv1", c, dhw, k1, 3)  # unpadded: -2 per axis
        second = conv(f"down{level}.conv2", k1, first.problem.y_shape[2:], k2, 3)
        out += [first, second]
        c, dhw = k2, second.problem.y_shape[2:]
        skips.append((c, dhw))
        dhw = tuple(_pooled(size, 2, 2) for size in dhw)  # 2x2x2 max-pool, stride 2
    dhw = skips.pop()[1]  # the bottom level is not pooled
    for level in (3, 2, 1):
        d, h, w = dhw
        up = Layer(
            f"up{level}.upconv",
            ConvProblem(
                n=n, c=c, d=d, h=h, w=w, k=c, t=2, r=2, s=2, stride_d=2, stride_h=2, stride_w=2, transposed=True
            ),
        )
        skip_c, _ = skips.pop()  # cropped to the up-convolution's size
        first = conv(f"up{level}.conv1", c + skip_c, up.problem.y_shape[2:], skip_c, 3)
        second = conv(f"up{level}.conv2", skip_c, first.problem.y_shape[2:], skip_c, 3)
        out += [up, first, second]
        c, dhw = skip_c, second.problem.y_shape[2:]
    out.append(conv("final", c, dhw, _UNET3D_LABELS, 1))  # -> 28x44x44x3
    return out


# Baidu DeepBench, code/kernels/conv_problems.h, `training_set`, in its order and field order:
# (w, h, c, n, k, filter_w (s), filter_h (r), pad_w, pad_h, stride_w, stride_h).
_DEEPBENCH_TRAINING: tuple[tuple[int, int, int, int, int, int, int, int, int, int, int], ...] = (
    (700, 161, 1, 4, 32, 20, 5, 0, 0, 2, 2),
    (700, 161, 1, 8, 32, 20, 5, 0, 0, 2, 2),
    (700, 161, 1, 16, 32, 20, 5, 0, 0, 2, 2),
    (700, 161, 1, 32, 32, 20, 5, 0, 0, 2, 2),
    (341, 79, 32, 4, 32, 10, 5, 0, 0, 2, 2),
    (341, 79, 32, 8, 32, 10, 5, 0, 0, 2, 2),
    (341, 79, 32, 16, 32, 10, 5, 0, 0, 2, 2),
    (341, 79, 32, 32, 32, 10, 5, 0, 0, 2, 2),
    (480, 48, 1, 16, 16, 3, 3, 1, 1, 1, 1),
    (240, 24, 16, 16, 32, 3, 3, 1, 1, 1, 1),
    (120, 12, 32, 16, 64, 3, 3, 1, 1, 1, 1),
    (60, 6, 64, 16, 128, 3, 3, 1, 1, 1, 1),
    (108, 108, 3, 8, 64, 3, 3, 1, 1, 2, 2),
    (54, 54, 64, 8, 64, 3, 3, 1, 1, 1, 1),
    (27, 27, 128, 8, 128, 3, 3, 1, 1, 1, 1),
    (14, 14, 128, 8, 256, 3, 3, 1, 1, 1, 1),
    (7, 7, 256, 8, 512, 3, 3, 1, 1, 1, 1),
    (224, 224, 3, 8, 64, 3, 3, 1, 1, 1, 1),
    (112, 112, 64, 8, 128, 3, 3, 1, 1, 1, 1),
    (56, 56, 128, 8, 256, 3, 3, 1, 1, 1, 1),
    (28, 28, 256, 8, 512, 3, 3, 1, 1, 1, 1),
    (14, 14, 512, 8, 512, 3, 3, 1, 1, 1, 1),
    (7, 7, 512, 8, 512, 3, 3, 1, 1, 1, 1),
    (224, 224, 3, 16, 64, 3, 3, 1, 1, 1, 1),
    (112, 112, 64, 16, 128, 3, 3, 1, 1, 1, 1),
    (56, 56, 128, 16, 256, 3, 3, 1, 1, 1, 1),
    (28, 28, 256, 16, 512, 3, 3, 1, 1, 1, 1),
    (14, 14, 512, 16, 512, 3, 3, 1, 1, 1, 1),
    (7, 7, 512, 16, 512, 3, 3, 1, 1, 1, 1),
    (224, 224, 3, 16, 64, 7, 7, 3, 3, 2, 2),
    (28, 28, 192, 16, 32, 5, 5, 2, 2, 1, 1),
    (28, 28, 192, 16, 64, 1, 1, 0, 0, 1, 1),
    (14, 14, 512, 16, 48, 5, 5, 2, 2, 1, 1),
    (14, 14, 512, 16, 192, 1, 1, 0, 0, 1, 1),
    (7, 7, 832, 16, 256, 1, 1, 0, 0, 1, 1),
    (7, 7, 832, 16, 128, 5, 5, 2, 2, 1, 1),
    (56, 56, 64, 8, 64, 3, 3, 1, 1, 1, 1),
    (56, 56, 64, 8, 256, 1, 1, 0, 0, 2, 2),
    (28, 28, 128, 8, 128, 3, 3, 1, 1, 1, 1),
    (28, 28, 128, 8, 512, 1, 1, 0, 0, 2, 2),
    (14, 14, 256, 8, 256, 1, 1, 0, 0, 1, 1),
    (14, 14, 256, 8, 256, 3, 3, 1, 1, 1, 1),
    (14, 14, 256, 8, 1024, 1, 1, 0, 0, 2, 2),
    (7, 7, 512, 8, 512, 1, 1, 0, 0, 1, 1),
    (7, 7, 2048, 8, 512, 1, 1, 3, 3, 2, 2),
    (56, 56, 64, 16, 64, 3, 3, 1, 1, 1, 1),
    (56, 56, 64, 16, 256, 1, 1, 0, 0, 2, 2),
    (28, 28, 128, 16, 128, 3, 3, 1, 1, 1, 1),
    (28, 28, 128, 16, 512, 1, 1, 0, 0, 2, 2),
    (14, 14, 256, 16, 256, 1, 1, 0, 0, 1, 1),
    (14, 14, 256, 16, 256, 3, 3, 1, 1, 1, 1),
    (14, 14, 256, 16, 1024, 1, 1, 0, 0, 2, 2),
    (7, 7, 512, 16, 512, 1, 1, 0, 0, 1, 1),
    (7, 7, 2048, 16, 512, 1, 1, 3, 3, 2, 2),
    (700, 161, 1, 16, 64, 5, 5, 1, 1, 2, 2),
    (350, 80, 64, 16, 64, 3, 3, 1, 1, 1, 1),
    (350, 80, 64, 16, 128, 5, 5, 1, 1, 2, 2),
    (175, 40, 128, 16, 128, 3, 3, 1, 1, 1, 1),
    (175, 40, 128, 16, 256, 5, 5, 1, 1, 2, 2),
    (84, 20, 256, 16, 256, 3, 3, 1, 1, 1, 1),
    (84, 20, 256, 16, 512, 5, 5, 1, 1, 2, 2),
    (42, 10, 512, 16, 512, 3, 3, 1, 1, 1, 1),
    (112, 112, 64, 8, 64, 1, 1, 0, 0, 1, 1),
    (56, 56, 64, 8, 256, 1, 1, 0, 0, 1, 1),
    (56, 56, 256, 8, 64, 1, 1, 0, 0, 1, 1),
    (56, 56, 256, 8, 128, 1, 1, 0, 0, 2, 2),
    (28, 28, 128, 8, 512, 1, 1, 0, 0, 1, 1),
    (28, 28, 512, 8, 128, 1, 1, 0, 0, 1, 1),
    (28, 28, 512, 8, 256, 1, 1, 0, 0, 2, 2),
    (14, 14, 256, 8, 1024, 1, 1, 0, 0, 1, 1),
    (28, 28, 512, 8, 1024, 1, 1, 0, 0, 2, 2),
    (14, 14, 1024, 8, 256, 1, 1, 0, 0, 1, 1),
    (14, 14, 256, 8, 1024, 1, 1, 0, 0, 1, 1),
    (14, 14, 1024, 8, 512, 1, 1, 0, 0, 2, 2),
    (7, 7, 512, 8, 512, 3, 3, 1, 1, 1, 1),
    (7, 7, 512, 8, 2048, 1, 1, 0, 0, 1, 1),
    (14, 14, 1024, 8, 2048, 1, 1, 0, 0, 2, 2),
    (7, 7, 2048, 8, 512, 1, 1, 0, 0, 1, 1),
    (112, 112, 64, 16, 64, 1, 1, 0, 0, 1, 1),
    (56, 56, 64, 16, 256, 1, 1, 0, 0, 1, 1),
    (56, 56, 256, 16, 64, 1, 1, 0, 0, 1, 1),
    (56, 56, 256, 16, 128, 1, 1, 0, 0, 2, 2),
    (28, 28, 128, 16, 512, 1, 1, 0, 0, 1, 1),
    (28, 28, 512, 16, 128, 1, 1, 0, 0, 1, 1),
    (28, 28, 512, 16, 256, 1, 1, 0, 0, 2, 2),
    (14, 14, 256, 16, 1024, 1, 1, 0, 0, 1, 1),
    (28, 28, 512, 16, 1024, 1, 1, 0, 0, 2, 2),
    (14, 14, 1024, 16, 256, 1, 1, 0, 0, 1, 1),
    (14, 14, 256, 16, 1024, 1, 1, 0, 0, 1, 1),
    (14, 14, 1024, 16, 512, 1, 1, 0, 0, 2, 2),
    (7, 7, 512, 16, 512, 3, 3, 1, 1, 1, 1),
    (7, 7, 512, 16, 2048, 1, 1, 0, 0, 1, 1),
    (14, 14, 1024, 16, 2048, 1, 1, 0, 0, 2, 2),
    (7, 7, 2048, 16, 512, 1, 1, 0, 0, 1, 1),
)


def _deepbench(n: int | None) -> list[Layer]:
    return [
        Layer(
            f"deepbench.{i}",
            ConvProblem(
                n=n if n is not None else db_n,
                c=c,
                h=h,
                w=w,
                k=k,
                r=r,
                s=s,
                pad_h=pad_h,
                pad_w=pad_w,
                stride_h=stride_h,
                stride_w=stride_w,
            ),
        )
        for i, (w, h, c, db_n, k, s, r, pad_w, pad_h, stride_w, stride_h) in enumerate(_DEEPBENCH_TRAINING)
    ]


_BUILDERS: dict[str, Callable[[int], list[Layer]]] = {
    "alexnet": _alexnet,
    "vgg16": _vgg16,
    "resnet18": lambda n: _resnet_basic(n, (2, 2, 2, 2)),
    "resnet50": lambda n: _resnet_bottleneck(n, (3, 4, 6, 3)),
    "resnet152": lambda n: _resnet_bottleneck(n, (3, 8, 36, 3)),
    "densenet40": _densenet40,
    "googlenet": _googlenet,
    "unet3d": _unet3d,
}


def canonical_name(name: str) -> str:
    """The `NETWORKS` key that `name` spells (``"ResNet-50"`` -> ``"resnet50"``), or `InvalidInput`."""
    if not isinstance(name, str):
        raise InvalidInput(f"network name must be a string, got {name!r}")
    canonical = name.lower().translate(_NAME_JUNK)
    if canonical not in NETWORKS:
        raise InvalidInput(f"unknown network {name!r}; known networks: {', '.join(NETWORKS)}")
    return canonical


def _check_batch(batch: int | None) -> None:
    if batch is None:
        return
    if not isinstance(batch, int) or isinstance(batch, bool):
        raise InvalidInput(f"batch must be a positive integer, got {batch!r}")
    if batch < 1:
        raise InvalidInput(f"batch must be a positive integer, got {batch}")


def layers(name: str, batch: int | None = None) -> list[Layer]:
    """The convolution layers of network `name`, in forward order, each a ``fwd`` problem.

    `name` is one of `NETWORKS` (case, ``-``, ``_`` and spaces are ignored: ``"ResNet-50"``
    works). `batch` sets every layer's ``n``; without it a network uses `DEFAULT_BATCH` and
    DeepBench keeps each problem's own batch. Raises `InvalidInput` for an unknown name (the
    message lists the known ones) or a batch below 1.
    """
    canonical = canonical_name(name)
    _check_batch(batch)
    if canonical == "deepbench":
        return _deepbench(batch)
    n = batch if batch is not None else DEFAULT_BATCH[canonical]
    assert n is not None  # every network but DeepBench has a default batch
    return _BUILDERS[canonical](n)


def kernels(
    name: str, batch: int | None = None, kinds: Sequence[str] = KINDS, *, skip_first_bwd_data: bool = False
) -> list[tuple[str, ConvProblem]]:
    """Every kernel of network `name`: ``(layer name, problem)`` for each layer, then each kind.

    A network of L layers gives ``L * len(kinds)`` kernels (AlexNet: 5 x 3 = 15). With
    `skip_first_bwd_data`, the first layer's ``bwd_data`` is left out: that layer reads the
    image, and training never needs the gradient of the input image. DeepBench problems are
    independent, none of them reads a network's image, so the flag leaves them all in.
    """
    kinds = tuple(kinds) if not isinstance(kinds, str) else (kinds,)
    if not kinds:
        raise InvalidInput(f"kinds must name at least one of {', '.join(KINDS)}")
    for kind in kinds:
        if kind not in KINDS:
            raise InvalidInput(f"unknown kernel kind {kind!r}; expected one of {', '.join(KINDS)}")
    if len(set(kinds)) != len(kinds):
        raise InvalidInput(f"kinds {list(kinds)} name a kind twice")
    canonical = canonical_name(name)
    net = layers(canonical, batch)
    image_layer = None if canonical == "deepbench" else net[0].name
    return [
        (layer.name, layer.problem.with_kind(kind))
        for layer in net
        for kind in kinds
        if not (skip_first_bwd_data and kind == "bwd_data" and layer.name == image_layer)
    ]


def unique_problems(net: Iterable[Layer]) -> dict[str, list[str]]:
    """Group layers by `ConvProblem.key` (every field but the batch): ``key -> layer names``.

    Layers with one key share their measurements. Keys keep the order of their first layer.
    """
    groups: dict[str, list[str]] = {}
    for layer in net:
        groups.setdefault(layer.problem.key, []).append(layer.name)
    return groups
