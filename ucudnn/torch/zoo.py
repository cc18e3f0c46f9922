"""Convolutional networks shaped as torchvision builds them, written by hand.

For tests, benchmarks and examples where torchvision does not import (PyPI's torchvision needs the
torch build it was made for). Layer for layer these are torchvision's shapes; `convert` and
`plan_memory` work on torchvision's own models the same way where it imports.

    model = ucudnn.torch.zoo.build("resnet18", num_classes=10)

- `resnet18`, `resnet50`: ResNet v1.5 (7x7/2 stem, max-pool, basic blocks [2, 2, 2, 2] or
  bottlenecks [3, 4, 6, 3] with the stride on the 3x3 convolution, 1x1 projections, batch norm).
- `vgg16`: configuration D (13 3x3 convolutions, 5 max-pools), torchvision's adaptive 7x7 pool and a
  smaller classifier (512*7*7 -> 256 -> classes) so that CPU runs stay short.
- `densenet`: a DenseNet-BC with torchvision's stem and transitions, growth 12 and blocks of
  (4, 4, 4) bottleneck layers: the concatenations of DenseNet-121 at a CPU-sized depth.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["MODELS", "build"]


class BasicBlock(nn.Module):
    expansion = 1

    def __init__(self, c_in: int, width: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, width, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.downsample = _projection(c_in, width, stride)

    def forward(self, x):
        out = self.bn2(self.conv2(F.relu(self.bn1(self.conv1(x)))))
        return F.relu(out + (x if self.downsample is None else self.downsample(x)))


class Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, c_in: int, width: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, width * 4, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(width * 4)
        self.downsample = _projection(c_in, width * 4, stride)

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        out = F.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return F.relu(out + (x if self.downsample is None else self.downsample(x)))


def _projection(c_in: int, c_out: int, stride: int) -> nn.Module | None:
    if stride == 1 and c_in == c_out:
        return None
    return nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride=stride, bias=False), nn.BatchNorm2d(c_out))


class ResNet(nn.Module):
    def __init__(self, block: type[BasicBlock | Bottleneck], blocks: tuple[int, ...], num_classes: int = 1000) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 64, 7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        stages, c_in = [], 64
        for i, count in enumerate(blocks):
            width = 64 * 2**i
            layers = []
            for b in range(count):
                layers.append(block(c_in, width, 2 if b == 0 and i > 0 else 1))
                c_in = width * block.expansion
            stages.append(nn.Sequential(*layers))
        self.layer1, self.layer2, self.layer3, self.layer4 = stages
        self.fc = nn.Linear(c_in, num_classes)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.bn1(self.conv1(x))), 3, 2, 1)
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


class VGG16(nn.Module):
    CONFIG = (64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512, "M")

    def __init__(self, num_classes: int = 1000) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        c_in = 3
        for v in self.CONFIG:
            if isinstance(v, str):  # "M"
                layers.append(nn.MaxPool2d(2, 2))
            else:
                layers += [nn.Conv2d(c_in, v, 3, padding=1), nn.ReLU(inplace=True)]
                c_in = v
        self.features = nn.Sequential(*layers)
        self.classifier = nn.Sequential(nn.Linear(512 * 7 * 7, 256), nn.ReLU(inplace=True), nn.Linear(256, num_classes))

    def forward(self, x):
        return self.classifier(torch.flatten(F.adaptive_avg_pool2d(self.features(x), 7), 1))


class DenseLayer(nn.Module):
    def __init__(self, c_in: int, growth: int) -> None:
        super().__init__()
        self.norm1 = nn.BatchNorm2d(c_in)
        self.conv1 = nn.Conv2d(c_in, 4 * growth, 1, bias=False)
        self.norm2 = nn.BatchNorm2d(4 * growth)
        self.conv2 = nn.Conv2d(4 * growth, growth, 3, padding=1, bias=False)

    def forward(self, x):
        out = self.conv1(F.relu(self.norm1(x)))
        return torch.cat([x, self.conv2(F.relu(self.norm2(out)))], 1)


class DenseNet(nn.Module):
    def __init__(self, growth: int = 12, blocks: tuple[int, ...] = (4, 4, 4), num_classes: int = 1000) -> None:
        super().__init__()
        c = 2 * growth
        layers: list[nn.Module] = [
            nn.Conv2d(3, c, 7, stride=2, padding=3, bias=False),
            nn.BatchNorm2d(c),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(3, 2, 1),
        ]
        for i, count in enumerate(blocks):
            for _ in range(count):
                layers.append(DenseLayer(c, growth))
                c += growth
            if i < len(blocks) - 1:  # transition: halve channels and resolution
                layers += [
                    nn.BatchNorm2d(c),
                    nn.ReLU(inplace=True),
                    nn.Conv2d(c, c // 2, 1, bias=False),
                    nn.AvgPool2d(2, 2),
                ]
                c //= 2
        self.features = nn.Sequential(*layers, nn.BatchNorm2d(c))
        self.fc = nn.Linear(c, num_classes)

    def forward(self, x):
        x = F.relu(self.features(x))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


MODELS = {
    "resnet18": lambda num_classes: ResNet(BasicBlock, (2, 2, 2, 2), num_classes),
    "resnet50": lambda num_classes: ResNet(Bottleneck, (3, 4, 6, 3), num_classes),
    "vgg16": lambda num_classes: VGG16(num_classes),
    "densenet": lambda num_classes: DenseNet(num_classes=num_classes),
}


def build(name: str, num_classes: int = 1000) -> nn.Module:
    """A fresh model of the zoo (`MODELS`), initialised as torch initialises its layers."""
    if name not in MODELS:
        from ucudnn.errors import InvalidInput

        raise InvalidInput(f"unknown model {name!r}; choose one of {', '.join(MODELS)}")
    return MODELS[name](num_classes)
