"""The accumulator as the chip has it: 16-bit input codes, and accumulators narrower than the
exact sum (``dal.accumulator``), for the integer groups of integer_groups.py.

An integer group gets an ``AccumulatorModel`` (``attach``) when its input codes are 16-bit
(int16 / uint16: the int32 kernels cannot hold 32767 * 127 * K exactly) or the file declares
``dal.accumulator`` with fewer than 32 bits. Per output channel c, exactly:

    acc   = sum_k (x_q - zp_x)(w_q - zp_w[c]) + bias_q[c]          Python-exact integers:
            8-bit codes through the int32 kernels, 16-bit codes as int64 numpy products
            (|acc| < 2^63 is checked), no float anywhere
    acc'  = clamp(acc, -2^(B-1), 2^(B-1) - 1)                      overflow "saturate"
          = ((acc + 2^(B-1)) mod 2^B) - 2^(B-1)                    overflow "wrap"
            (B = dal.accumulator bits; no declaration: acc' = acc)
    q     = the requantizer of metadata.py applied to acc'
            float:        clamp(round_half_even(float32(float64(acc') * M_c) / s_y) + zp_y)
            fixed_point / power_of_two: clamp(round_shift(acc' * m_c, n_c) + zp_y)

"saturate" clamps the exact sum once, as a MAC array with a wide adder tree that saturates
when it writes its B-bit accumulator; it does not model saturation of each partial sum. The
requantizers are the same formulas as csrc/requant.cpp, written again here in numpy on int64
(or Python integers when a product could pass 2^62).
"""
from __future__ import annotations

import numpy as np

from .errors import NPUError

WIDE_CODES = {np.dtype(np.int16), np.dtype(np.uint16)}
_ROUNDING = ("half_up", "half_even", "half_away")


def attach(g, step, rq) -> "AccumulatorModel | None":
    """The model for ``step`` (an integer_groups.FusedStep under construction), or None when the
    existing exact int32 path already is the chip (8-bit codes, no narrower accumulator)."""
    wide = np.dtype(step.x_dtype) in WIDE_CODES
    narrow = rq.accumulator_bits is not None and rq.accumulator_bits < 32
    if not (wide or narrow):
        return None
    return AccumulatorModel(g, step, rq, wide)


def limit(acc: np.ndarray, bits, overflow: str) -> np.ndarray:
    """``acc`` (int64) as a ``bits``-wide accumulator: saturated or wrapped (module doc)."""
    if bits is None or bits >= 64:
        return acc
    lo, hi = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    if overflow == "saturate":
        return np.clip(acc, lo, hi)
    return ((acc + (1 << (bits - 1))) & ((1 << bits) - 1)) - (1 << (bits - 1))


def round_shift(p: np.ndarray, n: np.ndarray, rounding: str) -> np.ndarray:
    """``p * 2^-n`` rounded per ``rounding`` (ties: half_up toward +inf, half_even, half_away
    from zero); ``n <= 0`` multiplies. ``p`` int64 or object (Python ints), ``n`` broadcastable."""
    p = np.asarray(p)
    n = np.broadcast_to(np.asarray(n, dtype=object if p.dtype == object else np.int64), p.shape)
    if p.dtype != object and (np.any(n > 62) or np.any(n < 0)):
        return round_shift(p.astype(object), n.astype(object), rounding)
    pos = np.maximum(n, 0)
    neg = np.maximum(-n, 0)
    one = 1 if p.dtype == object else np.int64(1)
    f = p >> pos
    rem = p - (f << pos)
    h = np.where(pos > 0, one << np.maximum(pos - 1, 0), 2 * one)  # pos == 0: no remainder, no tie
    up = rem > h
    tie = rem == h
    if rounding == "half_up":
        r = f + (up | tie)
    elif rounding == "half_even":
        r = f + up + (tie & ((f & 1) == 1))
    else:
        r = f + up + (tie & (p >= 0))
    return np.where(n <= 0, p << neg, r)


