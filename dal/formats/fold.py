"""The BN-folded weight of QConvBn2d training in one pass over the weight, and per-row ranges.

QConvBn2d trains ``conv(x, fq(W * f) / f)`` (or ``conv(x, fq(W * f)) / f``), ``f`` one factor
per output channel (``dal.nn.conv_bn``). As separate torch ops that is about a dozen passes
over the weight per step: ``W * f``, the observer's min and max, the fake quantization, ``/ f``,
and the backward of each. Here it is three:

* :func:`row_minmax` — per output channel the min and max of ``W * f`` without forming it
  (``min(W * f) = f * min(W)`` for ``f > 0``, ``f * max(W)`` for ``f < 0``: rounding a product
  by one factor is monotonic, so this is exact; the rare rows where it could differ in the sign
  of a zero, or that hold a NaN or inf, make it return None and the caller uses torch's amin /
  amax of the product);
* :class:`FoldedFakeQuantizeFunction` forward: ``out = fq(W * f) [/ f]`` in one sweep, plus
  the clip mask at one bit per element;
* its backward: ``grad_W`` and ``grad_f`` in one sweep over the gradient, W and ``out``.

The same float32 expressions as autograd's chain, in the same order, so the output and
``grad_W`` are bit-identical to ``fq(W * f) / f`` computed op by op (tests/formats check it).
``grad_f`` (-> BN's gamma) is that chain's exact value, ``sum(g (m W - out)) / f``, summed in
double; torch's chain sums two float32 terms that nearly cancel (the straight-through estimator
makes ``fq(W f) / f`` nearly independent of f), so it differs from this in the last bits of a
small number, and this one is the closer to float64 (tests/formats check that too). Only the
straight-through estimator, CPU float32, per-tensor or per-output-channel (axis 0) scales;
everything else takes the op-by-op path (``fold_eligible``). The kernel is division-bound
(``x / s`` must be a true division, as in ONNX): three divisions per element and step, where
the op-by-op chain and a backward that recomputes the mask need six.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch.autograd.function import once_differentiable

from . import native
from .fused import kernel_params, plain_tensor
from .granularity import Granularity
from .qformat import QFormat

_KERNEL_FORMATS = ("fp8_e4m3", "fp8_e5m2")


def fold_granularity(gran: Granularity) -> bool:
    """Whether the kernel covers ``gran`` for a weight: per tensor, or per channel along axis 0."""
    return gran.axis is None or (gran.axis == 0 and not gran.block_size)


def kernel_format(fmt: QFormat) -> bool:
    """Integer formats and FP8 (the formats the C++ kernel rounds)."""
    return fmt.is_integer or fmt.name in _KERNEL_FORMATS


def _plain_f32(t: torch.Tensor) -> bool:
    return t.is_cpu and t.dtype == torch.float32 and t.is_contiguous() and plain_tensor(t)


def fold_eligible(weight: torch.Tensor, f: torch.Tensor) -> bool:
    """Whether these tensors can take the fused path: CPU float32 contiguous plain tensors (not
    traced, compiled or wrapped), ``f`` one value per row of ``weight``, the kernel loaded."""
    if weight.dim() < 2 or not weight.numel() or f.dim() != 1 or f.numel() != weight.shape[0]:
        return False
    return _plain_f32(weight) and _plain_f32(f) and native.library() is not None


@torch.no_grad()
def row_minmax(x: torch.Tensor, f: Optional[torch.Tensor] = None) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
    """Per row ``r`` of ``x`` (rows = ``x.shape[0]``, CPU float32 contiguous): the min and max of
    ``x[r] * f[r]`` (``f`` None: of ``x[r]``), exactly torch's ``amin`` / ``amax`` of that
    float32 product, in one pass. None when the kernel is missing or a row needs torch's own
    reduction (a NaN, an infinite or zero extreme, an ``f`` that is zero or not finite)."""
    lib = native.library()
    if lib is None or not x.numel() or x.dim() < 1:
        return None
    rows = x.shape[0]
    lo = torch.empty(rows, dtype=torch.float32)
    hi = torch.empty(rows, dtype=torch.float32)
    fp = None if f is None else f.detach().contiguous()
    ok = lib.dal_row_minmax(x.data_ptr(), rows, x.numel() // rows, None if fp is None else fp.data_ptr(),
                            lo.data_ptr(), hi.data_ptr(), torch.get_num_threads())
    return (lo, hi) if ok else None


@torch.no_grad()
def scale_extremes(x: torch.Tensor, gran: Granularity, f: Optional[torch.Tensor] = None):
    """``(lo, hi)`` per scale of ``gran`` (per tensor, per channel along axis 0, or per group of
    ``block_size`` along the last axis of a contiguous ``x``, flat in the scale's row-major order)
    of ``x`` (of ``x * f`` per row when ``f`` is given; not per group), exactly as the observers'
    ``block_minmax`` finds them for finite data; None where only ``block_minmax`` can (other granularities, a row
    ``row_minmax`` declines). Per tensor without ``f`` it is ``torch.aminmax``, as there."""
    axis = gran.normalized_axis(x.dim())
    if axis is None and f is None:
        return torch.aminmax(x.detach())
    if gran.block_size:  # blocks of the last axis of a contiguous x: the rows of x.reshape(-1, block_size)
        if f is not None or axis != x.dim() - 1 or not x.is_contiguous():
            return None
        return row_minmax(x.detach().reshape(-1, gran.block_size))
    if axis not in (None, 0):
        return None
    rows = row_minmax(x.detach(), None if f is None else f.detach())
    if rows is not None and axis is None:
        return rows[0].min(), rows[1].max()
    return rows


def _layout(weight: torch.Tensor, scale: torch.Tensor) -> tuple[int, int, int, int]:
    rows = weight.shape[0]
    return rows, weight.numel() // rows, 1, (rows if scale.numel() > 1 else 1)


class FoldedFakeQuantizeFunction(torch.autograd.Function):
    """``fq(weight * f[:, None, ...])``, divided by ``f`` again when ``divide`` (module doc).

    Arguments: weight ``[C_out, ...]``, f ``[C_out]``, scale / zero_point per tensor or per
    output channel, then ``fmt, qmin, qmax, divide`` and optionally the kernel parameters.
    Gradients for weight and f (STE)."""

    @staticmethod
    def forward(ctx, weight, f, scale, zero_point, fmt, qmin, qmax, divide, kp=None, done=None):
        # kp: ``kernel_params(...)`` from the caller (dal.quantizer); only the forward reads them.
        # done: ``(out, mask)`` already computed by ``track.fold_track_forward`` with these kp.
        rows, row_len, div, mod = _layout(weight, scale)
        need_grad = ctx.needs_input_grad[0] or ctx.needs_input_grad[1]
        if done is not None:
            out, mask = done
        else:
            s, lo, hi, mode = kp if kp is not None else kernel_params(scale, zero_point, fmt, qmin, qmax)
            out = torch.empty_like(weight)
            mask = torch.empty(rows * ((row_len + 7) // 8), dtype=torch.uint8) if need_grad else None
            native.library().dal_fold_forward(
                weight.data_ptr(), out.data_ptr(), mask.data_ptr() if need_grad else None, rows, row_len, div, mod,
                f.detach().data_ptr(), s.data_ptr(), lo.data_ptr(), hi.data_ptr(), mode, int(bool(divide)),
                torch.get_num_threads())
        if need_grad:
            # The backward reads the weight, f, the clip mask and (divide) this output, which the
            # conv keeps alive anyway: no extra memory beyond the mask's 1/32.
            ctx.save_for_backward(weight, f, mask, out if divide else None)
        ctx.rows, ctx.row_len, ctx.divide = rows, row_len, int(bool(divide))
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        need_w, need_f = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if not (need_w or need_f):
            return (None,) * 10
        weight, f, mask, out = ctx.saved_tensors
        return fold_backward(grad_out, weight, f, mask, out, ctx.divide, need_w, need_f) + (None,) * 8


def fold_backward(grad_out: torch.Tensor, weight: torch.Tensor, f: torch.Tensor, mask: torch.Tensor,
                  out: Optional[torch.Tensor], divide: bool, need_w: bool = True,
                  need_f: bool = True) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """``(d weight, d f)`` of ``out = fq(weight * f) [/ f]`` (None where not needed) in one C++
    pass over the gradient, from the forward's clip ``mask`` and, when ``divide``, its ``out``
    (straight-through estimator; the formulas are the module doc's)."""
    rows = weight.shape[0]
    g = grad_out.to(torch.float32).contiguous()
    grad_w = torch.empty_like(weight) if need_w else None
    grad_f = torch.empty(rows, dtype=torch.float32) if need_f else None
    native.library().dal_fold_backward(
        g.data_ptr(), weight.data_ptr(), out.data_ptr() if divide else None, mask.data_ptr(),
        grad_w.data_ptr() if need_w else None, grad_f.data_ptr() if need_f else None, rows, weight.numel() // rows,
        f.detach().data_ptr(), int(bool(divide)), torch.get_num_threads())
    return grad_w, grad_f
