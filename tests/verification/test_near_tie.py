"""The near-tie test of one differing code, against exact rational arithmetic (fractions.Fraction).

A one-layer QDQ graph (DQ x, DQ w -> MatMul -> Q) is built with an output scale chosen (among
float32 neighbours) so that the exact value before rounding lies a chosen distance from the
boundary k + 0.5. The expected verdict is computed here: the exact value with Fractions, and the
bound from near_tie's documented formula evaluated in Fractions (for MatMul of fan-in n, DQ
errors u|x|, u|w|: e = sum |x_i w_i| (2u + u^2 + gamma_{n+2} (1 + u)^2); in codes E = e / s_y +
2u|v| (the float division) + 2u|v| (the NPU's float requantizer)). A code difference of 1 at a
value 0.9 E from the boundary is a near-tie; at 1.1 E it is not; a difference of 2 never is.
"""
from fractions import Fraction

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from dal.verification.layer_verdict import judge_codes
from dal.verification.near_tie import LayerEvaluator, gamma, is_near_tie

U = Fraction(1, 2 ** 24)
N = 64


def _codes():
    rng = np.random.default_rng(7)
    x = rng.integers(-100, 101, size=(1, N)).astype(np.int8)
    w = rng.integers(-100, 101, size=(N, 1)).astype(np.int8)
    if int((x.astype(np.int64) @ w.astype(np.int64)).reshape(())) < 0:
        w = -w  # a positive accumulator: the value lands above 100
    return x, w


def _model(x_scale, w_scale, y_scale):
    _, w = _codes()
    inits = [numpy_helper.from_array(np.float32(x_scale).reshape(()), "xs"),
             numpy_helper.from_array(np.int8(0).reshape(()), "xz"),
             numpy_helper.from_array(w, "w.weight_quant.codes"),
             numpy_helper.from_array(np.float32(w_scale).reshape(()), "ws"),
             numpy_helper.from_array(np.int8(0).reshape(()), "wz"),
             numpy_helper.from_array(np.float32(y_scale).reshape(()), "ys"),
             numpy_helper.from_array(np.int16(0).reshape(()), "yz")]
    nodes = [helper.make_node("DequantizeLinear", ["xq", "xs", "xz"], ["xd"], name="x/DequantizeLinear"),
             helper.make_node("DequantizeLinear", ["w.weight_quant.codes", "ws", "wz"], ["wd"], name="w/DequantizeLinear"),
             helper.make_node("MatMul", ["xd", "wd"], ["y"], name="/model/w/MatMul"),
             helper.make_node("QuantizeLinear", ["y", "ys", "yz"], ["yq"], name="out/QuantizeLinear")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("xq", TensorProto.INT8, [1, N])],
                              [helper.make_tensor_value_info("yq", TensorProto.INT16, [1, 1])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])


def _exact(x_scale, w_scale, y_scale):
    """(v in codes, bound E in codes), both as Fractions, from the integers and the float32 scales."""
    x, w = _codes()
    xs, ws, ys = (Fraction(float(np.float32(s))) for s in (x_scale, w_scale, y_scale))
    terms = [int(a) * int(b) for a, b in zip(x.reshape(-1), w.reshape(-1))]
    v = sum(terms) * xs * ws / ys
    g = Fraction(gamma(N + 2))  # gamma_{n+2} as the float it is (its own rounding is 1e-16 relative)
    abs_sum = sum(abs(t) for t in terms) * xs * ws
    e = abs_sum * (2 * U + U * U + g * (1 + U) ** 2)
    return v, e / ys + 4 * U * abs(v)


def _scale_at(distance_in_bounds: float):
    """An output scale (float32) whose exact value lies ``distance_in_bounds`` E above the boundary below it."""
    x, w = _codes()
    acc = int((x.astype(np.int64) @ w.astype(np.int64)).reshape(()))
    assert acc > 1000, "the fixed seed gives a large positive accumulator"
    xs, ws = 0.05, 0.02
    ideal = float(acc) * xs * ws / 100.5  # lands on the boundary 100.5
    s = np.float32(ideal)
    best = None
    for _ in range(200000):  # walk float32 neighbours down: v grows ~6e-6 codes per step
        v, bound = _exact(xs, ws, s)
        d = v - (int(v) + Fraction(1, 2)) if v - int(v) >= Fraction(1, 2) else None
        if d is not None and d >= distance_in_bounds * bound:
            best = (s, v, bound)
            break
        s = np.nextafter(s, np.float32(0))
    assert best is not None
    return xs, ws, best


@pytest.mark.parametrize("where,expected", [(0.9, True), (1.1, False)])
def test_a_one_lsb_difference_is_a_near_tie_exactly_within_the_bound(where, expected):
    xs, ws, (ys, v, bound) = _scale_at(where)
    boundary = int(v) + Fraction(1, 2)
    assert (abs(v - boundary) <= bound) == expected  # the oracle's verdict, in exact arithmetic
    assert where * bound <= abs(v - boundary) < (where + 0.02) * bound  # close to the edge, not far past it
    model = _model(xs, ws, ys)
    x, _ = _codes()
    ev = LayerEvaluator(model, {"xq": x}, {}, {"kind": "float"})
    q_node = model.graph.node[-1]
    got_v, got_bound = ev.pre_rounding(q_node)
    assert float(got_v.reshape(())) == pytest.approx(float(v), abs=1e-9)
    assert float(got_bound.reshape(())) == pytest.approx(float(bound), rel=1e-6)
    lo = int(boundary - Fraction(1, 2))
    near, fail, note = judge_codes(ev, q_node, np.array([[lo]]), np.array([[lo + 1]]))
    assert (near, fail) == ((1, 0) if expected else (0, 1)), note
    # the boundary must lie between the two codes: the same value against codes k+1 / k+2 is no near-tie
    assert judge_codes(ev, q_node, np.array([[lo + 1]]), np.array([[lo + 2]]))[:2] == (0, 1)
    # two LSB apart is never a near-tie, whatever the value
    assert judge_codes(ev, q_node, np.array([[lo]]), np.array([[lo + 2]]))[:2] == (0, 1)


def test_is_near_tie_measures_the_distance_to_the_nearest_half():
    v = np.array([3.5, 3.5004, 3.4996, 3.0, -2.5001, 7.9])
    assert is_near_tie(v, 5e-4).tolist() == [True, True, True, False, True, False]


def test_an_op_without_an_error_model_is_a_failure_naming_it():
    x = np.array([[1, 2, 3]], dtype=np.int8)
    nodes = [helper.make_node("DequantizeLinear", ["xq", "s", "z"], ["xd"], name="dq"),
             helper.make_node("Softplus", ["xd"], ["y"], name="soft"),
             helper.make_node("QuantizeLinear", ["y", "s", "z"], ["yq"], name="q")]
    inits = [numpy_helper.from_array(np.float32(0.1).reshape(()), "s"), numpy_helper.from_array(np.int8(0).reshape(()), "z")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("xq", TensorProto.INT8, [1, 3])],
                              [helper.make_tensor_value_info("yq", TensorProto.INT8, [1, 3])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    onnx.checker.check_model(model)
    ev = LayerEvaluator(model, {"xq": x}, {}, None)
    near, fail, note = judge_codes(ev, model.graph.node[-1], np.array([[7, 8, 9]]), np.array([[7, 9, 9]]))
    assert (near, fail) == (0, 1) and "Softplus" in note and "soft" in note