class AccumulatorModel:
    """Runs one integer group with the accumulator of the module doc."""

    def __init__(self, g, step, rq, wide: bool):
        self.step, self.rq, self.wide = step, rq, wide
        if wide:
            self.w = self._weights(g, step)

    @staticmethod
    def _weights(g, step) -> np.ndarray:
        """Weight codes minus zero point as int64: Conv [O, C/g, kh, kw]; Gemm/MatMul [K, N]."""
        node = step.node
        dqw = g.producer(node.input[1])
        wq, wz = g.const(dqw.input[0]), g.const_opt(dqw, 2)
        wd = wq.astype(np.int64)
        if wz is not None and wz.size > 1:
            shape = [1] * wq.ndim
            shape[g.attrs(dqw).get("axis", 1) % wq.ndim] = wz.size
            wd = wd - wz.astype(np.int64).reshape(shape)
        elif wz is not None:
            wd = wd - int(wz.reshape(-1)[0])
        if node.op_type == "Gemm" and g.attrs(node).get("transB", 0):
            wd = wd.T
        return np.ascontiguousarray(wd)

    def _conv(self, x: np.ndarray) -> np.ndarray:
        """Exact int64 accumulators [N, O, OH, OW] of a 2-D conv of ``x`` (codes minus zp)."""
        strides, dil, pads = self.step.conv_geo
        o, cg, kh, kw = self.w.shape
        n, c, h, w = x.shape
        group = c // cg
        xp = np.pad(x, ((0, 0), (0, 0), (pads[0], pads[2]), (pads[1], pads[3])))
        oh = (xp.shape[2] - dil[0] * (kh - 1) - 1) // strides[0] + 1
        ow = (xp.shape[3] - dil[1] * (kw - 1) - 1) // strides[1] + 1
        og = o // group
        acc = np.zeros((n, o, oh, ow), dtype=np.int64)
        for i in range(kh):
            for j in range(kw):
                win = xp[:, :, i * dil[0]: i * dil[0] + strides[0] * (oh - 1) + 1: strides[0],
                         j * dil[1]: j * dil[1] + strides[1] * (ow - 1) + 1: strides[1]]
                for gi in range(group):
                    wg = self.w[gi * og:(gi + 1) * og, :, i, j]              # [og, cg]
                    xg = win[:, gi * cg:(gi + 1) * cg]                       # [n, cg, oh, ow]
                    acc[:, gi * og:(gi + 1) * og] += np.einsum("oc,nchw->nohw", wg, xg)
        return acc

    def _exact(self, xq: np.ndarray, threads: int) -> np.ndarray:
        """acc [C, P] as int64, bias included."""
        s = self.step
        if not self.wide:
            acc = s.accumulators(xq, threads)
            rows = np.moveaxis(acc, 1, 0).reshape(s.channels, -1) if s.op == "Conv" else acc
            s.out_shape = acc.shape
            rows = rows.astype(np.int64)
        else:
            x = xq.astype(np.int64) - s.x_zp
            per_out = np.abs(self.w).reshape(self.w.shape[0], -1).sum(1) if s.op == "Conv" else np.abs(self.w).sum(0)
            bound = int(np.abs(x).max(initial=0)) * int(per_out.max(initial=0))
            if bound >= 2**62:
                raise NPUError(f"node {s.node_name!r}: a 16-bit accumulation could pass 2^62; not modelled")
            if s.op == "Conv":
                acc = self._conv(x)
                s.out_shape = acc.shape
                rows = np.moveaxis(acc, 1, 0).reshape(s.channels, -1)
            else:
                rows = (x.reshape(-1, s.k) @ self.w).T
        if s.bias_q is not None:
            rows = rows + s.bias_q.reshape(-1, 1).astype(np.int64)
        return np.ascontiguousarray(rows)

    def _requant(self, rows: np.ndarray) -> np.ndarray:
        s, rq = self.step, self.rq
        zp, lo, hi = int(s.y_zp), int(s.lo), int(s.hi)
        if rq.integer:
            m = s.fp_m.astype(np.int64).reshape(-1, 1)
            n = s.fp_n.astype(np.int64).reshape(-1, 1)
            big = int(np.abs(rows).max(initial=0)) * int(m.max(initial=1)) >= 2**62
            p = rows.astype(object) * m.astype(object) if big else rows * m
            r = round_shift(p, n, rq.rounding)
            return np.clip(r + zp, lo, hi).astype(np.int64)
        v = (rows.astype(np.float64) * s.mult.reshape(-1, 1)).astype(np.float32)
        if s.bias_f is not None:
            v = v + s.bias_f.reshape(-1, 1).astype(np.float32)
        r = np.rint(v / np.float32(s.y_scale))  # float32 division, half to even (ONNX Q)
        r = np.clip(r, np.float32(lo - zp), np.float32(hi - zp))
        return r.astype(np.int64) + zp

    def run(self, xq, threads, want_extra=False):
        s = self.step
        rows = limit(self._exact(xq, threads), self.rq.accumulator_bits, self.rq.accumulator_overflow)
        out = {s.q_out: s.rows_to_output(self._requant(rows), xq).astype(s.y_dtype)}
        if want_extra:
            s.add_op_values(out, rows, xq)
        return out
