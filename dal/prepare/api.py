"""prepare_qat: one call turns a float model into a QAT model for a recipe and a hardware model.

The flow is plan -> check -> apply (``plan.py``, ``check.py``, ``apply.py``): operator
replacement first (it brings the hardware's own operators), then one capture of every
module's own forward (and, with example inputs, one recorded float forward, ``example_run``),
one plan of (path, action, spec, reason) for every module and functional op, one check of the
whole plan against the hardware model (every offender in one error, before anything but the
replacement changed), the plan's model-wide actions decided (``actions.py``: output quantizers,
sparsity, shared-scale groups, power-of-two scales, scales-only freezing, the detector guard),
and the plan carried out. Nothing is installed after apply; the report is rendered from the
plan (the accumulator and channel-alignment checks of the result add notes).
"""
from __future__ import annotations

import contextlib
import copy
from typing import Optional

import torch
from torch import nn

from ..capture import Record, recording
from ..hardware.op_classes import OP_CLASSES as HW_OP_CLASSES
from ..nn.modes import eval_mode
from ..nn.registry import float_type_name, op_class_of
from ..quantizer import quantizer_states
from ..replace.hf_attention import attach_quantizers
from .actions import plan_actions, render
from .apply import apply_plan
from .boundary import host_steps, is_detector
from .check import check_plan, refuse_host, refuse_nothing_quantized
from .constraints import check_constraints, constraint_notes
from .example_run import decide, site_result
from .handle import Prepared, attach
from .plan import build_plan, capture
from .report import PrepareReport, rows_from_plan
from .site_capture import capture_sites


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
        example_inputs: a tuple of example inputs; with them, modules whose forward never runs
            stay float, and the layers producing the model's outputs are found.
        quantize_outputs: those layers get output quantizers (None: the recipe's, default False:
            outputs feed the loss; README "When scales move"). The report's notes name them.
        inplace: modify ``model`` (default) or a deep copy.
        strict: raise for modules with parameters no QAT module handles and for ops the hardware
            has no engine for (report status "host": nonzero, integer compares, cumsum, ...).

    Forwards: with ``example_inputs``, prepare runs the float model once, before anything is
    swapped (eval, quantizers off, no grad), recorded by ``dal.capture``: bad inputs are named
    before anything is touched; the same forward finds the call sites of forwards fx cannot
    trace, and records (``example_run``) the modules that never run (they stay float: their
    weights are used functionally elsewhere) and the layers producing the outputs. Operator
    replacement validates its swaps with two forwards (before and after); the second is that
    record, so a ``replace:`` recipe makes two, three when a forward does not trace. A detector
    adds its zero batch (below). Without example inputs, none but that zero batch
    (``bench/prepare.py`` counts them).

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
    model, example_inputs = model if inplace else copy.deepcopy(model), _as_tuple(example_inputs)
    report = PrepareReport(recipe=rec.name, hardware=getattr(hw, "name", str(hw_name)))
    run = Record() if example_inputs is not None else None  # the float forward's (dal.capture)
    model, checked = _replace_operators(model, rec, hw, example_inputs, report, run)
    # position: first / last rules (the first conv, the classifier) become rules by name.
    rec = rec.bind_positions((n, float_type_name(m), c if (c := op_class_of(m)) in HW_OP_CLASSES else None)
                             for n, m in model.named_modules() if n)
    resolve = _resolver(rec)
    cap = capture(model)  # changes nothing (fx traces each forward; dal.nn.own_forward)
    site_plan, site_notes = _sites(model, cap, resolve, example_inputs, checked, run)
    plan = host_steps(model, build_plan(model, cap, resolve, site_plan))
    if hw is not None:
        plan = check_plan(plan, rec, hw, model)
        check_constraints(plan, rec, hw)
    _refuse_unknown(plan, strict, model, rec)
    # the float forward's verdicts (modules that never run, output producers) and the model-wide
    # actions: the last decisions, all before anything is swapped
    plan, to_float, outputs = decide(plan, model, cap, run, resolve, rec.quantize_outputs
                                     if quantize_outputs is None else bool(quantize_outputs))
    actions = plan_actions(model, plan, rec, hw, resolve, outputs, to_float)
    model = apply_plan(model, plan, cap, actions)
    report.rows, notes = render(rows_from_plan(plan), actions)
    report.notes += site_notes + notes
    constraint_notes(model, hw, report)  # read-only checks of the result (accumulators, alignment)
    attach(model, Prepared(rec, hw, report, plan, actions, run.entries() if run is not None else ()))
    return model


def _as_tuple(example_inputs) -> Optional[tuple]:
    if example_inputs is None:
        return None
    return tuple(example_inputs) if isinstance(example_inputs, (list, tuple)) else (example_inputs,)


