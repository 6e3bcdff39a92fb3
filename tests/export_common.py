"""Shared helpers of the exporter tests: small QAT models, and the teacher-forced comparison of
torch against a runtime layer by layer. The oracles themselves (onnxruntime, onnx.reference,
the output LSB, LSB counting) are tests/oracles.py."""
from __future__ import annotations

import numpy as np
import onnx
import torch
from torch import nn

import dal
from dal.nn import QAdd, QConv2d, QConvBnReLU2d, QLinear, SimpleLayerSpec, SimpleTensorSpec
from oracles import lsb_stats, run_ort, with_outputs


def check_valid(proto: onnx.ModelProto) -> None:
    """onnx's own checker (full) and strict shape inference accept the file."""
    onnx.checker.check_model(proto, full_check=True)
    onnx.shape_inference.infer_shapes(proto, check_type=True, strict_mode=True, data_prop=True)


def freeze_all(model: nn.Module) -> None:
    for m in model.modules():
        if isinstance(m, dal.FakeQuantizer):
            m.end_observation("frozen")


def _tensor(fmt, granularity="per_tensor", group_size=None, symmetric=True):
    return SimpleTensorSpec(fmt, granularity, group_size=group_size, symmetric=symmetric) if fmt else None


def spec(w=None, a=None, wg="per_channel", gs=None, symmetric=True) -> SimpleLayerSpec:
    """A layer spec: weight format ``w`` at ``wg`` granularity, input and output format ``a``."""
    act = _tensor(a, symmetric=symmetric)
    return SimpleLayerSpec(weight=_tensor(w, wg, gs), input=act, output=act)


class MixedNet(nn.Module):
    """INT8 (conv+BN+ReLU), INT4 per group (conv), INT8 add, FP8 (linear), FP16 (linear) in one graph."""

    def __init__(self):
        super().__init__()
        self.c1 = QConvBnReLU2d.from_float(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16),
                                           spec("int8", "int8"), "c1")
        self.c2 = QConv2d.from_float(nn.Conv2d(16, 16, 3, padding=1), spec("int4", "int8", wg="per_group", gs=8), "c2", activation="relu")
        self.add = QAdd.from_spec(spec(a="int8"), "add")
        self.fc = QLinear.from_float(nn.Linear(16, 32), spec("fp8_e4m3", "fp8_e4m3", wg="per_tensor"), "fc")
        self.fc16 = QLinear.from_float(nn.Linear(32, 16), spec("fp16", "fp16"), "fc16", activation="relu")
        self.head = QLinear.from_float(nn.Linear(16, 10), spec("int8", "int8"), "head")

    def forward(self, x):
        y = self.c1(x)
        y = self.add(y, self.c2(y))
        return self.head(self.fc16(self.fc(y.mean((2, 3)))))


class SmallCNN(nn.Module):
    """A float CNN for prepare_qat: conv-bn-relu, residual add, pooling, linear head."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 16, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(16)
        self.conv2 = nn.Conv2d(16, 16, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(16)
        self.conv3 = nn.Conv2d(16, 32, 3, stride=2, padding=1)
        self.fc = nn.Linear(32, 10)

    def forward(self, x):
        y = torch.relu(self.bn1(self.conv1(x)))
        y = y + torch.relu(self.bn2(self.conv2(y)))
        y = torch.relu(self.conv3(y))
        return self.fc(torch.flatten(nn.functional.adaptive_avg_pool2d(y, 1), 1))


def randomize_bn(model: nn.Module, seed: int = 0) -> None:
    """Non-trivial BN statistics, so that folding is exercised."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.running_mean.copy_(torch.randn(m.num_features, generator=g) * 0.1)
                m.running_var.copy_(torch.rand(m.num_features, generator=g) + 0.5)
                m.weight.copy_(torch.rand(m.num_features, generator=g) + 0.5)
                m.bias.copy_(torch.randn(m.num_features, generator=g) * 0.1)


def calibrated_mixed(seed: int = 0) -> tuple[MixedNet, torch.Tensor]:
    torch.manual_seed(seed)
    m = MixedNet()
    randomize_bn(m, seed)
    with torch.no_grad():
        for _ in range(3):
            m(torch.randn(4, 3, 16, 16))
    freeze_all(m)
    return m.eval(), torch.randn(2, 3, 16, 16)


def prepared(model: nn.Module, x: torch.Tensor, recipe: str, hardware=None, batches: int = 2) -> nn.Module:
    """prepare_qat + calibrate on random data (same shape as ``x``), eval mode."""
    model = dal.prepare_qat(model, recipe=recipe, hardware=hardware, example_inputs=(x,), quantize_outputs=True)
    g = torch.Generator().manual_seed(1)
    dal.calibrate(model, [torch.randn(x.shape, generator=g) for _ in range(batches)], progress=False)
    return model.eval()


def activation_dq_outputs(proto: onnx.ModelProto) -> dict[str, tuple[str, float]]:
    """{quantizer path: (DQ output tensor, scale)} for activation quantizers called once.

    The exporter names each activation's nodes ``<quantizer path>/QuantizeLinear`` and
    ``.../DequantizeLinear`` (export/SPEC.md); only per-tensor scales are collected.
    """
    inits = {t.name: t for t in proto.graph.initializer}
    found, seen = {}, {}
    quantized = {n.output[0] for n in proto.graph.node if n.op_type == "QuantizeLinear"}
    for n in proto.graph.node:
        if n.op_type == "DequantizeLinear" and n.input[0] in quantized:
            qname = n.name.rsplit("/", 1)[0]
            seen[qname] = seen.get(qname, 0) + 1
            scale = onnx.numpy_helper.to_array(inits[n.input[1]])
            if scale.size == 1:
                found[qname] = (n.output[0], float(scale.reshape(())))
    return {k: v for k, v in found.items() if seen[k] == 1}


def teacher_forced_stats(model: nn.Module, proto: onnx.ModelProto, x: torch.Tensor, run=run_ort) -> dict:
    """Per activation quantizer: LSB differences of torch vs the ONNX file *from the same inputs*.

    Every activation quantizer's output in torch is replaced by the ONNX runtime's value at that
    point (read as an extra graph output), after comparing the two. A 1-LSB rounding flip (float
    summation order differs between engines) then cannot propagate and be amplified by later
    layers, so each figure measures one layer's agreement: what the exporter claims.
    """
    points = activation_dq_outputs(proto)
    probe = with_outputs(proto, [tensor for tensor, _ in points.values()])
    names = [o.name for o in probe.graph.output]
    values = dict(zip(names, run(probe, {probe.graph.input[0].name: x.numpy()})))
    stats, hooks = {}, []
    modules = dict(model.named_modules())
    for qname, (tensor, scale) in points.items():
        mod = modules.get(qname)
        if mod is None:
            continue

        def hook(mod, inputs, out, qname=qname, tensor=tensor, scale=scale):
            onnx_value = values[tensor]
            stats[qname] = lsb_stats(onnx_value, out.detach().numpy(), scale)
            return torch.from_numpy(np.array(onnx_value))
        hooks.append(mod.register_forward_hook(hook))
    try:
        with torch.no_grad():
            model(x)
    finally:
        for h in hooks:
            h.remove()
    return stats

