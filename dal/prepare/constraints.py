"""What the chip forces beyond formats, from the hardware model (decided in prepare's plan,
``actions.py``, carried out by ``apply_plan``; the checks run on the prepared model):

* ``scale_constraint: power_of_two`` (weight_rules / activation_rules): every quantizer of that
  role gets ``constrain_power_of_two`` (rounding from the recipe's ``observer_args:
  {power_of_two: nearest | cover}``, default ``cover``, which never clips the observed range);
  a recipe ``fixed_scale`` that is not exactly 2^k is refused (``check_constraints``);
* ``shared_scale: [cat, ...]``: one quantizer per group (``shared_scale.py``);
* ``accumulator_bits``: a warning naming each layer whose worst case overflows
  (``accumulator_width.py``);
* ``channel_alignment``: a report note per layer whose channel counts the chip pads.
"""
from __future__ import annotations

import math

from torch import nn

from ..config.problems import Problem
from ..hardware.op_classes import OP_CLASSES
from ..quantizer import quantizers
from ..recipe.errors import RecipeError
from .accumulator_width import check_accumulators

ROLES = ("input", "weight", "output")


def _rule_of(hw, role: str):
    return hw.weight_rules if role == "weight" else hw.activation_rules


def _is_pow2(v: float) -> bool:
    m, _ = math.frexp(float(v))
    return v > 0 and m == 0.5


def _source(rule) -> tuple[str | None, int | None]:
    src = getattr(rule, "source", None)
    if src and ":" in src:
        file, _, line = src.rpartition(":")
        if line.isdigit():
            return file, int(line)
    return src, None


def check_constraints(plan, recipe, hw) -> None:
    """Raise ``RecipeError`` (file:line of the rule, the layer, what is allowed) for every layer
    whose spec asks for a ``fixed_scale`` that is not a power of two, or a ``power_of_two``
    rounding that is not one of nearest / cover, where the hardware requires power-of-two
    scales. Per-channel activations and formats are refused by the recipe check already."""
    if hw is None:
        return
    problems = []
    for step in plan:
        spec = getattr(step, "spec", None)
        if spec is None or getattr(spec, "fallback_fp16", False):
            continue
        for role in ROLES:
            t = getattr(spec, role, None)
            if t is None or not t.format.is_scaled or _rule_of(hw, role).scale_constraint != "power_of_two":
                continue
            args = dict(t.observer_args)
            fixed, rounding = args.get("fixed_scale"), args.get("power_of_two")
            bad = []
            if fixed is not None and not (isinstance(fixed, (int, float)) and _is_pow2(fixed)):
                k = math.floor(math.log2(fixed)) if isinstance(fixed, (int, float)) and fixed > 0 else None
                hint = f" such as {2.0 ** k!r} (2^{k}) or {2.0 ** (k + 1)!r} (2^{k + 1})" if k is not None else ""
                bad.append(f"fixed_scale {fixed!r} is not a power of two; allowed: a scale 2^k{hint}")
            if rounding is not None and rounding not in ("nearest", "cover"):
                bad.append(f"power_of_two {rounding!r} is not a rounding; allowed: nearest, cover")
            if not bad:
                continue
            op_class = step.op_class if step.op_class in OP_CLASSES else None
            index = recipe.match(step.path, step.type_name, op_class)
            file, line = _source(recipe.rules[index]) if index is not None else (None, None)
            for why in bad:
                problems.append(Problem(f"layer {step.path!r} ({step.type_name}): {role} {t.format.name}: {why}, "
                                        f"since hardware {hw.name!r} has scale_constraint: power_of_two for "
                                        f"{'weights' if role == 'weight' else 'activations'}",
                                        ("rules", index, role, "observer_args"), file, line))
    if problems:
        raise RecipeError(problems, what=f"recipe {recipe.name!r} for hardware {hw.name!r}")


def power_of_two_roles(hw) -> tuple:
    """The quantizer roles (``"weight"``, ``"input"``: every activation) whose scales ``hw`` keeps
    2^k (``scale_constraint: power_of_two`` in its weight_rules / activation_rules)."""
    return tuple(r for r in ("weight", "input") if _rule_of(hw, r).scale_constraint == "power_of_two")


def constrain_power_of_two(model: nn.Module, roles) -> int:
    """Give every scaled quantizer of ``model`` of a role in ``roles`` ``constrain_power_of_two``
    (its recipe rounding, default ``cover``); returns how many."""
    constrained = 0
    for name, q in quantizers(model):
        role = "weight" if name.endswith("weight_quant") else "input"
        if q.fmt.is_scaled and role in roles:
            q.constrain_power_of_two(q.power_of_two or "cover")
            constrained += 1
    return constrained


def constraint_notes(model: nn.Module, hw, report=None) -> None:
    """The read-only checks of a prepared ``model`` against ``hw``: the accumulator check (a
    warning and a note per layer whose worst case overflows) and the channel-alignment notes."""
    if hw is None:
        return
    check_accumulators(model, hw, report)
    if report is not None:
        report.notes += alignment_notes(model, hw)


def alignment_notes(model: nn.Module, hw) -> list[str]:
    """One line per conv / linear whose input or output channel count is not a multiple of
    ``hw.channel_alignment``: the padded count and the share of the MACs spent on padding."""
    a = hw.channel_alignment
    if a <= 1:
        return []
    out = []
    for path, mod in model.named_modules():
        cin = getattr(mod, "in_channels", getattr(mod, "in_features", None))
        cout = getattr(mod, "out_channels", getattr(mod, "out_features", None))
        if not (isinstance(cin, int) and isinstance(cout, int) and hasattr(mod, "weight_quant")):
            continue
        pin, pout = -(-cin // a) * a, -(-cout // a) * a
        if (pin, pout) != (cin, cout):
            waste = 1.0 - (cin * cout) / (pin * pout)
            out.append(f"channel_alignment {a}: {path} computes {cin}->{cout} channels as {pin}->{pout} "
                       f"on {hw.name!r} ({waste:.0%} of its MACs are padding)")
    return out
