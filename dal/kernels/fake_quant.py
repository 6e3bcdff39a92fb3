"""``dal::fake_quantize``: ONNX QuantizeLinear -> DequantizeLinear as one registered op, with its mask.

For integer formats, with ``v = float32(x) / s`` (a true division, as ONNX; never ``x * (1/s)``)::

    r = round_half_even(v);   c = clamp(r, qmin - zp, qmax - zp);   y = c * s
    mask = (qmin - zp <= r <= qmax - zp)

which is ``(saturate(round(x / s) + zp) - zp) * s``. FP8 (``mode`` 1: E4M3, 2: E5M2, ONNX
``saturate=1``): ``c = fp8(clamp(v, -max, max))``, ``mask = |v| <= max``. Scale and rounding are
float32 whatever the input's dtype; ``y`` is cast to the input's dtype (bfloat16 input: one more
rounding, to bfloat16, after the float32 result). NaN stays NaN (mask false: no gradient); +-inf
saturate. The gradient is the straight-through estimator with the clip mask,
``d y / d x = mask``, as ``grad * mask`` (``dal::mask_grad``); the scale and zero point get none
(a learnable scale: ``dal::fake_quantize_lsq``, :mod:`.lsq`).

The op returns ``(y, mask)``; the mask is packed, one bit per element of ``x`` in logical order
(per tensor, and per channel where ``x``'s memory keeps the axes up to the channel axis outermost
in order, e.g. a channels-last weight: in ``x``'s memory order, :func:`mask_perm`), in
rows of whole bytes (:func:`mask_layout`, :func:`pack_mask` / :func:`unpack_mask`: the C++ kernel's
layout), and empty when ``need_mask`` is false (no gradient wanted). Granularity: ``axis`` None (per tensor), or an axis
with ``block_size`` 0 (per channel) or the block length (per group); ``scale`` and
``zero_point`` have ``Granularity.scale_shape(x.shape)``.

CPU implementation: the C++ kernel ``dal_fq_forward`` (``dal.formats.native``), when ``x`` is
float32, contiguous (per tensor or per channel: any dense layout :func:`mask_perm` accepts, e.g.
channels-last, over the memory order, ``y`` with ``x``'s strides) and non-empty, its granularity a layout the kernel has
(:func:`kernel_layout`: per tensor, per channel, blocks on the last axis) and the kernel
built, and ``dal::mask_grad`` by the C++ ``dal_fq_backward`` for a float32 gradient contiguous in that order
(the bit mask is never unpacked on these paths). Everything else (other dtypes,
channels-last or strided input, blocks on another axis, no compiler) runs the generic
implementation, which is plain torch on any device and gives the same bits.
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from ..formats import native
from ..formats.autograd import broadcast_view
from ..formats.fused import kernel_mode
from ..formats.fused import kernel_params as fused_kernel_params
from ..formats.granularity import PER_TENSOR, Granularity
from ..formats.qformat import get_format
from ..formats.qparams import code_range

#: The op's ``mode`` of each FP8 format (0: integer formats): the C++ kernel's numbering
#: (``dal.formats.fused.kernel_mode``); each mode's torch dtype and saturation bound come from its QFormat.
FP8_MODES = {name: kernel_mode(get_format(name)) for name in ("fp8_e4m3", "fp8_e5m2")}
_FP8 = {mode: (get_format(name).torch_dtype(), get_format(name).max_value) for name, mode in FP8_MODES.items()}
_BY_MODE = {mode: get_format(name) for name, mode in FP8_MODES.items()}
_INTEGER = get_format("int8")  # any integer format: fused.kernel_params reads only fmt.is_float8 then


def laid_out_like(x: torch.Tensor, t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t`` (x's shape) as ``dtype`` with the strides ``torch.empty_like(x)`` has: what the fake
    implementation promises."""
    ref = torch.empty_like(x, dtype=dtype)
    if t.dtype == dtype and t.stride() == ref.stride():
        return t
    return ref.copy_(t)


def memory_perm(x: torch.Tensor) -> tuple[int, ...]:
    """The dimensions of ``x`` by decreasing stride (stable): ``x.permute(memory_perm(x))`` is
    contiguous when ``x`` is non-overlapping and dense, so its logical order is x's memory order."""
    return tuple(sorted(range(x.dim()), key=lambda d: -x.stride(d)))


