"""PRelu, Celu, Selu, Sign, LogSoftmax and DepthToSpace in dal.npu (export/SPEC.md §5a, §5h): the
nodes torch writes for nn.PReLU, nn.CELU, nn.SELU, nn.LPPool2d, F.log_softmax and nn.PixelShuffle.

Oracles: torch's own float64 functions (F.prelu, F.celu, F.selu, torch.sign, F.log_softmax),
rounded once to float32 by numpy (the rule: each node one rounding from float64), torch's
pixel_shuffle for DepthToSpace (CRD, what torch exports) and onnx.reference for the DCR mode and
for every node's attribute semantics within float32 rounding.
"""
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from onnx import TensorProto, helper, numpy_helper

import dal.npu
from dal.npu import NPUError
from oracles import run_reference


def _one_node(op, x, extra=(), opset=13, **attrs):
    inputs = ["x"] + [name for name, _ in extra]
    inits = [numpy_helper.from_array(v, name) for name, v in extra]
    et = {np.dtype(np.float32): TensorProto.FLOAT, np.dtype(np.int8): TensorProto.INT8}[x.dtype]
    graph = helper.make_graph([helper.make_node(op, inputs, ["y"], name="the_op", **attrs)], op,
                              [helper.make_tensor_value_info("x", et, list(x.shape))],
                              [helper.make_tensor_value_info("y", et, None)], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 8
    return model


_ALPHA, _GAMMA = 1.6732632423543772848170429916717, 1.0507009873554804934193349852946  # torch's SELU


def _data():
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((2, 3, 40)) * np.exp2(rng.integers(-6, 5, size=(2, 3, 40)))).astype(np.float32)
    x[0, 0, :4] = [0.0, -0.0, 1e-30, -1e-30]
    return x


def _f64(fn, x):
    return fn(torch.from_numpy(x).double()).numpy().astype(np.float32)


@pytest.mark.parametrize("op,attrs,oracle", [
    ("Celu", {"alpha": 0.5}, lambda t: F.celu(t, alpha=float(np.float32(0.5)))),
    ("Celu", {}, F.celu),
    # torch's SELU constants are not float32 values; the file's (ONNX defaults) are
    ("Selu", {}, lambda t: float(np.float32(_GAMMA)) * F.elu(t, alpha=float(np.float32(_ALPHA)))),
    ("Sign", {}, torch.sign),
])
def test_float64_rounded_once(op, attrs, oracle):
    x = _data()
    model = _one_node(op, x, **attrs)
    got = dal.npu.run(model, {"x": x})[0]
    want = _f64(oracle, x)
    assert got.dtype == np.float32 and np.array_equal(got, want)
    ref = run_reference(model, {"x": x})[0]  # ONNX's own semantics, computed in float32
    assert np.allclose(got, ref, rtol=4e-7, atol=1e-37)


@pytest.mark.parametrize("axis", [1, -1])
def test_log_softmax_is_the_float64_value_rounded_once(axis):
    """Python's math.fsum / math.log1p per row (an exactly rounded sum of the float64 exps) is the
    oracle; a row whose other terms are tiny (-2e-11) is where log(sum exp) loses digits."""
    import math
    x = _data()
    got = dal.npu.run(_one_node("LogSoftmax", x, axis=axis), {"x": x})[0]
    xm = np.moveaxis(x.astype(np.float64), axis, -1)
    want = np.empty(xm.shape, np.float64)
    for idx in np.ndindex(xm.shape[:-1]):
        row = xm[idx]
        k = int(np.argmax(row))
        d = [float(v) - float(row[k]) for v in row]
        lse = math.log1p(math.fsum(math.exp(v) for j, v in enumerate(d) if j != k))
        want[idx] = [v - lse for v in d]
    want = np.moveaxis(want, -1, axis).astype(np.float32)
    assert np.array_equal(got, want)
    torch_f64 = F.log_softmax(torch.from_numpy(x).double(), dim=axis).numpy().astype(np.float32)
    # torch's float64 log_softmax: within a float32 ulp, or its own float64 error (~1e-16) absolute
    assert np.allclose(got, torch_f64, rtol=2.4e-7, atol=1e-15)


def test_prelu_is_one_float32_multiplication():
    x = _data()
    slope = np.array([0.25, -0.1, 0.3], np.float32).reshape(3, 1)  # per channel, as torch exports it
    got = dal.npu.run(_one_node("PRelu", x, [("slope", slope)]), {"x": x})[0]
    want = F.prelu(torch.from_numpy(x), torch.from_numpy(slope.reshape(3))).numpy()
    assert np.array_equal(got, want)
    assert np.array_equal(got, run_reference(_one_node("PRelu", x, [("slope", slope)]), {"x": x})[0])


@pytest.mark.parametrize("dtype", [np.float32, np.int8])
def test_depth_to_space_crd_is_pixel_shuffle(dtype):
    x = np.random.default_rng(1).integers(-100, 100, size=(2, 8, 3, 5)).astype(dtype)
    got = dal.npu.run(_one_node("DepthToSpace", x, blocksize=2, mode="CRD"), {"x": x})[0]
    assert got.dtype == dtype and np.array_equal(got, F.pixel_shuffle(torch.from_numpy(x), 2).numpy())


def test_depth_to_space_dcr_matches_onnx_reference():
    x = np.random.default_rng(2).standard_normal((1, 18, 2, 3)).astype(np.float32)
    model = _one_node("DepthToSpace", x, blocksize=3)
    assert np.array_equal(dal.npu.run(model, {"x": x})[0], run_reference(model, {"x": x})[0])


def test_depth_to_space_bad_channels_are_named():
    x = np.zeros((1, 6, 2, 2), np.float32)
    with pytest.raises(NPUError, match="the_op.*DepthToSpace.*blocksize"):
        dal.npu.run(_one_node("DepthToSpace", x, blocksize=2), {"x": x})
