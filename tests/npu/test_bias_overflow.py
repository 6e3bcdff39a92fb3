"""Accumulator plus int32 bias at the edge of int32, on every kernel variant this CPU runs.

The shape is the one of SSDlite's ``features.0.10/block/block.2/block.2.0/Conv`` where the
overflow was reported (1x1, 184 input channels, uint8 codes with zero point 130, so the VNNI
path subtracts a zero-point correction), with 84 output channels (a partial last panel) and 25
pixels (a partial 6-pixel tile); and the same reduction as a Gemm. Exact accumulators come from
numpy int64. Bias codes set to exactly 2^31-1 - max acc (even channels) and -2^31 - min acc
(odd channels) must run and give onnxruntime's codes; one code further on two channels (5 down,
82 up, in the last panel) must be refused with the node, the channels, the outputs hit and the
numbers, counted here independently.
"""
from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper

import graphs
from oracles import run_ort

CIN, COUT, HW, M, ZX = 184, 84, 5, 25, 130
SX = np.float32(2.0 ** -6)  # power of two: x = (q - ZX) * SX quantizes back to q exactly
BUMPED = {5: -1, 82: +1}  # odd channels sit at the low edge, even ones at the high edge


def _case(op: str):
    """(input codes, weights minus zero point [O, K], weight scales) of a fixed draw."""
    rng = np.random.default_rng(7)
    shape = (1, CIN, HW, HW) if op == "Conv" else (M, CIN)
    q = rng.integers(0, 256, size=shape).astype(np.uint8)
    w = rng.integers(-127, 128, size=(COUT, CIN)).astype(np.int8)
    sw = rng.uniform(0.001, 0.02, size=COUT).astype(np.float32)
    return q, w, sw


def _acc(op, q, w):
    """Exact accumulators [O, pixels] in int64."""
    d = q.astype(np.int64) - ZX
    rows = d[0].reshape(CIN, -1) if op == "Conv" else d.T
    return w.astype(np.int64) @ rows


def _edge_bias(acc, bump):
    b = np.where(np.arange(COUT) % 2 == 0, 2**31 - 1 - acc.max(1), -2**31 - acc.min(1))
    for o, s in bump.items():
        b[o] += s
    assert b.min() >= -2**31 and b.max() <= 2**31 - 1, "the draw needs max acc >= 0 >= min acc"
    return b.astype(np.int32)


def _model(op, w, sw, bias):
    b = graphs.Builder(0, "u8")
    shape = [1, CIN, HW, HW] if op == "Conv" else [M, CIN]
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)
    sxi, zxi = b.init(SX, "s"), b.init(np.array(ZX, dtype=np.uint8), "z")  # zero point 130, not graphs' 128
    dx = b.node("DequantizeLinear", [b.node("QuantizeLinear", ["x", sxi, zxi]), sxi, zxi])
    wq = w.reshape(COUT, CIN, 1, 1) if op == "Conv" else w
    dw = b.node("DequantizeLinear", [b.init(wq, "w"), b.init(sw, "ws"), b.init(np.zeros(COUT, np.int8), "wz")], axis=0)
    bs = (SX * sw).astype(np.float32)
    db = b.node("DequantizeLinear", [b.init(bias, "b"), b.init(bs, "bs"), b.init(np.zeros(COUT, np.int32), "bz")], axis=0)
    if op == "Conv":
        y = b.node("Conv", [dx, dw, db], kernel_shape=[1, 1], pads=[0, 0, 0, 0])
    else:
        y = b.node("Gemm", [dx, dw, db], transB=1)
    y, _ = b.qdq(y, scale=np.float32(0.05))
    m = b.model([x], y)
    return m, next(n.name for n in m.graph.node if n.op_type == op)


def _feed(q):
    return {"x": ((q.astype(np.float32) - ZX) * SX).astype(np.float32)}


def _variants():
    import dal.npu as npu
    return npu.info()["supported"]


@pytest.mark.parametrize("op", ["Conv", "Gemm"])
def test_bias_at_the_int32_edge_runs_on_every_variant(npu_lib, op):
    import dal.npu as npu
    q, w, sw = _case(op)
    model, _ = _model(op, w, sw, _edge_bias(_acc(op, q, w), {}))
    want = run_ort(model, _feed(q))[0]
    for kernel in _variants():
        got = npu.load(model, kernel=kernel, threads=1).run(_feed(q))[0]
        assert np.array_equal(got, want), kernel


@pytest.mark.parametrize("op", ["Conv", "Gemm"])
def test_one_code_past_the_edge_is_refused_with_its_numbers(npu_lib, op):
    import dal.npu as npu
    q, w, sw = _case(op)
    acc = _acc(op, q, w)
    bias = _edge_bias(acc, BUMPED)
    total = acc + bias.astype(np.int64)[:, None]
    hit = int(((total > 2**31 - 1) | (total < -2**31)).sum())
    assert hit == int((acc[5] == acc[5].min()).sum() + (acc[82] == acc[82].max()).sum())
    model, name = _model(op, w, sw, bias)
    o, p = 5, int(np.argmin(acc[5]))  # both miss by exactly one: the first channel is the one shown
    for kernel in _variants():
        sess = npu.load(model, kernel=kernel, threads=1)
        with pytest.raises(npu.NPUError) as err:
            sess.run(_feed(q))
        msg = str(err.value)
        assert f"node {name!r}" in msg and f"overflows int32 at {hit} of {acc.size} outputs" in msg, (kernel, msg)
        assert "(channels 5, 82)" in msg, (kernel, msg)
        assert f"channel {o}: acc {int(acc[o, p])} + bias code {int(bias[o])} = {int(total[o, p])}" in msg, (kernel, msg)
        assert f"bias scale s_x*s_w = {float(SX) * float(sw[o]):.3g}" in msg, (kernel, msg)
