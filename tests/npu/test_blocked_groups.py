"""export/SPEC.md §5a's blocked integer group in dal.npu (dal/npu/blocked_groups.py): a MatMul
whose weight codes are dequantized per block of input channels, fed by per-tensor input codes and
read by QuantizeLinear(s), computed as per-block exact accumulators combined in float64 in
ascending block order.

Oracles: tests/blocked_oracle.py (the SPEC formula in Python integers and floats, products checked
exact with fractions), onnxruntime with ORT_DISABLE_ALL (float32 dequantize-then-MatMul: within
one LSB, a near-tie apart). Edge codes -128/127, 0/255, -8/7, 0/15, nonzero zero points per block,
a K that the block size does not divide.
"""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

import blocked_oracle
from oracles import run_ort

_T = {np.dtype(np.int8): TensorProto.INT8, np.dtype(np.uint8): TensorProto.UINT8,
      np.dtype(np.uint16): TensorProto.UINT16, np.dtype(ml_dtypes.int4): TensorProto.INT4, np.dtype(ml_dtypes.uint4): TensorProto.UINT4}


def _model(x_dt, zx, sx, wq, ws, wz, block, readers, relu=False, bias=None, axis=0):
    """xq (graph input codes) -> DQ -> MatMul(., DQ(wq blocked along axis 0)) [-> Relu] -> Q per
    reader (sy, zy, dtype) -> graph outputs; ``bias``: a float32 Add after the MatMul."""
    mk = helper.make_node
    inits = [numpy_helper.from_array(np.float32(sx), "sx"), numpy_helper.from_array(np.array(zx, x_dt), "zx"),
             numpy_helper.from_array(wq, "wq"), numpy_helper.from_array(ws, "ws"), numpy_helper.from_array(wz, "wz")]
    nodes = [mk("DequantizeLinear", ["xq", "sx", "zx"], ["x"], name="x_dq"),
             mk("DequantizeLinear", ["wq", "ws", "wz"], ["w"], name="w_dq", axis=axis, block_size=block),
             mk("MatMul", ["x", "w"], ["mm"], name="matmul")]
    last = "mm"
    if bias is not None:
        inits.append(numpy_helper.from_array(bias, "b"))
        nodes.append(mk("Add", ["mm", "b"], ["mm_b"], name="bias_add"))
        last = "mm_b"
    if relu:
        nodes.append(mk("Relu", [last], ["act"], name="relu"))
        last = "act"
    outs = []
    for i, (sy, zy, dt) in enumerate(readers):
        inits += [numpy_helper.from_array(np.float32(sy), f"sy{i}"), numpy_helper.from_array(np.array(zy, dt), f"zy{i}")]
        nodes.append(mk("QuantizeLinear", [last, f"sy{i}", f"zy{i}"], [f"y{i}"], name=f"q{i}"))
        outs.append(helper.make_tensor_value_info(f"y{i}", _T[np.dtype(dt)], None))
    g = helper.make_graph(nodes, "blocked_group", [helper.make_tensor_value_info("xq", _T[np.dtype(x_dt)], None)],
                          outs, inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)])
    m.ir_version = 10
    return m


