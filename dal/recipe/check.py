"""Refuse a recipe that asks for what the hardware cannot do, listing every offender at once.

``check_against_hardware(recipe, hardware, layers)`` raises ``RecipeError`` when a format,
granularity, group size or symmetry that a rule asks for is not allowed by the hardware
model for the op class it applies to. Each problem names the layer (or, without layers, the
rule and its ``file:line``), the format, the hardware and what it would allow, and says
what to do. What is not an error is returned in a ``CheckReport``: sparsity the hardware
cannot use (weights left dense), op classes the hardware does not run (left in float),
FP16 fallback on hardware without FP16 for that op (runs off the NPU).
"""
from __future__ import annotations

from dataclasses import dataclass

from dal.config.problems import Problem
from dal.formats.qformat import FP16
from dal.hardware.load import load_hardware
from dal.hardware.model import HardwareModel
from dal.hardware.op_classes import OP_CLASSES, SPARSIFIABLE
from dal.recipe.errors import RecipeError
from dal.recipe.load import load_recipe
from dal.recipe.recipe import Recipe
from dal.recipe.rule import Rule


@dataclass(frozen=True)
class CheckReport:
    """What a passing check found worth saying (none of it is an error).

    Attributes:
        recipe, hardware: names.
        left_dense: one line per layer (or rule x op class) whose N:M sparsity the hardware
            cannot use; its weights stay dense.
        left_float: one line per layer (or rule x op class) the hardware does not run.
        notes: FP16 fallbacks that run off the NPU, rules that matched no layer, replacement
            rules the hardware needs that the recipe does not list.
    """

    recipe: str
    hardware: str
    left_dense: tuple[str, ...] = ()
    left_float: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()

    def __str__(self) -> str:
        lines = [f"recipe {self.recipe!r} fits hardware {self.hardware!r}"]
        for title, items in (("left dense", self.left_dense), ("left in float", self.left_float),
                             ("notes", self.notes)):
            if items:
                lines.append(f"{title}:")
                lines += [f"  - {x}" for x in items]
        return "\n".join(lines)


def check_against_hardware(recipe, hardware=None, layers: list[tuple[str, str, str]] | None = None) -> CheckReport:
    """Check ``recipe`` against ``hardware``; raise ``RecipeError`` listing every offender.

    ``recipe`` / ``hardware`` are anything ``load_recipe`` / ``load_hardware`` accept
    (``hardware=None``: the recipe's own ``hardware``).
    ``layers`` is a list of ``(module_name, module_type_name, op_class)``; each is resolved
    (first matching rule) and checked. Without layers every rule is checked for the op
    classes it can reach: those named by its ``type`` (minus those taken whole by an earlier
    rule without ``match``), or every op class the hardware runs.

    >>> check_against_hardware("w4a8_fp8_performance", "a1000")   # doctest: +SKIP
    RecipeError: invalid recipe 'w4a8_fp8_performance' for hardware 'a1000': ...
    """
    recipe = load_recipe(recipe)
    hw = load_hardware(recipe.target_hardware(hardware))
    ctx = _Context(recipe, hw)
    if layers is None:
        ctx.check_rules()
    else:
        ctx.check_layers(layers)
    needed = [r for r in hw.replace_rules_needed if r not in recipe.replace]
    if needed:
        ctx.notes.append(f"hardware {hw.name!r} needs the replacement rules {', '.join(needed)}, which the "
                         f"recipe's replace: does not list; without them the operators those rules "
                         f"match are trained as plain PyTorch operators, not as this chip runs them")
    if ctx.problems:
        raise RecipeError(ctx.problems, what=f"recipe {recipe.name!r} for hardware {hw.name!r}")
    return CheckReport(recipe.name, hw.name, tuple(ctx.left_dense), tuple(ctx.left_float), tuple(ctx.notes))


def _split_source(source: str | None) -> tuple[str | None, int | None]:
    if source and ":" in source:
        file, _, line = source.rpartition(":")
        if line.isdigit():
            return file, int(line)
    return source, None


