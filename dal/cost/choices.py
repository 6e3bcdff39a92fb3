"""The formats each layer of a prepared model runs in, read from its quantizers and plan.

- a QAT layer: its weight quantizer's format, its (first) input quantizer's format, its output
  quantizer's format (else the input's: the layer requantizes to the format it reads in); a
  quantizer turned ``off`` counts as absent; 2:4 when prepare gave it a ``weight_mask`` (dal.sparsity)
  and the hardware runs that pattern; a lookup-table activation (``QLutActivation``) is timed as a lookup;
- a layer in float (no quantizer): FP16 where the hardware runs the op class in FP16 (a
  ``fallback: fp16`` layer has FP16 quantizers and is covered above), else it runs off the NPU
  and is listed untimed;
- a passthrough layer with no quantizer of its own (max pool): the format of the activations
  flowing into it, i.e. the output format of the layer before it in execution order.
"""
from __future__ import annotations

from typing import Optional

from ..formats import FP16
from ..hardware.op_classes import OP_CLASS_ROLES
from .roofline import Choice, LayerGeom


def _fmt(q):
    return None if q is None or q.state == "off" else q.fmt


def _input_quant(mod):
    q = getattr(mod, "input_quant", None)
    if q is None:
        qs = getattr(mod, "input_quants", None)
        q = qs[0] if qs is not None and len(qs) else None
    return q


def fp16_allowed(hw, op_class: str, role: str = "input") -> bool:
    return FP16 in hw.allowed_formats(op_class, role)


def _float_choice(geom: LayerGeom, hw) -> Optional[Choice]:
    has_weight = geom.weight_elems > 0 and "weight" in OP_CLASS_ROLES.get(geom.op_class, ())
    if not hw.supports_op(geom.op_class) or not fp16_allowed(hw, geom.op_class, "weight" if has_weight else
                                                            ("output" if geom.op_class == "embedding" else "input")):
        return None
    return Choice(FP16 if has_weight else None, FP16 if geom.op_class != "embedding" else None, FP16)


def module_choice(geom: LayerGeom, mod, hw, plan_step, previous) -> Optional[Choice]:
    """The ``Choice`` of one traced layer (see the module docstring); None: off the NPU."""
    w, x = _fmt(getattr(mod, "weight_quant", None)), _fmt(_input_quant(mod))
    y = _fmt(getattr(mod, "output_quant", None))
    lut = type(mod).__name__ == "QLutActivation"
    if w is None and x is None and y is None:
        action = getattr(plan_step, "action", "")
        if action == "passthrough" and previous is not None and geom.op_class != "activation":
            return Choice(None, previous.output, previous.output)
        return _float_choice(geom, hw)
    if geom.op_class == "embedding":
        return Choice(w, None, y or w)
    if x is None:
        x = y or w
    # prepare gives a layer a weight_mask only where the pattern fits (not depthwise, reduction % M == 0)
    spec = getattr(plan_step, "spec", None)
    pattern = getattr(spec, "sparsity", None) or "2:4"
    sparse = (getattr(mod, "weight_mask", None) is not None and w is not None
              and hw.supports_sparsity(geom.op_class, pattern))
    return Choice(w, x, y or x, sparse=sparse, lut=lut)


def prepared_choices(layers, model, hw) -> dict:
    """name -> ``Choice`` (or None: off the NPU) for the traced ``layers`` of a prepared model."""
    from ..prepare.handle import find_prepared

    handle = find_prepared(model)
    steps = {s.path: s for s in (handle.plan if handle is not None else [])}
    out, previous = {}, None
    for geom, mod in layers:
        base = geom.name.split("#")[0]
        choice = module_choice(geom, mod, hw, steps.get(base), previous)
        out[geom.name] = choice
        if choice is not None and choice.output is not None:
            previous = choice
    return out
