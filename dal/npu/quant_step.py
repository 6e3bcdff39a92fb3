"""QuantizeLinear of float32 to 8-bit codes with one scale and one zero point, in C++.

    q = clamp(round_half_even(x / s) + zp, qmin, qmax)        float32 division

(csrc/quantize.cpp, the same operations as quant.quantize, bit for bit). It is the graph
input's quantizer in every QDQ file, and it can write its codes pixel-major (layout.py) for the
first conv. Anything else -- other input types, NaN in the input (quant.py defines its code),
a rank that is not 4 where pixel-major codes were planned -- runs the node-by-node op.
"""
from __future__ import annotations

import numpy as np

from .byte_tables import ByteTable

_OUT = {np.dtype(np.uint8): 1, np.dtype(np.int8): 2}


class QuantStep:
    kind = "node"
    nhwc_capable, nhwc_in, nhwc_out = "out", (), False  # layout.py

    def __init__(self, fallback, scale, zp, isa):
        self.fallback = fallback  # the node-by-node step of the same node (session.NodeStep)
        self.node, self.node_name = fallback.node, fallback.node_name
        self.inputs, self.outputs, self.extra_outputs = fallback.inputs, fallback.outputs, []
        self.scale, self.zp, self.isa = float(scale), int(zp.reshape(())), max(int(isa), -1)
        self.out_code, self.dtype, self.kernel = _OUT[zp.dtype], zp.dtype, None

    def run(self, ins, threads, want_extra=False):
        x = ins[0]
        nhwc = bool(self.nhwc_out)
        if isinstance(x, np.ndarray) and x.dtype == np.float32 and (x.ndim == 4 or not nhwc):
            if self.kernel is None:  # looked up once, not per run
                import torch
                from .build import kernels as lib
                self.kernel = (lib().quantize_codes, torch.from_numpy)
            fn, from_numpy = self.kernel
            try:
                q = fn(from_numpy(np.ascontiguousarray(x)), self.scale, self.zp, self.out_code, nhwc, threads,
                       self.isa).numpy()
                if x.ndim == 0:  # np.ascontiguousarray makes a scalar (a LayerNorm's epsilon) 1-D
                    q = q.reshape(())
                return {self.outputs[0]: q.view(self.dtype)}
            except RuntimeError as e:
                if "is NaN" not in str(e):
                    raise
        from .layout import to_nhwc
        out = self.fallback.run(ins, threads, want_extra)
        if nhwc:
            from .errors import NPUError
            y = out[self.outputs[0]]
            if y.ndim != 4:
                raise NPUError(f"node {self.node_name!r}: codes of rank {y.ndim} where the graph's "
                               "convolutions need rank 4")
            out[self.outputs[0]] = to_nhwc(y)
        return out


def match(g, node, fallback, isa):
    """A QuantStep for QuantizeLinear ``node`` with constant scalar float32 scale and 8-bit zero
    point (no block_size, no output_dtype), else None."""
    params = _scalar_params(g, node, "QuantizeLinear")
    return None if params is None else QuantStep(fallback, np.float32(params[0].reshape(())), params[1], isa)


def _scalar_params(g, node, op_type):
    """(scale, zero point) of a ``op_type`` node with a constant scalar float32 scale (finite,
    positive) and 8-bit zero point, no block_size and no output_dtype; else None."""
    if node.op_type != op_type or node.domain not in ("", "ai.onnx") or len(node.input) < 3:
        return None
    s, z = g.const(node.input[1]), g.const(node.input[2]) if node.input[2] else None
    if s is None or z is None or s.size != 1 or z.size != 1 or s.dtype != np.float32 or z.dtype not in _OUT:
        return None
    a = g.attrs(node)
    if a.get("block_size", 0) or a.get("output_dtype", 0) or not (np.isfinite(s).all() and float(s.reshape(())) > 0):
        return None
    return s, z


class DequantStep:
    """DequantizeLinear of 8-bit codes with one constant float32 scale and zero point:
    ``float32(int64(x) - zp) * s``, the operations of quant.dequantize for scalar parameters
    (bit for bit; computed at load for the 256 codes, looked up per run), with the parameters
    broadcast and checked once at load (validate.py checked the constant scale), not per run.
    Other input types run the node-by-node op (its error)."""

    kind = "node"

    def __init__(self, fallback, scale, zp):
        self.fallback = fallback
        self.node, self.node_name = fallback.node, fallback.node_name
        self.inputs, self.outputs, self.extra_outputs = fallback.inputs, fallback.outputs, []
        self.scale = np.asarray(scale, dtype=np.float32).reshape(())
        self.zp, self.dtype = np.asarray(zp).reshape(()).astype(np.int64), zp.dtype
        # the same expression on all 256 codes, indexed by the code's byte: one gather per run
        # instead of four numpy passes (the graph's last DequantizeLinear at batch 1)
        codes = np.arange(256, dtype=np.uint8).view(self.dtype)
        self.table = self._formula(codes)
        self.lookup = ByteTable(self.table).lookup  # C++ for large tensors (byte_tables.py)

    def _formula(self, x):
        return np.asarray((x.astype(np.int64) - self.zp).astype(np.float32) * self.scale)

    def run(self, ins, threads, want_extra=False):
        x = ins[0]
        if not isinstance(x, np.ndarray) or x.dtype != self.dtype:
            return self.fallback.run(ins, threads, want_extra)
        return {self.outputs[0]: self.lookup(x.view(np.uint8))}


def match_dequant(g, node, fallback):
    """A DequantStep for DequantizeLinear ``node`` with constant scalar float32 scale and 8-bit
    zero point (no block_size, no output_dtype), else None."""
    params = _scalar_params(g, node, "DequantizeLinear")
    return None if params is None else DequantStep(fallback, *params)
