"""Quantization ops run node by node: QuantizeLinear, DequantizeLinear, the QOperator ops
(QLinearConv, QLinearMatMul), ConvInteger, MatMulInteger and DynamicQuantizeLinear.

Integer products go through the exact int32 C++ kernels (kernels.py). The QOperator
requantization follows the ONNX reference implementation: ``R = float64(acc) *
float32(float32(x_scale * w_scale) / y_scale) + y_zero_point``, rounded half to even and
saturated (the spec does not pin the rounding of this product further).
"""
from __future__ import annotations

import numpy as np

from . import kernels, quant
from .errors import NPUError, UnsupportedNode
from .ops_float import op
from .ops_nn import conv_attrs
from .validate import check_scale

DQ_INPUTS = quant.INTEGER_Q | quant.FLOAT8
FLOAT_IN = {np.dtype(np.float32), np.dtype(np.float16)}


def _types(ins):
    return [str(x.dtype) if x is not None else "none" for x in ins]


@op("DequantizeLinear")
def _dq(ctx, ins, a):
    x, s = ins[0], ins[1]
    zp = ins[2] if len(ins) > 2 else None
    if x.dtype not in DQ_INPUTS or s.dtype not in FLOAT_IN:
        raise UnsupportedNode(ctx.node, _types(ins), "DequantizeLinear element types")
    if zp is not None and zp.dtype != x.dtype:
        raise NPUError(f"node {ctx.node.name!r}: zero point type {zp.dtype} != input type {x.dtype}")
    check_scale(s, ctx.node)
    out = s.dtype
    if a.get("output_dtype"):
        from .tensors import np_dtype
        out = np_dtype(a["output_dtype"], ctx.node)
    return [quant.dequantize(x, s, zp, axis=a.get("axis", 1), block_size=a.get("block_size", 0),
                             out_dtype=out)]


@op("QuantizeLinear")
def _q(ctx, ins, a):
    x, s = ins[0], ins[1]
    zp = ins[2] if len(ins) > 2 else None
    if x.dtype not in FLOAT_IN or s.dtype not in FLOAT_IN:
        raise UnsupportedNode(ctx.node, _types(ins), "QuantizeLinear element types")
    check_scale(s, ctx.node)
    if zp is not None:
        out = zp.dtype
    elif a.get("output_dtype"):
        from .tensors import np_dtype
        out = np_dtype(a["output_dtype"], ctx.node)
    else:
        out = np.dtype(np.uint8)
    if out not in DQ_INPUTS or out == np.int32:
        raise UnsupportedNode(ctx.node, _types(ins), f"QuantizeLinear to {out}")
    return [quant.quantize(x, s, zp, out, axis=a.get("axis", 1), block_size=a.get("block_size", 0),
                           saturate=bool(a.get("saturate", 1)))]


def _int8ish(x):
    return x is not None and x.dtype in (np.dtype(np.int8), np.dtype(np.uint8))


def _zp_scalar(z, what, ctx):
    if z is None:
        return 0
    if z.size != 1:
        raise UnsupportedNode(ctx.node, [], f"{what} zero point must be a scalar")
    return int(z.reshape(-1)[0])


def _int_conv(ctx, x, zx, w, zw, a):
    strides, dil, pads, group = conv_attrs(ctx, x.shape, w.shape, a)
    one_d = w.ndim == 3
    if one_d:
        x, w = x[:, :, None], w[:, :, None]
    zw = np.asarray(0 if zw is None else zw).astype(np.int32)
    if zw.size > 1 and zw.size != w.shape[0]:
        raise NPUError(f"node {ctx.node.name!r}: weight zero point size {zw.size} != {w.shape[0]} outputs")
    wts = kernels.ConvWeights(w, zw, group)
    acc = kernels.conv2d(x, zx, wts, strides, dil, pads, ctx.threads, repr(ctx.node.name))
    return acc[:, :, 0] if one_d else acc


@op("ConvInteger")
def _conv_integer(ctx, ins, a):
    x, w = ins[0], ins[1]
    if not (_int8ish(x) and _int8ish(w)):
        raise UnsupportedNode(ctx.node, _types(ins), "ConvInteger needs int8/uint8 inputs")
    zx = _zp_scalar(ins[2] if len(ins) > 2 else None, "input", ctx)
    zw = ins[3] if len(ins) > 3 else None
    return [_int_conv(ctx, x, zx, w, zw, a)]


@op("QLinearConv")
def _qlinear_conv(ctx, ins, a):
    x, xs, xz, w, ws, wz, ys, yz = ins[:8]
    b = ins[8] if len(ins) > 8 else None
    if not (_int8ish(x) and _int8ish(w)) or (yz is not None and not _int8ish(yz)):
        raise UnsupportedNode(ctx.node, _types(ins), "QLinearConv needs int8/uint8 tensors")
    acc = _int_conv(ctx, x, _zp_scalar(xz, "input", ctx), w, wz, a).astype(np.int64)
    if b is not None:
        acc = acc + b.astype(np.int64).reshape((1, -1) + (1,) * (acc.ndim - 2))
    m = (xs.astype(np.float32) * ws.astype(np.float32) / ys.astype(np.float32)).astype(np.float32)
    m = m.reshape((1, -1) + (1,) * (acc.ndim - 2)) if m.size > 1 else m.reshape(())
    return [_requant_like_reference(acc.astype(np.int32), m, yz, x.dtype)]


