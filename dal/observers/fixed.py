"""A scale fixed by the recipe (``observer_args: {fixed_scale: 0.00390625}``), e.g. 1/256 for a
sigmoid or softmax output whose range is known, not measured."""
from __future__ import annotations

import torch


def fixed_qparams(observer, lo: torch.Tensor, hi: torch.Tensor, scale: torch.Tensor,
                  zero_point: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(scale, zero_point)`` with every scale ``observer.fixed_scale``.

    Symmetric formats keep their fixed zero point; affine ones get
    ``zp = clamp(qmin - round_half_even(min(lo, 0) / s), qmin, qmax)`` for the observed ``lo``.
    """
    s = torch.full_like(scale, observer.fixed_scale, dtype=torch.float32)
    if observer.symmetric or observer.fmt.is_float8:
        return s, zero_point
    from ..formats import code_range
    qmin, qmax = code_range(observer.fmt, observer.narrow_range)
    low = torch.clamp(lo.double(), max=0.0)
    zp = torch.clamp(qmin - torch.round(low / s.double()), qmin, qmax).to(torch.int32)
    return s, zp
