"""Modules planned whole by what they compute (dal.prepare.whole_modules): a formula activation
is one float activation (an FP16 island on the a2000, refused by its path on the a1000); an
activation written as one torch call is read as before."""
import math

import pytest
import torch
from torch import nn

import dal
from dal.recipe import RecipeError


class FormulaGelu(nn.Module):
    """GELU's tanh approximation written out (as transformers' NewGELUActivation)."""

    def forward(self, x):
        return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


class FormulaSwish(nn.Module):
    def forward(self, x):
        return x * torch.sigmoid(x)


class OneCallGelu(nn.Module):
    def forward(self, x):
        return nn.functional.gelu(x)


class Mlp(nn.Module):
    def __init__(self, act):
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(16, 32), act, nn.Linear(32, 16)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


@pytest.mark.parametrize("act,fn", [(FormulaGelu(), "gelu"), (FormulaSwish(), "silu")])
def test_formula_activation_is_one_island(act, fn):
    p = dal.prepare_qat(Mlp(act), recipe="int8_balanced", hardware="a2000")
    rows = {r.name: r for r in dal.prepared(p).report.rows}
    assert rows["act"].status == "fp16" and not any(n.startswith("act.") for n in rows)
    assert type(p.act).__name__ == f"Fp16{type(act).__name__}"
    x = torch.randn(4, 16)
    dal.calibrate(p, [x], progress=False)
    with dal.quantizer_states(p.act, "off"):
        torch.testing.assert_close(p.act(x), act(x))
    with pytest.raises(RecipeError, match=f"act \\({type(act).__name__}\\): the export would hold a float {fn}"):
        dal.prepare_qat(Mlp(type(act)()), recipe="int8_balanced", hardware="a1000")


def test_one_call_activation_read_as_before():
    p = dal.prepare_qat(Mlp(OneCallGelu()), recipe="int8_balanced", hardware="a2000")
    rows = {r.name: r for r in dal.prepared(p).report.rows}
    assert "act" not in rows and rows["act.gelu"].status == "fp16"
