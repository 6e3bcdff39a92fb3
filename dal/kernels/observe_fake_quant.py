"""``dal::observe_fake_quantize_``: a min-max quantizer's whole QAT step as one registered op.

``observe_fake_quantize_(x, min_val, max_val, batches_seen, nonfinite_count, scale, zero_point,
averaging_constant, fmt, symmetric, narrow_range, power_of_two, axis, block_size, need_mask)`` is,
by definition, the three ops in a row::

    dal::observe_minmax_(x, min_val, max_val, batches_seen, nonfinite_count, averaging_constant, axis, block_size)
    s, z = dal::minmax_qparams(min_val, max_val, fmt, symmetric, narrow_range, power_of_two)
    scale.copy_(s);  zero_point.copy_(z)
    y, mask = dal::fake_quantize(x, s, z, *op_format_args(fmt, narrow_range), axis, block_size, need_mask)

and returns ``(y, mask)``: the observer's update (running min / max, or the moving average with
``averaging_constant`` > 0), the scale and zero point from the updated range (float64 arithmetic,
``dal.formats.choose_qparams``), written into ``scale`` / ``zero_point``, and ONNX's fake
quantization of ``x`` with them (divide by the scale, round half to even, saturate), with the
packed clip mask of ``dal::fake_quantize`` (:mod:`.fake_quant`). The six buffers are declared
mutated arguments. ``d y / d x = mask`` (``dal::mask_grad``); the buffers get no gradient. torch
registers no autograd formula on an op that mutates its arguments, so :class:`ObserveFakeQuantize`
(applied by :func:`observe_fake_quantize`) carries it.

Implementations (the same bits; tests/kernels/test_kernels_observe_fake_quant.py):

* device-generic: the three ops' plain-torch implementations in that order, any device and dtype;
* CPU: per tensor, the C++ step ``dal_track_fq_forward`` (one pass for the batch's extremes, the
  observer step and scale in C++ with the same float32 / float64 expressions, one fake-quantization
  pass; ``dal.formats.track``), and per channel on the rows of a weight (``axis`` 0, or every axis
  before it of size 1) or per group along the last axis of a contiguous ``x`` (one row per group)
  ``dal_row_minmax`` -> ``dal_track_qparams`` -> ``dal_fq_forward``; each for
  float32 input in a dense layout the kernel reads in memory order, float32 / int32 / int64 CPU
  buffers and no power-of-two rounding. Where the C++ step declines (a NaN or an infinity, a zero
  extreme whose sign torch's reductions decide, a running min / max touching zero), having written
  nothing, and everywhere else, the CPU implementations of the three ops run.

Why one op: under ``torch.compile`` the three ops are an inlined observer reduction, about thirty
small float64 tensor ops of ``minmax_qparams`` with their dtype conversions, and an opaque fake
quantization; here they are one call (bench/results/qat_step.md, "one op per quantizer step").
"""
from __future__ import annotations

from typing import Optional

import torch

from ..formats import native
from ..formats.qformat import get_format
from ..formats.track import buffers_ok, step_args
from . import fake_quant, observer_update
from .fake_quant import kernel_layout, mask_grad_op, mask_layout, mask_perm, op_format_args
from .qparams import minmax_qparams

MUTATED = ("min_val", "max_val", "batches_seen", "nonfinite_count", "scale", "zero_point")


def composite(x, min_val, max_val, batches_seen, nonfinite_count, scale, zero_point, averaging_constant: float,
              fmt: str, symmetric: bool, narrow_range: bool, power_of_two: Optional[str], axis: Optional[int],
              block_size: int, need_mask: bool, cpu: bool):
    """The op's definition (module docstring), by the three ops (``cpu``: dispatched, so on the CPU their
    CPU implementations) or their device-generic implementations."""
    observe = observer_update.observe_minmax_ if cpu else observer_update.generic
    observe(x, min_val, max_val, batches_seen, nonfinite_count, averaging_constant, axis, block_size)
    s, z = minmax_qparams(min_val, max_val, fmt, symmetric, narrow_range, power_of_two)
    scale.copy_(s)
    zero_point.copy_(z)
    mode, qmin, qmax = op_format_args(fmt, narrow_range)
    run = fake_quant.fake_quantize_op if cpu else fake_quant.generic
    return run(x, s, z, float(qmin), float(qmax), axis, block_size, mode, need_mask)


