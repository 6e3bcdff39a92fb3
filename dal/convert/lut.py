"""``QLutActivation`` (rule ``lut_activation``) in the integer model: one table per layer,
``T[c] = Q_out(f(DQ_in(c)))`` for every input code ``c``, with ``f`` evaluated as the exported
graph spells it (export/SPEC.md §6a), not as torch's float32 kernels compute it:

* ``gelu`` (exact form), traced opset < 20: ``Mul(Mul(x, Add(Erf(Div(x, float32(sqrt 2))), 1)),
  0.5)``, each node one float32 op, ``Erf`` in float64 rounded once; opset 20: ``Gelu``,
  ``0.5 x (1 + erf(x / sqrt 2))`` in float64 rounded once; its tanh form: :func:`_gelu_tanh`;
* ``sigmoid``: ``1 / (1 + exp(-x))`` in float64 rounded once; ``silu``: ``x * sigmoid(x)``;
* ``tanh``: ``tanh`` in float64, rounded once;
* ``hardsigmoid``: ``clip(x * float32(1/6) + 0.5, 0, 1)`` in float32; ``hardswish``: ``x *`` that.

The table is computed once, in numpy, for the 2^bits codes of the input format, so the
integer model runs the same function on every device. A float ``nn.GELU`` module (no
table, either form) is :class:`GeluForm`: the same GELU nodes, in torch on the device.
"""
from __future__ import annotations

import math
from typing import Optional

import numpy as np
import torch
from torch import nn

from ..formats import dequantize, quantize
from .wrapped import WrapsModule

#: the first traced opset at which torch exports GELU as one ``Gelu`` node
GELU_OPSET = 20
_F = np.float32
_erf = np.vectorize(math.erf, otypes=[np.float64])


