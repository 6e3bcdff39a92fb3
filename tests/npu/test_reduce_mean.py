"""Float means in dal.npu -- ReduceMean, GlobalAveragePool, AveragePool -- by export/SPEC.md §5a:
``y = T(sum float64(x) / float64(n))``, the float64 sum divided in float64 and rounded ONCE to
the input type T (float32 or float16). Single-op graphs, judged by an exact rational oracle
(tests/mean_cases.py: the ``Fraction`` sum / n, rounded to nearest even by
``oracles.nearest_float``) and by onnxruntime (optimizations off) where onnxruntime is exact.

The tie cases (tests/mean_cases.py ``tie_case``) are built so that a second rounding shows: on
every group of them, ``T(T(sum) / n)`` (SPEC's rule before, n = 3) or what dal.npu computed for
float16 before, ``float16(float32(float32(sum) / n))`` (n = 2^k), is an ulp off.

Where onnxruntime differs, and why: its CPU ReduceMean sums float32 in float32 (float16 too,
widened to float32) and rounds the quotient again, so the sum drops eps. Measured with
onnxruntime 1.32: on the float32 tie cases it is an ulp off on every element (74 of 74), on the
float16 ones with n = 2^k on every element (69 of 69), on the float16 ones with n = 3 exact
(its float32 sum of three float16 values is exact). The tie-case test asserts only that it is
within an ulp. On small-integer data every partial sum is exact in any order and the quotient
is rounded once, so there the axes / keepdims / noop_with_empty_axes semantics are compared
with it bit for bit.
"""
import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

import dal.npu
from dal.npu import NPUError
from mean_cases import exact_mean, rounded_twice, tie_case
from oracles import npu_equals_ort, run_ort

_ET = {np.float32: TensorProto.FLOAT, np.float16: TensorProto.FLOAT16}


def _single(op, x, inputs=(), opset=18, **attrs):
    """One ``op`` node reading graph input ``x`` and the constant ``inputs`` (name, array)."""
    node = helper.make_node(op, ["x"] + [n for n, _ in inputs], ["y"], name="the_mean", **attrs)
    et = _ET[x.dtype.type]
    graph = helper.make_graph([node], "mean", [helper.make_tensor_value_info("x", et, list(x.shape))],
                              [helper.make_tensor_value_info("y", et, None)],
                              [numpy_helper.from_array(v, n) for n, v in inputs])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 8
    return model


def _reduce_mean(x, axes=None, opset=18, **attrs):
    if axes is not None and opset < 18:
        return _single("ReduceMean", x, opset=opset, axes=list(axes), **attrs)
    inputs = [("axes", np.asarray(axes, np.int64))] if axes is not None else []
    return _single("ReduceMean", x, inputs, opset=opset, **attrs)


def _assert_tie_cases(x, axes, want):
    """Every group of x is a tie case that a second rounding gets wrong (module doc)."""
    n = int(np.prod([x.shape[a] for a in axes]))
    via = x.dtype.type if n == 3 else np.float32
    if n != 3 and x.dtype == np.float32:
        return  # a power-of-two float32 mean has no second rounding to show: the division is exact
    assert (rounded_twice(x, axes, via).reshape(-1) != want.reshape(-1)).all(), via


TIE_AXES = [((2, 3, 2, 5), [1], 1), ((2, 5, 3), [2], 0), ((2, 3, 1, 4), [1, 2], 1),
            ((3, 1, 2), [-3, 1], 0), ((2, 4, 2, 8), [1], 1), ((2, 4, 2, 8), [3], 0),
            ((2, 4, 2, 8), [1, 2], 1), ((2, 4, 2, 8), [-1, 1], 0), ((2, 4, 2, 8), [0, 1, 2, 3], 1)]


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
@pytest.mark.parametrize("shape,axes,keep", TIE_AXES, ids=[f"{s}-axes{a}-keep{k}" for s, a, k in TIE_AXES])
def test_reduce_mean_rounds_once_on_tie_cases(dtype, shape, axes, keep):
    x = tie_case(shape, axes, dtype)
    model = _reduce_mean(x, axes, keepdims=keep)
    got = dal.npu.run(model, {"x": x})[0]
    want = exact_mean(x, axes, bool(keep))
    assert got.dtype == dtype and got.shape == want.shape and np.array_equal(got, want)
    _assert_tie_cases(x, axes, want)
    # onnxruntime rounds more than once (module doc): within an ulp of the exact mean
    ort = run_ort(model, {"x": x})[0]
    assert ort.shape == want.shape
    assert (np.abs(ort.astype(np.float64) - want) <= np.spacing(np.abs(want))).all()


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
@pytest.mark.parametrize("axes", [[1], [1, 2], [0, 2]])
def test_reduce_mean_is_the_exact_mean_rounded_once_on_wide_data(dtype, axes):
    """Mixed signs over 12 binades, groups of 48 / 240 / 15 elements (not powers of two: the
    division rounds too): dal.npu equals the exact mean rounded once on every element, where
    rounding the sum first gives another value on some of them."""
    rng = np.random.default_rng(2)
    x = (rng.standard_normal((3, 48, 5)) * np.exp2(rng.integers(-6, 6, (3, 48, 5)))).astype(dtype)
    model = _reduce_mean(x, axes, keepdims=0)
    got = dal.npu.run(model, {"x": x})[0]
    want = exact_mean(x, axes, keepdims=False)
    assert got.dtype == dtype and np.array_equal(got, want)
    if axes == [1]:  # 15 means of 48: the old order of roundings differs on some of them
        assert (rounded_twice(x, axes, x.dtype.type) != want).any()


