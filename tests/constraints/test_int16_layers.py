"""INT16 activations: a layer whose input is int16 (a recipe rule, on hardware that lists int16)
exports as INT16 QDQ (opset 21) and runs through dal.npu's integer groups with exact
accumulation, bit for bit against the float64 model of ref64.py, layer by layer."""
import warnings

import numpy as np
import onnx
import pytest
import torch
from torch import nn

import dal
from constraints_common import export, ort_all, pow2_hw
from ref64 import run_group

W8 = {"format": "int8", "granularity": "per_channel", "symmetric": True, "observer": "minmax"}
RECIPE = {"name": "a16_on_b", "rules": [
    {"match": "b", "weight": W8, "input": {"format": "int16", "symmetric": True, "observer": "minmax"}},
    {"type": ["conv", "linear"], "weight": W8,
     "input": {"format": "uint8", "symmetric": False, "observer": "minmax"}}]}


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Conv2d(3, 256, 3, padding=1), nn.Conv2d(256, 16, 3, padding=1), nn.Conv2d(16, 8, 1)
        self.fc = nn.Linear(8 * 64, 10)

    def forward(self, x):
        return self.fc(self.c(torch.relu(self.b(torch.relu(self.a(x))))).flatten(1))


def _file(tmp_path, hardware="pow2_int8", positive=False):
    torch.manual_seed(0)
    net = Net()
    if positive:  # positive weights and inputs: b's exact sums pass int32
        with torch.no_grad():
            net.a.weight.abs_(), net.a.bias.fill_(0.5), net.b.weight.uniform_(0.5, 1.0)
    x = torch.randn(2, 3, 8, 8).abs() if positive else torch.randn(2, 3, 8, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        m = dal.prepare_qat(net, recipe=RECIPE, hardware=hardware, example_inputs=(x,))
        dal.calibrate(m, [(torch.randn(2, 3, 8, 8).abs() if positive else torch.randn(2, 3, 8, 8),)
                          for _ in range(3)], progress=False)
        return export(m, x, tmp_path / "a16.onnx")


def test_int16_layer_exports_as_opset_21_qdq(tmp_path):
    model = _file(tmp_path)
    assert max(o.version for o in model.opset_import if o.domain in ("", "ai.onnx")) >= 21
    onnx.checker.check_model(model, full_check=True)
    init = {i.name: i for i in model.graph.initializer}
    assert init["b.input_quant.zero_point"].data_type == onnx.TensorProto.INT16


@pytest.mark.parametrize("bits", [32, 48])
def test_int16_groups_are_bit_exact_layer_by_layer(tmp_path, bits, npu_lib):
    import dal.npu
    model = _file(tmp_path, pow2_hw(accumulator_bits=bits), positive=bits == 48)
    x = np.random.default_rng(0).standard_normal((2, 3, 8, 8)).astype(np.float32)
    x = np.abs(x) * 4 if bits == 48 else x  # beyond the calibrated range: codes at the top
    ref = ort_all(model, {"input": x})
    sess = dal.npu.load(model)
    fused = {s.node_name: s for s in sess.steps if type(s).__name__ == "FusedStep"}
    assert {"/a/Conv", "/b/Conv"} <= set(fused)
    assert fused["/b/Conv"].acc_model is not None and fused["/b/Conv"].x_dtype == np.int16
    got = sess.run_layerwise(ref)
    for name, step in fused.items():
        want, acc = run_group(model, name, ref[step.inputs[0]], "power_of_two", "half_even", bits, "saturate")
        assert np.array_equal(got[step.outputs[0]], want), name
        if name == "/b/Conv" and bits == 48:
            assert np.abs(acc).max() > 2 ** 31  # exact beyond int32
    # onnxruntime's float graph on the same codes: its float32 partial sums may round, 1 LSB at most
    b = fused["/b/Conv"]
    assert np.abs(got[b.outputs[0]].astype(int) - ref[b.outputs[0]].astype(int)).max() <= 1 or bits == 48
