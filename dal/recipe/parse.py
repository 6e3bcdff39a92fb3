"""Turn a YAML document (or a dict) into a validated ``Recipe``; schema in ``recipes/README.md``.

Every problem is collected, located at ``file:line`` and raised together as one ``RecipeError``.
"""
from __future__ import annotations

from pathlib import PurePath

from dal.config.fields import Checker
from dal.config.problems import format_path
from dal.config.vocabulary import GRANULARITIES
from dal.config.yaml_lines import YamlDoc, from_data
from dal.recipe.errors import RecipeError
from dal.recipe.recipe import CALIBRATION_METHODS, PTQ_STEPS, TRAIN_MODES, Calibration, Recipe
from dal.recipe.rule import Rule
from dal.recipe.spec import OBSERVERS, TensorSpec, role_defaults

TOP_KEYS = ("name", "description", "hardware", "calibration", "replace", "sparsity_schedule", "ptq", "train",
            "quantize_outputs", "rules")
CALIBRATION_KEYS = ("method", "num_batches", "args")
RULE_KEYS = ("match", "type", "position", "weight", "input", "output", "fallback", "skip", "sparsity", "replace")
SPEC_KEYS = ("format", "granularity", "axis", "group_size", "symmetric", "narrow_range", "observer",
             "observer_args", "learnable")


def parse_recipe(doc: YamlDoc) -> Recipe:
    """Validate ``doc.data`` against the recipe schema and build the ``Recipe``."""
    c = Checker()
    data = c.mapping(doc.data, (), TOP_KEYS, required=("rules",))
    if data is None:
        c.raise_if_any(RecipeError, doc)
    kw: dict = {"name": PurePath(doc.source).stem if doc.source[:1] != "<" else "custom"}
    for key in ("name", "description", "hardware"):
        if data.get(key) is not None:
            kw[key] = c.string(data[key], (key,))
    if data.get("calibration") is not None:
        kw["calibration"] = _calibration(c, data["calibration"])
    if data.get("replace") is not None:
        kw["replace"] = c.strings(data["replace"], ("replace",))
    if data.get("sparsity_schedule") is not None:
        kw["sparsity_schedule"] = _schedule(c, data["sparsity_schedule"])
        kw["sparsity_schedule_at"] = doc.where(("sparsity_schedule",))
    if data.get("ptq") is not None:
        kw["ptq"] = _ptq(c, data["ptq"])
    if data.get("train") is not None:
        kw["train"] = c.string(data["train"], ("train",), TRAIN_MODES)
    if data.get("quantize_outputs") is not None:
        kw["quantize_outputs"] = c.boolean(data["quantize_outputs"], ("quantize_outputs",))
    kw["rules"] = _rules(c, data.get("rules"), doc)
    c.raise_if_any(RecipeError, doc)
    c.build((), Recipe, source=doc.source, **kw)
    c.raise_if_any(RecipeError, doc)
    return Recipe(source=doc.source, **kw)


def parse_rule_list(rules: list, source: str) -> tuple[Rule, ...]:
    """Rules given as ``Rule`` objects or dicts (e.g. by an automatic FP16-fallback search)."""
    doc = from_data({"rules": [r.to_dict() if isinstance(r, Rule) else r for r in rules]}, source)
    c = Checker()
    out = _rules(c, doc.data["rules"], doc)
    c.raise_if_any(RecipeError, doc)
    # Rule objects keep their own source.
    return tuple(r if isinstance(r, Rule) else o for r, o in zip(rules, out))


def _calibration(c: Checker, raw):
    path = ("calibration",)
    before = len(c.problems)
    if c.mapping(raw, path, CALIBRATION_KEYS) is None:
        return None
    kw = {}
    if "method" in raw:
        kw["method"] = c.string(raw["method"], path + ("method",), CALIBRATION_METHODS)
    if "num_batches" in raw:
        kw["num_batches"] = c.integer(raw["num_batches"], path + ("num_batches",), 1)
    if "args" in raw:
        kw["args"] = c.scalar_args(raw["args"], path + ("args",))
    return None if len(c.problems) > before else c.build(path, Calibration, **kw)


def _ptq(c: Checker, raw):
    """``ptq: [equalize, adaround, bias_correction]``: names of dal.ptq steps, run in that order."""
    if not isinstance(raw, list):
        c.add(("ptq",), f"expected a list of PTQ steps (allowed: {', '.join(PTQ_STEPS)}), got {raw!r}")
        return ()
    out = [c.string(v, ("ptq", i), PTQ_STEPS) for i, v in enumerate(raw)]
    return tuple(v for v in out if v is not None)


