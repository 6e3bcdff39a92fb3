"""``DQ -> Flatten | Reshape -> Q`` on 8-bit codes (scalar parameters) as one code step.

A shape op moves elements without changing them, so it commutes with the elementwise DQ and Q:

    Q(shape(DQ(c))) = shape(T[c]),   T[c] = Q(DQ(c)) for the 256 codes

(T computed at load by quant.py's own functions, exactly as fused_codes' tables are). Where T is
the identity -- the same scale and zero point on both sides, as quantize_static writes the
Flatten before ResNet's classifier -- the codes pass through unchanged: one step instead of a
DequantizeLinear, the shape op and a QuantizeLinear, each a Python step per run at batch 1.
The shape op is the registered op itself (ops_float's Flatten / Reshape, which only reshape
their input), applied to the codes once per input shape, then the reshape it made (the same
view, without the op's Python per run); a Reshape's target shape must be a constant. With
``return_intermediates`` (or codes of another type) the three nodes run one by one.
"""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from . import quant

#: shape ops that move elements and never change one (ops_float: x.reshape)
SHAPE_OPS = ("Flatten", "Reshape")


class ShapeCodes:
    """``DQ(x) -> Flatten | Reshape -> Q`` of 8-bit codes with scalar parameters (module doc)."""

    kind = "codes"

    def __init__(self, g, node, dq, q):
        self.g, self.node, self.node_name = g, node, node.name
        (self.dq, xs, xz), (self.q, ys, yz) = dq, q
        self.inputs = [self.dq.input[0]] + list(node.input[1:])
        self.outputs, self.extra_outputs, self.absorbed = [self.q.output[0]], [node.output[0]], [self.q]
        self.x_dtype = xz.dtype
        lo, hi = quant.int_range(xz.dtype)
        codes = np.arange(lo, hi + 1).astype(xz.dtype)
        t = quant.quantize(quant.dequantize(codes, xs, xz), ys, yz, yz.dtype)
        identity = t.dtype == codes.dtype and np.array_equal(t, codes)
        self.table = None if identity else np.empty(256, dtype=yz.dtype)  # indexed by the code's byte
        if self.table is not None:
            self.table[codes.view(np.uint8)] = t
        self.shapes = {}  # output shape per input shape: the op runs once per shape

    def run(self, ins, threads, want_extra=False):
        x = ins[0]
        if want_extra or not isinstance(x, np.ndarray) or x.dtype != self.x_dtype:
            return self._by_nodes(ins, threads, want_extra)
        shape = self.shapes.get(x.shape)
        if shape is None:  # the registered op on these codes (its checks, its errors)
            from .ops_float import OPS
            from .validate import precheck
            ctx = SimpleNamespace(node=self.node, opset=self.g.opset, threads=threads)
            attrs = self.g.attrs(self.node)
            precheck(self.node, ins, attrs)
            y = OPS[self.node.op_type](ctx, list(ins), attrs)[0]
            if len(self.shapes) < 64:
                self.shapes[x.shape] = y.shape
        else:  # what the op computes (ops_float: x.reshape; the target shape is a constant)
            y = x.reshape(shape)
        if self.table is not None:
            y = np.take(self.table, np.ascontiguousarray(y).view(np.uint8))
        return {self.outputs[0]: y}

    def _by_nodes(self, ins, threads, want_extra):
        """DequantizeLinear, the shape op, QuantizeLinear by the node-by-node ops."""
        from .ops_float import OPS
        vals = dict(zip(self.inputs, ins))
        for node in (self.dq, self.node, self.q):
            ctx = SimpleNamespace(node=node, opset=self.g.opset, threads=threads)
            args = [vals[i] if i in vals else self.g.consts.get(i) if i else None for i in node.input]
            vals[node.output[0]] = OPS[node.op_type](ctx, args, self.g.attrs(node))[0]
        out = {self.outputs[0]: vals[self.outputs[0]]}
        if want_extra:
            out[self.node.output[0]] = vals[self.node.output[0]]
        return out


def match(g, node, dq, q):
    """A ShapeCodes for shape op ``node`` between DQ ``dq`` and Q ``q`` (fused_codes' parameter
    tuples, or None), or None: Reshape needs a constant target shape."""
    if dq is None or q is None or node.op_type not in SHAPE_OPS:
        return None
    if node.op_type == "Reshape" and (len(node.input) != 2 or g.const(node.input[1]) is None):
        return None
    return ShapeCodes(g, node, dq, q)
