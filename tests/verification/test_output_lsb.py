"""Every output gets an LSB figure: a float output (detection heads after Reshape / Concat /
Sigmoid, no output quantizer) is compared in the scale of the last activation DequantizeLinear
feeding it (the issue-15 rule), the smallest when several feed it. Graphs written by hand, so
the expected scale is the one put in, not one dal computed."""
import numpy as np
import onnx
import torch
from onnx import TensorProto, helper, numpy_helper
from torch import nn

import dal
from dal.verification.onnx_tools import output_lsb


def _graph(nodes, inits, outputs):
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
                              [helper.make_tensor_value_info(o, TensorProto.FLOAT, ["n", "m"]) for o in outputs],
                              [numpy_helper.from_array(np.asarray(v), k) for k, v in inits.items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])


def _qdq(name, src, scale):
    return [helper.make_node("QuantizeLinear", [src, f"{name}_s", f"{name}_z"], [f"{name}_q"]),
            helper.make_node("DequantizeLinear", [f"{name}_q", f"{name}_s", f"{name}_z"], [f"{name}_dq"])], \
        {f"{name}_s": np.float32(scale), f"{name}_z": np.int8(0)}


def test_float_output_takes_the_smallest_nearest_activation_scale():
    a, ia = _qdq("a", "x", 0.05)
    b, ib = _qdq("b", "x", 0.02)
    far, ifar = _qdq("far", "x", 0.001)  # upstream of 'a2' through another DQ: not the nearest grid
    a2, ia2 = _qdq("a2", "far_dq", 0.03)
    nodes = a + b + far + a2 + [
        helper.make_node("Reshape", ["a_dq", "shape"], ["a_r"]),
        helper.make_node("Concat", ["a_r", "b_dq"], ["cat"], axis=1),
        helper.make_node("Sigmoid", ["cat"], ["head"]),
        helper.make_node("Relu", ["a2_dq"], ["other"])]
    model = _graph(nodes, {**ia, **ib, **ifar, **ia2, "shape": np.array([1, 4], dtype=np.int64)},
                   ["head", "a_dq", "other"])
    onnx.checker.check_model(model)
    assert output_lsb(model, "head") == np.float32(0.02)
    assert output_lsb(model, "a_dq") == np.float32(0.05)
    assert output_lsb(model, "other") == np.float32(0.03)


def test_weight_dequantize_is_not_an_activation_grid_and_pure_float_has_none():
    w = {"w_q": np.ones((4, 4), np.int8), "w_s": np.float32(0.5), "w_z": np.int8(0)}
    nodes = [helper.make_node("DequantizeLinear", ["w_q", "w_s", "w_z"], ["w"]),
             helper.make_node("MatMul", ["x", "w"], ["y"])]
    model = _graph(nodes, w, ["y"])
    assert output_lsb(model, "y") is None


class _TwoHeads(nn.Module):
    """A conv trunk and two heads whose raw outputs are flattened and concatenated (no output
    quantizer on the result), as a detector's box and class tensors are."""

    def __init__(self):
        super().__init__()
        self.trunk = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU())
        self.box = nn.Conv2d(8, 4, 1)
        self.cls = nn.Conv2d(8, 3, 1)

    def forward(self, x):
        f = self.trunk(x)
        return torch.cat([self.box(f).flatten(2), self.cls(f).flatten(2)], dim=1).permute(0, 2, 1)


def test_verify_gives_every_output_an_lsb_figure(tmp_path):
    torch.manual_seed(0)
    x = torch.randn(2, 3, 8, 8)
    model = dal.prepare_qat(_TwoHeads(), recipe="int8_balanced", hardware="a2000", example_inputs=(x,))
    dal.calibrate(model, [x, x * 1.5], progress=False)
    model.eval()
    path = str(tmp_path / "heads.onnx")
    dal.export_onnx(model, (x,), path)
    report = dal.verify(path, model, (x,))
    for name, pairs in report.outputs.items():
        for kind, agreement in pairs.items():
            assert agreement.lsb is not None and agreement.lsb > 0, f"{name} {kind} has no LSB figure"
            assert agreement.max_lsb is not None
