"""dal.npu's requantized moves (dal/npu/code_moves.py): the KV cache's DQ -> Unsqueeze -> Expand ->
Reshape [-> Transpose] -> Q -> DQ, run as one 256-entry table lookup and the moves, equals the
nodes one by one (``fuse_chains=False``) on every code of every type, and the ONNX formulas
computed here in float64 / numpy (DequantizeLinear (c - zp) * s in float32, QuantizeLinear
saturate(round_half_even(x / s) + zp)); DQ's output read elsewhere stays its own step."""
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import dal.npu

ELEM = {np.int8: TensorProto.INT8, np.uint8: TensorProto.UINT8}


def _model(dtype, s1, z1, s2, z2, transpose):
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
              helper.make_node("Slice", ["f", "st", "en", "sax"], ["side"], name="side_slice")]
    consts = {"s1": np.float32(s1), "z1": dtype(z1), "s2": np.float32(s2), "z2": dtype(z2),
              "ax": np.array([2], np.int64), "shape": np.array([1, 2, 2, 16, 8], np.int64),
              "flat": np.array([1, 4, 16, 8], np.int64), "st": np.array([1], np.int64),
              "en": np.array([16], np.int64), "sax": np.array([2], np.int64)}
    g = helper.make_graph(nodes, "kv", [helper.make_tensor_value_info("c", ELEM[dtype], [1, 2, 16, 8])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, None),
                           helper.make_tensor_value_info("side", TensorProto.FLOAT, None)],
                          initializer=[numpy_helper.from_array(np.asarray(v), k) for k, v in consts.items()])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)])
    m.ir_version = 10
    return m.SerializeToString()


def _oracle(c, dtype, s1, z1, s2, z2, transpose):
    info = np.iinfo(dtype)
    f = ((c.astype(np.int64) - z1).astype(np.float32) * np.float32(s1)).astype(np.float32)
    x = np.broadcast_to(f[:, :, None], (1, 2, 2, 16, 8)).reshape(1, 4, 16, 8)
    if transpose:
        x = x.transpose(0, 1, 3, 2)
    q = np.clip(np.rint(x / np.float32(s2)).astype(np.float64) + z2, info.min, info.max).astype(np.int64)
    return ((q - z2).astype(np.float32) * np.float32(s2)).astype(np.float32)


CASES = [  # (dtype, s1, z1, s2, z2): equal scales, a coarser and a finer second grid (saturating)
    (np.int8, 0.05, 0, 0.05, 0), (np.int8, 0.0371, 0, 0.1093, 0), (np.int8, 0.02, 0, 0.0071, 0),
    (np.uint8, 0.013, 128, 0.031, 120), (np.uint8, 0.25, 3, 0.125, 250)]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("transpose", [False, True])
def test_table_equals_nodes_and_formula(case, transpose):
    dtype, s1, z1, s2, z2 = case
    m = _model(dtype, s1, z1, s2, z2, transpose)
    fused, plain = dal.npu.load(m, threads=1), dal.npu.load(m, threads=1, fuse_chains=False)
    kinds = [type(s).__name__ for s in fused.steps]
    assert kinds.count("CodeMoves") == 1 and "QuantStep" not in kinds, kinds  # it did fuse
    rng = np.random.default_rng(0)
    every = np.arange(256, dtype=np.uint8).view(dtype).reshape(1, 2, 16, 8)  # each code once
    for c in (every, rng.integers(0, 256, (1, 2, 16, 8), dtype=np.uint8).view(dtype)):
        got, want = fused.run({"c": c}), plain.run({"c": c})
        for a, b in zip(got, want):
            assert a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a.view(np.uint32), b.view(np.uint32))
        assert np.array_equal(got[0].view(np.uint32), _oracle(c, dtype, s1, z1, s2, z2, transpose).view(np.uint32))


def test_intermediates_are_the_nodes():
    """Every-tensor runs keep each node's output (the unfused steps), equal in both sessions."""
    m = _model(np.int8, 0.0371, 0, 0.1093, 0, True)
    fused, plain = dal.npu.load(m, threads=1), dal.npu.load(m, threads=1, fuse_chains=False)
    c = np.arange(256, dtype=np.uint8).view(np.int8).reshape(1, 2, 16, 8)
    _, va = fused.run({"c": c}, return_intermediates=True)
    _, vb = plain.run({"c": c}, return_intermediates=True)
    assert set(va) == set(vb) and {"q", "e", "t"} <= set(va)
    assert all(np.array_equal(va[k], vb[k]) for k in va)
