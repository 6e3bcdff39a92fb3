"""An FP16 GroupNorm / InstanceNorm island (``Fp16GroupNorm``, ``Fp16InstanceNorm2d`` on the a2000)
is exported as ``InstanceNormalization`` (GroupNorm: on the ``(N, G, -1)`` view, scale 1, B 0,
then ``Mul(gamma)`` and ``Add(beta)``) between Casts, and by export/SPEC.md §5a both integer
engines compute the InstanceNormalization in float64 and round once to float32, then GroupNorm's
Mul and Add in float32, one rounding each.

Before, dal.convert ran torch's float32 ``group_norm`` kernel (float32 statistics, the affine
folded into ``x * a + c``): an ulp off that on about half of the island's float32 outputs and on
~2.5e-4 of its float16 values; the int8 quantizer after RetinaNet v2's head block (Conv ->
GroupNorm -> ReLU) then differed from dal.npu on 1 of 16384 codes, 273 of 2.1M end to end.
The oracle: Python fractions for the statistics (exact), ``decimal`` at 60 digits for the
square root and division, correctly rounded to float32; numpy float32 for the Mul and Add.
"""
from __future__ import annotations

from decimal import Decimal, localcontext
from fractions import Fraction

import numpy as np
import pytest
import torch
from torch import nn

import dal
from convert_common import assert_bit_exact, build, random_batches
from oracles import nearest_float

torch.set_num_threads(1)


class ConvNormConv(nn.Module):
    """Conv -> norm -> ReLU -> Conv: RetinaNet v2's head block, small."""

    def __init__(self, norm: nn.Module):
        super().__init__()
        self.conv0, self.norm, self.act, self.conv1 = nn.Conv2d(3, 16, 3, padding=1), norm, nn.ReLU(), nn.Conv2d(16, 4, 1)
        with torch.no_grad():  # a non-trivial affine, so that GroupNorm's Mul and Add round
            self.norm.weight.uniform_(0.5, 2.0)
            self.norm.bias.uniform_(-1.0, 1.0)

    def forward(self, x):
        return self.conv1(self.act(self.norm(self.conv0(x))))


def instancenorm_exact(x: np.ndarray, scale: np.ndarray, bias: np.ndarray, eps: float) -> np.ndarray:
    """float32 of the exact ``(x - mean) / sqrt(var + eps) * scale + B`` over axes 2.. of each
    (n, c), the biased variance, ``eps`` the float32 attribute's value."""
    out = np.empty(x.shape, np.float32)
    with localcontext() as ctx:
        ctx.prec = 60
        e = Fraction(float(np.float32(eps)))
        for (n, c) in np.ndindex(x.shape[:2]):
            v = [Fraction(float(t)) for t in x[n, c].ravel()]
            mean = sum(v) / len(v)
            var = sum((t - mean) ** 2 for t in v) / len(v)
            var_e = var + e
            inv = 1 / (Decimal(var_e.numerator) / Decimal(var_e.denominator)).sqrt()
            g, b = Decimal(float(scale[c])), Fraction(float(bias[c]))
            flat = out[n, c].reshape(-1)
            for i, t in enumerate(v):
                d = Decimal((t - mean).numerator) / Decimal((t - mean).denominator)
                flat[i] = nearest_float(Fraction(d * inv * g) + b, np.float32)
    return out


def _f16(t: torch.Tensor) -> np.ndarray:
    return t.detach().numpy().astype(np.float16).astype(np.float32)  # the file's Cast round trip


def _island_output(proto) -> str:
    """The float32 tensor the island's Cast(FLOAT16) reads (GroupNorm's Add, InstanceNorm's node)."""
    cast = next(n for n in proto.graph.node if n.op_type == "Cast" and n.name.startswith("/norm/output_quant/"))
    return cast.input[0]


# torch's exporter warns that instance_norm uses input statistics in eval mode: it is what the module does
@pytest.mark.filterwarnings("ignore:ONNX export mode is set to TrainingMode.EVAL")
@pytest.mark.parametrize("norm", [lambda: nn.GroupNorm(4, 16), lambda: nn.InstanceNorm2d(16, affine=True)],
                         ids=["groupnorm", "instancenorm"])
def test_fp16_norm_island_is_correctly_rounded_in_both_engines(norm):
    torch.manual_seed(0)
    x = torch.randn(2, 3, 8, 8)
    qat, proto, sess = build(ConvNormConv(norm()), x, "a2000")
    assert type(qat.norm).__name__.startswith("Fp16"), type(qat.norm)
    assert [n for n in proto.graph.node if n.op_type == "InstanceNormalization"]
    im = dal.convert(qat)
    seen = {}
    q_in, q_out = im.net.norm.input_quant, im.net.norm.output_quant
    q_in.register_forward_hook(lambda mod, args, out: seen.__setitem__("in", out.numpy().copy()))
    q_out.register_forward_hook(lambda mod, args, out: seen.__setitem__("out", args[0].numpy().copy()))
    out_name = _island_output(proto)
    mod = qat.norm
    w, b = _f16(mod.weight), _f16(mod.bias)
    for batch in random_batches((2, 3, 8, 8), n=2, seed=5):
        im(batch)
        _, values = sess.run({sess.input_names[0]: batch.numpy()}, return_intermediates=True)
        x_in = seen["in"]
        assert (x_in == x_in.astype(np.float16)).all()  # the island reads float16 values
        if isinstance(mod, nn.GroupNorm):
            g = mod.num_groups
            ones = np.ones(g, np.float32)
            y = instancenorm_exact(x_in.reshape(x_in.shape[0], g, -1), ones, 0 * ones, mod.eps).reshape(x_in.shape)
            want = y * w.reshape(1, -1, 1, 1) + b.reshape(1, -1, 1, 1)  # two float32 roundings
        else:
            want = instancenorm_exact(x_in, w, b, mod.eps)
        got, npu = seen["out"], np.asarray(values[out_name])
        assert np.array_equal(got.view(np.int32), want.view(np.int32)), \
            f"dal.convert is off the correctly rounded island on {(got != want).sum()} of {got.size}"
        assert np.array_equal(npu.view(np.int32), want.view(np.int32)), \
            f"dal.npu is off the correctly rounded island on {(npu != want).sum()} of {npu.size}"
    assert_bit_exact(im, proto, sess, random_batches((3, 3, 8, 8), n=3), "conv -> fp16 norm -> relu -> conv")
