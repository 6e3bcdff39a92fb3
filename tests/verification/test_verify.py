"""dal.verify end to end: prepare, calibrate, export, then NPU reference vs torch and onnxruntime."""
import json
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
import yaml
from oracles import lsb_stats, output_scale, run_ort

import dal
import dal.npu
from dal.prepare import set_quantizer_state
from dal_examples.zoo import MnistCNN

ROOT = Path(__file__).resolve().parents[2]


def _exported(tmp_path, hardware):
    torch.manual_seed(0)
    x = torch.randn(16, 1, 28, 28)
    q = dal.prepare_qat(MnistCNN(), recipe="int8_balanced", hardware=hardware,
                        example_inputs=(x,), quantize_outputs=True)
    dal.calibrate(q, [torch.randn(16, 1, 28, 28) for _ in range(3)], progress=False)
    set_quantizer_state(q, "frozen")
    q.eval()
    path = tmp_path / f"mnist_{hardware}.onnx"
    dal.export_onnx(q, (x,), path)
    return path, q, x


def _yaml_requantizer(hardware):
    """The requantizer the hardware model's YAML declares, read without dal."""
    with open(ROOT / "hardware_models" / f"{hardware}.yaml") as f:
        return yaml.safe_load(f)["requantizer"]


def _counts(stats):
    """(identical, off by one, off by more) from the exact LSB histogram of tests/oracles.lsb_stats."""
    return stats.counts.get(0, 0), stats.counts.get(1, 0), sum(c for d, c in stats.counts.items() if d > 1)


@pytest.mark.parametrize("hardware,requantizer", [("a2000", "float"), ("a1000", "fixed_point")])
def test_verify_reports_parity_in_lsb(tmp_path, hardware, requantizer):
    path, q, x = _exported(tmp_path, hardware)
    proto = onnx.load(str(path))
    # The requantizer the file carries is the one the hardware YAML declares (so the fixed-point
    # case cannot silently run the float requantizer).
    meta = {p.key: p.value for p in proto.metadata_props}
    declared = _yaml_requantizer(hardware)
    assert declared["kind"] == requantizer
    assert json.loads(meta["dal.requantizer"]) == declared
    report = dal.verify(path, q, (x,))
    assert report.requantizer == requantizer
    (pairs,) = report.outputs.values()
    vs_torch, vs_ort = pairs["npu_vs_torch"], pairs["npu_vs_ort"]
    # The LSB dal.verify counts in is the output DequantizeLinear's scale, read here from the file.
    lsb = output_scale(proto)
    assert vs_torch.lsb == lsb and vs_ort.lsb == lsb
    assert vs_torch.elements == 160 and vs_ort.elements == 160
    # The counts, recomputed from the three engines' outputs: the NPU reference's, torch's and
    # onnxruntime's (ORT_DISABLE_ALL), differences counted exactly in LSBs by tests/oracles.
    feed = {proto.graph.input[0].name: x.numpy()}
    (npu_out,) = dal.npu.run(proto, feed)
    with torch.no_grad():
        torch_out = q(x).numpy()
    (ort_out,) = run_ort(proto, feed)
    torch_stats, ort_stats = lsb_stats(npu_out, torch_out, lsb), lsb_stats(npu_out, ort_out, lsb)
    assert (vs_torch.identical, vs_torch.off_by_one, vs_torch.off_by_more) == _counts(torch_stats), torch_stats
    assert (vs_ort.identical, vs_ort.off_by_one, vs_ort.off_by_more) == _counts(ort_stats), ort_stats
    # (dal's max_lsb is |d| / lsb unrounded: the grid is float32 codes * scale)
    assert abs(vs_torch.max_lsb - torch_stats.max_lsb) < 1e-3 and abs(vs_ort.max_lsb - ort_stats.max_lsb) < 1e-3
    # The exporter issue's criterion, stated in LSB of the output quantizer: nothing beyond 1 LSB.
    assert torch_stats.max_lsb <= 1 and ort_stats.max_lsb <= 1
    print(f"{hardware}: NPU vs torch {torch_stats}; NPU vs onnxruntime {ort_stats}")
    if requantizer == "fixed_point":
        # The metadata drives the reference's arithmetic: with an 8-bit multiplier instead of
        # the YAML's, its output moves (at 31 bits it may equal the float requantizer's).
        coarse = onnx.ModelProto()
        coarse.CopyFrom(proto)
        entry = next(e for e in coarse.metadata_props if e.key == "dal.requantizer")
        entry.value = json.dumps({**declared, "multiplier_bits": 8})
        assert not np.array_equal(dal.npu.run(coarse, feed)[0], npu_out)
    assert vs_torch.within_one_lsb_fraction == 1.0
    assert report.layers, "no quantized intermediate tensor was compared"
    # layer by layer (from onnxruntime's quantized inputs): the same tensors, each differing code
    # a near-tie (1 LSB, its exact value within the float32 error bound of the boundary), tested
    # code by code in both layer-by-layer views (measured: a few of 624,032 codes differ)
    assert [r.tensor for r in report.layers_forced] == [r.tensor for r in report.layers]
    assert report.max_layer_lsb_forced <= 1
    for row in report.layers_forced + report.torch_layers:
        assert row.near_ties == row.differ and row.failures == 0, row
    text = str(report)
    assert "npu_vs_torch" in text and requantizer in text and "layer by layer" in text
    # a correct export meets the one criterion; meets_criterion is the same verdict
    assert report.verdict() and report.meets_criterion()
    assert text.splitlines()[1].startswith("VERDICT: PASS")


