"""From observed ranges to quantization parameters (scale, zero point)."""
from __future__ import annotations

import torch

from .qformat import QFormat, get_format

# The smallest scale we hand out: keeps x / scale finite for any float32 x of normal size.
MIN_SCALE = 2.0 ** -100
_MIN_SCALE = MIN_SCALE


def code_range(fmt: QFormat, narrow_range: bool = False) -> tuple[float, float]:
    """The codes a quantizer may produce: ``[qmin, qmax]``; narrow range drops the most negative
    code of a signed integer format (int8: [-127, 127]) so the range is symmetric."""
    fmt = get_format(fmt)
    qmin, qmax = fmt.qmin, fmt.qmax
    if narrow_range and fmt.is_integer and fmt.signed:
        qmin += 1
    return qmin, qmax


def choose_qparams(min_val: torch.Tensor, max_val: torch.Tensor, fmt, symmetric: bool = True,
                   narrow_range: bool = False, check: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale and zero point that map ``[min_val, max_val]`` (elementwise tensors) onto ``fmt``.

    The range is first widened to contain 0 (so 0.0 is exactly representable, as padding and
    ReLU need). With ``a = max(|min|, |max|)``:

    * integer, symmetric:  ``scale = a / qmax_sym``, zero point 0 for signed formats and the
      mid code ``(qmin + qmax + 1) // 2`` for unsigned ones, where ``qmax_sym = qmax - zp``;
    * integer, affine:     ``scale = (max - min) / (qmax - qmin)``,
      ``zero_point = clamp(qmin - round_half_even(min / scale), qmin, qmax)``;
    * FP8:                 ``scale = a / fmt.max_value``, zero point 0 (FP8 is always symmetric).

    An all-zero range gets scale 1.0 (any positive scale represents it exactly) and never a
    division by zero. Returns float32 scale and int32 zero point tensors of the input's shape.
    ``check=False`` skips the validation of the range (finite, ``min <= max``) for callers that
    already guarantee it: each check synchronises and costs a few small tensor ops, which
    add up when every quantizer of a network calls this at every QAT step.

    >>> s, z = choose_qparams(torch.tensor(-1.0), torch.tensor(2.0), "uint8", symmetric=False)
    >>> float(s), int(z)
    (0.011764706112444401, 85)
    """
    fmt = get_format(fmt)
    if not fmt.is_scaled:
        raise ValueError(f"format {fmt.name!r} is a plain cast and has no scale or zero point")
    min_val = torch.as_tensor(min_val, dtype=torch.float32)
    max_val = torch.as_tensor(max_val, dtype=torch.float32)
    if check and not (torch.isfinite(min_val).all() and torch.isfinite(max_val).all()):
        raise ValueError(f"choose_qparams got a non-finite range: min={min_val}, max={max_val}")
    if check and (min_val > max_val).any():
        raise ValueError(f"choose_qparams got min_val > max_val: min={min_val}, max={max_val}")
    lo = torch.clamp(min_val, max=0.0).double()
    hi = torch.clamp(max_val, min=0.0).double()
    qmin, qmax = code_range(fmt, narrow_range)
    if fmt.is_float8 or symmetric:
        amax = torch.maximum(-lo, hi)
        if fmt.is_float8:
            zp = 0
            denom = fmt.max_value
        else:
            zp = 0 if fmt.signed else int(qmin + qmax + 1) // 2
            denom = float(qmax - zp)
        scale = amax / denom
        zero_point = torch.full_like(scale, zp, dtype=torch.int32)
    else:
        scale = (hi - lo) / float(qmax - qmin)
        safe = torch.where(scale > 0, scale, torch.ones_like(scale))
        zero_point = torch.clamp(qmin - torch.round(lo / safe), qmin, qmax).to(torch.int32)
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    scale = torch.clamp(scale, min=_MIN_SCALE).to(torch.float32)
    return scale, zero_point
