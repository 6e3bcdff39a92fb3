"""Functional ``F.gelu``, ``F.softmax`` and ``F.layer_norm`` calls (not modules) in the integer model:
computed as their exported nodes (dal/convert/float_ops.py), so the integer model equals dal.npu
on every element; with torch's own float32 kernels instead it does not."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import dal
from convert_common import build, compare, random_batches
from dal.convert import float_ops

torch.set_num_threads(1)
SHAPE = (4, 6, 16)


class TokenNet(nn.Module):
    """Linear -> F.gelu -> Linear -> F.layer_norm (own affine) -> F.softmax -> Linear, rank 3; the
    softmax is also an output, in float (no quantizer after it): compared value for value."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2, self.fc3 = nn.Linear(16, 64), nn.Linear(64, 32), nn.Linear(32, 8)
        self.ln_w, self.ln_b = nn.Parameter(1 + 0.3 * torch.randn(32)), nn.Parameter(0.2 * torch.randn(32))

    def forward(self, x):
        y = self.fc2(F.gelu(self.fc1(x)))
        p = F.softmax(4 * F.layer_norm(y, (32,), self.ln_w, self.ln_b, 1e-5), dim=-1)
        return self.fc3(p), p


@pytest.mark.parametrize("hardware", ["a2000", "generic_int8"])
def test_functional_forms_bit_exact(hardware):
    """On the a2000 the GELU and softmax calls are FP16 islands (Fp16Function around the call);
    on generic_int8 (compute fp32) they are plain float32 calls. Both routed, both bit-exact."""
    torch.manual_seed(0)
    qat, proto, sess = build(TokenNet(), torch.randn(SHAPE) * 2, hardware)
    ops = {n.op_type for n in proto.graph.node}
    assert {"Erf", "Softmax"} <= ops and ("LayerNormalization" in ops or "ReduceMean" in ops), ops
    im = dal.convert(qat)
    batches = random_batches(SHAPE, n=3, seed=21, scale=2.0)
    for x in batches:
        r = compare(im, proto, sess, x)
        assert r["out_diff"] == 0 and r["code_diff"] == 0 and not r["unmatched"], r
    # the routing is what makes them agree: torch's float32 kernels for the three calls differ
    keep = float_ops._opset_impl
    float_ops._opset_impl = lambda opset: {}
    try:
        plain = dal.convert(qat)
        assert sum(compare(plain, proto, sess, x)["out_diff"] for x in batches) > 0
    finally:
        float_ops._opset_impl = keep
