"""One recipe rule: which layers it matches and what it asks for them.

Matching (all given conditions must hold; an absent condition matches everything):

- ``match``: module-name patterns, any of which may match the dotted module path.
  A pattern is an ``fnmatch`` glob (``features.0.*``, ``layer?.0.conv1``; ``*`` also crosses
  dots), or a regular expression after ``re:`` that must match the *whole* name
  (``re:layer\\d+\\.0\\.conv\\d``).
- ``types``: any of which may equal the module's class name (``Conv2d``, globs allowed:
  ``Conv*``) or its op class (``conv``, ``linear``, ... see ``dal.hardware.OP_CLASSES``).

- ``position``: "first" or "last": of the modules the other conditions match, only the first
  (last) in registration order (``Recipe.bind_positions``, which ``prepare_qat`` calls, turns
  it into a ``match`` of that module's name). W4 recipes keep the first conv and the last
  linear at INT8 this way.

Actions: tensor specs (``weight`` / ``input`` / ``output``), or ``fallback_fp16``, or ``skip``
(leave the layer in float), plus optional ``sparsity`` ("2:4") and ``replace`` rule names.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from fnmatch import fnmatchcase

from dal.config.problems import Problem
from dal.hardware.op_classes import ALL_OP_CLASSES, op_class_of_type
from dal.recipe.errors import RecipeError
from dal.recipe.spec import TensorSpec, canonical_sparsity

POSITIONS = (None, "first", "last")
_REPLACE_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def _tuple(value) -> tuple:
    if value is None:
        return ()
    if isinstance(value, str):
        return (value,)
    return tuple(value)


@dataclass(frozen=True)
class Rule:
    """A recipe rule; see the module docstring. ``source`` ("file.yaml:line") is not compared."""

    match: tuple[str, ...] = ()
    types: tuple[str, ...] = ()
    weight: TensorSpec | None = None
    input: TensorSpec | None = None
    output: TensorSpec | None = None
    fallback_fp16: bool = False
    skip: bool = False
    sparsity: str | None = None
    replace: tuple[str, ...] = ()
    position: str | None = None
    source: str | None = field(default=None, compare=False)

    def __post_init__(self):
        for name in ("match", "types", "replace"):
            object.__setattr__(self, name, _tuple(getattr(self, name)))
        problems: list[Problem] = []
        compiled = []
        for i, pat in enumerate(self.match):
            if not isinstance(pat, str) or not pat:
                problems.append(Problem(f"a match pattern is a non-empty string, got {pat!r}", ("match", i)))
            elif pat.startswith("re:"):
                try:
                    compiled.append(re.compile(pat[3:]))
                except re.error as e:
                    problems.append(Problem(f"invalid regular expression {pat[3:]!r}: {e}", ("match", i)))
            else:
                compiled.append(pat)
        object.__setattr__(self, "_patterns", tuple(compiled))
        for i, t in enumerate(self.types):
            if not isinstance(t, str) or not t:
                problems.append(Problem(f"a type is a class name or op class, got {t!r}", ("type", i)))
        specs = [r for r in ("weight", "input", "output") if getattr(self, r) is not None]
        for r in specs:
            if not isinstance(getattr(self, r), TensorSpec):
                problems.append(Problem(f"expected a tensor spec, got {getattr(self, r)!r}", (r,)))
        for key in ("fallback_fp16", "skip"):
            if not isinstance(getattr(self, key), bool):
                problems.append(Problem(f"expected true or false, got {getattr(self, key)!r}", (key,)))
        if self.skip:
            extra = specs + [k for k, v in (("fallback", self.fallback_fp16), ("sparsity", self.sparsity),
                                            ("replace", self.replace)) if v]
            if extra:
                problems.append(Problem(f"skip: true leaves the layer in float; remove {', '.join(extra)} "
                                        "or remove skip", ("skip",)))
        if self.fallback_fp16 and specs:
            problems.append(Problem(f"fallback: fp16 keeps the whole layer in FP16; remove {', '.join(specs)} "
                                    "or remove fallback", ("fallback",)))
        if not (specs or self.fallback_fp16 or self.skip or self.sparsity or self.replace):
            problems.append(Problem("the rule asks for nothing; give weight/input/output, fallback: fp16, "
                                    "skip: true, sparsity or replace"))
        if self.position not in POSITIONS:
            problems.append(Problem(f"{self.position!r} is not allowed (allowed: first, last)", ("position",)))
        canonical_sparsity(self, problems)
        for i, r in enumerate(self.replace):
            if not isinstance(r, str) or not _REPLACE_NAME.match(r):
                problems.append(Problem(f"{r!r} is not a replacement rule name", ("replace", i)))
        if problems:
            raise RecipeError(problems)

    def matches(self, module_name: str, type_name: str, op_class: str | None) -> bool:
        """True when the module satisfies every condition of the rule. A ``position`` rule matches
        nothing until ``Recipe.bind_positions`` has turned it into a rule by name."""
        if self.position:
            return False
        if self._patterns and not any(
                p.fullmatch(module_name) if isinstance(p, re.Pattern) else fnmatchcase(module_name, p)
                for p in self._patterns):
            return False
        if self.types and not any(t == op_class or fnmatchcase(type_name, t) for t in self.types):
            return False
        return True

    def op_classes(self) -> tuple[str, ...] | None:
        """Op classes this rule can apply to judging by ``types`` alone; None = any."""
        if not self.types:
            return None
        out = []
        for t in self.types:
            if t in ALL_OP_CLASSES:  # the host op classes too (grid_sample, deformable_attention)
                out.append(t)
            elif op_class_of_type(t) is not None:
                out.append(op_class_of_type(t))
            else:
                return None  # an unknown class name (or a glob) could be anything
        return tuple(dict.fromkeys(out))

    def describe(self) -> str:
        cond = []
        if self.match:
            cond.append("match " + "|".join(self.match))
        if self.types:
            cond.append("type " + "|".join(self.types))
        if self.position:
            cond.append(f"{self.position} of those")
        return ", ".join(cond) or "every layer"

    def to_dict(self) -> dict:
        """The rule in the YAML schema (specs with every field)."""
        out: dict = {}
        if self.match:
            out["match"] = self.match[0] if len(self.match) == 1 else list(self.match)
        if self.types:
            out["type"] = self.types[0] if len(self.types) == 1 else list(self.types)
        if self.position:
            out["position"] = self.position
        for role in ("weight", "input", "output"):
            spec = getattr(self, role)
            if spec is not None:
                out[role] = spec.to_dict()
        if self.fallback_fp16:
            out["fallback"] = "fp16"
        if self.skip:
            out["skip"] = True
        if self.sparsity is not None:
            out["sparsity"] = self.sparsity
        if self.replace:
            out["replace"] = list(self.replace)
        return out
