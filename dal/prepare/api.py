"""prepare_qat: one call turns a float model into a QAT model for a recipe and a hardware model.

The flow is plan -> check -> apply (``plan.py``, ``check.py``, ``apply.py``): operator
replacement first (it brings the hardware's own operators), then one capture of every
module's own forward, one plan of (path, action, spec, reason) for every module and functional
op, one check of the whole plan against the hardware model (every offender in one error,
before anything but the replacement changed), and the plan carried out. The report is the plan.
"""
from __future__ import annotations

import copy
from typing import Optional

import torch
from torch import nn

from ..hardware.op_classes import OP_CLASSES as HW_OP_CLASSES
from ..nn.base import QATModule
from ..nn.modes import eval_mode
from ..nn.registry import float_type_name, op_class_of
from ..nn.spec import make_quantizer
from ..nn.tree import set_submodule
from ..quantizer import quantizer_states
from ..replace.hf_attention import attach_quantizers
from .apply import apply_plan
from .boundary import guard, host_steps, is_detector
from .check import check_plan, refuse_host, refuse_nothing_quantized
from .constraints import apply_constraints, check_constraints
from .handle import Prepared, attach
from .plan import build_plan, capture
from .report import LayerRow, PrepareReport, rows_from_plan
from .scales_only import freeze_all_but_quantizers
from .site_capture import capture_sites
from .sparsity_step import attach_sparsity


def prepare_qat(model: nn.Module, recipe="int8_balanced", hardware=None, example_inputs=None,
                inplace: bool = True, strict: bool = False, quantize_outputs: Optional[bool] = None) -> nn.Module:
    """Turn ``model`` into a QAT model: fuse, swap, quantize functional ops; return the model.

    Args:
        model: a float ``nn.Module``.
        recipe: bundled recipe name, YAML path, dict or ``dal.recipe.Recipe``.
        hardware: bundled hardware model name ("a2000"), path, dict or ``HardwareModel``; defaults
            to the recipe's ``hardware``. The plan is checked against it once: a layer asking for
            a format the hardware cannot run, or a float op it cannot run (a SiLU on an int8-only
            NPU, an unfolded BatchNorm, an LSTM), is refused with every offender listed, each with
            its fix (a replacement rule such as ``lut_activation``, or a ``skip: true`` rule that
            keeps it off the NPU on purpose).
        example_inputs: a tuple of example inputs; with them, QAT modules whose forward never
            runs go back to float, and the layers producing the model's outputs are found.
        quantize_outputs: those layers get output quantizers (None: the recipe's, default False:
            outputs feed the loss; README "When scales move"). The report's notes name them.
        inplace: modify ``model`` (default) or a deep copy.
        strict: raise for modules with parameters no QAT module handles and for ops the hardware
            has no engine for (report status "host": nonzero, integer compares, cumsum, ...).

    Forwards: with ``example_inputs``, prepare runs the model twice — once in float before any
    change (so bad inputs are named before anything is touched; the same forward finds the call
    sites of forwards fx cannot trace) and once after the swap with every quantizer off (to find
    the modules that never run and the output producers) — plus the forwards operator
    replacement makes to validate its swaps, and a detector's zero batch (below). Without them,
    none but that zero batch (``bench/prepare.py`` counts them).

    Forwards torch.fx cannot trace (FeaturePyramidNetwork, heads over a list of levels) have their
    ``+ * @ cat`` quantized and every other op listed by call site (``call_sites``: one example
    forward). A torchvision detector needs no example inputs: its NPU part (backbone + heads,
    ``boundary``) is captured on a zero batch at its input size, pre/post-processing stays float
    on the host, and ``detector(images, targets)`` arguments are checked (one-line errors).
    Normalisations no conv absorbs: a BatchNorm2d (timm's BatchNormAct2d: its BN, act kept) becomes
    a quantized per-channel affine (``dal.nn.QBatchNorm2d``), a GroupNorm / InstanceNorm2d an FP16
    module on hardware with an FP16 vector engine (refused by path on int8-only hardware).

    Returns the prepared model; ``dal.prepared(model)`` gives its recipe, hardware model and
    :class:`PrepareReport` (every module and functional op: quantized, fp16, passthrough, or
    float with the reason). When the root's own forward contains functional ops the returned
    object is a ``torch.fx.GraphModule`` sharing the same parameters (use the returned model).
    Quantizers start in the ``observe`` state: call ``dal.calibrate`` next.
    """
    from ..hardware import load_hardware
    from ..recipe import load_recipe

    if not isinstance(model, nn.Module):
        raise TypeError(f"prepare_qat needs an nn.Module, got {type(model).__name__}")
    rec = load_recipe(recipe)
    hw_name = hardware if hardware is not None else rec.hardware
    hw = load_hardware(hw_name) if hw_name is not None else None
    model = model if inplace else copy.deepcopy(model)
    example_inputs, checked = _inputs_checked_first(model, rec, example_inputs)
    report = PrepareReport(recipe=rec.name, hardware=getattr(hw, "name", str(hw_name)))
    model = _replace_operators(model, rec, hw, example_inputs, report)
    # position: first / last rules (the first conv, the classifier) become rules by name.
    rec = rec.bind_positions((n, float_type_name(m), c if (c := op_class_of(m)) in HW_OP_CLASSES else None)
                             for n, m in model.named_modules() if n)
    resolve = _resolver(rec)
    cap = capture(model)  # changes nothing (fx traces each forward; dal.nn.own_forward)
    site_plan, site_notes = _sites(model, cap, resolve, example_inputs, checked)
    plan = host_steps(model, build_plan(model, cap, resolve, site_plan))
    if hw is not None:
        plan = check_plan(plan, rec, hw, model)
        check_constraints(plan, rec, hw)
    _refuse_unknown(plan, strict, model, rec)
    model = apply_plan(model, plan, cap)
    report.rows = rows_from_plan(plan)
    report.notes += site_notes
    if is_detector(model):
        guard(model)  # detector(images, targets): a wrong format is named in one line
    if example_inputs is not None:
        _after_example_forward(model, example_inputs, resolve, report, rec.quantize_outputs
                               if quantize_outputs is None else bool(quantize_outputs))
    attach_sparsity(model, rec, hw, report)
    apply_constraints(model, hw, report)
    if rec.train == "scales_only":  # recipe key train: scales_only (dal/prepare/scales_only.py)
        freeze_all_but_quantizers(model)
    attach(model, Prepared(rec, hw, report, plan))
    return model


