"""prepare_qat: one call turns a float model into a QAT model for a recipe and a hardware model."""
from __future__ import annotations

import copy
from typing import Optional

import torch
from torch import nn

from ..nn import QAdd, QCat, QConvBn2d, QConvBnReLU2d, QMatMul, QMul
from ..nn.registry import OP_CLASSES, QAT_MODULES, float_type_name, op_class_of
from ..nn.modes import eval_mode
from ..nn.own_forward import find_conv_bn, needs_tracing, trace_own_forward
from .own_forward import cat_dim, functional_kind, rebuild, replace_module_in_parent
from .report import PrepareReport

_FUNCTIONAL = {"add": QAdd, "mul": QMul, "matmul": QMatMul, "cat": QCat}


def _describe(spec) -> str:
    if spec is None:
        return ""
    if getattr(spec, "fallback_fp16", False):
        return "fp16"
    parts = []
    for role in ("input", "weight", "output"):
        t = getattr(spec, role, None)
        if t is not None:
            fmt = getattr(t.format, "name", t.format)
            parts.append(f"{role[0]}={fmt}/{t.granularity}")
    if getattr(spec, "sparsity", None):
        parts.append(f"sparse={spec.sparsity}")
    return " ".join(parts)


class _Resolver:
    """Recipe lookup with the hardware check, one place for prepare's decisions."""

    def __init__(self, recipe, hardware):
        self.recipe, self.hardware = recipe, hardware

    def __call__(self, name: str, type_name: str, op_class: str):
        from ..hardware.op_classes import OP_CLASSES as HW_OP_CLASSES

        # A user-registered module of no hardware op class is matched by name and type only.
        return self.recipe.resolve(name, type_name, op_class if op_class in HW_OP_CLASSES else None)


def _fp16_spec(spec):
    """A fallback layer: every tensor becomes an FP16 cast round trip."""
    from ..nn.spec import SimpleLayerSpec, SimpleTensorSpec

    t = SimpleTensorSpec("fp16")
    return SimpleLayerSpec(weight=t, input=t, output=None, fallback_fp16=True)


def _effective(spec):
    if spec is not None and getattr(spec, "fallback_fp16", False):
        return _fp16_spec(spec)
    return spec


def _candidates(model: nn.Module) -> list[tuple[str, str, str]]:
    """(name, type, op_class) of every layer prepare would quantize: for the hardware check."""
    layers = []
    for name, mod in model.named_modules():
        if type(mod) in QAT_MODULES:
            layers.append((name, type(mod).__name__, OP_CLASSES[type(mod)]))
        if needs_tracing(mod):
            try:
                graph = trace_own_forward(mod)
            except Exception:  # noqa: BLE001 - reported later, in the apply phase
                continue
            for node in graph.nodes:
                kind = functional_kind(node)
                if kind:
                    layers.append((f"{name}.{node.name}" if name else node.name, kind, kind))
    return layers


def _rewrite_module(root, path, mod, resolve, report) -> nn.Module:
    """Fuse Conv+BN(+ReLU) and quantize functional ops in ``mod``'s own forward."""
    try:
        graph = trace_own_forward(mod)
    except Exception as err:  # noqa: BLE001 - any tracing failure means "leave this forward as is"
        msg = str(err).splitlines()[0][:160] if str(err) else type(err).__name__
        report.notes.append(f"{path or '<root>'} ({type(mod).__name__}): forward does not trace with torch.fx "
                            f"({msg}); its submodules are still swapped, functional ops in it stay float")
        return mod
    changed = False
    prefix = f"{path}." if path else ""
    for pat in find_conv_bn(graph, mod):
        name = prefix + pat.conv
        spec = _effective(resolve(name, "Conv2d", "conv"))
        if spec is None:
            continue
        conv, bn = mod.get_submodule(pat.conv), mod.get_submodule(pat.bn)
        cls = QConvBnReLU2d if pat.relu_node is not None else QConvBn2d
        fused = cls.from_float(conv, bn, spec, name)
        replace_module_in_parent(mod, pat.conv, fused)
        conv_node, bn_node = pat.nodes
        bn_node.replace_all_uses_with(conv_node)
        graph.erase_node(bn_node)
        if pat.relu_node is not None:
            pat.relu_node.replace_all_uses_with(conv_node)
            graph.erase_node(pat.relu_node)
        parent_path, _, leaf = pat.bn.rpartition(".")
        delattr(mod.get_submodule(parent_path) if parent_path else mod, leaf)
        report.add(name, cls.__name__, "conv", "fp16" if spec.fallback_fp16 else "quantized",
                   f"fused with {prefix + pat.bn}" + (" + relu" if pat.relu_node is not None else "") + "; "
                   + _describe(spec))
        changed = True
    for node in list(graph.nodes):
        kind = functional_kind(node)
        if kind is None:
            continue
        name = prefix + node.name
        spec = _effective(resolve(name, kind, kind))
        if spec is None:
            report.add(name, kind, kind, "float", "no recipe rule quantizes it")
            continue
        attr = node.name if not hasattr(mod, node.name) else f"{node.name}_q"
        if kind == "cat":
            tensors = node.args[0] if node.args else node.kwargs["tensors"]
            qmod = QCat(spec, prefix + attr, arity=len(tensors), dim=cat_dim(node))
            args = tuple(tensors)
        else:
            qmod = _FUNCTIONAL[kind](spec, prefix + attr)
            args = (node.args[0], node.args[1])
        mod.add_module(attr, qmod)
        with graph.inserting_after(node):
            new = graph.call_module(attr, args)
        node.replace_all_uses_with(new)
        graph.erase_node(node)
        report.add(prefix + attr, type(qmod).__name__, kind, "fp16" if spec.fallback_fp16 else "quantized",
                   _describe(spec))
        changed = True
    if not changed:
        return mod
    gm = rebuild(mod, graph)
    if path:
        replace_module_in_parent(root, path, gm)
    return gm


