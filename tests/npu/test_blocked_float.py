"""export/SPEC.md §5a's blocked linear with a float output in dal.npu (dal/npu/blocked_groups.py,
``BlockedFloatStep``): a blocked INT4 MatMul of per-tensor input codes whose output is read by
anything (a graph output, a float bias Add, several readers) is the blocked group's exact ``v``.

Oracles: tests/blocked_oracle.py (the SPEC formula with Python integers and floats), onnxruntime
with ORT_DISABLE_ALL (dequantize in float32, a float32 MatMul in its own order: within the float32
accumulation-error bound of ``v``, and the next quantizer's codes within one LSB).
"""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

import blocked_oracle
from oracles import run_ort
from test_blocked_groups import CASES, _T, _inputs, _weights


def _model(x_dt, zx, sx, wq, ws, wz, block, sy, bias=None):
    """xq -> DQ -> MatMul(., DQ(wq blocked along axis 0)) = "mm", a graph output, also read by
    [Add(bias) ->] QuantizeLinear(sy, zero point 1, int8) -> "y" (a second reader of "mm", or of
    the bias Add)."""
    mk = helper.make_node
    inits = [numpy_helper.from_array(np.float32(sx), "sx"), numpy_helper.from_array(np.array(zx, x_dt), "zx"),
             numpy_helper.from_array(wq, "wq"), numpy_helper.from_array(ws, "ws"), numpy_helper.from_array(wz, "wz"),
             numpy_helper.from_array(np.float32(sy), "sy"), numpy_helper.from_array(np.int8(1), "zy")]
    nodes = [mk("DequantizeLinear", ["xq", "sx", "zx"], ["x"], name="x_dq"),
             mk("DequantizeLinear", ["wq", "ws", "wz"], ["w"], name="w_dq", axis=0, block_size=block),
             mk("MatMul", ["x", "w"], ["mm"], name="matmul")]
    last = "mm"
    if bias is not None:
        inits.append(numpy_helper.from_array(bias, "b"))
        nodes.append(mk("Add", ["b", "mm"], ["mm_b"], name="bias_add"))
        last = "mm_b"
    nodes.append(mk("QuantizeLinear", [last, "sy", "zy"], ["y"], name="q"))
    outs = [helper.make_tensor_value_info("mm", TensorProto.FLOAT, None),
            helper.make_tensor_value_info("y", TensorProto.INT8, None)]
    g = helper.make_graph(nodes, "blocked_float", [helper.make_tensor_value_info("xq", _T[np.dtype(x_dt)], None)],
                          outs, inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)])
    m.ir_version = 10
    return m


def _kinds(m, **kw):
    import dal.npu as npu
    s = npu.load(m, threads=1, **kw)
    return s, {st.node_name: st.kind for st in s.steps}


def _ort_bound(xq, zx, sx, wq, wz, ws, block):
    """The float32 error bound of onnxruntime's dequantize-then-MatMul against the exact sum:
    (K + 4) 2^-24 sum_k |x_k w_k| per output (two dequantize roundings, the product, K - 1
    additions; first order, with the last float32 rounding of ``v``)."""
    k = xq.shape[1]
    blk = np.arange(k) // block
    xd = np.abs((xq.astype(np.float64) - zx) * np.float64(sx))
    wd = np.abs((wq.astype(np.float64) - wz.astype(np.float64)[blk]) * ws.astype(np.float64)[blk])
    return (k + 4) * 2.0 ** -24 * (xd @ wd) * (1 + 1e-6)