def mask_perm(x: torch.Tensor, axis: Optional[int], block_size: int) -> Optional[tuple[int, ...]]:
    """The permutation whose logical order the op's mask follows: :func:`memory_perm` per tensor, and
    per channel when it keeps dimensions ``0..axis`` first and in order (each channel's elements
    then one block of memory per outer index); None (x's logical order) otherwise."""
    if axis is not None and block_size:
        return None
    perm = memory_perm(x)
    return perm if axis is None or perm[:axis + 1] == tuple(range(axis + 1)) else None


def codes(x, scale, zero_point, qmin: float, qmax: float, axis: Optional[int], block_size: int, mode: int,
          need_mask: bool):
    """``(v, c, mask, s)`` in float32, shaped for broadcasting (``broadcast_view``): ``v = x / s``, the
    clipped code minus zero point ``c`` (FP8: the saturated FP8 value), the clip mask (None unless
    ``need_mask``) and the broadcast scale ``s``. The formula of the module docstring, shared by
    ``dal::fake_quantize`` and ``dal::fake_quantize_lsq`` (:mod:`.lsq`)."""
    gran = Granularity(axis, block_size)
    work, view = broadcast_view(gran, x.shape)
    v = x.to(torch.float32).reshape(work)
    s = view(scale.to(torch.float32))
    v = v / s
    if mode:
        dtype, limit = _FP8[mode]
        mask = v.abs() <= limit if need_mask else None
        c = torch.clamp(v, -limit, limit).to(dtype).to(torch.float32)
    else:
        zp = torch.round(zero_point.to(torch.float32)) if zero_point.is_floating_point() \
            else zero_point.to(torch.float32)
        zp = view(zp)
        lo, hi = qmin - zp, qmax - zp
        r = torch.round(v)
        mask = ((r >= lo) & (r <= hi)) if need_mask else None
        c = torch.clamp(r, lo, hi)
    return v, c, mask, s


def generic(x, scale, zero_point, qmin: float, qmax: float, axis: Optional[int], block_size: int, mode: int,
            need_mask: bool):
    """The op in plain torch, for every device and dtype (see the module docstring)."""
    _, c, mask, s = codes(x, scale, zero_point, qmin, qmax, axis, block_size, mode, need_mask)
    y = laid_out_like(x, (c * s).reshape(x.shape), x.dtype)
    if need_mask:
        mask = mask.reshape(x.shape)
        perm = mask_perm(x, axis, block_size)
        if perm is not None:
            mask = mask.permute(perm)
        m = pack_mask(mask, *mask_layout(x.shape, axis, block_size))
    else:
        m = x.new_empty(0, dtype=torch.uint8)
    return y, m


def kernel_params(scale, zero_point, qmin: float, qmax: float, mode: int):
    """``(s, lo, hi)`` flat float32 as ``dal_fq_forward`` reads them: the scale, and the code bounds
    ``qmin - zp`` and ``qmax - zp`` (FP8: -+max); ``dal.formats.fused.kernel_params``, the same
    float32 expressions as :func:`generic`."""
    fmt = _BY_MODE[mode] if mode else None
    return fused_kernel_params(scale, zero_point, fmt or _INTEGER, qmin, qmax)[:3]


def mask_layout(shape, axis: Optional[int], block_size: int) -> tuple[int, int]:
    """``(rows, row_len)`` of the op's packed mask for an input of ``shape`` (logical order): the
    C++ kernel's rows where it has a layout (:func:`kernel_layout`), one row otherwise."""
    n = math.prod(shape)
    if axis is None or n == 0:
        return 1, n
    inner = math.prod(shape[axis + 1:])
    if not block_size:
        return n // inner, inner
    if inner != 1:
        return 1, n
    return n // block_size, block_size


def unpack_mask(packed: torch.Tensor, rows: int, row_len: int, shape) -> torch.Tensor:
    """The packed mask (``rows`` rows of ``ceil(row_len / 8)`` bytes, bit ``j % 8`` of byte
    ``j // 8`` for element ``j`` of a row) as a bool tensor of ``shape``."""
    bit = torch.arange(8, dtype=torch.uint8, device=packed.device)
    b = (packed.reshape(rows, -1, 1) >> bit) & 1
    return b.reshape(rows, -1)[:, :row_len].reshape(shape).to(torch.bool)


