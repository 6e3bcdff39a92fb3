"""FP16 (and BF16) regions of the integer model: a Conv / Linear layer kept in a plain float
format, computed with the float semantics of export/SPEC.md §6 ("FP16 regions"), in torch.

A layer whose input and weight quantizers are the same plain float format (a recipe's
``fallback: fp16``) is exported as ``Cast(to=FLOAT16) -> Conv|Gemm|MatMul(x16, W16, b16)
[-> Relu|Clip] -> Cast(to=FLOAT)``, and the NPU computes, every node rounding once to float16:

    x16 = float16(x)                                        (round to nearest even)
    y   = float16(sum_k x16[k] * W16[o, k] + b16[o])          (products, sum, bias in float64; ONE rounding)
    y   = Relu(y) | Clip(y, float16(lo), float16(hi))        (exact)

then the Cast back to float32 (exact). A Linear on rank > 2 inputs is exported as MatMul + Add,
two nodes: ``float16(float16(sum) + b16)``, the Add one correctly rounded float16 addition. These are written here from the spec, not from dal.npu:
the weight is the trained (BN-folded, masked) weight rounded to float16 by the layer's own
weight quantizer, the bias the trained float bias rounded to float16, as the exporter writes
its float16 initializers. The float64 sum is exact for every product (11-bit significands) and
rounded once; two implementations can only disagree where a float64 sum lies within its own
rounding error of a float16 rounding boundary (export/SPEC.md §5a).

The QAT model trains such a layer with float32 arithmetic on float16-rounded operands; this
module is what the chip computes instead.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

def _active(q) -> bool:
    return q is not None and q.state in ("quantize", "frozen")


def round_once(y64: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """float64 ``y64`` rounded ONCE, to nearest even, to ``dtype`` (float16 / bfloat16), as
    numpy's ``astype(float16)`` (dal.npu) does. torch's float64 -> float16 conversion goes through
    float32 and rounds twice (1 + 2^-11 + 2^-40 becomes 1.0). Here the float32 step rounds to
    odd instead (toward zero, the last bit set when inexact), which keeps the sticky information:
    float32's 24 bits are at least p + 2 for p = 11 (float16) and 8 (bfloat16), so the second
    rounding is the correct one. NaN stays NaN; beyond float32's range gives +-inf as before."""
    y = y64.to(torch.float32)
    inexact = y.to(torch.float64) != y64
    away = inexact & (y.abs().to(torch.float64) > y64.abs())  # rounded away from zero: step back
    y = torch.where(away, torch.nextafter(y, torch.zeros_like(y)), y)
    bits = y.view(torch.int32)
    return torch.where(inexact & ~y.isnan(), bits | 1, bits).view(torch.float32).to(dtype)


def to_dtype_once(y64: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """float64 ``y64`` rounded once to ``dtype``: float32 directly, float16 / bfloat16 by
    :func:`round_once` (torch's own float64 -> float16 cast goes through float32, rounding twice)."""
    return round_once(y64, dtype) if dtype in (torch.float16, torch.bfloat16) else y64.to(dtype)


def float32_value(v: float) -> float:
    """The value a float32 ONNX attribute (``epsilon``) holds, widened exactly to a Python float."""
    return float(torch.tensor(v, dtype=torch.float32))


def half_dtype(qat: nn.Module) -> Optional[torch.dtype]:
    """The torch dtype of the FP16 / BF16 region ``qat`` (a Conv / Linear QAT layer) is exported
    as, or None: its input and weight quantizers are both active and of that one plain float
    format (what the exporter's region rule requires, dal/export/casts.py)."""
    q_in, q_w = getattr(qat, "input_quant", None), getattr(qat, "weight_quant", None)
    if not (_active(q_in) and _active(q_w)) or q_in.fmt.name != q_w.fmt.name:
        return None
    fmt = q_in.fmt  # a plain float cast (FP16 / BF16: no scale) forms a region; QFormat knows its dtype
    return fmt.torch_dtype() if fmt.kind == "float" and fmt.bits < 32 else None


def add_half(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``a + b`` correctly rounded to ``dtype`` (float16 / bfloat16) for ``dtype``-valued a, b:
    the float32 sum of two such values rounded once. float32's 24-bit significand has at least
    2p + 2 bits for float16 (p = 11) and bfloat16 (p = 8), so the double rounding is innocuous:
    this is the IEEE addition in that format."""
    return (a.float() + b.float()).to(dtype)


def _activation(y: torch.Tensor, activation, dtype: torch.dtype) -> torch.Tensor:
    """Relu / relu6 / ("clip", lo, hi) on ``dtype`` values; Clip's bounds are ``dtype``
    constants in the file (the exporter converts a region's constants), so round them too."""
    if activation is None:
        return y
    if activation == "relu":
        return torch.clamp(y, min=0)
    if activation == "relu6":
        lo, hi = 0.0, 6.0
    else:
        lo, hi = float(activation[1]), float(activation[2])
    lo16, hi16 = (torch.tensor(v, dtype=torch.float32).to(dtype).to(y.dtype) for v in (lo, hi))
    return torch.minimum(torch.maximum(y, lo16), hi16)


def half_forward(qat: nn.Module, kind: str, w: torch.Tensor, b: Optional[torch.Tensor], x: torch.Tensor,
                 dtype: torch.dtype) -> torch.Tensor:
    """The layer ``qat`` (``kind`` "conv" or "linear") as its FP16/BF16 region computes it
    (module docstring), from ``w`` (the trained weight, already rounded by its quantizer) and
    ``b`` (the trained float bias or None). Returns float32; a non-float output quantizer of
    the layer (the region ends at it) is applied after the Cast back to float32."""
    x16 = x.to(dtype)
    w64 = w.to(dtype).double()
    b64 = None if b is None else b.to(dtype).double()
    if kind == "conv":
        ph, pw = qat.padding
        xp = F.pad(x16.double(), (pw, pw, ph, ph))
        y = F.conv2d(xp, w64, None, qat.stride, 0, qat.dilation, qat.groups)
        y = round_once(y if b64 is None else y + b64.reshape(1, -1, 1, 1), dtype)
    elif x.ndim == 2 or b64 is None:  # Gemm (or a MatMul without bias): one rounding
        y = torch.matmul(x16.double(), w64.t())
        y = round_once(y if b64 is None else y + b64, dtype)
    else:  # MatMul, then the bias Add: two nodes, two roundings
        y = add_half(round_once(torch.matmul(x16.double(), w64.t()), dtype), b64.to(dtype), dtype)
    y = _activation(y, qat.activation, dtype).float()
    q_out = qat.output_quant
    return q_out(y) if q_out is not None else y
