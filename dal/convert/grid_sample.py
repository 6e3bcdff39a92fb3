"""``QGridSample`` in the integer model: the GridSample float island of export/SPEC.md §5b,
computed in torch float64 from the dequantized input and grid, what dal.npu computes from the file.

Per output ``(n, c, i, j)``: unnormalize (``align_corners``: ``(g + 1) / 2 * (n - 1)``, else
``((g + 1) * n - 1) / 2``), clamp to ``[-2, n + 1]`` (zeros) / ``[-1, n]`` (border); bilinear:
``w_ab = wy_a * wx_b`` from ``x0 = floor(px)``, ``wx1 = px - x0``, ``wx0 = 1 - wx1``, and
``acc = v00 w00 + v01 w01 + v10 w10 + v11 w11`` summed left to right in float64, rounded once to
float32; nearest: the pixel at ``round_half_even`` of the coordinates; taps outside are 0.0
(zeros) or the pixel at the clamped index (border); a NaN coordinate samples 0.0. Then the
output QuantizeLinear with the input quantizer's scale and zero point. The QAT module itself runs
torch's float32 ``grid_sampler`` instead.
"""
from __future__ import annotations

import torch
from torch import nn

from ..nn.grid_sample import check_grid
from .wrapped import WrapsModule


def _pixel(g: torch.Tensor, n: int, align: bool, border: bool) -> torch.Tensor:
    p = (g + 1.0) / 2.0 * (n - 1) if align else ((g + 1.0) * n - 1.0) / 2.0
    return p.clamp(-1.0, float(n)) if border else p.clamp(-2.0, float(n + 1))


def _gather(x: torch.Tensor, iy: torch.Tensor, ix: torch.Tensor, border: bool) -> torch.Tensor:
    """(N, C, Ho, Wo) pixels of ``x`` (float64, N C H W) at integral float indices (N, Ho, Wo)."""
    n_, c_, h, w = x.shape
    yi, xi = iy.clamp(0, h - 1).long(), ix.clamp(0, w - 1).long()
    flat = (yi * w + xi).reshape(n_, 1, -1).expand(n_, c_, -1)
    v = torch.gather(x.reshape(n_, c_, h * w), 2, flat).reshape(n_, c_, *iy.shape[1:])
    if not border:
        inside = (iy >= 0) & (iy <= h - 1) & (ix >= 0) & (ix <= w - 1)
        v = torch.where(inside[:, None], v, torch.zeros((), dtype=v.dtype, device=v.device))
    return v


def grid_sample_f64(x: torch.Tensor, grid: torch.Tensor, mode: str, padding_mode: str,
                    align_corners: bool) -> torch.Tensor:
    """export/SPEC.md §5b's GridSample on float32 ``x`` (N, C, H, W) and ``grid`` (N, Ho, Wo, 2):
    float64 throughout, one rounding to float32 (module doc)."""
    X, G = x.double(), grid.double()
    h, w = X.shape[2], X.shape[3]
    border = padding_mode == "border"
    px = _pixel(G[..., 0], w, align_corners, border)
    py = _pixel(G[..., 1], h, align_corners, border)
    nan = torch.isnan(px) | torch.isnan(py)
    zero = torch.zeros((), dtype=torch.float64, device=X.device)
    px, py = torch.where(nan, zero, px), torch.where(nan, zero, py)
    if mode == "nearest":
        out = _gather(X, torch.round(py), torch.round(px), border)  # torch.round: half to even
    else:
        x0, y0 = torch.floor(px), torch.floor(py)
        wx1, wy1 = px - x0, py - y0
        wx0, wy0 = 1.0 - wx1, 1.0 - wy1
        acc = _gather(X, y0, x0, border) * (wy0 * wx0)[:, None]
        acc = acc + _gather(X, y0, x0 + 1.0, border) * (wy0 * wx1)[:, None]
        acc = acc + _gather(X, y0 + 1.0, x0, border) * (wy1 * wx0)[:, None]
        out = acc + _gather(X, y0 + 1.0, x0 + 1.0, border) * (wy1 * wx1)[:, None]
    return torch.where(nan[:, None], zero, out).float()


def float_grid_sample(input, grid, mode="bilinear", padding_mode="zeros", align_corners=None):
    """A float ``F.grid_sample`` left unquantized (its recipe rule does not quantize it): the
    exported GridSample as :func:`grid_sample_f64` computes it, or None (torch's own op) for
    another mode, padding, rank or dtype (dal.npu refuses those modes)."""
    if (mode not in ("bilinear", "nearest") or padding_mode not in ("zeros", "border") or input.dim() != 4
            or input.dtype != torch.float32 or grid.dtype != torch.float32):
        return None
    return grid_sample_f64(input, grid, mode, padding_mode, bool(align_corners))


class GridSampleForm(WrapsModule):
    """A ``QGridSample`` (``qat``) as the file computes it: its input and grid quantizers, the
    float64 GridSample of :func:`grid_sample_f64`, then the input quantizer again (the output
    keeps the input's scale and zero point)."""

    def __init__(self, qat: nn.Module, path: str):
        super().__init__()
        self.qat, self.path = qat, path

    def forward(self, x: torch.Tensor, grid: torch.Tensor) -> torch.Tensor:
        q = self.qat
        check_grid(self.path, x, grid)
        xq = q.input_quant(x) if q.input_quant is not None else x
        y = grid_sample_f64(xq, q.grid_quant(grid), q.mode, q.padding_mode, q.align_corners)
        return q.input_quant(y) if q.input_quant is not None else y
