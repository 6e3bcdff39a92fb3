"""The exponential activations as torch exports them and dal.npu computes them (export/SPEC.md
§5a: a float op computed in float64 from its float32 input and rounded once to float32).

Each form takes the torch function's arguments and returns None where the export would not be the
one node stated (another dtype, an argument the exporter writes as more nodes), so torch runs.
The float64 arithmetic is numpy's, on the CPU, as dal.npu's kernels compute it (its ``Elu``,
``Celu``, ``Selu``, ``Softplus``, ``LogSoftmax``): the same routine on the same values gives the
same bits, where torch's float64 ``expm1`` / ``logaddexp`` are other implementations whose last
bit may differ (:mod:`dal.convert.matmul_f64` does the same for float-island MatMuls).
"""
from __future__ import annotations

from typing import Optional

import numpy as np
import torch
import torch.nn.functional as F

from .op_forms import form_factory

#: ONNX Selu's default attributes (torch exports F.selu as Selu without attributes), float32 values
SELU_ALPHA = float(np.float32(1.67326319217681884765625))
SELU_GAMMA = float(np.float32(1.05070102214813232421875))


def _f64(x: torch.Tensor) -> Optional[np.ndarray]:
    return x.detach().to("cpu", torch.float64).numpy() if x.dtype == torch.float32 else None


def _back(y: np.ndarray, like: torch.Tensor) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(y.astype(np.float32))).to(like.device)


def _attr(value: float) -> float:
    """An ONNX float attribute as the file holds it: ``value`` rounded to float32."""
    return float(np.float32(value))


@np.errstate(all="ignore")  # inf / NaN inputs give inf / NaN, as the node's
def elu_f64(x, alpha=1.0, inplace=False):
    """ONNX Elu: ``x`` for ``x >= 0``, else ``alpha * expm1(x)``, in float64, rounded once."""
    v = _f64(x)
    if v is None:
        return None
    return _back(np.where(v >= 0, v, _attr(alpha) * np.expm1(np.minimum(v, 0.0))), x)


@np.errstate(all="ignore")
def celu_f64(x, alpha=1.0, inplace=False):
    """ONNX Celu: ``max(0, x) + min(0, alpha * expm1(x / alpha))``, in float64, rounded once."""
    v = _f64(x)
    if v is None:
        return None
    a = _attr(alpha)
    return _back(np.maximum(0.0, v) + np.minimum(0.0, a * np.expm1(np.minimum(v, 0.0) / a)), x)


@np.errstate(all="ignore")
def selu_f64(x, inplace=False):
    """ONNX Selu (default attributes): ``gamma * x`` for ``x > 0``, else
    ``gamma * (alpha * expm1(x))``, in float64, rounded once."""
    v = _f64(x)
    if v is None:
        return None
    return _back(np.where(v > 0, SELU_GAMMA * v, SELU_GAMMA * (SELU_ALPHA * np.expm1(np.minimum(v, 0.0)))), x)


@np.errstate(all="ignore")
def softplus_f64(x, beta=1.0, threshold=20.0):
    """ONNX Softplus, ``log(1 + exp(x))`` as ``logaddexp(0, x)`` in float64, rounded once; torch
    exports ``F.softplus`` with ``beta == 1`` as that one node (its ``threshold`` is not exported:
    the node computes the exact function). Another ``beta``: None (Mul, Softplus, Div nodes)."""
    v = _f64(x)
    if v is None or beta != 1:
        return None
    return _back(np.logaddexp(0.0, v), x)


@np.errstate(all="ignore")
def mish_f64(x, inplace=False):
    """``F.mish`` as torch exports it, ``x * Tanh(Softplus(x))``: the Softplus and the Tanh each in
    float64 rounded once to float32, the Mul in float32."""
    v = _f64(x)
    if v is None:
        return None
    t = np.tanh(np.logaddexp(0.0, v).astype(np.float32).astype(np.float64))
    return x * _back(t, x)


@np.errstate(all="ignore")
def log_softmax_f64(x, dim=None, _stacklevel=3, dtype=None):
    """ONNX LogSoftmax (opset 13+) over ``dim``, in float64, rounded once: with ``m`` the first
    maximum along ``dim`` and ``d = x - m``, ``d - log1p(sum of exp(d) over the other elements)``.
    No explicit ``dim``, or a ``dtype``: None."""
    v = _f64(x)
    if v is None or dim is None or dtype is not None:
        return None
    top = np.expand_dims(np.argmax(v, axis=dim), dim)
    d = v - np.take_along_axis(v, top, dim)
    e = np.exp(d)
    np.put_along_axis(e, top, 0.0, dim)
    return _back(d - np.log1p(e.sum(axis=dim, keepdims=True)), x)


@form_factory(needs_opset=False)
def elu_form(func, opset):
    """The ``elu`` op's form for a call of ``func``: :func:`elu_f64` for ``F.elu``,
    :func:`celu_f64` for ``F.celu`` (exported as Celu); None for its other callables."""
    if func is F.elu:
        return elu_f64
    return celu_f64 if func is F.celu else None
