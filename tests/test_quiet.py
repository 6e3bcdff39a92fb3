"""dal is quiet by default: the everyday flow raises no warning from dal's own code, and the
exported outputs have names a user can read."""
import warnings

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper

import dal
import dal.npu
from dal_examples.zoo import MnistCNN

DAL_MODULES = r"dal(\.|$)"  # warnings attributed to dal's own modules (not torch's, not numpy's)


@pytest.fixture
def dal_warnings_are_errors():
    with warnings.catch_warnings():
        warnings.filterwarnings("error", module=DAL_MODULES)
        yield


def test_the_demo_flow_warns_nothing_from_dal(tmp_path, dal_warnings_are_errors):
    torch.manual_seed(0)
    x = torch.randn(4, 1, 28, 28)
    model = dal.prepare_qat(MnistCNN(), recipe="int8_balanced", hardware="a2000", example_inputs=(x,))
    dal.calibrate(model, [torch.randn(4, 1, 28, 28) for _ in range(2)], progress=False)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    model.train()
    model(x).square().mean().backward()  # one QAT step
    optimizer.step()
    dal.set_quantizer_state(model, "frozen")
    path = tmp_path / "m.onnx"
    proto = dal.export_onnx(model, (x,), path)
    report = dal.verify(path, model, (x,))
    assert [o.name for o in proto.graph.output] == ["output"]  # not torch's number ("375")
    assert [i.name for i in proto.graph.input] == ["input"]
    assert list(report.outputs) == ["output"]
    assert report.meets_criterion(), report


class TwoHeads(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.body, self.a, self.b = torch.nn.Linear(8, 8), torch.nn.Linear(8, 3), torch.nn.Linear(8, 2)

    def forward(self, x):
        h = torch.relu(self.body(x))
        return self.a(h), self.b(h)


def _two_heads():
    torch.manual_seed(0)
    x = torch.randn(4, 8)
    model = dal.prepare_qat(TwoHeads(), recipe="int8_balanced", hardware="a2000", example_inputs=(x,))
    dal.calibrate(model, [torch.randn(4, 8) for _ in range(2)], progress=False)
    dal.set_quantizer_state(model, "frozen")
    return model, x


def test_several_outputs_are_numbered_and_explicit_names_are_kept(tmp_path):
    model, x = _two_heads()
    proto = dal.export_onnx(model, (x,))
    assert [o.name for o in proto.graph.output] == ["output.0", "output.1"]  # dal.nest names
    proto = dal.export_onnx(model, (x,), output_names=["logits", "boxes"])
    assert [o.name for o in proto.graph.output] == ["logits", "boxes"]
    # the renamed file runs: the NPU reference and onnxruntime agree on both outputs
    report = dal.verify(proto, model, (x,))
    assert set(report.outputs) == {"logits", "boxes"} and report.meets_criterion(), report


def _unary_model(op_type: str, dtype: int) -> onnx.ModelProto:
    node = helper.make_node(op_type, ["x"], ["y"], name=op_type.lower())
    graph = helper.make_graph([node], op_type, [helper.make_tensor_value_info("x", dtype, [None])],
                              [helper.make_tensor_value_info("y", dtype, [None])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


# Far tails: exp(-x) overflows float64 below x = -709.78; exp(x) overflows float32 above x = 88.72.
TAILS = np.array([-1e30, -800.0, -709.79, -709.78, -100.0, -88.8, -1.0, 0.0, 1.0, 88.72, 88.73, 100.0, 1e30,
                  np.inf, -np.inf, np.nan], dtype=np.float32)


@pytest.mark.parametrize("op_type,formula", [
    ("Sigmoid", lambda x: 1.0 / (1.0 + np.exp(-x.astype(np.float64)))),
    ("Exp", np.exp),
])
def test_npu_float_ops_do_not_overflow_and_keep_their_values(op_type, formula, dal_warnings_are_errors):
    x = np.concatenate([TAILS, np.random.default_rng(0).normal(0, 300, 10000).astype(np.float32)])
    with np.errstate(over="ignore"):  # the textbook formula overflows to inf, which is the right answer
        expected = formula(x).astype(np.float32)
    (y,) = dal.npu.run(_unary_model(op_type, TensorProto.FLOAT), {"x": x})
    assert y.dtype == np.float32
    np.testing.assert_array_equal(y, expected)  # bit for bit, inf and nan included