def _inputs_checked_first(model, rec, example_inputs) -> tuple:
    """``(example inputs as a tuple or None, checked)``: a recipe with ``replace:`` rules changes
    the model before the capture, so its inputs are checked by a float forward first; otherwise
    the check waits for :func:`_sites`, which may combine it with the call-site discovery."""
    if example_inputs is None:
        return None, True
    example_inputs = tuple(example_inputs) if isinstance(example_inputs, (list, tuple)) else (example_inputs,)
    if rec.replace or any(r.replace for r in rec.rules):
        _check_example_inputs(model, example_inputs)
        return example_inputs, True
    return example_inputs, False


def _sites(model, cap, resolve, example_inputs, checked: bool):
    """``capture_sites`` with at most one float forward on the example inputs before apply: the
    call-site discovery runs them only when some forward did not trace (``cap.untraced``), and then
    it is also the check of the inputs (on failure a plain float forward names them, nothing
    changed yet); otherwise, or for a detector (discovered on its own zero batch), the check is
    its own forward. So prepare with ``example_inputs`` makes two forwards of the model (this one
    and ``_after_example_forward``), plus a detector's zero batch and operator replacement's."""
    discover_on = example_inputs if cap.untraced else None
    if not checked and (discover_on is None or is_detector(model)):
        _check_example_inputs(model, example_inputs)
        checked = True
    try:
        return capture_sites(model, cap, resolve, discover_on)
    except Exception:
        if not checked:
            _check_example_inputs(model, example_inputs)  # raises naming the inputs if they are at fault
        raise


def _resolver(rec):
    """``(path, type_name, op_class) -> LayerSpec | None``; an op class the hardware schema does
    not know (a user-registered module's "custom") is matched by name and type only."""
    def resolve(name: str, type_name: str, op_class: str):
        return rec.resolve(name, type_name, op_class if op_class in HW_OP_CLASSES else None)
    return resolve


def _refuse_unknown(plan, strict: bool, model, rec) -> None:
    refuse_nothing_quantized(model, plan, rec)  # a model with no layer dal quantizes (check.py)
    refuse_host(plan, strict)  # ops of a class the hardware has no engine for (check.py)
    unknown = [s for s in plan if s.action == "float" and s.float_op is not None and s.float_op.op_class == "custom"]
    if strict and unknown:
        listing = "\n".join(f"  {s.path}: {s.type_name} -> @dal.register_qat_module({s.type_name}) on a QAT class"
                             for s in unknown)
        raise ValueError(f"prepare_qat(strict=True): {len(unknown)} module(s) have parameters and no QAT "
                         f"module:\n{listing}")


