"""QConv1D: transformers' ``Conv1D`` (GPT-2's attention and MLP projections) as a QAT linear.

``Conv1D`` is a linear layer with its weight stored transposed, ``[in_features, out_features]``:
``y = x @ W + b`` (``torch.addmm``). It is registered lazily (``dal.nn.registry.LAZY_QAT_MODULES``):
this module, which imports transformers, is imported only when prepare meets a ``Conv1D``, so
``import dal`` never imports transformers. Op class ``linear``: recipes and hardware models treat
it as any Linear. Per-channel weight scales run along axis 1 (output features), per-group blocks
along axis 0 (input features): the same quantization as the ``nn.Linear`` with weight ``W.T``.
"""
from __future__ import annotations

import torch
from transformers.pytorch_utils import Conv1D

from .base import QWeightedModule
from .registry import register_qat_module


@register_qat_module(Conv1D, op_class="linear")
class QConv1D(QWeightedModule, Conv1D):
    """``y = fq_out(fq_in(x) @ fq_w(W) + fq_bias(b))`` with ``W`` of shape ``[in, out]``; the
    ``Conv1D``'s own Parameters."""

    weight_channel_axis, weight_reduction_axis = 1, 0

    @property
    def in_features(self) -> int:
        return int(self.weight.shape[0])

    @property
    def out_features(self) -> int:
        return int(self.weight.shape[1])

    def weighted_op(self, x, weight, bias):
        y = x.reshape(-1, x.shape[-1]) @ weight
        if bias is not None:
            y = y + bias
        return y.reshape(*x.shape[:-1], weight.shape[1])
