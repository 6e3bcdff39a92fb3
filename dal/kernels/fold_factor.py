"""``dal::fold_factor``: QConvBn2d's per-channel fold factor as one registered op whose results
autograd saves.

``fold_factor(gamma, running_var, eps, ones_for_zero) -> (f, std, keep)`` with, per channel,
``std = sqrt(running_var + eps)`` (each operation correctly rounded), ``raw = gamma / std``
(``1 / std`` when ``gamma`` is None), ``keep = raw != 0`` and ``f = raw``, or 1 where ``raw`` is 0
when ``ones_for_zero`` (training). ``d gamma = where(keep, d f, +0) / std``; the variance gets no
gradient. The values and gradient of ``dal.formats.fold_factor.fold_factor``.

Why an op: in training BatchNorm updates ``running_var`` in place in the same forward. Under
``torch.compile`` AOTAutograd's partitioner may recompute plain-torch intermediates in the
backward from the graph's inputs, so a fold factor written as torch ops is recomputed from the
already updated variance and the weights' and gamma's gradients come out slightly different from
the eager step's (pytorch/pytorch#197039, open: "Don't recompute reads of mutated inputs or mutable
buffers"). This op's outputs are saved, not recomputed: the compiled gradients are the eager ones.

CPU: the C++ kernel ``dal_fold_factor`` for float32 contiguous vectors (as
``dal.formats.fold_factor.kernel_applies``), else the generic torch implementation: the square
root in float64, rounded once to float32, which is the same correctly rounded value.
"""
from __future__ import annotations

from typing import Optional

import torch

from ..formats.fold_factor import fold_factor_parts, kernel_applies


def generic(gamma: Optional[torch.Tensor], running_var: torch.Tensor, eps: float, ones_for_zero: bool):
    """``(f, std, keep)`` in plain torch on any device (module docstring)."""
    var_eps = running_var + eps
    std = torch.sqrt(var_eps.double()).to(var_eps.dtype)
    raw = gamma / std if gamma is not None else 1.0 / std
    if not ones_for_zero:
        return raw.clone(), std, torch.ones_like(raw, dtype=torch.bool)
    keep = raw != 0
    return torch.where(keep, raw, 1.0), std, keep


@torch.library.custom_op("dal::fold_factor", mutates_args=())
def fold_factor_op(gamma: Optional[torch.Tensor], running_var: torch.Tensor, eps: float,
                   ones_for_zero: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(f, std, keep)`` of the module docstring; the device-generic implementation."""
    return generic(gamma, running_var, eps, ones_for_zero)


@fold_factor_op.register_kernel("cpu")
def _cpu(gamma, running_var, eps, ones_for_zero):
    g = None if gamma is None else gamma.detach()
    if kernel_applies(g, running_var.detach()):
        f, std, keep = fold_factor_parts(g, running_var.detach(), eps, ones_for_zero)
        return f, std, keep.to(torch.bool)
    return generic(gamma, running_var, eps, ones_for_zero)


@fold_factor_op.register_fake
def _fake(gamma, running_var, eps, ones_for_zero):
    return (torch.empty_like(running_var), torch.empty_like(running_var),
            torch.empty_like(running_var, dtype=torch.bool))


def _setup_context(ctx, inputs, output):
    _, std, keep = output
    ctx.save_for_backward(std, keep)


def _backward(ctx, grad_f, grad_std, grad_keep):
    std, keep = ctx.saved_tensors
    return torch.where(keep, grad_f, 0.0) / std, None, None, None


fold_factor_op.register_autograd(_backward, setup_context=_setup_context)


def fold_factor(gamma: Optional[torch.Tensor], running_var: torch.Tensor, eps: float,
                ones_for_zero: bool = False) -> torch.Tensor:
    """``f`` of ``dal::fold_factor`` (``gamma / sqrt(running_var + eps)``, 1 where 0 with
    ``ones_for_zero``), differentiable in ``gamma``.

    >>> fold_factor(torch.tensor([2.0, 0.0]), torch.tensor([3.0, 1.0]), 1.0, True).tolist()
    [1.0, 1.0]
    """
    return fold_factor_op(gamma, running_var.detach(), float(eps), bool(ones_for_zero))[0]
