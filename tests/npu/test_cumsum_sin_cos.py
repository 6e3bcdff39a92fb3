"""CumSum, Sin and Cos (Hugging Face DETR-family sine position embeddings: ``mask.cumsum(1)``,
``pos.sin()``, ``pos.cos()``) in dal.npu and in dal.convert's float ops (export/SPEC.md §5a).

Oracles: onnxruntime (optimizations off) on data whose running sums are exact in any order (small
integers) for the CumSum attribute semantics; Python's float (IEEE double) running sum, rounded
exactly to float32, for the float rule (float64 sum, one rounding per element); Python's ``math.sin`` / ``math.cos`` for Sin / Cos (a
float64 libm result, rounded once to float32). The two integer engines then agree bit for bit on
the same random data.
"""
import math
from fractions import Fraction

import numpy as np
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

import dal.npu
from dal.convert.float_ops import cos_f64, cumsum_f64, sin_f64
from dal.npu import NPUError
from oracles import nearest_float, npu_equals_ort

_ET = {np.float32: TensorProto.FLOAT, np.float16: TensorProto.FLOAT16, np.int32: TensorProto.INT32,
       np.int64: TensorProto.INT64}


def _one_node(op: str, x: np.ndarray, axis=None, **attrs):
    inputs, inits = ["x"], []
    if axis is not None:
        inputs.append("axis")
        inits.append(numpy_helper.from_array(np.asarray(axis, np.int64), "axis"))
    et = _ET[x.dtype.type]
    graph = helper.make_graph([helper.make_node(op, inputs, ["y"], name="the_op", **attrs)], op,
                              [helper.make_tensor_value_info("x", et, list(x.shape))],
                              [helper.make_tensor_value_info("y", et, None)], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 14)])
    model.ir_version = 8
    return model


@pytest.mark.parametrize("dtype", [np.float32, np.int32, np.int64])
@pytest.mark.parametrize("axis", [0, 1, -1])
@pytest.mark.parametrize("exclusive,reverse", [(0, 0), (1, 0), (0, 1), (1, 1)])
def test_cumsum_semantics_match_onnxruntime(dtype, axis, exclusive, reverse):
    x = np.random.default_rng(0).integers(-9, 10, size=(3, 4, 5)).astype(dtype)
    npu_equals_ort(_one_node("CumSum", x, axis, exclusive=exclusive, reverse=reverse), {"x": x})


def test_cumsum_float_is_the_float64_running_sum_rounded_once():
    """Each output is the float64 running sum (Python floats: IEEE double, added in order along the
    axis) rounded once to float32; the data's range (2^-20 .. 2^20) makes float32 running sums round
    differently, so a float32 accumulation would fail here."""
    rng = np.random.default_rng(1)
    x = (rng.standard_normal((2, 300)) * np.exp2(rng.integers(-20, 20, size=(2, 300)))).astype(np.float32)
    got = dal.npu.run(_one_node("CumSum", x, 1), {"x": x})[0]
    want = np.empty_like(x)
    for r in range(2):
        acc = 0.0
        for k in range(300):
            acc = acc + float(x[r, k])
            want[r, k] = nearest_float(Fraction(acc), np.float32)
    assert np.array_equal(got, want)
    assert not np.array_equal(np.cumsum(x, axis=1, dtype=np.float32), want)


def test_cumsum_integer_overflow_is_named():
    x = np.array([2**30, 2**30], np.int32)
    with pytest.raises(NPUError, match="the_op.*CumSum.*leaves int32"):
        dal.npu.run(_one_node("CumSum", x, 0), {"x": x})


@pytest.mark.parametrize("op,fn", [("Sin", math.sin), ("Cos", math.cos)])
def test_sin_cos_are_float64_rounded_once(op, fn):
    x = np.random.default_rng(2).uniform(-200, 200, size=4000).astype(np.float32)
    got = dal.npu.run(_one_node(op, x), {"x": x})[0]
    want = np.array([fn(float(v)) for v in x], np.float64).astype(np.float32)
    assert got.dtype == np.float32 and np.array_equal(got, want)


def test_convert_float_ops_equal_the_npu_bit_for_bit():
    rng = np.random.default_rng(3)
    x = (rng.standard_normal((2, 16, 16)) * 50).astype(np.float32)
    t = torch.from_numpy(x)
    assert np.array_equal(sin_f64(t).numpy(), dal.npu.run(_one_node("Sin", x), {"x": x})[0])
    assert np.array_equal(cos_f64(t).numpy(), dal.npu.run(_one_node("Cos", x), {"x": x})[0])
    for axis in (1, 2):
        assert np.array_equal(cumsum_f64(t, axis).numpy(), dal.npu.run(_one_node("CumSum", x, axis), {"x": x})[0])
    assert cumsum_f64(t.double(), 1) is None and cumsum_f64(t, 1, dtype=torch.float64) is None
