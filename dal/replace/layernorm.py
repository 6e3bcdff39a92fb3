"""Rule ``layernorm_fp16``: nn.LayerNorm computed in FP16, as an FP16 vector engine runs it.

:class:`Fp16LayerNorm` rounds its input, weight, bias and output to FP16 with
``FakeQuantizer("fp16")`` (identities until calibration, so the freshly replaced model equals
the original), normalizes in between, and carries the QAT-module protocol (``qat_name``,
``quantizers()``, ``to_float()``), so prepare keeps it and the exporter writes it as
``Cast(float16) -> Cast(float) -> LayerNormalization (or its decomposition) -> Cast -> Cast``
with FP16-valued weights.
"""
from __future__ import annotations

import torch.nn.functional as F
from torch import nn

from ..nn.base import QATModule
from ..quantizer import FakeQuantizer
from .registry import rule


class Fp16LayerNorm(QATModule):
    """``q_out(layer_norm(q_in(x), q_w(weight), q_b(bias)))`` with FP16 cast round trips;
    shares the original LayerNorm's Parameters."""

    op_class = "layernorm"

    def __init__(self, ln: nn.LayerNorm, name: str = ""):
        super().__init__()
        self.normalized_shape, self.eps = tuple(ln.normalized_shape), ln.eps
        self.elementwise_affine = ln.elementwise_affine
        self.weight, self.bias = ln.weight, ln.bias  # the same Parameter objects (or None)
        self.qat_name = name
        self.input_quant = FakeQuantizer("fp16", name=f"{name}.input_quant")
        self.weight_quant = FakeQuantizer("fp16", name=f"{name}.weight_quant") if ln.weight is not None else None
        self.bias_quant = FakeQuantizer("fp16", name=f"{name}.bias_quant") if ln.bias is not None else None
        self.output_quant = FakeQuantizer("fp16", name=f"{name}.output_quant")
        self.train(ln.training)

    def quantizers(self) -> dict:
        return {k: q for k in ("input_quant", "weight_quant", "bias_quant", "output_quant")
                if (q := getattr(self, k)) is not None}

    def to_float(self) -> nn.LayerNorm:
        ln = nn.LayerNorm(self.normalized_shape, self.eps, elementwise_affine=self.elementwise_affine,
                          bias=self.bias is not None)
        if self.weight is not None:
            ln.weight = self.weight
        if self.bias is not None:
            ln.bias = self.bias
        ln.train(self.training)
        return ln

    def forward(self, x):
        w = self.weight_quant(self.weight) if self.weight is not None else None
        b = self.bias_quant(self.bias) if self.bias is not None else None
        y = F.layer_norm(self.input_quant(x), self.normalized_shape, w, b, self.eps)
        return self.output_quant(y)

    def extra_repr(self) -> str:
        return f"{self.normalized_shape}, eps={self.eps}, fp16"


@rule("layernorm_fp16")
class LayerNormFp16Rule:
    """nn.LayerNorm -> Fp16LayerNorm, where the hardware runs layernorm in FP16."""

    def match(self, module, name, hardware=None) -> bool:
        return type(module) is nn.LayerNorm and (hardware is None or hardware.runs_in_fp16("layernorm"))

    def build(self, module, hardware):
        return Fp16LayerNorm(module)

    def describe(self, module, name) -> str:
        return "input, weight, bias and output rounded to fp16"

    def why_nothing(self, hardware):
        if hardware is not None and not hardware.runs_in_fp16("layernorm"):
            return f"hardware {hardware.name} does not run layernorm in fp16 (fp16_ops: {list(hardware.fp16_ops)})"
        return "no nn.LayerNorm module"