@pytest.mark.parametrize("rows,spread", [(1, False), (5, False), (5, True)])
@pytest.mark.parametrize("x_dt,zx,w_dt,k,n,block", CASES)
def test_float_output_equals_the_spec_formula(x_dt, zx, w_dt, k, n, block, rows, spread, npu_lib):
    """The MatMul's output (a graph output and a quantizer's input) is the SPEC's ``v`` exactly,
    by both ways dal.npu computes it (one exact float64 matmul; the float32 blocks where one block's
    scales are 2^-30 of the others), and the quantizer reading it rounds that ``v``."""
    rng = np.random.default_rng(k * 11 + n)
    wq, ws, wz = _weights(rng, k, n, block, w_dt)
    if spread:
        ws[1] *= np.float32(2.0 ** -30)
    xq = _inputs(rng, rows, k, x_dt)
    sx = np.float32(0.029)
    v = blocked_oracle.block_values(xq, zx, wq, wz, ws, block, sx)
    sy = np.float32(np.abs(v).max() / 100)
    s, kinds = _kinds(_model(x_dt, zx, sx, wq, ws, wz, block, sy))
    assert kinds["matmul"] == "blocked_float"
    assert next(st for st in s.steps if st.node_name == "matmul").w_exact is None if spread else True
    mm, y = s.run({"xq": xq})
    assert mm.dtype == np.float32
    np.testing.assert_array_equal(mm, v)
    np.testing.assert_array_equal(y.astype(np.int64), blocked_oracle.codes(v, sy, 1, -128, 127))


def test_onnxruntime_within_float32_bound(npu_lib):
    """onnxruntime (ORT_DISABLE_ALL) on the same file: its MatMul output within the float32
    accumulation-error bound of ``v``, its codes within one LSB (a near tie apart), on the tiny
    Llama's shape (K 256, blocks of 32)."""
    rng = np.random.default_rng(21)
    k, n, block = 256, 64, 32
    wq, ws, wz = _weights(rng, k, n, block, ml_dtypes.int4)
    xq = _inputs(rng, 16, k, np.int8)
    sx = np.float32(0.013)
    v = blocked_oracle.block_values(xq[:3], -2, wq, wz, ws, block, sx)
    sy = np.float32(np.abs(v).max() / 90)
    m = _model(np.int8, -2, sx, wq, ws, wz, block, sy)
    s, kinds = _kinds(m)
    assert kinds["matmul"] == "blocked_float"
    mm, y = s.run({"xq": xq})
    np.testing.assert_array_equal(mm[:3], v)
    o_mm, o_y = run_ort(m, {"xq": xq})
    bound = _ort_bound(xq, -2, sx, wq, wz, ws, block)
    assert np.all(np.abs(mm.astype(np.float64) - o_mm.astype(np.float64)) <= bound)
    assert np.abs(y.astype(np.int64) - o_y.astype(np.int64)).max() <= 1


def test_bias_add_reads_v(npu_lib):
    """A float bias Add after the MatMul (torch's Linear on rank > 2 inputs with a per-group
    weight: the bias stays float) reads ``v``: one float32 addition, then the quantizer."""
    rng = np.random.default_rng(8)
    k, n, block = 64, 6, 16
    wq, ws, wz = _weights(rng, k, n, block, ml_dtypes.int4)
    xq = _inputs(rng, 3, k, np.int8)
    b = rng.standard_normal(n).astype(np.float32)
    v = blocked_oracle.block_values(xq, 0, wq, wz, ws, block, np.float32(0.02))
    sy = np.float32(np.abs(v).max() / 50)
    s, kinds = _kinds(_model(np.int8, 0, np.float32(0.02), wq, ws, wz, block, sy, bias=b))
    assert kinds["matmul"] == "blocked_float" and kinds["bias_add"] == "node"
    mm, y = s.run({"xq": xq})
    np.testing.assert_array_equal(mm, v)
    np.testing.assert_array_equal(y.astype(np.int64), blocked_oracle.codes(b + v, sy, 1, -128, 127))


