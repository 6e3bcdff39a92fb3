"""QConv1d, QConv2d, QConvTranspose2d (the QAT modules of dal/ops/weighted.py's conv entries)."""
from __future__ import annotations

import torch.nn.functional as F
from torch import nn

from .base import QWeightedModule


class _QConv(QWeightedModule):
    weight_channel_axis, weight_reduction_axis = 0, 1

    def weighted_op(self, x, weight, bias):
        return self._conv_forward(x, weight, bias)


class QConv1d(_QConv, nn.Conv1d):
    """nn.Conv1d with input / weight (per output channel: axis 0) / output fake quantizers."""


class QConv2d(_QConv, nn.Conv2d):
    """nn.Conv2d with input / weight (per output channel: axis 0) / output fake quantizers."""


class QConvTranspose2d(QWeightedModule, nn.ConvTranspose2d):
    """nn.ConvTranspose2d; its weight is [in, out/groups, kh, kw], so per-channel scales run along
    axis 1 (output channels; exact for groups == 1) and the reduction axis is 0."""

    weight_channel_axis, weight_reduction_axis = 1, 0

    def forward(self, x, output_size=None):
        if self.input_quant is not None:
            x = self.input_quant(x)
        output_padding = self._output_padding(x, output_size, self.stride, self.padding, self.kernel_size,
                                              2, self.dilation)
        y = F.conv_transpose2d(x, self.quantized_weight(self.weight), self.quantized_bias(self.bias), self.stride,
                               self.padding, output_padding, self.groups, self.dilation)
        return self.finish(y)
