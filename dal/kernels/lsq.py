"""``dal::fake_quantize_lsq``: fake quantization with a learnable scale and zero point (LSQ / LSQ+)
as one registered op, its gradient registered once (``register_autograd``) as a second op,
``dal::fake_quantize_lsq_backward``.

Forward: the parameters projected into range, ``s = max(scale, MIN_SCALE)`` and, integer formats,
``zp = round_half_even(clamp(zero_point, qmin, qmax))``; then ``dal::fake_quantize``'s formula
(:func:`.fake_quant.codes`): ``v = x / s``, ``c = clamp(round(v), qmin - zp, qmax - zp)`` (FP8:
``c = fp8(clamp(v, -max, max))``), ``y = c * s`` in float32, cast to ``x``'s dtype. With the
clip mask ``m`` (``qmin - zp <= round(v) <= qmax - zp``; FP8 ``|v| <= max``), the upstream
gradient ``g`` widened to float32, and LSQ's gradient scale ``gs`` (the caller's ``grad_scale``,
``1 / sqrt(N_per_scale * qmax)`` for a quantizer):

* ``d y / d x  = g * m``, in ``g``'s dtype (``g * 0.0`` where clipped: NaN / inf stay, -0.0 for negative g);
* ``d y / d s  = float32(gs * S)``, ``S`` the float64 sum over each scale's elements of the float32
  products ``g * where(m, c - v, c)``;
* ``d y / d zp = float32(gs * Z)``, ``Z`` the float64 sum of the float32 products ``g * where(m, 0, -s)``;
* the projection passes gradients straight through (``d s / d scale = 1``).

``d y / d x`` and the products are the float32 operations of the eager
``dal.formats.autograd.FakeQuantizeFunction`` (the same bits); the sums are float64 in any order,
then rounded once to float32 (the eager function sums in float32). So each scale / zero-point
gradient is within one float32 ulp of ``gs * S`` exactly summed, plus the float64 summation error
``n * 2**-53 * gs * sum|products|`` (tests/kernels/test_kernels_lsq_cpu.py checks both forms
against ``math.fsum``).

Nothing is kept from the forward but ``x`` and the parameters: the backward recomputes ``v``,
``c`` and ``m`` from ``x`` (the forward's operations, so the forward's values). Eagerly a
quantizer projects its Parameters in place before the call (``project_learned_qparams_``), so
the op's projection is the identity there; under ``torch.compile`` the op's projection is the one
applied (no write into the Parameter, no host read of its value): the same output and gradients,
while an out-of-range Parameter keeps its raw value. A NaN scale gives NaN outputs here (eagerly
the quantizer raises before the call).

CPU implementation: the forward is ``dal::fake_quantize``'s C++ kernel without a mask, the
backward one C++ pass (``csrc/lsq.cpp``, :mod:`.lsq_kernel`) computing ``dx`` and both sums, where
they apply (float32 CPU tensors in a layout of the fake-quant kernel, the kernel built); everything
else, and every other device, runs the plain-torch form below (same contract). Under
``torch.compile`` both ops are opaque.
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from ..formats.autograd import broadcast_view
from ..formats.granularity import PER_TENSOR, Granularity
from ..formats.qparams import MIN_SCALE
from . import lsq_kernel
from .fake_quant import codes, cpu_kernel, laid_out_like, op_format_args


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


def forward_generic(x, scale, zero_point, qmin, qmax, axis, block_size, mode):
    """``y`` of the module docstring in plain torch, any device and dtype, laid out like ``x``."""
    s, zp = _projected(scale, zero_point, qmin, qmax, mode)
    _, c, _, sb = codes(x, s, zp, qmin, qmax, axis, block_size, mode, False)
    return laid_out_like(x, (c * sb).reshape(x.shape), x.dtype)


@torch.library.custom_op("dal::fake_quantize_lsq", mutates_args=())
def fake_quantize_lsq_op(x: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor, qmin: float, qmax: float,
                         axis: Optional[int], block_size: int, mode: int, grad_scale: float) -> torch.Tensor:
    """``y`` of the module docstring (``grad_scale`` is read by the backward only); plain torch."""
    return forward_generic(x, scale, zero_point, qmin, qmax, axis, block_size, mode)


def forward_cpu(x, scale, zero_point, qmin, qmax, axis, block_size, mode) -> Optional[torch.Tensor]:
    """``y`` by ``dal::fake_quantize``'s C++ forward without a mask (the same float32 expressions as
    :func:`forward_generic`), or None where that kernel does not apply."""
    s, zp = _projected(scale, zero_point, qmin, qmax, mode)
    done = cpu_kernel(x, s, zp, qmin, qmax, axis, block_size, mode, False)
    return None if done is None else done[0]


@fake_quantize_lsq_op.register_kernel("cpu")
def _cpu(x, scale, zero_point, qmin, qmax, axis, block_size, mode, grad_scale):
    y = forward_cpu(x, scale, zero_point, qmin, qmax, axis, block_size, mode)
    return y if y is not None else forward_generic(x, scale, zero_point, qmin, qmax, axis, block_size, mode)


@fake_quantize_lsq_op.register_fake
def _fake(x, scale, zero_point, qmin, qmax, axis, block_size, mode, grad_scale):
    return torch.empty_like(x)


def _sum_to_param(t: torch.Tensor, param_shape, gran: Granularity) -> torch.Tensor:
    """``t`` (input-shaped float32) summed in float64 down to ``param_shape`` (the adjoint of
    ``Granularity.expand``)."""
    axis = gran.normalized_axis(t.dim())
    if axis is None:
        return t.sum(dtype=torch.float64).reshape(param_shape)
    if not gran.block_size:
        return t.sum(dim=[d for d in range(t.dim()) if d != axis], dtype=torch.float64).reshape(param_shape)
    shape = list(t.shape)
    shape[axis:axis + 1] = [shape[axis] // gran.block_size, gran.block_size]
    return t.reshape(shape).sum(dim=axis + 1, dtype=torch.float64).reshape(param_shape)


def backward_generic(grad, x, scale, zero_point, qmin, qmax, axis, block_size, mode, grad_scale,
                     need_x, need_s, need_zp):
    """``(dx, ds, dzp)`` of the module docstring in plain torch, any device and dtype; each empty
    unless asked, ``ds`` / ``dzp`` float32 shaped like ``scale``."""
    s, zp = _projected(scale, zero_point, qmin, qmax, mode)
    gran, shape = Granularity(axis, block_size), x.shape
    work, view = broadcast_view(gran, shape)
    v, c, mask, sb = codes(x, s, zp, qmin, qmax, axis, block_size, mode, True)
    g = grad.reshape(work)
    dx = laid_out_like(x, (g * mask).reshape(shape), grad.dtype) if need_x else grad.new_empty(0)
    g32 = g.to(torch.float32)
    ds, dzp = grad.new_empty(0, dtype=torch.float32), grad.new_empty(0, dtype=torch.float32)
    if need_s:
        local = torch.where(mask, c - v, c)
        ds = (_sum_to_param((g32 * local).reshape(shape), scale.shape, gran) * grad_scale).to(torch.float32)
    if need_zp:
        lz = torch.where(mask, torch.zeros_like(sb), -sb)
        dzp = (_sum_to_param((g32 * lz).reshape(shape), scale.shape, gran) * grad_scale).to(torch.float32)
    return dx, ds, dzp


@torch.library.custom_op("dal::fake_quantize_lsq_backward", mutates_args=())
def fake_quantize_lsq_backward_op(grad: torch.Tensor, x: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor,
                                  qmin: float, qmax: float, axis: Optional[int], block_size: int, mode: int,
                                  grad_scale: float, need_x: bool, need_s: bool, need_zp: bool
                                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dx, ds, dzp)`` of the module docstring (each empty unless asked); plain torch."""
    return backward_generic(grad, x, scale, zero_point, qmin, qmax, axis, block_size, mode, grad_scale,
                            need_x, need_s, need_zp)


