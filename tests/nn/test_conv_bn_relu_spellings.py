"""A Conv2d -> BatchNorm2d chain followed by a ReLU fuses with it (one QConvBnReLU2d) whichever way
the forward spells the ReLU: the module nn.ReLU, F.relu, torch.relu, torch.relu_, x.relu(),
x.relu_() (dal.ops' op ``relu``); a clamp of another range (F.relu6, F.hardtanh) or another
activation (sigmoid, leaky ReLU) is no ReLU: the chain fuses without it and the activation stays."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dal.nn.own_forward import find_conv_bn, trace_own_forward

RELUS = {
    "nn.ReLU": lambda m, y: m.act(y),
    "F.relu": lambda m, y: F.relu(y),
    "F.relu_inplace": lambda m, y: F.relu(y, inplace=True),
    "torch.relu": lambda m, y: torch.relu(y),
    "torch.relu_": lambda m, y: torch.relu_(y),
    "x.relu()": lambda m, y: y.relu(),
    "x.relu_()": lambda m, y: y.relu_(),
}
NOT_RELUS = {
    "F.relu6": lambda m, y: F.relu6(y),
    "F.hardtanh": lambda m, y: F.hardtanh(y),
    "torch.sigmoid": lambda m, y: torch.sigmoid(y),
    "nn.LeakyReLU": lambda m, y: m.leaky(y),
}


class Block(nn.Module):
    def __init__(self, act):
        super().__init__()
        self.conv, self.bn = nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4)
        self.act, self.leaky, self.how = nn.ReLU(), nn.LeakyReLU(0.1), act

    def forward(self, x):
        return self.how(self, self.bn(self.conv(x)))


def _patterns(act):
    block = Block(act)
    return find_conv_bn(trace_own_forward(block), block)


@pytest.mark.parametrize("spelling", list(RELUS))
def test_every_spelling_of_relu_fuses(spelling):
    found = _patterns(RELUS[spelling])
    assert [(p.conv, p.bn) for p in found] == [("conv", "bn")]
    assert found[0].relu_node is not None


@pytest.mark.parametrize("spelling", list(NOT_RELUS))
def test_other_activations_do_not_fuse(spelling):
    found = _patterns(NOT_RELUS[spelling])
    assert [(p.conv, p.bn) for p in found] == [("conv", "bn")]
    assert found[0].relu_node is None
