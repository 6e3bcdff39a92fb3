"""near_tie's float32 error bounds for LayerNormalization and InstanceNormalization (GroupNorm's export;
near_tie_smooth.layer_norm_bound / instance_norm_bound) against
the float64 oracle (torch's float64 layer_norm): onnxruntime (optimizations off, float32, its own
algorithm) and torch's float32 CPU layer_norm (the QAT model's) lie within the bound of the float64
value, also on rows whose mean dwarfs their spread (one-pass variance cancels there); the exact
float64 LayerNorm of inputs moved anywhere inside their error bounds ``e`` lies within it; and the
bound stays small (a bound that admits anything would make every differing code a near-tie)."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from onnx import TensorProto, helper

from dal.verification.near_tie import U, Exact, NoBound
from dal.verification.near_tie_smooth import layer_norm_bound
from oracles import run_ort


def _exact(a: np.ndarray, e=None) -> Exact:
    v = torch.from_numpy(a.astype(np.float64))
    return Exact(v, U * v.abs() if e is None else torch.full_like(v, e), v.abs())


def _data(offset: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(3)
    x = (rng.standard_normal((4, 16, 64)) * 2 + offset * rng.standard_normal((4, 16, 1))).astype(np.float32)
    return x, (rng.standard_normal(64) * 0.5 + 1).astype(np.float32), (rng.standard_normal(64) * 0.2).astype(np.float32)


def _node():
    return helper.make_node("LayerNormalization", ["x", "s", "b"], ["y"], name="ln", axis=-1, epsilon=1e-5)


def _f64(x, s, b):
    return torch.nn.functional.layer_norm(torch.from_numpy(x).double(), (x.shape[-1],), torch.from_numpy(s).double(),
                                          torch.from_numpy(b).double(), 1e-5).numpy()


@pytest.mark.parametrize("offset", [0.0, 30.0])
def test_layer_norm_bound_holds_for_onnxruntime_and_torch_float32(offset):
    x, s, b = _data(offset)
    model = helper.make_model(helper.make_graph(
        [_node()], "ln", [helper.make_tensor_value_info(k, TensorProto.FLOAT, a.shape) for k, a in
                          (("x", x), ("s", s), ("b", b))],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)]), opset_imports=[helper.make_opsetid("", 17)])
    ort = run_ort(model, {"x": x, "s": s, "b": b})[0].astype(np.float64)
    tf32 = torch.nn.functional.layer_norm(torch.from_numpy(x), (64,), torch.from_numpy(s), torch.from_numpy(b),
                                          1e-5).double().numpy()
    exact = _f64(x, s, b)
    bound = layer_norm_bound(_node(), _exact(x), _exact(s), _exact(b))
    assert np.allclose(bound.v.numpy(), exact, rtol=0, atol=1e-12)
    e = bound.e.numpy()
    for got in (ort, tf32):
        err = np.abs(got - exact)
        assert err.max() > 0  # float32 really differs: the check has something to hold
        assert np.all(err <= e), float((err - e).max())
    # ~2e-5 of |y| ~ 3 without offset; one-pass cancellation grows it with mean(x^2) / V: not a blanket
    assert float(e.max()) < 3e-4 * (1 + offset ** 2)


def test_layer_norm_bound_covers_the_inputs_own_errors():
    x, s, b = _data(0.0)
    e_in = 1e-3
    bound = layer_norm_bound(_node(), _exact(x, e_in), _exact(s), _exact(b))
    rng = np.random.default_rng(4)
    exact = _f64(x, s, b)
    for _ in range(20):
        moved = x.astype(np.float64) + rng.choice([-e_in, e_in], size=x.shape)
        y = torch.nn.functional.layer_norm(torch.from_numpy(moved), (64,), torch.from_numpy(s).double(),
                                           torch.from_numpy(b).double(), 1e-5).numpy()
        assert np.all(np.abs(y - exact) <= bound.e.numpy())
    assert float(bound.e.max()) < 0.05  # ~ |s| (2 e) / sigma, sigma ~ 2


def test_layer_norm_without_spread_has_no_bound():
    x = np.ones((1, 2, 8), np.float32)
    with pytest.raises(NoBound, match="ln \\(LayerNormalization\\)"):
        layer_norm_bound(_node(), _exact(x, 1.0), _exact(np.ones(8, np.float32)), None)


def test_layer_evaluator_bounds_a_layer_behind_a_layer_norm():
    """DQ -> LayerNormalization -> Q: the value before rounding is the float64 LayerNorm of the
    dequantized codes over the output scale (the oracle: torch's float64 layer_norm), with a finite,
    small bound, where before LayerNormalization had no error model (every differing code a failure)."""
    from onnx import numpy_helper

    from dal.verification.near_tie import LayerEvaluator

    rng = np.random.default_rng(5)
    codes = rng.integers(-128, 128, (1, 6, 32)).astype(np.int8)
    s, b = (rng.standard_normal(32) * 0.5 + 1).astype(np.float32), (rng.standard_normal(32) * 0.2).astype(np.float32)
    inits = [numpy_helper.from_array(a, k) for k, a in (("xs", np.array(0.05, np.float32)), ("xz", np.array(0, np.int8)),
                                                         ("s", s), ("b", b), ("ys", np.array(0.02, np.float32)),
                                                         ("yz", np.array(3, np.int8)))]
    nodes = [helper.make_node("DequantizeLinear", ["q", "xs", "xz"], ["x"], name="dq"),
             helper.make_node("LayerNormalization", ["x", "s", "b"], ["y"], name="ln", axis=-1, epsilon=1e-5),
             helper.make_node("QuantizeLinear", ["y", "ys", "yz"], ["out"], name="out/QuantizeLinear")]
    model = helper.make_model(helper.make_graph(nodes, "g", [helper.make_tensor_value_info("q", TensorProto.INT8, None)],
                                                [helper.make_tensor_value_info("out", TensorProto.INT8, None)], inits),
                              opset_imports=[helper.make_opsetid("", 17)])
    v, bound = LayerEvaluator(model, {"q": codes}, {}).pre_rounding(nodes[2])
    ref = _f64(codes.astype(np.float64) * float(np.float32(0.05)), s, b) / float(np.float32(0.02)) + 3
    assert np.allclose(v, ref, rtol=0, atol=1e-9)
    assert np.all(np.isfinite(bound)) and float(bound.max()) < 1e-2  # in codes


@pytest.mark.parametrize("offset", [0, 90])
def test_group_norm_chain_bound_holds_for_onnxruntime_and_torch_float32(offset):
    """torch's GroupNorm export, DQ -> Reshape -> InstanceNormalization(scale 1, B 0) -> Reshape ->
    Mul(gamma) -> Add(beta) -> Q, through LayerEvaluator (near_tie_smooth.instance_norm_bound, then
    Mul and Add): the value is torch's float64 group_norm of the dequantized codes (the oracle), and
    onnxruntime's float32 result and torch's float32 group_norm (statistics in float32, affine folded)
    lie within the bound of it, in output codes."""
    from onnx import numpy_helper

    from dal.verification.near_tie import LayerEvaluator

    rng = np.random.default_rng(6)
    codes = np.clip(rng.normal(offset, 20, (2, 8, 6, 6)).round(), -128, 127).astype(np.int8)
    gam = (rng.standard_normal((8, 1, 1)) * 0.5 + 1).astype(np.float32)
    bet = (rng.standard_normal((8, 1, 1)) * 0.2).astype(np.float32)
    xs, ys = np.float32(0.05), np.float32(0.01)
    inits = [numpy_helper.from_array(a, k) for k, a in (
        ("xs", np.array(xs)), ("xz", np.array(0, np.int8)), ("shape_g", np.array([0, 2, -1], np.int64)),
        ("one", np.ones(2, np.float32)), ("zero", np.zeros(2, np.float32)), ("shape_x", np.array([2, 8, 6, 6], np.int64)),
        ("gamma", gam), ("beta", bet), ("ys", np.array(ys)), ("yz", np.array(0, np.int16)))]
    nodes = [helper.make_node("DequantizeLinear", ["q", "xs", "xz"], ["x"], name="dq"),
             helper.make_node("Reshape", ["x", "shape_g"], ["xg"], name="r1"),
             helper.make_node("InstanceNormalization", ["xg", "one", "zero"], ["n"], name="in", epsilon=1e-5),
             helper.make_node("Reshape", ["n", "shape_x"], ["nx"], name="r2"),
             helper.make_node("Mul", ["nx", "gamma"], ["m"], name="mul"),
             helper.make_node("Add", ["m", "beta"], ["y"], name="add"),
             helper.make_node("QuantizeLinear", ["y", "ys", "yz"], ["out"], name="out/QuantizeLinear")]
    model = helper.make_model(helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("q", TensorProto.INT8, None)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None),
         helper.make_tensor_value_info("out", TensorProto.INT16, None)], inits), opset_imports=[helper.make_opsetid("", 21)])
    v, bound = LayerEvaluator(model, {"q": codes}, {}).pre_rounding(nodes[-1])
    x64 = torch.from_numpy(codes.astype(np.float64) * float(xs))
    ref = torch.nn.functional.group_norm(x64, 2, torch.from_numpy(gam.reshape(-1)).double(),
                                         torch.from_numpy(bet.reshape(-1)).double(), 1e-5).numpy() / float(ys)
    assert np.allclose(v, ref, rtol=0, atol=1e-8)
    ort = run_ort(model, {"q": codes})[0].astype(np.float64) / float(ys)
    tf32 = torch.nn.functional.group_norm(x64.float(), 2, torch.from_numpy(gam.reshape(-1)),
                                          torch.from_numpy(bet.reshape(-1)), 1e-5).double().numpy() / float(ys)
    for got in (ort, tf32):
        err = np.abs(got - v)
        assert err.max() > 0
        assert np.all(err <= bound), float((err - bound).max())
    assert float(bound.max()) < 1e-3 * float(np.abs(v).max())  # a 1-LSB difference far from a boundary fails
