"""KV-cache quantizers: keys (after the rotary embedding) and values as they enter an attention's
KV cache, fake-quantized with static scales (op class ``kv_cache``).

:class:`QKVCache` sits in an NPU attention (``dal.replace.hf_attention``) in front of the
attention core: ``(k, v) -> (Q_k(k), Q_v(v))`` on head-split tensors ``[B, kv_heads, L, d]``,
before the heads are repeated for grouped-query attention. Each quantizer is an ordinary
activation :class:`~dal.quantizer.FakeQuantizer`: identity while observing, calibrated by
``dal.calibrate``, then fake quantization with its scale (the ``quantize`` / ``frozen`` states;
in eval mode, as in ``generate``, the scale never moves), ``off`` is the float model.

    Q(x) = (clamp(round_half_even(x / s) + zp, qmin, qmax) - zp) * s      (INT8 / UINT8)
    Q(x) = float8(x / s) * s, saturating to the format's max            (FP8 e4m3 / e5m2)

with one ``s`` per tensor, or one per head (``granularity: per_channel``, axis 1 of
``[B, kv_heads, L, d]``; another ``axis`` may be given, e.g. 3 for one scale per channel of the
head dimension).

Where the cache is. HF's cache classes (DynamicCache, StaticCache) store the float K and V that
the attention module computed, and hand the attention function past + new entries at each step;
this module quantizes them there. That equals storing codes as they enter the cache: ``Q`` is
element-wise with a fixed scale, so ``Q(cat(past, new)) = cat(Q(past), Q(new))``, and it is
idempotent on its grid, ``Q(Q(x)) = Q(x)``, so an entry's code never changes across decode
steps (tests/hf/test_kv_cache.py checks both). While observing, a cached entry is seen again at
every later step of one forward; ``dal.calibrate`` runs whole sequences, where each entry is seen once.

How a recipe asks: a rule ``{type: kv_cache, input: {...}}`` (first match wins, as for every
layer). :func:`attach_kv_quantizers` (called by ``prepare_qat`` after operator replacement)
resolves the rule for every QKVCache, checks it against the hardware model's ``kv_cache`` op
(formats, per-tensor / per-head) and builds the two quantizers; a hardware model without a
``kv_cache`` op refuses a rule that names ``kv_cache``.
"""
from __future__ import annotations

from typing import Optional

import torch

from ..config.problems import Problem
from ..quantizer import FakeQuantizer
from ..recipe.errors import RecipeError
from .base import QATModule
from .spec import make_quantizer

#: the op class of the cache (dal.hardware.op_classes)
OP_CLASS = "kv_cache"
#: the head axis of ``[B, kv_heads, L, d]``: per_channel KV scales are per head unless ``axis`` says otherwise
HEAD_AXIS = 1


