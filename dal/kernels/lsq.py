"""``dal::fake_quantize_lsq``: fake quantization with a learnable scale and zero point (LSQ / LSQ+)
as one registered op, its gradient registered once (``register_autograd``).

Forward: the parameters projected into range, ``s = max(scale, MIN_SCALE)`` and, integer formats,
``zp = round_half_even(clamp(zero_point, qmin, qmax))``; then ``dal::fake_quantize``'s formula
(:func:`.fake_quant.codes`): ``v = x / s``, ``c = clamp(round(v), qmin - zp, qmax - zp)`` (FP8:
``c = fp8(clamp(v, -max, max))``), ``y = c * s`` in float32, cast to ``x``'s dtype. With the
clip mask ``m`` (``qmin - zp <= round(v) <= qmax - zp``; FP8 ``|v| <= max``) and LSQ's gradient
scale ``g`` (the caller's ``grad_scale``, ``1 / sqrt(N_per_scale * qmax)`` for a quantizer):

* ``d y / d x  = m``;
* ``d y / d s  = (c - v) * g`` where ``m``, ``c * g`` elsewhere, summed over each scale's elements;
* ``d y / d zp = 0`` where ``m``, ``-s * g`` elsewhere, summed likewise;
* the projection passes gradients straight through (``d s / d scale = 1``).

These are the gradients of the eager ``dal.formats.autograd.FakeQuantizeFunction`` (the same
float32 operations in the same order, so the same bits: tests/kernels/test_kernels_lsq.py).
Eagerly a quantizer projects its Parameters in place before the call (``project_learned_qparams_``),
so the op's projection is the identity there; under ``torch.compile`` the op's projection is the
one applied (no write into the Parameter, no host read of its value): the same output and
gradients, while an out-of-range Parameter keeps its raw value. A NaN scale gives NaN outputs
here (eagerly the quantizer raises before the call).

One implementation, plain torch, for every device (the C++ kernel of ``dal::fake_quantize`` does
not produce ``v`` and ``c``, which the scale's gradient needs). The op returns ``(y, mask,
local)``: ``mask`` (bool, empty unless ``need_mask``) and ``local = where(m, c - v, c)``
(float32, empty unless ``need_local``) are what the backward reads.
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from ..formats.autograd import broadcast_view, reduce_to_param
from ..formats.granularity import PER_TENSOR, Granularity
from ..formats.qparams import MIN_SCALE
from .fake_quant import codes, op_format_args, laid_out_like


def lsq_grad_scale(numel: int, scale_numel: int, qmax: float) -> float:
    """LSQ's gradient scale ``g = 1 / sqrt(N * qmax)`` for a tensor of ``numel`` elements over
    ``scale_numel`` scales (``N = numel // scale_numel``, at least 1; ``qmax`` at least 1): it keeps
    a scale's step size comparable to the weights'."""
    per_scale = max(numel // max(scale_numel, 1), 1)
    return 1.0 / math.sqrt(per_scale * max(abs(qmax), 1.0))


def _projected(scale, zero_point, qmin: float, qmax: float, mode: int):
    s = torch.clamp(scale, min=MIN_SCALE)
    zp = zero_point if mode else torch.clamp(zero_point, qmin, qmax)
    return s, zp


@torch.library.custom_op("dal::fake_quantize_lsq", mutates_args=())
def fake_quantize_lsq_op(x: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor, qmin: float, qmax: float,
                         axis: Optional[int], block_size: int, mode: int, grad_scale: float, need_mask: bool,
                         need_local: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(y, mask, local)`` of the module docstring (``grad_scale`` is read by the backward only)."""
    s, zp = _projected(scale, zero_point, qmin, qmax, mode)
    v, c, mask, sb = codes(x, s, zp, qmin, qmax, axis, block_size, mode, need_mask or need_local)
    y = laid_out_like(x, (c * sb).reshape(x.shape), x.dtype)
    empty_mask = x.new_empty(0, dtype=torch.bool)
    m = laid_out_like(x, mask.reshape(x.shape), torch.bool) if need_mask or need_local else empty_mask
    local = laid_out_like(x, torch.where(mask, c - v, c).reshape(x.shape), torch.float32) if need_local \
        else x.new_empty(0, dtype=torch.float32)
    return y, m, local


@fake_quantize_lsq_op.register_fake
def _fake(x, scale, zero_point, qmin, qmax, axis, block_size, mode, grad_scale, need_mask, need_local):
    mask = torch.empty_like(x, dtype=torch.bool) if need_mask or need_local else x.new_empty(0, dtype=torch.bool)
    local = torch.empty_like(x, dtype=torch.float32) if need_local else x.new_empty(0, dtype=torch.float32)
    return torch.empty_like(x), mask, local


def _setup_context(ctx, inputs, output):
    x, scale, zero_point, qmin, qmax, axis, block_size, mode, grad_scale, _, _ = inputs
    ctx.save_for_backward(output[1], output[2], scale, zero_point)
    ctx.qmin, ctx.qmax, ctx.mode, ctx.grad_scale = qmin, qmax, mode, grad_scale
    ctx.gran = Granularity(axis, block_size)


def _backward(ctx, grad_y, grad_mask, grad_local):
    mask, local, scale, zero_point = ctx.saved_tensors
    need_x, need_s, need_zp = ctx.needs_input_grad[:3]
    if (need_x or need_zp) and mask.numel() != grad_y.numel() or need_s and local.numel() != grad_y.numel():
        raise RuntimeError("dal::fake_quantize_lsq was called with need_mask / need_local False but a gradient is "
                           "asked for; call it through dal.kernels.fake_quantize_lsq, which sets them")
    gran, shape = ctx.gran, grad_y.shape
    work, view = broadcast_view(gran, shape)
    g = grad_y.reshape(work)
    grad_x = (g * mask.reshape(work)).reshape(shape) if need_x else None
    grad_s = grad_zp = None
    if need_s:
        grad_s = reduce_to_param((g * local.reshape(work)).reshape(shape), scale.shape, gran) * ctx.grad_scale
    if need_zp:
        s, _ = _projected(scale, zero_point, ctx.qmin, ctx.qmax, ctx.mode)
        s = view(s.to(grad_y.dtype))
        lz = torch.where(mask.reshape(work), torch.zeros_like(g), -s)
        grad_zp = reduce_to_param((g * lz).reshape(shape), scale.shape, gran) * ctx.grad_scale
    return grad_x, grad_s, grad_zp, None, None, None, None, None, None, None, None


fake_quantize_lsq_op.register_autograd(_backward, setup_context=_setup_context)


def fake_quantize_lsq(x: torch.Tensor, scale: torch.Tensor, zero_point: Optional[torch.Tensor], fmt,
                      granularity: Granularity = PER_TENSOR, narrow_range: bool = False,
                      grad_scale: float = 1.0) -> torch.Tensor:
    """LSQ / LSQ+ fake quantization by ``dal::fake_quantize_lsq``: ``y`` in ``x``'s dtype with the
    gradients of the module docstring for ``x``, ``scale`` and ``zero_point`` (each only where it
    requires grad; zero point None: 0). Integer or FP8 ``fmt`` at ``granularity``; ``scale`` /
    ``zero_point`` shaped ``granularity.scale_shape(x.shape)``; ``grad_scale`` is LSQ's ``g``.

    >>> s = torch.tensor(1.0, requires_grad=True)
    >>> fake_quantize_lsq(torch.tensor([0.3, 1.5, 300.0]), s, None, "int8").sum().backward()
    >>> round(s.grad.item(), 4)   # (0 - 0.3) + (2 - 1.5) + 127
    127.2
    """
    mode, qmin, qmax = op_format_args(fmt, narrow_range)
    if zero_point is None:
        zero_point = torch.zeros(scale.shape, dtype=torch.float32, device=scale.device)
    grad = torch.is_grad_enabled()
    need_local = grad and scale.requires_grad
    need_mask = grad and (x.requires_grad or zero_point.requires_grad)
    y, _, _ = fake_quantize_lsq_op(x, scale, zero_point, float(qmin), float(qmax),
                                   granularity.normalized_axis(x.dim()), granularity.block_size, mode,
                                   float(grad_scale), need_mask, need_local)
    return y
