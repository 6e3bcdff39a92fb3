"""ONNX QuantizeLinear / DequantizeLinear semantics in numpy (the float side of every group).

    DequantizeLinear:  y = float32(x - zero_point) * scale           (integer x; float32 product)
                       y = float32(x) * scale                         (float8 x)
    QuantizeLinear:    y = saturate(round_half_even(x / scale) + zero_point)   (float32 DIVISION)
                       float8: y = cast(x / scale) with saturate=1 clipping to +-max first

Scales and zero points are per tensor (scalar), per axis (1-D, ``axis``) or per block
(``block_size`` > 0: same rank as x, ``ceil(x.shape[axis] / block_size)`` along ``axis``).
Clipping happens in float before the integer cast (onnxruntime's behaviour and the spec's;
onnx.reference casts to int32 first and wraps for |x/scale| >= 2^31: measured, 3e9 gives -128,
not 127). float16 inputs are divided in float32.
"""
from __future__ import annotations

import ml_dtypes
import numpy as np

from .errors import NPUError

FLOAT8 = {np.dtype(ml_dtypes.float8_e4m3fn), np.dtype(ml_dtypes.float8_e5m2),
          np.dtype(ml_dtypes.float8_e4m3fnuz), np.dtype(ml_dtypes.float8_e5m2fnuz)}
INT4 = {np.dtype(ml_dtypes.int4), np.dtype(ml_dtypes.uint4)}
INTEGER_Q = {np.dtype(t) for t in (np.int8, np.uint8, np.int16, np.uint16, np.int32)} | INT4


def int_range(dtype) -> tuple[int, int]:
    """(qmin, qmax) of an integer storage dtype, int4/uint4 included."""
    info = ml_dtypes.iinfo(dtype) if np.dtype(dtype) in INT4 else np.iinfo(dtype)
    return int(info.min), int(info.max)


def broadcast_param(p: np.ndarray, x_shape, axis: int, block_size: int, what: str) -> np.ndarray:
    """Reshape/expand a scale or zero point so it broadcasts against x (per tensor/axis/block)."""
    p = np.asarray(p)
    rank = len(x_shape)
    if p.size == 1 and block_size == 0:
        return p.reshape(())
    if rank == 0:
        raise NPUError(f"{what}: non-scalar parameter for a scalar input")
    axis = axis + rank if axis < 0 else axis
    if not 0 <= axis < rank:
        raise NPUError(f"{what}: axis {axis} out of range for rank {rank}")
    if block_size > 0:
        if p.ndim != rank:
            raise NPUError(f"{what}: blocked parameter must have rank {rank}, got shape {p.shape}")
        need = -(-x_shape[axis] // block_size)
        if p.shape[axis] != need or any(p.shape[i] != x_shape[i] for i in range(rank) if i != axis):
            raise NPUError(f"{what}: blocked parameter shape {p.shape} does not match input "
                           f"{tuple(x_shape)} with block_size {block_size} on axis {axis}")
        return p.take(np.arange(x_shape[axis]) // block_size, axis=axis)  # element i in block i // block_size
    if block_size < 0:
        raise NPUError(f"{what}: negative block_size {block_size}")
    if p.ndim != 1 or p.shape[0] != x_shape[axis]:
        raise NPUError(f"{what}: per-axis parameter of shape {p.shape} does not match "
                       f"dimension {x_shape[axis]} of axis {axis}")
    shape = [1] * rank
    shape[axis] = p.shape[0]
    return p.reshape(shape)


def dequantize(x: np.ndarray, scale: np.ndarray, zp: np.ndarray | None = None, *, axis: int = 1,
               block_size: int = 0, out_dtype=None) -> np.ndarray:
    """DequantizeLinear. Output dtype: ``out_dtype`` or the scale's dtype."""
    x = np.asarray(x)
    scale = np.asarray(scale)
    out_dtype = np.dtype(out_dtype or scale.dtype)
    s = broadcast_param(scale, x.shape, axis, block_size, "DequantizeLinear scale").astype(np.float32)
    if x.dtype in FLOAT8:
        return (x.astype(np.float32) * s).astype(out_dtype)
    d = x.astype(np.int64)
    if zp is not None:
        d = d - broadcast_param(np.asarray(zp), x.shape, axis, block_size,
                                "DequantizeLinear zero point").astype(np.int64)
    return (d.astype(np.float32) * s).astype(out_dtype)


def quantize(x: np.ndarray, scale: np.ndarray, zp: np.ndarray | None, out_dtype, *, axis: int = 1,
             block_size: int = 0, saturate: bool = True) -> np.ndarray:
    """QuantizeLinear to ``out_dtype`` (int8/uint8/int16/uint16/int4/uint4/float8)."""
    out_dtype = np.dtype(out_dtype)
    x = np.asarray(x)
    s = broadcast_param(np.asarray(scale), x.shape, axis, block_size, "QuantizeLinear scale")
    r = x.astype(np.float32) / s.astype(np.float32)
    if out_dtype in FLOAT8:
        if saturate:
            fmax = np.float32(ml_dtypes.finfo(out_dtype).max)
            r = np.where(np.isnan(r), r, np.clip(r, -fmax, fmax))
        return r.astype(out_dtype)
    if out_dtype not in INTEGER_Q:
        raise NPUError(f"QuantizeLinear to {out_dtype} is not supported")
    qmin, qmax = int_range(out_dtype)
    q = np.rint(r).astype(np.float64)
    if zp is not None:
        q = q + broadcast_param(np.asarray(zp), x.shape, axis, block_size,
                                "QuantizeLinear zero point").astype(np.float64)
    return np.clip(q, qmin, qmax).astype(np.int64).astype(out_dtype)
