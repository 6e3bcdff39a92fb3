"""QConvBn2d's fold factor ``f = gamma / sqrt(running_var + eps)``, each operation correctly
rounded, in one C++ call.

``dal.nn.conv_bn`` folds, per output channel,

    std = sqrt(running_var + eps);  raw = gamma / std;  f = raw           (eval, export)
                                                        f = raw where raw != 0, else 1   (training)

(a zero-gamma channel takes f = 1 in training: its BN output is beta whatever the conv computes).

Why not torch's ops: ``torch.sqrt`` of float32 on the CPU is not correctly rounded (measured with
torch 2.14.1 here: one ulp off on 0.66% of inputs against IEEE sqrt, and which inputs depends on
the math library of the build and the CPU), so the folded weight, and the exported int8 codes on
near-ties, would depend on the machine that exported them. Here every step is IEEE float32:
``eps`` rounded to float32 first (as torch adds a Python float to a float32 tensor), then add,
sqrt and division each correctly rounded; the torch fallback computes the square root in float64
and rounds once, which is the same value (double rounding is innocuous for sqrt, 53 >= 2*24 + 2).

Why a kernel: as torch ops the training factor is five dispatches forward and three backward
nodes per layer and step on vectors of a few hundred values (bench/results/detection_speed.md).

:class:`FoldFactorFunction`'s backward is autograd's chain for the formula exactly:
``d gamma = where(raw != 0, g, +0) / std`` (training), ``g / std`` (eval); ``running_var`` gets
no gradient (a buffer).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch.autograd.function import once_differentiable

from . import native
from .fused import plain_tensor

_F32 = torch.float32


def fold_factor_parts(gamma: Optional[torch.Tensor], running_var: torch.Tensor, eps: float,
                      ones_for_zero: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(f, std, keep)`` by the C++ kernel, no autograd (tensors as :func:`kernel_applies`
    accepts them): ``std = sqrt(running_var + eps)`` and ``keep = raw != 0`` (uint8) are what
    :func:`fold_factor_grad` needs to turn ``d f`` into ``d gamma``."""
    n = running_var.numel()
    f, std, keep = torch.empty(n), torch.empty(n), torch.empty(n, dtype=torch.uint8)
    native.library().dal_fold_factor(None if gamma is None else gamma.data_ptr(), running_var.data_ptr(), eps,
                                     n, int(ones_for_zero), f.data_ptr(), std.data_ptr(), keep.data_ptr())
    return f, std, keep


def fold_factor_grad(grad_f: torch.Tensor, std: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """``d gamma = where(keep, d f, +0) / std``, autograd's chain for the formula (module doc)."""
    g = grad_f.to(_F32).contiguous()
    grad = torch.empty_like(std)
    native.library().dal_fold_factor_backward(g.data_ptr(), std.data_ptr(), keep.data_ptr(), g.numel(),
                                              grad.data_ptr())
    return grad


class FoldFactorFunction(torch.autograd.Function):
    """``f`` from ``(gamma or None, running_var, eps, ones_for_zero)`` (module doc); gradient for gamma."""

    @staticmethod
    def forward(ctx, gamma: Optional[torch.Tensor], running_var: torch.Tensor, eps: float,
                ones_for_zero: bool) -> torch.Tensor:
        f, std, keep = fold_factor_parts(gamma, running_var, eps, ones_for_zero)
        # fresh tensors no one else holds or writes: kept as attributes (no saved-tensor hooks to run)
        ctx.std, ctx.keep = std, keep
        return f

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_f: torch.Tensor):
        if not ctx.needs_input_grad[0]:
            return None, None, None, None
        return fold_factor_grad(grad_f, ctx.std, ctx.keep), None, None, None


def _plain(t: Optional[torch.Tensor], n: int) -> bool:
    return t is None or (t.is_cpu and t.dtype is _F32 and t.dim() == 1 and t.numel() == n and t.is_contiguous()
                         and plain_tensor(t))


def fold_factor_torch(gamma: Optional[torch.Tensor], running_var: torch.Tensor, eps: float,
                      ones_for_zero: bool) -> torch.Tensor:
    """The same values with torch ops, on any device and dtype (the square root in float64,
    rounded once: correctly rounded, unlike float32 ``torch.sqrt`` on the CPU)."""
    var_eps = running_var + eps
    std = torch.sqrt(var_eps.double()).to(var_eps.dtype)
    raw = gamma / std if gamma is not None else 1.0 / std
    return torch.where(raw != 0, raw, 1.0) if ones_for_zero else raw


def kernel_applies(gamma: Optional[torch.Tensor], running_var: torch.Tensor) -> bool:
    """Whether :func:`fold_factor` takes the C++ kernel for these tensors: CPU float32 plain
    contiguous vectors of one length, a constant variance, the kernel loaded."""
    n = running_var.numel()
    return bool(n) and not running_var.requires_grad and _plain(running_var, n) and _plain(gamma, n) \
        and native.library() is not None


def fold_factor(gamma: Optional[torch.Tensor], running_var: torch.Tensor, eps: float,
                ones_for_zero: bool = False) -> torch.Tensor:
    """``raw = gamma / sqrt(running_var + eps)`` per channel (``gamma`` None: a BN without affine
    parameters, ``1 / std``), each operation correctly rounded; with ``ones_for_zero``, 1 where
    ``raw`` is 0 (QConvBn2d training). Differentiable in ``gamma``, and in ``running_var`` when it
    requires grad (batch statistics: the torch route). The C++ kernel on CPU float32 plain tensors
    and a constant variance, else the torch ops of :func:`fold_factor_torch` (the same values)."""
    if kernel_applies(gamma, running_var):
        return FoldFactorFunction.apply(gamma, running_var, float(eps), bool(ones_for_zero))
    return fold_factor_torch(gamma, running_var, eps, ones_for_zero)