def pack_mask(mask: torch.Tensor, rows: int, row_len: int) -> torch.Tensor:
    """A bool mask (logical order) in the layout :func:`unpack_mask` reads, the C++ kernel's."""
    m = mask.reshape(rows, row_len).to(torch.uint8)
    pad = (-row_len) % 8
    if pad:
        m = torch.cat([m, m.new_zeros(rows, pad)], dim=1)
    weights = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8, device=mask.device)
    return (m.reshape(rows, -1, 8) * weights).sum(dim=-1, dtype=torch.uint8).reshape(-1)


def kernel_layout(x: torch.Tensor, axis: Optional[int], block_size: int) -> Optional[tuple[int, int, int, int]]:
    """``(rows, row_len, param_div, param_mod)`` of ``dal_fq_forward``: x as ``rows`` contiguous rows
    (x's memory in order for a dense layout :func:`mask_perm` accepts),
    row ``r`` quantized with parameter ``(r // param_div) % param_mod``; None where the C++ kernel
    does not apply (not float32 contiguous or dense as above on the CPU, empty, blocks on an axis other than the
    last, or no kernel built)."""
    perm = mask_perm(x, axis, block_size)
    dense = x.is_contiguous() or (perm is not None and x.permute(perm).is_contiguous())
    if not (x.device.type == "cpu" and x.dtype == torch.float32 and dense and x.numel()):
        return None
    if type(x) not in (torch.Tensor, torch.nn.Parameter) or native.library() is None:
        return None
    n = x.numel()
    if axis is None:
        return 1, n, 1, 1
    inner = math.prod(x.shape[axis + 1:])
    if not block_size:
        return n // inner, inner, 1, int(x.shape[axis])
    if inner != 1:
        return None
    return n // block_size, block_size, 1, n // block_size


