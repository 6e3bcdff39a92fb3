"""The integer model's quantizer calls, without per-call overhead that changes no value.

``IntegerModel`` runs its network under ``NPUFloatOps`` (float_ops.py), a ``TorchFunctionMode``:
every torch call in the forward, a tensor attribute read included, passes through a Python
handler first (about a microsecond each; a frozen quantizer's call makes a dozen). A quantizer
computes ONNX Q/DQ with torch ops none of which the mode replaces, so :class:`IntegerQuantizer`
runs its forward with torch-function handling off: the same ops, the same values.

A weight's quantizer (its input an ``nn.Parameter``: an embedding table, a norm's weight)
computes the same output on every call: it is kept and returned while the parameter, the output
and the quantizer's own buffers (scale, zero point, state) are unchanged (their ``_version``
counters and storage).

The forms of float islands (attention.py ``MatMulForm`` / ``SoftmaxForm``, rmsnorm.py) turn the
handling off the same way (:func:`dispatch_off`), except while the probe records a forward.
"""
from __future__ import annotations

import contextlib

import torch
from torch import nn

from ..quantizer import FakeQuantizer
from .probe import recording


def dispatch_off():
    """A context in which torch-function handling (NPUFloatOps' per-call dispatch) is off, for a
    form none of whose ops NPUFloatOps replaces; a no-op context while the probe records a forward
    (probe.py ``recording``), whose mode must see the functions a form calls at the top level."""
    return contextlib.nullcontext() if recording() else torch._C.DisableTorchFunction()


class IntegerQuantizer(FakeQuantizer):
    """A ``FakeQuantizer`` of the integer model (module doc): ``forward`` returns what
    ``FakeQuantizer.forward`` returns, bit for bit and with the same strides, computed with
    torch-function handling off, and kept across calls for an ``nn.Parameter`` input (no grad).
    Its name in printouts stays FakeQuantizer."""

    #: ``(key, output, output's version)`` of the last Parameter input (``_kept``): a plain
    #: attribute, not a buffer; the class default keeps its lookup off nn.Module.__getattr__
    _kept_output = None

    def _get_name(self) -> str:
        return "FakeQuantizer"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch._C.DisableTorchFunction():
            if isinstance(x, nn.Parameter) and not torch.is_grad_enabled():
                return self._kept(x)
            return super().forward(x)

    def _key(self, x: torch.Tensor) -> tuple:
        return (id(x), x.data_ptr(), x._version, self.state, self.scale._version, self.zero_point._version,
                self.scale.data_ptr(), self.zero_point.data_ptr())

    def _kept(self, x: torch.Tensor) -> torch.Tensor:
        kept = self._kept_output
        key = self._key(x)
        if kept is not None and kept[0] == key and kept[1]._version == kept[2]:
            return kept[1]
        y = super().forward(x)
        self._kept_output = (key, y, y._version)
        return y


def use_integer_quantizers(net: nn.Module) -> int:
    """Make every plain ``FakeQuantizer`` in ``net`` an :class:`IntegerQuantizer` (in place;
    subclasses are left as they are); returns how many."""
    n = 0
    for m in net.modules():
        if type(m) is FakeQuantizer:
            m.__class__ = IntegerQuantizer
            n += 1
    return n
