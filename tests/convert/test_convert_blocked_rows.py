"""dal.convert's blocked linear on a few rows (a decode step): float32 block sums combined in float64
(dal/convert/blocked_linear.py ``BlockedWeights.value``, fewer than ``BLOCK_ROWS`` rows) give the
same ``v`` as the SPEC formula, on edge codes, one row and ``BLOCK_ROWS - 1`` rows; where those sums
would not be exact (block bound above 2^24, scales too spread for any order, oneDNN's float32 matmul
in bf16) the other paths run, equal to the formula too.

Oracle: tests/blocked_oracle.py (export/SPEC.md §5a in Python integers and floats, ascending order).
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

import blocked_oracle
from dal.convert.blocked_linear import BLOCK_ROWS, F32_EXACT, BlockedWeights


def _case(rng, k: int, n: int, block: int, rows: int, edge: bool):
    codes = rng.integers(-8, 8, (n, k))
    zp = rng.integers(-8, 8, (n, k // block))
    scale = rng.uniform(0.002, 0.05, (n, k // block)).astype(np.float32)
    xq = rng.integers(-128, 128, (rows, k))
    if edge:  # the largest block sums: codes at their extremes against the zero point, inputs at -128 / 127
        codes[:, ::2], codes[:, 1::2] = -8, 7
        zp[:, :] = 7
        xq[0, ::2], xq[0, 1::2] = -128, 127
        xq[-1, :] = -128
    return codes, zp, scale, xq


@pytest.mark.parametrize("rows", [1, BLOCK_ROWS - 1])
@pytest.mark.parametrize("edge", [False, True])
def test_few_rows_equal_the_spec_formula(rows, edge):
    rng = np.random.default_rng(rows * 10 + edge)
    k, n, block, zx = 128, 24, 32, 3
    codes, zp, scale, xq = _case(rng, k, n, block, rows, edge)
    bw = BlockedWeights(torch.tensor(codes, dtype=torch.float32), torch.tensor(zp, dtype=torch.int32),
                        torch.tensor(scale), block, 128)
    assert bw.w32 is not None and bw.bound <= F32_EXACT  # the float32 block path runs
    sx = float(np.float32(0.0173))
    got = bw.value(torch.tensor(xq - zx, dtype=torch.float32)[None], sx)[0].numpy()
    want = blocked_oracle.block_values(xq, zx, codes.T, zp.T, scale.T, block, sx)
    np.testing.assert_array_equal(got, want)
    # the float64 path of BLOCK_ROWS rows and more: the same numbers row for row
    many = np.concatenate([xq] * (-(-BLOCK_ROWS // rows)))
    got_many = bw.value(torch.tensor(many - zx, dtype=torch.float32), sx).numpy()
    np.testing.assert_array_equal(got_many[:rows], want)


def test_not_exact_in_float32_takes_the_other_paths():
    """Scales 2^-30 apart (no order-free float64 sum: ascending blocks), a block of 2^14 channels
    (block sums up to 2^14 * 128 * 15 > 2^24: the one float64 matmul) and oneDNN in bf16: no float32 blocks."""
    rng = np.random.default_rng(5)
    codes, zp, scale, xq = _case(rng, 96, 7, 32, 1, True)
    spread = scale.copy()
    spread[:, 1] *= np.float32(2.0 ** -30)
    bw = BlockedWeights(torch.tensor(codes, dtype=torch.float32), torch.tensor(zp, dtype=torch.int32),
                        torch.tensor(spread), 32, 128)
    assert bw.w32 is None and bw.w_exact is None
    np.testing.assert_array_equal(bw.value(torch.tensor(xq + 2, dtype=torch.float32), 0.5).numpy(),
                                  blocked_oracle.block_values(xq, -2, codes.T, zp.T, spread.T, 32, 0.5))

    big = 2 ** 14
    codes_b, zp_b, scale_b, xq_b = _case(rng, big, 3, big, 1, True)
    bw = BlockedWeights(torch.tensor(codes_b, dtype=torch.float32), torch.tensor(zp_b, dtype=torch.int32),
                        torch.tensor(scale_b), big, 128)
    assert bw.bound > F32_EXACT and bw.w32 is None and bw.w_exact is not None
    np.testing.assert_array_equal(bw.value(torch.tensor(xq_b, dtype=torch.float32), 0.25).numpy(),
                                  blocked_oracle.block_values(xq_b, 0, codes_b.T, zp_b.T, scale_b.T, big, 0.25))

    bw = BlockedWeights(torch.tensor(codes, dtype=torch.float32), torch.tensor(zp, dtype=torch.int32),
                        torch.tensor(scale), 32, 128)
    assert bw.w32 is not None
    seen = []
    real = torch.bmm
    old = torch.backends.mkldnn.matmul.fp32_precision
    try:
        torch.backends.mkldnn.matmul.fp32_precision = "bf16"
        torch.bmm = lambda *a, **kw: seen.append(a[0].dtype) or real(*a, **kw)
        got = bw.value(torch.tensor(xq, dtype=torch.float32), 0.5).numpy()
    finally:
        torch.bmm = real
        torch.backends.mkldnn.matmul.fp32_precision = old
    assert torch.float32 not in seen  # the float64 matmul, not the float32 blocks
    np.testing.assert_array_equal(got, blocked_oracle.block_values(xq, 0, codes.T, zp.T, scale.T, 32, 0.5))
