"""``y / f`` per output channel, QConvBn2d's 1/f on the conv output, with a one-pass backward.

In training, QConvBn2d undoes its BN folding on the conv output where its weight is large
against that output (``conv(x, fq(W f)) / f``; ``QConvBn2d._divide_output`` says when). As a plain broadcast division, autograd's backward
(DivBackward0) makes five passes over the conv output: ``grad / f`` for y, and for f
``-grad * ((y / f) / f)`` as four separate ops, then the sum over batch and space. Here the
elementwise part is one C++ pass (``dal_channel_divide_backward`` in
``dal/formats/csrc/fake_quant.cpp``) with the same float32 expressions in the same order, and
the sum is torch's own reduction over the same axes (autograd's ``sum_to``): output and both
gradients are bit-identical to ``y / f.reshape(1, -1, 1, 1)`` (tests/nn/test_channel_divide.py).
Anything the kernel does not take (not CPU float32 contiguous, tracing, no kernel) is that
plain division.
"""
from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from ..formats import native
from ..formats.fused import plain_tensor


def _eligible(y: torch.Tensor, f: torch.Tensor) -> bool:
    if y.dim() < 2 or f.dim() != 1 or y.shape[1] != f.numel() or not y.numel():
        return False
    for t in (y, f):
        if not t.is_cpu or t.dtype != torch.float32 or not t.is_contiguous() or not plain_tensor(t):
            return False
    return native.library() is not None


def channel_divide(y: torch.Tensor, f: torch.Tensor) -> torch.Tensor:
    """``y / f.reshape(1, -1, 1, ...)`` for ``y`` of shape ``[N, C, ...]`` and ``f`` of shape ``[C]``:
    the same bits forward and backward, the backward in one pass over ``y`` (module doc)."""
    if _eligible(y, f):
        return ChannelDivideFunction.apply(y, f)
    return y / f.reshape(1, -1, *[1] * (y.dim() - 2))


class ChannelDivideFunction(torch.autograd.Function):
    """``z = y / f[c]``; backward ``grad_y = g / f``, ``grad_f = sum_{n, ...} (-g) * ((y / f) / f)``."""

    @staticmethod
    def forward(ctx, y, f):
        fb = f.reshape(1, -1, *[1] * (y.dim() - 2))
        ctx.save_for_backward(y, f)
        return y / fb

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        y, f = ctx.saved_tensors
        need_y, need_f = ctx.needs_input_grad
        g = grad_out.to(torch.float32).contiguous()
        grad_y = torch.empty_like(g) if need_y else None
        t = torch.empty_like(g) if need_f else None
        if need_y or need_f:
            outer, channels = y.shape[0], y.shape[1]
            native.library().dal_channel_divide_backward(
                g.data_ptr(), y.data_ptr(), f.data_ptr(), grad_y.data_ptr() if need_y else None,
                t.data_ptr() if need_f else None, outer, channels, y.numel() // (outer * channels),
                torch.get_num_threads())
        grad_f = None
        if need_f:
            # autograd's sum_to(t, [1, C, 1, ...]): every axis where the broadcast shape has 1
            dims = [d for d in range(y.dim()) if d != 1 and y.shape[d] != 1]
            grad_f = (t.sum(dims, keepdim=True) if dims else t).reshape(f.shape)
        return grad_y, grad_f
