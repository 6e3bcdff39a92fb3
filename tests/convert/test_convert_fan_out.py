"""Fan-out groups (a layer's output read by k >= 2 quantizers: one exact accumulator, one
requantizer per reader, export/SPEC.md) in the integer model: equal to dal.npu on every element
of every output and quantized tensor, float and fixed-point requantizers; the DigitDetector's FPN
convs read by two quantizers, its Conv -> Resize(nearest) -> Q and ResNet's stem
Conv -> Relu -> MaxPool -> {Q, Q} are integer groups in both engines now."""
import pytest
import torch

import dal
from convert_common import assert_bit_exact, build, npu_fused_groups, random_batches
from dal_examples.zoo_detection import DigitDetector

torch.set_num_threads(1)

#: DigitDetector convs whose Relu output is read by two QuantizeLinear nodes (lateral + next stage)
FAN_OUT = {"/fpn/c2/c2.1/c2.1.0/Conv", "/fpn/c3/c3.1/c3.1.0/Conv", "/fpn/smooth4/smooth4.0/Conv"}


@pytest.mark.parametrize("hardware", ["a2000", "a1000"])
def test_digit_detector_fan_out_bit_exact(hardware):
    torch.manual_seed(0)
    qat, proto, sess = build(DigitDetector(), torch.randn(2, 1, 64, 64), hardware)
    fan = {s.node_name: len(s.outputs) for s in sess.steps if s.kind == "fused" and len(s.outputs) > 1}
    assert fan == {n: 2 for n in FAN_OUT}, fan
    float_convs = [s.node_name for s in sess.steps if s.kind == "node" and s.node.op_type == "Conv"]
    assert float_convs == []  # before: the three above and lat4 (Conv -> Resize -> Q)
    lat4 = next(s for s in sess.steps if s.node_name == "/fpn/lat4/Conv")
    assert lat4.kind == "fused" and lat4.post.op_type == "Resize"  # requantize, then resize codes
    im = dal.convert(qat)
    batches = random_batches((3, 1, 64, 64), n=2)
    assert_bit_exact(im, proto, sess, batches, f"DigitDetector/{hardware}")
    forms = im.layer_forms()
    assert sum(f == "integer" for f in forms.values()) == npu_fused_groups(sess) == 15, im.summary()
    for x in batches:  # the shared-accumulator path (no intermediates asked) is the same
        got = im(x)
        plain = sess.run({sess.input_names[0]: x.numpy()})
        assert all(torch.equal(g, torch.from_numpy(p)) for g, p in zip(got, plain))


@pytest.mark.parametrize("hardware", ["a2000", "a1000"])
def test_resnet18_small_input_bit_exact(hardware):
    tv = pytest.importorskip("torchvision")
    torch.manual_seed(0)
    qat, proto, sess = build(tv.models.resnet18(weights=None), torch.randn(2, 3, 32, 32), hardware)
    im = dal.convert(qat)
    batches = random_batches((2, 3, 32, 32), n=2)
    stem = next(s for s in sess.steps if s.node_name == "/model/conv1/Conv")
    # Conv -> Relu -> MaxPool -> {Q, Q}: the stem's codes, max-pooled, for both readers
    assert stem.kind == "fused" and stem.post.op_type == "MaxPool" and len(stem.outputs) == 2
    assert not [s.node_name for s in sess.steps if s.kind == "node" and s.node.op_type in ("Conv", "MaxPool")]
    assert_bit_exact(im, proto, sess, batches, f"resnet18/{hardware}")
    assert sum(f == "integer" for f in im.layer_forms().values()) == npu_fused_groups(sess), im.summary()
    for x in batches:
        assert torch.equal(im(x), torch.from_numpy(sess.run({sess.input_names[0]: x.numpy()})[0]))
