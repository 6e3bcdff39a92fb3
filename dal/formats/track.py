"""A QAT quantizer's per-step observer update in one C++ call, and the kernel's parameters.

During QAT a min-max quantizer updates its range at every step and re-derives (scale, zero
point) from it: the observer update, ``Observer.calculate_qparams``, ``choose_qparams`` and
``FakeQuantizer.set_qparams`` are about thirty small torch ops, a few microseconds each, for a
handful of numbers, at every call of every quantizer. :func:`track_qparams` computes the same
numbers with the same float32 / float64 expressions in one call of the C++ kernel
(``dal_track_qparams`` in ``csrc/fake_quant.cpp``, which states them), writes them into the
same buffers, and bumps their autograd version counters as ``copy_`` would. It declines (None,
nothing written) whenever the torch path must decide, so it never changes a result; the tests
compare both paths bit for bit (tests/formats/test_formats_track.py).

:func:`fixed_kernel_params` gives the fused kernel its per-scale ``(s, lo, hi, mode)`` for a
quantizer whose scale does not move (``frozen``, or ``quantize`` with a calibrated observer) in
one call too. They are recomputed at every call, not cached: code may write a scale through
``.data``, which no version counter sees.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch.autograd.graph import increment_version

from . import native
from .fused import kernel_mode, kernel_params
from .qformat import QFormat


def _f32(t: torch.Tensor, n: int) -> bool:
    return t.dtype == torch.float32 and t.numel() == n and t.is_contiguous() and t.device.type == "cpu"


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
    if lib is None or not (_f32(lo, n) and _f32(hi, n) and _buffers_ok(min_val, max_val, batches_seen, scale, zero_point)):
        return None
    s, k_lo, k_hi = torch.empty(n), torch.empty(n), torch.empty(n)
    ok = lib.dal_track_qparams(lo.data_ptr(), hi.data_ptr(), n, min_val.data_ptr(), max_val.data_ptr(),
                               batches_seen.data_ptr(), *_step_args(ema, fmt, symmetric, qmin, qmax),
                               scale.data_ptr(), zero_point.data_ptr(), s.data_ptr(), k_lo.data_ptr(),
                               k_hi.data_ptr())
    if not ok:
        return None
    increment_version((min_val, max_val, batches_seen, scale, zero_point))
    return s, k_lo, k_hi, kernel_mode(fmt)


def _buffers_ok(min_val, max_val, batches_seen, scale, zero_point) -> bool:
    n = scale.numel()
    return _f32(min_val, n) and _f32(max_val, n) and _f32(scale, n) and zero_point.dtype == torch.int32 \
        and zero_point.numel() == n and zero_point.is_contiguous() and batches_seen.dtype == torch.int64 \
        and batches_seen.numel() == 1


def _step_args(ema, fmt: QFormat, symmetric: bool, qmin, qmax) -> tuple:
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
    if lib is None or scale.numel() != rows or not _buffers_ok(min_val, max_val, batches_seen, scale, zero_point):
        return None
    row_len = weight.numel() // rows
    s, k_lo, k_hi = torch.empty(rows), torch.empty(rows), torch.empty(rows)
    out = torch.empty_like(weight)
    mask = torch.empty(rows * ((row_len + 7) // 8), dtype=torch.uint8) if need_mask else None
    mode = kernel_mode(fmt)
    ok = lib.dal_fold_track_forward(weight.data_ptr(), out.data_ptr(), mask.data_ptr() if need_mask else None, rows,
                                    row_len, f.data_ptr(), min_val.data_ptr(), max_val.data_ptr(),
                                    batches_seen.data_ptr(), *_step_args(ema, fmt, symmetric, qmin, qmax),
                                    scale.data_ptr(), zero_point.data_ptr(), s.data_ptr(), k_lo.data_ptr(),
                                    k_hi.data_ptr(), mode, bool(divide), torch.get_num_threads())
    if not ok:
        return None
    increment_version((min_val, max_val, batches_seen, scale, zero_point))
    return out, mask, (s, k_lo, k_hi, mode)


def fixed_kernel_params(scale: torch.Tensor, zero_point: torch.Tensor, fmt: QFormat, qmin, qmax) -> tuple:
    """``kernel_params(scale, zero_point, ...)`` in one C++ call (fresh tensors, the scale copied:
    nothing a later step writes), falling back to the torch ops for other dtypes."""
    lib = native.library()
    n = scale.numel()
    if lib is None or not _f32(scale, n) or zero_point.dtype != torch.int32 or zero_point.numel() != n \
            or not zero_point.is_contiguous():
        s, lo, hi, mode = kernel_params(scale, zero_point, fmt, qmin, qmax)
        return s.clone(), lo, hi, mode
    s, k_lo, k_hi = torch.empty(n), torch.empty(n), torch.empty(n)
    lib.dal_kernel_params(scale.data_ptr(), zero_point.data_ptr(), n, float(qmin), float(qmax),
                          fmt.max_value if fmt.is_float8 else 0.0, s.data_ptr(), k_lo.data_ptr(), k_hi.data_ptr())
    return s, k_lo, k_hi, kernel_mode(fmt)
