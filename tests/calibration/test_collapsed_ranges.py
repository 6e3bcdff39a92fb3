"""calibrate warns, naming the quantizers, when an activation's eval-mode range collapses (a
random-init network's BatchNorm statistics do this: SSDlite's head inputs came out at 1e-29),
and stays quiet for a model whose activations do not."""
import warnings

import pytest
import torch
from torch import nn

import dal


class Collapsing(nn.Module):
    """conv -> BN whose running variance makes its eval-mode output ~1e-12 of its input -> conv."""

    def __init__(self):
        super().__init__()
        self.c1, self.bn, self.c2 = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.Conv2d(8, 8, 3, padding=1)
        self.c3 = nn.Conv2d(8, 4, 1)
        with torch.no_grad():
            self.bn.running_var.fill_(1e24)

    def forward(self, x):
        return self.c3(torch.relu(self.c2(torch.relu(self.bn(self.c1(x))))))


def _calibrate(model):
    torch.manual_seed(0)
    x = torch.randn(4, 3, 16, 16)
    q = dal.prepare_qat(model, recipe="int8_balanced", hardware="a2000", example_inputs=(x,))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dal.calibrate(q, [x], progress=False)
    return [str(w.message) for w in caught if "activation quantizer" in str(w.message)]


def test_a_collapsed_activation_range_is_named():
    torch.manual_seed(0)
    msgs = _calibrate(Collapsing())
    assert len(msgs) == 1, msgs
    # c2's input (after the collapsed BN) is named; c3's is not (c2's bias restores its range),
    # nor the model's input
    assert "c2.input_quant" in msgs[0] and "c3." not in msgs[0] and "c1." not in msgs[0], msgs[0]
    assert "BatchNorm statistics" in msgs[0]


def test_no_warning_when_the_statistics_describe_the_data():
    torch.manual_seed(0)
    model = Collapsing()
    with torch.no_grad():
        model.bn.running_var.fill_(1.0)
    assert _calibrate(model) == []


@pytest.mark.parametrize("ratio", [1e-3, 1e-9])
def test_the_threshold_is_relative_to_the_median(ratio):
    from dal.calibration.observe import COLLAPSE_RATIO
    torch.manual_seed(0)
    model = Collapsing()
    # variance v scales the BN output by 1/sqrt(v): ratio 1e-3 -> v 1e6 (not collapsed), 1e-9 -> v 1e18
    with torch.no_grad():
        model.bn.running_var.fill_(ratio ** -2)
    assert bool(_calibrate(model)) == (ratio < COLLAPSE_RATIO)
