"""The cost model's tables come from dal.ops (dal/cost/op_costs.py): the same op classes and ONNX
node types the hand-written tables of cost/torch_graph.py, roofline.py and onnx_graph.py held, and
a user's op is charged by its own ``cost`` (ONNX node types owned by the op whose whole pattern
they are, shared ones only when their ops agree)."""
import pytest

import dal
from dal.cost import op_costs

#: the tables as the cost model held them before the registry (the oracle for the derived ones),
#: less GlobalMaxPool: dal's exporter writes AdaptiveMaxPool2d(1) as MaxPool and max_pool's
#: pattern lists MaxPool only, so a GlobalMaxPool (another exporter's file) is no longer timed
OLD_MATRIX_CLASSES = {"conv", "conv_transpose", "linear", "matmul", "embedding"}
OLD_VECTOR_CLASSES = {"add", "mul", "cat", "pool", "activation", "softmax", "layernorm", "resize"}
OLD_FREE_ACTIVATIONS = {"relu", "relu6", "hardtanh"}
OLD_MATRIX_OPS = {"Conv": "conv", "ConvTranspose": "conv_transpose", "Gemm": "linear", "MatMul": "matmul"}
OLD_VECTOR_OPS = {"Add": "add", "Mul": "mul", "Concat": "cat", "MaxPool": "pool", "AveragePool": "pool",
                  "GlobalAveragePool": "pool", "Softmax": "softmax", "LayerNormalization": "layernorm",
                  "Resize": "resize", "Sigmoid": "activation", "Tanh": "activation", "Gelu": "activation",
                  "HardSwish": "activation", "HardSigmoid": "activation", "Exp": "activation"}


def test_op_classes_are_the_cost_models_own():
    assert op_costs.matrix_classes() == OLD_MATRIX_CLASSES
    assert op_costs.vector_classes() == OLD_VECTOR_CLASSES
    assert op_costs.free_activations() == OLD_FREE_ACTIVATIONS


def test_onnx_node_types_map_as_before():
    assert op_costs.onnx_classes("matrix") == OLD_MATRIX_OPS
    vector = op_costs.onnx_classes("vector")
    assert {t: vector.get(t) for t in OLD_VECTOR_OPS} == OLD_VECTOR_OPS
    assert "MaxPool" in op_costs.onnx_passthrough() and "AveragePool" not in op_costs.onnx_passthrough()
    charged = set(vector) | set(op_costs.onnx_classes("matrix"))
    assert not {"Gather", "Relu", "Clip", "Reshape", "Transpose", "QuantizeLinear"} & charged


def test_node_types_shared_by_ops_belong_to_the_whole_pattern_or_to_ops_that_agree():
    Op = dal.ops.Op
    added = [Op("k_whole", "activation", "float", onnx=("KWhole",), cost="vector"),
             Op("k_first", "pool", "float", onnx=("KWhole", "KShared", "KSplit"), cost="vector"),
             Op("k_second", "pool", "float", onnx=("KShared", "KSplit"), cost="vector"),
             Op("k_free", "custom", "passthrough", onnx=("KSplit", "KOwn"), cost="free")]
    for op in added:
        dal.ops.register(op)
    try:
        vector = op_costs.onnx_classes("vector")
        assert vector["KWhole"] == "activation"  # k_whole's whole pattern, though k_first lists it
        assert vector["KShared"] == "pool"  # k_first and k_second agree
        assert "KSplit" not in vector and "KSplit" not in op_costs.onnx_classes("free")  # they disagree
        assert op_costs.onnx_classes("free")["KOwn"] == "custom"
    finally:
        for op in added:
            dal.ops.unregister(op.name)
    assert "KWhole" not in op_costs.onnx_classes("vector")  # the tables follow the registry


@pytest.mark.parametrize("cost, charged", [("vector", "activation"), ("free", None), (None, None)])
def test_a_module_is_charged_by_its_ops_cost(cost, charged):
    from torch import nn

    from dal.cost.torch_graph import op_class_for

    class Shrink(nn.Hardshrink):
        pass

    dal.ops.register(dal.ops.Op("k_shrink", "activation", "float", modules=(Shrink,), cost=cost))
    try:
        # cost None: the op does not say, and its op class decides, as for an unregistered type
        # (a Hardshrink subclass has none: not a layer)
        assert op_class_for(Shrink()) == charged
    finally:
        dal.ops.unregister("k_shrink")
