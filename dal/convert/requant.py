"""The hardware's requantizer, in torch, on the exact accumulators (float64 integer values).

Written from the hardware model and export/SPEC.md, not from dal.npu's code (which reads the
same contract from the ONNX metadata): agreement is the cross-check.

* **float** (ONNX semantics): ``v = float32(float64(acc) * (float64(s_x) * float64(s_w[c])))``,
  one rounding; a bias that could not be folded into ``acc`` is then added in float32; the
  consumer's QuantizeLinear divides ``v`` by ``s_y`` in float32 and rounds half to even.
* **fixed_point** (``multiplier_bits`` B, ``rounding`` R): ``M = s_x * s_w[c] / s_y`` in float64
  on the float32 scales, ``M = f * 2^e`` (frexp, f in [0.5, 1)), ``m = round_half_even(f * 2^B)``
  (``m == 2^B`` becomes ``2^(B-1)``, e + 1), ``n = B - e``; then with exact integers
  ``q = clamp(round_shift(acc * m, n) + zp_y, lo, hi)``, round_shift by R: ``half_up`` (ties
  to +inf), ``half_even``, ``half_away`` (from zero); ``n <= 0`` multiplies by ``2^-n``.
  ``acc * m`` fits int64 because |acc| < 2^31 and m < 2^31.
* **power_of_two** (a shift-only requantizer, ``rounding`` R): every scale is ``2^k``, so
  ``M = s_x * s_w[c] / s_y`` (float64 on the float32 scales) is exactly ``2^-n``;
  ``q = clamp(round_shift(acc, n) + zp_y, lo, hi)`` (``m = 1`` above). A multiplier that is
  not a power of two is refused, naming the layer (the exporter and the NPU refuse it too).
"""
from __future__ import annotations

import math

import torch

from .errors import ConvertError

ROUNDINGS = ("half_up", "half_even", "half_away")


def fixed_point_multiplier(multiplier: float, bits: int, who: str) -> tuple[int, int]:
    """(m, n) with ``multiplier ~= m * 2^-n`` and ``2^(bits-1) <= m < 2^bits`` (module doc)."""
    if not (math.isfinite(multiplier) and multiplier > 0):
        raise ConvertError(f"{who}: requantizer multiplier {multiplier!r} is not finite and positive")
    f, e = math.frexp(multiplier)
    m = round(f * (1 << bits))  # Python round: half to even
    if m == 1 << bits:
        m, e = m >> 1, e + 1
    return m, bits - e


def round_shift(prod: torch.Tensor, n: torch.Tensor, rounding: str) -> torch.Tensor:
    """``prod / 2^n`` rounded by ``rounding`` (int64 tensors, ``n`` broadcast); ``n <= 0``
    multiplies by ``2^-n``; ``n >= 63`` gives 0 (|prod| < 2^62 is below half of 2^n)."""
    pos = n.clamp(1, 62)
    f = torch.bitwise_right_shift(prod, pos)  # arithmetic: floor(prod / 2^n)
    rem = prod - torch.bitwise_left_shift(f, pos)
    h = torch.bitwise_left_shift(torch.ones_like(pos), pos - 1)
    if rounding == "half_up":
        r = f + (rem >= h).long()
    elif rounding == "half_even":
        r = f + ((rem > h) | ((rem == h) & (f % 2 != 0))).long()
    elif rounding == "half_away":
        r = f + ((rem > h) | ((rem == h) & (prod >= 0))).long()
    else:
        raise ConvertError(f"requantizer rounding {rounding!r} is not one of {ROUNDINGS}")
    left = torch.bitwise_left_shift(prod, (-n).clamp(0, 62))
    r = torch.where(n <= 0, left, r)
    return torch.where(n >= 63, torch.zeros_like(r), r)


def power_of_two_shift(multiplier: float, who: str) -> tuple[int, int]:
    """(1, n) with ``multiplier == 2^-n`` exactly; ConvertError naming ``who`` otherwise."""
    f, e = math.frexp(multiplier) if math.isfinite(multiplier) and multiplier > 0 else (0.0, 0)
    if f != 0.5:
        raise ConvertError(f"{who}: the power_of_two requantizer needs s_x * s_w / s_y = 2^-n, got "
                           f"{multiplier!r}; train with power-of-two scales (scale_constraint: power_of_two)")
    return 1, 1 - e


class FixedPoint:
    """Per-channel (m, n) of one layer for its consumer's output scale; see the module doc.
    ``kind`` "fixed_point" (``bits``-bit multipliers) or "power_of_two" (m = 1, a shift)."""

    def __init__(self, mult: torch.Tensor, s_y: float, bits: int, rounding: str, who: str,
                 kind: str = "fixed_point"):
        if rounding not in ROUNDINGS:
            raise ConvertError(f"{who}: requantizer rounding {rounding!r} is not one of {ROUNDINGS}")
        if kind == "power_of_two":
            pairs = [power_of_two_shift(float(m) / float(s_y), who) for m in mult.tolist()]
        else:
            pairs = [fixed_point_multiplier(float(m) / float(s_y), bits, who) for m in mult.tolist()]
        self.m = torch.tensor([p[0] for p in pairs], dtype=torch.int64)
        self.n = torch.tensor([p[1] for p in pairs], dtype=torch.int64)
        self.rounding, self.who = rounding, who

    def to(self, device) -> "FixedPoint":
        self.m, self.n = self.m.to(device), self.n.to(device)
        return self

    def __call__(self, acc: torch.Tensor, channel_axis: int, zp: int, lo: int, hi: int) -> torch.Tensor:
        """Codes (int64) of ``acc`` (float64 exact integers), channels along ``channel_axis``."""
        shape = [1] * acc.ndim
        shape[channel_axis] = -1
        if float(acc.abs().max()) * float(self.m.max()) >= 2.0 ** 62 if acc.numel() else False:
            raise ConvertError(f"{self.who}: accumulator times multiplier passes 2^62 (16-bit codes with a "
                               "fixed-point multiplier): no exact int64 form here")
        prod = acc.long() * self.m.reshape(shape)
        return (round_shift(prod, self.n.reshape(shape), self.rounding) + zp).clamp_(lo, hi)
