"""A BatchNorm left in float (nothing to fold into: DenseNet's pre-activation BN reads a Concat)
is one ONNX BatchNormalization node, and by export/SPEC.md §5a's rule "each node rounds once"
both integer engines compute it in float64 and round once to float32.

Before, dal.convert ran torch's float32 batch norm, which rounds its per-channel terms to
float32 in its own order: on timm's densenet121 (64x64, an unfolded BatchNormAct2d) its
output differed from dal.npu's by an ulp on 5090 of 18432 elements of one BN, and one of them
flipped a code of the next quantizer (integer model vs NPU: 30135 of 2.7M codes differed end to
end). The oracle here is Python's ``decimal`` at 50 digits, correctly rounded to float32.
"""
from __future__ import annotations

from decimal import Decimal, localcontext

import numpy as np
import torch
from torch import nn

import dal
from convert_common import assert_bit_exact, build, random_batches

torch.set_num_threads(1)


class PreActDense(nn.Module):
    """stem (conv + BN + ReLU: folds), then two pre-activation layers: BN -> ReLU -> conv, the
    second BN on the concat of the stem's and the first layer's outputs (as DenseNet)."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU())
        self.norm1, self.act1, self.conv1 = nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1, bias=False)
        self.norm2, self.act2, self.conv2 = nn.BatchNorm2d(16), nn.ReLU(), nn.Conv2d(16, 4, 1)

    def forward(self, x):
        a = self.stem(x)
        b = self.conv1(self.act1(self.norm1(a)))
        return self.conv2(self.act2(self.norm2(torch.cat([a, b], 1))))


def _nearest_f32(v: Decimal) -> np.float32:
    """The float32 nearest to the exact ``v`` (the candidates around float(v), compared exactly)."""
    f = np.float32(float(v))
    cands = (np.nextafter(f, np.float32(-np.inf)), f, np.nextafter(f, np.float32(np.inf)))
    return min(cands, key=lambda c: abs(Decimal(float(c)) - v))


def batchnorm_exact(x: np.ndarray, bn: nn.BatchNorm2d) -> np.ndarray:
    """float32 of the exact ``(x - mean) / sqrt(var + float32(eps)) * scale + B`` (50 digits)."""
    mean, var, w, b = (t.detach().numpy() for t in (bn.running_mean, bn.running_var, bn.weight, bn.bias))
    eps = Decimal(float(np.float32(bn.eps)))
    out = np.empty_like(x)
    with localcontext() as ctx:
        ctx.prec = 50
        for c in range(x.shape[1]):
            inv = 1 / (Decimal(float(var[c])) + eps).sqrt()
            m, g, beta = Decimal(float(mean[c])), Decimal(float(w[c])), Decimal(float(b[c]))
            for i, v in np.ndenumerate(x[:, c]):
                out[(i[0], c) + i[1:]] = _nearest_f32((Decimal(float(v)) - m) * inv * g + beta)
    return out


def _float_bn_recipe(tmp_path) -> str:
    """int8_balanced with norm1 and norm2 kept in float (``skip``): a float BN island, whatever
    its reason (a2000 prepare left timm's unfolded BatchNormAct2d so before it became a
    QBatchNorm2d, dal.nn.norm_act.NormActAffine)."""
    import yaml
    recipe = yaml.safe_load(open("recipes/int8_balanced.yaml"))
    recipe["name"] = "int8_float_bn"
    recipe["rules"] = [{"match": ["norm1", "norm2"], "skip": True}] + recipe["rules"]
    path = tmp_path / "float_bn.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return str(path)


def test_a_float_batchnorm_rounds_once_in_both_engines(tmp_path):
    torch.manual_seed(0)
    x = torch.randn(2, 3, 8, 8)
    qat, proto, sess = build(PreActDense(), x, "a2000", recipe=_float_bn_recipe(tmp_path))
    bns = [n for n in proto.graph.node if n.op_type == "BatchNormalization"]
    assert len(bns) == 2, "norm1 and norm2 are left in float (nothing to fold into)"
    im = dal.convert(qat)
    seen = {}
    for name in ("norm1", "norm2"):
        im.net.get_submodule(name).register_forward_hook(
            lambda mod, args, out, name=name: seen.__setitem__(name, (args[0].numpy().copy(), out.numpy().copy())))
    batch = random_batches((2, 3, 8, 8), n=1)[0]
    im(batch)
    _, values = sess.run({sess.input_names[0]: batch.numpy()}, return_intermediates=True)
    for node, name in zip(bns, ("norm1", "norm2")):
        x_in, got = seen[name]
        assert np.array_equal(x_in, values[node.input[0]]), f"{name}: the engines' BN inputs differ"
        want = batchnorm_exact(x_in, qat.get_submodule(name))
        assert np.array_equal(got.view(np.int32), want.view(np.int32)), \
            f"{name}: dal.convert is off the correctly rounded BN on {(got != want).sum()} of {got.size}"
        npu = np.asarray(values[node.output[0]])
        assert np.array_equal(npu.view(np.int32), want.view(np.int32)), \
            f"{name}: dal.npu is off the correctly rounded BN on {(npu != want).sum()} of {npu.size}"
    assert_bit_exact(im, proto, sess, random_batches((3, 3, 8, 8), n=3), "pre-activation dense block")


def test_a_float16_batchnorm_rounds_once():
    # x * w + b = 1 + 2^-11 + 2^-30 exactly: float16's nearest is 1 + 2^-10; through float32 first
    # (torch's float64 -> float16) it becomes the tie 1 + 2^-11 and then 1.0. dal.npu rounds once.
    from dal.convert.float_ops import batch_norm_f64
    x = torch.ones(1, 1, 1, 1, dtype=torch.float16)
    eps = 2.0 ** -10
    mean, var = torch.zeros(1), torch.full((1,), 1 - eps)  # var + eps = 1 exactly
    w, b = torch.full((1,), 1 + 2.0 ** -11), torch.full((1,), 2.0 ** -30)
    y = batch_norm_f64(x, mean, var, w, b, eps=eps)
    assert y.dtype == torch.float16 and float(y) == float(np.float16(1 + 2.0 ** -10))
