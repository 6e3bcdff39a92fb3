"""In-place ReLU and ReLU6 modules of a prepared model, trained by the bit-mask node.

``nn.ReLU(inplace=True)`` and ``nn.ReLU6(inplace=True)`` (torchvision's Conv2dNormActivation,
MobileNetV2 after every expand and depthwise conv, SSDlite's heads) write into their input and
record ``ReluBackward0`` / ``HardtanhBackward0``, which keep the result for the backward. The
next layer's input quantizer may then not write into that tensor (``dal.nn.sole_input`` checks
the node and refuses), so in a QAT step each such activation costs one more full-size tensor.

:func:`install` gives each such module an instance ``forward`` (:class:`MaskedActivation`) that
does the same write through ``dal.formats.relu_mask`` (``relu_in_place`` / ``relu6_in_place``):
the same values, the same gradient (for a NaN result ReLU6's is torch's vector body's, +0, at
every position; relu_mask's doc), a node that keeps one bit per element instead of the result.
The module, its class, its hooks and ``state_dict`` are unchanged (a hook still runs: the module
is called as before). Every call the kernel does not take (no grad, tracing, a leaf or a view, no
C++ library: ``relu_mask.kernel_applies``) and every call a ``TorchFunctionMode`` watches runs the
class's own ``forward``, the very call an unprepared model makes, so what watches the call
(dal.convert's probe reads the activation's bounds from it) sees what it would see without dal;
a mode would not see the autograd Function at all. (A fallback to ``F.hardtanh_``, which the
probe did not read then, once left an SSDlite head conv in float in dal.convert while dal.npu
fused it: 1 code in 13 M apart.) Only ``inplace=True`` modules: one that returns a new tensor
keeps its input intact for other readers, which this would overwrite.

Only tensors of at least :data:`MIN_ELEMENTS` values: the bit-mask node is a Python autograd
Function, ~20 us more per call (forward and backward) than torch's C++ op, and what it saves (one
full-size tensor, 0.2-0.5 ns a value) pays that back from ~60 K values. Measured: MobileNetV2,
batch 8 at 160x160, QAT step 313 -> 300 ms (float 266 ms); on SSDlite320, whose ReLU6 are in
its heads and mostly small, without the bound the step was 1.5-2.3 ms slower.
"""
from __future__ import annotations

import torch
from torch import nn
from torch.overrides import has_torch_function_unary

from ..formats.relu_mask import kernel_applies, relu6_in_place, relu_in_place

#: the module types (exactly) and the bit-mask op that does their in-place write
_MASKED = {nn.ReLU: relu_in_place, nn.ReLU6: relu6_in_place}
#: smaller tensors take torch's own op (module doc)
MIN_ELEMENTS = 1 << 16


def install(model: nn.Module) -> int:
    """Give every ``nn.ReLU`` / ``nn.ReLU6`` in ``model`` with ``inplace=True`` a
    :class:`MaskedActivation` forward; returns how many. Idempotent."""
    n = 0
    for m in model.modules():
        if type(m) in _MASKED and m.inplace and "forward" not in m.__dict__:
            m.forward = MaskedActivation(m)
            n += 1
    return n


class MaskedActivation:
    """An in-place ReLU / ReLU6 module's instance ``forward`` (module doc). An object rather than
    a bound method so that the model pickles and deep-copies with it."""

    __slots__ = ("module",)

    def __init__(self, module: nn.Module):
        self.module = module

    def __reduce__(self):
        return MaskedActivation, (self.module,)

    def __call__(self, input):
        m = self.module
        if (type(input) is not torch.Tensor or has_torch_function_unary(input) or not m.inplace
                or input.numel() < MIN_ELEMENTS or not kernel_applies(input)):
            # an fx Proxy, a subclass, a function mode active; inplace switched off; small; no kernel
            return type(m).forward(m, input)
        return _MASKED[type(m)](input)