class _Context:
    def __init__(self, recipe: Recipe, hw: HardwareModel):
        self.recipe, self.hw = recipe, hw
        self.problems: list[Problem] = []
        self.left_dense: list[str] = []
        self.left_float: list[str] = []
        self.notes: list[str] = []

    # -- the two modes --------------------------------------------------------------------------
    def check_layers(self, layers) -> None:
        used = set()
        for entry in layers:
            name, type_name, op_class = entry
            spec = self.recipe.resolve(name, type_name, op_class)
            index = self.recipe.match(name, type_name, op_class)
            if index is not None:
                used.add(index)
            if spec is None:
                continue
            who = f"layer {name!r} ({type_name}, op class {op_class})"
            op = self.hw.op(op_class)
            for role, issue, allowed in self._issues(op_class, index, who, spec.sparsity):
                where = f" for {op_class} ({op.engine} engine); allowed: {', '.join(allowed)}" if allowed else ""
                self._problem(index, role, f"{who}: {issue}{where}", bool(allowed), name, [op_class])
        for i, rule in enumerate(self.recipe.rules):
            if i not in used:
                self.notes.append(f"rule {i} ({rule.source}, {rule.describe()}) matched no layer")

    def check_rules(self) -> None:
        taken: set[str] = set()  # op classes wholly decided by an earlier rule without match / position:
        for index, rule in enumerate(self.recipe.rules):
            reach = rule.op_classes()
            explicit = reach is not None
            candidates = reach if explicit else tuple(op.op_class for op in self.hw.ops)
            candidates = [c for c in candidates if c not in taken]
            if not rule.match and not rule.position:  # a position rule decides for one module only
                taken |= set(candidates if explicit else OP_CLASSES)
            if rule.skip:
                continue
            grouped: dict[tuple, list[str]] = {}
            notes_before = len(self.notes)
            for op_class in candidates:
                if not explicit and not self._applies(rule, op_class):
                    continue
                who = f"rule {index} ({rule.describe()}) on {op_class}"
                sparsity = rule.sparsity if op_class in SPARSIFIABLE else None
                for role, issue, allowed in self._issues(op_class, index, who, sparsity):
                    key = (role, issue, tuple(sorted(allowed)) if allowed else None)
                    grouped.setdefault(key, []).append(op_class)
            if not explicit and len(self.notes) > notes_before + 1:  # one note, not one per op class
                del self.notes[notes_before:]
                self.notes.append(f"rule {index} ({rule.describe()}): fallback fp16, but {self.hw.name!r} "
                                  "has no fp16 for some op classes; such layers will run outside the NPU")
            for (role, issue, allowed), classes in grouped.items():
                where = f" for {', '.join(classes)}; allowed there: {', '.join(allowed)}" if allowed else \
                    f" for {', '.join(classes)}"
                self._problem(index, role, f"rule {index} ({rule.describe()}): {issue}{where}",
                              bool(allowed), None, classes)

    # -- shared -----------------------------------------------------------------------------------
    def _applies(self, rule: Rule, op_class: str) -> bool:
        """Whether an untyped rule asks anything of ``op_class`` (specs of roles it has, etc.)."""
        op = self.hw.op(op_class)
        roles = op.roles if op is not None else ()
        return rule.fallback_fp16 or any(getattr(rule, r) is not None for r in roles) or (
            bool(rule.sparsity) and op_class in SPARSIFIABLE)

    def _issues(self, op_class: str, index: int, who: str, sparsity: str | None):
        """(role, what is wrong, allowed format names or None) for ``op_class`` under rule ``index``."""
        rule = self.recipe.rules[index]
        hw, op = self.hw, self.hw.op(op_class)
        if op is None:
            if rule.fallback_fp16 or any(getattr(rule, r) is not None for r in ("weight", "input", "output")):
                self.left_float.append(f"{who}: hardware {hw.name!r} does not run {op_class}; left in float")
            return []
        out = []
        if rule.fallback_fp16 and FP16 not in op.formats(op.roles[-1]):
            self.notes.append(f"{who}: fallback fp16, but {hw.name!r} runs {op_class} only in "
                              f"{_names(op.formats(op.roles[-1]))}; the layer will run outside the NPU")
        for role in op.roles:
            spec = getattr(rule, role)
            if spec is None:
                continue
            allowed = op.formats(role)
            if spec.format not in allowed:
                out.append((role, f"{role} format {spec.format.name} is not supported by hardware {hw.name!r}",
                            tuple(f.name for f in allowed)))
            elif not spec.format.is_scaled:
                continue
            elif role == "weight":
                for v in hw.weight_rules.violations(spec.granularity, spec.group_size, spec.symmetric,
                                                    spec.narrow_range):
                    out.append((role, f"{spec.format.name} weights: {v} by hardware {hw.name!r}", None))
            elif spec.granularity == "per_token" and "per_token" not in hw.activation_rules.granularities:
                out.append((role, f"{role} {spec.format.name}: dynamic per-token activation scales (granularity "
                                  f"per_token) are not declared by hardware {hw.name!r} ({hw.source or 'no file'}: "
                                  f"activation_rules.granularities lists "
                                  f"{', '.join(hw.activation_rules.granularities)}); use granularity: per_tensor "
                                  f"(a static scale set by dal.calibrate)", None))
            else:
                for v in hw.activation_rules.violations(spec.granularity, spec.symmetric,
                                                        hw.activation_granularities(op_class)):
                    out.append((role, f"{role} {spec.format.name}: {v} by hardware {hw.name!r}", None))
        if sparsity and not hw.supports_sparsity(op_class, sparsity):
            has = (f"takes {', '.join(hw.sparsity_patterns)} sparse weights only for {', '.join(hw.sparse_ops)}"
                   if hw.sparse_ops else "has no sparse engine")
            self.left_dense.append(f"{who}: {sparsity} sparsity asked by rule {index} ({rule.source}), but "
                                   f"{hw.name!r} {has}; weights stay dense")
        return out

    def _problem(self, index: int, role: str, issue: str, allowed: bool, fix_layer: str | None,
                 op_classes: list[str]) -> None:
        rule = self.recipe.rules[index]
        file, line = _split_source(rule.source)
        fix = [f"set {role}.format in this rule to an allowed format"] if allowed else [
            "change the rule's quantization parameters as said"]
        if fix_layer is not None:
            fp16 = all(FP16 in self.hw.allowed_formats(c, "output") for c in op_classes)
            fix.append(f"or put a rule {{match: {fix_layer!r}, {'fallback: fp16' if fp16 else 'skip: true'}}} "
                       f"before it")
        else:
            fix.append("or narrow the rule with match:/type: so that it does not reach these op classes")
        text = issue + "; fix: " + ", ".join(fix)
        self.problems.append(Problem(text, ("rules", index, role), file, line))


def _names(formats) -> str:
    return ", ".join(f.name for f in formats) or "(none)"
