"""The K blocks of the amx_int8 GEMM (csrc/qconv_amx.h gemm: the reduction of a 32-pixel group
runs in blocks of at most 9 k steps of 64 bytes, the 2 x 2 accumulator tiles stored and loaded
back between blocks). Shapes around the block edges -- K just below, at and above one block,
several blocks with and without a K tail, groups of 1, 15, 16, 17, 33, 65 pixels, odd panel
counts -- must give numpy's int64 sums as the int32 accumulators and the same codes on every
variant this CPU runs (the portable one included), for 1 and 2 threads. The convolutions that
need two to four K blocks, and weights too large for L2 (every group inside each pair), are in
test_partition.py's CONVS (the same check at 1 to 4 threads, with and without acc_out)."""
from __future__ import annotations

import numpy as np
import pytest

# m, k (reduction bytes), n; nk = ceil(k / 64) k steps, blocks of ceil(nk / ceil(nk / 9))
GEMMS = [
    (17, 572, 48),    # nk 9 (8 full + a 60-byte tail): one block, as before blocking
    (33, 576, 33),    # nk 9 exactly, no tail; 3 panels (an odd last panel), 33 = 32 + 1 rows
    (16, 580, 17),    # nk 10: two blocks of 5, the tail in the second; 2 panels, one partial
    (1, 1152, 16),    # nk 18: two blocks of 9, one pixel (a one-tile-row group)
    (15, 1156, 80),   # nk 19: three blocks of 7 (the last 5, with a 4-byte tail), 5 panels
    (65, 2300, 40),   # nk 36 with a 60-byte tail: four blocks; 2 full groups + 1 row, 3 panels
    (64, 2304, 64),   # nk 36 exactly, rows line aligned: the tiles load them in place
]


def _owned(a):
    """A copy in torch's 64-byte aligned memory (rows read in place by the tiles need it)."""
    import torch
    t = torch.empty(a.shape, dtype=torch.uint8)
    t.numpy()[...] = a
    return t


@pytest.mark.parametrize("m,k,n", GEMMS)
def test_qgemm_k_blocks_exact(m, k, n, npu_lib):
    import torch
    import dal.npu as npu
    from qgemm_case import QgemmCase
    rng = np.random.default_rng(m * 7 + k + n)
    x = rng.integers(0, 256, (m, k)).astype(np.uint8)
    x[0, :] = 255  # extreme quads: 255 * -128, nothing may saturate
    w = rng.integers(-128, 128, (n, k))
    w[0, :] = -128
    case = QgemmCase(x, 0 if k % 64 == 0 else 13, w)  # zero point 0: the uint8 rows may be read in place
    for kernel in npu.info()["supported"]:
        for threads in (1, 2):
            acc = torch.empty(m * n, dtype=torch.int32)
            q = case.run(npu_lib, _owned(x), kernel, threads, acc)
            assert np.array_equal(acc.numpy().reshape(m, n), case.exact), (kernel, threads)
            assert np.array_equal(q, case.want), (kernel, threads)
            # without acc_out the one-pass block requantizer reads the accumulators instead
            q2 = case.run(npu_lib, _owned(x), kernel, threads)
            assert np.array_equal(q2, case.want), (kernel, threads, "no acc_out")
