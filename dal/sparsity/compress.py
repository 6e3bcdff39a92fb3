"""Check and (de)compress N:M sparse tensors; pure functions for tests and the exporter.

Compressed 2:4 layout (along ``axis``, which must have a length divisible by 4):

- ``values``: the tensor with ``axis`` halved; group ``g`` of the dense axis (elements
  ``4g .. 4g+3``) becomes elements ``2g, 2g+1`` of ``values``, its two kept entries in
  ascending position order.
- ``indices``: uint8, same shape as ``values``; ``indices[..., 2g+k, ...]`` in ``0..3`` is the
  position inside group ``g`` of ``values[..., 2g+k, ...]``; strictly increasing within a
  group. These are the 2-bit metadata a sparse matrix engine reads; packing four of them per
  byte is the writer's business.

A group with fewer than two non-zeros is padded with explicit zeros at its lowest free
positions, so the layout is dense and fixed-size. ``decompress_2to4(*compress_2to4(w, a), a)``
equals ``w`` exactly for every 2:4 tensor.
"""
from __future__ import annotations

import torch
from torch import Tensor

from .layout import from_groups, to_groups
from .mask import nm_mask

__all__ = ["is_nm", "is_2to4", "compress_2to4", "decompress_2to4"]


def is_nm(tensor: Tensor, n: int, m: int, axis: int) -> bool:
    """True when every group of ``m`` consecutive elements along ``axis`` has at most ``n``
    non-zeros. False (not an error) when the axis length is not a multiple of ``m``.

    >>> is_nm(torch.tensor([[1., 0, 0, 2, 0, 0, 3, 0]]), 2, 4, axis=1)
    True
    """
    if tensor.dim() == 0 or tensor.shape[axis] % m:
        return False
    return bool(((to_groups(tensor, axis, m) != 0).sum(dim=1) <= n).all())


def is_2to4(tensor: Tensor, axis: int) -> bool:
    """``is_nm(tensor, 2, 4, axis)``: at most 2 non-zeros in every group of 4 along ``axis``.
    For module weights pass ``dal.sparsity.reduction_axis(module)`` (1 for Linear and Conv,
    0 for ConvTranspose)."""
    return is_nm(tensor, 2, 4, axis)


def compress_2to4(w: Tensor, axis: int) -> "tuple[Tensor, Tensor]":
    """Split a 2:4 tensor into ``(values, indices)`` (layout in the module docstring).

    Raises ``ValueError`` when some group has more than two non-zeros.

    >>> v, i = compress_2to4(torch.tensor([[0., 5., 0., 7.]]), axis=1)
    >>> v.tolist(), i.tolist()
    ([[5.0, 7.0]], [[1, 3]])
    """
    g = to_groups(w.detach(), axis, 4)
    nz = g != 0
    bad = int((nz.sum(dim=1) > 2).sum())
    if bad:
        raise ValueError(f"tensor of shape {tuple(w.shape)} is not 2:4 along axis {axis}: "
                         f"{bad} of {g.shape[0]} groups have more than 2 non-zeros")
    # non-zeros rank first; zero padding takes the lowest free positions (ties -> low index)
    keep = nm_mask(nz.to(torch.float32), 2, 4, axis=-1)
    pos = torch.arange(4, dtype=torch.uint8, device=w.device).expand_as(g)
    values = g[keep].view(-1, 2)          # boolean indexing is row-major: ascending positions
    indices = pos[keep].view(-1, 2)
    shape = list(w.shape)
    shape[axis] //= 2
    return from_groups(values, shape, axis), from_groups(indices, shape, axis)


def decompress_2to4(values: Tensor, indices: Tensor, axis: int) -> Tensor:
    """Inverse of :func:`compress_2to4`: the dense tensor, ``axis`` doubled.

    Raises ``ValueError`` when ``indices`` are outside ``0..3`` or not strictly increasing
    within a group.
    """
    if values.shape != indices.shape:
        raise ValueError(f"values {tuple(values.shape)} and indices {tuple(indices.shape)} "
                         "must have the same shape")
    vg = to_groups(values, axis, 2)
    ig = to_groups(indices, axis, 2).long()
    if bool((ig < 0).any() or (ig > 3).any() or (ig[:, 0] >= ig[:, 1]).any()):
        raise ValueError("indices must lie in 0..3 and increase strictly within each pair")
    dense = torch.zeros(vg.shape[0], 4, dtype=values.dtype, device=values.device)
    dense.scatter_(1, ig, vg)
    shape = list(values.shape)
    shape[axis] *= 2
    return from_groups(dense, shape, axis)
