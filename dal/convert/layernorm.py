"""``Fp16LayerNorm`` (rule ``layernorm_fp16``) and float ``nn.LayerNorm`` modules in the
integer model: what the exported graph computes (export/SPEC.md §6a), not torch's fused
``layer_norm`` kernel.

Input, weight and bias are rounded to float16 (Cast round trips; Fp16LayerNorm only), then, over the normalised
(last) axes with ``n`` elements, as the file spells it:

* traced opset >= 17, ``LayerNormalization``: in float64, ``d = x - mean(x)``,
  ``y = float32(d / sqrt(mean(d^2) + eps))`` (one rounding), then ``y * w + b`` in float32;
* below 17, torch's decomposition, each node one float32 op: ``mean = float32(sum_float64(x) /
  n)`` (ReduceMean: the division in float64, one rounding), ``d = x - mean``,
  ``var = ReduceMean(d * d)`` (Pow 2 is the correctly rounded square), ``y = d / sqrt(var +
  float32(eps))`` (Sqrt correctly rounded), ``y * w + b``;

then the output is rounded to float16 (Fp16LayerNorm). The float16-valued input makes the first sum exact in
float64 in any order (11-bit mantissas over an exponent span of 40 bits: exact for n < 2^13);
the sum of squares is not, which leaves SPEC.md §5a's residual float64 near-tie.
"""
from __future__ import annotations

import torch
from torch import nn

from .float_ops import mean_f64
from .fp16_region import float32_value
from .wrapped import WrapsModule

#: the first opset with a LayerNormalization operator (torch exports it from there on)
LAYERNORM_OPSET = 17


def layer_norm_onnx(x, w, b, ndims: int, eps: float, opset: int) -> torch.Tensor:
    """``LayerNormalization`` (``opset >= 17``) or torch's decomposition of it (module doc), on
    float32 ``x``; ``w`` / ``b`` may be None."""
    dims = tuple(range(x.ndim - ndims, x.ndim))
    n = 1
    for d in dims:
        n *= x.shape[d]
    if opset >= LAYERNORM_OPSET:
        x64 = x.double()
        mean = x64.sum(dim=dims, keepdim=True) / n
        d = x64 - mean
        var = (d * d).sum(dim=dims, keepdim=True) / n
        y = (d / torch.sqrt(var + float32_value(eps))).float()
    else:
        d = x - mean_f64(x, dims, True)  # ReduceMean (float_ops.py, SPEC §5a)
        var = mean_f64(d * d, dims, True)
        v = var + torch.tensor(eps, dtype=torch.float32, device=x.device)
        # Sqrt correctly rounded: in float64, rounded once (float64 holds 2 * 24 + 2 bits). torch's
        # float32 sqrt is not (its vectorised kernel: 29 of 3136 results an ulp off, measured)
        y = d / torch.sqrt(v.double()).float()
    if w is not None:
        y = y * w
    if b is not None:
        y = y + b
    return y


def _call(q, x):
    return q(x) if q is not None else x


class LayerNormForm(WrapsModule):
    """An ``Fp16LayerNorm`` or a float ``nn.LayerNorm`` (``qat``) as the file computes it, at
    the export's traced ``opset`` (a float one has no FP16 round trips)."""

    def __init__(self, qat: nn.Module, path: str, opset: int):
        super().__init__()
        self.qat, self.path, self.opset = qat, path, int(opset)

    def forward(self, x):
        q = self.qat
        w = _call(getattr(q, "weight_quant", None), q.weight) if q.weight is not None else None
        b = _call(getattr(q, "bias_quant", None), q.bias) if q.bias is not None else None
        x = _call(getattr(q, "input_quant", None), x).float()
        y = layer_norm_onnx(x, w, b, len(q.normalized_shape), q.eps, self.opset)
        return _call(getattr(q, "output_quant", None), y)
