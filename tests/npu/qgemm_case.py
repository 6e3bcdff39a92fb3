"""One fused int8 GEMM call as the kernel tests make it (test_kernels.py, test_amx_blocking.py):
u8 / s8 codes ``x`` [m, k] with zero point ``zx`` times integer weights ``w`` [n, k], one
requantizer for every channel (multiplier MULT, output scale YS, zero point ZY, uint8 codes).

The oracle is numpy's, not a dal kernel: the exact int64 sums ``(x - zx) @ w.T`` and the
requantizer's formula on them in numpy's float32, ``clip(rint(float32(sum * MULT) / YS) + ZY,
0, 255)`` (rint: half to even)."""
from __future__ import annotations

import numpy as np

MULT, YS, ZY = 2e-5, 0.5, 3


class QgemmCase:
    """The packed operands of one case, the exact sums and the oracle's codes."""

    def __init__(self, x: np.ndarray, zx: int, w: np.ndarray):
        import torch
        from dal.npu import kernels
        m, k = x.shape
        n = w.shape[0]
        self.x, self.zx, self.n = x, zx, n
        self.exact = (x.astype(np.int64) - zx) @ w.T
        kpad = -(-k // 4) * 4
        self.bp, self.ws = kernels.pack_panels_s8(np.pad(w, ((0, 0), (0, kpad - k))))
        self.mult = kernels.pad_channels(np.full(n, MULT), n, np.float64)
        self.empties = tuple(torch.empty(0, dtype=t) for t in (torch.int32, torch.float32, torch.int64))
        q = np.rint((self.exact * MULT).astype(np.float32) / np.float32(YS)) + ZY
        self.want = np.clip(q, 0, 255).astype(np.uint8)

    def run(self, lib, x_tensor, kernel: str, threads: int, acc_out=None) -> np.ndarray:
        """The kernel's codes [m, n] (``x_tensor``: the codes as a torch tensor, e.g. in aligned
        memory); ``acc_out``: an int32 tensor of m * n for the accumulators, or None."""
        import torch
        from dal.npu.dispatch import NAMES
        e32, ef, e64 = self.empties
        acc = acc_out if acc_out is not None else torch.empty(0, dtype=torch.int32)
        q = lib.qgemm(x_tensor, self.zx, self.bp, self.ws, self.n, self.mult, e32, ef, e64, e64, 0, YS, ZY, 0, 255,
                      1, acc, threads, NAMES.index(kernel)).numpy()
        return q.reshape(self.x.shape[0], self.n)
