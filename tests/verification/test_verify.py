"""dal.verify end to end: prepare, calibrate, export, then NPU reference vs torch and onnxruntime."""
import pytest
import torch

import dal
from dal.prepare import set_quantizer_state
from dal.zoo import MnistCNN


def _exported(tmp_path, hardware):
    torch.manual_seed(0)
    x = torch.randn(16, 1, 28, 28)
    q = dal.prepare_qat(MnistCNN(), recipe="int8_balanced", hardware=hardware, example_inputs=(x,))
    dal.calibrate(q, [torch.randn(16, 1, 28, 28) for _ in range(3)], progress=False)
    set_quantizer_state(q, "frozen")
    q.eval()
    path = tmp_path / f"mnist_{hardware}.onnx"
    dal.export_onnx(q, (x,), path)
    return path, q, x


@pytest.mark.parametrize("hardware,requantizer", [("a2000", "float"), ("a1000", "fixed_point")])
def test_verify_reports_parity_in_lsb(tmp_path, hardware, requantizer):
    path, q, x = _exported(tmp_path, hardware)
    report = dal.verify(path, q, (x,))
    assert report.requantizer == requantizer
    (pairs,) = report.outputs.values()
    vs_torch, vs_ort = pairs["npu_vs_torch"], pairs["npu_vs_ort"]
    assert vs_torch.lsb and vs_torch.elements == 160
    # The exporter issue's criterion, stated in LSB of the output quantizer: nothing beyond 1 LSB.
    assert vs_torch.off_by_more == 0 and vs_ort.off_by_more == 0
    assert vs_torch.within_one_lsb_fraction == 1.0
    assert report.layers, "no quantized intermediate tensor was compared"
    # layer by layer (from onnxruntime's quantized inputs): the same tensors, and on this
    # shallow model no near-tie either way
    assert [r.tensor for r in report.layers_forced] == [r.tensor for r in report.layers]
    assert report.max_layer_lsb_forced <= 1
    text = str(report)
    assert "npu_vs_torch" in text and requantizer in text and "layer by layer" in text


def test_torch_layer_by_layer_view_isolates_the_layer_that_differs(tmp_path):
    path, q, x = _exported(tmp_path, "a2000")
    report = dal.verify(path, q, (x,))
    rows = {r.tensor.split(" ")[0]: r for r in report.torch_layers}
    assert len(rows) >= 8 and report.max_torch_layer_lsb <= 1  # near-ties only (exact int32 vs float32)
    assert sum(r.differ for r in rows.values()) <= 1e-4 * sum(r.elements for r in rows.values())
    # Change one layer of the torch model after export: only the quantizer that reads its output
    # disagrees; every later layer is fed the NPU's values, so the change does not cascade.
    with torch.no_grad():
        q.get_submodule("conv").weight.mul_(1.5)
    changed = {r.tensor.split(" ")[0]: r for r in dal.verify(path, q, (x,), onnxruntime=False).torch_layers}
    assert changed["add.input_quants.1"].differ > 0.5 * changed["add.input_quants.1"].elements
    for name in ("down2.0.input_quant", "head.input_quant", "head.output_quant"):
        assert changed[name].differ == rows[name].differ, name
    assert "torch vs NPU layer by layer" in str(report)


def test_verify_names_the_input_count_mismatch(tmp_path):
    path, q, x = _exported(tmp_path, "a2000")
    with pytest.raises(ValueError, match="takes 1 input"):
        dal.verify(path, q, (x, x))


def test_dynamic_batch_export_of_an_fx_rewritten_root(tmp_path):
    # MnistCNN's own forward has a `+`, so prepare_qat returns a GraphModule root.
    torch.manual_seed(0)
    x = torch.randn(4, 1, 28, 28)
    q = dal.prepare_qat(MnistCNN(), recipe="int8_balanced", hardware="a2000", example_inputs=(x,))
    assert isinstance(q, torch.fx.GraphModule)
    dal.calibrate(q, [x], progress=False)
    set_quantizer_state(q, "frozen")
    dal.export_onnx(q, (x,), tmp_path / "dyn.onnx", dynamic_batch=True)
    report = dal.verify(tmp_path / "dyn.onnx", q, (torch.randn(7, 1, 28, 28),))
    (pairs,) = report.outputs.values()
    assert pairs["npu_vs_torch"].elements == 70 and pairs["npu_vs_torch"].off_by_more == 0
