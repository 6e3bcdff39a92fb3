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


QGEMMS = [  # m, k, n, activation codes: every tile edge of the micro kernels
    (1, 4, 1, "u8"),       # one pixel, one channel, one k quad (AMX: only the zero-padded tail)
    (33, 60, 17, "s8"),    # 33 pixels = 32 + 1 edge row, 2 panels (the second partial), K < 64
    (47, 1000, 50, "u8"),  # 15 full 64-byte AMX steps + a 40-byte tail, 4 panels, 47 = 32 + 15 rows
    (200, 576, 96, "s8"),  # several pixel blocks, 6 panels, K a multiple of 64 (no tail)
    (64, 132, 33, "u8"),   # 3 panels (odd: a single last panel), K tail of one quad
    (96, 256, 40, "u8"),   # uint8 rows a strided matrix (96 = 6 x 16, K = 4 x 64): AMX tiles load them in place
]


@pytest.mark.parametrize("m,k,n,act", QGEMMS)
def test_qgemm_every_variant_exact(m, k, n, act, npu_lib):
    """The fused int8 GEMM of every variant this CPU runs (amx_int8 tdpbusd included) returns
    numpy's int64 sum (x - zx) @ w.T as its int32 accumulators, and the same codes, for 1 and 3
    threads; s8 activations go through the u = code + 128 offset."""
    import torch
    import dal.npu as npu
    from qgemm_case import QgemmCase
    rng = np.random.default_rng(m + k + n)
    dt = np.uint8 if act == "u8" else np.int8
    info = np.iinfo(dt)
    x = rng.integers(info.min, info.max + 1, (m, k)).astype(dt)
    x[0, :] = info.max  # extreme operands: 255 * -128 quads, nothing may saturate
    w = rng.integers(-128, 128, (n, k))
    w[0, :] = -128
    case = QgemmCase(x, 121 if act == "u8" else -5, w)
    codes = {}
    for kernel in npu.info()["supported"]:
        for threads in (1, 3):
            acc = torch.empty(m * n, dtype=torch.int32)
            codes[kernel, threads] = case.run(npu_lib, torch.from_numpy(x), kernel, threads, acc)
            assert np.array_equal(acc.numpy().reshape(m, n), case.exact), (kernel, threads)
    ref = codes["portable", 1]
    assert np.array_equal(ref, case.want)
    for key, q in codes.items():
        assert np.array_equal(q, ref), key
