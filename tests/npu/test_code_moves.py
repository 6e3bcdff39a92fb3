"""dal.npu's requantized moves (dal/npu/code_moves.py): the KV cache's DQ -> Unsqueeze -> Expand ->
Reshape [-> Transpose] -> Q -> DQ, run as one 256-entry table lookup and the moves, equals the
nodes one by one (``fuse_chains=False``) on every code of every type, and the ONNX formulas
computed here in float64 / numpy (DequantizeLinear (c - zp) * s in float32, QuantizeLinear
saturate(round_half_even(x / s) + zp)); and the cache's ``present_*`` output, DQ -> Slice -> Q back
to codes, as a codes table (the identity on the cache's own grid)."""
import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

import dal.npu

ELEM = {np.int8: TensorProto.INT8, np.uint8: TensorProto.UINT8}


def _model(dtype, s1, z1, s2, z2, transpose, s3=None, z3=None):
    nodes = [helper.make_node("DequantizeLinear", ["c", "s1", "z1"], ["f"], name="dq1"),
             helper.make_node("Unsqueeze", ["f", "ax"], ["u"], name="unsqueeze"),
             helper.make_node("Expand", ["u", "shape"], ["e"], name="expand"),
             helper.make_node("Reshape", ["e", "flat"], ["r"], name="reshape")]
    last = "r"
    if transpose:
        nodes.append(helper.make_node("Transpose", ["r"], ["t"], name="transpose", perm=[0, 1, 3, 2]))
        last = "t"
    nodes += [helper.make_node("QuantizeLinear", [last, "s2", "z2"], ["q"], name="q2"),
              helper.make_node("DequantizeLinear", ["q", "s2", "z2"], ["y"], name="dq2"),
              helper.make_node("Slice", ["f", "st", "en", "sax"], ["side"], name="side_slice"),
              helper.make_node("QuantizeLinear", ["side", "s3", "z3"], ["present"], name="q3")]
    s3, z3 = (s1, z1) if s3 is None else (s3, z3)
    consts = {"s1": np.float32(s1), "z1": dtype(z1), "s2": np.float32(s2), "z2": dtype(z2),
              "s3": np.float32(s3), "z3": dtype(z3),
              "ax": np.array([2], np.int64), "shape": np.array([1, 2, 2, 16, 8], np.int64),
              "flat": np.array([1, 4, 16, 8], np.int64), "st": np.array([1], np.int64),
              "en": np.array([16], np.int64), "sax": np.array([2], np.int64)}
    g = helper.make_graph(nodes, "kv", [helper.make_tensor_value_info("c", ELEM[dtype], [1, 2, 16, 8])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, None),
                           helper.make_tensor_value_info("present", ELEM[dtype], None)],
                          initializer=[numpy_helper.from_array(np.asarray(v), k) for k, v in consts.items()])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)])
    m.ir_version = 10
    return m.SerializeToString()


def _q(x, s, z, dtype):
    info = np.iinfo(dtype)
    with np.errstate(over="ignore"):  # 1e30 / s: +-inf, saturated below
        return np.clip(np.rint(x / np.float32(s)).astype(np.float64) + z, info.min, info.max).astype(np.int64)


def _oracle(c, dtype, s1, z1, s2, z2, transpose, s3, z3):
    """(y, present) by the ONNX formulas."""
    f = ((c.astype(np.int64) - z1).astype(np.float32) * np.float32(s1)).astype(np.float32)
    x = np.broadcast_to(f[:, :, None], (1, 2, 2, 16, 8)).reshape(1, 4, 16, 8)
    if transpose:
        x = x.transpose(0, 1, 3, 2)
    q = _q(x, s2, z2, dtype)
    present = _q(f[:, :, 1:16], s3, z3, dtype).astype(dtype)
    return ((q - z2).astype(np.float32) * np.float32(s2)).astype(np.float32), present


