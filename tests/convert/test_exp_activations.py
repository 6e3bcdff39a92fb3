"""dal.convert's exponential activations (dal/convert/exp_activations.py) equal dal.npu's nodes bit
for bit: Elu, Celu, Selu, Softplus, LogSoftmax, and Mish as torch exports it (Softplus, Tanh, Mul).

Both integer engines must agree on every element (DESIGN.md); the forms are run under NPUFloatOps
(as the integer model calls them: F.elu, F.celu, F.selu, F.softplus, F.mish, F.log_softmax) and
compared with dal.npu running the one-node file, on inputs with +-inf, NaN, +-0, subnormals and
large magnitudes. Each case also shows that torch's own float32 kernel differs on some element
(the form is what makes them agree, so the comparison can fail).
"""
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from onnx import TensorProto, helper

import dal.npu
from dal.convert.float_ops import NPUFloatOps


def _data():
    rng = np.random.default_rng(3)
    x = (rng.standard_normal((4, 2000)) * np.exp2(rng.integers(-12, 7, size=(4, 2000)))).astype(np.float32)
    x[0, :8] = [0.0, -0.0, np.inf, -np.inf, np.nan, 1e-40, -1e-40, -88.5]
    x[1, :4] = [40.0, -40.0, 1e-7, -1e-7]
    return x


def _graph(nodes, x):
    graph = helper.make_graph(nodes, "act", [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(x.shape))],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    return model


CASES = {
    "elu": ([helper.make_node("Elu", ["x"], ["y"], alpha=0.7)], lambda t: F.elu(t, alpha=0.7)),
    "celu": ([helper.make_node("Celu", ["x"], ["y"], alpha=0.3)], lambda t: F.celu(t, alpha=0.3)),
    "selu": ([helper.make_node("Selu", ["x"], ["y"])], F.selu),
    "softplus": ([helper.make_node("Softplus", ["x"], ["y"])], F.softplus),
    "mish": ([helper.make_node("Softplus", ["x"], ["s"]), helper.make_node("Tanh", ["s"], ["t"]),
              helper.make_node("Mul", ["x", "t"], ["y"])], F.mish),
    "log_softmax": ([helper.make_node("LogSoftmax", ["x"], ["y"], axis=1)], lambda t: F.log_softmax(t, dim=1)),
}


@pytest.mark.parametrize("name", list(CASES))
def test_the_form_equals_the_npu_node(name):
    nodes, call = CASES[name]
    x = _data()
    if name == "log_softmax":
        x = np.where(np.isfinite(x), x, np.float32(3.0)).astype(np.float32)  # a row with inf / NaN is all NaN
    npu = dal.npu.run(_graph(nodes, x), {"x": x})[0]
    t = torch.from_numpy(x.copy())
    with NPUFloatOps():
        got = call(t).numpy()
    assert got.dtype == np.float32
    number = ~np.isnan(npu)
    assert np.array_equal(got, npu, equal_nan=True) and np.array_equal(np.signbit(got[number]), np.signbit(npu[number])), \
        f"{name}: {np.sum(got != npu)} elements differ from dal.npu"
    plain = call(t).numpy()  # torch's float32 kernel, outside the mode
    assert np.any(plain[np.isfinite(plain)] != npu[np.isfinite(plain)]), f"{name}: torch's own kernel agrees anyway"


def test_other_arguments_leave_torch_its_op():
    x = torch.randn(3, 4)
    with NPUFloatOps():
        assert torch.equal(F.softplus(x, beta=2.0), F.softplus(x.clone(), beta=2.0))  # Mul / Softplus / Div
        assert F.log_softmax(x.double(), dim=1).dtype == torch.float64
