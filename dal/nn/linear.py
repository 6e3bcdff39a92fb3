"""QLinear and QEmbedding."""
from __future__ import annotations

import torch.nn.functional as F
from torch import nn

from .adopt import adopt, release
from .base import QATMixin
from .registry import register_qat_module


@register_qat_module(nn.Linear, op_class="linear")
class QLinear(QATMixin, nn.Linear):
    """nn.Linear with input / weight / output fake quantizers: ``y = fq_out(act(fq_in(x) @ fq_w(W)^T + b))``.

    Weight per-channel scales run along axis 0 (output features); groups along axis 1.
    """

    weight_channel_axis, weight_reduction_axis = 0, 1

    @classmethod
    def from_float(cls, mod: nn.Linear, spec=None, name: str = "", activation=None) -> "QLinear":
        q = adopt(cls, mod)
        q._init_qat(spec, name, activation)
        return q

    def to_float(self) -> nn.Module:
        return release(self)

    def forward(self, x):
        if self.input_quant is not None:
            x = self.input_quant(x)
        y = F.linear(x, self.quantized_weight(self.weight), self.quantized_bias(self.bias))
        return self.finish(y)

    def extra_repr(self):
        return f"{super().extra_repr()}, {self.qat_extra_repr()}"


@register_qat_module(nn.Embedding, op_class="embedding")
class QEmbedding(QATMixin, nn.Embedding):
    """nn.Embedding whose table is fake-quantized (per row: axis 0); inputs are indices."""

    weight_channel_axis, weight_reduction_axis = 0, 1

    @classmethod
    def from_float(cls, mod: nn.Embedding, spec=None, name: str = "", activation=None) -> "QEmbedding":
        q = adopt(cls, mod)
        q._init_qat(spec, name, activation)
        q.input_quant = None  # indices are not quantized
        return q

    def to_float(self) -> nn.Module:
        return release(self)

    def forward(self, idx):
        w = self.quantized_weight(self.weight)
        y = F.embedding(idx, w, self.padding_idx, self.max_norm, self.norm_type, self.scale_grad_by_freq, self.sparse)
        return self.finish(y)
