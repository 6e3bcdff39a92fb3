"""The C++ input quantizer (csrc/quantize.cpp) cut between threads: pixel-major output is dealt
as image rows (n, y), every channel of a row by one thread, so that no output line is written by
two threads; the flat form in pieces of 4096. Whatever the cut, every code must equal numpy's
float32 formula q = clip(rint(x / s) + zp, lo, hi) (rint: round half to even) at 1-4 threads,
for batches that do and do not divide among the threads and channel counts 1, 3 and 5."""
from __future__ import annotations

import numpy as np
import pytest

SHAPES = [(1, 3, 7, 9), (3, 3, 5, 11), (2, 5, 3, 4), (1, 1, 6, 5), (1, 3, 1, 4099)]


def _numpy_codes(x, s, zp, dt):
    info = np.iinfo(dt)
    r = np.rint(x / np.float32(s)).astype(np.float64)  # float32 division, then half-even rounding
    return np.clip(r + zp, info.min, info.max).astype(dt)


@pytest.mark.parametrize("shape", SHAPES)
def test_quantize_codes_any_thread_count(shape, npu_lib):
    import torch
    import dal.npu as npu
    from dal.npu.dispatch import NAMES
    rng = np.random.default_rng(sum(shape))
    x = (rng.standard_normal(shape) * 5).astype(np.float32)
    s = float(np.float32(0.0371))
    k = rng.integers(-150, 150, min(64, x.size)).astype(np.float32)
    x.reshape(-1)[:k.size] = (k + np.float32(0.5)) * np.float32(s)  # near ties
    for dt, code, zp in ((np.uint8, 1, 131), (np.int8, 2, -3)):
        want = _numpy_codes(x, s, zp, dt)
        for kernel in npu.info()["supported"]:
            isa = NAMES.index(kernel)
            for threads in (1, 2, 3, 4):
                flat = npu_lib.quantize_codes(torch.from_numpy(x), s, zp, code, False, threads, isa).numpy()
                assert np.array_equal(flat.view(dt), want), (kernel, threads)
                hwc = npu_lib.quantize_codes(torch.from_numpy(x), s, zp, code, True, threads, isa).numpy()
                assert np.array_equal(hwc.view(dt), want.transpose(0, 2, 3, 1)), (kernel, threads)
