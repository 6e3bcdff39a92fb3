"""dal.npu runs constant steps (a weight's DequantizeLinear on initializers) once at load
(dal/npu/constant_steps.py): the step leaves Session.steps, the dequantized weight equals
onnxruntime's (every graph optimization off) bit for bit, and the MatMul on it equals the
float64 product of x and onnxruntime's weight rounded once to float32 (dal.npu's documented
float MatMul; onnxruntime's float32 sum is order-dependent, so it is not the MatMul oracle)."""
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import dal.npu

ort = pytest.importorskip("onnxruntime")


def _dq_matmul(out_is_weight=False):
    rng = np.random.default_rng(0)
    k, n, block = 32, 8, 16
    w = rng.integers(-8, 8, size=(k, n)).astype(np.int8)
    scale = (rng.random((k // block, n)) * 0.1 + 0.01).astype(np.float32)
    w_t = helper.make_tensor("w", TensorProto.INT4, [k, n], w.flatten().tolist())
    nodes = [helper.make_node("DequantizeLinear", ["w", "s"], ["w_f"], name="dq_w", axis=0, block_size=block),
             helper.make_node("MatMul", ["x", "w_f"], ["y"], name="mm")]
    outs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, n])]
    if out_is_weight:
        outs.append(helper.make_tensor_value_info("w_f", TensorProto.FLOAT, [k, n]))
    graph = helper.make_graph(nodes, "dq_mm", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, k])],
                              outs, initializer=[w_t, numpy_helper.from_array(scale, "s")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    model.ir_version = 10
    onnx.checker.check_model(model)
    return model.SerializeToString()


def _ort(model, feed):
    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    return ort.InferenceSession(model, opts, providers=["CPUExecutionProvider"]).run(None, feed)


@pytest.mark.parametrize("out_is_weight", [False, True])
def test_weight_dq_is_folded_and_matches_onnxruntime(out_is_weight):
    model = _dq_matmul(out_is_weight)
    x = np.random.default_rng(1).standard_normal((4, 32)).astype(np.float32)
    sess = dal.npu.load(model)
    assert [s.node_name for s in sess.steps] == ["mm"]  # the DQ ran at load
    got = sess.run({"x": x})
    w_ort = _ort(_dq_matmul(True), {"x": x})[1]
    want = [(x.astype(np.float64) @ w_ort.astype(np.float64)).astype(np.float32)]
    if out_is_weight:  # a graph output that is a folded constant is still returned
        want.append(w_ort)
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_array_equal(a, b)  # 0 LSB
    _, values = sess.run({"x": x}, return_intermediates=True)
    np.testing.assert_array_equal(values["w_f"], w_ort)


def test_failing_constant_step_raises_its_named_error_at_run():
    # a Reshape of a constant to an impossible shape: not folded, the run names the node
    w = numpy_helper.from_array(np.arange(6, dtype=np.float32).reshape(2, 3), "w")
    shp = numpy_helper.from_array(np.array([4, 4], dtype=np.int64), "shp")
    nodes = [helper.make_node("Reshape", ["w", "shp"], ["r"], name="bad_reshape"),
             helper.make_node("Add", ["x", "r"], ["y"], name="add")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 4])], initializer=[w, shp])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    sess = dal.npu.load(model.SerializeToString())
    with pytest.raises(dal.npu.NPUError, match="bad_reshape"):
        sess.run({"x": np.zeros((4, 4), np.float32)})