def backward_cpu(grad, x, scale, zero_point, qmin, qmax, axis, block_size, mode, grad_scale, need_x, need_s,
                 need_zp) -> Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """:func:`backward_generic`'s result by the C++ pass (:mod:`.lsq_kernel`), or None where it does
    not apply."""
    s, zp = _projected(scale, zero_point, qmin, qmax, mode)
    done = lsq_kernel.backward(grad, x, s, zp, qmin, qmax, axis, block_size, mode, grad_scale, need_x, need_s,
                               need_zp)
    if done is None:
        return None
    dx, ds, dzp = done
    return dx, ds.reshape(scale.shape) if need_s else ds, dzp.reshape(scale.shape) if need_zp else dzp


@fake_quantize_lsq_backward_op.register_kernel("cpu")
def _backward_cpu(grad, x, scale, zero_point, qmin, qmax, axis, block_size, mode, grad_scale, need_x, need_s,
                  need_zp):
    args = (grad, x, scale, zero_point, qmin, qmax, axis, block_size, mode, grad_scale, need_x, need_s, need_zp)
    done = backward_cpu(*args)
    return done if done is not None else backward_generic(*args)


@fake_quantize_lsq_backward_op.register_fake
def _backward_fake(grad, x, scale, zero_point, qmin, qmax, axis, block_size, mode, grad_scale, need_x, need_s,
                   need_zp):
    def param(needed):
        return torch.empty(scale.shape if needed else (0,), dtype=torch.float32, device=scale.device)
    return torch.empty_like(x, dtype=grad.dtype) if need_x else grad.new_empty(0), param(need_s), param(need_zp)


