"""A bf16 autocast QAT step: every quantizer computes its scale and its rounding in float32 and returns
the input's dtype; its codes are those of float32 fake quantization of the same values.

What differs from the float32 step, and why: the float layers. Under autocast a conv takes bf16
inputs (8 significant bits: a dequantized int8 activation ``c * s`` is itself rounded to bf16, up to
2^-9 relative) and writes bf16, so the tensor reaching the next quantizer is not the float32 step's.
Measured on this model and data (frozen quantizers, same scales): the first quantizer (float32
input) agrees exactly; at the first quantizer after a bf16 conv codes differ by up to 3 LSB on ~17%
of elements, growing layer by layer (up to ~40 LSB before the head). Those numbers depend on the
CPU's bf16 convolution, so only the exact properties are asserted.
"""
import copy

import torch
import torch.nn.functional as F

from dal.formats import fake_quantize as reference
from dal.quantizer import quantizers

from test_compile import _prepared


def _capture(model):
    seen = []

    def hook(mod, inp, out):
        seen.append((mod, inp[0].detach().clone(), out.detach().clone(), mod.scale.detach().clone(),
                     mod.zero_point.detach().clone()))
    handles = [q.register_forward_hook(hook) for _, q in quantizers(model)]
    return seen, handles


def _codes(mod, y, scale, zp):
    s, z = mod.granularity.expand(scale, y.shape), mod.granularity.expand(zp.float(), y.shape)
    return torch.round(y.float() / s) + z


def test_bf16_autocast_step_quantizes_in_float32():
    for state in ("quantize", "frozen"):
        model = _prepared(state)
        f32, bf16 = copy.deepcopy(model), copy.deepcopy(model)
        seen32, _ = _capture(f32)
        seen16, _ = _capture(bf16)
        x, y = torch.randn(4, 1, 28, 28), torch.tensor([3, 1, 4, 1])
        F.cross_entropy(f32(x), y).backward()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = bf16(x)
        F.cross_entropy(out.float(), y).backward()
        half = 0
        for (m, xin, yout, scale, zp), (m32, *_r) in zip(seen16, seen32):
            assert m.name == m32.name
            assert yout.dtype == xin.dtype and scale.dtype == torch.float32, m.name
            if xin.dtype != torch.bfloat16:
                continue
            half += 1
            # float32 fake quantization of the same values (exactly widened), rounded once to bf16
            expect = reference(xin.float(), m.fmt, scale, zp, m.granularity, m.narrow_range).to(torch.bfloat16)
            assert torch.equal(yout, expect), m.name
            # and the codes are exactly recoverable from the bf16 output (|c| <= 255 < 2^8, error < 0.5 LSB)
            codes = _codes(m, yout, scale, zp)
            assert torch.equal(codes, _codes(m, expect.float(), scale, zp))
            assert codes.min() >= m.qmin and codes.max() <= m.qmax
        assert half >= 5, "the activations after a conv should be bf16 under autocast"
        first32, first16 = seen32[0], seen16[0]  # the stem's input quantizer: float32 input in both steps
        assert torch.equal(first32[2], first16[2])
        for p in bf16.parameters():
            assert p.grad is None or (p.grad.dtype == torch.float32 and torch.isfinite(p.grad).all())
