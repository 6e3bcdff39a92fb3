"""Refusals, metadata, 2:4 sparsity, and the promise that export leaves the model as it was."""
import json
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
import yaml
from onnx import numpy_helper
from torch import nn

import dal
from dal.export import ExportError, export_onnx
from dal.nn import QLinear
from export_common import SmallCNN, calibrated_mixed, freeze_all, prepared, spec
from oracles import assert_lsb_parity, lsb_stats, output_scale, run_ort

ROOT = Path(__file__).resolve().parents[2]


# ---- refusals ------------------------------------------------------------------------------

def test_observe_state_is_refused_naming_every_quantizer():
    x = torch.randn(2, 3, 16, 16)
    model = dal.prepare_qat(SmallCNN(), recipe="int8_balanced", example_inputs=(x,), quantize_outputs=True)
    with pytest.raises(ExportError, match="still in state 'observe'") as err:
        export_onnx(model, (x,))
    msg = str(err.value)
    assert "conv1.input_quant" in msg and "fc.output_quant" in msg and "dal.calibrate" in msg


@pytest.mark.parametrize("fmt,gran,opset,needed", [("int4", "per_channel", 19, 21), ("fp8_e4m3", "per_tensor", 17, 19),
                                                   ("int8", "per_group", 20, 21)])
def test_opset_too_low_is_refused(fmt, gran, opset, needed):
    x = torch.randn(1, 32)
    layer = QLinear.from_float(nn.Linear(32, 8), spec(fmt, "int8", wg=gran, gs=8 if gran == "per_group" else None),
                               "fc")
    model = nn.Sequential(layer)
    model(x)
    freeze_all(model)
    with pytest.raises(ExportError) as err:
        export_onnx(model, (x,), opset=opset)
    msg = str(err.value)
    assert f"opset={opset}" in msg and "0.weight_quant" in msg and f"needs opset >= {needed}" in msg
    assert export_onnx(model, (x,)).opset_import[0].version == needed  # the default picks it