class QKVCache(QATModule):
    """``forward(key, value) -> (key_quant(key), value_quant(value))``; a quantizer that is None
    (no recipe rule asked for it) passes its tensor through.

    Built empty by the attention replacement; :meth:`configure` gives it quantizers. Quantizer
    names: ``<path>.key_quant``, ``<path>.value_quant``.
    """

    swappable = False  # built by the attention replacement, not from a float module

    def __init__(self, name: str = ""):
        super().__init__()
        self.qat_name = name
        self.key_quant: Optional[FakeQuantizer] = None
        self.value_quant: Optional[FakeQuantizer] = None

    def configure(self, spec, name: Optional[str] = None) -> "QKVCache":
        """Quantizers for K and V from one recipe ``TensorSpec`` (each calibrates its own scale);
        ``per_channel`` defaults to axis 1, the kv head."""
        if name is not None:
            self.qat_name = name
        self.key_quant = make_quantizer(spec, HEAD_AXIS, f"{self.qat_name}.key_quant")
        self.value_quant = make_quantizer(spec, HEAD_AXIS, f"{self.qat_name}.value_quant")
        return self

    def quantizers(self) -> dict:
        return {k: q for k, q in (("key", self.key_quant), ("value", self.value_quant)) if q is not None}

    def forward(self, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.key_quant is not None:
            key = self.key_quant(key)
        if self.value_quant is not None:
            value = self.value_quant(value)
        return key, value

    def extra_repr(self) -> str:
        q = self.quantizers()
        return ", ".join(f"{k}={v.fmt.name}/{'per_tensor' if v.granularity.axis is None else f'axis {v.granularity.axis}'}"
                         for k, v in q.items()) or "float"


def _problem(rule, text: str) -> Problem:
    source = getattr(rule, "source", None) or ""
    file, _, line = source.rpartition(":")
    if line.isdigit():
        return Problem(text, ("rules", "input"), file, int(line))
    return Problem(text, ("rules", "input"), source or None)


def check_kv_spec(path: str, spec, rule, hw) -> list[str]:
    """What ``hw`` cannot do of a KV spec, each with what it allows ([] when it fits)."""
    op = hw.op(OP_CLASS)
    if op is None:
        return [f"{path}: hardware {hw.name!r} has no kv_cache op (it stores no quantized KV cache); "
                f"remove the kv_cache rule ({getattr(rule, 'source', '')}) or use hardware that lists kv_cache "
                f"under ops:"]
    out = []
    fmt = spec.format
    if fmt not in op.input_formats:
        out.append(f"{path}: KV cache format {fmt.name} is not supported by hardware {hw.name!r} "
                    f"(allowed: {', '.join(f.name for f in op.input_formats)})")
    elif fmt.is_scaled:
        out += [f"{path}: KV cache {fmt.name}: {v} by hardware {hw.name!r}" for v in
                hw.activation_rules.violations(spec.granularity, spec.symmetric, hw.activation_granularities(OP_CLASS))]
    return out


def attach_kv_quantizers(model: torch.nn.Module, recipe, hw=None) -> list[str]:
    """Give every :class:`QKVCache` of ``model`` the quantizers its recipe rule asks for.

    For each QKVCache at ``path`` the recipe resolves ``(path, "QKVCache", "kv_cache")`` (first
    match wins); its ``input`` spec is the format of both K and V. Checked against ``hw``
    (None: unchecked): the format must be one of ``ops.kv_cache.input_formats``, the granularity
    one of its ``granularities``; a rule that names ``kv_cache`` in its ``type`` on hardware without
    a ``kv_cache`` op is refused (``RecipeError`` naming the hardware, the path and the rule); a
    rule that reaches the cache without naming it (``match: "*"``) leaves it in float there.
    Every problem is listed in one error, before any quantizer is built.

    Returns the report notes: one line per cache quantized, with its formats.
    """
    caches = [(p, m) for p, m in model.named_modules() if isinstance(m, QKVCache)]
    if not caches or recipe is None:
        return []
    plans, problems, notes = [], [], []
    for path, mod in caches:
        spec = recipe.resolve(path, type(mod).__name__, OP_CLASS)
        if spec is None or spec.input is None or spec.fallback_fp16:
            continue
        rule = recipe.rules[spec.rule_index] if spec.rule_index is not None else None
        if hw is not None and hw.op(OP_CLASS) is None and OP_CLASS not in (getattr(rule, "types", ()) or ()):
            notes.append(f"{path}: hardware {hw.name!r} has no kv_cache op; the KV cache stays float")
            continue
        issues = check_kv_spec(path, spec.input, rule, hw) if hw is not None else []
        problems += [_problem(rule, t) for t in issues]
        plans.append((path, mod, spec.input))
    if problems:
        raise RecipeError(problems, what=f"recipe {recipe.name!r} for hardware {hw.name!r}")
    for path, mod, spec in plans:
        mod.configure(spec, path)
        how = spec.granularity if spec.granularity != "per_channel" else \
            f"per head (axis {spec.axis if spec.axis is not None else HEAD_AXIS})"
        notes.append(f"{path}: KV cache quantizers key_quant, value_quant {spec.format.name} {how}, static scales")
    return notes
