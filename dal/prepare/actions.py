"""The plan's model-wide actions: decided before apply with the steps, carried out by apply, and
rendered into the report with them.

The steps (``plan.Step``) say what each module and op becomes. :class:`ModelActions` holds what
acts on the model as a whole, each decided from the recipe, the hardware model, the checked
steps and the float example forward (``example_run``), never from the prepared model:

* ``outputs`` — the model-output producers; with ``quantize_outputs: true`` an output quantizer
  each (built from the layer's input spec), else a note naming them;
* ``to_float`` — QAT modules already in the model (operator replacement's) that never run on the
  example inputs: given back as float;
* ``sparsity`` — N:M masks on the layers whose recipe rule asks (``dal.sparsity``), with the
  layers that stay dense and why, found on the float modules (``dense_reason``);
* ``shared_scale`` — the op classes the hardware runs without requantizing (``shared_scale.py``)
  and the paths that become one-quantizer groups;
* ``power_of_two`` — the quantizer roles whose scales the hardware keeps 2^k (``constraints.py``);
* ``scales_only`` — recipe ``train: scales_only``: everything but the quantizers frozen;
* ``guard`` — a torchvision detector's ``detector(images, targets)`` arguments checked per call.

:func:`carry_out` runs them in that order, as the last part of ``apply_plan``; nothing is
installed on the model after apply.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Optional

from torch import nn

from ..nn.base import QATModule
from ..nn.registry import float_type_name, op_class_of
from ..nn.spec import make_quantizer, role_specs
from ..nn.tree import set_submodule
from .boundary import guard, is_detector
from .constraints import constrain_power_of_two, power_of_two_roles
from .example_run import Outputs
from .scales_only import freeze_all_but_quantizers
from .shared_scale import share_scales


@dataclass(frozen=True)
class SparsityPlan:
    """``pattern`` for the ``layers`` the recipe asks (path -> pattern asked), ``dense`` (path ->
    why it stays dense), the recipe's ``schedule``; ``kept``: the model already had masks from
    ``dal.sparsity.prepare_sparse`` (they stay, the recipe's rules are not applied again)."""

    pattern: str
    layers: tuple = ()
    dense: tuple = ()
    schedule: object = None
    hardware: object = None
    kept: bool = False
    kept_count: int = 0


@dataclass(frozen=True)
class ModelActions:
    """What prepare does to the model as a whole (module doc)."""

    hardware: str = ""
    outputs: Outputs = field(default_factory=Outputs)
    to_float: tuple = ()
    sparsity: Optional[SparsityPlan] = None
    shared_scale: tuple = ()        # op classes
    shared_groups: tuple = ()       # paths of the ops that become groups
    power_of_two: tuple = ()        # roles: "weight", "input"
    scales_only: bool = False
    guard: bool = False


def plan_actions(model: nn.Module, plan: list, rec, hw, resolve, outputs: Outputs, to_float: tuple) -> ModelActions:
    """The model-wide actions for the checked, final ``plan`` of ``model`` (still float)."""
    wanted = tuple(getattr(hw, "shared_scale", None) or ()) if hw is not None else ()
    return ModelActions(
        hardware=getattr(hw, "name", ""), outputs=outputs, to_float=to_float,
        sparsity=_plan_sparsity(model, plan, rec, hw, resolve, set(to_float)),
        shared_scale=wanted, shared_groups=_shared_groups(model, plan, set(wanted), set(to_float)),
        power_of_two=power_of_two_roles(hw) if hw is not None else (),
        scales_only=rec.train == "scales_only", guard=is_detector(model))


def carry_out(model: nn.Module, actions: ModelActions) -> None:
    """Apply ``actions`` to the swapped ``model`` (the last part of ``apply_plan``)."""
    for path, spec in actions.outputs.specs:
        mod = model.get_submodule(path)
        if getattr(mod, "output_quant", None) is None and hasattr(mod, "output_quant"):
            mod.output_quant = make_quantizer(spec, None, f"{path}.output_quant")
    for path in actions.to_float:
        try:
            mod = model.get_submodule(path)
        except AttributeError:  # a rewritten parent (GraphModule) no longer holds what it never called
            continue
        set_submodule(model, path, mod.to_float())
    if actions.sparsity is not None:
        _sparsify(model, actions.sparsity)
    if actions.shared_scale:
        share_scales(model, actions.shared_scale)
    if actions.power_of_two:
        constrain_power_of_two(model, actions.power_of_two)
    if actions.scales_only:  # recipe key train: scales_only (dal/prepare/scales_only.py)
        freeze_all_but_quantizers(model)
    if actions.guard:
        guard(model)  # detector(images, targets): a wrong format is named in one line


def render(rows: list, actions: ModelActions) -> tuple[list, list[str]]:
    """``(rows, notes)``: the plan's rows with each dense layer's detail saying why, and one note
    per action, in the order :func:`carry_out` runs them."""
    notes = []
    out = actions.outputs
    if out.paths and out.quantize:
        notes.append(f"output quantizer added to {', '.join(out.paths)} (model outputs; recipe "
                     "quantize_outputs: true)")
    elif out.paths:
        notes.append(f"model outputs left in float: {', '.join(out.paths)} (they feed the loss; recipe "
                     "quantize_outputs: true quantizes them)")
    sp = actions.sparsity
    if sp is not None:
        rows, more = _sparsity_rendered(rows, sp)
        notes += more
    if actions.shared_groups:
        notes.append(f"shared-scale groups (one scale and zero point for inputs and output, the "
                     f"hardware does not requantize them): {', '.join(actions.shared_groups)}")
    if actions.power_of_two:
        what = " and ".join({"weight": "weight", "input": "activation"}[r] for r in actions.power_of_two)
        notes.append(f"power-of-two scales ({actions.hardware!r}): every {what} quantizer keeps every scale 2^k")
    if actions.scales_only:
        notes.append("train: scales_only: every weight, bias and BatchNorm statistic is frozen; only the "
                     "quantizers' parameters train")
    if actions.guard:
        notes.append("detector(images, targets): the arguments of every call are checked (one-line errors, "
                     "dal.prepare.boundary.guard)")
    return rows, notes


def _plan_sparsity(model, plan, rec, hw, resolve, gone: set) -> Optional[SparsityPlan]:
    from ..sparsity.controller import find_controller
    from ..sparsity.layout import SPARSE_TYPES
    from ..sparsity.pattern import parse_pattern
    from ..sparsity.prepare import dense_reason

    asked = {}  # module path -> the pattern its recipe rule asks for, in module order
    modules = dict(model.named_modules())
    for s in plan:
        if s.action in ("quantize", "fuse", "functional", "fp16") and getattr(s.spec, "sparsity", None):
            asked[s.path] = str(s.spec.sparsity)
    for path, mod in modules.items():  # QAT modules already in the model (operator replacement's)
        if path and isinstance(mod, QATModule) and path not in gone and path not in asked:
            pattern = getattr(resolve(path, float_type_name(mod), op_class_of(mod)), "sparsity", None)
            if pattern:
                asked[path] = str(pattern)
    order = {p: i for i, p in enumerate(modules)}
    asked = dict(sorted(asked.items(), key=lambda kv: order.get(kv[0], len(order))))
    ctl = find_controller(model)
    if not asked and ctl is None:
        return None
    if ctl is not None:
        dense = tuple((n, ctl.skipped.get(n, "not made sparse")) for n in asked if n not in ctl.layers)
        return SparsityPlan(str(ctl.pattern), tuple(asked.items()), dense, kept=True, kept_count=len(ctl.layers))
    patterns = sorted(set(asked.values()))
    if len(patterns) > 1:
        by = {p: [n for n, q in asked.items() if q == p] for p in patterns}
        raise ValueError("prepare_qat: a model takes one N:M pattern, the recipe asks for "
                         + "; ".join(f"{p} on {', '.join(ns)}" for p, ns in by.items())
                         + ": make every sparsity rule of the recipe use the same pattern")
    pat = parse_pattern(patterns[0])
    dense = []
    for path in asked:
        mod = modules.get(path)
        why = dense_reason(mod, pat.m, hw, str(pat)) if isinstance(mod, SPARSE_TYPES) else "not made sparse"
        if why is not None:
            dense.append((path, why))
    return SparsityPlan(str(pat), tuple(asked.items()), tuple(dense), _recipe_schedule(rec), hw)


def _sparsify(model: nn.Module, sp: SparsityPlan) -> None:
    from ..sparsity import controller_of, prepare_sparse
    from ..sparsity.controller import find_controller

    if sp.kept:
        find_controller(model)  # moves it to a new (fx) root if apply made one
        return
    asked = dict(sp.layers)
    prepare_sparse(model, pattern=sp.pattern, layers=lambda name, mod: name in asked, schedule=sp.schedule,
                   hardware=sp.hardware)
    ctl = controller_of(model)
    for name in list(ctl.skipped):
        if name not in asked:  # the recipe never asked: say so, not "filtered out"
            ctl.skipped[name] = "its recipe rule asks for no sparsity"


def _sparsity_rendered(rows: list, sp: SparsityPlan) -> tuple[list, list[str]]:
    asked, dense = dict(sp.layers), dict(sp.dense)
    rows = [dataclasses.replace(r, detail=f"{r.detail.replace(f'sparse={asked[r.name]}', '').rstrip()} dense "
                                f"({sp.pattern} not possible: {dense[r.name]})".strip())
            if r.name in dense else r for r in rows]
    notes = []
    if sp.kept:
        notes.append(f"{sp.pattern} sparsity set up by dal.sparsity.prepare_sparse before prepare_qat is kept "
                     f"({sp.kept_count} sparse layer(s)); the recipe's sparsity rules are not applied again")
        sparse = sp.kept_count
    else:
        by_reason: dict = {}
        for name, reason in dense.items():
            by_reason.setdefault(reason, []).append(name)
        left = "; ".join(f"{', '.join(ns)} ({r})" for r, ns in by_reason.items())
        sparse = len(asked) - len(dense)
        notes.append(f"{sp.pattern} sparsity, schedule {sp.schedule!r}: {sparse} of {len(asked)} "
                     f"layer(s) the recipe asks for are sparse" + (f"; left dense: {left}" if left else ""))
    if sparse:
        notes.append("sparsity: call dal.sparsity.controller_of(model).step() after each "
                     "optimizer.step() (a one-shot mask never changes; pruned weights stay "
                     "0 either way); per-layer table: dal.sparsity.report(model)")
    return rows, notes


def _recipe_schedule(rec):
    """The recipe's ``sparsity_schedule`` as a schedule object; a bad one names file and line."""
    from ..sparsity.schedule import resolve_schedule

    try:
        return resolve_schedule(rec.schedule_data())
    except ValueError as err:
        where = rec.sparsity_schedule_at or rec.source or f"<recipe {rec.name}>"
        raise ValueError(f"{where}: sparsity_schedule: {err}") from None


def _shared_groups(model, plan, wanted: set, gone: set) -> tuple:
    """Paths of the functional ops (planned, or already QAT modules) of a shared-scale op class
    with a scaled quantizer: the groups ``share_scales`` makes."""
    if not wanted:
        return ()
    paths = []
    for s in plan:
        if s.action == "functional" and s.op_class in wanted:
            in_spec, _, out_spec = role_specs(s.spec)
            if any(t is not None and t.format.is_scaled for t in (in_spec, out_spec)):
                paths.append(s.path)
    for path, mod in model.named_modules():
        if path and path not in gone and isinstance(mod, QATModule) and getattr(mod, "op_class", None) in wanted \
                and isinstance(getattr(mod, "input_quants", None), nn.ModuleList) and any(
                    q is not None and q.fmt.is_scaled for q in (*mod.input_quants, mod.output_quant)):
            paths.append(path)
    return tuple(paths)

