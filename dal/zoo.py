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
