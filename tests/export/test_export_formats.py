"""What the file holds for each format: typed weights, Q/DQ element types, int32 biases, FP16
regions, opsets; and FP8 / INT4 / mixed graphs against onnx.reference and onnxruntime."""
import ml_dtypes
import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, numpy_helper
from torch import nn

from dal.export import export_onnx
from dal.nn import QConv2d, QLinear
from export_common import (SmallCNN, calibrated_mixed, check_valid, freeze_all, prepared, randomize_bn, spec,
                           teacher_forced_stats)
from oracles import assert_lsb_parity, lsb_stats, output_scale, run_ort, run_reference


def _inits(proto):
    return {t.name: t for t in proto.graph.initializer}


def _weight_dqs(proto):
    inits = _inits(proto)
    return [(n, inits[n.input[0]]) for n in proto.graph.node
            if n.op_type == "DequantizeLinear" and n.input[0] in inits]


def _attrs(node):
    return {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}


class _OneLayer(nn.Module):
    def __init__(self, layer):
        super().__init__()
        self.layer = layer

    def forward(self, x):
        return self.layer(x)


def _calibrated(layer, x):
    model = _OneLayer(layer)
    with torch.no_grad():
        model(x)
        model(x * 1.5)
    freeze_all(model)
    return model.eval()


# ---- mixed graph ---------------------------------------------------------------------------

def test_mixed_int8_int4_fp8_fp16_graph():
    model, x = calibrated_mixed()
    proto = export_onnx(model, (x,))
    check_valid(proto)
    assert proto.opset_import[0].version == 21  # int4 per group decides
    types = {numpy_helper.to_array(w).dtype for _, w in _weight_dqs(proto)}
    assert {np.dtype(np.int8), np.dtype(ml_dtypes.int4), np.dtype(ml_dtypes.float8_e4m3fn),
            np.dtype(np.int32)} <= types
    with torch.no_grad():
        ref = model(x).numpy()
    scale = output_scale(proto)
    for run in (run_reference, run_ort):
        assert_lsb_parity(lsb_stats(run(proto, {"input": x.numpy()})[0], ref, scale), run.__name__)
    forced = teacher_forced_stats(model, proto, x, run=run_reference)
    for name, st in forced.items():
        assert_lsb_parity(st, name)


def test_fp16_layer_runs_in_fp16_between_casts():
    model, x = calibrated_mixed()
    proto = export_onnx(model, (x,))
    inits = _inits(proto)
    gemms = [n for n in proto.graph.node if n.op_type == "Gemm" and n.input[1] in inits
             and inits[n.input[1]].data_type == TensorProto.FLOAT16]
    assert len(gemms) == 1, "the fp16 linear must be a Gemm with an fp16 weight initializer"
    g = gemms[0]
    assert inits[g.input[2]].data_type == TensorProto.FLOAT16  # bias in fp16 too
    producers = {o: n for n in proto.graph.node for o in n.output}
    cast_in = producers[g.input[0]]
    assert cast_in.op_type == "Cast" and _attrs(cast_in)["to"] == TensorProto.FLOAT16
    consumers = [n for n in proto.graph.node if any(i in n.input for i in g.output)]
    assert [c.op_type for c in consumers] == ["Relu"]  # the fused activation stays in fp16
    after = [n for n in proto.graph.node if consumers[0].output[0] in n.input]
    assert after[0].op_type == "Cast" and _attrs(after[0])["to"] == TensorProto.FLOAT


# ---- weights, activations, biases -------------------------------------------------------------

@pytest.mark.parametrize("fmt,onnx_type,opset", [("int8", TensorProto.INT8, 13),
                                                 ("int4", TensorProto.INT4, 21),
                                                 ("fp8_e4m3", TensorProto.FLOAT8E4M3FN, 19),
                                                 ("fp8_e5m2", TensorProto.FLOAT8E5M2, 19)])
def test_conv_weight_and_activation_types(fmt, onnx_type, opset):
    torch.manual_seed(0)
    x = torch.randn(2, 8, 10, 10)
    gran = "per_tensor" if fmt.startswith("fp8") else "per_channel"
    model = _calibrated(QConv2d.from_float(nn.Conv2d(8, 16, 3), spec(fmt, fmt, wg=gran), "conv"), x)
    proto = export_onnx(model, (x,))
    check_valid(proto)
    assert proto.opset_import[0].version == opset
    (dq, w), = [(n, w) for n, w in _weight_dqs(proto) if w.data_type != TensorProto.INT32]
    assert w.data_type == onnx_type and list(w.dims) == [16, 8, 3, 3]
    assert _attrs(dq).get("axis") == (0 if gran == "per_channel" else None)
    q = [n for n in proto.graph.node if n.op_type == "QuantizeLinear"]
    assert q and all(_inits(proto)[n.input[2]].data_type == onnx_type for n in q)
    if fmt.startswith("fp8"):
        assert all(_attrs(n)["saturate"] == 1 for n in q)
    with torch.no_grad():
        ref = model(x).numpy()
    run = run_reference if opset >= 19 else run_ort  # onnx.reference has no Q/DQ kernels before 19
    out = run(proto, {"input": x.numpy()})[0]
    assert_lsb_parity(lsb_stats(out, ref, output_scale(proto)), fmt)


