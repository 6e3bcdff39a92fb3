"""Rule ``lut_activation``: element-wise activations through the vector engine's lookup table.

An int8 vector engine evaluates ``f`` on an 8-bit input with a table of ``lut_size`` entries:

    table[k] = Q_out(f(DQ_in(qmin + k)))          k = 0 .. qmax - qmin
    y        = DQ_out(table[code(x) - qmin])

which is, at each of the 256 codes, exactly what ``DequantizeLinear -> f -> QuantizeLinear``
computes. So:

* the float module :class:`LutActivation` computes ``f`` (equal to the original);
* ``prepare_qat`` swaps it (registered QAT module, op class ``activation``) to
  :class:`QLutActivation`, with a per-tensor input quantizer from the recipe's activation spec
  (int8 affine when the spec has none) and an output quantizer (the spec's ``output``, else a
  second quantizer of the ``input`` spec's format);
* training forward: values from the table, gradient of ``Q_out(f(Q_in(x)))`` (STE through both
  quantizers, ``f'`` at the quantized input); observers see the real tensors;
* export forward: ``Q_out(f(Q_in(x)))``, which the exporter writes as Q -> DQ -> f -> Q -> DQ with
  f = GELU's Erf decomposition (TorchScript below opset 20), Sigmoid, Tanh, Mul(x, Sigmoid(x))
  for SiLU, Clip(x * 1/6 + 0.5) [* x] for HardSigmoid [HardSwish]. At all 256 codes of int8
  and uint8 inputs onnxruntime (ORT_DISABLE_ALL) and dal.npu give the table's values
  (tests/replace/test_lut.py; 0 of 256 codes differ for every function).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from ..formats import dequantize, fake_quantize, quantize
from ..nn.adopt import adopt
from ..nn.base import QATModule
from ..nn.registry import register_qat_module
from ..nn.spec import SimpleTensorSpec, make_quantizer, role_specs
from ..ops import select
from .activation_probe import probe_activation
from .registry import rule

#: the functions this rule builds tables for (:func:`apply_function` computes each as the export
#: writes it), as hardware models spell them in ``lut_ops``
FUNCTIONS = ("gelu", "silu", "sigmoid", "tanh", "hardswish", "hardsigmoid")


def lut_types() -> dict[type, str]:
    """Float module type -> the LUT function it computes: the module types of dal.ops' activation
    ops whose ``function`` is one of :data:`FUNCTIONS` (``nn.GELU`` -> ``"gelu"``)."""
    return {t: op.function for op in select(op_class="activation") if op.function in FUNCTIONS for t in op.modules}


def _onnx_hardsigmoid(x: torch.Tensor) -> torch.Tensor:
    # ONNX HardSigmoid's formula, max(0, min(1, x * float32(1/6) + 0.5)), not torch's
    # relu6(x + 3) / 6: the two round differently and torch's flips 3 of 256 table codes against
    # the exported HardSigmoid / HardSwish. Both are within an ulp of the real function.
    return torch.clamp(x * (1.0 / 6.0) + 0.5, 0.0, 1.0)


def apply_function(fn: str, x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """``f(x)`` for a LUT function name, in float32: torch's own GELU / SiLU / Sigmoid / Tanh,
    ONNX's formula for HardSigmoid / HardSwish (see ``_onnx_hardsigmoid``)."""
    if fn == "gelu":
        return F.gelu(x, approximate=approximate)
    if fn == "silu":
        return F.silu(x)
    if fn == "sigmoid":
        return torch.sigmoid(x)
    if fn == "tanh":
        return torch.tanh(x)
    if fn == "hardswish":
        return x * _onnx_hardsigmoid(x)
    if fn == "hardsigmoid":
        return _onnx_hardsigmoid(x)
    raise ValueError(f"{fn!r} is not a LUT function ({', '.join(FUNCTIONS)})")


class LutActivation(nn.Module):
    """Float stand-in for an activation the NPU evaluates by table: ``forward(x) = f(x)``.

    Args:
        fn: "gelu", "silu", "sigmoid", "tanh", "hardswish" or "hardsigmoid".
        approximate: GELU's "none" or "tanh".
        lut_size: table entries the hardware has (input formats with more codes cannot use it).
    """

    def __init__(self, fn: str, approximate: str = "none", lut_size: int = 256):
        super().__init__()
        if fn not in FUNCTIONS:
            raise ValueError(f"{fn!r} is not a LUT function ({', '.join(FUNCTIONS)})")
        self.fn, self.approximate, self.lut_size = fn, approximate, int(lut_size)

    def forward(self, x):
        return apply_function(self.fn, x, self.approximate)

    def extra_repr(self) -> str:
        approx = f", approximate={self.approximate}" if self.fn == "gelu" and self.approximate != "none" else ""
        return f"fn={self.fn}{approx}, lut_size={self.lut_size}"


class _TableValues(torch.autograd.Function):
    """Forward: ``table[index]``. Backward: the gradient of ``y`` (the fake-quant chain)."""

    @staticmethod
    def forward(ctx, y, table, index):
        return table[index]

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None


def _default_activation_spec():
    return SimpleTensorSpec("int8", symmetric=False, observer="minmax")