def _sigmoid(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        return (1.0 / (1.0 + np.exp(-x.astype(np.float64)))).astype(_F)


def _hardsigmoid(x: np.ndarray) -> np.ndarray:
    return np.clip(x * _F(1.0 / 6.0) + _F(0.5), _F(0), _F(1))


#: the float32 constants torch's exporter writes for GELU's tanh form (below opset 20)
_KAPPA, _BETA = _F(0.044715), _F(math.sqrt(2.0 / math.pi))


def _gelu_tanh(x: np.ndarray, opset: int) -> np.ndarray:
    """GELU's tanh form as exported: opset >= 20 one ``Gelu(approximate="tanh")`` node,
    ``0.5 x (1 + tanh(u)) = x / (1 + exp(-2u))``, ``u = sqrt(2/pi) (x + 0.044715 (x x) x)``, in
    float64 rounded once (the second spelling: no cancellation where tanh(u) ~ -1); below,
    ``Mul(0.5, Mul(x, Add(1, Tanh(Mul(beta, Add(x, Mul(kappa, Mul(x, Mul(x, x)))))))))``, each
    Mul / Add one float32 op, ``Tanh`` in float64 rounded once (export/SPEC.md §5a)."""
    if opset >= GELU_OPSET:
        x64 = x.astype(np.float64)
        u = math.sqrt(2 / math.pi) * (x64 + 0.044715 * (x64 * x64 * x64))
        with np.errstate(over="ignore"):
            return (x64 / (1 + np.exp(-2 * u))).astype(_F)
    inner = _BETA * (x + _KAPPA * (x * (x * x)))
    t = np.tanh(inner.astype(np.float64)).astype(_F)
    return _F(0.5) * (x * (_F(1) + t))


def onnx_function(fn: str, x: np.ndarray, approximate: str, opset: int) -> Optional[np.ndarray]:
    """``f(x)`` on float32 ``x`` as the exported nodes compute it (module doc); None: no form."""
    x = np.asarray(x, dtype=_F)
    if fn == "gelu" and approximate == "tanh":
        return _gelu_tanh(x, opset)
    if fn == "gelu":
        if approximate != "none":
            return None
        if opset >= GELU_OPSET:
            x64 = x.astype(np.float64)
            return (0.5 * x64 * (1 + _erf(x64 / math.sqrt(2)))).astype(_F)
        e = _erf((x / _F(math.sqrt(2))).astype(np.float64)).astype(_F)
        return (x * (e + _F(1))) * _F(0.5)
    if fn == "sigmoid":
        return _sigmoid(x)
    if fn == "silu":
        return x * _sigmoid(x)
    if fn == "tanh":
        return np.tanh(x.astype(np.float64)).astype(_F)
    if fn == "hardsigmoid":
        return _hardsigmoid(x)
    if fn == "hardswish":
        return x * _hardsigmoid(x)
    return None


def gelu_onnx(x: torch.Tensor, opset: int, approximate: str = "none") -> torch.Tensor:
    """A float ``nn.GELU`` as its exported nodes compute it, on float32 ``x`` (the module
    docstring's GELU line, in torch: ``Erf`` by torch's float64 ``erf``, rounded once; the tanh
    form as :func:`_gelu_tanh`, ``Tanh`` by torch's float64 ``tanh``, rounded once)."""
    if approximate == "tanh":
        if opset >= GELU_OPSET:
            x64 = x.double()
            u = math.sqrt(2 / math.pi) * (x64 + 0.044715 * (x64 * x64 * x64))
            return (x64 / (1 + torch.exp(-2 * u))).float()
        beta = torch.tensor(float(_BETA), dtype=torch.float32, device=x.device)
        kappa = torch.tensor(float(_KAPPA), dtype=torch.float32, device=x.device)
        t = torch.tanh((beta * (x + kappa * (x * (x * x)))).double()).float()
        return 0.5 * (x * (1.0 + t))
    if opset >= GELU_OPSET:
        x64 = x.double()
        return (0.5 * x64 * (1 + torch.special.erf(x64 / math.sqrt(2)))).float()
    t = x / torch.tensor(math.sqrt(2), dtype=torch.float32, device=x.device)
    e = torch.special.erf(t.double()).float()
    return (x * (e + 1.0)) * 0.5


class GeluForm(WrapsModule):
    """A float ``nn.GELU`` (either ``approximate``) in its exported form (:func:`gelu_onnx`); an
    FP16 island's (``Fp16GELU``) input and output quantizers round around it, as its Casts do."""

    wrapped = "mod"

    def __init__(self, mod: nn.Module, path: str, opset: int):
        super().__init__()
        self.mod, self.path, self.opset = mod, path, int(opset)

    def forward(self, x):
        if x.dtype != torch.float32:
            return self.mod(x)
        qi, qo = getattr(self.mod, "input_quant", None), getattr(self.mod, "output_quant", None)
        y = gelu_onnx(qi(x) if qi is not None else x, self.opset, self.mod.approximate)
        return qo(y) if qo is not None else y


def lut_form_why_not(qat: nn.Module) -> str:
    """Why ``qat`` has no table form here ("" when it has one)."""
    qi = qat.input_quant
    if qat.fn == "gelu" and qat.approximate not in ("none", "tanh"):
        return f"GELU's approximate={qat.approximate!r} has no table in the integer model"
    if qi is None or not (qi.fmt.is_integer and qi.state in ("quantize", "frozen") and qi.scale.numel() == 1):
        return "input is not per-tensor integer codes"
    if qi.qmax - qi.qmin + 1 > 1 << 16:
        return "input format has more than 2^16 codes"
    return ""


class LutForm(WrapsModule):
    """A ``QLutActivation`` (``qat``) through its table (module docstring)."""

    def __init__(self, qat: nn.Module, path: str, opset: int):
        super().__init__()
        self.qat, self.path = qat, path
        qi = qat.input_quant
        s, zp = qi.effective_qparams()
        self.s, self.zp, self.qmin = s.reshape(()).float(), zp.reshape(()), int(qi.qmin)
        codes = torch.arange(qi.qmin, qi.qmax + 1, dtype=torch.int64)
        grid = dequantize(codes, qi.fmt, self.s, self.zp)
        f = torch.from_numpy(onnx_function(qat.fn, grid.numpy(), qat.approximate, opset))
        qo = qat.output_quant
        self.register_buffer("table", qo(f) if qo is not None else f)

    def forward(self, x):
        q = self.qat
        xq = q.input_quant(x)
        idx = quantize(xq, q.input_quant.fmt, self.s.to(x.device), self.zp.to(x.device)).long() - self.qmin
        y = self.table[idx]
        return q.output_quant(y) if q.output_quant is not None else y