CASES = [  # (dtype, s1, z1, s2, z2, s3, z3): equal scales, coarser and finer (saturating) grids;
    # s3 None: present_* requantized on the cache's own grid (the table is the identity)
    (np.int8, 0.05, 0, 0.05, 0, None, None), (np.int8, 0.0371, 0, 0.1093, 0, None, None),
    (np.int8, 0.02, 0, 0.0071, 0, 0.013, 5), (np.uint8, 0.013, 128, 0.031, 120, None, None),
    (np.uint8, 0.25, 3, 0.125, 250, 0.5, 100)]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("transpose", [False, True])
def test_table_equals_nodes_and_formula(case, transpose):
    dtype, s1, z1, s2, z2, s3, z3 = case
    m = _model(dtype, s1, z1, s2, z2, transpose, s3, z3)
    fused, plain = dal.npu.load(m, threads=1), dal.npu.load(m, threads=1, fuse_chains=False)
    kinds = [type(s).__name__ for s, _, _ in fused._fetch_plan(False)]
    assert kinds == ["CodeMoves", "CodeMoves"], kinds  # both fused; DQ1's output no longer read
    rng = np.random.default_rng(0)
    every = np.arange(256, dtype=np.uint8).view(dtype).reshape(1, 2, 16, 8)  # each code once
    for c in (every, rng.integers(0, 256, (1, 2, 16, 8), dtype=np.uint8).view(dtype)):
        got, want = fused.run({"c": c}), plain.run({"c": c})
        for a, b in zip(got, want):
            assert a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a.view(np.uint32), b.view(np.uint32))
        y, present = _oracle(c, dtype, s1, z1, s2, z2, transpose, s3 if s3 else s1, z3 if s3 else z1)
        assert np.array_equal(got[0].view(np.uint32), y.view(np.uint32)) and np.array_equal(got[1], present)


def test_intermediates_are_the_nodes():
    """Every-tensor runs keep each node's output (the unfused steps), equal in both sessions."""
    m = _model(np.int8, 0.0371, 0, 0.1093, 0, True)
    fused, plain = dal.npu.load(m, threads=1), dal.npu.load(m, threads=1, fuse_chains=False)
    c = np.arange(256, dtype=np.uint8).view(np.int8).reshape(1, 2, 16, 8)
    _, va = fused.run({"c": c}, return_intermediates=True)
    _, vb = plain.run({"c": c}, return_intermediates=True)
    assert set(va) == set(vb) and {"q", "e", "t", "f", "side"} <= set(va)
    assert all(np.array_equal(va[k], vb[k]) for k in va)


def _append_model(dtype, s1, z1, s2, z2):
    """A decoder's cache append: Q(Concat(DQ(cache codes), new float rows)) -> present codes."""
    nodes = [helper.make_node("DequantizeLinear", ["c", "s1", "z1"], ["f"], name="dq_cache"),
             helper.make_node("Concat", ["f", "x"], ["cat"], name="append", axis=2),
             helper.make_node("QuantizeLinear", ["cat", "s2", "z2"], ["k"], name="q_cache")]
    consts = {"s1": np.float32(s1), "z1": dtype(z1), "s2": np.float32(s2), "z2": dtype(z2)}
    g = helper.make_graph(nodes, "append", [helper.make_tensor_value_info("c", ELEM[dtype], [1, 2, 16, 8]),
                                            helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 2, 3, 8])],
                          [helper.make_tensor_value_info("k", ELEM[dtype], None)],
                          initializer=[numpy_helper.from_array(np.asarray(v), k) for k, v in consts.items()])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)])
    m.ir_version = 10
    return m.SerializeToString()


@pytest.mark.parametrize("case", [(np.int8, 0.05, 0), (np.int8, 0.0371, 0), (np.uint8, 0.013, 128),
                                  (np.uint8, 0.25, 3)])
