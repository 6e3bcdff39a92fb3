"""Streaming error statistics of a tensor ``a`` (quantized) against a reference ``b`` (float).

Accumulated over batches in float64 so that a layer's numbers do not depend on the batch size:

    cosine = <a, b> / (|a| |b|)          (1.0 when both are zero)
    MSE    = sum((a - b)^2) / N          MAE = sum(|a - b|) / N
    PSNR   = 10 log10(max|b|^2 / MSE)    (inf when MSE is 0)
    max    = max |a - b|
"""
from __future__ import annotations

import math

import torch


class ErrorStats:
    """``add(a, b)`` per batch, then read ``cosine``, ``mse``, ``psnr``, ``mae``, ``max_abs``."""

    def __init__(self):
        self.n = 0
        self.dot = self.aa = self.bb = self.sse = self.sae = 0.0
        self.max_abs = 0.0
        self.peak = 0.0

    def add(self, a: torch.Tensor, b: torch.Tensor) -> "ErrorStats":
        if a.shape != b.shape:
            raise ValueError(f"cannot compare tensors of shapes {tuple(a.shape)} and {tuple(b.shape)}")
        a, b = a.detach().double(), b.detach().double()
        d = a - b
        self.n += a.numel()
        self.dot += float((a * b).sum())
        self.aa += float((a * a).sum())
        self.bb += float((b * b).sum())
        self.sse += float((d * d).sum())
        self.sae += float(d.abs().sum())
        if a.numel():
            self.max_abs = max(self.max_abs, float(d.abs().max()))
            self.peak = max(self.peak, float(b.abs().max()))
        return self

    @property
    def cosine(self) -> float:
        if self.aa == 0.0 and self.bb == 0.0:
            return 1.0
        return self.dot / max(math.sqrt(self.aa * self.bb), 1e-300)

    @property
    def mse(self) -> float:
        return self.sse / max(self.n, 1)

    @property
    def mae(self) -> float:
        return self.sae / max(self.n, 1)

    @property
    def psnr(self) -> float:
        if self.mse == 0.0:
            return math.inf
        return 10.0 * math.log10(max(self.peak, 1e-300) ** 2 / self.mse)

    def as_dict(self) -> dict:
        return {"cosine": self.cosine, "mse": self.mse, "psnr": self.psnr, "mae": self.mae,
                "max_abs": self.max_abs, "elements": self.n}
