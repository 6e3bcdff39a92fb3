"""float8 codes in dal.verify: grid positions, torch <-> ml_dtypes, onnxruntime feeds and fetches,
and the near-tie test of a float8 QuantizeLinear.

Oracles: ml_dtypes' float64 values of every float8 bit pattern (the grid's order), torch's own
float8 casts (``.to(torch.float8_e4m3fn)`` is ONNX saturate=1, FACTS.md), exact rationals
(fractions) for a value placed on / off the midpoint of two float8 codes.
"""
from fractions import Fraction

import ml_dtypes
import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

from dal.verification.codes import as_numpy, as_torch, is_code, is_float8, ordinals
from dal.verification.layer_verdict import judge_codes
from dal.verification.near_tie import LayerEvaluator

FORMATS = [(ml_dtypes.float8_e4m3fn, torch.float8_e4m3fn, TensorProto.FLOAT8E4M3FN),
           (ml_dtypes.float8_e5m2, torch.float8_e5m2, TensorProto.FLOAT8E5M2)]


@pytest.mark.parametrize("np_type, torch_type, elem", FORMATS)
def test_ordinals_are_grid_steps(np_type, torch_type, elem):
    """Every finite code, sorted by its float64 value: consecutive ordinals differ by exactly 1
    (+0 and -0 share 0); integer codes are their own ordinals."""
    codes = np.arange(256, dtype=np.uint8).view(np_type)
    values = codes.astype(np.float64)
    finite = np.isfinite(values)
    order = np.argsort(values[finite], kind="stable")
    steps = np.diff(ordinals(codes)[finite][order])
    zeros = values[finite][order] == 0
    assert set(steps[~(zeros[1:] & zeros[:-1])].tolist()) == {1}
    assert (steps[zeros[1:] & zeros[:-1]] == 0).all()
    assert ordinals(np.array([-128, 0, 127], np.int8)).tolist() == [-128, 0, 127]
    assert is_float8(codes) and is_code(codes) and is_code(np.int8(1)) and not is_code(np.float32(1))


@pytest.mark.parametrize("np_type, torch_type, elem", FORMATS)
def test_torch_and_ml_dtypes_same_bits(np_type, torch_type, elem):
    """as_numpy / as_torch keep the bits: torch's float8 values equal ml_dtypes' for every pattern."""
    bits = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    t = bits.view(torch_type)
    a = as_numpy(t)
    assert a.dtype == np.dtype(np_type)
    assert np.array_equal(a.view(np.uint8), bits.numpy())
    finite = torch.isfinite(t.float())
    assert np.array_equal(a.astype(np.float32)[finite.numpy()], t.float()[finite].numpy())
    back = as_torch(a)
    assert back.dtype == torch_type and torch.equal(back.view(torch.uint8), bits)


def _fp8_graph(elem):
    """x (float8) -> DQ(0.5) -> Mul(1.7) -> Q(float8, 0.25) -> c -> DQ(0.25) -> Add(0.5) -> y (float32),
    and c's codes as a second output."""
    zp = numpy_helper.from_array(np.zeros((), np.uint8), "zp")
    zp.data_type = elem  # a float8 zero point: the raw byte 0 is +0
    inits = [numpy_helper.from_array(np.float32(0.5), "s1"), numpy_helper.from_array(np.float32(0.25), "s2"),
             numpy_helper.from_array(np.float32(1.7), "k"), numpy_helper.from_array(np.float32(0.5), "h"), zp]
    nodes = [helper.make_node("DequantizeLinear", ["x", "s1", "zp"], ["a"], name="dq1"),
             helper.make_node("Mul", ["a", "k"], ["b"], name="mul"),
             helper.make_node("QuantizeLinear", ["b", "s2", "zp"], ["c"], name="q"),
             helper.make_node("DequantizeLinear", ["c", "s2", "zp"], ["d"], name="dq2"),
             helper.make_node("Add", ["d", "h"], ["y"], name="add")]
    g = helper.make_graph(nodes, "fp8", [helper.make_tensor_value_info("x", elem, [2, 8])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 8]),
                           helper.make_tensor_value_info("c", elem, [2, 8])], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 19)])
    onnx.checker.check_model(m, full_check=True)
    return m


@pytest.mark.parametrize("np_type, torch_type, elem", FORMATS)
def test_onnxruntime_float8_feed_and_fetch(np_type, torch_type, elem):
    """ort_run_all feeds a float8 input as an OrtValue and hands back float8 outputs as ml_dtypes
    arrays holding onnxruntime's codes: equal to torch's float32 chain and float8 cast."""
    pytest.importorskip("onnxruntime")
    from dal.verification.onnx_tools import ort_run_all

    g = torch.Generator().manual_seed(0)
    x = (torch.randn(2, 8, generator=g) * 20).to(torch_type)
    (y, c), inter = ort_run_all(_fp8_graph(elem), {"x": as_numpy(x)})
    b = x.float() * torch.tensor(0.5) * torch.tensor(1.7)
    want_c = (b / torch.tensor(0.25)).to(torch_type)  # saturating cast: QuantizeLinear's saturate=1
    assert c.dtype == np.dtype(np_type) and np.array_equal(c.view(np.uint8), as_numpy(want_c).view(np.uint8))
    assert np.array_equal(y, (want_c.float() * 0.25 + 0.5).numpy())
    assert np.array_equal(inter["c"].view(np.uint8), c.view(np.uint8))  # a coded graph output is a layer too


def _judged(v: float):
    """(near-ties, failures) for an int8 input whose exact value ``v`` reaches a float8 e4m3fn
    QuantizeLinear (scale 1): the engines' codes are 1.0 and 1.125, the boundary 1.0625."""
    x = np.array([[16]], np.int8)
    s = Fraction(v) / 16  # DQ(16, s) = v exactly: s a float32 (checked below)
    zp8 = numpy_helper.from_array(np.zeros((), np.uint8), "zp8")
    zp8.data_type = TensorProto.FLOAT8E4M3FN
    inits = [numpy_helper.from_array(np.float32(s), "s"), numpy_helper.from_array(np.int8(0), "zp"),
             numpy_helper.from_array(np.float32(1.0), "one"), zp8]
    nodes = [helper.make_node("DequantizeLinear", ["x", "s", "zp"], ["a"], name="dq"),
             helper.make_node("QuantizeLinear", ["a", "one", "zp8"], ["q"], name="q")]
    m = helper.make_model(helper.make_graph(nodes, "t", [helper.make_tensor_value_info("x", TensorProto.INT8, [1, 1])],
                                            [helper.make_tensor_value_info("q", TensorProto.FLOAT8E4M3FN, [1, 1])],
                                            inits), opset_imports=[helper.make_opsetid("", 19)])
    assert Fraction(float(np.float32(s))) * 16 == Fraction(v)
    ev = LayerEvaluator(m, {"x": x}, {"x": x})
    mine = np.array([[1.0]], ml_dtypes.float8_e4m3fn)
    theirs = np.array([[1.125]], ml_dtypes.float8_e4m3fn)
    return judge_codes(ev, m.graph.node[1], mine, theirs)[:2]


def test_float8_near_tie_is_the_midpoint():
    """A one-step float8 difference is a near-tie only when the exact value is within the bound
    of the two codes' midpoint: at 1.0625 it is, at 1.03125 (1/32 away, ~1e6 bounds) it is not."""
    assert _judged(1.0625) == (1, 0)
    assert _judged(1.03125) == (0, 1)
