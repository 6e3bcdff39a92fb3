"""Turn a YAML document (or a dict) into a validated ``HardwareModel``.

Every problem in the document is collected, located at its ``file:line`` and raised together
as one ``HardwareModelError``. The schema is documented in ``hardware_models/README.md``.
"""
from __future__ import annotations

from dal.config.fields import Checker
from dal.config.yaml_lines import YamlDoc
from dal.hardware.cost import parse_cost
from dal.hardware.errors import HardwareModelError
from dal.hardware.model import (ActivationRules, Engine, HardwareModel, OpSupport, Requantizer,
                                WeightRules)

TOP_KEYS = ("name", "description", "engines", "ops", "weight_rules", "activation_rules", "requantizer",
            "accumulator_bits", "channel_alignment", "lut_size", "sparse_ops", "sparsity_patterns",
            "fp16_ops", "lut_ops", "replace_rules_needed", "resize_modes", "shared_scale",
            "accumulator_overflow", "cost")
ENGINE_KEYS = ("description", "formats", "compute")
OP_KEYS = ("engine", "weight_formats", "input_formats", "output_formats", "granularities", "grid_formats")
WEIGHT_RULE_KEYS = ("symmetric_required", "granularities", "group_sizes", "narrow_range", "scale_constraint")
ACTIVATION_RULE_KEYS = ("symmetric", "affine", "granularities", "scale_constraint")
REQUANTIZER_KEYS = ("kind", "multiplier_bits", "rounding")


def parse_hardware(doc: YamlDoc) -> HardwareModel:
    """Validate ``doc.data`` against the schema and build the model; raise on any problem."""
    c = Checker()
    data = c.mapping(doc.data, (), TOP_KEYS, required=("name", "engines", "ops"))
    if data is None:
        c.raise_if_any(HardwareModelError, doc)
    kw: dict = {}
    if "name" in data:
        kw["name"] = c.string(data["name"], ("name",))
    if "description" in data:
        kw["description"] = c.string(data["description"], ("description",))
    for key, lo in (("accumulator_bits", 8), ("channel_alignment", 1), ("lut_size", 2)):
        if key == "lut_size" and data.get(key, 0) is None:
            kw[key] = None  # explicit "no lookup table"
        elif key in data:
            kw[key] = c.integer(data[key], (key,), lo)
    if "accumulator_overflow" in data:
        kw["accumulator_overflow"] = c.string(data["accumulator_overflow"], ("accumulator_overflow",))
    for key in ("sparse_ops", "fp16_ops", "lut_ops", "replace_rules_needed", "resize_modes", "shared_scale"):
        if key in data:
            kw[key] = () if data[key] is None else c.strings(data[key], (key,))
    if "sparsity_patterns" in data:
        raw = data["sparsity_patterns"]
        kw["sparsity_patterns"] = () if raw is None else c.nm_patterns(raw, ("sparsity_patterns",))
    kw["engines"] = _engines(c, data.get("engines"))
    kw["ops"] = _ops(c, data.get("ops"))
    for key, cls, keys in (("weight_rules", WeightRules, WEIGHT_RULE_KEYS),
                           ("activation_rules", ActivationRules, ACTIVATION_RULE_KEYS),
                           ("requantizer", Requantizer, REQUANTIZER_KEYS)):
        if key in data:
            kw[key] = _section(c, data[key], (key,), cls, keys)
    if "cost" in data:
        kw["cost"] = parse_cost(c, data["cost"], data.get("engines"))
    # Cross-checks (engines of ops, sparse ops, ...) run even when some fields were bad, so
    # that one run reports everything; what depends on a bad field is not reported twice.
    first = list(c.problems)
    kw = {k: v for k, v in kw.items() if v is not None}
    kw["source"] = doc.source
    second = Checker()
    model = second.build((), HardwareModel, **kw) if "name" in kw else None
    for p in second.problems:
        if not any(_depends(p.path, q.path) for q in first):
            c.problems.append(p)
    c.raise_if_any(HardwareModelError, doc)
    return model


def _depends(path: tuple, bad: tuple) -> bool:
    """Whether a cross-check problem at ``path`` may be caused by a problem at ``bad``."""
    if path[:2] == bad[:2]:
        return True
    return (path[:1] == ("sparse_ops",) and bad[:1] == ("ops",)) or (
        path[:1] == ("ops",) and bad[:1] == ("engines",))


def _engines(c: Checker, raw) -> tuple:
    if not isinstance(raw, dict):
        if raw is not None:
            c.add(("engines",), f"expected a mapping of engine name -> {{{', '.join(ENGINE_KEYS)}}}, got {raw!r}")
        return ()
    out = []
    for name, body in raw.items():
        path = ("engines", name)
        body = {} if body is None else body
        if c.mapping(body, path, ENGINE_KEYS) is None:
            continue
        kw = {}
        if "description" in body:
            kw["description"] = c.string(body["description"], path + ("description",))
        if "formats" in body:
            kw["formats"] = c.qformats(body["formats"], path + ("formats",))
        if "compute" in body:  # fp32 | fp16, checked by Engine (its float precision)
            kw["compute"] = c.string(body["compute"], path + ("compute",))
        if None not in kw.values():
            out.append(c.build(path, Engine, str(name), **kw))
    return tuple(e for e in out if e is not None)


def _ops(c: Checker, raw) -> tuple:
    if not isinstance(raw, dict):
        if raw is not None:
            c.add(("ops",), f"expected a mapping of op class -> {{{', '.join(OP_KEYS)}}}, got {raw!r}")
        return ()
    out = []
    for op_class, body in raw.items():
        path = ("ops", op_class)
        if c.mapping(body, path, OP_KEYS, required=("engine",)) is None:
            continue
        kw = {"engine": c.string(body.get("engine", ""), path + ("engine",))}
        for key in OP_KEYS[1:4] + ("grid_formats",):
            if key in body:
                kw[key] = () if body[key] is None else c.qformats(body[key], path + (key,))
        if body.get("granularities") is not None:
            kw["granularities"] = c.strings(body["granularities"], path + ("granularities",))
        if None not in kw.values():
            out.append(c.build(path, OpSupport, op_class, **kw))
    return tuple(o for o in out if o is not None)


def _section(c: Checker, raw, path: tuple, cls, keys):
    before = len(c.problems)
    if c.mapping(raw, path, keys) is None:
        return None
    kw = {}
    for key, value in raw.items():
        if key not in keys:
            continue
        p = path + (key,)
        if key == "multiplier_bits" and value is None:
            kw[key] = None
            continue
        if key in ("symmetric_required", "symmetric", "affine"):
            kw[key] = c.boolean(value, p)
        elif key == "granularities":
            kw[key] = c.strings(value, p)
        elif key in ("group_sizes",):
            items = c.listing(value, p) if value is not None else []
            kw[key] = None if items is None else tuple(c.integer(v, p + (i,), 1) for i, v in enumerate(items))
        elif key == "multiplier_bits":
            kw[key] = c.integer(value, p, 8, 32)
        else:
            kw[key] = c.string(value, p)
    return None if len(c.problems) > before else c.build(path, cls, **kw)
