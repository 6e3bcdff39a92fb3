"""A QAT quantizer's per-step observer update in one C++ call, and the kernel's parameters.

During QAT a min-max quantizer updates its range at every step and re-derives (scale, zero
point) from it: the observer update, ``Observer.calculate_qparams``, ``choose_qparams`` and
``FakeQuantizer.set_qparams`` are about thirty small torch ops, a few microseconds each, for a
handful of numbers, at every call of every quantizer. :func:`track_qparams` computes the same
numbers with the same float32 / float64 expressions in one call of the C++ kernel
(``dal_track_qparams`` in ``csrc/fake_quant.cpp``, which states them), writes them into the
same buffers, and bumps their autograd version counters as ``copy_`` would. It declines (None,
nothing written) whenever the torch path must decide, so it never changes a result; the tests
compare both paths bit for bit (tests/test_quantizer_fast_path.py, tests/formats/test_formats_track.py).

:func:`kernel_fake_quantize` is a quantizer's whole forward on the kernel path. Per tensor it is
ONE C++ call (:func:`track_fake_quantize`): the batch's min / max (``torch.aminmax``'s values,
the sign of a zero extreme included, in about half its time), the observer step, and the fused
fake quantization. A quantizer whose scale does not move (``frozen``, or ``quantize`` with a
calibrated observer) is one call too (:func:`fixed_fake_quantize`: the kernel's bounds are
computed in C++, no parameter tensors). Parameters are read at every call, never cached: code may
write a scale through ``.data``, which no version counter sees.
"""
from __future__ import annotations

import functools
from typing import Optional

import torch
from torch.autograd.graph import increment_version

from . import native
from .fold import scale_extremes
from .fused import (FusedFakeQuantizeFunction, KernelOutputFunction, kernel_layout, kernel_mode, kernel_params,
                    plain_tensor)
from .memory_order import dense_order, elementwise_order, inverse
from .granularity import Granularity
from .qformat import QFormat


def bump_versions(tensors: tuple) -> None:
    """Autograd's version counter of each tensor += 1 (buffers a C++ call wrote in place, as ``copy_``
    would bump them), in one call where torch takes a tuple (>= 2.5), else one call per tensor."""
    try:
        increment_version(tensors)
    except TypeError:  # torch 2.4 takes one tensor
        for t in tensors:
            increment_version(t)


def _f32(t: torch.Tensor, n: int) -> bool:
    return t.dtype == torch.float32 and t.numel() == n and t.is_contiguous() and t.is_cpu


def track_qparams(lo: torch.Tensor, hi: torch.Tensor, min_val: torch.Tensor, max_val: torch.Tensor,
                  batches_seen: torch.Tensor, ema: Optional[float], fmt: QFormat, symmetric: bool, qmin, qmax,
                  scale: torch.Tensor, zero_point: torch.Tensor) -> Optional[tuple]:
    """One observer step from the batch's extremes ``lo`` / ``hi`` (float32, shaped like the
    scale), in place: ``min_val``, ``max_val`` (running min / max, or the moving average with
    constant ``ema``), ``batches_seen`` += 1, then ``scale`` / ``zero_point`` as
    ``choose_qparams`` gives them for ``fmt`` (``symmetric``, codes ``[qmin, qmax]``).

    Returns this call's kernel parameters ``(s, lo, hi, mode)`` (fresh tensors, see
    ``fused.kernel_params``), or None, having changed nothing, where the torch path must decide:
    no kernel, unexpected dtypes or shapes, a non-finite batch extreme, and for the running
    min / max any zero or non-finite extreme (the sign torch gives a zero extreme depends on its
    kernel's operand order)."""
    lib = native.library()
    n = scale.numel()
    if lib is None or not (_f32(lo, n) and _f32(hi, n)
                           and buffers_ok(min_val, max_val, batches_seen, scale, zero_point)):
        return None
    s, k_lo, k_hi = torch.empty(n), torch.empty(n), torch.empty(n)
    ok = lib.dal_track_qparams(lo.data_ptr(), hi.data_ptr(), n, min_val.data_ptr(), max_val.data_ptr(),
                               batches_seen.data_ptr(), *step_args(ema, fmt, symmetric, qmin, qmax),
                               scale.data_ptr(), zero_point.data_ptr(), s.data_ptr(), k_lo.data_ptr(),
                               k_hi.data_ptr())
    if not ok:
        return None
    bump_versions((min_val, max_val, batches_seen, scale, zero_point))  # written in place by the C++ step
    return s, k_lo, k_hi, kernel_mode(fmt)


