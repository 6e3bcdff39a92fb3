"""export/SPEC.md §5a's blocked integer group written out from the SPEC text, for the tests of
both integer engines (tests/npu/test_blocked_groups.py, tests/convert/test_convert_blocked_linear.py).
``block_values`` without ``codes`` is the blocked linear with a float output: its ``v`` is the
MatMul's output tensor (tests/npu/test_blocked_float.py, tests/convert/test_convert_blocked_float.py,
tests/llm_npu/test_decoder_graphs.py).

Python integers for the block sums, Python floats (IEEE float64) for the block combination in
ascending block order, then numpy float32 for the last rounding and ONNX QuantizeLinear's float32
division. Every product ``acc_b * s_w[b, n]`` is checked exact with fractions.
"""
from __future__ import annotations

from fractions import Fraction

import numpy as np


def block_values(xq, zx, wq, wz, ws, block, sx) -> np.ndarray:
    """``v`` [M, N] float32 for codes ``xq`` [M, K] (zero point ``zx``), weight codes ``wq`` [K, N]
    with zero point ``wz`` and scale ``ws`` [nb, N] per block of ``block`` input channels (the last
    block short when ``block`` does not divide K), input scale ``sx``."""
    xq = np.asarray(xq).astype(np.int64)
    wq, wz = np.asarray(wq).astype(np.int64), np.asarray(wz).astype(np.int64)
    m_rows, k = xq.shape
    n_cols = wq.shape[1]
    nb = -(-k // block)
    assert ws.shape == (nb, n_cols) and wz.shape == (nb, n_cols)
    out = np.empty((m_rows, n_cols), np.float32)
    for m in range(m_rows):
        for n in range(n_cols):
            t = None
            for b in range(nb):
                ks = range(b * block, min(k, (b + 1) * block))
                acc = sum((int(xq[m, i]) - int(zx)) * (int(wq[i, n]) - int(wz[b, n])) for i in ks)
                s = float(np.float32(ws[b, n]))
                p = float(acc) * s
                assert Fraction(p) == Fraction(acc) * Fraction(s), "inexact block product"
                t = p if t is None else t + p
            out[m, n] = np.float32(float(np.float32(sx)) * t)
    return out


def codes(v, sy, zy, lo, hi) -> np.ndarray:
    """``clamp(round_half_even(v / s_y) + zp_y, lo, hi)`` with a float32 division."""
    r = np.rint(np.asarray(v, np.float32) / np.float32(sy)).astype(np.float64) + zy
    return np.clip(r, lo, hi).astype(np.int64)
