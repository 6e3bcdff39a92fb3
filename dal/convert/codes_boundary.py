"""The decoder files' codes boundary (``dal.export.decoder_module.CodesStep``) in the integer model,
outside NPUFloatOps' per-call dispatch.

``CodesStep`` dequantizes the ``past`` KV codes (DequantizeLinear, ``(c - zp) * s``) and quantizes
the step's ``key_i`` / ``value_i`` outputs (QuantizeLinear) with dal.formats' ``dequantize`` /
``quantize``. Those compute ONNX Q/DQ with torch ops none of which ``NPUFloatOps`` replaces (the same
ground as quant_calls.py's ``IntegerQuantizer``; tests/convert/test_codes_boundary.py checks it on
the functions themselves), so :class:`IntegerCodesStep` runs them with torch-function handling off
(``dispatch_off``): the same ops, the same values, ~600 fewer dispatched calls per decode step of a
4-layer decoder. The step between them (transformers' layers) still runs under the mode.
"""
from __future__ import annotations

from torch import nn

from ..export.decoder_module import CodesStep
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


def integer_boundary(net: nn.Module) -> bool:
    """Make ``net`` an :class:`IntegerCodesStep` when it is exactly a ``CodesStep`` (in place; a
    subclass is left as it is); True when it did."""
    if type(net) is not CodesStep:
        return False
    net.__class__ = IntegerCodesStep
    return True
