"""The metadata contract between dal's exporter and the NPU reference (``metadata_props``).

``dal.requantizer`` (JSON; default ``{"kind": "float"}``; a key whose value is null counts as
absent, so ``{"kind": "float", "multiplier_bits": null}`` is the default):
    float        ONNX QuantizeLinear semantics on the kernel's float value (see integer_groups.py).
    fixed_point  ``{"kind": "fixed_point", "multiplier_bits": B, "rounding": R}``. For each
                 output channel c the multiplier M = s_x * s_w[c] / s_y (float64 arithmetic
                 on the float32 scales) is written M = f * 2^e with f in [0.5, 1) (frexp);
                 m = round_half_even(f * 2^B) in [2^(B-1), 2^B] (if it reaches 2^B it becomes
                 2^(B-1) and e += 1) and n = B - e, so M ~= m * 2^-n. Then, with exact
                 integers, out = clamp(round_shift(acc * m, n) + zp_y, qmin, qmax) where
                 round_shift(p, n) = floor((p + 2^(n-1)) / 2^n) for R = "half_up" (ties to
                 +inf), ties to even for "half_even", ties away from zero for "half_away";
                 n <= 0 means p * 2^-n. acc includes the int32 bias.
``dal.sparse_24`` (JSON object ``{initializer_name: reduction_axis}``): weights that are 2:4
    along that axis; they are verified and run through the compressed sparse kernel.
Other ``dal.*`` keys are informational. Files from other tools have none: defaults apply.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass

from .errors import NPUError

ROUNDINGS = ("half_up", "half_even", "half_away")


@dataclass(frozen=True)
class Requantizer:
    kind: str = "float"
    multiplier_bits: int = 31
    rounding: str = "half_up"

    def __post_init__(self):
        if self.kind not in ("float", "fixed_point"):
            raise NPUError(f"dal.requantizer: kind must be 'float' or 'fixed_point', got {self.kind!r}")
        if not (isinstance(self.multiplier_bits, int) and 2 <= self.multiplier_bits <= 31):
            raise NPUError(f"dal.requantizer: multiplier_bits must be an int in [2, 31], "
                           f"got {self.multiplier_bits!r}")
        if self.rounding not in ROUNDINGS:
            raise NPUError(f"dal.requantizer: rounding must be one of {ROUNDINGS}, got {self.rounding!r}")


def fixed_point_params(multiplier: float, bits: int) -> tuple[int, int]:
    """(m, n) with multiplier ~= m * 2^-n and m in [2^(bits-1), 2^bits) (see module doc)."""
    if not (math.isfinite(multiplier) and multiplier > 0):
        raise NPUError(f"fixed-point requantizer: multiplier {multiplier!r} must be finite and > 0")
    f, e = math.frexp(multiplier)
    m = round(f * (1 << bits))
    if m == 1 << bits:
        m, e = m >> 1, e + 1
    return m, bits - e


def _json(model, key):
    for p in model.metadata_props:
        if p.key == key:
            try:
                return json.loads(p.value)
            except ValueError as e:
                raise NPUError(f"metadata {key!r} is not valid JSON: {e}") from None
    return None


def read_requantizer(model) -> Requantizer:
    raw = _json(model, "dal.requantizer")
    if raw is None:
        return Requantizer()
    if not isinstance(raw, dict):
        raise NPUError("metadata 'dal.requantizer' must be a JSON object")
    unknown = set(raw) - {"kind", "multiplier_bits", "rounding"}
    if unknown:
        raise NPUError(f"metadata 'dal.requantizer' has unknown keys {sorted(unknown)}")
    # JSON null means "not given": the default applies (writers may emit every key)
    return Requantizer(**{k: v for k, v in raw.items() if v is not None})


def read_sparse24(model) -> dict[str, int]:
    raw = _json(model, "dal.sparse_24")
    if raw is None:
        return {}
    if not isinstance(raw, dict) or not all(isinstance(v, int) for v in raw.values()):
        raise NPUError("metadata 'dal.sparse_24' must be a JSON object {initializer: axis}")
    return dict(raw)
