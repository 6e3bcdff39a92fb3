"""INT16 activations as the step between INT8 and FP16 of the sensitivity fallback.

A layer steps INT8 -> INT16 (before FP16) when its recipe spec has 8-bit integer activations and
the hardware model lists ``int16`` in that op class's ``input_formats`` (and ``output_formats``
when the layer quantizes its output). The weights keep their spec; the INT16 activations are
symmetric per tensor (min-max), with the power-of-two rounding of the INT8 spec when it had one.
"""
from __future__ import annotations

from typing import Optional

from torch import nn

from ..prepare.handle import prepared


def _is_int8(spec) -> bool:
    return spec is not None and spec.format.is_integer and spec.format.bits == 8


def _int16_spec(spec) -> dict:
    args = dict(spec.observer_args or ())
    out = {"format": "int16", "granularity": "per_tensor", "symmetric": True, "observer": "minmax"}
    if "power_of_two" in args:
        out["observer_args"] = {"power_of_two": args["power_of_two"]}
    return out


def int16_rule(model: nn.Module, name: str) -> Optional[dict]:
    """The recipe rule moving layer ``name`` of the prepared ``model`` to INT16 activations
    (``{match: name, weight: <its spec>, input: int16[, output: int16]}``), or None when the
    layer is not an INT8-activation layer or the hardware does not offer int16 for its op class."""
    handle = prepared(model)
    hw = handle.hardware
    step = next((s for s in handle.plan if s.path == name and s.spec is not None), None)
    if hw is None or step is None or step.spec.fallback_fp16 or not _is_int8(step.spec.input):
        return None
    spec = step.spec
    if "int16" not in {f.name.lower() for f in hw.allowed_formats(step.op_class, "input")}:
        return None
    if spec.output is not None and ("int16" not in {f.name.lower() for f in hw.allowed_formats(step.op_class, "output")}
                                    or not _is_int8(spec.output)):
        return None
    rule = {"match": name}
    if spec.weight is not None:
        rule["weight"] = spec.weight.to_dict()
    rule["input"] = _int16_spec(spec.input)
    if spec.output is not None:
        rule["output"] = _int16_spec(spec.output)
    return rule


def fp16_allowed(model: nn.Module, name: str) -> bool:
    """True when layer ``name`` of the prepared ``model`` may fall back to FP16 on its hardware:
    no hardware model is attached, or the op class lists fp16 among the formats of its last role
    (the rule ``dal.recipe``'s check applies to a ``fallback: fp16`` rule). On int8-only hardware
    (``pow2_int8``, ``a1000``) an FP16 layer would leave the NPU, so the fallback must not propose it."""
    from ..formats import FP16

    handle = prepared(model)
    hw = handle.hardware
    if hw is None:
        return True
    step = next((s for s in handle.plan if s.path == name), None)
    op = hw.op(step.op_class) if step is not None else None
    return op is not None and FP16 in op.formats(op.roles[-1])


def precision_steps(model: nn.Module, name: str, int16: Optional[dict]) -> tuple:
    """The fallback steps of layer ``name`` after INT8, in order: ``"int16"`` when ``int16`` (the
    layer's ``int16_rule``) is given, then ``"fp16"`` when ``fp16_allowed``."""
    return (("int16",) if int16 is not None else ()) + (("fp16",) if fp16_allowed(model, name) else ())


def int16_quantizer(old, name: str):
    """An INT16 quantizer (symmetric, per tensor) covering the range of the calibrated 8-bit
    ``old``: ``s16 = max(|(qmin - zp) s|, |(qmax - zp) s|) / 32767`` (then 2^k when ``old`` is
    power-of-two constrained), in ``quantize``. The in-place simulation of an ``int16_rule``."""
    import torch

    from ..formats.qparams import MIN_SCALE
    from ..quantizer import FakeQuantizer

    q = FakeQuantizer("int16", symmetric=True, name=name)
    if old.power_of_two is not None:
        q.constrain_power_of_two(old.power_of_two)
    scale, zp = old.effective_qparams()
    s, z = scale.double().flatten(), zp.double().flatten()
    amax = torch.maximum(((old.qmin - z) * s).abs(), ((old.qmax - z) * s).abs()).max()
    q.set_qparams(torch.clamp(amax / q.qmax, min=MIN_SCALE).float().reshape(1), torch.zeros(1, dtype=torch.int32))
    return q.set_state("quantize")
