"""The plan against the hardware model, once: every offender listed in one error.

Two kinds of problem: a layer the recipe quantizes in a way the hardware does not allow
(``dal.recipe.check_against_hardware``), and an op the export will hold in float that the
hardware cannot run (``float_ops.hardware_verdict``) — refused by path with the fix, unless the
recipe rule matching that path says ``skip: true`` (the user accepts it running off the NPU).
"""
from __future__ import annotations

import dataclasses

from ..config.problems import Problem
from ..recipe import check_against_hardware
from ..recipe.errors import RecipeError
from ..nn.norm import FP16_NORMS
from ..hardware.op_classes import HOST_OP_CLASSES
from .float_ops import hardware_verdict
from .fp16_island import is_island
from .plan import Step

FP16_NORM_NAMES = {t.__name__: c.__name__ for t, c in FP16_NORMS.items()}
#: actions whose recipe spec the recipe check reads
QUANTIZING = ("quantize", "fuse", "functional")


def check_plan(plan: list[Step], recipe, hw) -> list[Step]:
    """Raise ``RecipeError`` listing every problem of ``plan`` on ``hw``; return the plan with
    each float step's reason saying how the hardware runs it (or that a skip rule keeps it)."""
    problems: list[Problem] = []
    layers = [(s.path, s.type_name, s.op_class) for s in plan if s.action in QUANTIZING]
    try:
        check_against_hardware(recipe, hw, layers)
    except RecipeError as err:
        problems += list(err.problems)
    checked = []
    for step in plan:
        if _fp16_norm(step, hw):
            checked.append(dataclasses.replace(step, action="fp16", built=FP16_NORM_NAMES[step.type_name], reason=_join(
                step.reason, f"runs in FP16 on {hw.name}'s vector engine (its FP16 layer norm; dal.nn.norm)")))
            continue
        if step.action == "float" and step.float_op is not None and step.float_op.op_class in HOST_OP_CLASSES \
                and not hw.supports_op(step.float_op.op_class):
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
            elif is_island(hw, step.float_op) and (step.site is not None or _skip_rule(recipe, step)):
                why = "its recipe rule (skip) keeps it" if step.site is None else "a call in a forward fx cannot trace:"
                step = dataclasses.replace(step, reason=_join(step.reason, f"{how}; {why} in float32, not an FP16 "
                                                              f"island (export/SPEC.md §5a)"))
            elif is_island(hw, step.float_op):
                built = f"Fp16Function({step.type_name})" if step.node else f"Fp16{step.type_name}"
                step = dataclasses.replace(step, action="fp16", built=built, reason=_join(
                    step.reason, f"{how}: an FP16 island, input and output rounded to fp16 ({hw.name}'s "
                    f"{hw.op(step.float_op.op_class).engine} engine has compute: fp16)"))
            else:
                step = dataclasses.replace(step, reason=_join(step.reason, how))
        checked.append(step)
    if problems:
        raise RecipeError(problems, what=f"recipe {recipe.name!r} for hardware {hw.name!r}")
    return checked


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


def _fp16_norm(step: Step, hw) -> bool:
    """A GroupNorm / InstanceNorm2d module left in float, on hardware whose vector engine runs a
    normalisation in FP16 (``layernorm`` in ``fp16_ops``): prepare makes it an FP16 module."""
    return (step.action == "float" and step.site is None and step.type_name in FP16_NORM_NAMES
            and "layernorm" in set(getattr(hw, "fp16_ops", ()) or ()))


def _skipped(recipe, step: Step) -> bool:
    """A ``skip: true`` rule, or a ``fallback: fp16`` rule on hardware without FP16 for the op
    (the recipe check's note: it runs outside the NPU), matches the step: kept off the NPU."""
    op_class = step.op_class if step.op_class not in ("norm", "custom", "passthrough") else None
    index = recipe.match(step.path, step.type_name, op_class)
    return index is not None and (recipe.rules[index].skip or recipe.rules[index].fallback_fp16)


def _skip_rule(recipe, step: Step) -> bool:
    """A ``skip: true`` rule matches the step: the user keeps it off the NPU, in float32 (no island)."""
    op_class = step.op_class if step.op_class not in ("norm", "custom", "passthrough") else None
    index = recipe.match(step.path, step.type_name, op_class)
    return index is not None and bool(recipe.rules[index].skip)


def _join(a: str, b: str) -> str:
    return f"{a}; {b}" if a else b