def test_torch_layer_by_layer_view_isolates_the_layer_that_differs(tmp_path):
    path, q, x = _exported(tmp_path, "a2000")
    report = dal.verify(path, q, (x,))
    rows = {r.tensor.split(" ")[0]: r for r in report.torch_layers}
    assert len(rows) >= 8 and report.max_torch_layer_lsb <= 1  # near-ties only (exact int32 vs float32)
    assert all(r.near_ties == r.differ for r in rows.values())  # each differing code tested: a near-tie
    # Change one layer of the torch model after export: only the quantizer that reads its output
    # disagrees; every later layer is fed the NPU's values, so the change does not cascade.
    with torch.no_grad():
        q.get_submodule("conv").weight.mul_(1.5)
    changed = {r.tensor.split(" ")[0]: r for r in dal.verify(path, q, (x,), onnxruntime=False).torch_layers}
    assert changed["add.input_quants.1"].differ > 0.5 * changed["add.input_quants.1"].elements
    # the changed layer is named by its own computation (conv), not by the quantizer reading it
    assert changed["add.input_quants.1"].layer == "conv" and changed["add.input_quants.1"].failures > 0
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
    q = dal.prepare_qat(MnistCNN(), recipe="int8_balanced", hardware="a2000",
                        example_inputs=(x,), quantize_outputs=True)
    assert isinstance(q, torch.fx.GraphModule)
    dal.calibrate(q, [x], progress=False)
    set_quantizer_state(q, "frozen")
    dal.export_onnx(q, (x,), tmp_path / "dyn.onnx", dynamic_batch=True)
    report = dal.verify(tmp_path / "dyn.onnx", q, (torch.randn(7, 1, 28, 28),))
    (pairs,) = report.outputs.values()
    assert pairs["npu_vs_torch"].elements == 70 and pairs["npu_vs_torch"].off_by_more == 0


class _SharedHead(torch.nn.Module):
    """One head module called on two feature maps, as FCOS / RetinaNet call theirs per level."""

    def __init__(self):
        super().__init__()
        self.stem = torch.nn.Conv2d(1, 8, 3, padding=1)
        self.down = torch.nn.Conv2d(8, 8, 3, stride=2, padding=1)
        self.head = torch.nn.Conv2d(8, 4, 3, padding=1)

    def forward(self, x):
        p3 = torch.relu(self.stem(x))
        p4 = torch.relu(self.down(p3))
        return self.head(p3), self.head(p4)


def test_torch_view_pairs_each_call_of_a_shared_head(tmp_path):
    """Each call of the shared head has its own QuantizeLinear (``head.output_quant/QuantizeLinear``,
    ``..._1``); the torch-fed view pairs the k-th torch call with the k-th node, so both calls get a
    row (``head.output_quant[k]``) and, teacher-forced, both agree within 1 LSB. Changing the head's weights after export makes
    both of its calls disagree, and nothing upstream."""
    torch.manual_seed(0)
    x = torch.randn(4, 1, 16, 16)
    q = dal.prepare_qat(_SharedHead(), recipe="int8_balanced", hardware="a2000",
                        example_inputs=(x,), quantize_outputs=True)
    dal.calibrate(q, [torch.randn(4, 1, 16, 16) for _ in range(3)], progress=False)
    set_quantizer_state(q, "frozen")
    q.eval()
    path = tmp_path / "shared.onnx"
    dal.export_onnx(q, (x,), path)
    names = [n.name for n in onnx.load(str(path)).graph.node if n.op_type == "QuantizeLinear"]
    assert "head.output_quant/QuantizeLinear" in names and "head.output_quant/QuantizeLinear_1" in names
    rows = {r.tensor.split(" ")[0]: r for r in dal.verify(path, q, (x,), onnxruntime=False).torch_layers}
    calls = [rows["head.output_quant[0]"], rows["head.output_quant[1]"]]
    assert calls[0].elements == 4 * 4 * 16 * 16 and calls[1].elements == 4 * 4 * 8 * 8
    assert all(r.max_abs <= 1 for r in rows.values())  # in codes: LSBs
    with torch.no_grad():
        q.head.weight.mul_(1.5)
    changed = {r.tensor.split(" ")[0]: r for r in dal.verify(path, q, (x,), onnxruntime=False).torch_layers}
    for k in (0, 1):
        r = changed[f"head.output_quant[{k}]"]
        assert r.differ > 0.5 * r.elements
    for upstream in ("stem.input_quant", "down.input_quant", "head.input_quant[0]", "head.input_quant[1]"):
        assert changed[upstream].differ == rows[upstream].differ, upstream


def test_torch_view_sees_through_a_wrapper(tmp_path):
    """verify given a wrapper around the exported model (paths ``model.<quantizer>``) still pairs
    each quantizer with its QuantizeLinear."""
    path, q, x = _exported(tmp_path, "a2000")

    class Wrapper(torch.nn.Module):
        def __init__(self, model):
            super().__init__()
            self.model = model

        def forward(self, x):
            return self.model(x)

    direct = {r.tensor: r.differ for r in dal.verify(path, q, (x,), onnxruntime=False).torch_layers}
    wrapped = {r.tensor: r.differ for r in dal.verify(path, Wrapper(q), (x,), onnxruntime=False).torch_layers}
    assert len(direct) >= 8 and wrapped == direct
