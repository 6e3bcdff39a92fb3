"""``DQ -> GlobalAveragePool -> Q`` on 8-bit codes (scalar parameters) as one step.

The node-by-node value is ``Q(float32(sum_hw float64(DQ(x))) / float32(H * W))`` (ops_nn's
GlobalAveragePool: a float64 sum rounded once to float32, export/SPEC.md §5a). Each ``DQ(c)``
is a finite float32, an integer multiple of its own ulp, and every ulp is a power of two no
smaller than ``quantum`` = the smallest ulp among the 256 table values; so every addend is an
integer multiple of ``quantum`` below ``max|DQ| / quantum`` units, and while
``H * W * max|DQ| / quantum < 2^53`` every partial sum is exact in float64: the sum, hence
the result, does not depend on the order of the additions. The step therefore sums, in
float64, the table values ``T[c] = DQ(c)`` (the very float32 values quant.dequantize gives) of the codes
as they are stored -- NCHW, or pixel-major [N, H, W, C] (layout.py), which spares the
conversion of the last residual sum -- then divides and quantizes exactly as the nodes do.
Outside that bound, or for other ranks / types, the three nodes run one by one.
"""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from . import quant


class GapCodes:
    """``DQ(x) -> GlobalAveragePool -> Q`` of 8-bit codes with scalar parameters (module doc)."""

    kind = "codes"
    nhwc_capable, nhwc_in, nhwc_out = True, (), False  # layout.py: reads input 0 in either layout

    def __init__(self, g, node, dq, q):
        self.g, self.node, self.node_name = g, node, node.name
        (self.dq, xs, xz), (self.q, self.ys, self.yz) = dq, q
        self.inputs, self.outputs = [self.dq.input[0]], [self.q.output[0]]
        self.extra_outputs, self.absorbed = [node.output[0]], [self.q]
        lo, hi = quant.int_range(xz.dtype)
        codes = np.arange(lo, hi + 1).astype(xz.dtype)
        t = quant.dequantize(codes, xs, xz).astype(np.float32)
        self.x_dtype = xz.dtype
        self.table = np.empty(256, dtype=np.float32)  # indexed by the code's byte
        self.table[codes.view(np.uint8)] = t
        # the same float32 values by float32(c) - float32(zp), times s: no gather (its index
        # array would be 8 bytes a code); used only where it reproduces every table value's bits
        self.zp32, self.s32 = np.float32(xz.reshape(())), np.float32(np.asarray(xs).reshape(()))
        self.affine = np.array_equal(self._affine(codes).view(np.int32), t.view(np.int32))
        big = float(np.abs(t).max())
        nz = np.abs(t[t != 0])
        quantum = float(np.spacing(nz).min()) if nz.size else 1.0
        # pixels a sum may hold and stay exact (module doc); 0 when a table value is not finite
        self.max_pixels = int(2.0 ** 53 / (big / quantum + 1)) if np.isfinite(t).all() else 0

    def run(self, ins, threads, want_extra=False):
        from .layout import to_nchw
        x, nin = ins[0], bool(self.nhwc_in and self.nhwc_in[0])
        if want_extra or x.dtype != self.x_dtype or x.ndim != 4:
            return self._by_nodes(to_nchw(x) if nin and x.ndim == 4 else x, threads, want_extra)
        n, c, h, w = (x.shape[0], x.shape[3], x.shape[1], x.shape[2]) if nin else x.shape
        if not 0 < h * w <= self.max_pixels:
            return self._by_nodes(to_nchw(x) if nin else x, threads, want_extra)
        v = self._affine(x) if self.affine else np.take(self.table, np.ascontiguousarray(x).view(np.uint8))
        # float32 addends summed in float64 (exact, any order: module doc); no float64 copy
        s = v.sum(axis=(1, 2) if nin else (2, 3), dtype=np.float64).astype(np.float32).reshape(n, c, 1, 1)
        y = (s / s.dtype.type(h * w)).astype(np.float32)
        qy = quant.quantize(y, self.ys, self.yz, self.yz.dtype)
        return {self.outputs[0]: qy.reshape(n, 1, 1, c) if self.nhwc_out else qy}

    def _affine(self, x):
        v = x.astype(np.float32)
        v -= self.zp32
        v *= self.s32
        return v

    def _by_nodes(self, x, threads, want_extra):
        """DequantizeLinear, GlobalAveragePool, QuantizeLinear by the node-by-node ops."""
        from .ops_float import OPS
        from .layout import to_nhwc
        vals = {self.dq.input[0]: x}
        for node in (self.dq, self.node, self.q):
            ctx = SimpleNamespace(node=node, opset=self.g.opset, threads=threads)
            args = [vals[i] if i in vals else self.g.consts.get(i) if i else None for i in node.input]
            vals[node.output[0]] = OPS[node.op_type](ctx, args, self.g.attrs(node))[0]
        y = vals[self.outputs[0]]
        out = {self.outputs[0]: to_nhwc(y) if self.nhwc_out and y.ndim == 4 else y}
        if want_extra:
            out[self.node.output[0]] = vals[self.node.output[0]]
        return out
