"""torchvision detectors and segmenters through dal (issue 15's checks), with random weights and
small inputs: prepare, calibrate on the normalised batch, one QAT step with the model's own loss,
export of the NPU part, dal.verify on the a2000 (dal.npu against onnxruntime, layer by layer);
on the a1000 refused by path. The user's training and evaluation calls are unchanged, and bad
input gets one line naming what is wrong."""
import json
import os

import pytest
import torch

import dal
from dal.recipe.errors import RecipeError
from detection_checks import DETECTORS, SEGMENTERS, batch, build, layer_figures, run_a1000, run_a2000

#: ops dal.npu runs and the a2000 runs: Q/DQ groups, data movement, FP16 islands between Casts
A2000_FLOAT_OK = {"Cast", "InstanceNormalization", "Mul", "Add", "Resize", "Sigmoid", "HardSigmoid", "HardSwish"}


@pytest.mark.slow
@pytest.mark.parametrize("name", [pytest.param(n, marks=[pytest.mark.xdist_group(f"tv_{n}")])
                                  for n in DETECTORS + SEGMENTERS])
def test_torchvision_model_trains_exports_and_runs_on_the_npu_reference(name, tmp_path):
    out = run_a2000(name, str(tmp_path / "m.onnx"))
    assert torch.isfinite(torch.tensor(out["loss"]))
    assert not [r.name for r in out["rows"] if "cannot run" in r.detail]  # no float op the a2000 cannot run
    differ, total, worst = layer_figures(out["report"])  # dal.verify raised no UnsupportedNode to get here
    assert total > 0 and worst <= 1 and differ <= 1e-5 * total, (differ, total, worst)
    differ, total, worst = layer_figures(out["report"], "torch_layers")  # the QAT model, each call of a head
    assert total > 0 and worst <= 1 and differ <= 1e-5 * total, ("torch", differ, total, worst)
    integer = out["report"].integer  # dal.convert of the QAT model against dal.npu, every element
    assert integer is not None and integer.identical, integer
    verdict = run_a1000(name)  # every model here holds a hardswish / groupnorm / bilinear the a1000 lacks
    assert verdict.startswith("refused: ") and "cannot run" in verdict and "fix:" in verdict
    if name in DETECTORS:
        boundary = json.loads({p.key: p.value for p in out["proto"].metadata_props}["dal.boundary"])
        assert [o.name for o in out["proto"].graph.output] == boundary["outputs"]
        assert "NMS" in boundary["host"] and boundary["npu"][0] == "backbone"


@pytest.fixture(scope="module")
def fcos():
    model = build("fcos_resnet50_fpn")
    return dal.prepare_qat(model, recipe="int8_balanced", hardware="a2000")


def test_functional_ops_of_untraceable_detector_modules_are_listed(fcos):
    rows = {r.name: r for r in dal.prepared(fcos).report.rows}
    adds = [n for n in rows if n.startswith("backbone.fpn.dal_sites.add_l")]
    cats = [n for n in rows if ".dal_sites.cat_l" in n]
    assert len(adds) == 2 and all(rows[n].status == "quantized" for n in adds)  # FPN's top-down sums
    assert len(cats) == 3  # the heads' concatenation of levels (cls_logits, bbox_regression, bbox_ctrness)
    # IntermediateLayerGetter (a ModuleDict with a forward) traces: its stem BN folds into conv1
    assert "fused with backbone.body.bn1 + relu" in rows["backbone.body.conv1"].detail
    assert not any(r.type_name == "QBatchNorm2d" for r in rows.values())
    assert all(r.type_name == "Fp16GroupNorm" for n, r in rows.items() if n.startswith("head.") and
               r.type_name.endswith("GroupNorm"))
    notes = " ".join(dal.prepared(fcos).report.notes)
    assert "transform (GeneralizedRCNNTransform): host side" in notes


def test_training_and_evaluation_calls_are_unchanged(fcos):
    x = batch("fcos_resnet50_fpn", fcos)
    fcos.eval()
    dal.calibrate(fcos, [x])
    images = [torch.rand(3, 64, 64) for _ in range(2)]
    targets = [{"boxes": torch.tensor([[4.0, 4.0, 40.0, 30.0]]), "labels": torch.tensor([1])}] * 2
    fcos.train()
    losses = fcos(images, targets)
    assert set(losses) == {"classification", "bbox_regression", "bbox_ctrness"}
    sum(losses.values()).backward()  # the head is called once per level: trains
    fcos.eval()
    with torch.no_grad():
        detections = fcos(images)
    assert len(detections) == 2 and set(detections[0]) == {"boxes", "scores", "labels"}