def _sites(model, cap, resolve, example_inputs, checked: bool, run: Optional[Record]):
    """``capture_sites`` with one float forward on the example inputs before apply, recorded into
    ``run`` (``example_run``: which modules run, which produce the outputs). The call-site
    discovery runs the example inputs only when some forward did not trace (``cap.untraced``),
    and then it is also the check of the inputs and the record (on failure a plain float forward
    names the inputs, nothing changed yet); otherwise, or for a detector (discovered on its own
    zero batch), the check is that forward, unless operator replacement's forward on the replaced
    model already filled ``run``. So prepare with ``example_inputs`` makes one forward of the
    model, plus a detector's zero batch; with ``replace:`` rules, replacement's two (before and
    after its swaps; the second is the record), and a third when a forward does not trace (the
    call-site discovery needs the replaced model captured first)."""
    discover_on = example_inputs if cap.untraced else None
    on_example = discover_on is not None and not is_detector(model)  # the discovery runs the example inputs
    if on_example and run.ran:
        run.take(Record())  # operator replacement's forward is recorded again by the discovery's
    if example_inputs is not None and not on_example and not run.ran:
        _check_example_inputs(model, example_inputs, run, changed=checked)
        checked = True
    try:
        with _recording(model, run if on_example else None):
            return capture_sites(model, cap, resolve, discover_on, site_result(run) if on_example else None)
    except Exception:
        if not checked:
            _check_example_inputs(model, example_inputs)  # raises naming the inputs if they are at fault
        raise


def _recording(model: nn.Module, run: Optional[Record]):
    """``dal.capture.recording`` into ``run`` (module and function calls, no call sites: reading
    each call's frames makes a detector's prepare ~20% slower), or nothing when ``run`` is None."""
    return contextlib.nullcontext() if run is None else recording(model, into=run)


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


def _check_example_inputs(model: nn.Module, example_inputs: tuple, run: Optional[Record] = None,
                          changed: bool = False) -> None:
    """One float forward (eval, quantizers off, no grad) before anything is swapped, recorded
    into ``run``: example inputs the model cannot take are named here, not as an error deep
    inside a half-prepared model. ``changed``: operator replacement already changed the model."""
    try:
        with _recording(model, run), eval_mode(model), quantizer_states(model, "off"), torch.no_grad():
            model(*example_inputs)
    except Exception as err:
        shapes = [tuple(t.shape) if torch.is_tensor(t) else type(t).__name__ for t in example_inputs]
        state = "after operator replacement" if changed else "nothing was changed"
        raise ValueError(f"prepare_qat: the float model fails on example_inputs {shapes} ({state}): "
                         f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}") from err


def _replace_operators(model, rec, hw, example_inputs, report, run: Optional[Record]) -> tuple:
    """``(model, checked)``: operator auto-replacement before fusing and swapping, so the
    hardware's own operators are what gets quantized and trained: the recipe's top-level
    ``replace:`` list over the whole model, then each rule name that only recipe rules list
    (``rules[i].replace``), offered only the modules whose first matching recipe rule lists it
    (first match decides, as for specs). Its forward on the replaced model (the swaps' check) is
    recorded into ``run``, prepare's float forward: ``checked`` says it ran. Example inputs the
    float model cannot take are named as prepare names them (a plain forward, on failure only)."""
    everywhere = list(getattr(rec, "replace", ()) or ())
    owners: dict[str, set] = {}
    for i, recipe_rule in enumerate(getattr(rec, "rules", ())):
        for name in recipe_rule.replace:
            if name not in everywhere:
                owners.setdefault(name, set()).add(i)
    if not everywhere and not owners:
        return model, False
    from ..replace import auto_replace

    def scoped(indices):
        def where(path, mod):
            op_class = op_class_of(mod)  # "custom" (a container, an attention block): type and path only
            return rec.match(path, float_type_name(mod), None if op_class == "custom" else op_class) in indices
        return where

    try:
        result = auto_replace(model, rules=everywhere + list(owners), hardware=hw, example_inputs=example_inputs,
                              scope={name: scoped(frozenset(idx)) for name, idx in owners.items()}, record=run)
    except Exception:
        if example_inputs is not None:
            _check_example_inputs(model, example_inputs)  # raises naming the inputs if they are at fault
        raise
    report.replacements = result
    report.notes.append(f"operator replacement: {result.summary()}")
    model = getattr(result, "model", model)
    report.notes += attach_quantizers(model, rec, hw)  # the KV caches npu_attention built (dal.replace.hf_attention)
    return model, run is not None and run.ran
