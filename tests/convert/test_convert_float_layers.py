"""A layer left float by a ``skip: true`` rule (export/SPEC.md §5a, float islands): the integer
model computes its float32 Conv / Gemm as the NPU does, products and sum in float64, rounded
once, then the bias in float32 (dal.convert.float_layers). Checked against a numpy float64
oracle written from the spec and, on whole models, against dal.npu element by element (before,
torch's float32 kernel made 2901 of 4116 output values of such a model differ)."""
from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
import yaml
from torch import nn

from convert_common import assert_bit_exact, build, random_batches
from dal.convert.float_layers import FloatLayerForm
import dal

torch.set_num_threads(1)


def _conv_oracle(x, w, b, pad, mode):
    """float32(sum float64 x * w) + b in float32 (stride 1), numpy: im2col with a float64 einsum."""
    n, c, h, wd = x.shape
    o, _, kh, kw = w.shape
    xp = np.pad(x.astype(np.float64), ((0, 0), (0, 0), (pad, pad), (pad, pad)), mode=mode)
    ho, wo = h + 2 * pad - kh + 1, wd + 2 * pad - kw + 1
    cols = np.stack([xp[:, :, i:i + ho, j:j + wo] for i in range(kh) for j in range(kw)], axis=2)
    s = np.einsum("nckhw,ock->nohw", cols, w.astype(np.float64).reshape(o, c, kh * kw)).astype(np.float32)
    return s + b.reshape(1, -1, 1, 1)


@pytest.mark.parametrize("mode", ["zeros", "reflect"])
def test_a_float_conv_is_the_float64_sum_rounded_once_then_the_bias(mode):
    torch.manual_seed(0)
    conv = nn.Conv2d(24, 7, 3, padding=1, padding_mode=mode)
    x = torch.randn(2, 24, 9, 9)
    got = FloatLayerForm(conv, "c")(x).detach().numpy()
    want = _conv_oracle(x.numpy(), conv.weight.detach().numpy(), conv.bias.detach().numpy(), 1,
                        "constant" if mode == "zeros" else "reflect")
    assert (got == want).all()
    assert (conv(x).detach().numpy() != want).any()  # torch's float32 kernel is not that (the test can fail)


def test_a_float_linear_is_the_float64_sum_rounded_once_then_the_bias():
    torch.manual_seed(1)
    fc = nn.Linear(300, 17)
    x = torch.randn(5, 4, 300)  # rank 3: exported MatMul + Add, the same two roundings as a Gemm
    got = FloatLayerForm(fc, "fc")(x).detach().numpy()
    s = (x.numpy().astype(np.float64) @ fc.weight.detach().numpy().astype(np.float64).T).astype(np.float32)
    assert (got == s + fc.bias.detach().numpy()).all()
    no_bias = nn.Linear(300, 17, bias=False)
    want = (x.numpy().astype(np.float64) @ no_bias.weight.detach().numpy().astype(np.float64).T).astype(np.float32)
    assert (FloatLayerForm(no_bias, "fc")(x).detach().numpy() == want).all()


class _Heads(nn.Module):
    """A small backbone with a pooled classifier and a 1x1 dense head, both skipped by the recipe."""

    def __init__(self):
        super().__init__()
        self.c1 = nn.Conv2d(3, 16, 3, padding=1)
        self.c2 = nn.Conv2d(16, 32, 3, padding=1)
        self.relu = nn.ReLU()
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(32, 10)
        self.head = nn.Conv2d(32, 8, 1)

    def forward(self, x):
        y = self.relu(self.c2(self.relu(self.c1(x))))
        return self.fc(self.pool(y).flatten(1)), self.head(y)


def _recipe_skipping(names):
    with open("recipes/int8_balanced.yaml") as f:
        recipe = yaml.safe_load(f)
    recipe["rules"].insert(0, {"match": names, "skip": True})
    return recipe


def test_skipped_layers_bit_exact_with_the_npu():
    x = torch.randn(2, 3, 16, 16)
    qat, proto, sess = build(_Heads(), x, "a2000", recipe=_recipe_skipping(["fc", "head"]))
    rows = {r.name: r for r in dal.prepared(qat).report.rows}
    assert rows["fc"].status == rows["head"].status == "float"
    im = dal.convert(copy.deepcopy(qat), (x,))
    assert_bit_exact(im, proto, sess, random_batches((3, 3, 16, 16)), "skipped fc + head")
