"""The two tracers of export_onnx (dal/export/routes.py) against each other.

The TorchScript route (``torch.onnx.export(dynamo=False)``) is the reference: torch's own exporter,
whose files every other export test checks against onnxruntime, onnx.reference and torch. The
dynamo route (``torch.export`` + the dynamo ONNX exporter) must write the same file after dal's
rewrites: the same nodes (operator, domain, attributes: an attribute written with its schema's
default counts as one left out) in the same order, and the same constants
bit for bit (every initializer and Constant value in order of first use: dtype, shape, bytes).
Tensor names may differ (torch names them); a ``Constant`` node and an initializer holding the
same value count as the same constant.

``route="auto"`` takes the dynamo route and falls back to TorchScript for a model torch.export
cannot capture; the file says which route ran and why (``dal.export_route``,
``dal.export_route_reason``).
"""
import numpy as np
import pytest
import torch
from onnx import defs, helper, numpy_helper
from torch import nn

from dal.export import ExportError, export_onnx
from dal_examples import zoo
from export_common import SmallCNN, calibrated_mixed, prepared, randomize_bn

pytest.importorskip("onnxscript")


def _meta(proto) -> dict:
    return {p.key: p.value for p in proto.metadata_props}


def _constant_key(array: np.ndarray):
    return str(array.dtype), array.shape, np.ascontiguousarray(array).tobytes()


def _attributes(node, opset):
    """The node's attributes as comparable values, those equal to the schema's default left out."""
    schema = defs.get_schema(node.op_type, opset, node.domain)
    found = []
    for a in node.attribute:
        default = schema.attributes[a.name].default_value if a.name in schema.attributes else None
        value = repr(helper.get_attribute_value(a))
        if default is not None and default.type == a.type and repr(helper.get_attribute_value(default)) == value:
            continue
        found.append((a.name, value))
    return tuple(sorted(found))


def _structure(proto):
    """(nodes, constants) of the module docstring."""
    g, opset = proto.graph, proto.opset_import[0].version
    values = {t.name: numpy_helper.to_array(t) for t in g.initializer}
    for n in g.node:
        if n.op_type == "Constant":
            values[n.output[0]] = numpy_helper.to_array(next(a.t for a in n.attribute if a.name == "value"))
    nodes, constants, seen = [], [], set()
    for n in g.node:
        if n.op_type == "Constant":
            continue
        nodes.append((n.domain, n.op_type, _attributes(n, opset)))
        for i in n.input:
            if i in values and i not in seen:
                seen.add(i)
                constants.append(_constant_key(values[i]))
    return nodes, constants


def _assert_routes_agree(model, x, **kwargs):
    ts = export_onnx(model, (x,), route="torchscript", **kwargs)
    dyn = export_onnx(model, (x,), route="dynamo", **kwargs)
    assert (_meta(ts)["dal.export_route"], _meta(dyn)["dal.export_route"]) == ("torchscript", "dynamo")
    assert dyn.opset_import[0].version == ts.opset_import[0].version
    ts_nodes, ts_consts = _structure(ts)
    dyn_nodes, dyn_consts = _structure(dyn)
    assert dyn_nodes == ts_nodes
    assert len(dyn_consts) == len(ts_consts)
    differ = [k for k, (a, b) in enumerate(zip(ts_consts, dyn_consts)) if a != b]
    assert not differ, f"constants {differ} differ (dtype, shape or bytes)"
    quantized = [n for n in dyn.graph.node if n.op_type == "DequantizeLinear"]
    assert quantized  # the comparison covered Q/DQ, not a float graph
    return ts, dyn


def test_small_cnn_routes_agree_at_opset_13():
    """INT8 with BN folded and int32 biases; opset 13 (the dynamo route traces at 18 and goes down)."""
    torch.manual_seed(0)
    x = torch.randn(2, 3, 32, 32)
    model = SmallCNN()
    randomize_bn(model)
    ts, _ = _assert_routes_agree(prepared(model, x, "int8_balanced"), x)
    assert ts.opset_import[0].version == 13