def _weights(rng, k, n, block, w_dt):
    lo, hi = blocked_oracle_range(w_dt)
    nb = -(-k // block)
    wq = rng.integers(lo, hi + 1, (k, n))
    wq[0, :] = lo  # edge codes in every column
    wq[1, :] = hi
    wz = rng.integers(lo, hi + 1, (nb, n))
    wz[0, 0], wz[-1, -1] = lo, hi
    ws = rng.uniform(0.002, 0.05, (nb, n)).astype(np.float32)
    return wq.astype(w_dt), ws, wz.astype(w_dt)


def blocked_oracle_range(dt):
    info = ml_dtypes.iinfo(dt) if np.dtype(dt) in (np.dtype(ml_dtypes.int4), np.dtype(ml_dtypes.uint4)) else np.iinfo(dt)
    return int(info.min), int(info.max)


def _inputs(rng, m, k, x_dt):
    lo, hi = blocked_oracle_range(x_dt)
    xq = rng.integers(lo, hi + 1, (m, k))
    xq[0, ::2], xq[0, 1::2] = lo, hi  # edge codes
    return xq.astype(x_dt)


def _steps(m):
    import dal.npu as npu
    s = npu.load(m, threads=1)
    return s, [type(st).__name__ for st in s.steps]


CASES = [  # x dtype, x zero point, weight dtype, K, N, block
    (np.int8, -3, ml_dtypes.int4, 80, 6, 32),     # the last block holds 16 channels
    (np.uint8, 131, ml_dtypes.uint4, 64, 5, 16),
    (np.int8, 0, np.int8, 96, 4, 32),
    (np.uint8, 0, np.uint8, 40, 3, 7),            # 6 blocks, the last of 5
    (ml_dtypes.int4, 2, ml_dtypes.int4, 48, 4, 32),
]


@pytest.mark.parametrize("rows,spread", [(4, False), (12, False), (12, True)])
@pytest.mark.parametrize("x_dt,zx,w_dt,k,n,block", CASES)
def test_codes_equal_the_spec_formula(x_dt, zx, w_dt, k, n, block, rows, spread, npu_lib):
    """Both ways dal.npu computes ``t``: float32 blocks (one block's scales 2^-30 of the others,
    where one float64 matmul would not be exact in every order) and one float64 matmul with the
    pre-scaled weight (trained-like scales), on 4 and 12 rows."""
    rng = np.random.default_rng(k * 7 + n)
    wq, ws, wz = _weights(rng, k, n, block, w_dt)
    if spread:
        ws[1] *= np.float32(2.0 ** -30)
    xq = _inputs(rng, rows, k, x_dt)
    sx = np.float32(0.037)
    v = blocked_oracle.block_values(xq, zx, wq, wz, ws, block, sx)
    sy = np.float32(np.abs(v).max() / 100)  # codes spread over about [-100, 100]
    readers = [(sy, -5, np.int8)]
    s, kinds = _steps(_model(x_dt, zx, sx, wq, ws, wz, block, readers))
    step = s.steps[kinds.index("BlockedStep")]
    assert (step.w_exact is None) == spread
    got = s.run({"xq": xq})[0]
    want = blocked_oracle.codes(v, sy, -5, -128, 127)
    np.testing.assert_array_equal(got.astype(np.int64), want)
    vals = s.run({"xq": xq}, return_intermediates=True)[1]
    np.testing.assert_array_equal(vals["mm"], v)  # the MatMul's value in the integer semantics


def test_blocks_combined_in_ascending_order(npu_lib):
    """acc_0 s_0 = 889 B, acc_1 s_1 = -889 B, acc_2 s_2 = 2^-40: added in ascending block order the
    sum is 2^-40 exactly; any other order (or a float32 sum) loses it to rounding and gives the
    zero point."""
    b = 32
    xq = np.zeros((1, 3 * b), np.int8)
    xq[0, :2 * b] = 127
    xq[0, 2 * b] = 1
    wq = np.zeros((3 * b, 2), ml_dtypes.int4)
    wq[:b] = 7
    wq[b:2 * b] = -7
    wq[2 * b] = 1
    ws = np.array([[1.0, 1.0], [1.0, 1.0], [2.0 ** -40, 2.0 ** -41]], np.float32)
    wz = np.zeros((3, 2), ml_dtypes.int4)
    sx = np.float32(0.5)
    v = blocked_oracle.block_values(xq, 0, wq, wz, ws, b, sx)
    assert v.tolist() == [[2.0 ** -41, 2.0 ** -42]]
    sy = np.float32(2.0 ** -44)
    s, kinds = _steps(_model(np.int8, 0, sx, wq, ws, wz, b, [(sy, 0, np.int8)]))
    assert "BlockedStep" in kinds
    assert s.run({"xq": xq})[0].tolist() == [[8, 4]]


def test_relu_and_two_readers(npu_lib):
    """A Relu narrows each reader's range to [Q(0), max]; two quantizers read the same value,
    each with its own scale and zero point (uint8 and int8)."""
    rng = np.random.default_rng(5)
    k, n, block = 64, 8, 32
    wq, ws, wz = _weights(rng, k, n, block, ml_dtypes.int4)
    xq = _inputs(rng, 3, k, np.int8)
    v = blocked_oracle.block_values(xq, 1, wq, wz, ws, block, np.float32(0.02))
    s1, s2 = np.float32(np.abs(v).max() / 300), np.float32(np.abs(v).max() / 60)
    readers = [(s1, 10, np.uint8), (s2, -20, np.int8)]
    s, kinds = _steps(_model(np.int8, 1, np.float32(0.02), wq, ws, wz, block, readers, relu=True))
    assert kinds.count("BlockedStep") == 1
    y1, y2 = s.run({"xq": xq})
    np.testing.assert_array_equal(y1.astype(np.int64), blocked_oracle.codes(v, s1, 10, 10, 255))
    np.testing.assert_array_equal(y2.astype(np.int64), blocked_oracle.codes(v, s2, -20, -20, 127))
    assert (y1 == 10).any() and (y1 == 255).any()  # both bounds reached


def test_onnxruntime_within_one_lsb(npu_lib):
    """onnxruntime (ORT_DISABLE_ALL) dequantizes in float32 and multiplies in float32: its codes
    differ from the integer semantics only near a rounding tie, by one LSB."""
    rng = np.random.default_rng(11)
    k, n, block = 256, 64, 32
    wq, ws, wz = _weights(rng, k, n, block, ml_dtypes.int4)
    xq = _inputs(rng, 16, k, np.int8)
    sx = np.float32(0.011)
    v = blocked_oracle.block_values(xq[:2], -1, wq, wz, ws, block, sx)
    sy = np.float32(np.abs(v).max() / 90)
    m = _model(np.int8, -1, sx, wq, ws, wz, block, [(sy, 3, np.int8)])
    s, kinds = _steps(m)
    assert "BlockedStep" in kinds
    got = s.run({"xq": xq})[0].astype(np.int64)
    ort = run_ort(m, {"xq": xq})[0].astype(np.int64)
    assert np.abs(got - ort).max() <= 1
    assert (got != ort).mean() < 0.01


@pytest.mark.parametrize("what", ["bias", "uint16_x", "blocked_along_n"])
def test_other_forms_stay_float_islands(what, npu_lib):
    """A bias Add, 16-bit input codes, blocks along the output channels: not a blocked group
    (§5a). The last two are float islands; with the bias Add the MatMul is the blocked linear with
    a float output (tests/npu/test_blocked_float.py) and the Add a float node: here equal to
    onnxruntime on every code."""
    rng = np.random.default_rng(3)
    k, n, block = 64, 4, 32
    wq, ws, wz = _weights(rng, k, n, block, ml_dtypes.int4)
    x_dt, zx, bias, axis = np.int8, 0, None, 0
    if what == "bias":
        bias = rng.standard_normal(n).astype(np.float32)
    elif what == "uint16_x":
        x_dt, zx = np.uint16, 30000
    else:
        axis, block = 1, 2
        ws, wz = ws[:1].repeat(k, 0)[:, :2], wz[:1].repeat(k, 0)[:, :2]  # [K, N / 2]
    xq = rng.integers(0, 100, (3, k)).astype(x_dt)
    m = _model(x_dt, zx, np.float32(0.01), wq, ws, wz, block, [(np.float32(0.05), 0, np.int8)], bias=bias, axis=axis)
    s, kinds = _steps(m)
    assert "BlockedStep" not in kinds
    assert ("BlockedFloatStep" in kinds) == (what == "bias")
    np.testing.assert_array_equal(s.run({"xq": xq})[0], run_ort(m, {"xq": xq})[0])


def test_fuzz_base_model_is_a_blocked_group(npu_lib):
    """The fuzzer's base model for this group (tests/npu/fuzz_decoder.py: uint8 codes with a zero
    point, a short last block, Relu, two readers) runs as one blocked step, within one LSB of
    onnxruntime on both outputs."""
    import dal.npu as npu
    import fuzz_decoder
    m = fuzz_decoder.blocked_group_model()
    s = npu.load(m, threads=1)
    assert [type(st).__name__ for st in s.steps].count("BlockedStep") == 1
    x = np.random.default_rng(4).standard_normal((4, 32)).astype(np.float32) * 3
    for got, want, lsb in zip(s.run({"x": x}), run_ort(m, {"x": x}), (0.3, 0.7)):
        assert np.abs(got - want).max() <= lsb * 1.0001
