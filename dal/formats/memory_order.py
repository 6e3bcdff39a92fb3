"""A tensor's dense memory order: the permutation under which a non-contiguous but dense tensor
(a transposed view, a channels-last activation) is a contiguous view of the same memory.

A per-tensor fake quantization is elementwise and its range a min / max over all elements, so
``fq(x) == fq(x.permute(p)).permute(inverse(p))`` element for element, and the result has
``x``'s strides. The fused C++ kernel takes contiguous tensors only; through this permutation it
takes a channels-last conv input or a transposed linear input without a copy (the torch path
would run about thirty small ops on it).

A tensor that is not dense (a broadcast ``expand``, a slice with gaps) has no such view: the kernel
runs on a dense copy laid out as torch lays out the result of an elementwise op on it
(:func:`elementwise_order`), so the result has the torch path's strides.
"""
from __future__ import annotations

import functools
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


@functools.lru_cache(maxsize=256)  # a few (shape, strides) per model: per call a lookup
def elementwise_order(shape: tuple[int, ...], stride: tuple[int, ...]) -> Optional[tuple[int, ...]]:
    """``p`` with ``(x / s).permute(p).is_contiguous()`` for any ``x`` of this shape and these strides
    and a broadcast scalar ``s``: the order in which torch's elementwise ops (TensorIterator) lay out
    their result, read from torch itself on meta tensors (no data). The identity where the result is
    contiguous, as it is for every contiguous ``x``; None if that result were not dense (torch's
    results are).

    >>> elementwise_order((3, 4), (0, 1)), elementwise_order((4, 3), (1, 8))
    ((0, 1), (1, 0))
    """
    out = torch.empty_strided(shape, stride, device="meta") / torch.empty((), device="meta")
    return tuple(range(len(shape))) if out.is_contiguous() else dense_order(out)
