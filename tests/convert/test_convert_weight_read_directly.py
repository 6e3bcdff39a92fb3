"""A float layer whose parent reads its weight and computes with it itself (torchvision's
ShiftedWindowAttention: ``F.linear(x, self.qkv.weight, ...)``) never calls the layer, so
dal.convert cannot compute it as the NPU's float island: a ConvertError naming the layer, and
dal.verify's integer row says so, where it used to stop on an AttributeError deep in the parent."""
import pytest
import torch

import dal
from dal.convert import ConvertError
from export_common import prepared
from parent_reads_weight import ReadsWeight


@pytest.mark.parametrize("hardware", ["a2000", "generic_int8"])
def test_a_weight_read_by_the_parent_is_named(hardware):
    torch.manual_seed(0)
    x = torch.randn(4, 8)
    qat = prepared(ReadsWeight(), x, "int8_balanced", hardware)
    row = next(r for r in dal.prepared(qat).report.rows if r.name == "fc")
    assert row.status == "float" and "never runs" in row.detail  # prepare said so too
    with pytest.raises(ConvertError, match=r"^fc: its parent reads its 'weight' and computes the layer itself"):
        dal.convert(qat)(x)
    report = dal.verify(dal.export_onnx(qat, (x,)), qat, (x,), onnxruntime=False)
    assert not report.integer.identical and "fc: its parent reads its 'weight'" in str(report.integer)
