"""``F.scaled_dot_product_attention`` in the integer model: the graph torch's exporter writes for
it (``symbolic_opset14``), node by node with the float semantics of export/SPEC.md §5a, not
torch's fused float32 attention kernel (timm's ViT, any ``nn.Module`` calling the function).

The exported graph, for ``q, k, v`` float32 ``[..., L, E]`` and no ``scale`` argument:

    r    = Sqrt(Div(1.0, Sqrt(Cast(E))))                 each node one float32 rounding
    qk   = MatMul(q * r, Transpose(k) * r)                 float64 sum, rounded once (§5a)
    p    = Softmax(qk [+ mask], axis=-1)                   dal.convert.attention.softmax_f32
    out  = MatMul(p, v)                                    float64 sum, rounded once

The float32 ``Sqrt`` and ``Div`` are correctly rounded (IEEE, as numpy computes them); they are
taken here in float64 and rounded once, which is the same float32 (double rounding is innocuous
for a square root or a quotient when the wide format has at least 2p + 2 bits: 53 >= 50).
torch's kernel scales ``q`` alone, by ``1 / sqrt(E)``, and sums in float32: on a timm ViT that
moved a few attention outputs across a rounding boundary of the next quantizer per batch.

Covered: no mask or a float mask, no dropout, not causal, no ``scale``, no grouped-query
attention; any other call returns None and runs torch's own function (it may then differ
from the NPU; the export's own symbolic decides what the file holds).
"""
from __future__ import annotations

import math

import torch

from .attention import softmax_f32

#: the first opset whose exporter writes this decomposition (symbolic_opset14)
SDPA_OPSET = 14


def _f32(v: float) -> float:
    """``v`` rounded once to float32 (round to nearest even), as a Python float."""
    return float(torch.tensor(v, dtype=torch.float64).float())


def attention_scale_root(embed: int) -> float:
    """``Sqrt(1 / Sqrt(float32(E)))`` in float32, each node correctly rounded (module doc)."""
    inv = _f32(1.0 / _f32(math.sqrt(float(embed))))
    return _f32(math.sqrt(inv))


def matmul_f64(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """A float island's MatMul (§5a): every product and the sum in float64, rounded once to float32."""
    return torch.matmul(a.double(), b.double()).float()


def sdpa_onnx(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
              enable_gqa=False):
    """``scaled_dot_product_attention`` as the exported graph computes it (module doc), or None
    for a call outside what that covers."""
    if dropout_p or is_causal or scale is not None or enable_gqa:
        return None
    if any(t.dtype != torch.float32 for t in (query, key, value)):
        return None
    if attn_mask is not None and attn_mask.dtype != torch.float32:
        return None
    r = torch.tensor(attention_scale_root(query.shape[-1]), dtype=torch.float32, device=query.device)
    qk = matmul_f64(query * r, key.transpose(-2, -1) * r)
    if attn_mask is not None:
        qk = qk + attn_mask
    return matmul_f64(softmax_f32(qk, -1), value)