def test_mixed_formats_routes_agree():
    """INT8 conv+BN, INT4 per group, FP8 linear, an FP16 region between Casts, an INT8 add (opset 21)."""
    model, x = calibrated_mixed()
    ts, _ = _assert_routes_agree(model, x)
    assert ts.opset_import[0].version == 21


class FunctionalOps(nn.Module):
    """add, cat and matmul as functions, between two convolutions; a hardswish, which the dynamo
    exporter writes as HardSwish (opset 14) and TorchScript at opset 13 as HardSigmoid + Mul."""

    def __init__(self):
        super().__init__()
        self.a = nn.Conv2d(3, 8, 3, padding=1)
        self.b = nn.Conv2d(3, 8, 3, padding=1)
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        a, b = nn.functional.hardswish(self.a(x)), self.b(x)
        y = torch.cat([a + b, a], dim=1)                        # (N, 16, H, W)
        y = torch.matmul(y, y.transpose(2, 3))                  # (N, 16, H, H)
        return self.head(y.mean((2, 3)))


def test_functional_ops_routes_agree():
    torch.manual_seed(0)
    x = torch.randn(2, 3, 8, 8)
    _assert_routes_agree(prepared(FunctionalOps(), x, "int8_balanced"), x)


@pytest.mark.parametrize("name", ["MnistCNN", "MobileNetTiny"])
def test_zoo_classifier_routes_agree(name):
    """dal_examples.zoo's CNNs: strided and depthwise convolutions, BN folded, pooling, a linear head."""
    torch.manual_seed(0)
    x = torch.randn(2, 1, 28, 28)
    model = getattr(zoo, name)()
    randomize_bn(model)
    _assert_routes_agree(prepared(model, x, "int8_balanced", batches=1), x)


@pytest.mark.slow
def test_resnet18_routes_agree():
    """torchvision's ResNet-18 (random weights): 20 convolutions, residual adds, both routes alike."""
    torchvision = pytest.importorskip("torchvision")
    torch.manual_seed(0)
    x = torch.randn(1, 3, 32, 32)
    model = torchvision.models.resnet18(weights=None)
    randomize_bn(model)
    _assert_routes_agree(prepared(model, x, "int8_balanced", batches=1), x)


class BufferScale(nn.Module):
    """``float(buffer)`` in forward: a constant for the TorchScript trace; torch.export's fake
    buffers have no value, so it cannot capture the model."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.register_buffer("gain", torch.tensor(2.0))

    def forward(self, x):
        return self.fc(x) * float(self.gain)


def test_auto_falls_back_to_torchscript_and_says_why():
    torch.manual_seed(0)
    x = torch.randn(2, 8)
    model = prepared(BufferScale(), x, "int8_balanced")
    proto = export_onnx(model, (x,), route="auto")
    meta = _meta(proto)
    assert meta["dal.export_route"] == "torchscript"
    assert meta["dal.export_route_reason"].startswith("dynamo capture failed: ")
    with pytest.raises(ExportError, match="torch.export could not capture"):
        export_onnx(model, (x,), route="dynamo")
    assert _meta(export_onnx(model, (x,), route="torchscript"))["dal.export_route_reason"] == "asked"


def test_unknown_route_is_refused():
    model, x = calibrated_mixed()
    with pytest.raises(ExportError, match=r"route='jit': expected one of \['torchscript', 'dynamo', 'auto'\]"):
        export_onnx(model, (x,), route="jit")
    assert not any("forward" in m.__dict__ for m in model.modules())


def test_dynamic_batch_through_the_dynamo_route():
    model, x = calibrated_mixed()
    proto = export_onnx(model, (x,), route="dynamo", dynamic_batch=True)
    dims = [d.dim_param for v in (*proto.graph.input, *proto.graph.output) for d in v.type.tensor_type.shape.dim[:1]]
    assert dims == ["batch"] * len(dims) and _meta(proto)["dal.export_route"] == "dynamo"
