"""``dal::fake_quantize`` in plain torch as a ``torch.autograd.Function`` that dynamo inlines:
the form ``dal.quantizer_ops`` uses under ``torch.compile`` (inductor then fuses it with the
neighbouring BatchNorm / ReLU / add kernels instead of calling an opaque op, one pass over memory less).

Forward: ``c * s`` of :func:`dal.kernels.fake_quant.codes`, the op's formula (``v = float32(x) / s``, a true
division; round half to even; clamp to the code range minus zero point; FP8: saturate and round to
the FP8 format), cast to ``x``'s dtype. Backward: the straight-through estimator with the clip mask,
``grad * mask`` (``0 * g`` keeps g's sign), the scale and zero point get no gradient. The same bits
as the op on the same inputs, eagerly and compiled by inductor (tests/kernels/test_fake_quant_inline.py):
inductor emits the division as a division and ``round`` as round-half-even (``nearbyint``), and
clamps / multiplies are exact or correctly rounded single operations.
"""
from __future__ import annotations

from typing import Optional

import torch

from ..formats.granularity import PER_TENSOR, Granularity
from .fake_quant import codes, op_format_args


class FakeQuantizeInline(torch.autograd.Function):
    """``y = fake_quantize(x)`` with ``d y / d x = mask`` (module docstring), plain torch both ways."""

    @staticmethod
    def forward(ctx, x, scale, zero_point, qmin: float, qmax: float, axis: Optional[int], block_size: int,
                mode: int):
        _, c, mask, s = codes(x, scale, zero_point, qmin, qmax, axis, block_size, mode, True)
        ctx.save_for_backward(mask)
        return (c * s).reshape(x.shape).to(x.dtype)

    @staticmethod
    def backward(ctx, grad_y):
        (mask,) = ctx.saved_tensors
        return grad_y * mask.reshape(grad_y.shape), None, None, None, None, None, None, None


def fake_quantize_inline(x: torch.Tensor, scale: torch.Tensor, zero_point: Optional[torch.Tensor], fmt,
                         granularity: Granularity = PER_TENSOR, narrow_range: bool = False) -> torch.Tensor:
    """:func:`dal.kernels.fake_quantize`'s contract and bits (integer or FP8 ``fmt``; ``scale`` /
    ``zero_point`` shaped ``granularity.scale_shape(x.shape)``, zero point None: 0; ``y`` in x's
    dtype; ``d y / d x`` the clip mask) by :class:`FakeQuantizeInline`.

    >>> fake_quantize_inline(torch.tensor([0.5, 1.5, 2.5, 300.0]), torch.tensor(1.0), None, "int8").tolist()
    [0.0, 2.0, 2.0, 127.0]
    """
    mode, qmin, qmax = op_format_args(fmt, narrow_range)
    if zero_point is None:
        zero_point = torch.zeros(scale.shape, dtype=torch.int32, device=scale.device)
    return FakeQuantizeInline.apply(x, scale, zero_point, float(qmin), float(qmax),
                                    granularity.normalized_axis(x.dim()), granularity.block_size, mode)
