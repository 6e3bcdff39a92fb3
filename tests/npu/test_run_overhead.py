"""The per-run shortcuts of Session.run (arguments built once at load or on the first run):
the cached fused-conv call (conv_call.py), the once-looked-up code-table and quantizer kernels
and the scalar DequantizeLinear step (quant_step.DequantStep). Each gives the same bits as the
path it short-cuts, and that path agrees with the oracles."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

import graphs
import oracles


def _free_batch(m):
    m = onnx.ModelProto.FromString(m.SerializeToString())
    m.graph.input[0].type.tensor_type.shape.dim[0].dim_param = "N"
    return m


@pytest.mark.parametrize("threads", [1, 2])
def test_cached_conv_call_matches_uncached_path_and_ort(threads):
    import dal.npu as npu
    from dal.npu.integer_groups import FusedStep
    m = _free_batch(graphs.conv_model(seed=3, cin=16, cout=24, hw=10))
    s = npu.load(m, threads=threads)
    rng = np.random.default_rng(0)
    conv = [st for st in s.steps if isinstance(st, FusedStep) and st.op == "Conv"]
    assert conv and conv[0].fast
    for n in (1, 3, 1, 2):  # new shapes after cached ones: one cached call per shape
        x = {"x": rng.standard_normal((n, 16, 10, 10)).astype(np.float32)}
        got = s.run(x)[0]
        assert any(k[0][0] == n for k in conv[0].conv_calls), "the cached call did not run"
        # return_intermediates takes the uncached _run_fast path of the same kernel
        ref = s.run(x, return_intermediates=True)[0][0]
        assert got.dtype == ref.dtype and np.array_equal(got, ref)
        assert np.array_equal(got, s.run(x)[0])  # the second run of a cached shape
        o = oracles.run_ort(m, x)[0]
        d = oracles.lsb_diff(got, o, oracles.output_scale(m))
        assert np.abs(d).max() <= 1


def test_cached_conv_call_refuses_other_codes():
    """Codes of another type than the zero point's: the plain path's named error, not a call."""
    import dal.npu as npu
    from dal.npu.conv_call import conv_codes
    from dal.npu.integer_groups import FusedStep
    s = npu.load(graphs.conv_model(seed=1, cin=8, cout=16, hw=6), threads=1)
    st = next(t for t in s.steps if isinstance(t, FusedStep))
    assert conv_codes(st, np.zeros((1, 8, 6, 6), np.int8), 1, 0) is None
    with pytest.raises(npu.NPUError, match="input codes are int8"):
        st.run([np.zeros((1, 8, 6, 6), np.int8)], 1)


def _dq_model(dtype, scale, zp, shape=(2, 3, 5)):
    tp = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    x = helper.make_tensor_value_info("x", tp, list(shape))
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    inits = [helper.make_tensor("s", TensorProto.FLOAT, [], [scale]),
             helper.make_tensor("z", tp, [], [zp])]
    node = helper.make_node("DequantizeLinear", ["x", "s", "z"], ["y"], name="dq")
    m = helper.make_model(helper.make_graph([node], "g", [x], [y], inits),
                          opset_imports=[helper.make_opsetid("", 21)])
    m.ir_version = 10
    return m


@pytest.mark.parametrize("dtype,scale,zp", [(np.uint8, 0.0123, 131), (np.int8, 3.7e-5, -7),
                                            (np.uint8, 1e30, 0), (np.int8, 0.1, 127)])
def test_dequant_step_bit_exact_with_onnx_reference(dtype, scale, zp):
    import dal.npu as npu
    from dal.npu.quant_step import DequantStep
    m = _dq_model(dtype, scale, zp)
    s = npu.load(m)
    assert isinstance(s.steps[0], DequantStep)
    lo, hi = np.iinfo(dtype).min, np.iinfo(dtype).max
    x = np.random.default_rng(1).integers(lo, hi + 1, (2, 3, 5)).astype(dtype)
    x.reshape(-1)[:2] = lo, hi  # both ends of the code range
    got = s.run({"x": x})[0]
    ref = oracles.run_reference(m, {"x": x})[0]
    assert got.dtype == np.float32 and got.shape == ref.shape
    assert np.array_equal(got.view(np.int32), ref.astype(np.float32).view(np.int32))
    # the node-by-node op of the same node, too
    assert np.array_equal(got, npu.load(m, semantics="onnx").run({"x": x})[0])


def test_dequant_step_wrong_codes_named():
    import dal.npu as npu
    s = npu.load(_dq_model(np.uint8, 0.5, 3))
    with pytest.raises(npu.NPUError, match="'x'|dq"):
        s.run({"x": np.zeros((2, 3, 5), np.int8)})
    consts = s.graph.consts
    with pytest.raises(npu.NPUError, match="'dq'.*zero point type uint8 != input type int8"):
        s.steps[0].run([np.zeros((2, 3, 5), np.int8), consts["s"], consts["z"]], 1)  # the step itself


def _gap_model(act, hw, scale=None, conv=True, seed=0):
    """x -> Q/DQ [-> Conv -> Relu -> Q/DQ] -> GlobalAveragePool -> Q/DQ (the tail of a ResNet)."""
    b = graphs.Builder(seed, act)
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 8, hw, hw])
    y, _ = b.qdq("x", scale)
    if conv:
        dw, _ = b.weight((16, 8, 3, 3))
        y, _ = b.qdq(b.node("Relu", [b.node("Conv", [y, dw], pads=[1, 1, 1, 1])]))
    y, _ = b.qdq(b.node("GlobalAveragePool", [y]))
    return b.model([x], y)


def _exact_gap_codes(m, codes, s, z, ys, yz):
    """The node-by-node value from math.fsum (the exact sum) of the float32 DQ values, rounded
    once to float32, divided in float32, then ONNX QuantizeLinear (round half even)."""
    import math
    v = ((codes.astype(np.int64) - int(z)).astype(np.float32) * np.float32(s)).astype(np.float64)
    n, c = v.shape[:2]
    sums = np.array([[math.fsum(v[i, j].reshape(-1)) for j in range(c)] for i in range(n)], np.float32)
    y = sums / np.float32(v.shape[2] * v.shape[3])
    q = np.rint(y.astype(np.float32) / np.float32(ys)) + int(yz)
    lo, hi = np.iinfo(yz.dtype).min, np.iinfo(yz.dtype).max
    return np.clip(q, lo, hi).astype(yz.dtype).reshape(n, c, 1, 1)


@pytest.mark.parametrize("act,hw,scale", [("u8", 7, None), ("s8", 5, 1e-30), ("u8", 33, 3e5), ("s8", 1, None)])
def test_gap_codes_bit_exact_with_exact_sum(act, hw, scale):
    """DQ -> GAP -> Q on the codes: equal to the node-by-node ops and to an fsum oracle."""
    import dal.npu as npu
    from dal.npu.gap_codes import GapCodes
    m = _gap_model(act, hw, scale, conv=False)
    s = npu.load(m)
    gap = [st for st in s.steps if isinstance(st, GapCodes)]
    assert len(gap) == 1 and gap[0].max_pixels >= hw * hw
    rng = np.random.default_rng(hw)
    x = {"x": (rng.standard_normal((2, 8, hw, hw)) * 200 * (scale or 0.03)).astype(np.float32)}
    vals = s.run(x, return_intermediates=True)[1]  # the node-by-node ops (_by_nodes)
    st, codes, c = gap[0], vals[gap[0].inputs[0]], s.graph.consts
    want = _exact_gap_codes(m, codes, c[st.dq.input[1]], c[st.dq.input[2]], c[st.q.input[1]], c[st.q.input[2]])
    assert np.array_equal(s.run(x)[0], c[st.q.input[1]] * (want.astype(np.float32) - c[st.q.input[2]]))
    assert np.array_equal(vals[st.outputs[0]], want)
    for nin in (False, True):  # either layout, 1 to 3 threads (C++ gap_codes_mean)
        for threads in (1, 2, 3):
            st.nhwc_in = (nin,)
            got = st.run([np.ascontiguousarray(np.moveaxis(codes, 1, 3)) if nin else codes], threads)[st.outputs[0]]
            assert got.dtype == want.dtype and np.array_equal(got, want), (nin, threads)


@pytest.mark.parametrize("threads", [1, 2])
def test_gap_codes_pixel_major_same_as_node_by_node(threads, monkeypatch):
    """After a conv the codes reach the step pixel-major; every output equals the session that
    runs GlobalAveragePool and its quantizers node by node (no code steps)."""
    import dal.npu as npu
    from dal.npu import fused_codes
    from dal.npu.gap_codes import GapCodes
    m = _gap_model("u8", 9)
    fast = npu.load(m, threads=threads)
    st = [t for t in fast.steps if isinstance(t, GapCodes)]
    assert st and st[0].nhwc_in == (True,)
    with monkeypatch.context() as mp:
        mp.setattr(fused_codes, "match", lambda g, n: None)
        slow = npu.load(m, threads=threads)
    assert not any(isinstance(t, GapCodes) for t in slow.steps)
    x = {"x": np.random.default_rng(5).standard_normal((2, 8, 9, 9)).astype(np.float32)}
    a, b = fast.run(x)[0], slow.run(x)[0]
    assert np.array_equal(a, b)
    va, vb = fast.run(x, return_intermediates=True)[1], slow.run(x, return_intermediates=True)[1]
    assert set(va) == set(vb) and all(np.array_equal(va[k], vb[k]) for k in vb)