def _report_ready_made(report, name: str, mod: nn.Module) -> None:
    """A row for a module that arrived already quantized (built by operator replacement, such as
    the FP16 softmax and layer norm, or by the user): its quantizers' formats, as they are."""
    quantizers = mod.quantizers() if callable(getattr(mod, "quantizers", None)) else {}
    if not quantizers:
        return
    formats = {role: q.fmt.name for role, q in quantizers.items()}
    status = "fp16" if set(formats.values()) == {"fp16"} else "quantized"
    op_class = op_class_of(mod)
    report.add(name, type(mod).__name__, op_class, status,
               "ready-made: " + " ".join(f"{role}={fmt}" for role, fmt in formats.items()))


def _swap_leaves(model: nn.Module, resolve, report, strict: bool) -> None:
    unknown = []
    reported = {r.name for r in report.rows}
    for name, mod in list(model.named_modules()):
        if hasattr(mod, "qat_name") and name and name not in reported:
            _report_ready_made(report, name, mod)
        if hasattr(mod, "qat_name") or hasattr(mod, "observer") or not name:
            continue
        cls = QAT_MODULES.get(type(mod))
        if cls is None:
            own_params = list(mod.named_parameters(recurse=False))
            if own_params and not isinstance(mod, (nn.BatchNorm2d, nn.LayerNorm, nn.GroupNorm, nn.BatchNorm1d)):
                unknown.append((name, type(mod).__name__))
                report.add(name, type(mod).__name__, "custom", "float",
                           f"no QAT module registered for {type(mod).__name__}: register one with "
                           f"@dal.register_qat_module({type(mod).__name__})")
            continue
        op_class = OP_CLASSES[type(mod)]
        spec = _effective(resolve(name, type(mod).__name__, op_class))
        if spec is None:
            report.add(name, type(mod).__name__, op_class, "float", "no recipe rule quantizes it")
            continue
        replace_module_in_parent(model, name, cls.from_float(mod, spec, name))
        report.add(name, cls.__name__, op_class, "fp16" if spec.fallback_fp16 else "quantized", _describe(spec))
    if strict and unknown:
        listing = "\n".join(f"  {n}: {t} -> @dal.register_qat_module({t}) on a QAT class" for n, t in unknown)
        raise ValueError(f"prepare_qat(strict=True): {len(unknown)} module(s) have parameters and no QAT "
                         f"module:\n{listing}")


def _revert_uncalled(model: nn.Module, example_inputs, report: PrepareReport) -> None:
    """QAT modules whose forward never runs on the example inputs (their weights are used
    functionally elsewhere) go back to float and are listed with the reason."""
    called = set()
    hooks = [m.register_forward_pre_hook(lambda m, i: called.add(id(m)))
             for m in model.modules() if hasattr(m, "qat_name") and hasattr(m, "to_float")]
    try:
        with torch.no_grad():
            model(*example_inputs)
    finally:
        for h in hooks:
            h.remove()
    rows = {r.name: i for i, r in enumerate(report.rows)}
    for name, mod in list(model.named_modules()):
        if name and hasattr(mod, "qat_name") and hasattr(mod, "to_float") and id(mod) not in called:
            replace_module_in_parent(model, name, mod.to_float())
            reason = "its forward never runs on the example inputs (weights used functionally); left in float"
            if name in rows:
                old = report.rows[rows[name]]
                report.rows[rows[name]] = type(old)(old.name, old.type_name, old.op_class, "float", reason)


