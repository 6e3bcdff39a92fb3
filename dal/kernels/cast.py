"""``dal::fp_round_trip``: ``x.to(dtype).to(x.dtype)`` (the FP16 / BF16 formats) as one registered op.

Each value rounded to the nearest ``dtype`` value (ties to even, overflow to +-inf, NaN stays NaN)
and back; ``d y / d x = 1``. The output is a new tensor even when ``dtype`` is ``x.dtype`` (an op
may not return its input). CPU: the C++ round trip of ``dal.formats.fp_cast`` for float32
contiguous input and float16 / bfloat16 (one pass, torch's bits); everything else: torch's two casts.
"""
from __future__ import annotations

import torch

from ..formats.fp_cast import kernel_round_trip


def generic(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The round trip by torch's casts, on any device."""
    return x.to(dtype).to(x.dtype) if dtype != x.dtype else x.clone()


@torch.library.custom_op("dal::fp_round_trip", mutates_args=())
def fp_round_trip(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` rounded to ``dtype`` and back (module docstring); the device-generic implementation."""
    return generic(x, dtype)


@fp_round_trip.register_kernel("cpu")
def _cpu(x, dtype):
    out = kernel_round_trip(x, dtype)
    return generic(x, dtype) if out is None else out


@fp_round_trip.register_fake
def _fake(x, dtype):
    return torch.empty_like(x)


def _backward(ctx, grad):
    return grad, None


fp_round_trip.register_autograd(_backward)
