"""float64 in exported graphs: torch's TorchScript ``linspace`` symbolic computes in double whatever
``dtype`` says (Hugging Face Deformable-DETR's reference points), and a QuantizeLinear on a float64
tensor is refused by name (export/SPEC.md §8).

Oracles: torch's own ``torch.linspace`` values and onnxruntime (optimizations off) running the file.
"""
import io

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

from dal.export import ExportError
from dal.export.float64_check import check_no_float64_quantize
from dal.export.symbolics import dal_symbolics
from oracles import run_ort


class _Grid(torch.nn.Module):
    """Reference points as Deformable-DETR's encoder makes them: linspace(dtype=x.dtype) / size."""

    def forward(self, x):
        h, w = x.shape[-2], x.shape[-1]
        ys = torch.linspace(0.5, h - 0.5, h, dtype=x.dtype) / h
        xs = torch.linspace(0.1, 0.9, w)  # dtype None: torch's default, float32
        return x * ys[:, None] + xs


def _export(model, x, dynamic: bool) -> onnx.ModelProto:
    buf = io.BytesIO()
    axes = {"x": {2: "h", 3: "w"}} if dynamic else None
    with dal_symbolics(17):
        torch.onnx.export(model, (x,), buf, dynamo=False, opset_version=17, input_names=["x"],
                          dynamic_axes=axes)
    return onnx.load_from_string(buf.getvalue())


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.parametrize("dynamic", [False, True])
def test_linspace_exports_in_its_dtype_with_torchs_values(dynamic):
    x = torch.randn(1, 2, 7, 9)
    proto = _export(_Grid(), x, dynamic)
    onnx.checker.check_model(proto, full_check=True)
    inferred = onnx.shape_inference.infer_shapes(proto).graph
    types = {v.name: v.type.tensor_type.elem_type for v in list(inferred.value_info) + list(inferred.output)}
    assert TensorProto.DOUBLE not in types.values()
    got = run_ort(proto, {"x": x.numpy()})[0]
    want = _Grid()(x).numpy()
    assert got.dtype == np.float32
    if not dynamic:  # constants: torch's own linspace values, so every element is torch's
        assert np.array_equal(got, want)
    else:  # computed in the graph (double formula, one Cast): within an ulp of torch's values
        assert np.allclose(got, want, rtol=2 ** -22, atol=2 ** -22)


def test_linspace_symbolic_is_torchs_again_after_export():
    import torch.onnx.symbolic_opset9 as s9
    from torch.onnx._internal.torchscript_exporter import registration
    with dal_symbolics(17):
        assert registration.registry.get_function_group("aten::linspace").get(17) is not s9.linspace
    assert registration.registry.get_function_group("aten::linspace").get(17) is s9.linspace


def test_quantize_of_a_float64_tensor_is_refused_naming_the_quantizer_and_the_origin():
    nodes = [helper.make_node("Cast", ["x"], ["x64"], name="/model/Cast_to_double", to=TensorProto.DOUBLE),
             helper.make_node("Mul", ["x64", "x64"], ["sq"], name="/model/Mul"),
             helper.make_node("QuantizeLinear", ["sq", "s", "z"], ["q"], name="blk.add_l7_0.input_quants.0/QuantizeLinear"),
             helper.make_node("DequantizeLinear", ["q", "s", "z"], ["y"], name="blk.add_l7_0.input_quants.0/DequantizeLinear")]
    inits = [numpy_helper.from_array(np.float32(0.1), "s"), numpy_helper.from_array(np.int8(0), "z")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])], inits)
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    with pytest.raises(ExportError, match=r"blk\.add_l7_0\.input_quants\.0: .*float64 starts at /model/Cast_to_double \(Cast\)"):
        check_no_float64_quantize(proto)
    proto.graph.node[0].attribute[0].i = TensorProto.FLOAT  # float32 all the way: nothing to refuse
    check_no_float64_quantize(proto)


class _Float64Add(torch.nn.Module):
    """A quantized add whose inputs the model itself computes in float64."""

    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 4, 3, padding=1)

    def forward(self, x):
        return (self.conv(x).double() + torch.arange(8, dtype=torch.float64) / 8).float()


def test_export_of_a_model_quantizing_float64_is_refused_by_name():
    import dal
    x = torch.randn(1, 3, 8, 8)
    p = dal.prepare_qat(_Float64Add(), recipe="int8_balanced", hardware="a2000", example_inputs=(x,))
    dal.calibrate(p, [x], progress=False)
    with pytest.raises(ExportError, match=r"add\.input_quants\.0: its input .* is float64; float64 starts at /model/Cast \(Cast\)"):
        dal.export_onnx(p, (x,))
