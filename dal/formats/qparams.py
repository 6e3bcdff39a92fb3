"""From observed ranges to quantization parameters (scale, zero point)."""
from __future__ import annotations

import torch

from .qformat import QFormat, get_format

# The smallest scale we hand out: keeps x / scale finite for any float32 x of normal size.
MIN_SCALE = 2.0 ** -100
_MIN_SCALE = MIN_SCALE


#: How a scale becomes a power of two: ``nearest`` in the log domain (k = round(log2 s); may clip
#: the observed range by up to a factor sqrt(2)) or ``cover`` (k = ceil(log2 s); the range is
#: never clipped, at the cost of up to one bit of resolution).
POW2_ROUNDINGS = ("nearest", "cover")


def check_pow2_rounding(rounding) -> str:
    """``rounding`` if it is one of POW2_ROUNDINGS, else ``ValueError`` naming what is allowed."""
    if rounding not in POW2_ROUNDINGS:
        raise ValueError(f"power_of_two={rounding!r} is not allowed (allowed: {', '.join(POW2_ROUNDINGS)})")
    return rounding


def pow2_exponent(scale: torch.Tensor, rounding: str = "cover") -> torch.Tensor:
    """The integer k (float tensor) of ``2^k`` for each positive ``scale``, exactly, from frexp.

    ``scale = m * 2^e`` with ``m in [0.5, 1)``. ``cover``: ``k = ceil(log2 s)``, i.e. ``e - 1``
    when ``m == 0.5`` (s is already 2^(e-1)) else ``e``. ``nearest``: ``k = round(log2 s)``,
    i.e. ``e`` when ``m >= 2^-0.5`` else ``e - 1`` (no ties: 2^-0.5 is irrational). k is clamped
    so that ``2^k >= MIN_SCALE``.
    """
    check_pow2_rounding(rounding)
    m, e = torch.frexp(torch.as_tensor(scale, dtype=torch.float64))
    if rounding == "cover":
        k = torch.where(m == 0.5, e - 1, e)
    else:
        k = torch.where(m >= 2.0 ** -0.5, e, e - 1)
    return torch.clamp(k.to(torch.float64), min=-100.0)


def power_of_two_scale(scale: torch.Tensor, rounding: str = "cover") -> torch.Tensor:
    """Each scale replaced by the power of two ``2^k`` of :func:`pow2_exponent` (float32, exact).

    >>> power_of_two_scale(torch.tensor([0.3, 0.25, 0.17]), "cover").tolist()
    [0.5, 0.25, 0.25]
    >>> power_of_two_scale(torch.tensor([0.3, 0.25, 0.17]), "nearest").tolist()
    [0.25, 0.25, 0.125]
    """
    return torch.pow(2.0, pow2_exponent(scale, rounding)).to(torch.float32)


def code_range(fmt: QFormat, narrow_range: bool = False) -> tuple[float, float]:
    """The codes a quantizer may produce: ``[qmin, qmax]``; narrow range drops the most negative
    code of a signed integer format (int8: [-127, 127]) so the range is symmetric."""
    fmt = get_format(fmt)
    qmin, qmax = fmt.qmin, fmt.qmax
    if narrow_range and fmt.is_integer and fmt.signed:
        qmin += 1
    return qmin, qmax


def choose_qparams(min_val: torch.Tensor, max_val: torch.Tensor, fmt, symmetric: bool = True,
                   narrow_range: bool = False, check: bool = True,
                   power_of_two: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
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

    ``power_of_two`` ("nearest" or "cover", see ``POW2_ROUNDINGS``): the scale above is replaced
    by ``2^k`` (:func:`power_of_two_scale`) and an affine zero point is recomputed for it
    (``clamp(qmin - round_half_even(min / 2^k))``), so the range's low end stays where it was.

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
    if power_of_two is not None:
        scale = power_of_two_scale(scale, power_of_two)
        if not (fmt.is_float8 or symmetric):
            zero_point = torch.clamp(qmin - torch.round(lo / scale.double()), qmin, qmax).to(torch.int32)
    return scale, zero_point
