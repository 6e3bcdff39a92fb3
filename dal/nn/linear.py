"""QLinear and QEmbedding (the QAT modules of dal/ops/weighted.py's linear and embedding entries)."""
from __future__ import annotations

import torch.nn.functional as F
from torch import nn

from .base import QATModule, QWeightedModule


class QLinear(QWeightedModule, nn.Linear):
    """nn.Linear with input / weight / output fake quantizers: ``y = fq_out(act(fq_in(x) @ fq_w(W)^T + b))``.

    Weight per-channel scales run along axis 0 (output features); groups along axis 1.
    """

    weight_channel_axis, weight_reduction_axis = 0, 1

    def weighted_op(self, x, weight, bias):
        return F.linear(x, weight, bias)


class QEmbedding(QATModule, nn.Embedding):
    """nn.Embedding whose table is fake-quantized (per row: axis 0); inputs are indices."""

    weight_channel_axis, weight_reduction_axis = 0, 1

    @classmethod
    def from_float(cls, mod: nn.Embedding, spec=None, name: str = "", activation=None) -> "QEmbedding":
        q = super().from_float(mod, spec, name, activation)
        q.input_quant = None  # indices are not quantized
        return q

    def forward(self, idx):
        if idx.is_floating_point():  # F.embedding's own message names no layer
            raise ValueError(f"{self.qat_name or 'QEmbedding'}: indices must be an integer tensor, got {idx.dtype}")
        w = self.quantized_weight(self.weight)
        y = F.embedding(idx, w, self.padding_idx, self.max_norm, self.norm_type, self.scale_grad_by_freq, self.sparse)
        return self.finish(y)

    def extra_repr(self):
        return f"{super().extra_repr()}, {self.qat_extra_repr()}"