@torch.library.custom_op("dal::observe_fake_quantize_", mutates_args=MUTATED)
def observe_fake_quantize_(x: torch.Tensor, min_val: torch.Tensor, max_val: torch.Tensor, batches_seen: torch.Tensor,
                           nonfinite_count: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor,
                           averaging_constant: float, fmt: str, symmetric: bool, narrow_range: bool,
                           power_of_two: Optional[str], axis: Optional[int], block_size: int,
                           need_mask: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``(y, mask)`` of the module docstring, the buffers updated in place; device-generic."""
    return composite(x, min_val, max_val, batches_seen, nonfinite_count, scale, zero_point, averaging_constant,
                     fmt, symmetric, narrow_range, power_of_two, axis, block_size, need_mask, cpu=False)


def cpu_step(x, min_val, max_val, batches_seen, scale, zero_point, averaging_constant: float, fmt: str,
             symmetric: bool, narrow_range: bool, power_of_two: Optional[str], axis: Optional[int], block_size: int,
             need_mask: bool):
    """The op by the C++ step, or None with nothing written where it does not apply or declines."""
    lib = native.library()
    if lib is None or power_of_two is not None or x.dtype != torch.float32 \
            or not buffers_ok(min_val, max_val, batches_seen, scale, zero_point):
        return None
    lay = kernel_layout(x, axis, block_size)
    if lay is None:
        return None
    rows, row_len, div, mod = lay
    if min_val.numel() != mod or (axis is not None and mod != rows):
        return None  # per channel: one row per channel only (a weight's axis 0); per group: one row per group
    q = get_format(fmt)
    mode, qmin, qmax = op_format_args(q, narrow_range)
    args = step_args(averaging_constant or None, q, symmetric, qmin, qmax)
    nthreads = torch.get_num_threads()
    y = torch.empty_like(x)
    packed = torch.empty(rows * ((row_len + 7) // 8), dtype=torch.uint8) if need_mask else None
    mask_ptr = packed.data_ptr() if need_mask else None
    if axis is None:
        ok = lib.dal_track_fq_forward(x.data_ptr(), y.data_ptr(), mask_ptr, row_len, min_val.data_ptr(),
                                      max_val.data_ptr(), batches_seen.data_ptr(), *args, scale.data_ptr(),
                                      zero_point.data_ptr(), mode, nthreads)
    else:
        lo, hi = torch.empty(rows), torch.empty(rows)
        s, k_lo, k_hi = torch.empty(rows), torch.empty(rows), torch.empty(rows)
        ok = lib.dal_row_minmax(x.data_ptr(), rows, row_len, None, lo.data_ptr(), hi.data_ptr(), nthreads) \
            and lib.dal_track_qparams(lo.data_ptr(), hi.data_ptr(), rows, min_val.data_ptr(), max_val.data_ptr(),
                                      batches_seen.data_ptr(), *args, scale.data_ptr(), zero_point.data_ptr(),
                                      s.data_ptr(), k_lo.data_ptr(), k_hi.data_ptr())
        if ok:
            lib.dal_fq_forward(x.data_ptr(), y.data_ptr(), mask_ptr, rows, row_len, 1, rows, s.data_ptr(),
                               k_lo.data_ptr(), k_hi.data_ptr(), mode, nthreads)
    if not ok:
        return None
    return y, (packed if need_mask else x.new_empty(0, dtype=torch.uint8))


@observe_fake_quantize_.register_kernel("cpu")
def _cpu(x, min_val, max_val, batches_seen, nonfinite_count, scale, zero_point, averaging_constant, fmt, symmetric,
         narrow_range, power_of_two, axis, block_size, need_mask):
    done = cpu_step(x, min_val, max_val, batches_seen, scale, zero_point, averaging_constant, fmt, symmetric,
                    narrow_range, power_of_two, axis, block_size, need_mask)
    if done is not None:
        return done
    return composite(x, min_val, max_val, batches_seen, nonfinite_count, scale, zero_point, averaging_constant,
                     fmt, symmetric, narrow_range, power_of_two, axis, block_size, need_mask, cpu=True)


@observe_fake_quantize_.register_fake
def _fake(x, min_val, max_val, batches_seen, nonfinite_count, scale, zero_point, averaging_constant, fmt, symmetric,
          narrow_range, power_of_two, axis, block_size, need_mask):
    rows, row_len = mask_layout(x.shape, axis, block_size)
    return torch.empty_like(x), x.new_empty(rows * ((row_len + 7) // 8) if need_mask else 0, dtype=torch.uint8)


class ObserveFakeQuantize(torch.autograd.Function):
    """``dal::observe_fake_quantize_`` with its straight-through gradient ``grad * mask`` (``dal::mask_grad``).
    torch registers no autograd formula on an op that mutates its arguments; this Function carries
    it, and dynamo traces it into the compiled graph (no graph break)."""

    @staticmethod
    def forward(ctx, x, min_val, max_val, batches_seen, nonfinite_count, scale, zero_point, averaging_constant,
                fmt, symmetric, narrow_range, power_of_two, axis, block_size):
        y, mask = observe_fake_quantize_(x, min_val, max_val, batches_seen, nonfinite_count, scale, zero_point,
                                         averaging_constant, fmt, symmetric, narrow_range, power_of_two, axis,
                                         block_size, True)
        ctx.save_for_backward(mask)
        ctx.rows, ctx.row_len = mask_layout(x.shape, axis, block_size)
        ctx.perm = mask_perm(x, axis, block_size)
        ctx.mark_non_differentiable(mask)
        return y, mask

    @staticmethod
    def backward(ctx, grad_y, grad_mask):
        (mask,) = ctx.saved_tensors
        if ctx.perm is None:
            grad_x = mask_grad_op(grad_y, mask, ctx.rows, ctx.row_len)
        else:  # the mask in x's memory order: grad_y permuted alike (as dal::fake_quantize's backward)
            inverse = sorted(range(len(ctx.perm)), key=ctx.perm.__getitem__)
            grad_x = mask_grad_op(grad_y.permute(ctx.perm), mask, ctx.rows, ctx.row_len).permute(inverse)
        return (grad_x,) + (None,) * 13


def observe_fake_quantize(x: torch.Tensor, min_val: torch.Tensor, max_val: torch.Tensor, batches_seen: torch.Tensor,
                          nonfinite_count: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor,
                          averaging_constant: float, fmt, symmetric: bool, narrow_range: bool,
                          power_of_two: Optional[str], axis: Optional[int], block_size: int) -> torch.Tensor:
    """``y`` of ``dal::observe_fake_quantize_`` (module docstring), the six buffers updated in place;
    the mask is written only when ``x`` needs a gradient. ``axis`` normalized (non-negative) or None.

    >>> mn, mx = torch.tensor(-1.0), torch.tensor(1.0)
    >>> seen, bad = torch.tensor(1), torch.tensor(0)
    >>> s, z = torch.tensor(1.0), torch.tensor(0, dtype=torch.int32)
    >>> y = observe_fake_quantize(torch.tensor([0.7, -1.984375]), mn, mx, seen, bad, s, z, 0.0, "int8", True,
    ...                           False, None, None, 0)
    >>> y.tolist(), float(mn), float(s), int(seen)  # range [-127/64, 1]: scale 1/64
    ([0.703125, -1.984375], -1.984375, 0.015625, 2)
    """
    args = (x, min_val, max_val, batches_seen, nonfinite_count, scale, zero_point, float(averaging_constant),
            get_format(fmt).name, bool(symmetric), bool(narrow_range), power_of_two, axis, block_size)
    if x.requires_grad and torch.is_grad_enabled():
        return ObserveFakeQuantize.apply(*args)[0]
    return observe_fake_quantize_(*args, False)[0]
