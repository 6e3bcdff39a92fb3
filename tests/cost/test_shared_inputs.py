"""The precision search groups layers that read the very same input tensor (one format for the
group: the NPU quantizes that tensor once), found from one dal.capture record."""
import torch
from torch import nn

from dal.cost.search import _shared_inputs


class QKV(nn.Module):
    """q, k and v read ``x`` itself; ``o`` reads their product; ``side`` reads a copy of ``x``
    (equal values, another tensor: not the same input)."""

    def __init__(self):
        super().__init__()
        self.q, self.k, self.v, self.o, self.side = (nn.Linear(8, 8) for _ in range(5))

    def forward(self, x):
        a = self.q(x) * self.k(x) + self.v(x)
        return self.o(a) + self.side(x.clone())


def test_layers_reading_the_same_tensor_are_one_group():
    names = ["q", "k", "v", "o", "side"]
    groups = _shared_inputs(QKV(), (torch.randn(2, 8),), names)
    assert [sorted(g) for g in groups] == [["k", "q", "v"]]
