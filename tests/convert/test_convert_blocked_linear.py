"""dal.convert's blocked integer group (export/SPEC.md §5a; dal/convert/blocked_linear.py): a Linear
with a per-group INT4 weight quantizer, read by an integer quantizer, computed as exact per-block
accumulators combined in float64 in ascending block order.

Oracles: tests/blocked_oracle.py (the SPEC formula in Python integers and floats), fed with the
exported file's initializers (codes, scales: written by the exporter, not by dal.convert) and ONNX
QuantizeLinear of the input; dal.npu on that file, element for element, with the same layers as
integer groups on both sides.
"""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import torch
from onnx import numpy_helper
from torch import nn

import blocked_oracle
import dal
import dal.npu
from convert_common import assert_bit_exact
from dal.convert.blocked_linear import BlockedWeights


def test_blocked_weights_equal_the_spec_formula():
    """Nonzero zero points per block, edge codes -8 / 7 and -128 / 127, three blocks."""
    rng = np.random.default_rng(0)
    k, n, block = 96, 5, 32
    codes = rng.integers(-8, 8, (n, k))
    codes[:, 0], codes[:, 1] = -8, 7
    zp = rng.integers(-8, 8, (n, k // block))
    scale = rng.uniform(0.002, 0.05, (n, k // block)).astype(np.float32)
    xq = rng.integers(-128, 128, (4, k))
    xq[0, ::2], xq[0, 1::2] = -128, 127
    bw = BlockedWeights(torch.tensor(codes, dtype=torch.float32), torch.tensor(zp, dtype=torch.int32),
                        torch.tensor(scale), block, 128)
    sx = float(np.float32(0.031))
    got = bw.value(torch.tensor(xq - 3, dtype=torch.float32), sx).numpy()
    want = blocked_oracle.block_values(xq, 3, codes.T, zp.T, scale.T, block, sx)
    np.testing.assert_array_equal(got, want)


def test_blocks_combined_in_ascending_order():
    """The same adversarial sums as tests/npu/test_blocked_groups.py: only ascending order keeps
    2^-40 next to +-889 B."""
    b = 32
    codes = np.zeros((1, 3 * b))
    codes[0, :b], codes[0, b:2 * b], codes[0, 2 * b] = 7, -7, 1
    scale = torch.tensor([[1.0, 1.0, 2.0 ** -40]])
    xi = torch.zeros(1, 3 * b)
    xi[0, :2 * b], xi[0, 2 * b] = 127, 1
    bw = BlockedWeights(torch.tensor(codes, dtype=torch.float32), torch.zeros(()), scale, b, 128)
    assert bw.value(xi, 0.5).tolist() == [[2.0 ** -41]]


@pytest.fixture(scope="module")
def two_linears():
    """Linear(96 -> 48, per-group INT4, read by the next Linear's int8 input quantizer: a blocked
    group) -> Linear(48 -> 16: 48 is no multiple of 32, so per channel; a graph output, float)."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(96, 48, bias=False), nn.Linear(48, 16, bias=False))
    qat = dal.prepare_qat(m, recipe="w4a8_int8_llm", hardware="a2000")
    g = torch.Generator().manual_seed(1)
    dal.calibrate(qat, [torch.randn(8, 96, generator=g) for _ in range(2)])
    proto = dal.export_onnx(qat, (torch.randn(2, 96),), dynamic_batch=True)
    return qat, proto, dal.npu.load(proto, threads=1), dal.convert(qat)


def test_layer_value_equals_the_spec_formula(two_linears):
    qat, proto, sess, im = two_linears
    assert qat[0].weight_quant.granularity.block_size == 32
    inits = {t.name: numpy_helper.to_array(t) for t in proto.graph.initializer}
    dq = {n.output[0]: n for n in proto.graph.node if n.op_type == "DequantizeLinear"}
    mm = next(n for n in proto.graph.node if n.op_type == "MatMul" and dq[n.input[1]].input[0] in inits
              and any(a.name == "block_size" for a in dq[n.input[1]].attribute))
    wd, xd = dq[mm.input[1]], dq[mm.input[0]]
    wq, ws = inits[wd.input[0]], inits[wd.input[1]]
    wz = inits[wd.input[2]] if len(wd.input) > 2 else np.zeros(ws.shape, ml_dtypes.int4)
    qx = next(n for n in proto.graph.node if n.output[0] == xd.input[0])
    sx, zx = inits[qx.input[1]], int(inits[qx.input[2]])
    x = torch.randn(5, 96, generator=torch.Generator().manual_seed(7)) * 3  # some codes saturate
    xq = np.clip(np.rint(x.numpy() / sx) + zx, -128, 127).astype(np.int64)  # ONNX QuantizeLinear
    assert (xq == -128).any() and (xq == 127).any()
    want = blocked_oracle.block_values(xq, zx, wq, wz, ws, 32, sx)
    seen = []
    h = im.net[0].register_forward_hook(lambda mod, i, o: seen.append(o.detach().clone()))
    try:
        im(x)
    finally:
        h.remove()
    np.testing.assert_array_equal(seen[-1].numpy(), want)  # what layer 0 hands its reader
    assert im.layer_forms()["0"] == "integer"


def test_integer_model_equals_npu(two_linears):
    qat, proto, sess, im = two_linears
    batches = [torch.randn(4, 96, generator=torch.Generator().manual_seed(s)) * (1 + s) for s in range(3)]
    assert_bit_exact(im, proto, sess, batches, "blocked linear")
    assert sum(type(s).__name__ == "BlockedStep" for s in sess.steps) == 1


class _ReluBlocked(nn.Module):
    """A per-group INT4 Linear (blocks of 16) with a fused ReLU and its own affine int8 output
    quantizer (a nonzero input zero point), then an int8 head."""

    def __init__(self):
        super().__init__()
        from dal.nn import QLinear
        from export_common import spec
        self.fc = QLinear.from_float(nn.Linear(64, 32, bias=False),
                                     spec("int4", "int8", wg="per_group", gs=16, symmetric=False), "fc",
                                     activation="relu")
        self.head = QLinear.from_float(nn.Linear(32, 10), spec("int8", "int8"), "head")

    def forward(self, x):
        return self.head(self.fc(x))


def test_relu_and_affine_input_equal_npu():
    torch.manual_seed(3)
    m = _ReluBlocked()
    with torch.no_grad():
        for _ in range(2):
            m(torch.randn(6, 64) + 0.5)
    for q in m.modules():
        if isinstance(q, dal.FakeQuantizer):
            q.end_observation("frozen")
    m.eval()
    assert m.fc.input_quant.effective_qparams()[1].item() != 0
    proto = dal.export_onnx(m, (torch.randn(2, 64),), dynamic_batch=True)
    sess = dal.npu.load(proto, threads=1)
    im = dal.convert(m)
    batches = [torch.randn(5, 64, generator=torch.Generator().manual_seed(s)) * 2 for s in range(3)]
    assert_bit_exact(im, proto, sess, batches, "blocked linear with relu")
    assert im.layer_forms()["fc"] == "integer"
    assert sum(type(s).__name__ == "BlockedStep" for s in sess.steps) == 1
