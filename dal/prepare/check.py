"""The plan against the hardware model, once: every offender listed in one error.

Two kinds of problem: a layer the recipe quantizes in a way the hardware does not allow
(``dal.recipe.check_against_hardware``), and an op the export will hold in float that the
hardware cannot run (``float_ops.hardware_verdict``) — refused by path with the fix, unless the
recipe rule matching that path says ``skip: true`` (the user accepts it running off the NPU).
"""
from __future__ import annotations

import dataclasses

import torch
from torch import nn

from ..config.problems import Problem
from ..formats import INT16
from ..recipe import check_against_hardware
from ..recipe.errors import RecipeError
from ..nn.norm import fp16_norms
from ..nn.registry import QAT_MODULES, registry_type
from ..hardware.op_classes import HOST_OP_CLASSES, OP_CLASS_ROLES
from .float_ops import hardware_verdict
from .call_sites import routes_island
from .fp16_island import is_island
from .plan import Step


def _fp16_norm_names() -> dict:
    """Float norm type name -> its FP16 module's name (dal.nn.norm.fp16_norms)."""
    return {t.__name__: c.__name__ for t, c in fp16_norms().items()}


#: actions whose recipe spec the recipe check reads
QUANTIZING = ("quantize", "fuse", "functional")


def check_plan(plan: list[Step], recipe, hw, model=None) -> list[Step]:
    """Raise ``RecipeError`` listing every problem of ``plan`` on ``hw``; return the plan with
    each float step's reason saying how the hardware runs it (or that a skip rule keeps it).
    With ``model``, per-group weights are also checked against the layers' shapes
    (:func:`weight_shape_problems`)."""
    problems: list[Problem] = [] if model is None else weight_shape_problems(model, plan, hw)
    layers = [(s.path, s.type_name, s.op_class) for s in plan if s.action in QUANTIZING]
    try:
        check_against_hardware(recipe, hw, layers)
    except RecipeError as err:
        problems += list(err.problems)
    checked = []
    for step in plan:
        if _fp16_norm(step, hw):
            checked.append(dataclasses.replace(step, action="fp16", built=_fp16_norm_names()[step.type_name], reason=_join(
                step.reason, f"runs in FP16 on {hw.name}'s vector engine (its FP16 layer norm; dal.nn.norm)")))
            continue
        if _rmsnorm(step):
            step, problem = _rmsnorm_verdict(step, recipe, hw)
            checked.append(step)
            problems += [problem] if problem is not None else []
            continue
        if step.action == "functional" and step.op_class in HOST_OP_CLASSES and not hw.supports_op(step.op_class):
            # a quantized op of a class the NPU may lack (grid_sample): refused by path with the fix
            at = f", called at {step.site.line}" if step.site is not None else ""  # a call site: its source line
            problems.append(Problem(f"{step.path} ({step.type_name}{at}): hardware {hw.name!r} does not run "
                                    f"{step.op_class} (not under ops: in {hw.source or hw.name}); fix: a recipe rule "
                                    f"with skip: true for {step.path!r} (or type {step.op_class}) keeps it in float "
                                    "off the NPU, or use hardware that lists it (e.g. a2000)"))
            checked.append(step)
            continue
        if step.action == "functional" and step.op_class == "grid_sample" and \
                INT16 not in hw.op("grid_sample").grid_formats:
            problems.append(Problem(f"{step.path} ({step.type_name}): dal quantizes a grid_sample's grid to int16 "
                                    f"(export/SPEC.md §5b), which hardware {hw.name!r} does not list in "
                                    f"ops.grid_sample.grid_formats; fix: a recipe rule with skip: true for "
                                    f"{step.path!r} keeps it in float off the NPU"))
        if step.action == "float" and step.float_op is not None and step.float_op.op_class in HOST_OP_CLASSES \
                and not runs_float(hw, step.float_op.op_class):
            checked.append(on_host(step, hw))
            continue
        if step.action == "float" and step.float_op is not None and step.float_op.kind == "float":
            runs, how = hardware_verdict(hw, step.float_op)
            if not runs and _skipped(recipe, step):
                step = dataclasses.replace(step, reason=_join(step.reason, f"kept off the NPU by its recipe rule "
                                                                  f"(skip, or fp16 that {hw.name} lacks): {how}"))
            elif not runs and (step.float_op.op_class == "custom" or hw.fp16_ops):
                # Listed with the hardware's verdict, not refused: a module dal does not know the
                # function of (DESIGN: left in float unless strict), or hardware with an FP16
                # vector engine, where normalisations (GroupNorm, an unfolded BN) become FP16 ops
                # once dal.nn has them. Only int8-only hardware has nowhere to run a float op.
                step = dataclasses.replace(step, reason=_join(step.reason, f"the hardware cannot run it in float: {how}"))
            elif not runs:
                problems.append(Problem(f"{step.path} ({step.type_name}): the export would hold a float "
                                        f"{step.float_op.function}, which hardware {hw.name!r} cannot run; fix: {how}"))
            elif is_island(hw, step.float_op) and ((step.site is not None and not routes_island(step.site))
                                                   or _skip_rule(recipe, step)):
                why = "its recipe rule (skip) keeps it" if _skip_rule(recipe, step) else \
                    "a call in a forward fx cannot trace:"
                step = dataclasses.replace(step, reason=_join(step.reason, f"{how}; {why} in float32, not an FP16 "
                                                              f"island (export/SPEC.md §5a)"))
            elif is_island(hw, step.float_op):
                built = f"Fp16Function({step.type_name})" if step.node or step.site else f"Fp16{step.type_name}"
                step = dataclasses.replace(step, action="fp16", built=built, reason=_join(
                    step.reason, f"{how}: an FP16 island, input and output rounded to fp16 ({hw.name}'s "
                    f"{hw.op(step.float_op.op_class).engine} engine has compute: fp16)"))
            else:
                step = dataclasses.replace(step, reason=_join(step.reason, how))
        checked.append(step)
    if problems:
        raise RecipeError(problems, what=f"recipe {recipe.name!r} for hardware {hw.name!r}")
    return checked


