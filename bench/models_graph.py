"""The two small Fashion-MNIST networks of bench/graph_mode.py: a ResNet and a MobileNet-V2-style network.

Both are plain ``nn.Module`` graphs with functional residual adds, BatchNorm after every conv and ReLU/ReLU6: the
patterns a graph-mode quantizer has to handle (conv-bn folding, quantizers after adds, depthwise convs) and that an
eager, module-swapping quantizer cannot see.
"""

from __future__ import annotations

import torch
from torch import nn


def conv_bn(c_in: int, c_out: int, kernel: int = 3, stride: int = 1, groups: int = 1) -> list[nn.Module]:
    """A bias-free conv ('same' padding) followed by BatchNorm."""
    conv = nn.Conv2d(c_in, c_out, kernel, stride=stride, padding=kernel // 2, groups=groups, bias=False)
    return [conv, nn.BatchNorm2d(c_out)]


class BasicBlock(nn.Module):
    """ResNet basic block: conv-bn-relu-conv-bn + (identity | 1x1 conv-bn) shortcut, add, relu."""

    def __init__(self, c_in: int, c_out: int, stride: int = 1) -> None:
        super().__init__()
        self.body = nn.Sequential(*conv_bn(c_in, c_out, 3, stride), nn.ReLU(), *conv_bn(c_out, c_out, 3))
        downsample = stride != 1 or c_in != c_out
        self.shortcut = nn.Sequential(*conv_bn(c_in, c_out, 1, stride)) if downsample else nn.Identity()
        self.relu = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.relu(self.body(x) + self.shortcut(x))


class SmallResNet(nn.Module):
    """Stem conv-bn-relu (28x28), three basic blocks (28x28 -> 14x14 -> 7x7), global average pool, linear."""

    def __init__(self, widths: tuple[int, int, int] = (16, 32, 64), num_classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Sequential(*conv_bn(1, widths[0], 3, 2), nn.ReLU())
        self.blocks = nn.Sequential(
            BasicBlock(widths[0], widths[0]), BasicBlock(widths[0], widths[1], 2), BasicBlock(widths[1], widths[2], 2)
        )
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(widths[2], num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.flatten(self.pool(self.blocks(self.stem(x))), 1))


class InvertedResidual(nn.Module):
    """MobileNet-V2 block: 1x1 expand conv-bn-relu6, 3x3 depthwise conv-bn-relu6, 1x1 project conv-bn (linear
    bottleneck); the input is added back when the stride is 1 and the channel counts match."""

    def __init__(self, c_in: int, c_out: int, stride: int = 1, expand: int = 4) -> None:
        super().__init__()
        hidden = c_in * expand
        self.body = nn.Sequential(
            *conv_bn(c_in, hidden, 1),
            nn.ReLU6(),
            *conv_bn(hidden, hidden, 3, stride, groups=hidden),
            nn.ReLU6(),
            *conv_bn(hidden, c_out, 1),
        )
        self.residual = stride == 1 and c_in == c_out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.body(x) if self.residual else self.body(x)


class SmallMobileNetV2(nn.Module):
    """Stem conv-bn-relu6 (28x28), four inverted-residual blocks (two with a residual add, two with stride 2),
    global average pool, linear."""

    def __init__(self, num_classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Sequential(*conv_bn(1, 16, 3, 2), nn.ReLU6())
        self.blocks = nn.Sequential(
            InvertedResidual(16, 16),  # residual
            InvertedResidual(16, 24, stride=2),  # 14x14
            InvertedResidual(24, 24),  # residual
            InvertedResidual(24, 32, stride=2),  # 7x7
        )
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(32, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.flatten(self.pool(self.blocks(self.stem(x))), 1))


MODELS: dict[str, type[nn.Module]] = {"resnet": SmallResNet, "mobilenetv2": SmallMobileNetV2}
