"""``Fp16RMSNorm`` (``dal.replace.rmsnorm``) in the integer model: what its exported nodes
compute (export/SPEC.md §5a, RMSNorm), not torch's fused ``rms_norm`` kernel.

The file spells the island, between the FP16 Cast round trips of its input and output, as
float32 nodes, each one rounding by §5a (``C`` the normalised size, ``x`` the float16-valued input):

    p   = Pow(x, 2)                      float32(x * x)          (exact: x has 11 significant bits)
    ms  = ReduceMean(p, -1)              float32(sum_float64(p) / C)          one rounding
    v   = Add(ms, float32(eps))          one float32 addition
    s   = Sqrt(v)                        correctly rounded float32 square root
    r   = Div(1, s)                      one float32 division
    n   = Mul(x, r)                      one float32 multiplication
    y   = Mul(n, float16(weight))        one float32 multiplication
    out = float16(y)                     the output quantizer's round trip

torch's ``F.rms_norm`` (the QAT forward) sums the squares in float32 and multiplies by an
``rsqrt``: an ulp of float32 off this chain on ~17% of elements (measured on random float16
rows of 64), which crosses a float16 rounding boundary on ~3 in 100,000 outputs and then, at
an int8 quantizer reading the island, a code (the tiny Qwen2 decode of
export/decoder_generate_check.py). The square root is taken in float64 and rounded once to
float32: that is the correctly rounded float32 square root (float64 holds 2 * 24 + 2 bits);
torch's float32 ``sqrt`` kernel is not always correctly rounded (layernorm.py).
"""
from __future__ import annotations

import torch
from torch import nn

from .float_ops import mean_f64
from .fp16_region import float32_value
from .quant_calls import dispatch_off
from .wrapped import WrapsModule


def rms_norm_onnx(x: torch.Tensor, eps: float) -> torch.Tensor:
    """``x / sqrt(mean(x^2, -1) + eps)`` over the last axis of float32 ``x`` as the exported
    Pow / ReduceMean / Add / Sqrt / Div / Mul nodes compute it, each rounded once to float32
    (module doc; ``eps`` taken as the float32 constant the file holds)."""
    if x.dtype != torch.float32:
        raise TypeError(f"rms_norm_onnx: x must be float32 (the exported island's type), got {x.dtype}")
    return _rms_norm(x, torch.tensor(float32_value(eps), dtype=torch.float32, device=x.device),
                     torch.tensor(1.0, dtype=torch.float32, device=x.device))


def _rms_norm(x: torch.Tensor, eps32: torch.Tensor, one: torch.Tensor) -> torch.Tensor:
    """:func:`rms_norm_onnx` with its float32 constants given as tensors on ``x``'s device: ``eps32``
    the file's epsilon, ``one`` the Div's 1 (RMSNormForm makes them once)."""
    ms = mean_f64(x * x, (-1,), True)
    s = torch.sqrt((ms + eps32).double()).float()
    return x * (one / s)


class RMSNormForm(WrapsModule):
    """An ``Fp16RMSNorm`` (``qat``) as the file computes it: its input quantizer (the FP16 round
    trip), :func:`rms_norm_onnx` in float32, the result cast to the input's dtype, times the
    weight after its quantizer (one float32 multiplication; none without a weight), then the
    output quantizer. The QAT module is kept, so its quantizers still run (code taps see them)."""

    def __init__(self, qat: nn.Module, path: str):
        super().__init__()
        self.qat, self.path = qat, path
        # the island's float32 constants (its epsilon, the Div's 1), made once (they move with the form)
        self.register_buffer("eps32", torch.tensor(float32_value(qat.rms_eps), dtype=torch.float32),
                             persistent=False)
        self.register_buffer("one", torch.tensor(1.0, dtype=torch.float32), persistent=False)

    def forward(self, x):
        # none of these ops is one NPUFloatOps replaces (float_ops.py): run without its per-call cost
        with dispatch_off():
            q = self.qat
            x = q.input_quant(x)
            xf = x.float()
            if xf.device == self.eps32.device:
                y = _rms_norm(xf, self.eps32, self.one).to(x.dtype)
            else:
                y = rms_norm_onnx(xf, q.rms_eps).to(x.dtype)
            if q.weight is not None:
                y = y * q.weight_quant(q.weight)
            return q.output_quant(y)
