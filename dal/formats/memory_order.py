"""A tensor's dense memory order: the permutation under which a non-contiguous but dense tensor
(a transposed view, a channels-last activation) is a contiguous view of the same memory.

A per-tensor fake quantization is elementwise and its range a min / max over all elements, so
``fq(x) == fq(x.permute(p)).permute(inverse(p))`` element for element, and the result has
``x``'s strides. The fused C++ kernel takes contiguous tensors only; through this permutation it
takes a channels-last conv input or a transposed linear input without a copy (the torch path
would run about thirty small ops on it).
"""
from __future__ import annotations

from typing import Optional

import torch


def dense_order(x: torch.Tensor) -> Optional[tuple[int, ...]]:
    """``p`` with ``x.permute(p).is_contiguous()`` for a non-contiguous ``x`` whose elements fill
    a block of memory exactly once (no overlap, no gaps); None for a contiguous ``x`` and for one
    with gaps or broadcast (stride 0) dimensions.

    >>> dense_order(torch.zeros(2, 3, 4, 5).permute(0, 2, 3, 1))
    (0, 3, 1, 2)
    """
    if x.is_contiguous() or x.dim() < 2:
        return None
    # Outermost first: the larger stride first. torch ignores a size-1 dimension's stride when it
    # decides contiguity, so those go last.
    perm = tuple(sorted(range(x.dim()), key=lambda d: (x.shape[d] == 1, -x.stride(d), d)))
    y = x.permute(perm)
    return perm if y.is_contiguous() else None


def inverse(perm: tuple[int, ...]) -> tuple[int, ...]:
    """The permutation undoing ``perm``: ``x.permute(perm).permute(inverse(perm))`` is ``x``."""
    inv = [0] * len(perm)
    for i, d in enumerate(perm):
        inv[d] = i
    return tuple(inv)