class _Custom(nn.Module):
    """Holds FakeQuantizers without being a QAT module: the exporter cannot know their roles."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.my_quant = dal.FakeQuantizer("int8")

    def forward(self, x):
        return self.lin(self.my_quant(x))


def test_unplaceable_quantizers_are_listed_at_once():
    model = nn.Sequential(_Custom(), _Custom())
    x = torch.randn(2, 8)
    model(x)
    freeze_all(model)
    with pytest.raises(ExportError, match="cannot place 2 quantizer") as err:
        export_onnx(model, (x,))
    assert "0.my_quant" in str(err.value) and "1.my_quant" in str(err.value)
    assert "_Custom" in str(err.value)


# ---- the model is left as it was ---------------------------------------------------------------

def _snapshot(model):
    return ({k: v.clone() for k, v in model.state_dict().items()},
            {n: m.training for n, m in model.named_modules()},
            {n: m.state for n, m in model.named_modules() if isinstance(m, dal.FakeQuantizer)})


def test_export_leaves_the_model_unchanged(tmp_path):
    torch.manual_seed(0)
    x = torch.randn(2, 3, 16, 16)
    model = prepared(SmallCNN(), x, "int8_balanced")
    model.train()  # training mode, quantizers in 'quantize' (observers live in training)
    model.fc.eval()  # and one module in another mode
    before = _snapshot(model)
    export_onnx(model, (x,), tmp_path / "m.onnx")
    after = _snapshot(model)
    assert before[1] == after[1] and before[2] == after[2]
    assert before[0].keys() == after[0].keys()
    for k in before[0]:
        assert torch.equal(before[0][k], after[0][k]), k
    assert all("forward" not in m.__dict__ for m in model.modules())
    assert (tmp_path / "m.onnx").exists()


def test_export_of_a_failing_model_restores_it_too():
    model, x = calibrated_mixed()
    model.train()
    before = _snapshot(model)
    with pytest.raises(ExportError):
        export_onnx(model, (torch.randn(2, 5, 16, 16),))  # wrong channel count: the trace fails
    after = _snapshot(model)
    assert before[1] == after[1] and before[2] == after[2]
    assert all("forward" not in m.__dict__ for m in model.modules())


# ---- metadata ------------------------------------------------------------------------------

def _meta(proto):
    return {p.key: p.value for p in proto.metadata_props}


def test_metadata_keys():
    model, x = calibrated_mixed()
    proto = export_onnx(model, (x,), metadata={"team": "npu", "run": {"epochs": 3}})
    meta = _meta(proto)
    assert meta["dal.version"] == dal.__version__
    assert meta["dal.recipe"] == "" and meta["dal.hardware"] == ""
    assert json.loads(meta["dal.requantizer"]) == {"kind": "float"}
    assert json.loads(meta["dal.sparse_24"]) == {}
    assert meta["team"] == "npu" and json.loads(meta["run"]) == {"epochs": 3}


def _yaml_requantizer(hardware):
    """The requantizer a bundled hardware model declares, read from its YAML (not through dal)."""
    with open(ROOT / "hardware_models" / f"{hardware}.yaml") as f:
        return yaml.safe_load(f).get("requantizer")


@pytest.mark.parametrize("hardware", ["a2000", "a1000"])
def test_metadata_from_prepare_and_hardware(hardware):
    torch.manual_seed(0)
    x = torch.randn(2, 3, 16, 16)
    model = prepared(SmallCNN(), x, "int8_balanced", hardware=hardware)
    meta = _meta(export_onnx(model, (x,)))
    assert meta["dal.recipe"] == "int8_balanced" and meta["dal.hardware"] == hardware
    req = json.loads(meta["dal.requantizer"])
    declared = _yaml_requantizer(hardware)
    if hardware == "a2000":
        assert declared == {"kind": "float"}, declared
        assert req == {"kind": "float"}  # ONNX's own semantics: no multiplier, no rounding keys
    else:
        assert declared["kind"] == "fixed_point", declared
        assert req == {"kind": "fixed_point", "multiplier_bits": declared["multiplier_bits"],
                       "rounding": declared["rounding"]}


class _Sparse(nn.Module):
    def __init__(self):
        super().__init__()
        self.c1 = nn.Conv2d(3, 16, 3)
        self.c2 = nn.Conv2d(16, 32, 3)
        self.fc = nn.Linear(32, 16)

    def forward(self, x):
        y = torch.relu(self.c2(torch.relu(self.c1(x))))
        return self.fc(y.flatten(2).transpose(1, 2))  # fc on [N, HW, C]: MatMul with a transposed weight


def _is_24(codes, axis):
    g = np.moveaxis(codes.astype(np.float32) != 0, axis, -1).reshape(-1, 4)
    return bool((g.sum(1) <= 2).all())


def test_sparse_24_metadata_names_2to4_weights():
    torch.manual_seed(0)
    x = torch.randn(2, 3, 16, 16)
    model = prepared(_Sparse(), x, "int8_sparse24", hardware="a2000")
    proto = export_onnx(model, (x,))
    sparse = json.loads(_meta(proto)["dal.sparse_24"])
    masked = [n for n, _ in model.named_buffers() if n.endswith("weight_mask")]
    assert len(sparse) == len(masked) >= 2
    inits = {t.name: numpy_helper.to_array(t) for t in proto.graph.initializer}
    matmul_w = {n.input[1] for n in proto.graph.node if n.op_type == "MatMul"}
    for name, axis in sparse.items():
        assert _is_24(inits[name], axis), name
        assert not _is_24(inits[name], 1 - axis if inits[name].ndim == 2 else 0)  # and not by accident
    producers = {o: n for n in proto.graph.node for o in n.output}
    mm_codes = [producers[w].input[0] for w in matmul_w]
    assert [sparse[c] for c in mm_codes] == [0]  # MatMul stores [in, out]: reduction axis 0
    with torch.no_grad():
        ref = model(x).numpy()
    assert_lsb_parity(lsb_stats(run_ort(proto, {"input": x.numpy()})[0], ref, output_scale(proto)), "sparse")


def test_a_bias_saturating_int32_keeps_its_sign(tmp_path):
    """A bias far beyond INT32_MAX * s_in * s_w saturates in the QAT model with its sign (float32
    rounds the clamp bound to 2**31, which an int32 cast would wrap to -2**31); the export refuses it."""
    from dal.nn import QLinear, SimpleLayerSpec, SimpleTensorSpec

    spec = SimpleLayerSpec(weight=SimpleTensorSpec("int8", "per_tensor"), input=SimpleTensorSpec("int8"))
    layer = QLinear.from_float(nn.Linear(4, 2), spec, "fc")
    with torch.no_grad():
        layer.bias.copy_(torch.tensor([1e9, -1e9]))
    x = torch.randn(8, 4) * 1e-3
    layer(x)
    layer.input_quant.end_observation("frozen")
    layer.weight_quant.end_observation("frozen")
    layer.eval()
    # The QAT model saturates with the right sign ...
    with torch.no_grad():
        codes = (layer.quantized_bias(layer.bias).double() / layer.bias_scale().double()).tolist()
    assert codes[0] >= 2 ** 31 - 1 and codes[1] <= -2 ** 31  # (float32: 2**31 up to rounding, not wrapped)
    # ... but such a layer cannot run on integer hardware (the accumulator overflows), so the
    # export refuses it, naming the layer and its scales (issue 15; dal/export/bias_range.py).
    with pytest.raises(dal.export.ExportError, match=r"2 of 2 int32 bias codes saturate; input scale s_in = "):
        dal.export_onnx(layer, (x,))
