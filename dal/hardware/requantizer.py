"""How an NPU scales its int32 accumulators to the output format (``requantizer:`` of a
hardware model), a frozen dataclass validated on construction."""
from __future__ import annotations

from dataclasses import dataclass

from dal.config.problems import Problem
from dal.hardware.errors import HardwareModelError

REQUANTIZER_KINDS = ("float", "fixed_point", "power_of_two")
ROUNDINGS = ("half_up", "half_even", "half_away")


@dataclass(frozen=True)
class Requantizer:
    """How int32 accumulators are scaled to the output format.

    ``kind="float"``: ONNX semantics, ``round_half_even(acc * s_in * s_w / s_out) + zp``.
    ``kind="fixed_point"``: ``acc * M >> shift`` with an integer multiplier of
    ``multiplier_bits`` bits and the given ``rounding`` (half_up, half_even, half_away).
    ``kind="power_of_two"``: shift only, ``round_shift(acc, n)`` with ``s_in * s_w / s_out = 2^-n``
    exactly (needs ``scale_constraint: power_of_two`` for weights and activations).
    """

    kind: str = "float"
    multiplier_bits: int | None = None
    rounding: str = "half_even"

    def __post_init__(self):
        problems: list[Problem] = []
        if self.kind not in REQUANTIZER_KINDS:
            problems.append(Problem(f"{self.kind!r} is not allowed (allowed: {', '.join(REQUANTIZER_KINDS)})", ("kind",)))
        if self.rounding not in ROUNDINGS:
            problems.append(Problem(f"{self.rounding!r} is not allowed (allowed: {', '.join(ROUNDINGS)})", ("rounding",)))
        if self.kind == "fixed_point":
            mb = self.multiplier_bits
            # at most 31: the multiplier is a positive signed 32-bit integer (the NPU reference's limit too)
            if isinstance(mb, bool) or not isinstance(mb, int) or not 8 <= mb <= 31:
                problems.append(Problem(f"a fixed_point requantizer needs multiplier_bits, an integer "
                                        f"from 8 to 31; got {mb!r}", ("multiplier_bits",)))
        elif self.multiplier_bits is not None and self.kind == "power_of_two":
            problems.append(Problem("a power_of_two requantizer only shifts; remove multiplier_bits", ("multiplier_bits",)))
        elif self.kind == "float":
            if self.multiplier_bits is not None:
                problems.append(Problem("multiplier_bits is only for kind: fixed_point; remove it", ("multiplier_bits",)))
            if self.rounding != "half_even":
                problems.append(Problem("a float requantizer rounds half_even (ONNX QuantizeLinear); "
                                        "use kind: fixed_point for another rounding", ("rounding",)))
        if problems:
            raise HardwareModelError(problems)
