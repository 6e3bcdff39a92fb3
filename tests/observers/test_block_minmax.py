"""block_minmax per tensor / channel / group against numpy, one slice at a time (non-finite values included)."""
import numpy as np
import pytest
import torch

import dal.formats as F
from dal.observers.base import block_minmax


def _slices(x: np.ndarray, gran):
    """Every scale's elements, as a list in scale order (C order of the scale's shape)."""
    if gran.axis is None:
        return [x.ravel()]
    axis = gran.axis % x.ndim
    moved = np.moveaxis(x, axis, 0)
    if not gran.block_size:
        return [moved[c].ravel() for c in range(moved.shape[0])]
    shape = gran.scale_shape(x.shape)
    out = []
    for idx in np.ndindex(*shape):
        sl = list(idx)
        sl[axis] = slice(idx[axis] * gran.block_size, (idx[axis] + 1) * gran.block_size)
        out.append(x[tuple(sl)].ravel())
    return out


@pytest.mark.parametrize("gran", [F.PER_TENSOR, F.per_channel(0), F.per_channel(1), F.per_channel(-1),
                                  F.per_group(1, 4), F.per_group(2, 3)])
@pytest.mark.parametrize("nonfinite", [False, True])
def test_block_minmax_against_numpy_per_slice(gran, nonfinite):
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(5, 8, 6, generator=gen) * torch.arange(1, 7).float()
    if nonfinite:
        flat = x.view(-1)
        flat[[0, 7, 50, 51, 100]] = torch.tensor([float("nan"), float("inf"), -float("inf"), float("nan"), float("inf")])
    x = x.transpose(0, 2) if gran.axis == -1 else x  # a non-contiguous input too
    lo, hi, bad = block_minmax(x, gran)
    xn = x.numpy()
    shape = gran.scale_shape(x.shape)
    ref_lo, ref_hi = [], []
    for s in _slices(xn, gran):
        fin = s[np.isfinite(s)]
        ref_lo.append(fin.min() if fin.size else np.inf)
        ref_hi.append(fin.max() if fin.size else -np.inf)
    assert lo.shape == shape and hi.shape == shape
    assert np.array_equal(lo.numpy().ravel(), np.array(ref_lo, dtype=np.float32))
    assert np.array_equal(hi.numpy().ravel(), np.array(ref_hi, dtype=np.float32))
    assert bad == (5 if nonfinite else 0)
