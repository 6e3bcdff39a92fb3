"""ReLU in place whose autograd node keeps a bit mask, not the result (``relu_in_place``).

``torch.relu_`` saves its result for the backward (``ReluBackward0``): the tensor may then not
be written again before the backward. A QAT layer's ReLU output is what the next layer's input
quantizer reads; where that quantizer is the tensor's only reader it may fake-quantize the
tensor in place (``dal.nn.sole_input``), which a saved result forbids. This ReLU keeps one bit
per element instead (``dal_relu_mask_forward`` in ``csrc/fake_quant.cpp``, one pass: the values
and the bits), so its output is free to overwrite.

Same bits as torch: forward ``x < 0 -> +0, else x`` (``-0`` and NaN kept, as ``torch.relu``);
backward ``grad_in = grad where not (result <= 0), else +0`` (``threshold_backward(grad,
result, 0)``). tests/formats/test_formats_relu_mask.py compares both with torch on special values and
random tensors. Where the kernel does not apply (no C++ library, not a contiguous float32 CPU
tensor, tracing) it is ``torch.relu_``.
"""
from __future__ import annotations

import torch

from . import native
from .first_order import first_order
from .fused import plain_tensor

_F32 = torch.float32


def relu_in_place(y: torch.Tensor) -> torch.Tensor:
    """``torch.relu_(y)``, by the bit-mask node where it applies (module doc); returns ``y``."""
    if (y.requires_grad and torch.is_grad_enabled() and y.is_cpu and y.dtype is _F32 and y.is_contiguous()
            and y.numel() and plain_tensor(y) and not y.is_leaf and y._base is None
            and not (torch.jit.is_tracing() or torch.compiler.is_compiling())
            and native.library() is not None):
        return ReluMaskFunction.apply(y)
    return torch.relu_(y)


class ReluMaskFunction(torch.autograd.Function):
    """``y -> relu(y)`` in place; the backward reads the forward's bit mask only (module doc)."""

    @staticmethod
    def forward(ctx, y):
        n = y.numel()
        mask = torch.empty((n + 7) // 8, dtype=torch.uint8)
        native.library().dal_relu_mask_forward(y.data_ptr(), mask.data_ptr(), n, torch.get_num_threads())
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
        return grad
