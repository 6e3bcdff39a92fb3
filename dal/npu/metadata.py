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
    power_of_two ``{"kind": "power_of_two", "rounding": R}``: a shift-only requantizer. Every
                 M = s_x * s_w[c] / s_y (float64 on the float32 scales) must be exactly 2^-n
                 (else the file is refused, naming the node); out = clamp(round_shift(acc, n)
                 + zp_y, qmin, qmax) with R as above (m = 1 in the fixed-point formula).
``dal.accumulator`` (JSON; absent: exact accumulation, int32 for 8-bit codes, int64 for
    16-bit ones): ``{"bits": B, "overflow": "saturate" | "wrap"}``. The exact sum acc (bias
    included) becomes clamp(acc, -2^(B-1), 2^(B-1) - 1) for saturate, or the B-bit two's
    complement of acc (((acc + 2^(B-1)) mod 2^B) - 2^(B-1)) for wrap, before the requantizer
    (accumulator.py).
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
    accumulator_bits: int | None = None   # dal.accumulator: None = exact
    accumulator_overflow: str = "saturate"

    def __post_init__(self):
        if self.kind not in ("float", "fixed_point", "power_of_two"):
            raise NPUError(f"dal.requantizer: kind must be 'float', 'fixed_point' or 'power_of_two', "
                           f"got {self.kind!r}")
        if not (isinstance(self.multiplier_bits, int) and 2 <= self.multiplier_bits <= 31):
            raise NPUError(f"dal.requantizer: multiplier_bits must be an int in [2, 31], "
                           f"got {self.multiplier_bits!r}")
        if self.rounding not in ROUNDINGS:
            raise NPUError(f"dal.requantizer: rounding must be one of {ROUNDINGS}, got {self.rounding!r}")
        for key, lo, hi in (("accumulator_bits", 8, 64),):
            v = getattr(self, key)
            if v is not None and not (isinstance(v, int) and not isinstance(v, bool) and lo <= v <= hi):
                raise NPUError(f"dal.accumulator: bits must be an int in [{lo}, {hi}], got {v!r}")
        if self.accumulator_overflow not in ("saturate", "wrap"):
            raise NPUError(f"dal.accumulator: overflow must be 'saturate' or 'wrap', "
                           f"got {self.accumulator_overflow!r}")

    @property
    def integer(self) -> bool:
        """An integer requantizer (multiplier and / or shift) rather than ONNX float semantics."""
        return self.kind != "float"


def requant_params(rq: Requantizer, multiplier: float, node: str = "") -> tuple[int, int]:
    """(m, n) of ``multiplier ~= m * 2^-n`` for an integer requantizer: ``fixed_point_params``,
    or for ``power_of_two`` m = 1 and ``multiplier == 2^-n`` exactly (else ``NPUError``)."""
    if rq.kind == "fixed_point":
        return fixed_point_params(multiplier, rq.multiplier_bits)
    f, e = math.frexp(multiplier) if math.isfinite(multiplier) and multiplier > 0 else (0.0, 0)
    if f != 0.5:
        raise NPUError(f"node {node!r}: the power_of_two requantizer needs s_x * s_w / s_y = 2^-n, got "
                       f"{multiplier!r}; export the model with power-of-two scales")
    return 1, 1 - e


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
    acc = _json(model, "dal.accumulator")
    extra = {}
    if acc is not None:
        if not isinstance(acc, dict) or set(acc) - {"bits", "overflow"}:
            raise NPUError("metadata 'dal.accumulator' must be a JSON object {\"bits\": B, \"overflow\": ...}")
        extra = {"accumulator_bits": acc.get("bits"), "accumulator_overflow": acc.get("overflow") or "saturate"}
    raw = _json(model, "dal.requantizer")
    if raw is None:
        return Requantizer(**extra)
    if not isinstance(raw, dict):
        raise NPUError("metadata 'dal.requantizer' must be a JSON object")
    unknown = set(raw) - {"kind", "multiplier_bits", "rounding"}
    if unknown:
        raise NPUError(f"metadata 'dal.requantizer' has unknown keys {sorted(unknown)}")
    # JSON null means "not given": the default applies (writers may emit every key)
    return Requantizer(**{k: v for k, v in raw.items() if v is not None}, **extra)


def read_sparse24(model) -> dict[str, int]:
    raw = _json(model, "dal.sparse_24")
    if raw is None:
        return {}
    if not isinstance(raw, dict) or not all(isinstance(v, int) for v in raw.values()):
        raise NPUError("metadata 'dal.sparse_24' must be a JSON object {initializer: axis}")
    return dict(raw)
