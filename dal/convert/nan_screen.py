"""Whether a float tensor holds a NaN, at the cost of one sum in the common case (none).

A float sum is NaN exactly when an addend is NaN or both infinities are among them (IEEE 754:
NaN propagates through every addition, and no sum of finite values or of infinities of one sign
is NaN). So ``float(t.sum())`` being a number proves ``t`` holds no NaN; only when it is NaN (a NaN,
or sums overflowing to both infinities) does the element-wise test run, which decides. The sum
writes no bool tensor, as ``torch.isnan(t).any()`` does (bench/results/integer_decode.md).
"""
from __future__ import annotations

import torch


#: the dtypes torch sums (a float8 tensor has no sum: the element-wise test runs)
SUMMED = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def holds_nan(t: torch.Tensor) -> bool:
    """``bool(torch.isnan(t).any())`` for a floating-point ``t``, screened by its sum (module doc) where
    its dtype is one of :data:`SUMMED`."""
    if t.dtype not in SUMMED:
        return bool(torch.isnan(t).any())
    s = float(t.sum())
    return s != s and bool(torch.isnan(t).any())
