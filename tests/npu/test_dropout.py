"""ONNX Dropout in inference form (what torch exports for an eval-mode ``F.dropout(x, p,
training=self.training)``, timm's GhostNet) on dal.npu against onnx.reference: the input and an
all-true mask; training mode, which is random, refused naming the node."""
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper
from onnx.reference import ReferenceEvaluator

import dal.npu
from dal.npu.errors import UnsupportedNode


def _dropout(training, mask: bool, opset: int = 17):
    inputs, inits = ["x", "ratio"], [helper.make_tensor("ratio", TensorProto.FLOAT, [], [0.3])]
    if training is not None:
        inputs.append("training_mode")
        inits.append(helper.make_tensor("training_mode", TensorProto.BOOL, [], [training]))
    outs = ["y", "mask"] if mask else ["y"]
    node = helper.make_node("Dropout", inputs, outs, name="drop")
    value_info = [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 5])]
    if mask:
        value_info.append(helper.make_tensor_value_info("mask", TensorProto.BOOL, [2, 5]))
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 5])],
                              value_info, inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    onnx.checker.check_model(model)
    return model


@pytest.mark.parametrize("training", [None, False])
@pytest.mark.parametrize("mask", [False, True])
def test_inference_dropout_is_onnx_references(training, mask):
    model = _dropout(training, mask)
    x = np.random.default_rng(0).standard_normal((2, 5)).astype(np.float32)
    want = ReferenceEvaluator(model).run(None, {"x": x})
    got = dal.npu.load(model).run({"x": x})
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and np.array_equal(g, w)


def test_training_mode_is_refused_by_node():
    with pytest.raises(UnsupportedNode, match=r"'drop'.*training_mode is true"):
        dal.npu.load(_dropout(True, False)).run({"x": np.zeros((2, 5), np.float32)})