def _requant_like_reference(acc, m, yz, default_dtype):
    r = acc.astype(np.float64) * m.astype(np.float64)
    dtype = yz.dtype if yz is not None else np.dtype(default_dtype)
    if yz is not None:
        r = r + yz.astype(np.float64).reshape(yz.shape if yz.size > 1 else ())
    qmin, qmax = quant.int_range(dtype)
    return np.clip(np.rint(r), qmin, qmax).astype(dtype)


def int_matmul(ctx, a, za, b, zb):
    """Exact int32 np.matmul semantics (broadcast batch dims) of (a - za) x (b - zb)."""
    a16 = np.asarray(a).astype(np.int32) - za
    b16 = np.asarray(b).astype(np.int32) - zb
    a2 = a16[None] if a16.ndim == 1 else a16
    b2 = b16[:, None] if b16.ndim == 1 else b16
    if a2.shape[-1] != b2.shape[-2]:
        raise NPUError(f"node {ctx.node.name!r}: matmul shapes {a.shape} x {b.shape}")
    batch = np.broadcast_shapes(a2.shape[:-2], b2.shape[:-2])
    aa = np.broadcast_to(a2, batch + a2.shape[-2:]).reshape((-1,) + a2.shape[-2:])
    bb = np.broadcast_to(b2, batch + b2.shape[-2:]).reshape((-1,) + b2.shape[-2:])
    out = np.empty((aa.shape[0], aa.shape[1], bb.shape[2]), dtype=np.int32)
    for i in range(aa.shape[0]):
        out[i] = kernels.matmul_s16(kernels.to_s16(aa[i], 0), kernels.to_s16(bb[i], 0),
                                    ctx.threads).numpy()
    out = out.reshape(batch + out.shape[1:])
    if a16.ndim == 1:
        out = out[..., 0, :]
    if b16.ndim == 1:
        out = out[..., 0]
    return out


@op("MatMulInteger")
def _matmul_integer(ctx, ins, a):
    x, w = ins[0], ins[1]
    if not (_int8ish(x) and _int8ish(w)):
        raise UnsupportedNode(ctx.node, _types(ins), "MatMulInteger needs int8/uint8 inputs")
    za = ins[2] if len(ins) > 2 and ins[2] is not None else np.zeros((), x.dtype)
    zb = ins[3] if len(ins) > 3 and ins[3] is not None else np.zeros((), w.dtype)
    za = za.astype(np.int32).reshape(-1, 1) if za.size > 1 else za.astype(np.int32).reshape(())
    zb = zb.astype(np.int32).reshape(-1) if zb.size > 1 else zb.astype(np.int32).reshape(())
    return [int_matmul(ctx, x, za, w, zb)]


@op("QLinearMatMul")
def _qlinear_matmul(ctx, ins, a):
    x, xs, xz, w, ws, wz, ys, yz = ins[:8]
    if not (_int8ish(x) and _int8ish(w)):
        raise UnsupportedNode(ctx.node, _types(ins), "QLinearMatMul needs int8/uint8 inputs")
    za = xz.astype(np.int32).reshape(()) if xz is not None and xz.size == 1 else (
        0 if xz is None else xz.astype(np.int32).reshape(-1, 1))
    zb = wz.astype(np.int32).reshape(()) if wz is not None and wz.size == 1 else (
        0 if wz is None else wz.astype(np.int32).reshape(-1))
    acc = int_matmul(ctx, x, za, w, zb)
    m = (xs.astype(np.float32) * ws.astype(np.float32) / ys.astype(np.float32)).astype(np.float32)
    return [_requant_like_reference(acc, m, yz, x.dtype)]


@op("DynamicQuantizeLinear")
def _dynamic_q(ctx, ins, a):
    x = ins[0]
    if x.dtype != np.float32:
        raise UnsupportedNode(ctx.node, _types(ins), "DynamicQuantizeLinear needs float32")
    mx = np.float32(max(0.0, float(np.max(x)) if x.size else 0.0))
    mn = np.float32(min(0.0, float(np.min(x)) if x.size else 0.0))
    scale = np.float32(1.0) if mx == mn else np.float32(mx - mn) / np.float32(255)
    zp = np.rint(np.clip(np.float32(0) - mn / scale, 0, 255))
    y = np.clip(np.rint(x / scale) + zp, 0, 255).astype(np.uint8)
    return [y, np.array(scale, dtype=np.float32), np.array(zp, dtype=np.uint8)]
