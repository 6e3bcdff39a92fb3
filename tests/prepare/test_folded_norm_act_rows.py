"""A timm BatchNormAct2d whose BN prepare folds (or quantizes whole) leaves no float batchnorm row.

Its forward does not trace with torch.fx, so the call-site capture listed its ``F.batch_norm``
as a float op ("float batchnorm, the hardware cannot run it") although the BN was folded into
the conv before it: on the int8-only a1000 that refused plain conv-BN-ReLU networks (timm
resnet18 with BatchNormAct2d: 44 problems). The folded BN's forward is replaced (ActAfterFold runs
drop + act only; NormActAffine is the QBatchNorm2d), so its batch_norm is no op of the model.
"""
import pytest
import torch
from torch import nn

import dal

timm = pytest.importorskip("timm")
from timm.layers import BatchNormAct2d  # noqa: E402


def _rows(model, x, hardware):
    q = dal.prepare_qat(model.eval(), recipe="int8_balanced", hardware=hardware, example_inputs=(x,))
    return q, dal.prepared(q).report.rows


def _batchnorm_rows(rows):
    return [r for r in rows if "batch_norm" in r.name or "batchnorm" in r.name or r.type_name == "batch_norm"]


def test_resnet18_with_batchnormact_prepares_on_the_int8_only_a1000():
    torch.manual_seed(0)
    model = timm.create_model("resnet18", pretrained=False, norm_layer=BatchNormAct2d)
    x = torch.randn(1, 3, 64, 64)
    q, rows = _rows(model, x, "a1000")  # raised "invalid recipe ... 44 problems" before
    assert not _batchnorm_rows(rows)
    assert sum(r.type_name == "QConvBn2d" for r in rows) == 20  # every BN folded, reported as fused
    assert all(r.status != "float" or r.op_class == "pool" for r in rows), [r for r in rows if r.status == "float"]


def test_efficientnet_b0_folded_bns_are_not_float_rows():
    torch.manual_seed(0)
    x = torch.randn(1, 3, 64, 64)
    q, rows = _rows(timm.create_model("efficientnet_b0", pretrained=False), x, "a2000")
    assert not _batchnorm_rows(rows)
    fused = [r for r in rows if r.type_name == "QConvBn2d"]
    assert len(fused) == sum(isinstance(m, BatchNormAct2d) for m in timm.create_model("efficientnet_b0").modules())


class CatThenNorm(nn.Module):
    """A BatchNormAct2d after a Concat: no conv folds it; it is quantized whole (NormActAffine)."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Conv2d(3, 4, 1), nn.Conv2d(3, 4, 1)
        self.norm = BatchNormAct2d(8)
        self.head = nn.Conv2d(8, 4, 1)

    def forward(self, x):
        return self.head(self.norm(torch.cat([self.a(x), self.b(x)], 1)))


def test_a_norm_act_quantized_whole_has_no_float_batchnorm_row():
    torch.manual_seed(0)
    q, rows = _rows(CatThenNorm(), torch.randn(2, 3, 8, 8), "a1000")
    assert not _batchnorm_rows(rows)
    assert any(r.name == "norm" and r.status == "quantized" for r in rows)
