"""Files written by onnxruntime's quantize_static (a tool dal did not write): the QDQ format
runs, with per-channel s8 weights and u8 or s8 activations, and agrees with onnxruntime
(no graph optimizations) on the output codes; the QOperator format's com.microsoft ops
(QLinearAdd, QLinearGlobalAveragePool, QGemm) are refused naming the node -- dal.npu runs the
ai.onnx QOperator ops (QLinearConv, QLinearMatMul, ConvInteger, MatMulInteger) only."""
from __future__ import annotations

import numpy as np
import pytest

import zoo


def _float_model(path):
    import torch

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.c1 = torch.nn.Conv2d(3, 16, 3, padding=1)
            self.c2 = torch.nn.Conv2d(16, 16, 3, padding=1, stride=2)
            self.fc = torch.nn.Linear(16, 10)

        def forward(self, x):
            y = torch.relu(self.c1(x))
            z = torch.relu(self.c2(y)) + torch.nn.functional.max_pool2d(y, 2)
            return self.fc(torch.nn.functional.adaptive_avg_pool2d(z, 1).flatten(1))

    torch.manual_seed(0)
    with torch.no_grad():
        torch.onnx.export(Net().eval(), (torch.randn(1, 3, 16, 16),), path, dynamo=False, opset_version=17,
                          input_names=["input"], output_names=["output"])
    return path


def _quantize(tmp_path, act, fmt):
    from onnxruntime.quantization import QuantFormat, QuantType, quantize_static
    fp = _float_model(str(tmp_path / "f.onnx"))
    out = str(tmp_path / f"q_{act}_{fmt}.onnx")
    quantize_static(fp, out, zoo._RandomReader("input", (1, 3, 16, 16)),
                    quant_format=QuantFormat.QDQ if fmt == "qdq" else QuantFormat.QOperator,
                    per_channel=True, weight_type=QuantType.QInt8,
                    activation_type=QuantType.QUInt8 if act == "u8" else QuantType.QInt8)
    return out


@pytest.mark.parametrize("act", ["u8", "s8"])
def test_qdq_runs_and_agrees_with_onnxruntime(act, tmp_path, npu_lib):
    import onnx
    import onnxruntime as ort
    import dal.npu as npu
    path = _quantize(tmp_path, act, "qdq")
    m = onnx.load(path)
    assert any(n.op_type == "DequantizeLinear" and len(onnx.numpy_helper.to_array(
        next(t for t in m.graph.initializer if t.name == n.input[1])).reshape(-1)) > 1
        for n in m.graph.node if n.input[1] in {t.name for t in m.graph.initializer}), "per-channel"
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    o = ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])
    x = np.random.default_rng(1).standard_normal((1, 3, 16, 16)).astype(np.float32)
    sess = npu.load(path)
    assert sum(st.kind == "fused" for st in sess.steps) >= 3  # both convs and the Gemm, integer
    _, vals = sess.run({"input": x}, return_intermediates=True)
    names = [n.output[0] for n in m.graph.node if n.op_type == "QuantizeLinear"]
    ref = onnx.helper.make_model(m.graph, opset_imports=m.opset_import)
    del ref.graph.output[:]
    ref.graph.output.extend([onnx.helper.make_empty_tensor_value_info(n) for n in names])
    r = ort.InferenceSession(ref.SerializeToString(), so, providers=["CPUExecutionProvider"]).run(names, {"input": x})
    total = diff = 0
    for n, e in zip(names, r):
        d = np.abs(vals[n].astype(np.int32) - e.astype(np.int32))
        assert d.max() <= 1, (n, int(d.max()))  # near-ties only: 1 LSB
        total, diff = total + d.size, diff + int((d > 0).sum())
    assert diff <= max(2, total // 1000), (diff, total)


def test_qoperator_contrib_ops_refused_by_name(tmp_path, npu_lib):
    import dal.npu as npu
    path = _quantize(tmp_path, "u8", "qop")
    with pytest.raises(npu.UnsupportedNode, match="com.microsoft::QLinear"):
        npu.load(path)
