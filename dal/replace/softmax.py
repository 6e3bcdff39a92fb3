"""The attention softmax as the hardware runs it: additive biases and masks, then softmax, in
one of three modes chosen from the hardware model (:func:`softmax_mode`):

* ``"fp16"`` (the vector engine runs softmax in FP16): input and output rounded to FP16 by two
  ``FakeQuantizer("fp16")`` (cast round trips); exported ``Cast(float16) -> Cast(float)`` around
  ``Softmax``.
* ``"lut"`` (integer softmax with an ``exp`` lookup table): an int8 per-tensor affine input
  quantizer and TFLite-style table softmax, ``y = T[c_max - c] / sum T[c_max - c]`` with
  ``T[k] = exp(-s * k)`` (see :mod:`dal.replace.softmax_lut`); no output quantizer, the next
  matmul's (uint8) input quantizer quantizes the probabilities. Exported
  ``QuantizeLinear -> DequantizeLinear -> Softmax``.
* ``"float"``: float32 softmax, no quantizer (integer-softmax hardware without a table: the
  quantized input of the following matmul stands for its output).

Quantizers are identities until calibration (state ``observe``) and when switched ``off``, so a
freshly replaced model equals the original, and prepare/calibrate/export treat them like every
other quantizer. The module carries ``qat_name`` and ``quantizers()`` (the QAT-module
protocol), so prepare does not rewrite the additions in its forward into integer ``QAdd``s: on
the NPU they are part of the softmax.
"""
from __future__ import annotations

from typing import Optional, Union

import torch
import torch.nn.functional as F

from ..formats import INT8
from ..nn.base import QATModule
from ..nn.spec import SimpleTensorSpec, make_quantizer
from ..quantizer import FakeQuantizer
from .softmax_lut import exp_table, lut_softmax

MODES = ("fp16", "lut", "float")


def as_mode(mode: Union[str, bool]) -> str:
    """A softmax mode from a mode name or the older ``fp16`` flag (True: "fp16", False: "float")."""
    if isinstance(mode, bool):
        return "fp16" if mode else "float"
    if mode not in MODES:
        raise ValueError(f"softmax mode {mode!r} is not one of {MODES}")
    return mode


class NpuSoftmax(QATModule):
    """``softmax(x + a_1 + a_2 + ..., dim)`` in the hardware's mode; ``None`` addends are skipped.

    Args:
        dim: softmax axis.
        fp16: the older flag: True is mode "fp16", False mode "float" (ignored when ``mode`` is given).
        name: module path (quantizer names in errors and exports).
        mode: "fp16", "lut" or "float" (module docstring; :func:`softmax_mode` picks it).
        lut_size: entries of the hardware's table; "lut" uses the table only when the input
            format's codes fit (256 for int8), else it computes ``softmax(Q(x))`` in float.
    """

    swappable = False  # built by the attention replacement, not from a float module

    def __init__(self, dim: int = -1, fp16: bool = True, name: str = "", mode: Optional[str] = None,
                 lut_size: int = 256):
        super().__init__()
        self.dim = dim
        self.mode = as_mode(fp16 if mode is None else mode)
        self.lut_size = int(lut_size)
        self.qat_name = name
        self.input_quant: Optional[FakeQuantizer] = None
        self.output_quant: Optional[FakeQuantizer] = None
        if self.mode == "fp16":
            self.input_quant = FakeQuantizer("fp16", name=f"{name}.input_quant")
            self.output_quant = FakeQuantizer("fp16", name=f"{name}.output_quant")
        elif self.mode == "lut":
            spec = SimpleTensorSpec("int8", symmetric=False, observer="minmax")
            self.input_quant = make_quantizer(spec, None, f"{name}.input_quant", force_per_tensor=True)

    def quantizers(self) -> dict:
        return {k: q for k in ("input_quant", "output_quant") if (q := getattr(self, k)) is not None}

    # ---- the lookup table ("lut" mode) ----------------------------------------------------
    def uses_table(self) -> bool:
        """True in mode "lut" with an active, calibrated per-tensor integer input quantizer whose
        code differences fit the table."""
        q = self.input_quant
        return (self.mode == "lut" and q is not None and q.fmt.is_integer and q.state in ("quantize", "frozen")
                and q.initialized and q.scale.numel() == 1 and q.qmax - q.qmin + 1 <= self.lut_size)

    def input_params(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The input quantizer's (scale, zero point) as scalars, detached (a learnable zero
        point rounded, as the quantizer rounds it)."""
        scale, zp = self.input_quant.effective_qparams()
        return scale.reshape(()), zp.reshape(())

    @torch.no_grad()
    def lookup_table(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(k, table)``: every index ``k = c_max - c`` (0 .. qmax - qmin) and ``exp(-s * k)``
        in float32, the value the row's code ``c`` contributes before normalisation."""
        if not self.uses_table():
            q = self.input_quant
            raise RuntimeError(f"{self.qat_name}: no lookup table (mode {self.mode}, input quantizer "
                               f"{q.fmt.name if q else None} state {q.state if q else None}); use mode 'lut' "
                               "and calibrate first")
        q = self.input_quant
        scale, _ = self.input_params()
        n = q.qmax - q.qmin + 1
        return torch.arange(n, dtype=torch.int32, device=scale.device), exp_table(scale, n)

    def forward(self, x: torch.Tensor, *addends) -> torch.Tensor:
        has_addends = False
        for a in addends:
            if a is not None:
                x = x + a
                has_addends = True
        if self.mode == "lut":
            y = lut_softmax(self, x, has_addends)
        else:
            if self.input_quant is not None:
                x = self.input_quant(x)
            y = F.softmax(x, dim=self.dim)
        # "lut" has an output quantizer only when prepare gave it one (P is a model output)
        return self.output_quant(y) if self.output_quant is not None else y

    def extra_repr(self) -> str:
        table = f", table={'on' if self.uses_table() else 'off'}" if self.mode == "lut" else ""
        return f"dim={self.dim}, mode={self.mode}{table}"


def softmax_mode(hardware) -> str:
    """How ``hardware`` runs the attention softmax:

    * ``"fp16"``: no hardware model (assume an FP16 vector engine), or ``softmax`` in ``fp16_ops``;
    * ``"lut"``: ``exp`` in ``lut_ops``, the ``softmax`` op takes int8 inputs and the table
      (``lut_size``) holds the 256 int8 code differences;
    * ``"float"``: otherwise (float32 softmax; the next matmul's input quantizer models the output).

    >>> from dal.hardware import load_hardware
    >>> softmax_mode(load_hardware("a1000")), softmax_mode(load_hardware("a2000")), softmax_mode(None)
    ('lut', 'fp16', 'fp16')
    """
    if hardware is None or hardware.runs_in_fp16("softmax"):
        return "fp16"
    codes = int(INT8.qmax - INT8.qmin) + 1
    if ("exp" in (hardware.lut_ops or ()) and INT8 in hardware.allowed_formats("softmax", "input")
            and (hardware.lut_size or 0) >= codes):
        return "lut"
    return "float"
