"""The float32 error bounds of near_tie.py for ops that are neither sums nor data movement.

Each returns the op's value in float64 and an absolute bound on how far a float32 engine's result
can be from it, given the inputs' own bounds ``e`` (``u = 2^-24``): the function's change over
the input's error interval, plus 8 ulp of the result for a vectorised float32 implementation
(module docstring of near_tie.py lists the formulas). GridSample: :func:`grid_sample_bound`;
LayerNormalization: :func:`layer_norm_bound`; InstanceNormalization: :func:`instance_norm_bound`.
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


def layer_norm_bound(node, x: Exact, scale: Exact, bias) -> Exact:
    """LayerNormalization (opset >= 17; export/SPEC.md §5a) in float64,
    ``y = d / sigma * scale + bias``, ``d = x - mean(x)``, ``sigma = sqrt(mean(d^2) + eps)`` over the
    ``N`` normalized elements, and a float32 bound for an engine that computes the mean as an ``N``-term
    sum, the variance by two passes ``mean(d^2)``, by one pass ``mean(x^2) - mean^2`` or by Welford
    updates, then ``sqrt``, a division (or a reciprocal and a product), ``* scale`` and ``+ bias``
    (``a = |x| + e``, ``u = 2^-24``):

    * the inputs' own errors ``e``: ``d`` moves by at most ``e_j + mean(e)``, and ``sigma`` (1-Lipschitz
      in ``d / sqrt(N)``, ``d`` an orthogonal projection of ``x``) by at most ``e2 = sqrt(mean(e^2))``;
    * rounding: the mean ``dm = gamma_{N+1} mean(a)``; each ``d_j`` ``dd_j = dm + u (|d_j| + e_j + mean(e) + dm)``;
      the variance ``dV = gamma_{3N+8} mean(a^2) + u (V + eps)`` (two-pass: ``2 mean|d| dd + gamma_{N+2}
      mean(d^2)``; one-pass: ``gamma_{N+1} mean(x^2) + 2 |m| dm + u m^2``; Welford: ``N u kappa V`` with
      ``kappa^2 = mean(x^2) / V``, Chan, Golub & LeVeque 1983: each at most ``gamma_{3N+8} mean(a^2)``);
    * ``|sigma_hat - sigma| <= S = e2 + min(sqrt(dV), dV / (sigma - e2)) + u (sigma + ...)`` (the ``sqrt``'s
      rounding), ``sigma_lo = (sigma - S)(1 - u)`` > 0 or no bound;
    * ``dz = (e_j + mean(e) + dd_j) / sigma_lo + |d_j| S / (sigma sigma_lo) + 2 u (|d_j| + e_j + mean(e) + dd_j) / sigma_lo``;
    * ``e_y = |s| dz + e_s (|z| + dz) + e_b + 2 u (1 + u) ((|s| + e_s)(|z| + dz) + |b| + e_b)``.

    dal.npu computes ``d / sigma`` in float64 and rounds it once, then ``* scale + bias`` in float32
    (three roundings, inside ``e_y``)."""
    axis = int(attr(node, "axis", -1)) % x.v.dim()
    z, dz = _normalized(node, x, tuple(range(axis, x.v.dim())), float(attr(node, "epsilon", 1e-5)))
    return _affine(z, dz, scale, bias)


def instance_norm_bound(node, x: Exact, scale: Exact, bias: Exact) -> Exact:
    """InstanceNormalization (GroupNorm's export; export/SPEC.md §5a): :func:`layer_norm_bound`'s value
    and bound with the statistics over the spatial axes (2, ...) of each (sample, channel) and
    ``scale``, ``B`` per channel (axis 1)."""
    if x.v.dim() < 3:
        raise NoBound(f"{node.name} (InstanceNormalization): input of rank {x.v.dim()} (at least 3 expected)")
    z, dz = _normalized(node, x, tuple(range(2, x.v.dim())), float(attr(node, "epsilon", 1e-5)))
    shape = [1, -1] + [1] * (x.v.dim() - 2)
    return _affine(z, dz, Exact(scale.v.reshape(shape), scale.e.reshape(shape), scale.mag.reshape(shape)),
                   Exact(bias.v.reshape(shape), bias.e.reshape(shape), bias.mag.reshape(shape)))


def _normalized(node, x: Exact, dims: tuple, eps: float):
    """``(z, dz)``: ``z = d / sigma`` in float64 over ``dims`` and its float32 bound (layer_norm_bound)."""
    n = int(np.prod([x.v.shape[d] for d in dims]))

    def mean(t):
        return t.mean(dim=dims, keepdim=True)
    d = x.v - mean(x.v)
    var = mean(d * d)
    sigma = (var + eps).sqrt()
    a = x.v.abs() + x.e
    e_mean = mean(x.e)
    e2 = mean(x.e * x.e).sqrt()
    dm = gamma(n + 1) * mean(a)
    dd = dm + U * (d.abs() + x.e + e_mean + dm)
    dv = gamma(3 * n + 8) * mean(a * a) + U * (var + eps)
    room = sigma - e2
    if not bool((room > 0).all()):
        raise NoBound(f"{node.name} ({node.op_type}): the inputs' error bound reaches the spread (sigma)")
    s_err = e2 + torch.minimum(dv.sqrt(), dv / room)
    s_err = s_err + U * (sigma + s_err)
    sigma_lo = (sigma - s_err) * (1 - U)
    if not bool((sigma_lo > 0).all()):
        raise NoBound(f"{node.name} ({node.op_type}): sigma's float32 error bound reaches 0")
    moved = x.e + e_mean + dd
    dz = moved / sigma_lo + d.abs() * s_err / (sigma * sigma_lo) + 2 * U * (d.abs() + moved) / sigma_lo
    return d / sigma, dz


def _affine(z, dz, scale: Exact, bias) -> Exact:
    """``z * scale + bias`` and ``e_y`` of layer_norm_bound."""
    b_v = bias.v if bias is not None else torch.zeros((), dtype=torch.float64)
    b_e = bias.e if bias is not None else torch.zeros((), dtype=torch.float64)
    v = z * scale.v + b_v
    s_abs = scale.v.abs() + scale.e
    e = (scale.v.abs() * dz + scale.e * (z.abs() + dz) + b_e
         + 2 * U * (1 + U) * (s_abs * (z.abs() + dz) + b_v.abs() + b_e))
    return Exact(v, e, s_abs * (z.abs() + 1) + b_v.abs() + b_e)
