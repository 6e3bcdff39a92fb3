"""dal.cost.shared_groups: which searched layers feed one shared-scale op, read from one dal.capture
record. The expected groups follow from each model's construction: the layers whose output values
reach a concat's inputs through calls a gradient could flow through, with no requantizing module
in between. A model with frozen parameters is grouped as a trainable one is."""
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import dal
from dal.cost.shared_groups import shared_scale_groups

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_search import _Branches  # noqa: E402


def _weighted(model):
    return [n for n, m in model.named_modules() if getattr(m, "weight_quant", None) is not None]


def test_frozen_model_is_grouped():
    """No parameter requires grad (a frozen model): the two branches feeding the cat still form one
    group, as for the trainable model."""
    torch.manual_seed(0)
    x = torch.randn(2, 1, 28, 28)
    net = _Branches().eval()
    for p in net.parameters():
        p.requires_grad_(False)
    q = dal.prepare_qat(net, recipe="pow2_int8", hardware="pow2_int8", example_inputs=(x,))
    for p in q.parameters():
        p.requires_grad_(False)
    assert shared_scale_groups(q, (x,), _weighted(q), ["cat"]) == [["a.0", "b.0"]]
    assert shared_scale_groups(q, (x,), _weighted(q), []) == []


class _Flows(nn.Module):
    """Ten 1x1 convs on one stem; each concat's inputs reach some of them through calls that carry
    data (gather's values, an in-place relu, an identity module) and others only through calls
    that do not (zeros_like, detach, .data, new_zeros, the shape operand of expand_as, an argmax
    index); the last two concats feed an add."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 1)
        self.c = nn.ModuleList(nn.Conv2d(8, 8, 1) for _ in range(10))
        self.idn = nn.Identity()

    def forward(self, x):
        x = self.stem(x)
        a, b, c, d, e, f, g, h, i, j = [m(x) for m in self.c]
        y1 = torch.cat([torch.zeros_like(a), b], 1)                               # b alone
        y2 = torch.cat([d.detach(), c, e.expand_as(f)], 1)                        # c, e
        idx = g.argmax(dim=1, keepdim=True)
        y3 = torch.cat([torch.gather(h, 1, idx).expand_as(i), torch.relu_(i.clone()), self.idn(j)], 1)  # h, i, j
        y4 = torch.cat([b.data, c.new_zeros(c.shape), a], 1)                      # a alone
        y5 = torch.cat([a, d], 1) + torch.cat([f, c], 1)                          # a, d | f, c
        return y1, y2, y3, y4, y5


@pytest.fixture(scope="module")
def flows():
    torch.manual_seed(0)
    x = torch.randn(2, 3, 8, 8)
    q = dal.prepare_qat(_Flows().eval(), recipe="pow2_int8", hardware="pow2_int8", example_inputs=(x,))
    return q, x


CATS = [["c.0", "c.3"], ["c.2", "c.4"], ["c.2", "c.5"], ["c.7", "c.8", "c.9"]]


def test_groups_follow_the_data_a_gradient_would(flows):
    q, x = flows
    assert sorted(shared_scale_groups(q, (x,), _weighted(q), ["cat"])) == CATS


def test_a_requantizing_op_stops_the_walk(flows):
    """Only adds share a scale: the concats feeding the add requantize (their own output
    quantizer), so no searched layer reaches the add; when concats share too, it is walked
    through and the add groups all four layers behind it."""
    q, x = flows
    mods = dict(q.named_modules())
    assert mods["cat_4"].output_quant is not None and mods["add"].op_class == "add"
    assert shared_scale_groups(q, (x,), _weighted(q), ["add"]) == []
    groups = sorted(shared_scale_groups(q, (x,), _weighted(q), ["cat", "add"]))
    assert groups == sorted(CATS + [["c.0", "c.2", "c.3", "c.5"]])


def test_an_unsearched_layer_is_walked_through(flows):
    """c.9 not searched (and without an output quantizer): the walk goes on through it to the stem."""
    q, x = flows
    names = [n for n in _weighted(q) if n != "c.9"]
    assert sorted(shared_scale_groups(q, (x,), names, ["cat"])) == CATS[:3] + [["c.7", "c.8", "stem"]]