def buffers_ok(min_val, max_val, batches_seen, scale, zero_point) -> bool:
    """The observer's and quantizer's buffers as the C++ step writes them: float32 range and scale,
    int32 zero point, one int64 counter, contiguous (the float ones on the CPU), one value per scale."""
    n = scale.numel()
    return _f32(min_val, n) and _f32(max_val, n) and _f32(scale, n) and zero_point.dtype == torch.int32 \
        and zero_point.numel() == n and zero_point.is_contiguous() and batches_seen.dtype == torch.int64 \
        and batches_seen.numel() == 1


@functools.lru_cache(maxsize=256)  # a handful of (format, range) combinations per model: per call a lookup
def step_args(ema, fmt: QFormat, symmetric: bool, qmin, qmax) -> tuple:
    """The C++ observer step's constant arguments ``(ema?, c, symmetric, qmin, qmax, zp_mid, denom,
    fp8)``, as ``dal_track_qparams`` in ``csrc/fake_quant.cpp`` reads them."""
    if fmt.is_float8:
        zp_mid, denom = 0, fmt.max_value
    else:  # as choose_qparams: symmetric unsigned formats centre on the mid code
        zp_mid = 0 if fmt.signed else int(qmin + qmax + 1) // 2
        denom = float(qmax - zp_mid)
    return (ema is not None, float(ema or 0.0), bool(symmetric), float(qmin), float(qmax), float(zp_mid),
            float(denom), fmt.is_float8)


