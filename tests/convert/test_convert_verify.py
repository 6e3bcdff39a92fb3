"""dal.verify's integer-model row, its one-line diagnosis and the verdict that does not flip
with the input (ResNet-18, random weights: end to end the float QAT model drifts from the NPU
on some inputs, from near-ties; the integer model never does)."""
import copy

import numpy as np
import pytest
import torch
from onnx import numpy_helper

import dal
from convert_common import build

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def resnet():
    tv = pytest.importorskip("torchvision")
    torch.manual_seed(0)
    qat, proto, _ = build(tv.models.resnet18(weights=None), torch.randn(2, 3, 64, 64), "a2000")
    return qat, proto


def _x(seed):
    return torch.randn((2, 3, 64, 64), generator=torch.Generator().manual_seed(seed))


def test_verdict_is_stable_where_the_float_model_drifts(resnet):
    qat, proto = resnet
    drifted = 0
    for seed in (0, 1):
        rep = dal.verify(proto, qat, (_x(seed),))
        assert rep.integer.identical and rep.integer.tensors >= 38, rep.integer
        assert rep.verdict(), rep.verdict_line()
        text = str(rep).splitlines()
        assert text[1].startswith("VERDICT: PASS: integer model == NPU on every element")
        vs_torch = rep.outputs["output"]["npu_vs_torch"]
        if vs_torch.identical < vs_torch.elements:
            drifted += 1
            assert rep.diagnosis().startswith("diagnosis: near-tie cascade"), rep.diagnosis()
            assert text[2] == rep.diagnosis()
    assert drifted, "this model and these inputs were chosen because the float model drifts on one"


def test_a_wrong_bias_is_a_real_discrepancy_and_fails_the_verdict(resnet):
    qat, proto = resnet
    bad = copy.deepcopy(proto)
    init = next(t for t in bad.graph.initializer if t.name == "layer2.0.conv1.bias.codes")
    init.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(init) + np.int32(1), init.name))
    rep = dal.verify(bad, qat, (_x(0),), onnxruntime=False)
    assert not rep.integer.identical and not rep.verdict()
    assert rep.diagnosis().startswith("diagnosis: real discrepancy"), rep.diagnosis()
    # the first differing quantized tensor is the one that layer's output feeds
    assert "layer2.0.conv2.input_quant" in rep.integer.first, rep.integer.first
    assert str(rep).splitlines()[1].startswith("VERDICT: FAIL")
