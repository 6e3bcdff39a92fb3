"""Words that hardware models and recipes share, defined once.

    >>> GRANULARITIES
    ('per_tensor', 'per_channel', 'per_group')
"""
from __future__ import annotations

#: How a scale is shared: one per tensor, one per index of a channel axis, or one per block of
#: ``group_size`` consecutive elements along an axis (ONNX blocked quantization).
GRANULARITIES: tuple[str, ...] = ("per_tensor", "per_channel", "per_group")

__all__ = ["GRANULARITIES"]
