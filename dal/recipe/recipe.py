"""``Recipe``: the user's quantization choices, an ordered list of rules (first match wins)."""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Iterable

from dal.config.problems import Problem
from dal.hardware.op_classes import OP_CLASS_ROLES, SPARSIFIABLE, check_op_class
from dal.recipe.errors import RecipeError
from dal.recipe.rule import Rule
from dal.recipe.spec import LayerSpec

CALIBRATION_METHODS = ("minmax", "percentile", "kl", "mse", "easyquant")
#: dal.ptq steps a recipe may name (``ptq:``); the float-model ones run before prepare_qat, the
#: others after calibration (dal.ptq.quantize_ptq)
PTQ_STEPS = ("fold_bn", "equalize", "smooth_quant", "adaround", "bias_correction", "bn_reestimate", "gptq",
             "sparsegpt")
#: what QAT trains (``train:``): everything, or only the learnable quantizers' scales / zero points
TRAIN_MODES = ("all", "scales_only")


@dataclass(frozen=True)
class Calibration:
    """How ``dal.calibrate`` sets scales: ``method`` over ``num_batches`` batches, extra ``args``."""

    method: str = "minmax"
    num_batches: int = 32
    args: tuple[tuple[str, Any], ...] = ()

    def __post_init__(self):
        if isinstance(self.args, dict):
            object.__setattr__(self, "args", tuple(sorted(self.args.items())))
        problems = []
        if self.method not in CALIBRATION_METHODS:
            problems.append(Problem(f"{self.method!r} is not allowed (allowed: {', '.join(CALIBRATION_METHODS)})",
                                    ("method",)))
        if isinstance(self.num_batches, bool) or not isinstance(self.num_batches, int) or self.num_batches < 1:
            problems.append(Problem(f"expected a positive integer, got {self.num_batches!r}", ("num_batches",)))
        if problems:
            raise RecipeError(problems)

    def to_dict(self) -> dict:
        out: dict = {"method": self.method, "num_batches": self.num_batches}
        if self.args:
            out["args"] = {k: list(v) if isinstance(v, tuple) else v for k, v in self.args}
        return out


