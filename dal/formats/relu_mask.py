"""ReLU and ReLU6 in place whose autograd node keeps a bit mask, not the result
(``relu_in_place``, ``relu6_in_place``).

``torch.relu_`` and ``F.hardtanh_`` save their result for the backward (``ReluBackward0``,
``HardtanhBackward0``): the tensor may then not be written again before the backward. A QAT
layer's activation output is what the next layer's input quantizer reads; where that quantizer
is the tensor's only reader it may fake-quantize the tensor in place (``dal.nn.sole_input``),
which a saved result forbids. These keep one bit per element instead (``dal_relu_mask_forward``
in ``csrc/fake_quant.cpp``, one pass: the values and the bits), so their output is free to
overwrite. ReLU6 is the activation of MobileNetV2 and of SSDlite's heads.

Same bits as torch:

* ReLU: forward ``x < 0 -> +0, else x`` (``-0`` and NaN kept, as ``torch.relu``); backward
  ``grad_in = grad where not (result <= 0), else +0`` (``threshold_backward(grad, result, 0)``).
* ReLU6: forward ``clamp(x, 0, 6)`` (``-0`` and NaN kept, as ``F.hardtanh_(x, 0, 6)``); backward
  ``grad_in = grad where 0 < result < 6, else +0`` (``hardtanh_backward``). For a NaN result
  torch itself differs: its vector body gives +0, its scalar tail (the last few elements) the
  gradient; this gives +0 everywhere.

tests/formats/test_formats_relu_mask.py compares both with torch on special values and random
tensors. Where the kernel does not apply (no C++ library, not a contiguous float32 CPU tensor,
tracing) they are ``torch.relu_`` / ``F.hardtanh_``.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from . import native
from .first_order import first_order
from .fused import plain_tensor

_F32 = torch.float32
_RELU, _RELU6 = 0.0, 6.0  # the kernel's ``top``: <= 0 no upper clip, else clamp(x, 0, top)


def relu_in_place(y: torch.Tensor) -> torch.Tensor:
    """``torch.relu_(y)``, by the bit-mask node where it applies (module doc); returns ``y``."""
    return ReluMaskFunction.apply(y, _RELU) if kernel_applies(y) else torch.relu_(y)


def relu6_in_place(y: torch.Tensor) -> torch.Tensor:
    """``F.hardtanh_(y, 0, 6)`` (ReLU6), by the bit-mask node where it applies (module doc); returns ``y``."""
    return ReluMaskFunction.apply(y, _RELU6) if kernel_applies(y) else F.hardtanh_(y, 0.0, 6.0)


def kernel_applies(y: torch.Tensor) -> bool:
    """Whether ``relu_in_place`` / ``relu6_in_place`` take the bit-mask node for ``y``: a
    contiguous float32 CPU tensor that autograd records (grad on, not a leaf nor a view), not
    traced or compiled, with the C++ library built."""
    return (y.requires_grad and torch.is_grad_enabled() and y.is_cpu and y.dtype is _F32 and y.is_contiguous()
            and y.numel() > 0 and plain_tensor(y) and not y.is_leaf and y._base is None
            and not (torch.jit.is_tracing() or torch.compiler.is_compiling())
            and native.library() is not None)


class ReluMaskFunction(torch.autograd.Function):
    """``(y, top) -> relu(y)`` (top 0) or ``clamp(y, 0, top)`` in place; the backward reads the
    forward's bit mask only (module doc)."""

    @staticmethod
    def forward(ctx, y, top):
        n = y.numel()
        mask = torch.empty((n + 7) // 8, dtype=torch.uint8)
        native.library().dal_relu_mask_forward(y.data_ptr(), mask.data_ptr(), n, top, torch.get_num_threads())
        ctx.mark_dirty(y)
        ctx.mask = mask  # a fresh tensor no one else holds or writes: no saved-tensor hooks to run
        return y

    @staticmethod
    @first_order
    def backward(ctx, grad_out):
        g = grad_out.to(_F32).contiguous()
        grad = torch.empty_like(g)
        native.library().dal_relu_mask_backward(g.data_ptr(), ctx.mask.data_ptr(), grad.data_ptr(), g.numel(),
                                                torch.get_num_threads())
        return grad, None
