"""recipes/int8_detection.yaml: the first conv and the last conv of each head in FP16, the rest
int8 as int8_balanced; the names cover dal_examples.zoo_detection's and torchvision's models."""
import pytest
import torch

import dal
from dal.recipe import check_against_hardware, load_recipe
from dal_examples.zoo_detection import DigitDetector, DigitSegmenter

FP16 = ["fpn.stem.0", "heat_head.1", "box_head.1", "head", "backbone.body.conv1",
        "head.classification_head.cls_logits", "head.regression_head.bbox_reg", "head.regression_head.bbox_ctrness",
        "backbone.features.0.0.0", "classifier.4", "classifier.low_classifier"]
INT8 = ["fpn.c2.0.0", "heat_head.0.0", "backbone.body.layer1.0.conv1", "head.classification_head.conv.0.0",
        "backbone.fpn.inner_blocks.0.0"]


@pytest.mark.parametrize("name", FP16)
def test_first_conv_and_head_outputs_fall_back_to_fp16(name):
    assert load_recipe("int8_detection").resolve(name, "Conv2d", "conv").fallback_fp16


@pytest.mark.parametrize("name", INT8)
def test_the_other_convs_are_int8(name):
    spec = load_recipe("int8_detection").resolve(name, "Conv2d", "conv")
    assert not spec.fallback_fp16 and spec.weight.format.name == "int8" and spec.input.format.name == "uint8"


def test_fits_the_a2000_and_says_fp16_runs_off_the_a1000():
    check_against_hardware(load_recipe("int8_detection"), "a2000")
    report = str(check_against_hardware(load_recipe("int8_detection"), "a1000"))
    assert "rule 0" in report and "outside the NPU" in report


@pytest.mark.parametrize("model, expect", [(DigitDetector, {"fpn.stem.0", "heat_head.1", "box_head.1"}),
                                           (DigitSegmenter, {"fpn.stem.0", "head"})])
def test_prepare_puts_exactly_those_layers_in_fp16(model, expect):
    q = dal.prepare_qat(model(), recipe="int8_detection", hardware="a2000", example_inputs=(torch.rand(2, 1, 96, 96),))
    fp16 = {row.name for row in dal.prepared(q).report.by_status("fp16")}
    assert fp16 == expect
