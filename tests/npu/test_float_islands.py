"""FP16 islands (Cast(to=float16) -> op -> Cast(to=float)) and FP8 QDQ conv / gemm, against
onnx.reference and onnxruntime (ORT_DISABLE_ALL).

Measured here (onnx 1.23, onnxruntime 1.32): the reference runtime (every op computed in
float32, reductions in float64, one rounding to float16) equals onnx.reference bit for bit on
the ops below (Conv and Gemm with a bias: within one float16 ulp -- onnx.reference rounds the
sum to float16 before adding the bias, dal.npu rounds once, export/SPEC.md §6); onnxruntime's CPU float16 kernels are not correctly rounded: elementwise ops differ
on ~25-33% of elements by up to 2^-10 relative (up to 3 ulps near cancellation), Conv / MatMul
/ Gemm by up to 0.64% (float16 accumulation); data movement (Relu, MaxPool) agrees exactly. FP8 (E4M3FN / E5M2) DQ -> Conv/Gemm -> Q equals onnx.reference on every code.
"""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

import oracles


def _island(op, inits, attrs=None, xshape=(1, 4, 8, 8)):
    nodes = [helper.make_node("Cast", ["x"], ["h"], to=TensorProto.FLOAT16),
             helper.make_node(op, ["h"] + list(inits), ["o16"], **(attrs or {})),
             helper.make_node("Cast", ["o16"], ["y"], to=TensorProto.FLOAT)]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(xshape))],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                          [numpy_helper.from_array(v, k) for k, v in inits.items()])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)])
    m.ir_version = 10
    return m


def _h(rng, *s):
    return rng.standard_normal(s).astype(np.float16)


def _cases(rng):
    return {
        "Add": (_island("Add", {"b": _h(rng, 1, 4, 1, 1)}), True),
        "Sub": (_island("Sub", {"b": _h(rng, 8)}), True),
        "Mul": (_island("Mul", {"b": _h(rng, 1, 4, 8, 8)}), True),
        "Div": (_island("Div", {"b": _h(rng, 1, 4, 8, 8) + np.float16(3)}), True),
        "Relu": (_island("Relu", {}), True),
        "Tanh": (_island("Tanh", {}), True),
        "Conv": (_island("Conv", {"w": _h(rng, 6, 4, 3, 3), "b": _h(rng, 6)}, {"pads": [1, 1, 1, 1]}), False),
        "MatMul": (_island("MatMul", {"w": _h(rng, 8, 5)}), True),
        "Gemm": (_island("Gemm", {"w": _h(rng, 5, 32), "c": _h(rng, 5)}, {"transB": 1}, (3, 32)), False),
        "MaxPool": (_island("MaxPool", {}, {"kernel_shape": [2, 2]}), True),
        "AveragePool": (_island("AveragePool", {}, {"kernel_shape": [2, 2]}), True),
        "GlobalAveragePool": (_island("GlobalAveragePool", {}), True),
    }


def _ulps16(a, b):
    """Distance in float16 ulps of two float32 arrays holding float16 values."""
    def key(v):
        i = v.astype(np.float16).view(np.int16).astype(np.int64)
        return np.where(i < 0, -(i & 0x7FFF), i)
    return np.abs(key(a) - key(b))


@pytest.mark.parametrize("name", list(_cases(np.random.default_rng(0))))
@pytest.mark.parametrize("semantics", ["integer", "onnx"])
def test_fp16_island(name, semantics, npu_lib):
    import dal.npu as npu
    rng = np.random.default_rng(0)
    m, exact_vs_ref = _cases(rng)[name]
    shape = [d.dim_value for d in m.graph.input[0].type.tensor_type.shape.dim]
    x = (3 * np.random.default_rng(1).standard_normal(shape)).astype(np.float32)
    got = npu.run(m, {"x": x}, semantics=semantics)[0]
    ref = oracles.ref_values(m, {"x": x})["y"]
    ort = oracles.ort_values(m, {"x": x})["y"]
    assert got.dtype == np.float32 and got.shape == ref.shape == ort.shape
    if exact_vs_ref:
        assert np.array_equal(got.view(np.uint32), ref.view(np.uint32)), name
    else:  # onnx.reference's float16 Conv / Gemm round the sum s to float16 before adding the
        # bias; export/SPEC.md §6 (and dal.npu) round once with the bias in the float64 sum. Each
        # rounding is at most half an ulp, <= 2^-11 of its value (plus half the smallest subnormal)
        inits = {t.name: numpy_helper.to_array(t).astype(np.float32) for t in m.graph.initializer}
        b = inits["b"].reshape(1, -1, 1, 1) if "b" in inits else inits["c"]
        bound = 2.0**-11 * (np.abs(ref - b) + np.abs(ref) + np.abs(got)) + 2.0**-24
        assert np.all(np.abs(got - ref) <= bound), name
        assert (_ulps16(got, ref) == 0).mean() > 0.5, name
    # onnxruntime is not an oracle for float16 arithmetic (see module doc): bound the gap,
    # relative to max(|y|, 1): measured <= 2^-10 elementwise, <= 0.0064 for Conv/MatMul/Gemm
    rel = np.abs(got - ort) / np.maximum(np.abs(got), 1)
    if name in ("Relu", "MaxPool"):
        assert rel.max() == 0
    elif name in ("Conv", "MatMul", "Gemm"):
        assert rel.max() <= 0.02, (name, float(rel.max()))
    else:
        assert rel.max() <= 2.0**-10, (name, float(rel.max()))


