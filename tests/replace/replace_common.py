"""Helpers shared by the dal.replace tests."""
from __future__ import annotations

import numpy as np
import onnxruntime as ort
import torch
from torch import nn


def ort_run(path_or_proto, feeds: dict) -> list:
    """onnxruntime with graph optimizations off (the oracle of FACTS.md)."""
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    src = path_or_proto if isinstance(path_or_proto, str) else path_or_proto.SerializeToString()
    return ort.InferenceSession(src, so, providers=["CPUExecutionProvider"]).run(None, feeds)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach(), b.detach()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def small_transformer(seed: int = 0, batch_first: bool = True) -> nn.Module:
    torch.manual_seed(seed)
    layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.1, batch_first=batch_first, activation=nn.GELU())
    return nn.Sequential(nn.TransformerEncoder(layer, 2, enable_nested_tensor=True), nn.Linear(32, 10)).eval()


def lsb_figures(torch_out: np.ndarray, other: np.ndarray, scale: float) -> tuple[float, float]:
    """(fraction of outputs within 1 LSB, max difference in LSB)."""
    d = np.abs(torch_out.astype(np.float64) - other.astype(np.float64)) / scale
    return float((d <= 1.0 + 1e-6).mean()), float(d.max())