def _after_example_forward(model: nn.Module, example_inputs: tuple, resolve, report: PrepareReport,
                           quantize_outputs: bool) -> None:
    """One forward with every quantizer off (no observer counts the example, often zeros, as a
    calibration batch, and nothing all-reduces under DDP): QAT modules that never run go back
    to float (their weights are used functionally elsewhere). The QAT layers whose results are
    the model's outputs get an output quantizer only when the recipe says ``quantize_outputs:
    true`` (exported outputs are then integers); by default those outputs stay float, because
    they feed the loss, and the report's notes name them either way."""
    called, produced = set(), {}
    hooks = []
    for name, mod in model.named_modules():
        if isinstance(mod, QATModule):
            hooks.append(mod.register_forward_pre_hook(lambda m, i: called.add(id(m))))
            hooks.append(mod.register_forward_hook(
                lambda m, i, o, name=name: produced.__setitem__(id(o), (name, m)) if torch.is_tensor(o) else None))
    try:
        with quantizer_states(model, "off"), eval_mode(model), torch.no_grad():
            out = model(*example_inputs)
    finally:
        for h in hooks:
            h.remove()
    rows = {r.name: i for i, r in enumerate(report.rows)}
    for name, mod in list(model.named_modules()):
        if name and isinstance(mod, QATModule) and mod.swappable and id(mod) not in called:
            set_submodule(model, name, mod.to_float())
            reason = "its forward never runs on the example inputs (weights used functionally); left in float"
            if name in rows:
                old = report.rows[rows[name]]
                report.rows[rows[name]] = LayerRow(old.name, old.type_name, old.op_class, "float", reason)
    outs = [out] if torch.is_tensor(out) else [o for o in (out if isinstance(out, (list, tuple)) else [])
                                                if torch.is_tensor(o)]
    names = []
    for o in outs:
        if id(o) not in produced:
            continue
        name, mod = produced[id(o)]
        spec = resolve(name, float_type_name(mod), op_class_of(mod))
        if getattr(mod, "output_quant", None) is None and hasattr(mod, "output_quant") and spec is not None \
                and spec.input is not None and not spec.fallback_fp16:
            if quantize_outputs:
                mod.output_quant = make_quantizer(spec.input, None, f"{name}.output_quant")
            names.append(name)
    if names and quantize_outputs:
        report.notes.append(f"output quantizer added to {', '.join(names)} (model outputs; recipe "
                            "quantize_outputs: true)")
    elif names:
        report.notes.append(f"model outputs left in float: {', '.join(names)} (they feed the loss; recipe "
                            "quantize_outputs: true quantizes them)")


def _check_example_inputs(model: nn.Module, example_inputs: tuple) -> None:
    """One float forward before anything changes: example inputs the model cannot take are named
    here, not as an error deep inside a half-prepared model."""
    try:
        with eval_mode(model), torch.no_grad():
            model(*example_inputs)
    except Exception as err:
        shapes = [tuple(t.shape) if torch.is_tensor(t) else type(t).__name__ for t in example_inputs]
        raise ValueError(f"prepare_qat: the float model fails on example_inputs {shapes} (nothing was changed): "
                         f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}") from err


def _replace_operators(model, rec, hw, example_inputs, report):
    """Operator auto-replacement before fusing and swapping, so the hardware's own operators are
    what gets quantized and trained: the recipe's top-level ``replace:`` list over the whole
    model, then each rule name that only recipe rules list (``rules[i].replace``), offered only
    the modules whose first matching recipe rule lists it (first match decides, as for specs)."""
    everywhere = list(getattr(rec, "replace", ()) or ())
    owners: dict[str, set] = {}
    for i, recipe_rule in enumerate(getattr(rec, "rules", ())):
        for name in recipe_rule.replace:
            if name not in everywhere:
                owners.setdefault(name, set()).add(i)
    if not everywhere and not owners:
        return model
    from ..replace import auto_replace

    def scoped(indices):
        def where(path, mod):
            op_class = op_class_of(mod)  # "custom" (a container, an attention block): type and path only
            return rec.match(path, float_type_name(mod), None if op_class == "custom" else op_class) in indices
        return where

    ex = example_inputs if example_inputs is None or isinstance(example_inputs, tuple) else (example_inputs,)
    result = auto_replace(model, rules=everywhere + list(owners), hardware=hw, example_inputs=ex,
                          scope={name: scoped(frozenset(idx)) for name, idx in owners.items()})
    report.replacements = result
    report.notes.append(f"operator replacement: {result.summary()}")
    model = getattr(result, "model", model)
    report.notes += attach_quantizers(model, rec, hw)  # the KV caches npu_attention built (dal.replace.hf_attention)
    return model
