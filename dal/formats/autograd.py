"""Autograd of fake quantization: straight-through estimator with clipping, and LSQ / LSQ+.

Kept apart from functional.py so that the forward formula and its gradients read side by side.
"""
from __future__ import annotations

import torch

from .fp_cast import kernel_round_trip
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


def broadcast_view(gran: Granularity, shape: torch.Size) -> tuple[list[int], callable]:
    """``(work_shape, view)``: x reshaped to ``work_shape`` broadcasts against ``view(param)``.

    Per group, the blocked axis is split into ``(blocks, block_size)`` and the parameter gets a
    1 after it, so parameters are broadcast, never repeated to the input's size: cheaper, and
    torch's ``clamp`` takes the same broadcasting kernel for every granularity (its full-size
    tensor kernel treats -0.0 and NaN differently, which would change the output's bits).
    """
    axis = gran.normalized_axis(len(shape))
    if axis is None or not gran.block_size:
        return list(shape), lambda p: gran.expand(p, shape)
    work = list(shape)
    work[axis:axis + 1] = [shape[axis] // gran.block_size, gran.block_size]
    return work, lambda p: p.unsqueeze(axis + 1)


class FakeQuantizeFunction(torch.autograd.Function):
    """out = clamp(round(x / s), qmin - zp, qmax - zp) * s   (FP8: cast_sat(x / s) * s)."""

    @staticmethod
    def forward(ctx, x, scale, zero_point, fmt, gran, qmin, qmax, grad_scale):
        work, view = broadcast_view(gran, x.shape)
        xw = x.reshape(work)
        s = view(scale.to(x.dtype))
        need_scale_grad = ctx.needs_input_grad[1]
        need_zp_grad = ctx.needs_input_grad[2]
        v = xw / s
        if fmt.is_float8:
            limit = fmt.max_value
            mask = v.abs() <= limit
            clipped = torch.clamp(v, -limit, limit).to(fmt.torch_dtype()).to(x.dtype)
        else:
            zp = torch.round(zero_point.to(x.dtype)) if zero_point.is_floating_point() else zero_point.to(x.dtype)
            zp = view(zp)
            lo, hi = qmin - zp, qmax - zp
            r = torch.round(v) if need_scale_grad else torch.round_(v)
            mask = (r >= lo) & (r <= hi)
            clipped = torch.clamp_(r, lo, hi) if isinstance(lo, torch.Tensor) else r.clamp_(lo, hi)
        if need_scale_grad:
            ctx.save_for_backward(mask, scale, v, clipped)
        else:
            ctx.save_for_backward(mask, scale)
        ctx.gran, ctx.grad_scale, ctx.need_zp_grad = gran, grad_scale, need_zp_grad
        out = clipped.mul_(s) if not need_scale_grad else clipped * s
        return out.reshape(x.shape)

    @staticmethod
    def backward(ctx, grad_out):
        saved = ctx.saved_tensors
        mask, scale = saved[0], saved[1]
        gran = ctx.gran
        shape = grad_out.shape
        work, view = broadcast_view(gran, shape)
        g = grad_out.reshape(work)
        grad_x = (g * mask).reshape(shape) if ctx.needs_input_grad[0] else None
        grad_scale = grad_zp = None
        if ctx.needs_input_grad[1]:
            v, clipped = saved[2], saved[3]
            # clipped holds the code minus zero point; inside the range d/ds = c - v, outside c.
            local = torch.where(mask, clipped - v, clipped)
            grad_scale = reduce_to_param((g * local).reshape(shape), scale.shape, gran) * ctx.grad_scale
        if ctx.need_zp_grad:
            s = view(scale.to(grad_out.dtype))
            local = torch.where(mask, torch.zeros_like(g), -s)
            grad_zp = reduce_to_param((g * local).reshape(shape), scale.shape, gran) * ctx.grad_scale
        return grad_x, grad_scale, grad_zp, None, None, None, None, None


class _CastRoundTrip(torch.autograd.Function):
    """x -> dtype -> x.dtype with an identity gradient (FP16 / BF16): one C++ pass where
    ``fp_cast.kernel_round_trip`` applies, else torch's two casts (the same bits)."""

    @staticmethod
    def forward(ctx, x, dtype):
        out = kernel_round_trip(x, dtype)
        return x.to(dtype).to(x.dtype) if out is None else out

    @staticmethod
    def backward(ctx, grad_out):
        return grad_out, None  # identity: the incoming gradient itself, no copy


def fp_cast_fake_quantize(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Round ``x`` to ``dtype`` and back (overflow becomes +-inf, as ONNX Cast does);
    ``d out / d x = 1``. Without a gradient to record, no autograd node is made."""
    if not (x.requires_grad and torch.is_grad_enabled()):
        out = kernel_round_trip(x, dtype)
        if out is not None:
            return out
    return _CastRoundTrip.apply(x, dtype)


class _Pow2FromLog2(torch.autograd.Function):
    """s = 2^r(t) with r = round (nearest) or ceil (cover); straight-through: ds/dt = s * ln 2."""

    @staticmethod
    def forward(ctx, log2_scale, cover: bool):
        k = torch.ceil(log2_scale) if cover else torch.round(log2_scale)
        s = torch.pow(2.0, k)
        ctx.save_for_backward(s)
        return s

    @staticmethod
    def backward(ctx, grad_out):
        (s,) = ctx.saved_tensors
        return grad_out * s * 0.6931471805599453, None


def pow2_scale_ste(log2_scale: torch.Tensor, rounding: str = "nearest") -> torch.Tensor:
    """LSQ with power-of-two scales: the learned parameter is ``t = log2 s``; the forward uses
    ``s = 2^round(t)`` ("nearest") or ``2^ceil(t)`` ("cover"), exactly a power of two, and the
    backward passes the gradient straight through the rounding in the log domain
    (``ds/dt = s ln 2``), so ``t`` accumulates small steps until the exponent changes.

    Learning ``t`` rather than ``s`` keeps the update relative (a step moves the scale by a
    factor, whatever its size), which is what makes a rounded exponent train stably.

    >>> pow2_scale_ste(torch.tensor([-3.4, -3.6])).tolist()
    [0.125, 0.0625]
    """
    if rounding not in ("nearest", "cover"):
        raise ValueError(f"rounding={rounding!r} is not allowed (allowed: nearest, cover)")
    return _Pow2FromLog2.apply(log2_scale, rounding == "cover")