@pytest.mark.parametrize("what", ["uint16_x", "fixed_point", "bound", "per_channel"])
def test_not_this_form(what, npu_lib):
    """16-bit input codes, a fixed-point requantizer, a block bound at or above 2^29 (int8 codes,
    one block of 40000 declared channels: 40000 * 128 * 127 > 2^29), a per-channel (non-blocked)
    weight: the MatMul stays a float-island node step (§5a), within one LSB of onnxruntime."""
    rng = np.random.default_rng(4)
    k, n, block = 40, 4, 20
    x_dt, zx, w_dt = np.int8, 0, ml_dtypes.int4
    if what == "bound":
        w_dt, block = np.int8, 40000
    wq, ws, wz = _weights(rng, k, n, block, w_dt)
    if what == "uint16_x":
        x_dt, zx = np.uint16, 30000
    xq = rng.integers(0, 100, (3, k)).astype(x_dt)
    m = _model(x_dt, zx, np.float32(0.01), wq, ws, wz, block, np.float32(0.05))
    if what == "per_channel":
        dq = next(nd for nd in m.graph.node if nd.name == "w_dq")
        dq.attribute.remove(next(a for a in dq.attribute if a.name == "block_size"))
        dq.attribute.remove(next(a for a in dq.attribute if a.name == "axis"))
        dq.attribute.append(helper.make_attribute("axis", 1))
        for name, arr in (("ws", ws[0]), ("wz", wz[0])):
            t = next(t for t in m.graph.initializer if t.name == name)
            t.CopyFrom(numpy_helper.from_array(arr, name))
    if what == "fixed_point":
        helper.set_model_props(m, {"dal.requantizer": '{"kind": "fixed_point", "multiplier_bits": 16}'})
    s, kinds = _kinds(m)
    assert kinds["matmul"] == "node"
    got, want = s.run({"xq": xq})[1], run_ort(m, {"xq": xq})[1]
    assert np.abs(got.astype(np.int64) - want.astype(np.int64)).max() <= 1


def test_fuzz_base_model(npu_lib):
    """The fuzzer's base model for the form (tests/npu/fuzz_decoder.py: int8 codes with a zero
    point, a short last block, the MatMul a graph output and read by a float bias Add): one
    BlockedFloatStep, ``v`` equal to the SPEC formula on the codes of the file's own
    QuantizeLinear, within the float32 bound of onnxruntime; the quantizer after the Add within
    one LSB. A zero or negative weight scale is refused, naming the DequantizeLinear's scale."""
    import dal.npu as npu
    import fuzz_decoder
    m = fuzz_decoder.blocked_float_model()
    s, kinds = _kinds(m)
    assert kinds["matmul"] == "blocked_float"
    x = np.random.default_rng(4).standard_normal((4, 32)).astype(np.float32) * 3
    inits = {t.name: numpy_helper.to_array(t) for t in m.graph.initializer}
    xq = np.clip(np.rint(x / inits["s_x"]) - 7, -128, 127)  # ONNX QuantizeLinear, zero point -7
    v = blocked_oracle.block_values(xq, -7, inits["w_codes"], inits["w_zp"], inits["w_scale"], 12, inits["s_x"])
    (mm, out), (o_mm, o_out) = s.run({"x": x}), run_ort(m, {"x": x})
    np.testing.assert_array_equal(mm, v)
    bound = _ort_bound(xq, -7, inits["s_x"], inits["w_codes"], inits["w_zp"], inits["w_scale"], 12)
    assert np.all(np.abs(mm.astype(np.float64) - o_mm) <= bound)
    assert np.abs(out - o_out).max() <= inits["s_y"] * 1.0001
    for bad in (0.0, -0.02):
        mb = fuzz_decoder.blocked_float_model()
        t = next(t for t in mb.graph.initializer if t.name == "w_scale")
        a = numpy_helper.to_array(t).copy()
        a[2, 5] = bad
        t.CopyFrom(numpy_helper.from_array(a, "w_scale"))
        with pytest.raises(npu.NPUError, match="w_dq.*w_scale|w_scale.*w_dq"):
            npu.load(mb).run({"x": x})
