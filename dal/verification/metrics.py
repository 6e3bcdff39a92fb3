"""Agreement between two tensors: cosine, MSE, PSNR, max abs error, and LSB mismatch counts."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np


@dataclass(frozen=True)
class Agreement:
    """How tensor ``a`` (e.g. the NPU reference) agrees with ``b`` (e.g. torch).

    ``lsb`` is the output format's scale when known: ``off_by_one`` counts elements with
    ``0 < |a - b| <= 1.5 LSB`` and ``off_by_more`` those beyond; without a scale only exact
    equality is counted (``off_by_one`` stays 0).
    """

    elements: int
    identical: int
    off_by_one: int
    off_by_more: int
    max_abs: float
    max_lsb: Optional[float]
    cosine: float
    mse: float
    psnr: float
    lsb: Optional[float]

    @property
    def within_one_lsb_fraction(self) -> float:
        return (self.identical + self.off_by_one) / max(self.elements, 1)


def agreement(a, b, lsb: Optional[float] = None) -> Agreement:
    """Compare ``a`` with ``b`` (same shape) in float64.

    cosine = <a, b> / (|a| |b|) (1.0 when both are zero); MSE = mean((a - b)^2);
    PSNR = 10 log10(max|b|^2 / MSE) (inf when MSE is 0).
    """
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    if a.shape != b.shape:
        raise ValueError(f"cannot compare tensors of shapes {a.shape} and {b.shape}")
    d = np.abs(a - b)
    identical = int((d == 0).sum())
    if lsb:
        steps = d / lsb
        one = int(((d > 0) & (steps <= 1.5)).sum())
        more = int((steps > 1.5).sum())
        max_lsb = float(steps.max(initial=0.0))
    else:
        one, more, max_lsb = 0, int((d > 0).sum()), None
    na, nb = np.linalg.norm(a), np.linalg.norm(b)
    cosine = 1.0 if na == 0 and nb == 0 else float((a * b).sum() / max(na * nb, 1e-300))
    mse = float((d ** 2).mean()) if d.size else 0.0
    peak = float(np.abs(b).max(initial=0.0))
    psnr = float("inf") if mse == 0 else float(10 * np.log10(max(peak, 1e-300) ** 2 / mse))
    return Agreement(int(a.size), identical, one, more, float(d.max(initial=0.0)), max_lsb, cosine, mse, psnr, lsb)
