"""Exported QDQ files against the torch QAT model, read by oracles dal did not write
(onnxruntime with optimizations off, onnx.reference), in LSBs of the output quantizer.

Two figures per model:

* end to end: the file's output vs the torch model's output. Criterion (INT8): >= 99.99% of
  elements within 1 LSB, none beyond 2 LSB.
* teacher forced: every activation quantizer's output in torch is compared with the file's
  value at that point and then replaced by it, so each layer is judged from the same inputs.

Why both: float convolutions sum in a different order in torch and onnxruntime, so about 1e-4
of requantized values flip by one LSB. In a deep network with random weights (no trained
weights ship with this machine) each flip feeds the next layers, whose gain is > 1, and the
end-to-end output drifts to a few LSB (ResNet-18 at 64x64: ~93% within 1 LSB, max 3). That
drift is not an export error; the teacher-forced figure isolates what the exporter controls
and must meet the criterion at every quantizer of every model. End to end is asserted where
the network is shallow enough for it to hold (the small CNN, the mixed graph) and reported
for the rest.
"""
import numpy as np
import pytest
import torch

from dal.export import export_onnx
from export_common import SmallCNN, check_valid, prepared, randomize_bn, teacher_forced_stats
from oracles import assert_lsb_parity, lsb_stats, merge, output_scale, run_ort, run_reference


def _parity(model, x, proto, label, end_to_end: bool):
    check_valid(proto)
    with torch.no_grad():
        ref = model(x).numpy()
    out = run_ort(proto, {"input": x.numpy()})[0]
    e2e = lsb_stats(out, ref, output_scale(proto))
    forced = teacher_forced_stats(model, proto, x)
    assert forced, "no activation quantizer was found in the exported file"
    for qname, st in forced.items():
        assert_lsb_parity(st, f"{label} {qname} (teacher forced)")
    print(f"\n{label}: end to end {e2e}\n{label}: teacher forced, {len(forced)} quantizers: {merge(forced)}")
    if end_to_end:
        assert_lsb_parity(e2e, f"{label} end to end")
    return e2e, forced


@pytest.mark.parametrize("recipe", ["int8_balanced", "int8_symmetric_acts"])
def test_small_cnn_matches_onnxruntime(recipe):
    torch.manual_seed(0)
    x = torch.randn(2, 3, 32, 32)
    model = SmallCNN()
    randomize_bn(model)
    if recipe == "int8_symmetric_acts":  # int8 activations with zero point 0 instead of uint8 affine
        recipe = {"name": "int8_sym", "rules": [{"type": ["conv", "linear"],
                  "weight": {"format": "int8", "granularity": "per_channel"},
                  "input": {"format": "int8"}, "output": {"format": "int8"}},
                 {"type": ["add", "mul", "cat", "matmul"], "input": {"format": "int8"}, "output": {"format": "int8"}}]}
    model = prepared(model, x, recipe)
    proto = export_onnx(model, (x,))
    _parity(model, x, proto, f"small_cnn[{recipe if isinstance(recipe, str) else 'int8_sym'}]", end_to_end=True)


def test_small_cnn_reference_evaluator_agrees():
    """onnx.reference (opset 21 file: its Q/DQ kernels start at opset 19) against torch and ORT."""
    torch.manual_seed(1)
    x = torch.randn(2, 3, 32, 32)
    model = prepared(SmallCNN(), x, "int8_balanced")
    proto = export_onnx(model, (x,), opset=21)
    check_valid(proto)
    with torch.no_grad():
        ref = model(x).numpy()
    out = run_reference(proto, {"input": x.numpy()})[0]
    assert_lsb_parity(lsb_stats(out, ref, output_scale(proto)), "reference vs torch")
    np.testing.assert_array_equal(out, run_ort(proto, {"input": x.numpy()})[0])


# arch -> is the end-to-end figure asserted? ResNet-18 (20 convs, residual gain > 1 with random
# weights) and Swin-T drift to 2-3 LSB end to end (~94% / ~97% within 1 LSB) from ~1e-5 single-layer
# flips that both engines are entitled to; their teacher-forced figures are asserted.
ZOO = {"resnet18": False, "mobilenet_v2": True, "mobilenet_v3_small": True, "efficientnet_b0": True,
       "shufflenet_v2_x0_5": True}


@pytest.mark.slow
@pytest.mark.parametrize("arch", list(ZOO))
def test_torchvision_int8(arch):
    torchvision = pytest.importorskip("torchvision")
    torch.manual_seed(0)
    x = torch.randn(1, 3, 64, 64)
    model = getattr(torchvision.models, arch)(weights=None)
    randomize_bn(model)
    model = prepared(model, x, "int8_balanced", batches=1)
    _parity(model, x, export_onnx(model, (x,)), arch, end_to_end=ZOO[arch])


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["vit_b_16", "swin_t"])
def test_torchvision_transformers_int8(arch):
    """224x224 is the only size these models accept; one image, one calibration batch."""
    torchvision = pytest.importorskip("torchvision")
    torch.manual_seed(0)
    x = torch.randn(1, 3, 224, 224)
    model = getattr(torchvision.models, arch)(weights=None)
    model = prepared(model, x, "int8_balanced", batches=1)
    _parity(model, x, export_onnx(model, (x,)), arch, end_to_end=arch == "vit_b_16")
