"""TopK (RT-DETR's query selection) and Einsum without a summed index (RT-DETR's position
embedding, ``grid.outer(omega)``) in dal.npu, and dal.convert's ``torch.topk`` in ONNX's order.

Oracles: onnxruntime (optimizations off): TopK on data full of ties (equal values by ascending
index, ONNX's rule), both outputs bit for bit; Einsum products (one float multiplication each) bit
for bit. dal.convert's topk against the NPU on the same tied data.
"""
import numpy as np
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

import dal.npu
from dal.convert.float_ops import topk_onnx
from dal.npu import UnsupportedNode
from oracles import run_ort

_ET = {np.float32: TensorProto.FLOAT, np.float64: TensorProto.DOUBLE, np.int32: TensorProto.INT32}


def _topk_model(x, k, **attrs):
    et = _ET[x.dtype.type]
    node = helper.make_node("TopK", ["x", "k"], ["v", "i"], name="the_topk", **attrs)
    graph = helper.make_graph([node], "topk", [helper.make_tensor_value_info("x", et, list(x.shape))],
                              [helper.make_tensor_value_info("v", et, None),
                               helper.make_tensor_value_info("i", TensorProto.INT64, None)],
                              [numpy_helper.from_array(np.array([k], np.int64), "k")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    return model


def _tied(dtype):
    return np.random.default_rng(0).integers(-3, 4, size=(2, 40, 3)).astype(dtype)  # 7 values: ties everywhere


@pytest.mark.parametrize("dtype", [np.float32, np.int32])
@pytest.mark.parametrize("axis,largest", [(1, 1), (1, 0), (-1, 1)])
def test_topk_matches_onnxruntime_on_ties(dtype, axis, largest):
    x = _tied(dtype)
    k = 3 if axis == -1 else 8
    model = _topk_model(x, k, axis=axis, largest=largest)
    want = run_ort(model, {"x": x})
    got = dal.npu.run(model, {"x": x})
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and np.array_equal(g, w)


def test_convert_topk_is_the_npus_order():
    x = _tied(np.float32)
    want = dal.npu.run(_topk_model(x, 8, axis=1), {"x": x})
    got = topk_onnx(torch.from_numpy(x), 8, dim=1)
    assert np.array_equal(got.values.numpy(), want[0]) and np.array_equal(got.indices.numpy(), want[1])


def _einsum_model(eq, a, b):
    et = _ET[a.dtype.type]
    node = helper.make_node("Einsum", ["a", "b"], ["y"], name="the_einsum", equation=eq)
    graph = helper.make_graph([node], "einsum", [helper.make_tensor_value_info("a", et, list(a.shape)),
                                                 helper.make_tensor_value_info("b", et, list(b.shape))],
                              [helper.make_tensor_value_info("y", et, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    return model


@pytest.mark.parametrize("eq,sa,sb", [("i,j->ij", (5,), (7,)), ("i,j->ji", (5,), (7,)), ("bi,j->bji", (2, 5), (3,))])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_einsum_products_match_onnxruntime(eq, sa, sb, dtype):
    rng = np.random.default_rng(1)
    a, b = rng.standard_normal(sa).astype(dtype), rng.standard_normal(sb).astype(dtype)
    model = _einsum_model(eq, a, b)
    want = run_ort(model, {"a": a, "b": b})[0]
    got = dal.npu.run(model, {"a": a, "b": b})[0]
    assert got.dtype == want.dtype and np.array_equal(got, want)


def test_einsum_contraction_is_refused_naming_the_node():
    a = np.ones((3, 4), np.float32)
    with pytest.raises(UnsupportedNode, match="the_einsum.*summed"):
        dal.npu.run(_einsum_model("ij,j->i", a, np.ones(4, np.float32)), {"a": a, "b": np.ones(4, np.float32)})
