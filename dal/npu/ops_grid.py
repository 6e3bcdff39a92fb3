"""ONNX GridSample (4-D), node by node, in numpy float64: the float island of export/SPEC.md §5b.

Per output ``(n, c, i, j)``, from the float32 (or widened float16) input ``X`` and grid ``g``:

* unnormalize each axis (``W``, ``gx``; ``H``, ``gy``): ``px = (gx + 1) / 2 * (W - 1)`` with
  ``align_corners=1``, ``px = ((gx + 1) * W - 1) / 2`` without, then ``px`` clamped to
  ``[-2, W + 1]`` (zeros) or ``[-1, W]`` (border), which changes no result;
* bilinear (``linear`` from opset 20): ``x0 = floor(px)``, ``wx1 = px - x0``, ``wx0 = 1 - wx1``,
  ``w_ab = wy_a * wx_b``, taps ``v_ab`` (outside the image: 0.0 for zeros, the pixel at the clamped
  index for border), ``acc = v00 w00; acc += v01 w01; acc += v10 w10; acc += v11 w11`` in float64,
  in that order, rounded once to the tensor type;
* nearest: the pixel at ``round_half_even(px), round_half_even(py)`` (a copy);
* a NaN coordinate samples 0.0 in every mode.

bicubic and reflection padding are refused (UnsupportedNode).
"""
from __future__ import annotations

import numpy as np

from .errors import NPUError, UnsupportedNode
from .ops_float import op
from .tensors import as_compute_type, is_float

_MODES = {"bilinear": "linear", "linear": "linear", "nearest": "nearest"}


def _text(v, default: str) -> str:
    v = default if v is None else v
    return v.decode() if isinstance(v, bytes) else str(v)


def _unnormalize(g: np.ndarray, n: int, align: bool, padding: str) -> np.ndarray:
    p = (g + 1.0) / 2.0 * (n - 1) if align else ((g + 1.0) * n - 1.0) / 2.0
    lo, hi = (-1.0, float(n)) if padding == "border" else (-2.0, float(n + 1))
    return np.clip(p, lo, hi)  # NaN stays NaN (masked by the caller)


def _taps(x: np.ndarray, iy: np.ndarray, ix: np.ndarray, padding: str) -> np.ndarray:
    """``x[n, :, iy, ix]`` as (N, C, Ho, Wo) for integral float indices (N, Ho, Wo); outside the
    image 0.0 (zeros) or the clamped pixel (border)."""
    n_, c_, h, w = x.shape
    yi = np.clip(iy, 0, h - 1).astype(np.int64)
    xi = np.clip(ix, 0, w - 1).astype(np.int64)
    v = x[np.arange(n_)[:, None, None], :, yi, xi]          # (N, Ho, Wo, C)
    v = np.moveaxis(v, -1, 1)                                # (N, C, Ho, Wo)
    if padding == "zeros":
        inside = (iy >= 0) & (iy <= h - 1) & (ix >= 0) & (ix <= w - 1)
        v = np.where(inside[:, None], v, 0.0)
    return v


@op("GridSample")
def _grid_sample(ctx, ins, a):
    """ONNX GridSample on a 4-D input (export/SPEC.md §5b; module doc)."""
    if len(ins) < 2 or ins[0] is None or ins[1] is None:
        raise NPUError(f"node {ctx.node.name!r}: GridSample needs X and grid")
    x, g = ins[0], ins[1]
    if not (is_float(x) and is_float(g)):
        raise UnsupportedNode(ctx.node, [x.dtype, g.dtype], "GridSample expects float X and grid (DequantizeLinear "
                                                            "before it)")
    mode = _MODES.get(_text(a.get("mode"), "bilinear"))
    padding = _text(a.get("padding_mode"), "zeros")
    if mode is None or padding not in ("zeros", "border"):
        raise UnsupportedNode(ctx.node, [x.dtype, g.dtype], f"GridSample mode {_text(a.get('mode'), 'bilinear')!r}, "
                              f"padding_mode {padding!r} (bilinear / linear and nearest; zeros and border only)")
    align = bool(int(a.get("align_corners", 0)))
    if x.ndim != 4 or g.ndim != 4 or g.shape[-1] != 2 or g.shape[0] != x.shape[0]:
        raise NPUError(f"node {ctx.node.name!r}: GridSample needs X (N, C, H, W) and grid (N, H_out, W_out, 2) with "
                       f"the same N; got X {list(x.shape)}, grid {list(g.shape)}")
    n_, c_, h, w = x.shape
    if h == 0 or w == 0:
        raise NPUError(f"node {ctx.node.name!r}: GridSample of an empty image {list(x.shape)}")
    if n_ * c_ * g.shape[1] * g.shape[2] > 1 << 31:
        raise NPUError(f"node {ctx.node.name!r}: GridSample output of {n_ * c_ * g.shape[1] * g.shape[2]} elements")
    X = as_compute_type(x).astype(np.float64)
    G = as_compute_type(g).astype(np.float64)
    with np.errstate(invalid="ignore"):
        px = _unnormalize(G[..., 0], w, align, padding)
        py = _unnormalize(G[..., 1], h, align, padding)
    nan = np.isnan(px) | np.isnan(py)
    px, py = np.where(nan, 0.0, px), np.where(nan, 0.0, py)
    if mode == "nearest":
        out = _taps(X, np.rint(py), np.rint(px), padding)   # np.rint: round half to even
    else:
        x0, y0 = np.floor(px), np.floor(py)
        wx1, wy1 = px - x0, py - y0
        wx0, wy0 = 1.0 - wx1, 1.0 - wy1
        out = _taps(X, y0, x0, padding) * (wy0 * wx0)[:, None]
        out = out + _taps(X, y0, x0 + 1.0, padding) * (wy0 * wx1)[:, None]
        out = out + _taps(X, y0 + 1.0, x0, padding) * (wy1 * wx0)[:, None]
        out = out + _taps(X, y0 + 1.0, x0 + 1.0, padding) * (wy1 * wx1)[:, None]
    out = np.where(nan[:, None], 0.0, out)
    return [np.ascontiguousarray(out.astype(x.dtype))]
