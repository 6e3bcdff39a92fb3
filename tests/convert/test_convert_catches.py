"""Integer model vs NPU has teeth: a bias one code off in the file, a requantizer the file
misstates, or a rounding bug in the integer model are all caught; and bad input is refused
with the culprit's name, or runs in float and is listed."""
import copy

import numpy as np
import pytest
import torch
from onnx import numpy_helper
from torch import nn

import dal
import dal.convert.requant as requant
import dal.npu
from convert_common import build, compare, random_batches
from dal.convert import ConvertError
from dal_examples.zoo import MnistCNN
from export_common import spec
from dal.nn import QConv2d, QConvBnReLU2d, QLinear

torch.set_num_threads(1)
SHAPE = (3, 1, 28, 28)


@pytest.fixture(scope="module")
def mnist_a1000():
    torch.manual_seed(0)
    qat, proto, sess = build(MnistCNN(), torch.randn(2, 1, 28, 28), "a1000")
    return qat, proto, sess, dal.convert(qat)


def _diffs(im, proto, sess):
    return sum(compare(im, proto, sess, x)["code_diff"] for x in random_batches(SHAPE, n=2))


def test_clean_file_agrees(mnist_a1000):
    qat, proto, sess, im = mnist_a1000
    assert _diffs(im, proto, sess) == 0


def test_bias_off_by_one_code_is_caught(mnist_a1000):
    qat, proto, sess, im = mnist_a1000
    bad = copy.deepcopy(proto)
    init = next(t for t in bad.graph.initializer if t.name == "conv.bias.codes")  # an integer group
    init.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(init) + np.int32(1), init.name))
    first = compare(im, bad, dal.npu.load(bad, threads=1), random_batches(SHAPE, n=1)[0])
    assert first["code_diff"] > 0, "a bias one code off went unnoticed"


def test_wrong_requantizer_in_file_is_caught(mnist_a1000):
    qat, proto, sess, im = mnist_a1000
    bad = copy.deepcopy(proto)
    for p in bad.metadata_props:
        if p.key == "dal.requantizer":  # the hardware says 31 bits
            p.value = '{"kind": "fixed_point", "multiplier_bits": 6, "rounding": "half_up"}'
    assert _diffs(im, bad, dal.npu.load(bad, threads=1)) > 0


def test_wrong_rounding_in_integer_model_is_caught(mnist_a1000, monkeypatch):
    qat, proto, sess, im = mnist_a1000
    truncate = lambda prod, n, rounding: torch.bitwise_right_shift(prod, n.clamp(0, 62))  # floor
    monkeypatch.setattr(requant, "round_shift", truncate)
    assert _diffs(dal.convert(qat), proto, sess) > 0


def test_never_calibrated_names_the_quantizers():
    model = dal.prepare_qat(MnistCNN(), recipe="int8_balanced", hardware="a2000",
                            example_inputs=(torch.randn(1, 1, 28, 28),), quantize_outputs=True)
    with pytest.raises(ConvertError, match=r"stem\.0\.input_quant.*\n(.*\n)*.*before dal\.convert"):
        dal.convert(model)


def test_still_observing_names_the_quantizer():
    torch.manual_seed(0)
    qat, _, _ = build(MnistCNN(), torch.randn(2, 1, 28, 28), "a2000")
    qat.head.output_quant.set_state("observe")
    with pytest.raises(ConvertError, match=r"head\.output_quant"):
        dal.convert(qat)


class _Mixed(nn.Module):
    """An int8 conv, a per-group int4 conv (no integer group in the NPU: it runs in float)."""

    def __init__(self):
        super().__init__()
        self.c1 = QConvBnReLU2d.from_float(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16),
                                           spec("int8", "int8"), "c1")
        self.c2 = QConv2d.from_float(nn.Conv2d(16, 16, 3, padding=1),
                                     spec("int4", "int8", wg="per_group", gs=8), "c2", activation="relu")
        self.head = QLinear.from_float(nn.Linear(16, 10), spec("int8", "int8"), "head")

    def forward(self, x):
        return self.head(self.c2(self.c1(x)).mean((2, 3)))


def test_layer_without_integer_form_runs_in_float_and_is_listed():
    torch.manual_seed(0)
    m = _Mixed()
    with torch.no_grad():
        for _ in range(2):
            m(torch.randn(4, 3, 16, 16))
    for q in m.modules():
        if isinstance(q, dal.FakeQuantizer):
            q.end_observation("frozen")
    m.eval()
    proto = dal.export_onnx(m, (torch.randn(2, 3, 16, 16),), dynamic_batch=True)
    sess = dal.npu.load(proto, threads=1)
    im = dal.convert(m)
    for x in random_batches((2, 3, 16, 16), n=2):
        r = compare(im, proto, sess, x)
        assert r["out_diff"] == 0 and r["code_diff"] == 0, r
    forms = im.layer_forms()
    assert forms["c2"].startswith("float: weight is not 8/4-bit integer codes"), forms
    assert "c2: float" in im.summary() and forms["c1"] == "integer"
