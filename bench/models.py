"""The whole networks of the end-to-end bench, written out as torchvision defines them (no torchvision
dependency): ResNet-18 (He et al. 2016, torchvision's `resnet18`) and MobileNetV2 (Sandler et al.
2018, torchvision's `mobilenet_v2`, width 1.0), each with 1000 classes; and the encoder-decoder of
examples/torch_interop.py, whose transposed convolution the other two lack.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
from torch_interop import build_network  # noqa: E402


class BasicBlock(nn.Module):
    """Two 3×3 convolutions with BatchNorm, added to the input (through a strided 1×1 where the
    shape changes), then ReLU."""

    def __init__(self, inplanes: int, planes: int, stride: int = 1):
        super().__init__()
        self.conv1 = nn.Conv2d(inplanes, planes, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(planes, planes, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.downsample = None
        if stride != 1 or inplanes != planes:
            self.downsample = nn.Sequential(nn.Conv2d(inplanes, planes, 1, stride, bias=False), nn.BatchNorm2d(planes))

    def forward(self, x):
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + identity)


def resnet18(num_classes: int = 1000) -> nn.Module:
    layers = [nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64), nn.ReLU(inplace=True),
              nn.MaxPool2d(3, 2, 1)]
    inplanes = 64
    for planes, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
        layers += [BasicBlock(inplanes, planes, stride), BasicBlock(planes, planes)]
        inplanes = planes
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(512, num_classes)]
    return nn.Sequential(*layers)


def _conv_bn_relu6(inp: int, oup: int, kernel: int = 3, stride: int = 1, groups: int = 1) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(inp, oup, kernel, stride, (kernel - 1) // 2, groups=groups, bias=False),
                         nn.BatchNorm2d(oup), nn.ReLU6(inplace=True))


class InvertedResidual(nn.Module):
    """1×1 expansion (unless t = 1), 3×3 depthwise at the stride, linear 1×1 projection; the input
    added where stride 1 keeps the shape."""

    def __init__(self, inp: int, oup: int, stride: int, expand_ratio: int):
        super().__init__()
        hidden = inp * expand_ratio
        self.use_residual = stride == 1 and inp == oup
        layers = [] if expand_ratio == 1 else [_conv_bn_relu6(inp, hidden, 1)]
        layers += [_conv_bn_relu6(hidden, hidden, 3, stride, groups=hidden),
                   nn.Conv2d(hidden, oup, 1, bias=False), nn.BatchNorm2d(oup)]
        self.conv = nn.Sequential(*layers)

    def forward(self, x):
        return x + self.conv(x) if self.use_residual else self.conv(x)


def mobilenet_v2(num_classes: int = 1000) -> nn.Module:
    settings = [(1, 16, 1, 1), (6, 24, 2, 2), (6, 32, 3, 2), (6, 64, 4, 2), (6, 96, 3, 1), (6, 160, 3, 2),
                (6, 320, 1, 1)]  # expansion t, channels c, repeats n, first stride s
    features = [_conv_bn_relu6(3, 32, 3, 2)]
    inp = 32
    for t, c, n, s in settings:
        for i in range(n):
            features.append(InvertedResidual(inp, c, s if i == 0 else 1, t))
            inp = c
    features.append(_conv_bn_relu6(inp, 1280, 1))
    return nn.Sequential(*features, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Dropout(0.2),
                         nn.Linear(1280, num_classes))


def encoder_decoder() -> nn.Module:
    """examples/torch_interop.py's network: strided, grouped and transposed convolutions, 3 → 3 channels."""
    return build_network()


MODELS = {"resnet18": resnet18, "mobilenet_v2": mobilenet_v2, "encoder_decoder": encoder_decoder}


def convolutions(model: nn.Module) -> int:
    return sum(isinstance(m, (nn.Conv2d, nn.ConvTranspose2d)) for m in model.modules())


__all__ = ["MODELS", "convolutions", "encoder_decoder", "mobilenet_v2", "resnet18", "torch"]
