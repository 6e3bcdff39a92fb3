"""quantize / dequantize / fake_quantize with exactly ONNX QuantizeLinear semantics.

    q = saturate(round_half_to_even(x / scale) + zero_point)          (integer formats)
    q = cast_saturate(x / scale)                                     (FP8, ONNX saturate=1)
    x' = (q - zero_point) * scale                                    (DequantizeLinear)

The division is a real float32 division, as in ONNX: torch's own fake-quant ops multiply by
``1/scale`` and land one LSB off on about 1e-6 of elements. INT4 is round, then clip.
"""
from __future__ import annotations

from typing import Optional

import torch

from .autograd import FakeQuantizeFunction, fp_cast_fake_quantize
from .checks import check_scale, check_tensor, check_zero_point
from .fused import FusedFakeQuantizeFunction, eligible
from .granularity import PER_TENSOR, Granularity
from .qformat import get_format
from .qparams import code_range
from .track import fixed_kernel_params


def _prepare(x, fmt, scale, zero_point, granularity, narrow_range):
    fmt = get_format(fmt)
    gran = granularity or PER_TENSOR
    check_tensor(x, gran)
    if not fmt.is_scaled:
        return fmt, gran, None, None, None, None
    scale = torch.as_tensor(scale, dtype=torch.float32, device=x.device)
    check_scale(scale, gran.scale_shape(x.shape))
    if zero_point is None:
        zero_point = torch.zeros_like(scale, dtype=torch.int32)
    zero_point = torch.as_tensor(zero_point, device=x.device)
    if zero_point.shape != scale.shape and zero_point.numel() != scale.numel():
        raise ValueError(f"zero_point has shape {tuple(zero_point.shape)} but scale has {tuple(scale.shape)}")
    qmin, qmax = code_range(fmt, narrow_range)
    check_zero_point(zero_point, fmt, qmin, qmax)
    return fmt, gran, scale.reshape(gran.scale_shape(x.shape)), zero_point.reshape(scale.shape), qmin, qmax


def quantize(x: torch.Tensor, fmt, scale, zero_point=None, granularity: Optional[Granularity] = None,
             narrow_range: bool = False) -> torch.Tensor:
    """Quantize ``x`` to codes of ``fmt`` (ONNX QuantizeLinear).

    Returns a tensor of the format's storage dtype (``fmt.torch_storage``: int8 for INT4 codes,
    float8 dtypes for FP8, float16 / bfloat16 for the plain casts).

    >>> quantize(torch.tensor([0.5, 1.5, 2.5, 300.0]), "int8", 1.0).tolist()
    [0, 2, 2, 127]
    """
    fmt, gran, scale, zp, qmin, qmax = _prepare(x, fmt, scale, zero_point, granularity, narrow_range)
    if not fmt.is_scaled:
        return x.to(fmt.torch_dtype())
    v = x.float() / gran.expand(scale, x.shape)
    if fmt.is_float8:
        return torch.clamp(v, -fmt.max_value, fmt.max_value).to(fmt.torch_dtype())
    # NaN has no integer code and ONNX leaves it undefined (onnxruntime happens to give qmin).
    # dal maps it to the zero point's code, which dequantizes to 0.0; +-inf saturate like any
    # out-of-range value (the spec's rule, which onnxruntime follows).
    # Saturate in float64 for formats wider than float32's 24-bit integers: in float32 the int32
    # bound 2**31 - 1 rounds up to 2**31, and the cast would wrap that to -2**31.
    work = torch.float64 if fmt.bits > 24 else torch.float32
    v = torch.nan_to_num_(torch.round(v), nan=0.0).to(work).add_(gran.expand(zp.to(work), x.shape))
    v = v.clamp_(qmin, qmax)
    return v.to(fmt.torch_dtype())


def dequantize(q: torch.Tensor, fmt, scale, zero_point=None, granularity: Optional[Granularity] = None) -> torch.Tensor:
    """Codes back to float32 (ONNX DequantizeLinear): ``(q - zero_point) * scale``."""
    fmt = get_format(fmt)
    gran = granularity or PER_TENSOR
    if not fmt.is_scaled:
        return q.to(torch.float32)
    scale = torch.as_tensor(scale, dtype=torch.float32, device=q.device)
    shape = gran.scale_shape(q.shape)
    check_scale(scale, shape)
    scale = scale.reshape(shape)
    v = q.to(torch.float32)
    if zero_point is not None and not fmt.is_float8:
        zp = torch.as_tensor(zero_point, device=q.device).reshape(shape).to(torch.float32)
        v = v - gran.expand(zp, q.shape)
    return v * gran.expand(scale, q.shape)


def fake_quantize(x: torch.Tensor, fmt, scale=None, zero_point=None, granularity: Optional[Granularity] = None,
                  narrow_range: bool = False, learnable: bool = False, grad_scale: float = 1.0,
                  check: bool = True) -> torch.Tensor:
    """``dequantize(quantize(x))`` in float32, differentiable.

    Gradients (straight-through estimator with clipping; LSQ / LSQ+ for a learnable scale and
    zero point), with ``v = x / scale`` and ``c = clamp(round(v), qmin - zp, qmax - zp)``:

    * ``d out / d x     = 1`` where ``qmin <= round(v) + zp <= qmax`` (FP8: ``|v| <= max``), else 0;
    * ``d out / d scale = (c - v) * g`` inside that range and ``c * g`` outside (``g = grad_scale``);
    * ``d out / d zp    = 0`` inside, ``-scale * g`` outside (only when ``zero_point`` requires grad).

    ``scale`` and ``zero_point`` receive gradients only when they require grad; pass
    ``learnable=True`` to round a floating zero point in the forward pass (LSQ+).
    FP16 / BF16 are a cast round trip with an identity gradient.
    """
    if check:
        fmt, gran, scale, zero_point, qmin, qmax = _prepare(x, fmt, scale, zero_point, granularity, narrow_range)
    else:
        fmt = get_format(fmt)
        gran = granularity or PER_TENSOR
        qmin, qmax = code_range(fmt, narrow_range) if fmt.is_scaled else (None, None)
    if not fmt.is_scaled:
        return fp_cast_fake_quantize(x, fmt.torch_dtype())
    if not isinstance(scale, torch.Tensor):
        scale = torch.as_tensor(scale, dtype=torch.float32, device=x.device)
    if zero_point is None:
        # Shaped like the scale (not a scalar): per-group expansion repeats it along the axis.
        zero_point = torch.zeros(scale.shape, dtype=torch.float32, device=x.device)
    elif not isinstance(zero_point, torch.Tensor):
        zero_point = torch.as_tensor(zero_point, device=x.device)
    if eligible(x, scale, zero_point, fmt, gran):
        # Same bits as the eager function below, in one pass over memory (see fused.py); the kernel's
        # bounds from one C++ call (fixed_kernel_params) rather than ~10 small torch ops.
        return FusedFakeQuantizeFunction.apply(x, scale, zero_point, fmt, gran, qmin, qmax,
                                               fixed_kernel_params(scale, zero_point, fmt, qmin, qmax))
    return FakeQuantizeFunction.apply(x, scale, zero_point, fmt, gran, qmin, qmax, grad_scale)
