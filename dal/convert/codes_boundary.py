"""The decoder files' codes boundary (``dal.export.decoder_module.CodesStep``) in the integer model,
outside NPUFloatOps' per-call dispatch.

``CodesStep`` dequantizes the ``past`` KV codes (DequantizeLinear, ``(c - zp) * s``) and quantizes
the step's ``key_i`` / ``value_i`` outputs (QuantizeLinear) with dal.formats' ``dequantize`` /
``quantize``. Those compute ONNX Q/DQ with torch ops none of which ``NPUFloatOps`` replaces (the same
ground as quant_calls.py's ``IntegerQuantizer``; tests/convert/test_codes_boundary.py checks it on
the functions themselves), so :class:`IntegerCodesStep` runs them with torch-function handling off
(``dispatch_off``): the same ops, the same values, ~600 fewer dispatched calls per decode step of a
4-layer decoder. The step between them (transformers' layers) still runs under the mode.

For a per-tensor integer quantizer (the LLM recipes' KV caches) the two run as the same torch ops as
dal.formats' ``dequantize`` / ``quantize`` without re-checking the quantizer's scale and zero point on
every call: ``(float32(c) - float32(zp)) * s`` and ``clamp(nan_to_num(round(float32(x) / s), 0) + zp,
qmin, qmax)`` with ``s`` float32, ``qmin, qmax`` the format's range. The constants are made, and
checked by one call of the dal.formats function, when first seen and again whenever the quantizer's
scale or zero point tensor is replaced or written (its data pointer or version changes); every other
quantizer (FP8, per channel, float casts) takes dal.formats' functions on every call. Inside a
``torch.compile`` capture (compiled.py: a frozen model) the kept constants are read without that
check (a data pointer cannot be traced).
"""
from __future__ import annotations

import torch
from torch import nn

from ..export.decoder_module import CodesStep
from ..formats import dequantize, quantize
from ..formats.qparams import code_range
from .quant_calls import dispatch_off


class IntegerCodesStep(CodesStep):
    """A ``CodesStep`` whose codes in / codes out run outside NPUFloatOps' dispatch (module doc):
    returns what ``CodesStep.forward`` returns, bit for bit. Printed as CodesStep."""

    def _get_name(self) -> str:
        return "CodesStep"

    def forward(self, input_ids, position_ids, mask, *past):
        with dispatch_off():
            floats = self.codes_in(past)
        out = self.step(input_ids, position_ids, mask, *floats)
        with dispatch_off():
            return self.codes_out(out)

    def codes_in(self, past: tuple) -> list:
        """``CodesStep.codes_in``'s values: the past codes dequantized, per-tensor integer ones with
        constants made once (module doc)."""
        qs = self._quantizers()
        if self.step.decode:
            self._check_past(qs, past)
        return [self._dequantize(q, c) for q, c in zip(qs, past)]

    def codes_out(self, out: tuple) -> tuple:
        """``CodesStep.codes_out``'s values: the step's KV outputs quantized (module doc)."""
        return (out[0], *(self._quantize(q, t) for q, t in zip(self._quantizers(), out[1:])))

    def _constants(self, q):
        """``(s, zp, zp_work, qmin, qmax, work)`` of a per-tensor integer quantizer ``q`` (0-dim float32
        scale and zero point, the zero point in the quantize's working dtype, the format's range, that
        dtype), None where dal.formats' route is taken, False while not made or stale."""
        fmt = q.fmt
        if not fmt.is_scaled or fmt.is_float8 or q.granularity.axis is not None:
            return None
        got = self.__dict__.setdefault("_kv_constants", {}).get(id(q))
        if torch.compiler.is_compiling():  # a captured model is frozen (compiled.py): the kept constants
            return got[2] if got is not None and got[0] is q else False
        key = (q.scale.data_ptr(), q.scale._version, q.zero_point.data_ptr(), q.zero_point._version, id(fmt))
        return got[2] if got is not None and got[0] is q and got[1] == key else False

    def _keep(self, q, s: torch.Tensor, zp: torch.Tensor) -> None:
        """Keep ``q``'s constants for :meth:`_constants`, once dal.formats has run (and checked) them."""
        if s.numel() == 1 and zp.numel() == 1:
            key = (q.scale.data_ptr(), q.scale._version, q.zero_point.data_ptr(), q.zero_point._version, id(q.fmt))
            qmin, qmax = code_range(q.fmt, False)
            work = torch.float64 if q.fmt.bits > 24 else torch.float32
            self.__dict__.setdefault("_kv_constants", {})[id(q)] = (
                q, key, (s.reshape(()), zp.reshape(()).to(torch.float32), zp.reshape(()).to(work), qmin, qmax, work))

    def _dequantize(self, q, c: torch.Tensor) -> torch.Tensor:
        k = self._constants(q)
        if not k:  # dal.formats (checks the scale and zero point); then keeps the constants if it may
            s, zp = q.effective_qparams()
            y = dequantize(c, q.fmt, s.float(), zp, q.granularity)
            if k is False:
                self._keep(q, s.float(), zp)
            return y
        return (c.to(torch.float32) - k[1]) * k[0]  # out of place: a float32 c is not written

    def _quantize(self, q, t: torch.Tensor) -> torch.Tensor:
        k = self._constants(q)
        if not k or not t.is_floating_point():
            s, zp = q.effective_qparams()
            y = quantize(t, q.fmt, s.float(), zp, q.granularity)
            if k is False:
                self._keep(q, s.float(), zp)
            return y
        v = torch.nan_to_num_(torch.round(t.float() / k[0]), nan=0.0).to(k[5]).add_(k[2])
        return v.clamp_(k[3], k[4]).to(q.fmt.torch_dtype())


def integer_boundary(net: nn.Module) -> bool:
    """Make ``net`` an :class:`IntegerCodesStep` when it is exactly a ``CodesStep`` (in place; a
    subclass is left as it is); True when it did."""
    if type(net) is not CodesStep:
        return False
    net.__class__ = IntegerCodesStep
    return True
