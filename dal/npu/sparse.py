"""2:4 structured sparsity: verification and the compressed form the sparse kernel reads.

A weight is 2:4 along its reduction axis when every group of 4 consecutive elements along
that axis has at most 2 non-zeros (after subtracting the zero point). Compressed form, for
rows r (output channels) and groups g of the reduction dimension:

    vals[r, g, 0:2]  int16  the two kept values, in increasing position order
    pos[r, g]        uint8  p0 | p1 << 2   (p0 < p1 in 0..3)

Groups with fewer than two non-zeros keep zeros at unused positions. For a Conv weight
[O, C, kh, kw] the reduction axis is 1 and groups are 4 consecutive input channels at each
(o, i, j); the kernel's reduction index is then (c, i, j), so the weight is permuted to
[O, kh*kw... ] internally -- see compress_conv.
"""
from __future__ import annotations

import numpy as np

from .errors import NPUError


def check_24(w: np.ndarray, axis: int, name: str) -> None:
    """Raise NPUError naming ``name`` unless w (codes minus zero point) is 2:4 along ``axis``."""
    w = np.asarray(w)
    axis = axis % w.ndim if w.ndim else 0
    if w.ndim == 0 or w.shape[axis] % 4:
        raise NPUError(f"sparse initializer {name!r}: reduction axis {axis} of shape "
                       f"{w.shape} is not a multiple of 4")
    g = np.moveaxis(w, axis, -1)
    g = g.reshape(g.shape[:-1] + (g.shape[-1] // 4, 4))
    nnz = (g != 0).sum(-1)
    bad = int((nnz > 2).sum())
    if bad:
        raise NPUError(f"sparse initializer {name!r} is listed in dal.sparse_24 but is not 2:4 "
                       f"along axis {axis}: {bad} groups of 4 have more than 2 non-zeros")


def compress_rows(w2: np.ndarray):
    """w2 [R, K] int (K % 4 == 0, already 2:4) -> (vals int16 [R, K/4, 2], pos uint8 [R, K/4])."""
    r, k = w2.shape
    g = w2.reshape(r, k // 4, 4)
    nz = g != 0
    # stable order: non-zeros first by position, then zeros by position; keep the first two
    key = np.where(nz, 0, 4) + np.arange(4)
    order = np.sort(np.argsort(key, axis=-1, kind="stable")[..., :2], axis=-1)
    vals = np.take_along_axis(g, order, axis=-1).astype(np.int16)
    pos = (order[..., 0] | (order[..., 1] << 2)).astype(np.uint8)
    return vals, pos


def compress_conv(w16, name_or_axis):
    """Torch int16 conv weight [O, C, kh, kw] -> torch (vals, pos) in im2col row order (c, i, j).

    The im2col reduction index is k = (c * kh + i) * kw + j. Groups of 4 along c at fixed (i, j)
    are not consecutive in k unless kh = kw = 1, so for kh*kw > 1 the im2col rows of a group are
    c..c+3 at stride kh*kw; the kernel wants consecutive rows. We therefore compress along the
    permuted order k' = (i * kw + j) * C + c and the caller feeds rows in that order
    (``perm``). For 1x1 kernels the two orders coincide.
    """
    import torch

    w = w16.numpy()
    o, c, kh, kw = w.shape
    w2 = np.ascontiguousarray(w.transpose(0, 2, 3, 1).reshape(o, kh * kw * c))
    vals, pos = compress_rows(w2)
    return torch.from_numpy(vals), torch.from_numpy(pos)


def im2col_row_perm(c: int, kh: int, kw: int) -> np.ndarray:
    """Row permutation from im2col order (c, i, j) to the sparse order (i, j, c)."""
    idx = np.arange(c * kh * kw).reshape(c, kh, kw)
    return idx.transpose(1, 2, 0).reshape(-1)
