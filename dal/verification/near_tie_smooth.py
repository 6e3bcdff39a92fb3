"""The float32 error bounds of near_tie.py for ops that are neither sums nor data movement.

Each returns the op's value in float64 and an absolute bound on how far a float32 engine's result
can be from it, given the inputs' own bounds ``e`` (``u = 2^-24``): the function's change over
the input's error interval, plus 8 ulp of the result for a vectorised float32 implementation
(module docstring of near_tie.py lists the formulas).
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