def _setup_context(ctx, inputs, output):
    x, scale, zero_point, qmin, qmax, axis, block_size, mode, grad_scale = inputs
    ctx.save_for_backward(x, scale, zero_point)
    ctx.args = (qmin, qmax, axis, block_size, mode, grad_scale)


def _backward(ctx, grad_y):
    x, scale, zero_point = ctx.saved_tensors
    need_x, need_s, need_zp = ctx.needs_input_grad[:3]
    dx, ds, dzp = fake_quantize_lsq_backward_op(grad_y, x, scale, zero_point, *ctx.args, need_x, need_s, need_zp)
    return (dx if need_x else None, ds if need_s else None, dzp if need_zp else None,
            None, None, None, None, None, None)


fake_quantize_lsq_op.register_autograd(_backward, setup_context=_setup_context)


def fake_quantize_lsq(x: torch.Tensor, scale: torch.Tensor, zero_point: Optional[torch.Tensor], fmt,
                      granularity: Granularity = PER_TENSOR, narrow_range: bool = False,
                      grad_scale: float = 1.0) -> torch.Tensor:
    """LSQ / LSQ+ fake quantization by ``dal::fake_quantize_lsq``: ``y`` in ``x``'s dtype with the
    gradients of the module docstring for ``x``, ``scale`` and ``zero_point`` (each only where it
    requires grad; zero point None: 0). Integer or FP8 ``fmt`` at ``granularity``; ``scale`` /
    ``zero_point`` shaped ``granularity.scale_shape(x.shape)``; ``grad_scale`` is LSQ's ``gs``.

    >>> s = torch.tensor(1.0, requires_grad=True)
    >>> fake_quantize_lsq(torch.tensor([0.3, 1.5, 300.0]), s, None, "int8").sum().backward()
    >>> round(s.grad.item(), 4)   # (0 - 0.3) + (2 - 1.5) + 127
    127.2
    """
    mode, qmin, qmax = op_format_args(fmt, narrow_range)
    if zero_point is None:
        zero_point = torch.zeros(scale.shape, dtype=torch.float32, device=scale.device)
    return fake_quantize_lsq_op(x, scale, zero_point, float(qmin), float(qmax),
                                granularity.normalized_axis(x.dim()), granularity.block_size, mode,
                                float(grad_scale))