def _fp8_model(op, fmt, seed):
    rng = np.random.default_rng(seed)
    f8 = {"e4m3": (ml_dtypes.float8_e4m3fn, TensorProto.FLOAT8E4M3FN),
          "e5m2": (ml_dtypes.float8_e5m2, TensorProto.FLOAT8E5M2)}[fmt]
    inits, nodes = [], []

    def init(v, name):
        inits.append(numpy_helper.from_array(np.asarray(v), name) if not isinstance(v, np.ndarray) or v.dtype != f8[0]
                     else helper.make_tensor(name, f8[1], v.shape, v.tobytes(), raw=True))
        return name
    zx = helper.make_tensor("zx", f8[1], [], np.zeros((), f8[0]).tobytes(), raw=True)
    inits.append(zx)
    init(np.float32(0.05), "sx")
    nodes.append(helper.make_node("QuantizeLinear", ["x", "sx", "zx"], ["xq"]))
    nodes.append(helper.make_node("DequantizeLinear", ["xq", "sx", "zx"], ["xd"]))
    if op == "Conv":
        w = rng.standard_normal((8, 4, 3, 3)).astype(np.float32).astype(f8[0])
        ws = rng.uniform(0.01, 0.05, 8).astype(np.float32)
        xshape = [1, 4, 10, 10]
    else:
        w = rng.standard_normal((12, 40)).astype(np.float32).astype(f8[0])
        ws = rng.uniform(0.01, 0.05, 12).astype(np.float32)
        xshape = [3, 40]
    init(w, "w")
    init(ws, "ws")
    nodes.append(helper.make_node("DequantizeLinear", ["w", "ws"], ["wd"], axis=0))
    init(rng.standard_normal(w.shape[0]).astype(np.float32) * np.float32(0.1), "b")
    if op == "Conv":
        nodes.append(helper.make_node("Conv", ["xd", "wd", "b"], ["y"], pads=[1, 1, 1, 1]))
    else:
        nodes.append(helper.make_node("Gemm", ["xd", "wd", "b"], ["y"], transB=1))
    init(np.float32(0.04), "sy")
    init(np.array(0, np.int8), "zy")
    nodes.append(helper.make_node("QuantizeLinear", ["y", "sy", "zy"], ["yq"]))
    inits.append(helper.make_tensor("zf", f8[1], [], np.zeros((), f8[0]).tobytes(), raw=True))
    nodes.append(helper.make_node("QuantizeLinear", ["y", "sy", "zf"], ["yf"]))
    nodes.append(helper.make_node("DequantizeLinear", ["yq", "sy", "zy"], ["out"]))
    nodes.append(helper.make_node("DequantizeLinear", ["yf", "sy", "zf"], ["out8"]))
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, xshape)],
                          [helper.make_tensor_value_info("out", TensorProto.FLOAT, None),
                           helper.make_tensor_value_info("out8", TensorProto.FLOAT, None)], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)])
    m.ir_version = 10
    return m, xshape


@pytest.mark.parametrize("op", ["Conv", "Gemm"])
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("semantics", ["integer", "onnx"])
def test_fp8_conv_gemm_vs_reference(op, fmt, semantics, npu_lib):
    import dal.npu as npu
    m, xshape = _fp8_model(op, fmt, seed=3)
    x = (2 * np.random.default_rng(2).standard_normal(xshape)).astype(np.float32)
    vals = npu.load(m, semantics=semantics).run({"x": x}, return_intermediates=True)[1]
    ref = oracles.ref_values(m, {"x": x})
    for k in ("xq", "yq", "yf", "out", "out8"):
        a, b = vals[k], ref[k]
        assert a.dtype == b.dtype and a.shape == b.shape, k
        assert np.array_equal(a.view(np.uint8) if a.dtype.itemsize == 1 else a,
                              b.view(np.uint8) if b.dtype.itemsize == 1 else b), k


@pytest.mark.parametrize("dtype", [TensorProto.FLOAT, TensorProto.FLOAT16])
def test_float_maxpool_exact_with_padding_and_infinities(dtype):
    """A float MaxPool (taken in float32 for float16/float32 inputs, where max is exact) equals
    onnx.reference and onnxruntime bit for bit, with asymmetric pads, dilation, ceil_mode,
    +-inf and -0.0 in the input."""
    import dal.npu as npu
    np_t = np.float32 if dtype == TensorProto.FLOAT else np.float16
    x = np.random.default_rng(4).standard_normal((2, 3, 11, 10)).astype(np_t)
    x[0, 0, 0, :3] = [np.inf, -np.inf, -0.0]
    x[1, 2, 5:, 4] = -np.inf
    for attrs in ({"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1]},
                  {"kernel_shape": [2, 3], "strides": [1, 2], "dilations": [2, 1], "pads": [0, 2, 1, 0]},
                  {"kernel_shape": [3, 2], "strides": [2, 2], "ceil_mode": 1}):
        g = helper.make_graph([helper.make_node("MaxPool", ["x"], ["y"], **attrs)], "g",
                              [helper.make_tensor_value_info("x", dtype, list(x.shape))],
                              [helper.make_tensor_value_info("y", dtype, None)])
        m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)])
        m.ir_version = 10
        got = npu.load(m).run({"x": x})[0]
        for want in (oracles.run_reference(m, {"x": x})[0], oracles.run_ort(m, {"x": x})[0]):
            assert got.dtype == want.dtype and got.shape == want.shape, attrs
            assert np.array_equal(got.view(np.uint32 if np_t is np.float32 else np.uint16),
                                  want.view(np.uint32 if np_t is np.float32 else np.uint16)), attrs