def fold_track_forward(weight: torch.Tensor, f: torch.Tensor, min_val, max_val, batches_seen, ema, fmt: QFormat,
                       symmetric: bool, qmin, qmax, scale, zero_point, divide: bool,
                       need_mask: bool) -> Optional[tuple]:
    """``track_qparams`` of a per-output-channel weight quantizer and the BN-fold forward
    ``fq(weight * f) [/ f]`` in one pass over the weight (``dal_fold_track_forward``): returns
    ``(out, mask, kp)`` for ``fold.FoldedFakeQuantizeFunction``, or None with nothing written."""
    lib = native.library()
    rows = weight.shape[0]
    if lib is None or scale.numel() != rows or not buffers_ok(min_val, max_val, batches_seen, scale, zero_point):
        return None
    row_len = weight.numel() // rows
    s, k_lo, k_hi = torch.empty(rows), torch.empty(rows), torch.empty(rows)
    out = torch.empty_like(weight)
    mask = torch.empty(rows * ((row_len + 7) // 8), dtype=torch.uint8) if need_mask else None
    mode = kernel_mode(fmt)
    ok = lib.dal_fold_track_forward(weight.data_ptr(), out.data_ptr(), mask.data_ptr() if need_mask else None, rows,
                                    row_len, f.data_ptr(), min_val.data_ptr(), max_val.data_ptr(),
                                    batches_seen.data_ptr(), *step_args(ema, fmt, symmetric, qmin, qmax),
                                    scale.data_ptr(), zero_point.data_ptr(), s.data_ptr(), k_lo.data_ptr(),
                                    k_hi.data_ptr(), mode, bool(divide), torch.get_num_threads())
    if not ok:
        return None
    bump_versions((min_val, max_val, batches_seen, scale, zero_point))  # written in place by the C++ step
    return out, mask, (s, k_lo, k_hi, mode)


def rows_track_fake_quantize(x: torch.Tensor, lay: tuple, min_val, max_val, batches_seen, ema, fmt: QFormat,
                             symmetric: bool, qmin, qmax, scale, zero_point, need_mask: bool) -> Optional[tuple]:
    """A quantizer with one scale per row of ``x`` (``lay = fused.layout(x.shape, gran)`` with
    ``rows == param_mod``: per channel along axis 0, a weight's output channels): each row's min /
    max (as ``dal_row_minmax``), its observer step (``track_qparams``) and its fused fake
    quantization, in one C++ call (``dal_fold_track_forward`` without a fold factor). Returns
    ``(out, mask, rows, row_len)`` for ``fused.KernelOutputFunction`` (mask None unless
    ``need_mask``), or None with nothing written where ``dal_row_minmax`` or ``track_qparams``
    would decline (NaN, a zero or non-finite extreme, ...)."""
    lib = native.library()
    rows, row_len = lay[0], lay[1]
    if lib is None or not buffers_ok(min_val, max_val, batches_seen, scale, zero_point):
        return None
    s, k_lo, k_hi = torch.empty(rows), torch.empty(rows), torch.empty(rows)
    out = torch.empty_like(x)
    mask = torch.empty(rows * ((row_len + 7) // 8), dtype=torch.uint8) if need_mask else None
    ok = lib.dal_fold_track_forward(x.data_ptr(), out.data_ptr(), mask.data_ptr() if need_mask else None, rows,
                                    row_len, None, min_val.data_ptr(), max_val.data_ptr(), batches_seen.data_ptr(),
                                    *step_args(ema, fmt, symmetric, qmin, qmax), scale.data_ptr(),
                                    zero_point.data_ptr(), s.data_ptr(), k_lo.data_ptr(), k_hi.data_ptr(),
                                    kernel_mode(fmt), False, torch.get_num_threads())
    if not ok:
        return None
    bump_versions((min_val, max_val, batches_seen, scale, zero_point))  # written in place by the C++ step
    return out, mask, rows, row_len


def fixed_kernel_params(scale: torch.Tensor, zero_point: torch.Tensor, fmt: QFormat, qmin, qmax) -> tuple:
    """``kernel_params(scale, zero_point, ...)`` in one C++ call (fresh tensors, the scale copied:
    nothing a later step writes), falling back to the torch ops for other dtypes."""
    lib = native.library()
    n = scale.numel()
    if lib is None or not _f32(scale, n) or zero_point.dtype != torch.int32 or zero_point.numel() != n \
            or not zero_point.is_contiguous() or not zero_point.is_cpu:
        s, lo, hi, mode = kernel_params(scale, zero_point, fmt, qmin, qmax)
        return s.clone(), lo, hi, mode
    s, k_lo, k_hi = torch.empty(n), torch.empty(n), torch.empty(n)
    lib.dal_kernel_params(scale.data_ptr(), zero_point.data_ptr(), n, float(qmin), float(qmax),
                          fmt.max_value if fmt.is_float8 else 0.0, s.data_ptr(), k_lo.data_ptr(), k_hi.data_ptr())
    return s, k_lo, k_hi, kernel_mode(fmt)


def kernel_fake_quantize(x: torch.Tensor, gran: Granularity, fmt: QFormat, qmin, qmax, scale: torch.Tensor,
                         zero_point: torch.Tensor, step: Optional[tuple]) -> Optional[torch.Tensor]:
    """A quantizer's fake quantization of ``x`` by the C++ kernel (the straight-through
    estimator): with ``step`` (an observer's ``track_step()``, the QAT step of a min-max
    quantizer) its observer update and new scale first, as ``track_qparams``; without, the
    fixed ``scale`` / ``zero_point``. One C++ call where it can (per tensor, one scale per row,
    or fixed parameters), so the per-call cost is a few microseconds of Python.

    Returns the output (an autograd node whose backward is ``grad * mask`` when ``x`` needs a
    gradient), or None, having changed nothing, where the torch path must decide: no kernel,
    a tensor or parameters the kernel does not take, a scale not yet calibrated, and every case
    where ``track_qparams`` declines (NaN, zeros of both signs at an extreme, ...). A dense
    non-contiguous ``x`` per tensor runs on its memory's contiguous view; the result has ``x``'s
    strides. One that is not dense (broadcast, gaps) and needs no gradient runs on a dense copy; the
    result has the strides torch gives an elementwise result of ``x`` (``dal.formats.memory_order``)."""
    lay = kernel_layout(x, gran)
    need = x.requires_grad and torch.is_grad_enabled()
    if lay is None:
        if gran.axis is not None or not plain_tensor(x):
            return None
        # Per tensor, a dense non-contiguous x (channels-last, transposed) is the contiguous view of its
        # memory permuted: the kernel on that view, the result permuted back, the same numbers (memory_order).
        perm = dense_order(x)
        if perm is not None:
            y = kernel_fake_quantize(x.permute(perm), gran, fmt, qmin, qmax, scale, zero_point, step)
            return None if y is None else y.permute(inverse(perm))
        # Not dense (a broadcast expand, gaps), no gradient: the kernel on a dense copy in the order torch
        # lays out an elementwise result of x, so the output has the torch path's strides (memory_order).
        if need or x.is_contiguous() or not (x.is_cpu and x.dtype == torch.float32 and x.numel()):
            return None
        perm = elementwise_order(tuple(x.shape), x.stride())
        y = None if perm is None else kernel_fake_quantize(x.permute(perm).contiguous(), gran, fmt, qmin, qmax,
                                                           scale, zero_point, step)
        return None if y is None else y.permute(inverse(perm))
    if step is None:
        done = fixed_fake_quantize(x, lay, scale, zero_point, fmt, qmin, qmax, need)
    elif gran.axis is None:
        done = track_fake_quantize(x, *step, scale, zero_point, need) if zero_point.is_cpu else None
    elif lay[0] == lay[3] == scale.numel() and zero_point.is_cpu and (gran.block_size or gran.normalized_axis(x.dim())
                                                                       == 0):
        # one row per scale, the rows scale_extremes takes: per channel along axis 0 (a weight's output
        # channels), per group of the last axis
        done = rows_track_fake_quantize(x, lay, *step, scale, zero_point, need)
    else:  # per channel / group: the range pass and the observer step, then the fused kernel
        rows = scale_extremes(x, gran)
        kp = None if rows is None else track_qparams(*rows, *step, scale, zero_point)
        return None if kp is None else FusedFakeQuantizeFunction.apply(x, scale, zero_point, fmt, gran, qmin, qmax, kp)
    if done is None:
        return None
    return KernelOutputFunction.apply(x, done) if need else done[0]


def track_fake_quantize(x: torch.Tensor, min_val, max_val, batches_seen, ema, fmt: QFormat, symmetric: bool, qmin,
                        qmax, scale, zero_point, need_mask: bool) -> Optional[tuple]:
    """``track_qparams`` of a per-tensor quantizer from ``x``'s own min / max (``torch.aminmax``'s
    values) and the fused fake quantization of ``x`` with the new parameters, in one C++ call
    (``dal_track_fq_forward``; ``x`` CPU float32 contiguous): ``(out, mask, 1, x.numel())`` for
    ``fused.KernelOutputFunction`` (mask None unless ``need_mask``), or None with nothing written."""
    if scale.numel() != 1 or not buffers_ok(min_val, max_val, batches_seen, scale, zero_point):
        return None
    return _track_fq(x, min_val, max_val, batches_seen, ema, fmt, symmetric, qmin, qmax, scale, zero_point, need_mask)


def _track_fq(x, min_val, max_val, batches_seen, ema, fmt, symmetric, qmin, qmax, scale, zero_point, need_mask):
    """track_fake_quantize once its buffers are checked (kernel_fake_quantize checked them)."""
    lib = native.library()
    if lib is None:
        return None
    n = x.numel()
    out = torch.empty_like(x)
    mask = torch.empty((n + 7) // 8, dtype=torch.uint8) if need_mask else None
    ok = lib.dal_track_fq_forward(x.data_ptr(), out.data_ptr(), mask.data_ptr() if need_mask else None, n,
                                  min_val.data_ptr(), max_val.data_ptr(), batches_seen.data_ptr(),
                                  *step_args(ema, fmt, symmetric, qmin, qmax), scale.data_ptr(),
                                  zero_point.data_ptr(), kernel_mode(fmt), torch.get_num_threads())
    if not ok:
        return None
    bump_versions((min_val, max_val, batches_seen, scale, zero_point))  # written in place by the C++ step
    return out, mask, 1, n


def fixed_fake_quantize(x: torch.Tensor, lay: tuple, scale: torch.Tensor, zero_point: torch.Tensor, fmt: QFormat,
                        qmin, qmax, need_mask: bool) -> Optional[tuple]:
    """The fused fake quantization of ``x`` (``lay = fused.layout(x.shape, gran)``) with a fixed
    ``scale`` / ``zero_point`` (float32 / int32, one value per parameter of the layout), the
    kernel's bounds computed in the same C++ call (``dal_fq_forward_fixed``, as
    ``fixed_kernel_params``): ``(out, mask, rows, row_len)``, or None where the kernel does not
    take these parameters (other dtypes or shapes, no scale yet)."""
    rows, row_len, div, mod = lay
    if not (_f32(scale, mod) and zero_point.dtype == torch.int32 and zero_point.numel() == mod
            and zero_point.is_contiguous()):
        return None
    out = torch.empty_like(x)
    mask = torch.empty(rows * ((row_len + 7) // 8), dtype=torch.uint8) if need_mask else None
    native.library().dal_fq_forward_fixed(x.data_ptr(), out.data_ptr(), mask.data_ptr() if need_mask else None, rows,
                                          row_len, div, mod, scale.data_ptr(), zero_point.data_ptr(), float(qmin),
                                          float(qmax), fmt.max_value if fmt.is_float8 else 0.0, kernel_mode(fmt),
                                          torch.get_num_threads())
    return out, mask, rows, row_len