def test_stored_weight_codes_equal_torch_fake_quantized_weight():
    """DequantizeLinear of the stored codes, computed by onnx.reference, is the weight torch used."""
    torch.manual_seed(0)
    x = torch.randn(1, 32)
    layer = QLinear.from_float(nn.Linear(32, 24), spec("int4", "int8", wg="per_group", gs=8), "fc")
    model = _calibrated(layer, x)
    proto = export_onnx(model, (x,))
    (dq, w), = [(n, w) for n, w in _weight_dqs(proto) if w.data_type == TensorProto.INT4]
    assert _attrs(dq) == {"axis": 1, "block_size": 8}
    sub = onnx.helper.make_model(onnx.helper.make_graph(
        [dq], "w", [], [onnx.helper.make_tensor_value_info(dq.output[0], TensorProto.FLOAT, None)],
        initializer=[i for i in proto.graph.initializer if i.name in dq.input]),
        opset_imports=[onnx.helper.make_opsetid("", 21)])
    got = run_reference(sub, {})[0]
    with torch.no_grad():
        want = layer.weight_quant(layer.weight).numpy()
    np.testing.assert_array_equal(got, want)


def test_bias_is_int32_with_scale_s_in_times_s_w():
    torch.manual_seed(0)
    x = torch.randn(2, 3, 16, 16)
    model = prepared(SmallCNN(), x, "int8_balanced")
    randomize_bn(model)
    proto = export_onnx(model, (x,))
    inits = _inits(proto)
    conv = next(n for n in proto.graph.node if n.op_type == "Conv")
    producers = {o: n for n in proto.graph.node for o in n.output}
    bias_dq, w_dq, x_dq = producers[conv.input[2]], producers[conv.input[1]], producers[conv.input[0]]
    assert inits[bias_dq.input[0]].data_type == TensorProto.INT32
    s_b = numpy_helper.to_array(inits[bias_dq.input[1]])
    s_w = numpy_helper.to_array(inits[w_dq.input[1]])
    s_x = numpy_helper.to_array(inits[x_dq.input[1]])
    np.testing.assert_array_equal(s_b, (s_x.astype(np.float32) * s_w).astype(np.float32))
    assert _attrs(bias_dq) == {"axis": 0}
    assert not numpy_helper.to_array(inits[bias_dq.input[2]]).any()


def test_bias_stays_float_for_fp8_and_per_group():
    model, x = calibrated_mixed()
    proto = export_onnx(model, (x,))
    inits = _inits(proto)
    for n in proto.graph.node:
        if n.op_type in ("Conv", "Gemm") and len(n.input) > 2 and n.input[2] in inits:
            assert inits[n.input[2]].data_type in (TensorProto.FLOAT, TensorProto.FLOAT16)
    n_int32 = sum(1 for _, w in _weight_dqs(proto) if w.data_type == TensorProto.INT32)
    assert n_int32 == 2  # c1 (int8 x int8) and head (int8 x int8); c2 per group, fc fp8: float


def test_w4a8_fp8_recipe_on_a2000():
    """The bundled INT4 / FP8 recipe, exported and run by onnx.reference and onnxruntime."""
    torch.manual_seed(0)
    x = torch.randn(2, 3, 32, 32)
    model = prepared(SmallCNN(), x, "w4a8_fp8_performance", hardware="a2000")
    proto = export_onnx(model, (x,))
    check_valid(proto)
    assert proto.opset_import[0].version == 21
    types = {w.data_type for _, w in _weight_dqs(proto)}
    assert TensorProto.INT4 in types
    with torch.no_grad():
        ref = model(x).numpy()
    for run in (run_reference, run_ort):
        assert_lsb_parity(lsb_stats(run(proto, {"input": x.numpy()})[0], ref, output_scale(proto)), run.__name__)


# ---- opsets ------------------------------------------------------------------------------------

def test_explicit_higher_opset_and_dynamic_batch():
    torch.manual_seed(0)
    x = torch.randn(2, 3, 16, 16)
    model = prepared(SmallCNN(), x, "int8_balanced")
    for opset in (17, 21):
        proto = export_onnx(model, (x,), opset=opset, dynamic_batch=True, output_names=["logits"])
        check_valid(proto)
        assert proto.opset_import[0].version == opset
        x3 = torch.randn(3, 3, 16, 16)
        out = run_ort(proto, {"input": x3.numpy()})[0]
        with torch.no_grad():
            ref = model(x3).numpy()
        assert out.shape == (3, 10)
        assert_lsb_parity(lsb_stats(out, ref, output_scale(proto)), f"opset {opset}")


def test_two_fp16_layers_in_a_row_share_one_fp16_tensor(tmp_path):
    """Two FP16-fallback Conv+BN+ReLU layers back to back: the second reads the first's float16
    output directly (no Cast pair between them), the graph is topologically sorted, and both
    onnxruntime (optimizations off) agrees with the QAT model in LSBs of the int8 output."""
    import yaml

    import dal
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                          nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 4, 1))
    randomize_bn(model)
    recipe = yaml.safe_load(open("recipes/int8_balanced.yaml"))
    recipe["name"] = "two_fp16"
    recipe["rules"] = [{"match": ["0", "3"], "fallback": "fp16"}] + recipe["rules"]
    path = tmp_path / "two_fp16.yaml"
    path.write_text(yaml.safe_dump(recipe))
    x = torch.randn(2, 3, 12, 12)
    model = dal.prepare_qat(model, recipe=str(path), hardware="a2000", example_inputs=(x,), quantize_outputs=True)
    dal.calibrate(model, [x, x * 1.5], progress=False)
    model.eval()
    proto = export_onnx(model, (x,))
    check_valid(proto)
    convs = [n for n in proto.graph.node if n.op_type == "Conv"]
    producers = {o: n for n in proto.graph.node for o in n.output}
    feed = producers[convs[1].input[0]]
    assert feed.op_type == "Relu", f"the second fp16 conv must read the first's fp16 Relu, got {feed.op_type}"
    with torch.no_grad():
        ref = model(x).numpy()
    scale = output_scale(proto)
    assert_lsb_parity(lsb_stats(run_ort(proto, {"input": x.numpy()})[0], ref, scale), "onnxruntime")
