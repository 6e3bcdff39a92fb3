"""Words that hardware models and recipes share, defined once.

    >>> GRANULARITIES
    ('per_tensor', 'per_channel', 'per_group', 'per_token')
"""
from __future__ import annotations

#: How a scale is shared: one per tensor, one per index of a channel axis, or one per block of
#: ``group_size`` consecutive elements along an axis (ONNX blocked quantization), or, for
#: activations only, one per token (each row of the last axis), computed from every tensor at
#: run time (dynamic scales): a hardware model offers it by listing ``per_token`` in
#: ``activation_rules.granularities``.
GRANULARITIES: tuple[str, ...] = ("per_tensor", "per_channel", "per_group", "per_token")

__all__ = ["GRANULARITIES"]
