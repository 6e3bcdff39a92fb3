"""dal.convert's blocked linear with a float output (export/SPEC.md §5a; dal/convert/layers.py
``_blocked_float``, dal/convert/blocked_linear.py): a Linear with a per-group INT4 weight whose
output is read by something other than quantizers (a float op and a quantizer, a graph output,
its own float bias Add on rank-3 inputs) computes the blocked group's exact ``v`` as its MatMul's
value, as dal.npu does from the file (``BlockedFloatStep``).

Oracles: tests/blocked_oracle.py (the SPEC formula with Python integers), fed with the exported
file's initializers and ONNX QuantizeLinear of the input; dal.npu on that file, element for element.
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
from dal.convert.blocked_linear import BLOCKED_FLOAT, BlockedWeights


class _Net(nn.Module):
    """fc1 (96 -> 64, per-group INT4) read by a float Mul and the quantized Add; fc3 (64 -> 64, with a
    bias) on rank-3 inputs (MatMul + a float bias Add); fc2 (64 -> 32) a graph output and the
    head's input; fc4 (96 -> 32, a bias) on rank-2 inputs: a Gemm, a float island. The head, the
    recipe's last linear, has int8 per-channel weights."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(96, 64, bias=False)
        self.fc3 = nn.Linear(64, 64)
        self.fc2 = nn.Linear(64, 32, bias=False)
        self.fc4 = nn.Linear(96, 32)
        self.head = nn.Linear(32, 8, bias=False)

    def forward(self, x):
        h = self.fc1(x)
        g = self.fc3(h * 0.5)
        y = self.fc2(g + h)
        return y, self.fc4(x[:, 0]), self.head(y)


@pytest.fixture(scope="module")
def net():
    torch.manual_seed(0)
    qat = dal.prepare_qat(_Net(), recipe="w4a8_int8_llm", hardware="a2000")
    g = torch.Generator().manual_seed(1)
    dal.calibrate(qat, [torch.randn(2, 5, 96, generator=g) for _ in range(2)])
    qat.eval()
    proto = dal.export_onnx(qat, (torch.randn(2, 5, 96),))
    return qat, proto, dal.npu.load(proto, threads=1), dal.convert(qat)


def test_forms_on_both_sides(net):
    qat, proto, sess, im = net
    assert all(getattr(qat, f).weight_quant.granularity.block_size == 32 for f in ("fc1", "fc2", "fc3", "fc4"))
    batches = [torch.randn(2, 5, 96, generator=torch.Generator().manual_seed(s)) * (1 + s) for s in range(3)]
    assert_bit_exact(im, proto, sess, batches, "blocked linear with a float output")
    forms = im.layer_forms()
    assert {k: f for k, f in forms.items() if f == BLOCKED_FLOAT}.keys() == {"fc1", "fc2", "fc3"}, forms
    assert forms["fc4"].startswith("float: per-group weight with a bias"), forms
    assert "fc1: " + BLOCKED_FLOAT in im.summary()
    kinds = {s.node_name: s.kind for s in sess.steps}
    assert [kinds[f"/model/fc{i}/MatMul"] for i in (1, 2, 3)] == ["blocked_float"] * 3, kinds
    assert kinds["/model/fc4/Gemm"] == "node", kinds


def test_values_equal_the_spec_formula(net):
    """fc1's and fc3's outputs (fc3: ``v`` plus the float32 bias) from the file's codes and scales."""
    qat, proto, sess, im = net
    inits = {t.name: numpy_helper.to_array(t) for t in proto.graph.initializer}
    made = {o: n for n in proto.graph.node for o in n.output}
    x = torch.randn(2, 5, 96, generator=torch.Generator().manual_seed(7)) * 3
    seen = {}
    hooks = [getattr(im.net, f).register_forward_hook(lambda mod, i, o, f=f: seen.__setitem__(f, o.detach().clone()))
             for f in ("fc1", "fc3")]
    try:
        im(x)
    finally:
        for h in hooks:
            h.remove()
    _, vals = sess.run({"input": x.numpy()} if "input" in sess.input_names else [x.numpy()], return_intermediates=True)
    for f in ("fc1", "fc3"):
        mm = next(n for n in proto.graph.node if n.name == f"/model/{f}/MatMul")
        xdq, wdq = made[mm.input[0]], made[mm.input[1]]
        wq, ws = inits[wdq.input[0]], inits[wdq.input[1]]
        wz = inits[wdq.input[2]] if len(wdq.input) > 2 else np.zeros(ws.shape, ml_dtypes.int4)
        xq = vals[xdq.input[0]].reshape(-1, wq.shape[0])
        v = blocked_oracle.block_values(xq, int(inits[xdq.input[2]]), wq, wz, ws, 32, inits[xdq.input[1]])
        want = v if f == "fc1" else v + qat.fc3.bias.detach().numpy()
        np.testing.assert_array_equal(seen[f].reshape(want.shape).numpy(), want, err_msg=f)


def test_exact_matmul_and_blocks_agree():
    """Both ways BlockedWeights computes ``v``: one float64 matmul with the pre-scaled weight (trained-
    like scales: ``w_exact`` kept) and the blocks combined in ascending order (one block's scales
    2^-30 of the others: ``w_exact`` None), each equal to the SPEC formula."""
    rng = np.random.default_rng(2)
    k, n, block = 96, 7, 32
    codes = rng.integers(-8, 8, (n, k))
    zp = rng.integers(-8, 8, (n, k // block))
    xq = rng.integers(-128, 128, (5, k))
    for spread in (False, True):
        scale = rng.uniform(0.002, 0.05, (n, k // block)).astype(np.float32)
        if spread:
            scale[:, 1] *= np.float32(2.0 ** -30)
        bw = BlockedWeights(torch.tensor(codes, dtype=torch.float32), torch.tensor(zp, dtype=torch.int32),
                            torch.tensor(scale), block, 128)
        assert (bw.w_exact is None) == spread
        got = bw.value(torch.tensor(xq + 2, dtype=torch.float32)[None], float(np.float32(0.021)))
        want = blocked_oracle.block_values(xq, -2, codes.T, zp.T, scale.T, block, np.float32(0.021))
        np.testing.assert_array_equal(got[0].numpy(), want)
