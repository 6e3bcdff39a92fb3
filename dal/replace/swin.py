"""NpuShiftedWindowAttention: torchvision's Swin (V1 and V2) window attention from modules.

torchvision's ``ShiftedWindowAttention.forward`` calls the function
``shifted_window_attention(x, self.qkv.weight, self.proj.weight, ...)``: the projections never
run as modules, so prepare cannot quantize them. This module runs the same computation with
``self.qkv`` / ``self.proj`` called as modules (the original nn.Linear objects) and the core's
explicit matmuls. Window partition, padding, cyclic shift and the shift mask depend on the
input's shape; they are fx leaf functions, so prepare's trace of this forward succeeds.
"""
from __future__ import annotations

from typing import Union

import torch
import torch.fx
import torch.nn.functional as F
from torch import nn

from .core import NpuAttentionCore


def _swin_partition(x: torch.Tensor, window_size: list, shift_size: list):
    """``[B, H, W, C]`` -> (windows ``[B*nW, Ws0*Ws1, C]``, geometry for the reverse and mask)."""
    b, h, w, c = x.shape
    pad_r = (window_size[1] - w % window_size[1]) % window_size[1]
    pad_b = (window_size[0] - h % window_size[0]) % window_size[0]
    x = F.pad(x, (0, 0, 0, pad_r, 0, pad_b))
    _, ph, pw, _ = x.shape
    shift = list(shift_size)
    if window_size[0] >= ph:  # a window covers the whole map: no shift (torchvision's rule)
        shift[0] = 0
    if window_size[1] >= pw:
        shift[1] = 0
    if sum(shift) > 0:
        x = torch.roll(x, shifts=(-shift[0], -shift[1]), dims=(1, 2))
    nw = (ph // window_size[0]) * (pw // window_size[1])
    x = x.view(b, ph // window_size[0], window_size[0], pw // window_size[1], window_size[1], c)
    x = x.permute(0, 1, 3, 2, 4, 5).reshape(b * nw, window_size[0] * window_size[1], c)
    return x, (b, h, w, ph, pw, shift, nw)


def _swin_mask(windows: torch.Tensor, geo, window_size: list):
    """The shifted-window additive mask ``[B*nW, 1, N, N]`` (0 / -inf), or None without shift.

    torchvision writes -100 (exp(-100) ~ 4e-44: the same probabilities to float32 precision);
    -inf says "masked" outright, so a table softmax gives those entries exactly 0 and its int8
    input range is not stretched by 100 to cover the mask (dal.replace.softmax_lut)."""
    b, _, _, ph, pw, shift, nw = geo
    if sum(shift) == 0:
        return None
    m = windows.new_zeros((ph, pw))
    hs = ((0, -window_size[0]), (-window_size[0], -shift[0]), (-shift[0], None))
    ws = ((0, -window_size[1]), (-window_size[1], -shift[1]), (-shift[1], None))
    count = 0
    for h in hs:
        for w in ws:
            m[h[0]:h[1], w[0]:w[1]] = count
            count += 1
    m = m.view(ph // window_size[0], window_size[0], pw // window_size[1], window_size[1])
    m = m.permute(0, 2, 1, 3).reshape(nw, window_size[0] * window_size[1])
    m = m.unsqueeze(1) - m.unsqueeze(2)
    m = m.masked_fill(m != 0, float("-inf")).masked_fill(m == 0, float(0.0))
    # window index of row r of the batch of windows is r % nW (torchvision's view(B, nW, ...))
    return m.unsqueeze(1).repeat(b, 1, 1, 1)


def _swin_reverse(x: torch.Tensor, geo, window_size: list):
    b, h, w, ph, pw, shift, _ = geo
    c = x.shape[-1]
    x = x.view(b, ph // window_size[0], pw // window_size[1], window_size[0], window_size[1], c)
    x = x.permute(0, 1, 3, 2, 4, 5).reshape(b, ph, pw, c)
    if sum(shift) > 0:
        x = torch.roll(x, shifts=(shift[0], shift[1]), dims=(1, 2))
    return x[:, :h, :w, :].contiguous()


def _rel_bias(table: torch.Tensor, index: torch.Tensor, window_size: list) -> torch.Tensor:
    n = window_size[0] * window_size[1]
    bias = table[index].view(n, n, -1)
    return bias.permute(2, 0, 1).contiguous().unsqueeze(0)


for _fn in ("_swin_partition", "_swin_mask", "_swin_reverse", "_rel_bias"):
    torch.fx.wrap(_fn)  # leaf calls for prepare's fx rewrite (shape-dependent Python)


class NpuShiftedWindowAttention(nn.Module):
    """Drop-in for torchvision's ``ShiftedWindowAttention`` / ``ShiftedWindowAttentionV2``
    (``forward(x: [B, H, W, C]) -> [B, H, W, C]``), sharing its modules and Parameters.

    V2: the k-part of ``qkv.bias`` is unused by torchvision (zeroed in a copy each call); after
    the swap it is zeroed in place and its gradient masked, so ``self.qkv`` can run as a module.
    """

    def __init__(self, swin: nn.Module, softmax_mode: Union[str, bool] = "fp16"):
        super().__init__()
        self.v2 = hasattr(swin, "logit_scale")
        self.window_size, self.shift_size = list(swin.window_size), list(swin.shift_size)
        self.num_heads = swin.num_heads
        self.qkv, self.proj = swin.qkv, swin.proj  # the original nn.Linear objects
        self.register_buffer("relative_position_index", swin.relative_position_index)
        if self.v2:
            self.cpb_mlp = swin.cpb_mlp
            self.register_buffer("relative_coords_table", swin.relative_coords_table)
        else:
            self.relative_position_bias_table = swin.relative_position_bias_table
        head_dim = swin.qkv.in_features // swin.num_heads
        self.core = NpuAttentionCore(head_dim ** -0.5, swin.attention_dropout, softmax_mode,
                                     logit_scale=swin.logit_scale if self.v2 else None, name="core")
        self.out_dropout = nn.Dropout(swin.dropout)
        self.train(swin.training)

    def zero_unused_key_bias(self) -> bool:
        """V2: zero the k-part of qkv.bias (torchvision never uses it) and keep it at zero (a gradient
        hook; the bias is marked ``dal_k_bias_masked = True`` so that a second call adds none)."""
        b = self.qkv.bias
        if not self.v2 or b is None or getattr(b, "dal_k_bias_masked", False):
            return False
        n = b.numel() // 3
        with torch.no_grad():
            b[n:2 * n].zero_()
        mask = torch.ones_like(b)
        mask[n:2 * n] = 0
        b.register_hook(lambda g: g * mask)
        b.dal_k_bias_masked = True
        return True

    def _bias(self):
        if self.v2:
            table = self.cpb_mlp(self.relative_coords_table).view(-1, self.num_heads)
            return 16 * torch.sigmoid(_rel_bias(table, self.relative_position_index, self.window_size))
        return _rel_bias(self.relative_position_bias_table, self.relative_position_index, self.window_size)

    def forward(self, x):
        c = x.shape[-1]
        windows, geo = _swin_partition(x, self.window_size, self.shift_size)
        qkv = self.qkv(windows)
        qkv = qkv.reshape(windows.shape[0], windows.shape[1], 3, self.num_heads, c // self.num_heads)
        qkv = qkv.permute(2, 0, 3, 1, 4)
        out, _ = self.core(qkv[0], qkv[1], qkv[2], self._bias(), _swin_mask(windows, geo, self.window_size))
        out = out.transpose(1, 2).reshape(windows.shape[0], windows.shape[1], c)
        out = self.out_dropout(self.proj(out))
        return _swin_reverse(out, geo, self.window_size)

    def extra_repr(self) -> str:
        return f"window_size={self.window_size}, shift_size={self.shift_size}, num_heads={self.num_heads}, v2={self.v2}"
