"""The near-tie test behind an FP16 island's output rounding (layer_verdict._judge_fp16).

An FP16 island (a softmax on the a2000) feeding a finer quantizer (the int16 weights of a
deformable attention's weighted sum) rounds to float16 first: two engines whose float32 values
straddle a float16 tie land one float16 ulp apart, several codes of the int16 quantizer. The graph
here is ``DQ(int16 x, 2^-12) -> Cast(FLOAT16) -> Cast(FLOAT) -> Q(int16, 2^-12)``: at x code 4098
the value ``1 + 2^-11`` is exactly the float16 tie between 1 and ``1 + 2^-10`` (codes 4096 and
4100). onnxruntime (optimizations off) gives 4096 (ties to even); the other rounding, 4100, is a
near-tie; 4104 (two float16 ulps) is not, nor is 4100 at x code 4097 (a quarter ulp from 1, no
tie), nor 4100 without the Casts (a plain int16 copy: 4 LSB is a failure)."""
import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from dal.verification.layer_verdict import judge_codes
from dal.verification.near_tie import LayerEvaluator


def _model(cast: bool) -> onnx.ModelProto:
    inits = [numpy_helper.from_array(np.float32(2.0 ** -12).reshape(()), "s"),
             numpy_helper.from_array(np.int16(0).reshape(()), "z")]
    nodes = [helper.make_node("DequantizeLinear", ["xq", "s", "z"], ["xd"], name="x/DequantizeLinear")]
    last = "xd"
    if cast:
        nodes += [helper.make_node("Cast", ["xd"], ["h"], to=TensorProto.FLOAT16, name="/model/act/Cast"),
                  helper.make_node("Cast", ["h"], ["f"], to=TensorProto.FLOAT, name="/model/act/Cast_1")]
        last = "f"
    nodes.append(helper.make_node("QuantizeLinear", [last, "s", "z"], ["yq"], name="out/QuantizeLinear"))
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("xq", TensorProto.INT16, [1, 1])],
                              [helper.make_tensor_value_info("yq", TensorProto.INT16, [1, 1])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])


def _judge(model, x_code: int, mine: int, theirs: int):
    x = np.array([[x_code]], np.int16)
    ev = LayerEvaluator(model, {"xq": x}, {}, {"kind": "float"})
    return judge_codes(ev, model.graph.node[-1], np.array([[mine]]), np.array([[theirs]]))[:2]


def _ort(model, x_code: int) -> int:
    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    sess = ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    return int(sess.run(None, {"xq": np.array([[x_code]], np.int16)})[0].reshape(()))


def test_one_float16_ulp_at_a_tie_is_a_near_tie():
    model = _model(cast=True)
    assert _ort(model, 4098) == 4096  # 1 + 2^-11 rounds to even: 1.0
    assert _judge(model, 4098, 4100, 4096) == (1, 0)
    assert _judge(model, 4098, 4096, 4100) == (1, 0)


def test_two_ulps_or_no_tie_is_a_failure():
    model = _model(cast=True)
    assert _judge(model, 4098, 4104, 4096) == (0, 1)
    assert _ort(model, 4097) == 4096
    assert _judge(model, 4097, 4100, 4096) == (0, 1)


def test_without_the_fp16_cast_only_one_lsb_can_be_a_near_tie():
    model = _model(cast=False)
    assert _ort(model, 4098) == 4098
    assert _judge(model, 4098, 4100, 4098) == (0, 1)
    assert _judge(model, 4098, 4099, 4098) == (0, 1)  # the exact value is a code: no tie at all