@register_qat_module(LutActivation, op_class="activation")
class QLutActivation(QATModule, LutActivation):
    """:class:`LutActivation` with its input and output FakeQuantizers; see the module docstring."""

    @classmethod
    def from_float(cls, mod: LutActivation, spec=None, name: str = "") -> "QLutActivation":
        q = adopt(cls, mod)
        q.qat_name = name
        in_spec, _, out_spec = role_specs(spec)
        in_spec = in_spec or _default_activation_spec()
        out_spec = out_spec or in_spec
        q.input_quant = make_quantizer(in_spec, None, f"{name}.input_quant", force_per_tensor=True)
        q.output_quant = make_quantizer(out_spec, None, f"{name}.output_quant", force_per_tensor=True)
        return q


    # ---- the table -------------------------------------------------------------------------
    def uses_table(self) -> bool:
        """True when the input is an active, calibrated integer quantizer whose codes fit the table."""
        q = self.input_quant
        return (q is not None and q.fmt.is_integer and q.state in ("quantize", "frozen") and q.initialized
                and q.scale.numel() == 1 and q.qmax - q.qmin + 1 <= self.lut_size)

    def _in_params(self):
        scale, zp = self.input_quant.effective_qparams()
        return scale.reshape(()), zp.reshape(())

    def _out(self, y: torch.Tensor) -> torch.Tensor:
        """``Q_out`` applied to table values without touching its observer."""
        q = self.output_quant
        if q is None or q.state in ("observe", "off"):
            return y
        if not q.fmt.is_scaled:
            return fake_quantize(y, q.fmt, check=False)
        return fake_quantize(y, q.fmt, q.scale.detach(), q.zero_point.detach(), q.granularity, q.narrow_range,
                             learnable=q.learnable, check=False)

    @torch.no_grad()
    def lookup_table(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(codes, values)``: every input code and the dequantized table value it maps to."""
        q = self.input_quant
        if not self.uses_table():
            raise RuntimeError(f"{self.qat_name}: no lookup table (input quantizer {q.fmt.name if q else None} "
                               f"state {q.state if q else None}); calibrate with an 8-bit input format first")
        scale, zp = self._in_params()
        codes = torch.arange(q.qmin, q.qmax + 1, dtype=torch.int32, device=scale.device).to(q.fmt.torch_dtype())
        grid = dequantize(codes, q.fmt, scale, zp)
        return codes, self._out(apply_function(self.fn, grid, self.approximate))

    def forward(self, x):
        qi, qo = self.input_quant, self.output_quant
        if torch.onnx.is_in_onnx_export() or torch.jit.is_tracing() or not self.uses_table():
            # export (DQ -> f -> Q) and the float / fp16 / calibration paths
            y = apply_function(self.fn, qi(x) if qi is not None else x, self.approximate)
            return qo(y) if qo is not None else y
        xq = qi(x)
        y = apply_function(self.fn, xq, self.approximate)
        y = qo(y) if qo is not None else y  # observers update and the STE gradient path
        _, table = self.lookup_table()
        scale, zp = self._in_params()
        index = quantize(xq.detach(), qi.fmt, scale, zp).long() - qi.qmin
        return _TableValues.apply(y, table, index)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, table={'on' if self.uses_table() else 'off'}"


def function_of(module: nn.Module) -> Optional[tuple[str, str]]:
    """``(fn, approximate)`` of a module that computes a LUT activation: torch's own classes by
    type, any other (timm's, transformers') by what it computes (``activation_probe``); else None."""
    fn = lut_types().get(type(module))
    if fn is not None:
        return fn, getattr(module, "approximate", "none")
    return probe_activation(module)


@rule("lut_activation")
class LutActivationRule:
    """GELU / SiLU / Sigmoid / Tanh / Hardswish / Hardsigmoid modules -> LutActivation, for the
    functions the hardware lists in ``lut_ops`` (all of them without a hardware model): torch's
    classes and any library's module that computes one of them (:func:`function_of`)."""

    def _allowed(self, hardware) -> tuple:
        if hardware is None:
            return FUNCTIONS
        return tuple(f for f in FUNCTIONS if f in (hardware.lut_ops or ()))

    def match(self, module: nn.Module, name: str, hardware=None) -> bool:
        found = function_of(module)
        return found is not None and found[0] in self._allowed(hardware)

    def build(self, module: nn.Module, hardware) -> nn.Module:
        found = function_of(module)
        if found is None:
            raise ValueError(f"{type(module).__name__} computes none of {', '.join(FUNCTIONS)}")
        fn, approximate = found
        if fn not in self._allowed(hardware):
            raise ValueError(f"hardware {hardware.name} has no lookup table for {fn} (lut_ops: {hardware.lut_ops})")
        size = getattr(hardware, "lut_size", None) or 256
        lut = LutActivation(fn, approximate, size)
        lut.train(module.training)
        return lut

    def describe(self, module: nn.Module, name: str) -> str:
        fn, approximate = function_of(module)
        how = "" if type(module) in lut_types() else f" (what {type(module).__name__} computes)"
        approx = f" approximate={approximate}" if fn == "gelu" and approximate != "none" else ""
        return f"{fn}{approx}{how} through a lookup table (exports as DQ -> f -> Q)"

    def why_nothing(self, hardware) -> Optional[str]:
        if hardware is not None and not hardware.lut_ops:
            return f"hardware {hardware.name} lists no lut_ops"
        return f"no {'/'.join(t.__name__ for t in lut_types())} module, nor one that computes such a function"
