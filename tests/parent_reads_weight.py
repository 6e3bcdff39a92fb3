"""A model whose ``fc`` never runs its forward: the parent computes with ``fc``'s weight
(``F.linear(x, self.fc.weight, self.fc.bias)``), as tied or functionally used weights do. Shared by
prepare's never-runs tests and dal.convert's weight-read test."""
import torch.nn.functional as F
from torch import nn


class ReadsWeight(nn.Module):
    """``fc``'s forward never runs: its parent computes with its weight."""

    def __init__(self):
        super().__init__()
        self.fc, self.out = nn.Linear(8, 8), nn.Linear(8, 4)

    def forward(self, x):
        return self.out(F.linear(x, self.fc.weight, self.fc.bias))
