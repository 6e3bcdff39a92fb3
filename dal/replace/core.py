"""The attention core every NPU attention shares: two explicit ``torch.matmul`` products around
the hardware's softmax.

``prepare_qat`` traces this module's own forward with torch.fx and rewrites each
``torch.matmul`` into a ``QMatMul`` (Q K^T and P V with quantized inputs, as the matrix engine
runs them); the softmax is an :class:`~dal.replace.softmax.NpuSoftmax` in the hardware's mode
(FP16 on an FP16 vector engine, an int8 exp lookup table on integer-softmax hardware).
Everything here works on head-split tensors ``[B, heads, L, d]``.
"""
from __future__ import annotations

import math
from typing import Optional, Union

import torch
import torch.fx
import torch.nn.functional as F
from torch import nn

from .softmax import NpuSoftmax, as_mode


def _times_logit_scale(scores: torch.Tensor, logit_scale: torch.Tensor) -> torch.Tensor:
    # Swin V2 cosine attention: a per-head temperature, clamped at 100 as torchvision does.
    return scores * torch.clamp(logit_scale, max=math.log(100.0)).exp()


# A leaf call for prepare's fx rewrite: the temperature is a constant per head, folded by the
# exporter; it must not become an integer QMul.
torch.fx.wrap("_times_logit_scale")


class NpuAttentionCore(nn.Module):
    """``out = P @ v`` with ``P = softmax(scale * q @ k^T + bias + mask)`` (or cosine scores).

    Args:
        scale: multiplies ``q`` before ``q @ k^T`` (``head_dim ** -0.5``); ignored when cosine.
        dropout: attention-probability dropout (training only).
        softmax_mode: "fp16", "lut" or "float" (see NpuSoftmax; a bool is the older flag,
            True = "fp16", False = "float").
        logit_scale: Swin V2 cosine attention: the shared per-head log temperature Parameter.
        name: module path, for quantizer names.

    ``forward(q, k, v, bias=None, mask=None) -> (out, P)``, ``q: [B, h, Lq, d]``, ``k, v: [B, h, Lk, d]``;
    ``bias`` and ``mask`` are additive and broadcast to ``[B, h, Lq, Lk]`` (added in that order).
    """

    def __init__(self, scale: Optional[float] = None, dropout: float = 0.0, softmax_mode: Union[str, bool] = "fp16",
                 logit_scale: Optional[nn.Parameter] = None, name: str = ""):
        super().__init__()
        self.scale = scale
        self.cosine = logit_scale is not None
        if logit_scale is not None:
            self.logit_scale = logit_scale  # the original module's Parameter object
        self.softmax = NpuSoftmax(-1, name=f"{name}.softmax" if name else "softmax", mode=as_mode(softmax_mode))
        self.dropout = nn.Dropout(dropout)

    def forward(self, q, k, v, bias=None, mask=None):
        if self.cosine:
            scores = torch.matmul(F.normalize(q, dim=-1), F.normalize(k, dim=-1).transpose(-2, -1))
            scores = _times_logit_scale(scores, self.logit_scale)
        else:
            scale = self.scale if self.scale is not None else q.shape[-1] ** -0.5
            scores = torch.matmul(q * scale, k.transpose(-2, -1))
        p = self.softmax(scores, bias, mask)
        p = self.dropout(p)
        return torch.matmul(p, v), p

    def extra_repr(self) -> str:
        return "cosine" if self.cosine else f"scale={self.scale}"