@dataclass(frozen=True)
class Recipe:
    """An ordered list of rules plus calibration and replacement settings.

    Attributes:
        name, description: free text (name defaults to the file stem).
        hardware: default target (bundled name or path), or None.
        calibration: a ``Calibration``.
        replace: replacement rules applied to the whole model.
        sparsity_schedule: when the 2:4 masks of the sparsity rules are (re)computed: a kind name
            (``"one_shot"``) or ``(("kind", "gradual"), ("steps", 2000), ...)`` pairs (YAML: a
            mapping); None = one shot. Resolved by ``dal.sparsity.resolve_schedule`` in prepare.
        ptq: names of PTQ steps (``PTQ_STEPS``) that ``dal.ptq.quantize_ptq`` runs, in order.
        train: ``"all"`` or ``"scales_only"`` (``prepare_qat`` freezes every weight, bias and BN
            statistic; only the ``learnable: true`` quantizers' scales and zero points train).
        quantize_outputs: False (the default): the model's outputs stay in float (they feed the
            loss; an output quantizer calibrated on an untrained model clips the logits to its
            small range and, with a straight-through gradient of zero outside it, training never
            widens it). True: with ``example_inputs``, the QAT layers whose results are the
            model's outputs get an output quantizer, so the exported outputs are integer codes.
        rules: ``Rule`` objects; the first that matches a layer decides for it.
        source: file it was loaded from (not compared: a saved and reloaded recipe is equal).
    """

    name: str
    description: str = ""
    hardware: str | None = None
    calibration: Calibration = field(default_factory=Calibration)
    replace: tuple[str, ...] = ()
    sparsity_schedule: str | tuple | None = None
    ptq: tuple[str, ...] = ()
    train: str = "all"
    quantize_outputs: bool = False
    rules: tuple[Rule, ...] = ()
    source: str | None = field(default=None, compare=False, repr=False)
    sparsity_schedule_at: str | None = field(default=None, compare=False, repr=False)  # "file:line"

    def __post_init__(self):
        object.__setattr__(self, "replace", tuple(self.replace))
        object.__setattr__(self, "rules", tuple(self.rules))
        object.__setattr__(self, "ptq", tuple(self.ptq))
        if isinstance(self.sparsity_schedule, dict):  # hashable, order-free, as the parser stores it
            object.__setattr__(self, "sparsity_schedule", tuple(sorted(self.sparsity_schedule.items())))
        problems = []
        if not isinstance(self.name, str) or not self.name:
            problems.append(Problem(f"name must be a non-empty string, got {self.name!r}", ("name",)))
        if not isinstance(self.calibration, Calibration):
            problems.append(Problem(f"expected a Calibration, got {self.calibration!r}", ("calibration",)))
        for i, step in enumerate(self.ptq):
            if step not in PTQ_STEPS:
                problems.append(Problem(f"{step!r} is not allowed (allowed: {', '.join(PTQ_STEPS)})", ("ptq", i)))
        for i, r in enumerate(self.rules):
            if not isinstance(r, Rule):
                problems.append(Problem(f"expected a Rule, got {r!r}", ("rules", i)))
        if self.train not in TRAIN_MODES:
            problems.append(Problem(f"{self.train!r} is not allowed (allowed: {', '.join(TRAIN_MODES)})", ("train",)))
        elif self.train == "scales_only" and not any(
                getattr(getattr(r, role, None), "learnable", False) for r in self.rules for role in
                ("weight", "input", "output")):
            problems.append(Problem("scales_only trains only learnable quantizers and no rule has one: set "
                                    "learnable: true on a weight or input spec (as w4a8_lsq does)", ("train",)))
        if problems:
            raise RecipeError(problems)

    # -- resolution ------------------------------------------------------------------------------
    def match(self, module_name: str, module_type_name: str, op_class: str | None) -> int | None:
        """Index of the first rule matching the module, or None."""
        if op_class is not None:
            check_op_class(op_class)
        for i, rule in enumerate(self.rules):
            if rule.matches(module_name, module_type_name, op_class):
                return i
        return None

    def resolve(self, module_name: str, module_type_name: str, op_class: str | None) -> LayerSpec | None:
        """What the recipe asks for one module; None = leave it in float.

        The first matching rule decides (later rules are not consulted). None is returned when
        no rule matches, when that rule says ``skip: true``, or when it asks for nothing that
        applies to ``op_class`` (specs for roles the op class lacks are dropped: ``weight`` of an
        ``add``, ``input`` of an ``embedding``; so is sparsity outside
        ``dal.hardware.op_classes.SPARSIFIABLE``). ``op_class`` is one of
        ``dal.hardware.OP_CLASSES``, or None when unknown (then every spec is kept).

            >>> r = load_recipe("int8_balanced")                              # doctest: +SKIP
            >>> r.resolve("features.0", "Conv2d", "conv").weight.format.name  # doctest: +SKIP
            'int8'
        """
        index = self.match(module_name, module_type_name, op_class)
        if index is None:
            return None
        rule = self.rules[index]
        if rule.skip:
            return None
        roles = OP_CLASS_ROLES[op_class] if op_class is not None else ("weight", "input", "output")
        spec = LayerSpec(
            weight=rule.weight if "weight" in roles else None,
            input=rule.input if "input" in roles else None,
            output=rule.output if "output" in roles else None,
            fallback_fp16=rule.fallback_fp16,
            sparsity=rule.sparsity if op_class is None or op_class in SPARSIFIABLE else None,
            replace=rule.replace,
            rule_index=index, rule_source=rule.source or f"<recipe {self.name}>:rules[{index}]")
        if not (spec.quantized or spec.fallback_fp16 or spec.sparsity or spec.replace):
            return None
        return spec

    def resolve_checked(self, module_name: str, module_type_name: str, op_class: str | None,
                        hardware=None) -> LayerSpec | None:
        """``resolve``, checked against ``hardware`` (default: ``self.hardware``), as it will run.

        Raises ``RecipeError`` when the hardware cannot do what the spec asks (see
        ``check_against_hardware``). Otherwise returns the spec with what the hardware cannot
        take removed: ``sparsity`` is None where the op class takes no sparse weights (left
        dense), and None is returned for an op class the hardware does not run (left in float).
        """
        from dal.hardware.load import load_hardware
        from dal.recipe.check import check_against_hardware

        hw = load_hardware(self.target_hardware(hardware))
        spec = self.resolve(module_name, module_type_name, op_class)
        if spec is None or op_class is None:
            return spec
        check_against_hardware(self, hw, [(module_name, module_type_name, op_class)])
        if not hw.supports_op(op_class):
            return None
        if spec.sparsity and not hw.supports_sparsity(op_class, spec.sparsity):
            spec = replace(spec, sparsity=None)
        return spec

    def target_hardware(self, hardware=None):
        """The hardware a call targets: ``hardware`` when given (a bundled name, a path or a
        HardwareModel), else the recipe's own ``hardware``; RecipeError when neither names one."""
        if hardware is None:
            hardware = self.hardware
        if hardware is None:
            raise RecipeError(Problem(f"recipe {self.name!r} names no hardware; pass hardware= "
                                      "(a bundled name such as 'a2000', a path or a HardwareModel)"))
        return hardware

    # -- editing and saving --------------------------------------------------------------------
    def with_rules_prepended(self, rules: Iterable) -> "Recipe":
        """A copy with ``rules`` (``Rule`` objects or dicts in the YAML rule schema) first.

            >>> r2 = recipe.with_rules_prepended([{"match": "layer1.0.conv1", "fallback": "fp16"}])  # doctest: +SKIP
        """
        from dal.recipe.parse import parse_rule_list

        new = parse_rule_list(list(rules), f"<prepended to {self.name}>")
        return replace(self, rules=new + self.rules)

    def bind_positions(self, modules: Iterable[tuple[str, str, str | None]]) -> "Recipe":
        """A copy in which each ``position: first|last`` rule matches, by name, the first (last)
        of ``modules`` (``(path, type name, op class)`` in registration order) that its other
        conditions match; a positional rule that matches none is dropped. Unchanged (``self``)
        when no rule is positional."""
        if not any(r.position for r in self.rules):
            return self
        modules = list(modules)
        rules = []
        for r in self.rules:
            if not r.position:
                rules.append(r)
                continue
            free = replace(r, position=None)
            hits = [name for name, type_name, op_class in modules if free.matches(name, type_name, op_class)]
            if hits:
                name = hits[0] if r.position == "first" else hits[-1]
                rules.append(replace(free, match=(name,)))
        return replace(self, rules=tuple(rules))

    def to_dict(self) -> dict:
        """The recipe in the YAML schema; ``load_recipe(recipe.to_dict()) == recipe``."""
        out: dict = {"name": self.name}
        if self.description:
            out["description"] = self.description
        if self.hardware is not None:
            out["hardware"] = self.hardware
        out["calibration"] = self.calibration.to_dict()
        if self.replace:
            out["replace"] = list(self.replace)
        if self.sparsity_schedule is not None:
            out["sparsity_schedule"] = self.schedule_data()
        if self.ptq:
            out["ptq"] = list(self.ptq)
        if self.train != "all":
            out["train"] = self.train
        if self.quantize_outputs:
            out["quantize_outputs"] = True
        out["rules"] = [r.to_dict() for r in self.rules]
        return out

    def schedule_data(self):
        """``sparsity_schedule`` as a user writes it: a name, a dict with ``kind``, or None."""
        sched = self.sparsity_schedule
        return dict(sched) if isinstance(sched, tuple) else sched

    def to_yaml(self, path=None) -> str:
        """The recipe as YAML text (written to ``path`` too when given)."""
        import yaml

        text = yaml.safe_dump(self.to_dict(), sort_keys=False, default_flow_style=False, width=100)
        if path is not None:
            from pathlib import Path

            Path(path).write_text(text, encoding="utf-8")
        return text
