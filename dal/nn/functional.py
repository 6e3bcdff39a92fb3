"""Quantized functional ops (``+``, ``*``, ``torch.cat``, ``@``): each input gets a quantizer.

``prepare_qat`` rewrites these calls (found with torch.fx) into these modules, so that the
integer hardware's requantizing adders, concatenations and matmuls are trained against.
"""
from __future__ import annotations

import torch
from torch import nn

from .base import QATModule
from .spec import make_quantizer, role_specs


class _QFunctional(QATModule):
    op_class = "custom"
    swappable = False
    arity = 2

    def __init__(self, spec=None, name: str = ""):
        super().__init__()
        self.qat_name = name
        in_spec, _, out_spec = role_specs(spec)
        self.input_quants = nn.ModuleList(
            [q for i in range(self.arity) if (q := make_quantizer(in_spec, None, f"{name}.input_quants.{i}"))])
        self.output_quant = make_quantizer(out_spec, None, f"{name}.output_quant")

    @classmethod
    def from_spec(cls, spec=None, name: str = ""):
        return cls(spec, name)

    def _q(self, i: int, t: torch.Tensor) -> torch.Tensor:
        if i >= len(self.input_quants):
            return t
        # A permuted view (a detection head's per-level outputs, a channels-last residual) goes to
        # the quantizer as it is: its fused kernel takes dense views (dal.formats.memory_order), and
        # the tensor stays the one the layer before produced, which dal.convert's fan-out groups
        # read by identity (a copy here would hide the reader from the group).
        return self.input_quants[i](t)

    def _out(self, y):
        return self.output_quant(y) if self.output_quant is not None else y

    def quantizers(self) -> dict:
        found = {f"input_quants.{i}": q for i, q in enumerate(self.input_quants)}
        if self.output_quant is not None:
            found["output_quant"] = self.output_quant
        return found


class QAdd(_QFunctional):
    """``fq_out(fq_0(a) + fq_1(b))``."""

    op_class = "add"

    def forward(self, a, b):
        return self._out(self._q(0, a) + self._q(1, b))


class QMul(_QFunctional):
    """``fq_out(fq_0(a) * fq_1(b))``."""

    op_class = "mul"

    def forward(self, a, b):
        return self._out(self._q(0, a) * self._q(1, b))


class QMatMul(_QFunctional):
    """``fq_out(fq_0(a) @ fq_1(b))`` (torch.matmul semantics, batched)."""

    op_class = "matmul"

    def forward(self, a, b):
        return self._out(torch.matmul(self._q(0, a), self._q(1, b)))


class QCat(_QFunctional):
    """``fq_out(torch.cat([fq_i(t_i)], dim))``; one quantizer per input, up to ``arity`` inputs."""

    op_class = "cat"

    def __init__(self, spec=None, name: str = "", arity: int = 2, dim: int = 0):
        self.arity = arity
        super().__init__(spec, name)
        self.dim = dim

    def forward(self, *tensors):
        return self._out(torch.cat([self._q(i, t) for i, t in enumerate(tensors)], dim=self.dim))

    def extra_repr(self):
        return f"dim={self.dim}, inputs={self.arity}"
