"""Small reference models used by the demo, the benchmarks and the tests."""
from __future__ import annotations

from torch import nn


class MnistCNN(nn.Module):
    """A small CNN for 1x28x28 digits: four Conv+BN(+ReLU) layers, a residual add, a linear head.

    It exercises what a real network needs from QAT: BN folding, a skip connection (``+``),
    pooling and a classifier.
    """

    def __init__(self, width: int = 16, num_classes: int = 10):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(1, width, 3, padding=1, bias=False), nn.BatchNorm2d(width), nn.ReLU())
        self.down = nn.Sequential(nn.Conv2d(width, 2 * width, 3, stride=2, padding=1, bias=False),
                                  nn.BatchNorm2d(2 * width), nn.ReLU())
        self.conv = nn.Conv2d(2 * width, 2 * width, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(2 * width)
        self.relu = nn.ReLU()
        self.down2 = nn.Sequential(nn.Conv2d(2 * width, 4 * width, 3, stride=2, padding=1, bias=False),
                                   nn.BatchNorm2d(4 * width), nn.ReLU())
        self.pool = nn.MaxPool2d(2)
        self.head = nn.Linear(36 * width, num_classes)

    def forward(self, x):
        x = self.down(self.stem(x))
        x = self.relu(x + self.bn(self.conv(x)))
        return self.head(self.pool(self.down2(x)).flatten(1))


class DepthwiseSeparable(nn.Sequential):
    """MobileNet-V1 unit: depthwise 3x3 conv + BN + ReLU, then pointwise 1x1 conv + BN + ReLU.
    One submodule, so a block-wise PTQ step (``dal.ptq.adaround(block="block")``) sees the pair."""

    def __init__(self, cin: int, cout: int, stride: int = 1):
        super().__init__(nn.Conv2d(cin, cin, 3, stride=stride, padding=1, groups=cin, bias=False),
                         nn.BatchNorm2d(cin), nn.ReLU(),
                         nn.Conv2d(cin, cout, 1, bias=False), nn.BatchNorm2d(cout), nn.ReLU())


class MobileNetTiny(nn.Module):
    """A MobileNet-style CNN for 1x28x28 digits: a 3x3 stem, five depthwise-separable units
    (two of stride 2), global average pooling, a linear head.

    The harder case for low-bit PTQ: with BN folded, a depthwise kernel has nine weights per
    output channel, so 4-bit round-to-nearest costs far more than on ``MnistCNN``.
    """

    def __init__(self, width: int = 16, num_classes: int = 10):
        super().__init__()
        w = width
        self.stem = nn.Sequential(nn.Conv2d(1, w, 3, padding=1, bias=False), nn.BatchNorm2d(w), nn.ReLU())
        self.blocks = nn.Sequential(DepthwiseSeparable(w, 2 * w, 2), DepthwiseSeparable(2 * w, 2 * w),
                                    DepthwiseSeparable(2 * w, 4 * w, 2), DepthwiseSeparable(4 * w, 4 * w),
                                    DepthwiseSeparable(4 * w, 4 * w))
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.head = nn.Linear(4 * w, num_classes)

    def forward(self, x):
        return self.head(self.pool(self.blocks(self.stem(x))).flatten(1))
