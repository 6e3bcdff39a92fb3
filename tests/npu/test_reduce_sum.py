"""ReduceSum (timm's ResNeSt sums its split-attention radix branches, ``x.sum(dim=1)``), on
single-op graphs against onnxruntime (optimizations off), and its float rule (export/SPEC.md
§5a: the sum in float64, rounded once to the input type) against an exact rational oracle.

onnxruntime sums float32 in float32 in its own order, so on general data it is an ulp off the
correctly rounded sum now and then; on data whose every partial sum is exact in the type (small
integers) any order gives the same bits, which is where the axes / keepdims /
noop_with_empty_axes semantics are compared with it bit for bit.
"""
from fractions import Fraction

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

import dal.npu
from dal.npu import NPUError, UnsupportedNode
from oracles import nearest_float, npu_equals_ort, run_ort

_TYPES = {np.float32: TensorProto.FLOAT, np.float16: TensorProto.FLOAT16, np.int32: TensorProto.INT32,
          np.int64: TensorProto.INT64}


def _reduce_sum(x: np.ndarray, axes=None, opset: int = 13, **attrs):
    """One ReduceSum of the graph input ``x``; ``axes`` as the second input (opset >= 13) or
    the attribute (opset 11)."""
    inputs, inits = ["x"], []
    if axes is not None and opset >= 13:
        inputs.append("axes")
        inits.append(numpy_helper.from_array(np.asarray(axes, np.int64), "axes"))
    elif axes is not None:
        attrs["axes"] = list(axes)
    node = helper.make_node("ReduceSum", inputs, ["y"], name="the_sum", **attrs)
    et = _TYPES[x.dtype.type]
    graph = helper.make_graph([node], "reduce_sum", [helper.make_tensor_value_info("x", et, list(x.shape))],
                              [helper.make_tensor_value_info("y", et, None)], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 8
    return model


_INT_VALUED = np.random.default_rng(0).integers(-50, 50, (2, 4, 3, 5)).astype(np.float32)
CASES = [  # (input, axes, opset, attributes)
    (_INT_VALUED.reshape(2, 2, 2, 3, 5), [1], 13, {"keepdims": 0}),  # ResNeSt's form
    (_INT_VALUED, [2, 3], 13, {}),
    (_INT_VALUED, [-1], 13, {"keepdims": 0}),
    (_INT_VALUED, None, 13, {}),                                     # no axes: every axis
    (_INT_VALUED, None, 13, {"noop_with_empty_axes": 1}),            # no axes: x itself
    (_INT_VALUED, [0, 2], 11, {"keepdims": 0}),                      # axes as the attribute
    (_INT_VALUED.astype(np.float16), [1], 13, {}),
    (_INT_VALUED.astype(np.int32), [1, 3], 13, {}),
    (_INT_VALUED.astype(np.int64), None, 13, {"keepdims": 0}),
    (np.zeros((2, 0, 3), np.float32), [1], 13, {}),                  # an empty sum is 0
]


@pytest.mark.parametrize("x,axes,opset,attrs", CASES, ids=[f"case{i}" for i in range(len(CASES))])
def test_reduce_sum_matches_onnxruntime(x, axes, opset, attrs):
    model = _reduce_sum(x, axes, opset, **attrs)
    npu_equals_ort(model, {"x": x})


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_a_float_sum_is_the_correctly_rounded_one(dtype):
    """64 summands of mixed sign over 12 binades per output (float32 rounding inside the sum
    shows, cancellation makes it many ulps of the result): dal.npu equals the exact sum rounded
    once; onnxruntime's is only within the recursive-summation bound ``(n - 1) u sum |x|``
    (measured: up to 34 ulps of the result off in float32)."""
    rng = np.random.default_rng(1)
    x = (rng.standard_normal((3, 64, 5)) * np.exp2(rng.integers(-6, 6, (3, 64, 5)))).astype(dtype)
    model = _reduce_sum(x, [1], keepdims=0)
    got = dal.npu.run(model, {"x": x})[0]
    want = np.array([[nearest_float(sum(Fraction(float(v)) for v in x[i, :, j]), dtype) for j in range(5)]
                     for i in range(3)])
    assert got.dtype == dtype and np.array_equal(got, want)
    ort = run_ort(model, {"x": x})[0].astype(np.float64)
    bound = 63 * float(np.finfo(dtype).eps) / 2 * np.abs(x.astype(np.float64)).sum(axis=1)
    assert (np.abs(ort - want) <= bound + np.spacing(np.abs(want).astype(dtype))).all()


def test_an_integer_sum_that_leaves_its_type_is_refused_naming_the_node():
    x = np.full((2, 3), 2**30, np.int32)
    with pytest.raises(NPUError, match="the_sum.*leaves int32"):
        dal.npu.run(_reduce_sum(x, [1]), {"x": x})
    big = np.full((2,), 2**62, np.int64)
    with pytest.raises(NPUError, match="the_sum.*leaves int64"):
        dal.npu.run(_reduce_sum(big, [0]), {"x": big})
    ok = np.array([2**62, -2**62, 5], np.int64)  # partial sums beyond int64 are fine when the total fits
    assert dal.npu.run(_reduce_sum(ok, [0], keepdims=0), {"x": ok})[0] == 5


def test_a_bad_axis_is_refused_naming_the_node():
    with pytest.raises(NPUError, match="the_sum.*axis 4 out of range"):
        dal.npu.run(_reduce_sum(_INT_VALUED, [4]), {"x": _INT_VALUED})
    assert issubclass(UnsupportedNode, NPUError)
