"""``dal::minmax_qparams``: (scale, zero point) from an observed range, as one registered op.

``minmax_qparams(min_val, max_val, fmt, symmetric, narrow_range, power_of_two)`` is
``dal.formats.choose_qparams(lo, maximum(hi, lo), ...)`` with ``lo`` / ``hi`` the range with its
non-finite entries (a slice that never saw a finite value) replaced by 0: what
``dal.observers.Observer.calculate_qparams`` returns for a min-max observer without a fixed scale.
Scale float32 and zero point int32, of the range's shape. All tensor arithmetic (float64 inside,
as ``choose_qparams``), no host synchronisation, one implementation for every device.

Why an op and not the plain torch function under ``torch.compile``: inductor would recompile the
float64 division ``amax / qmax`` and its rounding to float32 with its own flags; as an opaque op the
compiled step computes the eager step's scale bit for bit.
"""
from __future__ import annotations

from typing import Optional

import torch

from ..formats.qparams import choose_qparams


@torch.library.custom_op("dal::minmax_qparams", mutates_args=())
def minmax_qparams(min_val: torch.Tensor, max_val: torch.Tensor, fmt: str, symmetric: bool, narrow_range: bool,
                   power_of_two: Optional[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(scale, zero_point)`` of the module docstring."""
    lo = torch.where(torch.isfinite(min_val), min_val, torch.zeros_like(min_val))
    hi = torch.where(torch.isfinite(max_val), max_val, torch.zeros_like(max_val))
    scale, zp = choose_qparams(lo, torch.maximum(hi, lo), fmt, symmetric, narrow_range, check=False,
                               power_of_two=power_of_two)
    return scale.reshape(min_val.shape).contiguous(), zp.reshape(min_val.shape).contiguous()


@minmax_qparams.register_fake
def _fake(min_val, max_val, fmt, symmetric, narrow_range, power_of_two):
    return (torch.empty(min_val.shape, dtype=torch.float32, device=min_val.device),
            torch.empty(min_val.shape, dtype=torch.int32, device=min_val.device))
