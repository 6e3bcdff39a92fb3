"""Helpers shared by the dal.replace tests (the oracles they use are tests/oracles.py)."""
from __future__ import annotations

import torch
from torch import nn


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach(), b.detach()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def small_transformer(seed: int = 0, batch_first: bool = True) -> nn.Module:
    torch.manual_seed(seed)
    layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.1, batch_first=batch_first, activation=nn.GELU())
    return nn.Sequential(nn.TransformerEncoder(layer, 2, enable_nested_tensor=True), nn.Linear(32, 10)).eval()

