"""timm models whose activations are not all 4-D run through the whole flow (prepare on a2000,
calibrate, export, dal.npu, dal.verify): LeViT (rank-3 token tensors between its stem convs
and head) and EfficientFormerV2 (convs and rank-3 attention). dal.npu's layout planning
refused both ("codes of rank 3 where the graph's convolutions need rank 4", layout.py).

Criteria: the integer model (dal.convert, derived from the trained model) equals dal.npu (derived
from the file) on every output element and every quantized tensor, with the same integer
groups (tests/convert/convert_common.py); dal.verify's integer row says IDENTICAL; layer by layer
(each layer from onnxruntime's or torch's quantized inputs) no code differs by more than 1 LSB.
Random weights at 64x64, no download.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "convert"))

MODELS = ["levit_128s", "efficientformerv2_s0"]


@pytest.mark.slow
@pytest.mark.parametrize("name", MODELS)
def test_token_model_integer_equals_npu(name, npu_lib):
    timm = pytest.importorskip("timm")
    import dal
    from convert_common import assert_bit_exact, build, npu_fused_groups, random_batches
    torch.manual_seed(0)
    model = timm.create_model(name, pretrained=False, img_size=64).eval()
    x = torch.randn(2, 3, 64, 64)
    qat, proto, sess = build(model, x, "a2000")
    assert npu_fused_groups(sess) > 0
    im = dal.convert(qat)
    assert_bit_exact(im, proto, sess, random_batches((2, 3, 64, 64), n=1), name)
    report = dal.verify(proto, qat, (x,))
    assert report.integer is not None and report.integer.identical, str(report.integer)
    differ, compared, max_lsb = report.layer_by_layer()
    assert compared > 0 and max_lsb <= 1, (differ, compared, max_lsb)
