"""AveragePool with ceil_mode=1 (timm's ``avg_down`` downsampling, ResNeSt's and ResNet-D's
``AvgPool2d(2, 2, ceil_mode=True, count_include_pad=False)``), single-op graphs against
onnxruntime (optimizations off).

dal.npu sums each window in float64 and rounds once (export/SPEC.md §5a), onnxruntime sums in
float32; on small-integer inputs every partial sum is exact in float32, so the two agree bit for
bit whatever the order, and the window shapes and counts (the part ceil_mode changes) are
compared exactly. A window that ceil_mode lets run past the end padding, with
count_include_pad=1, counts the pads but not the overhang: onnxruntime's divisor and torch's
(which the QAT model computes); onnx.reference divides by another count on some shapes (6x6,
kernel 4, stride 3, pads 1: its last column 0.5 and 1.0 where onnxruntime and torch give 0.375
and 0.25 on ones), so it is not the oracle here.
"""
import numpy as np
import pytest
from onnx import TensorProto, helper

from oracles import npu_equals_ort


def _avgpool(shape, **attrs):
    node = helper.make_node("AveragePool", ["x"], ["y"], name="the_pool", **attrs)
    graph = helper.make_graph([node], "pool", [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(shape))],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 19)])
    model.ir_version = 9
    return model


CASES = [  # (input H, W, attributes)
    ((7, 9), dict(kernel_shape=[2, 2], strides=[2, 2], ceil_mode=1, count_include_pad=0)),  # avg_down, odd sizes
    ((8, 8), dict(kernel_shape=[2, 2], strides=[2, 2], ceil_mode=1, count_include_pad=0)),  # even: ceil changes nothing
    ((8, 8), dict(kernel_shape=[2, 2], strides=[2, 2], ceil_mode=1, count_include_pad=1)),
    ((7, 7), dict(kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1], ceil_mode=1, count_include_pad=0)),
    ((6, 5), dict(kernel_shape=[3, 2], strides=[2, 3], pads=[0, 1, 1, 0], ceil_mode=1, count_include_pad=0)),
    ((4, 4), dict(kernel_shape=[2, 2], strides=[2, 2], pads=[0, 0, 1, 1], ceil_mode=1, count_include_pad=0)),
    ((7, 7), dict(kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1], ceil_mode=1, count_include_pad=1)),
    ((7, 9), dict(kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1], count_include_pad=1)),     # no ceil
    # windows past the end padding, pads counted:
    ((7, 7), dict(kernel_shape=[2, 2], strides=[2, 2], ceil_mode=1, count_include_pad=1)),
    ((8, 8), dict(kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1], ceil_mode=1, count_include_pad=1)),
    ((6, 6), dict(kernel_shape=[4, 4], strides=[3, 3], pads=[1, 1, 1, 1], ceil_mode=1, count_include_pad=1)),
    ((6, 7), dict(kernel_shape=[4, 3], strides=[3, 2], pads=[1, 0, 0, 1], ceil_mode=1, count_include_pad=1)),
]


@pytest.mark.parametrize("hw,attrs", CASES, ids=[f"case{i}" for i in range(len(CASES))])
def test_ceil_mode_average_pool_matches_onnxruntime(hw, attrs):
    x = np.random.default_rng(0).integers(-20, 20, (2, 3) + hw).astype(np.float32)
    model = _avgpool(x.shape, **attrs)
    npu_equals_ort(model, {"x": x})
