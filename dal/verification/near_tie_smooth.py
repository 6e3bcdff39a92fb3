"""The float32 error bounds of near_tie.py for ops that are neither sums nor data movement.

Each returns the op's value in float64 and an absolute bound on how far a float32 engine's result
can be from it, given the inputs' own bounds ``e`` (``u = 2^-24``): the function's change over
the input's error interval, plus 8 ulp of the result for a vectorised float32 implementation
(module docstring of near_tie.py lists the formulas). GridSample: :func:`grid_sample_bound`.
"""
from __future__ import annotations

import numpy as np
import torch

from .near_tie import U, Exact, NoBound, attr, gamma


def smooth_bound(node, op: str, ins: list) -> Exact:
    """Div, Erf, Sqrt, Pow (exponent 2), Exp, Softmax: the value in float64 and the float32 bound
    (module docstring): the function's change over the input's error interval, plus 8 ulp of the result."""
    a = ins[0]
    if op == "Div":
        b = ins[1]
        room = b.v.abs() - b.e
        if not bool((room > 0).all()):
            raise NoBound(f"{node.name} (Div): the divisor's error bound reaches 0")
        v = a.v / b.v
        return Exact(v, (a.e + v.abs() * b.e) / room + U * v.abs(), a.mag / room)
    if op == "Erf":
        v = torch.erf(a.v)
        return Exact(v, 2 / np.sqrt(np.pi) * a.e + 8 * U * v.abs(), torch.ones_like(v))
    if op == "Sqrt":
        v = a.v.clamp_min(0).sqrt()
        lo = (a.v - a.e).clamp_min(0)
        e = torch.minimum(a.e.sqrt(), a.e / (lo.sqrt() + v).clamp_min(1e-300))
        return Exact(v, e + U * v.abs(), a.mag.sqrt())
    if op == "Pow":
        p = ins[1].v
        if p.numel() != 1 or float(p) != 2.0:
            raise NoBound(f"{node.name} (Pow): only the exponent 2 is modelled")
        v = a.v * a.v
        return Exact(v, 2 * a.v.abs() * a.e + a.e * a.e + U * (a.v.abs() + a.e) ** 2, a.mag * a.mag)
    if op == "Exp":
        v = torch.exp(a.v)
        return Exact(v, v * torch.expm1(a.e) + 8 * U * v * torch.exp(a.e), torch.exp(a.v + a.e))
    axis = attr(node, "axis", -1)
    v = torch.softmax(a.v, dim=axis)
    n = a.v.shape[axis]
    worst_in = a.e.amax(dim=axis, keepdim=True)
    spread = (a.v - a.v.amax(dim=axis, keepdim=True)).abs()
    rel = 2 * worst_in + 10 * U + U * spread + gamma(n + 1)
    return Exact(v, 1.01 * v * torch.expm1(rel) + 1e-300, torch.ones_like(v))


def grid_sample_bound(node, x: Exact, g: Exact) -> Exact:
    """GridSample (export/SPEC.md §5b) in float64, and the float32 bound: the input's own errors
    sampled with the same (non-negative, at most 1 in sum) weights; the pixel coordinate's float32
    error ``dp = n/2 e_g + 4 u (n + 2 + |p|)`` per axis (``n`` pixels) times the bilinear
    function's slope in it, at most ``2 M`` with ``M`` the largest ``|x| + e`` of that image and
    channel (the function is continuous in the coordinate, tap changes included, for zeros and
    border padding); the weights' and the four-term sum's rounding, ``gamma_8`` times the sampled
    ``|x| + e``. Nearest copies a pixel: its error is the pixel's (a coordinate within ``dp`` of a
    half pixel may pick another pixel on another engine: a code differing there is no near-tie)."""
    import torch.nn.functional as F

    mode = attr(node, "mode", b"linear")
    mode = {"linear": "bilinear", "bilinear": "bilinear", "nearest": "nearest"}.get(
        mode.decode() if isinstance(mode, bytes) else mode)
    padding = attr(node, "padding_mode", b"zeros")
    padding = padding.decode() if isinstance(padding, bytes) else padding
    if mode is None or padding not in ("zeros", "border") or x.v.dim() != 4:
        raise NoBound(f"{node.name} (GridSample): only 4-D bilinear / nearest with zeros or border padding is modelled")
    align = bool(attr(node, "align_corners", 0))

    def sample(t):
        return F.grid_sample(t, g.v, mode=mode, padding_mode=padding, align_corners=align)
    v = sample(x.v)
    carried = sample(x.e)
    if mode == "nearest":
        return Exact(v, carried, sample(x.mag))
    big = (x.v.abs() + x.e).amax(dim=(2, 3), keepdim=True)  # (N, C, 1, 1)
    dp = 0
    for axis, n in ((0, x.v.shape[3]), (1, x.v.shape[2])):
        p = (g.v[..., axis].abs() + 1) * n / 2
        dp = dp + n / 2 * g.e[..., axis] + 4 * U * (n + 2 + p)
    e = carried + 2 * big * dp.unsqueeze(1) + gamma(8) * sample(x.v.abs() + x.e)
    return Exact(v, e, big.expand_as(x.v) if v.shape == x.v.shape else big.expand(v.shape))


def reduce_sum_bound(node, a: Exact, axes) -> Exact:
    """ReduceSum over ``axes`` (all when absent; ``noop_with_empty_axes`` 0): the float64 sum and
    the float32 bound of an ``n``-term sum in any order, ``sum(e) + gamma_n sum(|x| + e)``."""
    if attr(node, "noop_with_empty_axes", 0) and (axes is None or len(axes) == 0):
        return a
    rank = a.v.dim()
    dims = tuple(range(rank)) if axes is None or len(axes) == 0 else tuple(int(d) % rank for d in np.ravel(axes))
    keep = bool(attr(node, "keepdims", 1))
    n = int(np.prod([a.v.shape[d] for d in dims])) if dims else 1

    def total(t):
        return t.sum(dim=dims, keepdim=keep)
    return Exact(total(a.v), total(a.e) + gamma(max(n, 1)) * total(a.v.abs() + a.e), total(a.mag))
