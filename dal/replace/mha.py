"""NpuMultiheadAttention: nn.MultiheadAttention rebuilt from modules the NPU runs.

Projections are ``nn.Linear`` modules (prepare swaps them to QLinear), the two products are
explicit matmuls in :class:`~dal.replace.core.NpuAttentionCore` (QMatMul after prepare) and the
softmax is the hardware's (``softmax_mode``: "fp16", "lut" or "float"; see NpuSoftmax). The
forward takes and returns what nn.MultiheadAttention does (batched 3-D inputs), so parents
such as nn.TransformerEncoderLayer and torchvision's ViT blocks call it unchanged.

Weight sharing: separate q/k/v weights and ``out_proj`` are the original Parameter objects.
A packed ``in_proj_weight`` [3E, E] is split into three Parameters that are *views of its
storage* (same memory, new Parameter objects): build the optimizer after ``prepare_qat`` (the
usual order), and note the state_dict keys become ``q_proj.weight`` etc.
"""
from __future__ import annotations

from typing import Optional, Union

import torch
import torch.fx
from torch import nn

from .core import NpuAttentionCore


def _additive(mask: Optional[torch.Tensor], dtype) -> Optional[torch.Tensor]:
    if mask is None:
        return None
    if mask.dtype == torch.bool:  # nn.MultiheadAttention: True = not allowed to attend
        return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(mask, float("-inf"))
    return mask.to(dtype)


def _mha_mask(q: torch.Tensor, k: torch.Tensor, attn_mask, key_padding_mask, is_causal: bool):
    """One additive mask broadcastable to ``[B, h, Lq, Lk]``, or None (nn.MultiheadAttention's rules)."""
    b, h, lq, lk = q.shape[0], q.shape[1], q.shape[2], k.shape[2]
    if attn_mask is None and is_causal:
        attn_mask = torch.ones(lq, lk, dtype=torch.bool, device=q.device).triu_(1)
    total = _additive(attn_mask, q.dtype)
    if total is not None and total.dim() == 3:  # [B * h, Lq, Lk]
        total = total.view(b, h, lq, lk)
    pad = _additive(key_padding_mask, q.dtype)
    if pad is not None:
        pad = pad.view(b, 1, 1, lk)
        total = pad if total is None else total + pad
    return total


def _mha_weights(p: torch.Tensor, need_weights: bool, average: bool):
    if not need_weights:
        return None
    return p.mean(dim=1) if average else p


# Leaf calls for prepare's fx rewrite: they branch on Python values (None masks, flags).
torch.fx.wrap("_mha_mask")
torch.fx.wrap("_mha_weights")


def _linear(weight: nn.Parameter, bias: Optional[nn.Parameter]) -> nn.Linear:
    """An nn.Linear holding ``weight`` / ``bias`` (the given Parameter objects, no copy)."""
    lin = nn.Linear(1, 1, bias=bias is not None)
    lin.in_features, lin.out_features = weight.shape[1], weight.shape[0]
    lin.weight = weight
    if bias is not None:
        lin.bias = bias
    return lin


def _view_param(p: Optional[torch.Tensor], lo: int, hi: int) -> Optional[nn.Parameter]:
    if p is None:
        return None
    return nn.Parameter(p.detach()[lo:hi], requires_grad=p.requires_grad)


class NpuMultiheadAttention(nn.Module):
    """Drop-in for a (3-D, batched) ``nn.MultiheadAttention``: ``forward(query, key, value,
    key_padding_mask=None, need_weights=True, attn_mask=None, average_attn_weights=True,
    is_causal=False) -> (out, weights or None)``; equal to it within float rounding while
    the quantizers are off.

    ``_qkv_same_embed_dim`` is False and ``in_proj_weight``/``in_proj_bias`` None: torch's
    TransformerEncoder(Layer) read them to decide on their fused fast path, which must not run.
    """

    _qkv_same_embed_dim = False
    in_proj_weight = None
    in_proj_bias = None
    bias_k = bias_v = None
    add_zero_attn = False

    def __init__(self, mha: nn.MultiheadAttention, softmax_mode: Union[str, bool] = "fp16"):
        super().__init__()
        e = mha.embed_dim
        self.embed_dim, self.num_heads, self.head_dim = e, mha.num_heads, mha.head_dim
        self.kdim, self.vdim, self.batch_first, self.dropout = mha.kdim, mha.vdim, mha.batch_first, mha.dropout
        bias = mha.in_proj_bias
        if mha._qkv_same_embed_dim:
            w = mha.in_proj_weight
            self.q_proj = _linear(_view_param(w, 0, e), _view_param(bias, 0, e))
            self.k_proj = _linear(_view_param(w, e, 2 * e), _view_param(bias, e, 2 * e))
            self.v_proj = _linear(_view_param(w, 2 * e, 3 * e), _view_param(bias, 2 * e, 3 * e))
        else:
            self.q_proj = _linear(mha.q_proj_weight, _view_param(bias, 0, e))
            self.k_proj = _linear(mha.k_proj_weight, _view_param(bias, e, 2 * e))
            self.v_proj = _linear(mha.v_proj_weight, _view_param(bias, 2 * e, 3 * e))
        self.out_proj = _linear(mha.out_proj.weight, mha.out_proj.bias)
        self.core = NpuAttentionCore(self.head_dim ** -0.5, mha.dropout, softmax_mode, name="core")
        self.train(mha.training)

    def _heads(self, x):
        return x.reshape(x.shape[0], x.shape[1], self.num_heads, self.head_dim).transpose(1, 2)

    def forward(self, query, key, value, key_padding_mask=None, need_weights=True, attn_mask=None,
                average_attn_weights=True, is_causal=False):
        if not self.batch_first:
            query, key, value = query.transpose(0, 1), key.transpose(0, 1), value.transpose(0, 1)
        q = self._heads(self.q_proj(query))
        k = self._heads(self.k_proj(key))
        v = self._heads(self.v_proj(value))
        mask = _mha_mask(q, k, attn_mask, key_padding_mask, is_causal)
        out, p = self.core(q, k, v, None, mask)
        out = out.transpose(1, 2).reshape(query.shape[0], query.shape[1], self.embed_dim)
        out = self.out_proj(out)
        if not self.batch_first:
            out = out.transpose(0, 1)
        return out, _mha_weights(p, need_weights, average_attn_weights)

    def extra_repr(self) -> str:
        return f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, batch_first={self.batch_first}"
