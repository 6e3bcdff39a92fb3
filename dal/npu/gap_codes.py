"""``DQ -> GlobalAveragePool -> Q`` on 8-bit codes (scalar parameters) as one step.

The node-by-node value is ``Q(float32(sum_hw float64(DQ(x)) / float64(H * W)))`` (ops_nn's
GlobalAveragePool: a float64 sum divided in float64, rounded once to float32, export/SPEC.md §5a). Each ``DQ(c)``
is a finite float32, an integer multiple of its own ulp, and every ulp is a power of two no
smaller than ``quantum`` = the smallest ulp among the 256 table values; so every addend is an
integer multiple of ``quantum`` below ``max|DQ| / quantum`` units, and while
``H * W * max|DQ| / quantum < 2^53`` every partial sum is exact in float64: the sum, hence
the result, does not depend on the order of the additions. The step therefore sums, in
float64, the table values ``T[c] = DQ(c)`` (the very float32 values quant.dequantize gives) of the codes
as they are stored -- NCHW, or pixel-major [N, H, W, C] (layout.py), which spares the
conversion of the last residual sum -- then divides and quantizes exactly as the nodes do.
The sums and the division are one C++ pass (csrc/pool_codes.cpp gap_codes_mean: a thread
per block of 64 channels, each sum in pixel order, which the bound makes equal to any other
order's), the quantizer csrc/quantize.cpp (quant_step.py).
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
        self.kernel = None  # (gap_codes_mean, quantize_codes, torch.from_numpy, table tensor): on first use
        self.scale, self.zp = float(self.ys), int(self.yz)  # quantize_codes' arguments
        self.isa = -1  # the session's kernel variant (session.py sets it; -1: the best)
        self.out_code = {np.dtype(np.uint8): 1, np.dtype(np.int8): 2}[self.yz.dtype]
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
        if self.kernel is None:
            import torch
            from .build import kernels as lib
            self.kernel = (lib().gap_codes_mean, lib().quantize_codes, torch.from_numpy, torch.from_numpy(self.table))
        mean, quantize, from_numpy, table = self.kernel
        try:  # float32 addends summed in float64 (exact, any order: module doc), divided, rounded once
            y = mean(from_numpy(np.ascontiguousarray(x)), table, int(nin), threads)
            # QuantizeLinear as quant_step.QuantStep runs it (csrc/quantize.cpp, quant.py's bits)
            qy = quantize(y, self.scale, self.zp, self.out_code, False, 1, self.isa).numpy().view(self.yz.dtype)
        except RuntimeError:  # a NaN mean, a refused scale: the nodes decide and name it
            return self._by_nodes(to_nchw(x) if nin else x, threads, want_extra)
        return {self.outputs[0]: qy.reshape(n, 1, 1, c) if self.nhwc_out else qy}

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