def _schedule(c: Checker, raw):
    """``"one_shot"`` or a mapping with ``kind`` and scalar fields; stored as plain data (the
    recipe layer does not import dal.sparsity, which checks kinds and fields at prepare time)."""
    path = ("sparsity_schedule",)
    if isinstance(raw, str):
        return raw
    if isinstance(raw, dict):
        if not isinstance(raw.get("kind"), str):
            c.add(path, "a mapping schedule needs kind: one_shot, gradual or recompute_then_freeze")
            return None
        return c.scalar_args(raw, path)
    c.add(path, f"expected a schedule name or a mapping with kind (e.g. {{kind: gradual, steps: 2000, "
                f"every: 100}}), got {raw!r}")
    return None


def _rules(c: Checker, raw, doc: YamlDoc) -> tuple:
    if raw is None:
        return ()
    if not isinstance(raw, list):
        c.add(("rules",), f"expected a list of rules (each a mapping with keys {', '.join(RULE_KEYS)}), got {raw!r}")
        return ()
    out = []
    for i, body in enumerate(raw):
        rule = _rule(c, body, ("rules", i), doc)
        if rule is not None:
            out.append(rule)
    return tuple(out)


def _rule(c: Checker, raw, path: tuple, doc: YamlDoc):
    before = len(c.problems)
    if c.mapping(raw, path, RULE_KEYS) is None:
        return None
    kw: dict = {}
    for key, field in (("match", "match"), ("type", "types"), ("replace", "replace")):
        if raw.get(key) is not None:
            kw[field] = c.strings(raw[key], path + (key,))
    for role in ("weight", "input", "output"):
        if raw.get(role) is not None:
            kw[role] = _tensor_spec(c, raw[role], path + (role,), role)
    if raw.get("fallback") is not None:
        value = raw["fallback"]
        if isinstance(value, str) and value.strip().lower() in ("fp16", "float16", "half"):
            kw["fallback_fp16"] = True
        else:
            c.add(path + ("fallback",), f"{value!r} is not allowed; the only fallback is fp16 "
                                        "(to leave a layer in fp32, use skip: true)")
    if raw.get("skip") is not None:
        kw["skip"] = c.boolean(raw["skip"], path + ("skip",))
    if raw.get("position") is not None:
        kw["position"] = c.string(raw["position"], path + ("position",), ("first", "last"))
    if raw.get("sparsity") is not None:
        kw["sparsity"] = c.nm_pattern(raw["sparsity"], path + ("sparsity",))
    if len(c.problems) > before:
        return None
    line = doc.line(path)
    source = f"{doc.source}:{line}" if line else f"{doc.source}:{format_path(path)}"
    return c.build(path, Rule, source=source, **kw)


def _tensor_spec(c: Checker, raw, path: tuple, role: str):
    """A spec from a format name (role defaults) or a mapping overriding the defaults."""
    if isinstance(raw, str):
        fmt = c.qformat(raw, path)
        return None if fmt is None else c.build(path, TensorSpec, fmt, **role_defaults(fmt, role))
    before = len(c.problems)
    if c.mapping(raw, path, SPEC_KEYS, required=("format",)) is None or "format" not in raw:
        return None
    fmt = c.qformat(raw["format"], path + ("format",))
    if fmt is None:
        return None
    kw = role_defaults(fmt, role)
    for key, value in raw.items():
        p = path + (key,)
        if key == "granularity":
            kw[key] = c.string(value, p, GRANULARITIES)
        elif key in ("axis", "group_size"):
            kw[key] = None if value is None else c.integer(value, p, None if key == "axis" else 1)
        elif key in ("symmetric", "narrow_range", "learnable"):
            kw[key] = c.boolean(value, p)
        elif key == "observer":
            kw[key] = c.string(value, p, OBSERVERS)
        elif key == "observer_args":
            kw[key] = c.scalar_args(value, p)
    if role == "weight" and kw.get("granularity") == "per_token":
        c.add(path + ("granularity",), "per_token (dynamic per-token scales) is for activations (input / "
                                       "output), not weights; use per_channel or per_group")
    if len(c.problems) > before:
        return None
    return c.build(path, TensorSpec, fmt, **kw)
