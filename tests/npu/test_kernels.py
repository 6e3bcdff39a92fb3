"""The C++ kernels alone: exact against numpy int64, including the operands that make
vpmaddubsw saturate (255 * 127 + 255 * 127 > 32767)."""
from __future__ import annotations

import numpy as np
import pytest


@pytest.mark.parametrize("m,k,n", [(1, 1, 1), (3, 7, 5), (4, 64, 24), (17, 301, 49), (64, 576, 100)])
def test_gemm_exact(m, k, n, npu_lib):
    from dal.npu import kernels
    rng = np.random.default_rng(m * k + n)
    a = rng.integers(-255, 256, (m, k))
    b = rng.integers(-255, 256, (k, n))
    got = kernels.matmul_s16(kernels.to_s16(a, 0), kernels.to_s16(b, 0), 2).numpy()
    assert np.array_equal(got, a @ b)


def test_no_int16_saturation(npu_lib):
    from dal.npu import kernels
    a = np.full((4, 64), 255)  # uint8 255 - zp 0
    b = np.full((64, 24), 127)
    got = kernels.matmul_s16(kernels.to_s16(a, 0), kernels.to_s16(b, 0), 1).numpy()
    assert (got == 255 * 127 * 64).all()


def test_requant_float_matches_formula(npu_lib):
    from dal.npu import kernels
    rng = np.random.default_rng(0)
    acc = rng.integers(-2**24, 2**24, (6, 1001)).astype(np.int32)
    mult = rng.uniform(1e-6, 1e-4, 6)
    ys = np.float32(0.05)
    got = kernels.requant_float(acc, mult, None, ys, 3, -128, 127, 2)
    v = (acc.astype(np.float64) * mult[:, None]).astype(np.float32)
    want = np.clip(np.rint(v / ys) + 3, -128, 127)
    assert np.array_equal(got, want)


def test_kernels_raise_not_crash(npu_lib):
    import torch
    with pytest.raises(RuntimeError):
        npu_lib.gemm_s16(torch.zeros((2, 3), dtype=torch.int16), torch.zeros((1, 16, 2), dtype=torch.int16), 4, 1)
    with pytest.raises(RuntimeError):
        npu_lib.im2col_s16(torch.zeros((1, 4, 4), dtype=torch.int16), 3, 3, 0, 1, 1, 1, 0, 0, 2, 2, True, 1)
    with pytest.raises(RuntimeError):
        npu_lib.dwconv_s16(torch.zeros((2, 4, 4), dtype=torch.int16), torch.zeros((3, 9), dtype=torch.int16),
                           3, 3, 1, 1, 1, 1, 0, 0, 2, 2, 1)
