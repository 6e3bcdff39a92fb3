"""The fused requantizer's rounding and clamping, checked where they are most fragile: quotients
exactly half-way between two codes (ties go to the even code), quotients far outside the output
range, and both at the clamp bounds -- for every kernel variant this CPU runs, against numpy's
own float32 arithmetic of the formula in csrc/qconv.h (not against another dal kernel).

  q = clip(rint(float32(float64(acc + bias_q) * mult) + bias_f) / ys) + zy, lo, hi)

Two call shapes reach two requantizer forms: the one-pass block form (8-bit codes, channels a
multiple of 16, no acc_out) and the per-row form (acc_out given, or a channel count that is not
a multiple of 16); both must give the oracle's codes."""
from __future__ import annotations

import numpy as np
import pytest


def _oracle(acc, mult, bias_q, bias_f, ys, zy, lo, hi):
    a = acc + (0 if bias_q is None else bias_q[None, :])
    v = (a.astype(np.float64) * mult[None, :]).astype(np.float32)
    if bias_f is not None:
        v = v + bias_f[None, :]  # float32 + float32
    r = np.rint(v / np.float32(ys))  # float32 division, half to even
    return np.clip(r + zy, lo, hi)


CASES = [  # m, n, out codes, ys, with acc_out: every path of the block and the row forms
    (50, 64, "u8", 1.0, False),    # mult 0.5: every odd sum is a tie
    (50, 64, "s8", 2.0, False),
    (37, 48, "u8", 0.5, True),     # acc_out: the row form
    (29, 40, "s8", 1.0, False),    # 40 channels: not a multiple of 16, the row form
]


@pytest.mark.parametrize("m,n,out,ys,with_acc", CASES)
def test_requant_ties_and_clamps_every_variant(m, n, out, ys, with_acc, npu_lib):
    import torch
    import dal.npu as npu
    from dal.npu import kernels
    from dal.npu.dispatch import NAMES
    rng = np.random.default_rng(m * n)
    k, zx = 12, 117
    x = rng.integers(zx - 40, zx + 41, (m, k)).astype(np.uint8)
    x[0, :] = 255  # far above the range: clamps to hi
    x[1, :] = 0    # and below it: clamps to lo
    w = rng.integers(-4, 5, (n, k))
    acc = (x.astype(np.int64) - zx) @ w.T
    mult = np.full(n, 0.5)
    mult[1::3] = 0.25  # v = acc / 4: quarter steps (with bias_f), ties again at every ys here
    bias_q = rng.integers(-7, 8, n).astype(np.int32)
    bias_f = (rng.integers(-4, 5, n) * 0.25).astype(np.float32)
    code_lo, code_hi, code = (0, 255, 1) if out == "u8" else (-128, 127, 2)
    zy = 100 if out == "u8" else -3
    want = _oracle(acc, mult, bias_q, bias_f, ys, zy, code_lo, code_hi)
    quot = (((acc + bias_q).astype(np.float64) * mult).astype(np.float32) + bias_f) / np.float32(ys)
    inside = (want > code_lo) & (want < code_hi)
    assert (np.abs(quot - np.trunc(quot)) == 0.5)[inside].sum() > m * n // 10  # the data holds ties...
    assert (want == code_lo).any() and (want == code_hi).any()  # ...and clamps at both bounds
    bp, ws = kernels.pack_panels_s8(w)
    pad = lambda v, dt: kernels.pad_channels(v, n, dt)  # noqa: E731
    e64 = torch.empty(0, dtype=torch.int64)
    bq = pad(bias_q, np.int32)
    bf = pad(bias_f, np.float32)
    for kernel in npu.info()["supported"]:
        for threads in (1, 2):
            acc_t = torch.empty(m * n, dtype=torch.int32) if with_acc else torch.empty(0, dtype=torch.int32)
            got = npu_lib.qgemm(torch.from_numpy(x), zx, bp, ws, n, pad(mult, np.float64), bq, bf, e64, e64, 0,
                                ys, zy, code_lo, code_hi, code, acc_t, threads, NAMES.index(kernel)).numpy()
            assert np.array_equal(got.astype(np.int64), want), (kernel, threads)
            if with_acc:
                assert np.array_equal(acc_t.numpy().reshape(m, n), acc + bias_q), (kernel, threads)
