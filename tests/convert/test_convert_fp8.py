"""FP8 element by element: a recipe rule giving convolutions and linears FP8 E4M3 weights and
activations (a float island on both engines: exact FP8 decoding, float64 sums rounded once),
E5M2 on the classifier; int8 residual adds; every FP8 tensor of the file compared bit for bit with dal.npu's."""
import pytest
import torch
import yaml

import dal
from convert_common import assert_bit_exact, build, random_batches

torch.set_num_threads(1)
ROOT = dal.recipe.load.__file__.rsplit("/dal/", 1)[0]


def _fp8_recipe():
    rec = yaml.safe_load(open(f"{ROOT}/recipes/int8_balanced.yaml"))
    rec["name"] = "fp8_everywhere"
    e4m3 = {"format": "fp8_e4m3", "granularity": "per_tensor", "symmetric": True, "observer": "minmax"}
    e4m3_w = dict(e4m3, granularity="per_channel")
    e5m2 = dict(e4m3, format="fp8_e5m2")
    rec["rules"] = [{"type": ["linear"], "weight": dict(e5m2, granularity="per_channel"), "input": e5m2},
                    {"type": ["conv"], "weight": e4m3_w, "input": e4m3}] + rec["rules"]
    return rec


def test_fp8_resnet_bit_exact():
    tv = pytest.importorskip("torchvision")
    torch.manual_seed(0)
    qat, proto, sess = build(tv.models.resnet18(weights=None), torch.randn(2, 3, 32, 32), "a2000",
                             recipe=_fp8_recipe())
    fp8_types = {t.data_type for t in proto.graph.initializer if t.name.endswith("zero_point")}
    assert {17, 19} <= fp8_types, "E4M3 (17) and E5M2 (19) zero points expected in the file"
    im = dal.convert(qat)
    assert_bit_exact(im, proto, sess, random_batches((2, 3, 32, 32), n=3), "resnet18/fp8")
