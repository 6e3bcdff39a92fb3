"""Shared helpers of the sparsity tests (unique module name: imported by the tests)."""
import torch
from torch import nn


def tiny_model(seed=0):
    """Linear and Conv layers whose reduction axes are multiples of 4."""
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Conv2d(4, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
        nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(),
        nn.AdaptiveAvgPool2d(2), nn.Flatten(), nn.Linear(32, 16), nn.ReLU(), nn.Linear(16, 4))


def tiny_batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(8, 4, 6, 6, generator=g), torch.randint(0, 4, (8,), generator=g)


def group_counts(mask, axis):
    return mask.movedim(axis, -1).reshape(-1, 4).sum(dim=1)