@pytest.mark.parametrize("targets, match", [
    ([{"boxes": torch.zeros(1, 4)}] * 2, r"targets\[0\]: missing key\(s\) \['labels'\]"),
    ({"boxes": torch.zeros(1, 4), "labels": torch.zeros(1, dtype=torch.int64)}, r"targets: expected a list of dicts"),
    ([{"boxes": torch.zeros(4), "labels": torch.zeros(1, dtype=torch.int64)}] * 2,
     r"targets\[0\]\['boxes'\]: expected a float tensor \[N, 4\]"),
    ([{"boxes": torch.zeros(1, 4), "labels": torch.zeros(1)}] * 2, r"targets\[0\]\['labels'\]: expected an int64"),
])
def test_targets_in_the_wrong_format_get_one_line(fcos, targets, match):
    fcos.train()
    with pytest.raises(ValueError, match=match) as info:
        fcos([torch.rand(3, 64, 64) for _ in range(2)], targets)
    assert "\n" not in str(info.value)


def test_calibration_dicts_and_wrong_rank_get_one_line(fcos):
    x = torch.rand(2, 3, 64, 64)
    for data, match in (([{"image": x}], r"calibration batch 0: .* got a dict with keys \['image'\]"),
                        ([x[0]], r"calibration batch 0: .* rank 4 .* got rank 3"),
                        ([x[0, 0, 0]], r"rank 4 .* got rank 1")):
        with pytest.raises(ValueError, match=match) as info:
            dal.calibrate(fcos, data)
        assert "\n" not in str(info.value)
    with pytest.raises(ValueError, match=r"images: expected a list of \(3, H, W\) tensors.*rank 3"):
        fcos(x[0])
    with pytest.raises(ValueError, match=r"export_onnx\(detector, \(batch,\)\): the batch: .*got rank 3"):
        dal.export_onnx(fcos, (x[0],))


def test_segmenters_on_a1000_are_refused_by_path():
    with pytest.raises(RecipeError, match=r"interpolate \(bilinear\).*'a1000' cannot run.*upsample_nearest"):
        model = build("fcn_resnet50")
        dal.prepare_qat(model, recipe="int8_balanced", hardware="a1000", example_inputs=(torch.rand(1, 3, 64, 64),))


def test_a_degenerate_input_scale_is_named_at_export(tmp_path):
    # Random weights, BN statistics of the constructor (mean 0, var 1): in eval the activations of
    # LRASPP's classifier after global pooling are ~1e-10, so is its calibrated input scale, and its
    # int32 bias codes saturate (dal.npu: "accumulator plus bias overflows int32"). Named here.
    model = build("lraspp_mobilenet_v3_large")
    x = torch.rand(1, 3, 64, 64)
    model = dal.prepare_qat(model, recipe="int8_balanced", hardware="a2000", example_inputs=(x,))
    model.eval()
    dal.calibrate(model, [x], bn_statistics="keep")  # "auto" would estimate them and avoid the collapse
    with pytest.raises(dal.export.ExportError, match=r"high_classifier/Conv: \d+ of \d+ int32 bias codes saturate; "
                                                      r"input scale s_in = [0-9.]+e-\d\d") as info:
        dal.export_onnx(model, (x,), os.fspath(tmp_path / "seg.onnx"))  # segmentation: the whole model
    assert "calibrate on representative data" in str(info.value) and "BatchNorm running statistics" in str(info.value)


def test_faster_rcnn_box_head_stays_float_on_the_host():
    """Faster R-CNN's RoI box head runs after proposal selection, outside the exported file, and
    dal.calibrate (which runs the NPU part) never feeds it: it is left float, listed with why,
    holds no quantizer, and the detector still evaluates."""
    model = build("fasterrcnn_mobilenet_v3_large_320_fpn")
    model = dal.prepare_qat(model, recipe="int8_balanced", hardware="a2000")
    rows = {r.name: r for r in dal.prepared(model).report.rows}
    box = [r for n, r in rows.items() if n.startswith("roi_heads.")]
    assert {"roi_heads.box_head.fc6", "roi_heads.box_predictor.cls_score"} <= {r.name for r in box}
    assert all(r.status == "float" and "host side of the detector boundary" in r.detail for r in box)
    assert not [n for n, m in model.roi_heads.named_modules() if isinstance(m, dal.FakeQuantizer)]
    assert any(r.status in ("quantized", "fused") for n, r in rows.items() if n.startswith("rpn.head."))
    model.eval()
    dal.calibrate(model, [torch.rand(1, 3, 64, 64)])
    with torch.no_grad():
        detections = model([torch.rand(3, 64, 64)])
    assert set(detections[0]) == {"boxes", "scores", "labels"}
