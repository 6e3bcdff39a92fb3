"""Autograd of fake quantization: straight-through estimator with clipping, and LSQ / LSQ+.

Kept apart from functional.py so that the forward formula and its gradients read side by side.
"""
from __future__ import annotations

import torch

from .granularity import Granularity


def reduce_to_param(t: torch.Tensor, param_shape: torch.Size, gran: Granularity) -> torch.Tensor:
    """Sum an input-shaped tensor down to the shape of its scale / zero point (the adjoint of
    ``Granularity.expand``)."""
    axis = gran.normalized_axis(t.dim())
    if axis is None:
        return t.sum().reshape(param_shape)
    if not gran.block_size:
        dims = [d for d in range(t.dim()) if d != axis]
        return t.sum(dim=dims).reshape(param_shape)
    shape = list(t.shape)
    shape[axis:axis + 1] = [shape[axis] // gran.block_size, gran.block_size]
    return t.reshape(shape).sum(dim=axis + 1).reshape(param_shape)


class FakeQuantizeFunction(torch.autograd.Function):
    """out = clamp(round(x / s), qmin - zp, qmax - zp) * s   (FP8: cast_sat(x / s) * s)."""

    @staticmethod
    def forward(ctx, x, scale, zero_point, fmt, gran, qmin, qmax, grad_scale):
        s = gran.expand(scale.to(x.dtype), x.shape)
        need_scale_grad = ctx.needs_input_grad[1]
        need_zp_grad = ctx.needs_input_grad[2]
        v = x / s
        if fmt.is_float8:
            limit = fmt.max_value
            mask = v.abs() <= limit
            clipped = torch.clamp(v, -limit, limit).to(fmt.torch_dtype()).to(x.dtype)
            lo_hi = None
        else:
            zp = torch.round(zero_point.to(x.dtype)) if zero_point.is_floating_point() else zero_point.to(x.dtype)
            zp = gran.expand(zp, x.shape)
            lo, hi = qmin - zp, qmax - zp
            r = torch.round(v) if need_scale_grad else torch.round_(v)
            mask = (r >= lo) & (r <= hi)
            clipped = torch.clamp_(r, lo, hi) if isinstance(lo, torch.Tensor) else r.clamp_(lo, hi)
            lo_hi = True
        if need_scale_grad:
            ctx.save_for_backward(mask, scale, v, clipped)
        else:
            ctx.save_for_backward(mask, scale)
        ctx.gran, ctx.grad_scale, ctx.need_zp_grad, ctx.is_int = gran, grad_scale, need_zp_grad, lo_hi
        return clipped.mul_(s) if not need_scale_grad else clipped * s

    @staticmethod
    def backward(ctx, grad_out):
        saved = ctx.saved_tensors
        mask, scale = saved[0], saved[1]
        gran = ctx.gran
        grad_x = grad_out * mask if ctx.needs_input_grad[0] else None
        grad_scale = grad_zp = None
        if ctx.needs_input_grad[1]:
            v, clipped = saved[2], saved[3]
            # clipped holds the code minus zero point; inside the range d/ds = c - v, outside c.
            local = torch.where(mask, clipped - v, clipped)
            grad_scale = reduce_to_param(grad_out * local, scale.shape, gran) * ctx.grad_scale
        if ctx.need_zp_grad:
            s = gran.expand(scale.to(grad_out.dtype), grad_out.shape)
            local = torch.where(mask, torch.zeros_like(grad_out), -s)
            grad_zp = reduce_to_param(grad_out * local, scale.shape, gran) * ctx.grad_scale
        return grad_x, grad_scale, grad_zp, None, None, None, None, None


class _CastRoundTrip(torch.autograd.Function):
    """x -> dtype -> x.dtype with an identity gradient (FP16 / BF16 fallback)."""

    @staticmethod
    def forward(ctx, x, dtype):
        return x.to(dtype).to(x.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        return grad_out, None


def fp_cast_fake_quantize(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Round ``x`` to ``dtype`` and back (overflow becomes +-inf, as ONNX Cast does)."""
    return _CastRoundTrip.apply(x, dtype)