def _quantize_model_outputs(model: nn.Module, example_inputs, resolve) -> Optional[str]:
    """Give an output quantizer to the QAT layers whose results are the model's outputs (found by
    running the example inputs), so exported outputs are integers the NPU can produce."""
    from ..nn.spec import make_quantizer

    produced: dict[int, tuple[str, nn.Module]] = {}
    hooks = []
    for name, mod in model.named_modules():
        if hasattr(mod, "qat_name") and hasattr(mod, "output_quant"):
            hooks.append(mod.register_forward_hook(
                lambda m, i, o, name=name: produced.__setitem__(id(o), (name, m)) if torch.is_tensor(o) else None))
    try:
        with torch.no_grad():
            out = model(*example_inputs)
    finally:
        for h in hooks:
            h.remove()
    outs = [out] if torch.is_tensor(out) else [o for o in (out if isinstance(out, (list, tuple)) else []) if torch.is_tensor(o)]
    names = []
    for o in outs:
        if id(o) in produced:
            name, mod = produced[id(o)]
            spec = resolve(name, float_type_name(mod), op_class_of(mod))
            if mod.output_quant is None and spec is not None and getattr(spec, "input", None) is not None \
                    and not getattr(spec, "fallback_fp16", False):
                mod.output_quant = make_quantizer(spec.input, None, f"{name}.output_quant")
                names.append(name)
    return ", ".join(names) or None


def prepare_qat(model: nn.Module, recipe="int8_balanced", hardware=None, example_inputs=None,
                inplace: bool = True, strict: bool = False) -> nn.Module:
    """Turn ``model`` into a QAT model: fuse, swap, quantize functional ops; return the model.

    Args:
        model: a float ``nn.Module``.
        recipe: bundled recipe name, YAML path, dict or ``dal.recipe.Recipe``.
        hardware: bundled hardware model name ("a2000"), path, dict or ``HardwareModel``; defaults
            to the recipe's ``hardware``. The recipe is checked against it first: a layer asking
            for a format the hardware cannot run is refused with every offender listed.
        example_inputs: a tuple of example inputs; with them, the layers producing the model's
            outputs get output quantizers (so the exported graph ends in integers).
        inplace: modify ``model`` (default) or a deep copy.
        strict: raise for modules with parameters that no QAT module handles, instead of
            leaving them in float and listing them in the report.

    Returns the prepared model; ``model.dal_report`` is a :class:`PrepareReport`. When the root's
    own forward contains functional ops (``+``, ``torch.cat``, ``@``) the returned object is a
    ``torch.fx.GraphModule`` sharing the same parameters (use the returned model).
    Quantizers start in the ``observe`` state: call ``dal.calibrate`` next.
    """
    from ..hardware import load_hardware
    from ..recipe import check_against_hardware, load_recipe

    if not isinstance(model, nn.Module):
        raise TypeError(f"prepare_qat needs an nn.Module, got {type(model).__name__}")
    rec = load_recipe(recipe)
    hw_name = hardware if hardware is not None else getattr(rec, "hardware", None)
    hw = load_hardware(hw_name) if hw_name is not None else None
    if not inplace:
        model = copy.deepcopy(model)
    if example_inputs is not None:
        example_inputs = tuple(example_inputs) if isinstance(example_inputs, list) else example_inputs
        example_inputs = example_inputs if isinstance(example_inputs, tuple) else (example_inputs,)
        _check_example_inputs(model, example_inputs)
    if hw is not None:
        check_against_hardware(rec, hw, _candidates(model))
    resolve = _Resolver(rec, hw)
    report = PrepareReport(recipe=getattr(rec, "name", str(recipe)), hardware=getattr(hw, "name", str(hw_name)))
    model = _replace_operators(model, rec, hw, example_inputs, report)
    if hw is not None and report.replacements is not None:
        # Replacement brings new layers (attention matmuls, table activations): check them too.
        # A refusal here leaves the replaced operators in place (they compute the float function).
        check_against_hardware(rec, hw, _candidates(model))
    for path, mod in list(model.named_modules()):
        if needs_tracing(mod) and (path == "" or _still_attached(model, path, mod)):
            new = _rewrite_module(model, path, mod, resolve, report)
            if path == "":
                model = new
    _swap_leaves(model, resolve, report, strict)
    if example_inputs is not None:
        # The example forwards only look at the graph: with quantizers off, no observer counts
        # the example (often zeros) as a calibration batch, and nothing all-reduces under DDP.
        from ..quantizer import STATES
        from .state import quantizers

        states = [(q, q.state) for _, q in quantizers(model)]
        for q, _ in states:
            q.state_code.fill_(STATES.index("off"))  # without set_state's leave-observe side effects
        try:
            with eval_mode(model):
                _revert_uncalled(model, example_inputs, report)
                outs = _quantize_model_outputs(model, example_inputs, resolve)
        finally:
            for q, state in states:
                q.state_code.fill_(STATES.index(state))
        if outs:
            report.notes.append(f"output quantizer added to {outs} (model outputs)")
    _attach_sparsity(model, rec, hw, report)
    model.dal_report = report
    model._dal_recipe = rec
    model._dal_hardware = hw
    return model


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
    return getattr(result, "model", model)


def _still_attached(model: nn.Module, path: str, mod: nn.Module) -> bool:
    try:
        return model.get_submodule(path) is mod
    except AttributeError:
        return False


def _attach_sparsity(model, rec, hw, report) -> None:
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
        if hasattr(mod, "qat_name"):
            pattern = getattr(_spec_of(rec, name, mod), "sparsity", None)
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


def _spec_of(rec, name, mod):
    return _Resolver(rec, None)(name, float_type_name(mod), op_class_of(mod))