def weight_shape_problems(model, plan: list[Step], hw) -> list[Problem]:
    """One problem per layer whose recipe spec cannot tile its tensors on ``hw``:

    * per-group weights whose blocked axis (the spec's ``axis``, else the layer's reduction axis:
      a Linear's ``in_features``) ``group_size`` does not divide: the problem names the layer,
      the size, and the group sizes of ``hw.weight_rules.group_sizes`` that do divide it (or, when
      none does, per_channel); without the refusal the layer would silently get another
      granularity;
    * dynamic per-token activation scales on hardware that declares them
      (``activation_rules.granularities``): dal's fake quantizers have static scales only, so
      they are refused by layer instead of trained as something else. (Hardware that does not
      declare them refuses them in ``check_against_hardware``.)"""
    problems = []
    for step in plan:
        spec = step.spec
        if step.action not in QUANTIZING or spec is None:
            continue
        for role in ("input", "output"):
            t = getattr(spec, role, None)
            if t is not None and t.granularity == "per_token":
                problems.append(Problem(f"{step.path} ({step.type_name}): {role} per_token (dynamic per-token "
                                        f"scales), which {hw.name!r} declares, is not implemented by dal's fake "
                                        f"quantizers (static scales only); use granularity: per_tensor (rule "
                                        f"{spec.rule_source})"))
        w = spec.weight
        if w is None or w.granularity != "per_group" or not w.group_size or step.action == "functional":
            continue
        try:
            mod = model.get_submodule(step.path)
        except AttributeError:
            continue
        weight = getattr(mod, "weight", None)
        if not isinstance(weight, torch.Tensor):
            continue
        qat = QAT_MODULES.get(registry_type(type(mod)))
        axis = w.axis if w.axis is not None else getattr(qat, "weight_reduction_axis", 1)
        if not -weight.dim() <= axis < weight.dim():
            continue
        n = int(weight.shape[axis])
        if n % w.group_size == 0:
            continue
        fits = [g for g in hw.weight_rules.group_sizes if n % g == 0]
        what = "in_features" if isinstance(mod, nn.Linear) and axis in (1, -1) else f"weight axis {axis}"
        fix = (f"group sizes that divide {n} on {hw.name}: {', '.join(map(str, fits))}; put a rule "
               f"{{match: {step.path!r}, weight: {{format: {w.format.name}, granularity: per_group, "
               f"group_size: {fits[-1]}}}}} before it" if fits else
               f"no group size {hw.name} allows ({', '.join(map(str, hw.weight_rules.group_sizes)) or 'none'}) "
               f"divides {n}; put a rule {{match: {step.path!r}, weight: {{format: {w.format.name}, "
               f"granularity: per_channel}}}} before it")
        problems.append(Problem(f"{step.path} ({step.type_name}): {what} {n} is not divisible by the "
                                f"weight group_size {w.group_size} (rule {spec.rule_source}); {fix}"))
    return problems


def refuse_nothing_quantized(model, plan: list[Step], recipe) -> None:
    """A ValueError when ``plan`` quantizes nothing because ``model`` has no layer dal quantizes
    (no Linear, Conv, Embedding or other registered QAT class, no ``+ * @ cat`` in a forward fx
    traces), naming the model and what would work. Not refused: layers a QAT class exists for that
    the recipe leaves float, host ops and modules with parameters but no QAT class (those are
    listed in the report; ``strict=True`` refuses them)."""
    if any(s.action in QUANTIZING + ("ready-made", "fp16", "host") for s in plan):
        return
    if any(s.action == "float" and (s.float_op is None or s.float_op.op_class == "custom") for s in plan):
        return
    known = ", ".join(sorted(_QUANTIZABLE_NAMES()))
    raise ValueError(
        f"prepare_qat: recipe {recipe.name!r} quantizes nothing in {type(model).__name__}: it has no layer dal "
        f"quantizes (one of {known}, or + * @ cat in a forward torch.fx traces). What would work: a model with "
        f"such layers, or @dal.register_qat_module(YourLayer) on a QAT class for your own layer")