_INT = np.random.default_rng(0).integers(-50, 50, (2, 4, 3, 5)).astype(np.float32)
SEMANTICS = [  # (input, axes, opset, attributes): every sum exact, so onnxruntime rounds once too
    (_INT, [1], 18, {}),
    (_INT, [2, 3], 18, {"keepdims": 0}),
    (_INT, [-1], 18, {}),
    (_INT, None, 18, {}),                                  # no axes: every axis
    (_INT, None, 18, {"noop_with_empty_axes": 1}),         # no axes: x itself
    (_INT, [0, 2], 13, {"keepdims": 0}),                   # axes as the attribute
    (_INT, [1, 3], 11, {}),
    (_INT.astype(np.float16), [1], 18, {}),
    (_INT.astype(np.float16), [0, 3], 13, {"keepdims": 0}),
]


@pytest.mark.parametrize("x,axes,opset,attrs", SEMANTICS, ids=[f"case{i}" for i in range(len(SEMANTICS))])
def test_reduce_mean_matches_onnxruntime_where_it_is_exact(x, axes, opset, attrs):
    model = _reduce_mean(x, axes, opset, **attrs)
    got = npu_equals_ort(model, {"x": x})
    if not attrs.get("noop_with_empty_axes"):
        ax = list(range(x.ndim)) if axes is None else axes
        assert np.array_equal(got, exact_mean(x, ax, bool(attrs.get("keepdims", 1))))


def test_a_float16_mean_whose_sum_overflows_float16_is_finite():
    """Four 60000s: the sum (240000) is past float16's 65504, the mean is not. Rounding the sum
    to float16 first would give inf."""
    x = np.full((1, 4), 60000, np.float16)
    got = dal.npu.run(_reduce_mean(x, [1], keepdims=0), {"x": x})[0]
    assert got.dtype == np.float16 and got.tolist() == [60000.0]


def test_an_integer_reduce_mean_is_refused_naming_the_node():
    x = np.ones((2, 3), np.int32)
    node = helper.make_node("ReduceMean", ["x"], ["y"], name="the_mean", axes=[1])
    graph = helper.make_graph([node], "m", [helper.make_tensor_value_info("x", TensorProto.INT32, [2, 3])],
                              [helper.make_tensor_value_info("y", TensorProto.INT32, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    with pytest.raises(NPUError, match="the_mean"):
        dal.npu.run(model, {"x": x})


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
@pytest.mark.parametrize("hw", [(4, 4), (3, 1)])
def test_global_average_pool_rounds_once_on_tie_cases(dtype, hw):
    x = tie_case((2, 3) + hw, [2, 3], dtype, seed=3)
    model = _single("GlobalAveragePool", x, opset=13)
    got = dal.npu.run(model, {"x": x})[0]
    want = exact_mean(x, [2, 3])
    assert got.dtype == dtype and np.array_equal(got, want)
    _assert_tie_cases(x, [2, 3], want)


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
@pytest.mark.parametrize("include_pad", [0, 1])
def test_average_pool_rounds_once_on_tie_cases(dtype, include_pad):
    """Non-overlapping 2x2 (float16) or 3x1 (both types) windows, no padding: every window a
    tie case (its count the same either way)."""
    for kh, kw in ((2, 2), (3, 1)):
        k = kh * kw
        w = tie_case((2 * 3 * 3 * 3, k), [1], dtype, seed=4)  # 54 windows of k
        x = np.ascontiguousarray(w.reshape(2, 3, 3, 3, kh, kw).transpose(0, 1, 2, 4, 3, 5).reshape(2, 3, 3 * kh, 3 * kw))
        model = _single("AveragePool", x, opset=19, kernel_shape=[kh, kw], strides=[kh, kw],
                        count_include_pad=include_pad)
        got = dal.npu.run(model, {"x": x})[0]
        want = exact_mean(w, [1], keepdims=False)
        assert got.dtype == dtype and np.array_equal(got.reshape(-1), want), (kh, kw)
        _assert_tie_cases(w, [1], want)
