"""dal.export.fold folds the int64 shape arithmetic HF models compute from buffers (ConstantOfShape,
Equal, Where, Expand, GatherElements), each to the value onnx.reference computes on the unfolded graph."""
import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator

from dal.export.fold import fold_constants
from dal.export.graph import Graph


def _const(name, array):
    return helper.make_node("Constant", [], [name], value=numpy_helper.from_array(np.asarray(array), name))


def _model():
    """BERT's buffered token_type_ids chain (as traced), plus a negative GatherElements index and a
    float ConstantOfShape fill; every result added to a graph input so that the graph keeps a consumer."""
    nodes = [
        _const("shape", np.array([2], np.int64)),
        helper.make_node("ConstantOfShape", ["shape"], ["ones"], value=numpy_helper.from_array(np.array([1], np.int64))),
        _const("minus1", np.array(-1, np.int64)),
        helper.make_node("Mul", ["ones", "minus1"], ["neg"]),
        _const("target", np.array([1, 16], np.int64)),
        helper.make_node("Equal", ["target", "neg"], ["is_neg"]),
        helper.make_node("Where", ["is_neg", "ones", "target"], ["expand_to"]),
        _const("buffer", np.arange(16, dtype=np.int64).reshape(1, 16) % 3),
        helper.make_node("Expand", ["buffer", "expand_to"], ["expanded"]),
        _const("index", np.array([[0, 3, -1, 5, 2, 2, 15, -16, 1, 4, 6, 7, 8, 9, 10, 11]], np.int64)),
        helper.make_node("GatherElements", ["expanded", "index"], ["gathered"], axis=1),
        helper.make_node("Add", ["x", "gathered"], ["y"]),
        _const("fshape", np.array([1, 16], np.int64)),
        helper.make_node("ConstantOfShape", ["fshape"], ["zeros"]),  # default fill: float32 0
        helper.make_node("Add", ["xf", "zeros"], ["yf"]),
    ]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.INT64, [1, 16]),
                     helper.make_tensor_value_info("xf", TensorProto.FLOAT, [1, 16])],
        [helper.make_tensor_value_info("y", TensorProto.INT64, [1, 16]),
         helper.make_tensor_value_info("yf", TensorProto.FLOAT, [1, 16])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_shape_arithmetic_folds_to_the_reference_value():
    model = _model()
    feeds = {"x": np.arange(16, dtype=np.int64).reshape(1, 16) * 100, "xf": np.linspace(-1, 1, 16, dtype=np.float32)[None]}
    expected = ReferenceEvaluator(model).run(None, feeds)
    graph = Graph(model)
    fold_constants(graph)
    folded = graph.finish()
    onnx.checker.check_model(folded, full_check=True)
    assert sorted(n.op_type for n in folded.graph.node) == ["Add", "Add"]
    got = ReferenceEvaluator(folded).run(None, feeds)
    for e, g in zip(expected, got):
        assert e.dtype == g.dtype and np.array_equal(e, g)
