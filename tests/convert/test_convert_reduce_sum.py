"""Float ReduceSum and ceil-mode average pooling (timm's ResNeSt: its split attention sums the
radix branches, ``x.sum(dim=1)``, and its ``avg_down`` shortcut pools with
``AvgPool2d(2, 2, ceil_mode=True, count_include_pad=False)``) in dal.convert, by export/SPEC.md
§5a: each sum in float64 rounded once to float32 (pooling: the window's sum divided by its
count, then rounded once). Judged by exact rational oracles written here and, on a small model with both,
by dal.npu on every element.

Before, dal.convert ran torch's float32 ``sum`` (every partial sum rounded) and its float32
ceil-mode ``avg_pool2d``; dal.npu refused ReduceSum and ceil-mode AveragePool.
"""
from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest
import torch
from oracles import nearest_float
import torch.nn.functional as F
from torch import nn

from convert_common import assert_bit_exact, build, random_batches
from dal.convert.float_ops import NPUFloatOps

torch.set_num_threads(1)


def _wide(shape, seed=0):
    """Mixed signs over 12 binades: float32 partial sums round, and cancel."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g) * torch.exp2(torch.randint(-6, 6, shape, generator=g).float())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_sum_is_the_exact_sum_rounded_once(dtype):
    x = _wide((3, 64, 5)).to(dtype)
    with NPUFloatOps():
        got = [x.sum(dim=1), torch.sum(x, (1,)), x.sum(1, keepdim=True).squeeze(1)]
    npd = np.float32 if dtype == torch.float32 else np.float16
    xs = x.numpy()
    want = np.array([[nearest_float(sum(Fraction(float(v)) for v in xs[i, :, j]), npd) for j in range(5)] for i in range(3)])
    for g in got:
        assert g.dtype == dtype and np.array_equal(g.numpy(), want)
    with NPUFloatOps():
        total = x.sum()
    assert total.item() == float(nearest_float(sum(Fraction(float(v)) for v in xs.reshape(-1)), npd))


def _pool_oracle(x: np.ndarray, k, s, p, include_pad: bool) -> np.ndarray:
    """ONNX AveragePool, ceil_mode=1, symmetric pads ``p``, from the spec: output size
    ``ceil((n + 2p - k) / s) + 1`` less a last window starting in the end padding; each window's
    exact sum divided by its count (input elements, or with ``include_pad`` its elements inside
    the padded input), rounded once to float32."""
    n, m = x.shape[2:]
    sizes = []
    for d, kk, ss, pp in ((n, k[0], s[0], p[0]), (m, k[1], s[1], p[1])):
        o = -(-(d + 2 * pp - kk) // ss) + 1
        sizes.append(o - 1 if (o - 1) * ss >= d + pp else o)
    out = np.empty(x.shape[:2] + tuple(sizes), np.float32)
    for i in range(sizes[0]):
        r0 = i * s[0] - p[0]
        rows = range(max(r0, 0), min(r0 + k[0], n))
        nr = min(r0 + k[0], n + p[0]) - r0 if include_pad else len(rows)
        for j in range(sizes[1]):
            c0 = j * s[1] - p[1]
            cols = range(max(c0, 0), min(c0 + k[1], m))
            nc = min(c0 + k[1], m + p[1]) - c0 if include_pad else len(cols)
            for b in range(x.shape[0]):
                for c in range(x.shape[1]):
                    exact = sum(Fraction(float(x[b, c, r, q])) for r in rows for q in cols)
                    out[b, c, i, j] = nearest_float(exact / (nr * nc), np.float32)
    return out


POOLS = [((8, 7), (2, 2), (2, 2), (0, 0), False),  # ResNeSt's avg_down, an odd width
         ((8, 7), (3, 3), (2, 2), (1, 1), True),   # last row window past the padding, pads counted
         ((8, 7), (3, 3), (2, 2), (1, 1), False),
         ((6, 6), (4, 4), (3, 3), (1, 1), True)]


@pytest.mark.parametrize("hw,k,s,p,include_pad", POOLS, ids=[f"pool{i}" for i in range(len(POOLS))])
def test_ceil_mode_avg_pool_is_the_exact_window_sum_rounded_once(hw, k, s, p, include_pad):
    x = _wide((2, 3) + hw, seed=1)
    with NPUFloatOps():
        got = F.avg_pool2d(x, k, s, p, ceil_mode=True, count_include_pad=include_pad)
    want = _pool_oracle(x.numpy(), k, s, p, include_pad)
    assert got.shape == want.shape and np.array_equal(got.numpy(), want)


class SplitSum(nn.Module):
    """A ResNeSt-like tail: conv, its 16 channels summed in 4 radix groups of 4, then two
    ceil-mode pools in a row (avg_down's, 8x7 -> 4x4; then one whose last windows run past the
    padding, 4x4 -> 3x3)."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 16, 3, padding=1)
        self.relu = nn.ReLU()
        self.down = nn.AvgPool2d(2, 2, ceil_mode=True, count_include_pad=False)
        self.pool = nn.AvgPool2d(3, 2, padding=1, ceil_mode=True, count_include_pad=True)
        self.head = nn.Conv2d(4, 4, 1)

    def forward(self, x):
        y = self.relu(self.conv(x))
        y = y.reshape(y.shape[0], 4, 4, y.shape[2], y.shape[3]).sum(dim=1)
        return self.head(self.pool(self.down(y)))


def test_split_sum_and_ceil_pools_bit_exact_with_the_npu():
    torch.manual_seed(0)
    qat, proto, sess = build(SplitSum(), torch.randn(2, 3, 8, 7), "a2000")
    ops = [n.op_type for n in proto.graph.node]
    assert "ReduceSum" in ops and ops.count("AveragePool") == 2
    import dal
    assert_bit_exact(dal.convert(qat), proto, sess, random_batches((3, 3, 8, 7), n=3, scale=2.0), "split sum")
