"""The blocked linear's C++ kernel (csrc/blocked_gemm.cpp): weights packed once at load, one call
per run, the same numbers as blocked_groups.py's numpy path on every element.

What it computes (blocked_groups.py's module doc, export/SPEC.md §5a), per row m and column n:

    acc_b = sum_{k in block b} (x_q[k] - zp_x) w_int[k, n]        exact int32 per block
    t     = (((acc_0 s_0 + acc_1 s_1) + acc_2 s_2) + ...)         float64, b ascending
    v     = float32(float64(s_x) * t)
    codes = clamp(round_half_even(v / s_y) + zp_y, lo, hi)        per 8-bit reader, float32 division

The block sums are exact integers in any order and each product ``acc_b * s_b`` is exact
(|acc_b| < 2^29, checked by the matcher), so the C++ sum of those products in ascending block
order is the module doc's ``t`` itself: no tolerance. Weights take the int8 form (vpdpbusd,
u8 x s8) when the session's kernel variant has VNNI and every ``w_int`` lies in [-128, 127],
else the int16 form (vpmaddwd); both are exact (csrc/blocked_gemm.h).

:func:`make` returns None (the numpy path then runs) for what the kernel does not take: input
codes other than int8 / uint8, an empty weight, or a library that does not build.
"""
from __future__ import annotations

import numpy as np

PANEL = 16  # columns per packed panel (csrc/blocked_gemm.cpp)
_OUT = {np.dtype(np.uint8): 1, np.dtype(np.int8): 2}


def pack(w_int: np.ndarray, block: int, vnni: bool):
    """``(Wp, wsum)`` as torch tensors: ``w_int`` [K, N] (weights minus their zero point) in blocks of
    ``block`` input channels, per block and 16-column panel; int8 [nb, NP, ceil(B/4), 16, 4] with
    int32 column sums per block [nb, NP * 16] when ``vnni``, else int16 [nb, NP, ceil(B/2), 16, 2]
    and an empty wsum. Rows past K and past B (padding) and columns past N hold 0."""
    import torch
    k, n = w_int.shape
    ks = 4 if vnni else 2
    nb, steps, npan = -(-k // block), -(-block // ks), -(-n // PANEL)
    w = np.zeros((nb, steps * ks, npan * PANEL), np.int8 if vnni else np.int16)
    wk = np.zeros((nb * block, n), np.int64)
    wk[:k] = w_int
    w[:, :block, :n] = wk.reshape(nb, block, n)
    wp = np.ascontiguousarray(w.reshape(nb, steps, ks, npan, PANEL).transpose(0, 3, 1, 4, 2))
    packed = torch.empty(wp.shape, dtype=torch.int8 if vnni else torch.int16)  # torch's 64-byte alignment
    packed.numpy()[...] = wp
    wsum = (torch.from_numpy(w.astype(np.int64).sum(axis=1).astype(np.int32)) if vnni
            else torch.empty(0, dtype=torch.int32))
    return packed, wsum


class BlockedKernel:
    """One blocked linear's packed weights and reader parameters; :meth:`value` and :meth:`codes`
    are one C++ call each."""

    def __init__(self, w_int, w_scale, block: int, x_zp: int, s_x, isa: int, readers):
        import torch

        from .dispatch import has_vnni
        k, n = w_int.shape
        self.isa, self.block, self.n, self.k = int(isa), int(block), n, k
        self.vnni = bool(has_vnni(self.isa) and w_int.min() >= -128 and w_int.max() <= 127)
        self.wp, self.wsum = pack(w_int, self.block, self.vnni)
        npan = -(-n // PANEL)
        ws = np.ones((w_scale.shape[0], npan * PANEL), np.float64)
        ws[:, :n] = w_scale
        self.ws = torch.from_numpy(ws)
        self.zx, self.sx = int(x_zp), float(s_x)
        i64 = lambda v: torch.tensor(v, dtype=torch.int64)
        self.no_readers = (torch.empty(0, dtype=torch.float32),) + (i64([]),) * 4
        # the readers' parameters as the kernel takes them, when every reader writes 8-bit codes
        self.readers = None
        if readers and all(dt in _OUT for *_, dt in readers):
            self.readers = (torch.tensor([float(r[1]) for r in readers], dtype=torch.float32),
                            i64([int(r[2]) for r in readers]), i64([int(r[3]) for r in readers]),
                            i64([int(r[4]) for r in readers]), i64([_OUT[r[5]] for r in readers]))
        from .build import kernels
        self.fn = kernels().blocked_gemm

    def _call(self, xq, params, threads):
        import torch
        x = torch.from_numpy(np.ascontiguousarray(xq.reshape(-1, self.k)))
        return self.fn(x, self.zx, self.wp, self.wsum, self.ws, self.block, self.n, self.sx, *params,
                       int(threads), self.isa)

    def value(self, xq: np.ndarray, threads: int = 1) -> np.ndarray:
        """``v`` float32 [..., N] for codes ``xq`` [..., K] (dtype and shape checked by the caller)."""
        return self._call(xq, self.no_readers, threads)[0].numpy().reshape(xq.shape[:-1] + (self.n,))

    def codes(self, xq: np.ndarray, threads: int = 1) -> list:
        """Each reader's codes [..., N] (only when ``self.readers``: every reader 8-bit)."""
        return [c.numpy().reshape(xq.shape[:-1] + (self.n,)) for c in self._call(xq, self.readers, threads)]


def make(plan: dict, readers, isa) -> BlockedKernel | None:
    """The kernel for blocked_groups' ``plan`` (its ``w_int``, ``w_scale``, ``block_size``, ``x_zp``,
    ``x_scale``, ``x_dtype``) and BlockedStep's ``readers`` ((name, ys, yz, lo, hi, dtype) each), or
    None where the numpy path must run (module doc)."""
    if np.dtype(plan["x_dtype"]) not in _OUT or plan["w_int"].size == 0:
        return None
    from .build import BuildError
    try:
        return BlockedKernel(plan["w_int"], plan["w_scale"], plan["block_size"], plan["x_zp"], plan["x_scale"],
                             -1 if isa is None else isa, readers)
    except BuildError:
        return None
