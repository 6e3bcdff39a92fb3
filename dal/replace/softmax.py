"""The attention softmax as the vector engine runs it: additive biases and masks, then softmax,
with its input and output rounded to FP16.

The rounding is done by two ``FakeQuantizer("fp16")`` (cast round trips): they are identities
until calibration (state ``observe``) and when switched ``off``, so a freshly replaced model
equals the original, and prepare/calibrate/export treat them like every other quantizer (the
exporter writes ``Cast(float16) -> Cast(float)``). The module carries ``qat_name`` and
``quantizers()`` (the QAT-module protocol), so prepare does not rewrite the additions in its
forward into integer ``QAdd``s: on the NPU they are part of the FP16 softmax.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from ..quantizer import FakeQuantizer


class NpuSoftmax(nn.Module):
    """``out_q(softmax(in_q(x + a_1 + a_2 + ...), dim))``; ``None`` addends are skipped.

    Args:
        dim: softmax axis.
        fp16: round input and output to FP16 (the hardware runs softmax in FP16); False keeps
            float32 (hardware whose softmax is integer: the quantized inputs of the following
            matmul model its output).
        name: module path (quantizer names in errors and exports).
    """

    def __init__(self, dim: int = -1, fp16: bool = True, name: str = ""):
        super().__init__()
        self.dim = dim
        self.qat_name = name
        self.input_quant: Optional[FakeQuantizer] = FakeQuantizer("fp16", name=f"{name}.input_quant") if fp16 else None
        self.output_quant: Optional[FakeQuantizer] = FakeQuantizer("fp16", name=f"{name}.output_quant") if fp16 else None

    def quantizers(self) -> dict:
        return {k: q for k in ("input_quant", "output_quant") if (q := getattr(self, k)) is not None}

    def forward(self, x: torch.Tensor, *addends) -> torch.Tensor:
        for a in addends:
            if a is not None:
                x = x + a
        if self.input_quant is not None:
            x = self.input_quant(x)
        y = F.softmax(x, dim=self.dim)
        return self.output_quant(y) if self.output_quant is not None else y

    def extra_repr(self) -> str:
        return f"dim={self.dim}, fp16={self.input_quant is not None}"


def softmax_in_fp16(hardware) -> bool:
    """Does ``hardware`` run softmax in FP16? (No hardware model: assume an FP16 vector engine.)"""
    if hardware is None:
        return True
    return bool(hardware.runs_in_fp16("softmax"))
