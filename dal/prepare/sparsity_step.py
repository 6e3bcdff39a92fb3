"""prepare's last step: N:M sparsity masks on the QAT layers whose recipe rule asks for them."""
from __future__ import annotations

from ..hardware.op_classes import OP_CLASSES as HW_OP_CLASSES
from ..nn.base import QATModule
from ..nn.registry import float_type_name, op_class_of


def _recipe_op_class(mod):
    op_class = op_class_of(mod)
    return op_class if op_class in HW_OP_CLASSES else None


def attach_sparsity(model, rec, hw, report) -> None:
    """N:M masks on the QAT layers whose recipe rule says ``sparsity: "2:4"`` (dal.sparsity).

    Runs after the swap, so each mask is a ``weight_mask`` buffer of the QAT module, multiplied
    into the weight before the weight fake quantizer: quantized weights are exactly N:M (a
    symmetric quantizer maps 0 to code 0). Masks are computed here, from the float weights,
    with the recipe's ``sparsity_schedule`` when it has one, else one-shot (fixed from now on).
    Layers that cannot be sparse (reduction length not a multiple of M, depthwise, refused by
    the hardware) stay dense: their report row says why, and a note lists them; not an error.
    A model already given masks by ``dal.sparsity.prepare_sparse`` before ``prepare_qat`` keeps
    them (the swap carries the buffers and hooks over). The user's loop steps the schedule with
    ``dal.sparsity.controller_of(model).step()`` after ``optimizer.step()``, or
    ``controller_of(model).attach(optimizer, auto_step=True)``.
    """
    import dataclasses

    from ..sparsity import controller_of, prepare_sparse
    from ..sparsity.controller import find_controller

    asked = {}  # QAT module name -> pattern its recipe rule asks for
    for name, mod in model.named_modules():
        if isinstance(mod, QATModule):
            pattern = getattr(rec.resolve(name, float_type_name(mod), _recipe_op_class(mod)), "sparsity", None)
            if pattern:
                asked[name] = str(pattern)
    pre_sparse = find_controller(model) is not None  # moves it to a new (fx) root if needed
    if not asked and not pre_sparse:
        return
    if pre_sparse:
        ctl = controller_of(model)
        report.notes.append(f"{ctl.pattern} sparsity set up by dal.sparsity.prepare_sparse before "
                            f"prepare_qat is kept ({len(ctl.layers)} sparse layer(s)); the recipe's "
                            "sparsity rules are not applied again")
    else:
        patterns = sorted(set(asked.values()))
        if len(patterns) > 1:
            by = {p: [n for n, q in asked.items() if q == p] for p in patterns}
            raise ValueError("prepare_qat: a model takes one N:M pattern, the recipe asks for "
                             + "; ".join(f"{p} on {', '.join(ns)}" for p, ns in by.items())
                             + ": make every sparsity rule of the recipe use the same pattern")
        prepare_sparse(model, pattern=patterns[0], layers=lambda name, mod: name in asked,
                       schedule=_recipe_schedule(rec), hardware=hw)
        ctl = controller_of(model)
        for name in list(ctl.skipped):
            if name not in asked:  # the recipe never asked: say so, not "filtered out"
                ctl.skipped[name] = "its recipe rule asks for no sparsity"
    pattern = str(ctl.pattern)
    dense = {n: ctl.skipped.get(n, "not made sparse") for n in asked if n not in ctl.layers}
    for i, row in enumerate(report.rows):
        if row.name in dense:
            detail = row.detail.replace(f"sparse={asked[row.name]}", "").rstrip()
            report.rows[i] = dataclasses.replace(
                row, detail=f"{detail} dense ({pattern} not possible: {dense[row.name]})".strip())
    by_reason: "dict[str, list[str]]" = {}
    for name, reason in dense.items():
        by_reason.setdefault(reason, []).append(name)
    left = "; ".join(f"{', '.join(ns)} ({r})" for r, ns in by_reason.items())
    if not pre_sparse:
        report.notes.append(
            f"{pattern} sparsity, schedule {ctl.schedule!r}: {len(ctl.layers)} of {len(asked)} "
            f"layer(s) the recipe asks for are sparse" + (f"; left dense: {left}" if left else ""))
    if ctl.layers:
        report.notes.append("sparsity: call dal.sparsity.controller_of(model).step() after each "
                            "optimizer.step() (a one-shot mask never changes; pruned weights stay "
                            "0 either way); per-layer table: dal.sparsity.report(model)")


def _recipe_schedule(rec):
    """The recipe's ``sparsity_schedule`` as a schedule object; a bad one names file and line."""
    from ..sparsity.schedule import resolve_schedule

    try:
        return resolve_schedule(rec.schedule_data())
    except ValueError as err:
        where = rec.sparsity_schedule_at or rec.source or f"<recipe {rec.name}>"
        raise ValueError(f"{where}: sparsity_schedule: {err}") from None
