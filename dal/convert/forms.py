"""The integer-model forms of dal.replace's operators, swapped into the converted copy.

``QMatMul`` -> :class:`~dal.convert.attention.MatMulForm`, ``NpuSoftmax`` ->
:class:`~dal.convert.attention.SoftmaxForm`, ``Fp16LayerNorm`` and float ``nn.LayerNorm`` ->
:class:`~dal.convert.layernorm.LayerNormForm`, ``Fp16RMSNorm`` ->
:class:`~dal.convert.rmsnorm.RMSNormForm`, ``QLutActivation`` ->
:class:`~dal.convert.lut.LutForm`, ``QGridSample`` -> :class:`~dal.convert.grid_sample.GridSampleForm`, a float ``nn.GELU`` (or its FP16 island, ``Fp16GELU``) ->
:class:`~dal.convert.lut.GeluForm`, a float ``nn.Linear`` / ``nn.ConvNd`` (a skipped layer) ->
:class:`~dal.convert.float_layers.FloatLayerForm`.
Each keeps the QAT module (its quantizers still run, so the integer model's code taps see them)
and computes what the exported nodes compute. A module
with no form here stays as it is and is listed with the reason (:func:`swap_forms`).
"""
from __future__ import annotations

from torch import nn

from ..export.plan import TRACE_MAX_OPSET
from ..nn.adopt import float_class_of
from ..nn.functional import QMatMul
from ..nn.grid_sample import QGridSample
from ..nn.scatter_add import QScatterAdd
from ..prepare.fp16_island import Fp16Island
from ..replace.layernorm import Fp16LayerNorm
from ..replace.lut import QLutActivation
from ..replace.rmsnorm import Fp16RMSNorm
from ..replace.softmax import NpuSoftmax
from .attention import MatMulForm, SoftmaxForm, half_operands
from .float_layers import FloatLayerForm, is_float_layer
from .grid_sample import GridSampleForm
from .scatter import ScatterAddForm
from .layernorm import LayerNormForm
from .rmsnorm import RMSNormForm
from .lut import GeluForm, LutForm, lut_form_why_not

def _is_gelu(mod: nn.Module) -> bool:
    """A float ``nn.GELU``, or one made an FP16 island by prepare (``Fp16GELU``: its quantizers
    round the form's input and output, lut.py ``GeluForm``)."""
    return type(mod) is nn.GELU or (isinstance(mod, Fp16Island) and float_class_of(mod) is nn.GELU)


def _form(mod: nn.Module, path: str, opset: int):
    """(form or None, why not)."""
    if isinstance(mod, QMatMul):
        qo = mod.output_quant
        if half_operands(list(mod.input_quants)) is not None and (qo is None or qo.state == "off"):
            # the region then runs on through the ops after it (export/SPEC.md §5a, region tails)
            return None, "an FP16 matmul with no output quantizer (FP16 region tail)"
        return MatMulForm(mod, path), ""
    if isinstance(mod, NpuSoftmax):
        return SoftmaxForm(mod, path), ""
    if isinstance(mod, QGridSample):
        return GridSampleForm(mod, path), ""
    if isinstance(mod, QScatterAdd):
        return ScatterAddForm(mod, path), ""
    if isinstance(mod, Fp16LayerNorm) or type(mod) is nn.LayerNorm:
        return LayerNormForm(mod, path, opset), ""
    if isinstance(mod, Fp16RMSNorm):
        return RMSNormForm(mod, path), ""
    if _is_gelu(mod):
        if mod.approximate not in ("none", "tanh"):
            return None, f"GELU approximate={mod.approximate!r}"
        return GeluForm(mod, path, opset), ""
    if isinstance(mod, QLutActivation):
        why = lut_form_why_not(mod)
        return (None, why) if why else (LutForm(mod, path, opset), "")
    if is_float_layer(mod):
        return FloatLayerForm(mod, path), ""
    return None, ""


def swap_forms(net: nn.Module, opset: int, swap) -> dict[str, str]:
    """Replace every module of ``net`` that has a form; ``opset`` is the export's (the traced
    opset is ``min(opset, 20)``). ``swap(parent, name, new)`` installs one. Returns
    ``{path: "<Form name>" | "QAT module: <why>"}`` for every such operator."""
    traced = min(int(opset), TRACE_MAX_OPSET)
    listing = {}
    for path, mod in list(net.named_modules()):
        if not path or not (isinstance(mod, (QMatMul, NpuSoftmax, Fp16LayerNorm, QLutActivation, QGridSample,
                                  QScatterAdd, Fp16RMSNorm))
                            or type(mod) is nn.LayerNorm or _is_gelu(mod) or is_float_layer(mod)):
            continue
        form, why = _form(mod, path, traced)
        if form is None:
            listing[path] = f"QAT module: {why} (may differ from the NPU)"
            continue
        parent_path, _, name = path.rpartition(".")
        swap(net.get_submodule(parent_path) if parent_path else net, name, form)
        listing[path] = type(form).__name__
    return listing