def _QUANTIZABLE_NAMES() -> set:
    return {getattr(t, "__name__", str(t)) for t in QAT_MODULES}


def runs_float(hw, op_class: str) -> bool:
    """Does ``hw`` run a float (unquantized) op of host op class ``op_class``? Only where it lists
    the class with fp16 among its input formats: a float tensor reaches the chip as fp16. The
    a2000's ``gather`` and ``scatter_add`` take integer codes only, so a float one stays on the host."""
    return hw.supports_op(op_class) and "fp16" in {f.name for f in hw.allowed_formats(op_class, "input")}


def on_host(step: Step, hw) -> Step:
    """A step of a host op class (op_classes.HOST_OP_CLASSES) that ``hw`` does not list under
    ``ops:``: action "host", the reason saying what it is and what becomes of it."""
    op = step.float_op
    return dataclasses.replace(step, action="host", reason=_join(step.reason, (
        f"{hw.name} has no {op.op_class} op ({op.function}): it runs on the host CPU, not the NPU; the exported "
        f"file still holds it and dal.npu, the NPU reference, cannot run it: compute it outside the model, or "
        f"replace it with ops {hw.name} runs")))


def refuse_host(plan, strict: bool) -> None:
    """``strict=True``: a ValueError naming every host step (path, op, source line)."""
    host = [s for s in plan if s.action == "host"]
    if strict and host:
        listing = "\n".join(f"  {s.path}: {s.type_name} ({s.op_class}); {s.reason}" for s in host)
        raise ValueError(f"prepare_qat(strict=True): {len(host)} op(s) the hardware cannot run:\n{listing}")


def _rmsnorm(step: Step) -> bool:
    return step.action == "float" and step.float_op is not None and step.float_op.function == "rmsnorm"


def _rmsnorm_verdict(step: Step, recipe, hw) -> tuple[Step, Problem | None]:
    """An RMSNorm (``dal.replace.rmsnorm``): an ``Fp16RMSNorm`` where ``hw`` runs layernorm in
    FP16, unless a ``skip: true`` rule keeps it in float32; elsewhere kept off the NPU by a skip
    or fp16-fallback rule (the recipe check notes it), or refused by path with the fix."""
    if "layernorm" in set(getattr(hw, "fp16_ops", ()) or ()):
        if _skip_rule(recipe, step):
            return dataclasses.replace(step, reason=_join(step.reason, "its recipe rule (skip) keeps it in float32, "
                                                          "off the NPU")), None
        return dataclasses.replace(step, action="fp16", built="Fp16RMSNorm", reason=_join(
            step.reason, f"runs in FP16 on {hw.name}'s {hw.op('layernorm').engine} engine (layernorm in fp16_ops): "
                         f"input, weight and output rounded to fp16")), None
    if _skipped(recipe, step):
        return dataclasses.replace(step, reason=_join(step.reason, f"kept off the NPU by its recipe rule (skip, or "
                                                      f"fp16 that {hw.name} lacks): {hw.name} has no FP16 engine")), None
    return step, Problem(f"{step.path} ({step.type_name}): an RMSNorm, which hardware {hw.name!r} cannot run (no "
                         f"FP16 engine: fp16_ops lists no layernorm, and no integer RMSNorm); fix: keep it off the "
                         f"NPU with a rule {{match: {step.path!r}, skip: true}} (or {{type: layernorm, fallback: "
                         f"fp16}}) before the others, or run on hardware with an FP16 vector engine")


def _fp16_norm(step: Step, hw) -> bool:
    """A GroupNorm / InstanceNorm2d module left in float, on hardware whose vector engine runs a
    normalisation in FP16 (``layernorm`` in ``fp16_ops``): prepare makes it an FP16 module."""
    return (step.action == "float" and step.site is None and step.type_name in _fp16_norm_names()
            and "layernorm" in set(getattr(hw, "fp16_ops", ()) or ()))


def _skipped(recipe, step: Step) -> bool:
    """A ``skip: true`` rule, or a ``fallback: fp16`` rule on hardware without FP16 for the op
    (the recipe check's note: it runs outside the NPU), matches the step: kept off the NPU."""
    op_class = step.op_class if step.op_class in OP_CLASS_ROLES else None  # "norm", "elementwise": by name
    index = recipe.match(step.path, step.type_name, op_class)
    return index is not None and (recipe.rules[index].skip or recipe.rules[index].fallback_fp16)


def _skip_rule(recipe, step: Step) -> bool:
    """A ``skip: true`` rule matches the step: the user keeps it off the NPU, in float32 (no island)."""
    op_class = step.op_class if step.op_class in OP_CLASS_ROLES else None  # "norm", "elementwise": by name
    index = recipe.match(step.path, step.type_name, op_class)
    return index is not None and bool(recipe.rules[index].skip)


def _join(a: str, b: str) -> str:
    return f"{a}; {b}" if a else b