def test_cache_append_on_codes(case):
    """Q undoes the cache's DQ (the same grid): Concat(c, Q(x)) equals the nodes and the ONNX
    formulas, on every code and on new rows with ties (x / s = k + 1/2), saturation, +-inf and NaN."""
    dtype, s, z = case
    m = _append_model(dtype, s, z, s, z)
    fused, plain = dal.npu.load(m, threads=1), dal.npu.load(m, threads=1, fuse_chains=False)
    assert [type(st).__name__ for st, _, _ in fused._fetch_plan(False)] == ["CodeConcat"]
    rng = np.random.default_rng(3)
    c = np.arange(256, dtype=np.uint8).view(dtype).reshape(1, 2, 16, 8)
    ties = ((rng.integers(-140, 140, 48) + 0.5) * np.float32(s)).astype(np.float32)
    x = np.concatenate([ties[:40], np.array([np.inf, -np.inf, 1e30, -1e30, 0.0, -0.0, 3 * s, np.nan],
                                            np.float32)]).reshape(1, 2, 3, 8)
    for xx in (x, np.nan_to_num(x, nan=0.0)):  # with NaN (quantized by its defined code) and without
        with np.errstate(invalid="ignore"):
            got, want = fused.run({"c": c, "x": xx})[0], plain.run({"c": c, "x": xx})[0]
        assert got.dtype == want.dtype == dtype and np.array_equal(got, want)
        assert np.array_equal(got[:, :, :16], c)
    clean = np.nan_to_num(x, nan=0.0)
    want = _q(clean, s, z, dtype).astype(dtype)
    assert np.array_equal(fused.run({"c": c, "x": clean})[0][:, :, 16:], want)


def test_cache_append_other_grid_not_fused():
    """A quantizer that does not undo the cache's DQ (another scale) keeps Concat and Q."""
    m = _append_model(np.int8, 0.05, 0, 0.07, 0)
    fused = dal.npu.load(m, threads=1)
    assert "CodeConcat" not in [type(st).__name__ for st in fused.steps]


def test_two_patterns_sharing_a_dequantize():
    """DQ1 -> Transpose -> Q2 -> DQ2 -> Unsqueeze -> Q3 -> DQ3: DQ2 ends the first pattern and would
    start a second one; the first takes it in (its input, Q2's codes, is then never computed), so
    the second is not formed, and the session equals the nodes one by one and the formulas."""
    s = {"s1": 0.05, "s2": 0.0371, "s3": 0.1093}
    nodes = [helper.make_node("DequantizeLinear", ["c", "s1", "z"], ["f"], name="dq1"),
             helper.make_node("Transpose", ["f"], ["t"], name="transpose", perm=[0, 2, 1]),
             helper.make_node("QuantizeLinear", ["t", "s2", "z"], ["q2"], name="q2"),
             helper.make_node("DequantizeLinear", ["q2", "s2", "z"], ["g"], name="dq2"),
             helper.make_node("Unsqueeze", ["g", "ax"], ["r"], name="unsqueeze"),
             helper.make_node("QuantizeLinear", ["r", "s3", "z"], ["q3"], name="q3"),
             helper.make_node("DequantizeLinear", ["q3", "s3", "z"], ["y"], name="dq3")]
    consts = {**{k: np.float32(v) for k, v in s.items()}, "z": np.int8(0), "ax": np.array([1], np.int64)}
    g = helper.make_graph(nodes, "two", [helper.make_tensor_value_info("c", TensorProto.INT8, [1, 16, 8])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                          initializer=[numpy_helper.from_array(np.asarray(v), k) for k, v in consts.items()])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)])
    m.ir_version = 10
    fused, plain = dal.npu.load(m.SerializeToString(), threads=1), dal.npu.load(m.SerializeToString(), threads=1,
                                                                                  fuse_chains=False)
    c = np.arange(128, dtype=np.int64).astype(np.uint8).view(np.int8).reshape(1, 16, 8) * 2
    got, want = fused.run({"c": c})[0], plain.run({"c": c})[0]
    f = c.astype(np.float32) * np.float32(s["s1"])
    q2 = _q(f.transpose(0, 2, 1), s["s2"], 0, np.int8).astype(np.float32) * np.float32(s["s2"])
    oracle = _q(q2[:, None], s["s3"], 0, np.int8).astype(np.float32) * np.float32(s["s3"])
    assert np.array_equal(got, want) and np.array_equal(got, oracle)
