"""PRelu, Celu, Selu, Sign and LogSoftmax, node by node (export/SPEC.md §5a): the float nodes torch
writes for ``nn.PReLU``, ``nn.CELU``, ``nn.SELU``, ``nn.LPPool*`` (its Sign) and ``F.log_softmax``.

    PRelu       y = x                              (x >= 0)
                y = x * slope                      (x < 0; one IEEE multiplication in T, slope
                                                    broadcast to x)
    Celu        y = T(max(0, x) + min(0, alpha * (exp(x / alpha) - 1)))     in float64
    Selu        y = T(gamma * x)                   (x > 0)     in float64
                y = T(gamma * (alpha * expm1(x)))              (x <= 0)
    Sign        y = -1, 0, 1 (NaN stays NaN)       exact
    LogSoftmax  d = x - max(x);  y = T(d - log1p(sum_{j != k} exp(d_j)))   along ``axis``, in
                float64, k the (first) position of the max: the sum without the max's own 1,
                so a row whose other terms are tiny keeps their digits (log(1 + s) would not)

``T`` is x's float type: each node rounds once, as Elu and Tanh do (ops_float.py). ``alpha`` and
``gamma`` are the file's float32 attributes, widened exactly.
"""
from __future__ import annotations

import numpy as np

from .errors import UnsupportedNode
from .ops_float import op
from .tensors import as_compute_type, is_float

_SELU_ALPHA = 1.67326319217681884765625   # ONNX's defaults (float32 values)
_SELU_GAMMA = 1.05070102214813232421875


def _float_input(ctx, x):
    if not is_float(x):
        raise UnsupportedNode(ctx.node, [x.dtype], "expects a float tensor")
    return as_compute_type(x)


@op("PRelu")
def _prelu(ctx, ins, a):
    x, slope = ins[0], ins[1]
    xc = _float_input(ctx, x)
    s = np.asarray(slope).astype(xc.dtype)
    return [np.where(xc >= 0, xc, xc * s).astype(x.dtype)]


@op("Celu")
def _celu(ctx, ins, a):
    x = ins[0]
    x64 = _float_input(ctx, x).astype(np.float64)
    alpha = float(a.get("alpha", 1.0))
    y = np.maximum(0.0, x64) + np.minimum(0.0, alpha * np.expm1(np.minimum(x64, 0.0) / alpha))
    return [y.astype(x.dtype)]


@op("Selu")
def _selu(ctx, ins, a):
    x = ins[0]
    x64 = _float_input(ctx, x).astype(np.float64)
    alpha, gamma = float(a.get("alpha", _SELU_ALPHA)), float(a.get("gamma", _SELU_GAMMA))
    y = np.where(x64 > 0, gamma * x64, gamma * (alpha * np.expm1(np.minimum(x64, 0.0))))
    return [y.astype(x.dtype)]


@op("Sign")
def _sign(ctx, ins, a):
    x = ins[0]
    return [np.sign(x).astype(x.dtype)]


@op("LogSoftmax")
def _log_softmax(ctx, ins, a):
    x = ins[0]
    if ctx.opset < 13:
        raise UnsupportedNode(ctx.node, [x.dtype], "LogSoftmax before opset 13 (2-D coercion)")
    axis = a.get("axis", -1)
    x64 = _float_input(ctx, x).astype(np.float64)
    top = np.expand_dims(np.argmax(x64, axis=axis), axis)
    d = x64 - np.take_along_axis(x64, top, axis)
    e = np.exp(d)
    np.put_along_axis(e, top, 0.0, axis)  # the max's own term, exp(0) = 1, is the 1 of log1p
    y = d - np.log1p(e.sum(axis=axis, keepdims=True))
    return [y.astype(x.dtype)]
