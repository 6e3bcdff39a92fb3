"""torch.cat, torch.concat and torch.concatenate (one op of dal.ops: cat), with the dimension given
positionally, as ``dim`` or as ``axis``, are one QCat along that dimension, in a forward torch.fx
traces and in one it cannot (captured by call site); with its quantizers off the prepared model
computes torch's float concatenation of the float branches, bit for bit."""
import copy

import pytest
import torch
from torch import nn

import dal
from dal.nn import QCat

SPELLINGS = [(torch.cat, None), (torch.cat, "axis"), (torch.concat, "dim"), (torch.concatenate, "axis"),
             (torch.concatenate, None)]


class TwoBranch(nn.Module):
    """Two convolutions of different widths joined along the channels (dim 1): along any other
    dimension torch refuses the shapes."""

    def __init__(self, cat, keyword, traceable):
        super().__init__()
        self.a, self.b = nn.Conv2d(3, 4, 1), nn.Conv2d(3, 2, 1)
        self.cat, self.keyword, self.traceable = cat, keyword, traceable

    def forward(self, x):
        if not self.traceable and x.shape[-1] > 1:  # Python control flow on a shape: torch.fx cannot trace it
            x = x * 1.0
        ys = [self.a(x), self.b(x)]
        return self.cat(ys, 1) if self.keyword is None else self.cat(ys, **{self.keyword: 1})


@pytest.mark.parametrize("traceable", [True, False], ids=["traced", "call_site"])
@pytest.mark.parametrize("cat, keyword", SPELLINGS, ids=lambda v: getattr(v, "__name__", str(v)))
def test_every_spelling_of_cat_is_a_qcat_along_its_dimension(cat, keyword, traceable):
    x = torch.randn(2, 3, 5, 5, generator=torch.Generator().manual_seed(0))
    model = TwoBranch(cat, keyword, traceable)
    float_model = copy.deepcopy(model)
    q = dal.prepare_qat(model, recipe="int8_balanced", hardware="a2000", example_inputs=(x,))
    cats = [m for m in q.modules() if isinstance(m, QCat)]
    assert len(cats) == 1 and cats[0].dim == 1 and cats[0].arity == 2, cats
    q.eval()
    with torch.no_grad(), dal.quantizer_states(q, "off"):
        got = q(x)
    with torch.no_grad():
        want = torch.cat([float_model.a(x), float_model.b(x)], dim=1)
    assert torch.equal(got, want)
