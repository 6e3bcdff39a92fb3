"""The attention operators of ``npu_attention`` (dal.replace) in the integer model: the two
activation products (``QMatMul``: ``Q @ K^T``, ``P @ V``) and the softmax (``NpuSoftmax``), with
the float semantics of export/SPEC.md §5a / §6a, i.e. what the exported graph computes:

* **MatMul of two activations** (``DQ(a) @ DQ(b)``, both operands quantized activations): a float
  island, never an integer group (the NPU fuses only constant weights), so
  ``y = float32(float64 matmul of the dequantized float32 operands)`` (one rounding), then the
  QMatMul's output quantizer if it has one; in an FP16 region (both operands FP16) the MatMul is
  float16 and rounds once to float16. The QAT module sums in float32.
* **Softmax** ``softmax(x + a_1 + ...)`` (addends added in float32, in order), per mode:
  ``"fp16"``: ``x`` rounded to float16 (Cast round trip), the softmax, the output rounded to
  float16; ``"lut"``: the exported form ``Softmax(DQ(Q(x)) + Clip(x + 1e30, max=0))`` (the mask
  term only with addends), not the training table; ``"float"``: on ``x``. The softmax itself is
  ``e = exp32(x - max(x))``, ``p = e / float32(sum_float64(e))`` (float32 division), where
  ``exp32`` is :func:`exp_f32`.
"""
from __future__ import annotations

import numpy as np
import torch
from torch import nn

from .fp16_region import round_once
from .quant_calls import dispatch_off
from .wrapped import WrapsModule

#: the exported mask term's constant (dal.replace.softmax_lut.MASKED_BELOW, float32 in the file)
MASK_OFFSET = 1e30


def exp_f32(x: torch.Tensor) -> torch.Tensor:
    """``exp`` of a float32 tensor as the NPU reference's Softmax computes it: numpy's float32
    ``np.exp`` on a C-contiguous array (export/SPEC.md §5a). That routine is not correctly
    rounded (on an AVX-512 CPU ~40% of its results differ by an ulp from ``float32(exp(float64
    x))``, and torch's own ``exp`` differs from it as often), so there is no torch kernel that
    reproduces it: the values go through numpy (from the GPU and back when ``x`` is on CUDA)."""
    if torch.compiler.is_compiling():  # a captured graph (compiled.py): the same np.exp as an operator
        return torch.ops.dal_convert.exp_f32(x.detach().to("cpu", torch.float32)).to(x.device)
    a = np.ascontiguousarray(x.detach().to("cpu", torch.float32).numpy())
    return torch.from_numpy(np.exp(a)).to(x.device)


def softmax_f32(x: torch.Tensor, dim: int) -> torch.Tensor:
    """``e / float32(sum_float64(e))`` with ``e = exp_f32(x - max(x))`` along ``dim`` (module doc)."""
    x = x.float()
    e = exp_f32(x - x.amax(dim=dim, keepdim=True))
    s = e.double().sum(dim=dim, keepdim=True).float()
    return e / s


def half_operands(qs: list):
    """The torch dtype (float16 / bfloat16) of an FP16 / BF16 region MatMul, or None: both
    operand quantizers active and of the same plain float format below 32 bits, which is when
    the exporter writes the MatMul itself in that type (dal/export/casts.py)."""
    if len(qs) != 2 or any(q is None or q.state not in ("quantize", "frozen") for q in qs):
        return None
    f0, f1 = qs[0].fmt, qs[1].fmt
    if f0.name != f1.name or f0.kind != "float" or f0.bits >= 32:
        return None
    return f0.torch_dtype()


class MatMulForm(WrapsModule):
    """A ``QMatMul`` (``qat``) of two activations, computed as the NPU's float island: in
    float32, ``float32(float64 matmul)``; in an FP16 / BF16 region (both operands that format),
    ``T(float64 matmul of the T operands)``, one rounding to T (export/SPEC.md §5a, §6), then the
    Cast back to float32 (exact) and the output quantizer (an FP16 one: that Cast, a no-op)."""

    def __init__(self, qat: nn.Module, path: str):
        super().__init__()
        self.qat, self.path = qat, path
        self.half_operands = half_operands(list(qat.input_quants))

    def forward(self, a, b):
        with dispatch_off():  # no op here is one NPUFloatOps replaces (float_ops.py, quant_calls.py)
            return self._forward(a, b)

    def _forward(self, a, b):
        q = self.qat
        qs = list(q.input_quants)  # one per operand, or none (the operand is used as it is)
        a, b = (qs[0](a), qs[1](b)) if len(qs) == 2 else (a, b)
        if self.half_operands is not None:  # operands already on the T grid: the casts are exact
            t = self.half_operands
            y = round_once(torch.matmul(a.to(t).double(), b.to(t).double()), t).float()
        else:
            y = torch.matmul(a.double(), b.double()).float()
        return q.output_quant(y) if q.output_quant is not None else y


class SoftmaxForm(WrapsModule):
    """An ``NpuSoftmax`` (``qat``) as the exported graph computes it (module docstring)."""

    def __init__(self, qat: nn.Module, path: str):
        super().__init__()
        self.qat, self.path = qat, path

    def forward(self, x, *addends):
        # softmax_f32's float64 sum is torch's (NPUFloatOps replaces float32 / float16 sums only)
        with dispatch_off():
            return self._forward(x, *addends)

    def _forward(self, x, *addends):
        q = self.qat
        has_addends = False
        for a in addends:
            if a is not None:
                x = x + a
                has_addends = True
        if q.mode == "lut":
            xq = q.input_quant(x)
            if has_addends:  # exactly 0 above -1e30, below -6e22 for the -inf masks
                off = torch.tensor(MASK_OFFSET, dtype=torch.float32, device=x.device)
                xq = xq + torch.clamp(x + off, max=0.0)
            x = xq
        elif q.input_quant is not None:
            x = q.input_quant(x)
        y = softmax_f32(x, q.dim)
        return q.output_quant(y) if q.output_quant is not None else y
