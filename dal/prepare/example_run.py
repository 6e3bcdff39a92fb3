"""What one forward of the FLOAT model on the example inputs decides, before anything is swapped.

``prepare_qat`` with ``example_inputs`` runs the float model once before apply (the forward that
checks the inputs, or the call-site discovery when a forward does not trace), recorded by
``dal.capture.recording`` into a :class:`dal.capture.Record`: every module and function call,
which modules' forwards ran, and which modules returned each tensor the root returned (innermost
first, as the hooks fire). From it, before apply (:func:`decide`):

* a step that would swap in a QAT module built from a float module (``quantize``, ``fuse``, an
  ``fp16`` module)
  whose float module never runs becomes ``float`` (its weights are read functionally by a parent,
  e.g. ``F.linear(x, self.fc.weight)``): apply never builds it. A QAT module already in the model
  (operator replacement's, with ``swappable``) that never runs is given back as float by apply;
* the steps whose module returns a model output (the outermost planned module that returned the
  tensor, as a forward hook on the QAT model would see it) are the model's output producers: they
  get an output quantizer when the recipe says ``quantize_outputs: true``, else a note names them.

The recorder's hooks also keep torch's fused TransformerEncoderLayer path off for that forward
(torch takes it only when no submodule has hooks), so every Linear the QAT model will call is seen
called. prepare keeps the record (``dal.prepared(model).record``, the root's output released).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from ..capture import Record
from ..nn.base import QATModule
from ..nn.norm_act import is_norm_act
from ..nn.registry import float_type_name, op_class_of

NEVER_RUNS = "its forward never runs on the example inputs (weights used functionally); left in float"


def output_tensors(record: Record) -> list:
    """The root's tensor outputs the producers are looked for: a tensor, or the tensors of a
    returned list / tuple (a dict's or a ``ModelOutput``'s values are the loss's business)."""
    out = record.returned
    if torch.is_tensor(out):
        return [out]
    return [o for o in (out if isinstance(out, (list, tuple)) else []) if torch.is_tensor(o)]


def site_result(record: Record):
    """``(site path, tensor)`` callback for ``call_sites.discover``: a call site's call returned
    the tensor (who returned what: :meth:`Record.note`)."""
    return lambda path, t: record.note(t, ("site", path))


@dataclass(frozen=True)
class Outputs:
    """The model's output producers: ``paths`` (in output order) and, when the recipe quantizes
    outputs, ``specs`` (path -> the input TensorSpec its output quantizer is built from)."""

    paths: tuple = ()
    quantize: bool = False
    specs: tuple = ()  # ((path, TensorSpec), ...)


def decide(plan: list, model: nn.Module, cap, record: Optional[Record], resolve,
           quantize_outputs: bool) -> tuple[list, tuple, Outputs]:
    """``(plan, to_float, outputs)`` from a float forward's ``record`` (None: no example inputs,
    nothing decided): steps whose float module never ran become float steps (:data:`NEVER_RUNS`),
    ``to_float`` the paths of QAT modules already in the model that never ran, ``outputs`` the
    model-output producers (module doc)."""
    if record is None or not record.ran:
        return plan, (), Outputs()
    modules = dict(model.named_modules(remove_duplicate=False))
    plan = [_never_ran(s, modules, record) for s in plan]
    to_float = tuple(p for p, m in model.named_modules() if p and isinstance(m, QATModule) and m.swappable
                     and id(m) not in record.called)
    gone = set(to_float)
    plan = [dataclasses.replace(s, action="float", reason=NEVER_RUNS) if s.action == "ready-made"
            and s.path in gone else s for s in plan]
    taps = _taps(plan, modules, cap, resolve, gone)
    paths, specs = [], []
    for t in output_tensors(record):
        tapped = [taps[i] for i in record.returned_by(t) if i in taps]
        if not tapped:
            continue
        path, spec = tapped[-1]  # the outermost: a hook on each QAT module would see it last
        if spec is not None:
            paths.append(path)
            specs.append((path, spec.input))
    return plan, to_float, Outputs(tuple(paths), bool(quantize_outputs), tuple(specs) if quantize_outputs else ())


def _never_ran(step, modules: dict, record: Record):
    """A quantize / fuse / fp16 module step whose float module (the conv of a fused chain) never
    ran: float."""
    if step.site is not None or step.action not in ("quantize", "fuse", "fp16") or (step.action != "fuse" and step.node):
        return step
    mod = modules.get(step.path)
    if mod is None or id(mod) in record.called:
        return step
    return dataclasses.replace(step, action="float", spec=None, built="", reason=NEVER_RUNS)


def _eligible(spec) -> bool:
    """A module built from ``spec`` has no output quantizer and quantizes its input: its output
    may get one (an FP16 fallback does not)."""
    return spec is not None and spec.input is not None and spec.output is None and not spec.fallback_fp16


def _taps(plan: list, modules: dict, cap, resolve, gone: set) -> dict:
    """id(float module whose output is a planned QAT module's output) -> (QAT module path, its
    LayerSpec when it may get an output quantizer, else None)."""
    taps = {}
    for path, mod in modules.items():  # QAT modules already in the model, nested ones included
        if path and isinstance(mod, QATModule) and path not in gone:
            spec = resolve(path, float_type_name(mod), op_class_of(mod))
            ok = hasattr(mod, "output_quant") and getattr(mod, "output_quant", None) is None and _eligible(spec)
            taps[id(mod)] = (path, spec if ok else None)
    for s in plan:
        if s.site is not None:  # a call site's module, seen by the discovery forward (site_result)
            if s.action == "functional":
                taps[("site", s.path)] = (s.path, s.spec if _eligible(s.spec) else None)
            continue
        if s.action in ("quantize", "fp16") and not s.node:
            mod = modules.get(s.path)
            if mod is not None:  # an FP16 module's output stays FP16: it returns the output, none is added
                ok = s.action == "quantize" and not is_norm_act(mod) and _eligible(s.spec)
                taps[id(mod)] = (s.path, s.spec if ok else None)
        elif s.action == "fuse":
            last = _chain_end(s, modules, cap)
            if last is not None:
                taps[id(last)] = (s.path, s.spec if _eligible(s.spec) else None)
        elif s.action == "functional" and s.node:
            owner = modules.get(s.owner)
            how = _returns(cap.graphs.get(s.owner), s.node)
            if owner is not None and how is not None:
                taps[id(owner) if how == "whole" else (id(owner), how)] = (
                    s.path, s.spec if _eligible(s.spec) else None)
    return taps


def _chain_end(step, modules: dict, cap) -> Optional[nn.Module]:
    """The module whose output is a fused Conv+BN(+ReLU)'s: the ReLU module, else the BN (None
    when the chain ends in a functional ReLU: no module returns it)."""
    graph = cap.graphs.get(step.owner)
    prefix = f"{step.owner}." if step.owner else ""
    if not step.relu:
        return modules.get(prefix + step.bn)
    conv = next((n for n in graph.nodes if n.op == "call_module" and n.target == step.node), None) if graph else None
    if conv is None:
        return None
    bn = next(iter(conv.users))
    relu = next(iter(bn.users))
    return modules.get(prefix + str(relu.target)) if relu.op == "call_module" else None


def _returns(graph, node_name: str):
    """``"whole"`` when ``graph``'s forward returns the value of node ``node_name`` itself (its
    owner's output is that op's output tensor), its index ``i`` when it returns it as element
    ``i`` of a tuple or list, else None."""
    if graph is None:
        return None
    out = next((n for n in graph.nodes if n.op == "output"), None)
    value = out.args[0] if out is not None and out.args else None
    if getattr(value, "name", None) == node_name:
        return "whole"
    if isinstance(value, (list, tuple)):
        return next((i for i, v in enumerate(value) if getattr(v, "name", None) == node_name), None)
    return None
