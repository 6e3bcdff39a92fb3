"""dal/npu/const_matmul.py: a float-island MatMul whose weight is a constant (an initializer, or a
blocked weight's DequantizeLinear folded at load) holds the weight's float64 copy once. Its outputs
are the node step's, bit for bit (the same numpy call on the same float64 values), and any other
input -- a value handed in by run_layerwise, an integer input -- runs the node step itself."""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from oracles import run_ort


def _model():
    """x (float) @ W1 (float32 initializer) -> Relu -> @ DQ(int4 codes, blocked along K) -> y (float:
    no quantizer reads it, so a float island)."""
    rng = np.random.default_rng(0)
    w1 = rng.standard_normal((24, 64)).astype(np.float32)
    codes = rng.integers(-8, 8, (64, 16)).astype(ml_dtypes.int4)
    scale = rng.uniform(0.01, 0.1, (2, 16)).astype(np.float32)
    inits = [numpy_helper.from_array(w1, "w1"), numpy_helper.from_array(codes, "wq"),
             numpy_helper.from_array(scale, "ws")]
    mk = helper.make_node
    nodes = [mk("MatMul", ["x", "w1"], ["h"], name="mm1"), mk("Relu", ["h"], ["r"], name="relu"),
             mk("DequantizeLinear", ["wq", "ws"], ["w2"], name="w2_dq", axis=0, block_size=32),
             mk("MatMul", ["r", "w2"], ["y"], name="mm2")]
    g = helper.make_graph(nodes, "const_mm", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 5, 24])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)])
    m.ir_version = 10
    return m


def test_same_bits_as_the_node_step(npu_lib):
    import dal.npu as npu
    from dal.npu.const_matmul import ConstWeightMatMul
    s = npu.load(_model(), threads=1)
    wrapped = [st for st in s.steps if isinstance(st, ConstWeightMatMul)]
    assert sorted(st.node_name for st in wrapped) == ["mm1", "mm2"]
    x = np.random.default_rng(1).standard_normal((3, 5, 24)).astype(np.float32)
    y, vals = s.run({"x": x}, return_intermediates=True)
    for st in wrapped:  # the wrapped node step, on the same inputs
        ins = [vals[st.inputs[0]] if st.inputs[0] in vals else x, st.w_src]
        want = st.inner.run(ins, 1)[st.outputs[0]]
        got = vals[st.outputs[0]]
        assert got.dtype == want.dtype and np.array_equal(got, want)
    # onnxruntime (ORT_DISABLE_ALL) sums in float32: within a few float32 ulps of the float64 sum
    np.testing.assert_allclose(y[0], run_ort(_model(), {"x": x})[0], rtol=1e-5, atol=1e-5)


def test_other_inputs_run_the_node_step(npu_lib):
    import dal.npu as npu
    from dal.npu.const_matmul import ConstWeightMatMul
    s = npu.load(_model(), threads=1)
    st = next(st for st in s.steps if isinstance(st, ConstWeightMatMul) and st.node_name == "mm1")
    x = np.random.default_rng(2).standard_normal((2, 24)).astype(np.float32)
    other = st.w_src.copy() * np.float32(2)  # not the constant: computed from what is handed in
    got = st.run([x, other], 1)[st.outputs[0]]
    assert np.array_equal(got, (x.astype(np.float64) @ other.astype(np.float64)).astype(np.float32))
    with pytest.raises(ValueError, match="mm1"):  # an integer input: the node step's named refusal
        st.run([x.astype(np.int8), st.w_src], 1)