def cpu_kernel(x, scale, zero_point, qmin: float, qmax: float, axis: Optional[int], block_size: int, mode: int,
               need_mask: bool):
    """The op by the C++ kernel, or None where it does not apply (module docstring)."""
    if x.dtype != torch.float32 or not scale.is_cpu or not zero_point.is_cpu:
        return None
    lay = kernel_layout(x, axis, block_size)
    if lay is None:
        return None
    rows, row_len, div, mod = lay
    s, lo, hi = kernel_params(scale, zero_point, qmin, qmax, mode)
    if s.numel() != mod:
        return None  # a scale of another shape: the generic path broadcasts it or raises torch's error
    y = torch.empty_like(x)
    packed = torch.empty(rows * ((row_len + 7) // 8), dtype=torch.uint8) if need_mask else None
    native.library().dal_fq_forward(x.data_ptr(), y.data_ptr(), packed.data_ptr() if need_mask else None,
                                    rows, row_len, div, mod, s.data_ptr(), lo.data_ptr(), hi.data_ptr(), mode,
                                    torch.get_num_threads())
    return y, (packed if need_mask else x.new_empty(0, dtype=torch.uint8))


@torch.library.custom_op("dal::mask_grad", mutates_args=())
def mask_grad_op(grad: torch.Tensor, packed: torch.Tensor, rows: int, row_len: int) -> torch.Tensor:
    """``grad * mask`` with the packed mask of ``dal::fake_quantize`` (:func:`unpack_mask`): the
    straight-through gradient (0 * g keeps g's sign: -0.0 for negative g)."""
    return mask_grad_generic(grad, packed, rows, row_len)


def mask_grad_generic(grad: torch.Tensor, packed: torch.Tensor, rows: int, row_len: int) -> torch.Tensor:
    """``dal::mask_grad`` in plain torch, any device and dtype; laid out like ``grad``."""
    return laid_out_like(grad, grad * unpack_mask(packed, rows, row_len, grad.shape), grad.dtype)


@mask_grad_op.register_kernel("cpu")
def _mask_grad_cpu(grad, packed, rows, row_len):
    # the C++ dal_fq_backward, g * (0.0 or 1.0) per element as above, where it applies
    if grad.dtype != torch.float32 or not grad.is_contiguous() or not grad.numel() or native.library() is None \
            or type(grad) is not torch.Tensor:
        return mask_grad_generic(grad, packed, rows, row_len)
    out = torch.empty_like(grad)
    native.library().dal_fq_backward(grad.data_ptr(), packed.data_ptr(), out.data_ptr(), rows, row_len,
                                     torch.get_num_threads())
    return out


@mask_grad_op.register_fake
def _mask_grad_fake(grad, packed, rows, row_len):
    return torch.empty_like(grad)


@torch.library.custom_op("dal::fake_quantize", mutates_args=())
def fake_quantize_op(x: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor, qmin: float, qmax: float,
                     axis: Optional[int], block_size: int, mode: int, need_mask: bool
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(y, mask)`` of the module docstring; the device-generic implementation."""
    return generic(x, scale, zero_point, qmin, qmax, axis, block_size, mode, need_mask)


@fake_quantize_op.register_kernel("cpu")
def _cpu(x, scale, zero_point, qmin, qmax, axis, block_size, mode, need_mask):
    done = cpu_kernel(x, scale, zero_point, qmin, qmax, axis, block_size, mode, need_mask)
    return done if done is not None else generic(x, scale, zero_point, qmin, qmax, axis, block_size, mode, need_mask)


@fake_quantize_op.register_fake
def _fake(x, scale, zero_point, qmin, qmax, axis, block_size, mode, need_mask):
    rows, row_len = mask_layout(x.shape, axis, block_size)
    return torch.empty_like(x), x.new_empty(rows * ((row_len + 7) // 8) if need_mask else 0, dtype=torch.uint8)


def _setup_context(ctx, inputs, output):
    x, _, _, _, _, axis, block_size, _, need_mask = inputs
    ctx.save_for_backward(output[1])
    ctx.rows, ctx.row_len = mask_layout(x.shape, axis, block_size)
    ctx.need_mask = need_mask
    ctx.perm = mask_perm(x, axis, block_size)


def _backward(ctx, grad_y, grad_mask):
    (mask,) = ctx.saved_tensors
    if not ctx.need_mask:
        raise RuntimeError("dal::fake_quantize was called with need_mask=False but a gradient is asked for; "
                           "call it through dal.kernels.fake_quantize, which sets need_mask")
    if ctx.perm is None:
        grad_x = mask_grad_op(grad_y, mask, ctx.rows, ctx.row_len)
    else:  # the mask in x's memory order: grad_y permuted alike (contiguous when laid out as x)
        inverse = sorted(range(len(ctx.perm)), key=ctx.perm.__getitem__)
        grad_x = mask_grad_op(grad_y.permute(ctx.perm), mask, ctx.rows, ctx.row_len).permute(inverse)
    return grad_x, None, None, None, None, None, None, None, None


fake_quantize_op.register_autograd(_backward, setup_context=_setup_context)


def op_format_args(fmt, narrow_range: bool = False) -> tuple[int, float, float]:
    """The ops' ``(mode, qmin, qmax)`` for a scaled format: an FP8 format's kernel mode and
    ``-+max``; an integer format mode 0 and its code range (narrowed with ``narrow_range``).
    A format without a scale (fp16, bf16) is a ValueError naming fp_round_trip."""
    fmt = get_format(fmt)
    if not fmt.is_scaled:
        raise ValueError(f"format {fmt.name!r} has no scale: use dal.kernels.fp_round_trip")
    if fmt.is_float8:
        return FP8_MODES[fmt.name], -fmt.max_value, fmt.max_value
    qmin, qmax = code_range(fmt, narrow_range)
    return 0, qmin, qmax


def fake_quantize(x: torch.Tensor, scale: torch.Tensor, zero_point: Optional[torch.Tensor], fmt,
                  granularity: Granularity = PER_TENSOR, narrow_range: bool = False) -> torch.Tensor:
    """``dequantize(quantize(x))`` by ``dal::fake_quantize``: integer or FP8 ``fmt`` at ``granularity``,
    ``scale`` / ``zero_point`` shaped ``granularity.scale_shape(x.shape)`` (zero point None: 0).
    Returns ``y`` in ``x``'s dtype; ``d y / d x`` is the clip mask (STE), the scale gets no gradient.

    >>> fake_quantize(torch.tensor([0.5, 1.5, 2.5, 300.0]), torch.tensor(1.0), None, "int8").tolist()
    [0.0, 2.0, 2.0, 127.0]
    """
    mode, qmin, qmax = op_format_args(fmt, narrow_range)
    if zero_point is None:
        zero_point = torch.zeros(scale.shape, dtype=torch.int32, device=scale.device)
    need_mask = x.requires_grad and torch.is_grad_enabled()
    y, _ = fake_quantize_op(x, scale, zero_point, float(qmin), float(qmax), granularity.normalized_axis(x.dim()),
                            granularity.block_size, mode, need_mask)
    return y
