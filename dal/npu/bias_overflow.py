"""The error of an integer group whose accumulator plus int32 bias leaves int32, with the numbers.

The NPU adds the bias codes to the exact int32 accumulator, ``t = acc + bias_q[o]``; when some
t leaves [-2^31, 2^31 - 1] the hardware would wrap, so dal.npu refuses. Measured on torchvision's
random-weight SSDlite exported without re-estimated BatchNorm statistics: the input scale of
``features.0.10...block.2.0/Conv`` was 1.1e-13, the bias scale s_x*s_w 6.2e-17, 14 of its 80
bias codes saturated at +-(2^31 - 1) and accumulators of ~1e4 pushed them over. That is a real
overflow of the file (not a kernel fault), so the message says which channel, by how much, and
which scale made the bias unrepresentable.
"""
from __future__ import annotations

import numpy as np

from . import quant
from .errors import NPUError

INT32_MIN, INT32_MAX = -2**31, 2**31 - 1


def acc_bound(wd, x_dtype, x_zp: int) -> np.ndarray | None:
    """Largest possible |acc[o]| = sum_k |wd[o, k]| * max(zx - qmin, qmax - zx) (int64), from the
    weights minus zero point ``wd`` [O, ...] and the input code range; None without weights."""
    if wd is None:
        return None
    qmin, qmax = quant.int_range(x_dtype)
    span = max(int(x_zp) - qmin, qmax - int(x_zp))
    return np.abs(np.asarray(wd, dtype=np.int64)).reshape(len(wd), -1).sum(1) * span


def bias_overflow_error(node_name, rows: np.ndarray, bias_q: np.ndarray, x_scale, w_scale,
                        bound: np.ndarray | None) -> NPUError:
    """NPUError naming the node, the worst channel (acc, bias code, their sum against the int32
    limit), how many bias codes are saturated, and the bias / input scales. ``rows``: exact
    accumulators without bias, [channels, -1]."""
    b = np.asarray(bias_q, dtype=np.int64).reshape(-1)
    t = np.asarray(rows, dtype=np.int64) + b.reshape(-1, 1)
    excess = np.maximum(t - INT32_MAX, INT32_MIN - t)
    bad = excess > 0
    o, p = np.unravel_index(int(np.argmax(excess)), t.shape)
    chans = np.unique(np.nonzero(bad)[0])
    ws = np.broadcast_to(np.asarray(w_scale, dtype=np.float64).reshape(-1), b.shape)
    bias_scale = np.float64(x_scale) * ws
    n_sat = int(np.sum(np.abs(b) >= INT32_MAX))
    side = f"> 2^31-1" if t[o, p] > INT32_MAX else "< -2^31"
    listed = ", ".join(str(int(c)) for c in chans[:8]) + (", ..." if chans.size > 8 else "")
    msg = (f"node {node_name!r}: accumulator plus bias overflows int32 at {int(bad.sum())} of {t.size} "
           f"outputs (channels {listed}); channel {o}: acc {int(rows[o, p])} + bias code {int(b[o])} = "
           f"{int(t[o, p])} {side}")
    if bound is not None:
        msg += (f"; the accumulator can reach +-{int(bound[o])} there, the bias leaves it "
                f"{max(0, INT32_MAX - abs(int(b[o])))} of headroom")
    msg += (f"; {n_sat} of {b.size} bias codes are saturated (+-2^31); bias scale s_x*s_w = "
            f"{bias_scale[o]:.3g} (input scale s_x = {float(x_scale):.3g}, weight scale {ws[o]:.3g})")
    if n_sat:
        msg += (": the bias is not representable at that scale, usually a degenerate calibration "
                "(activations ~0, e.g. random weights with untrained BatchNorm statistics)")
    return NPUError(msg)
