"""Float-island MatMuls whose weight is a constant (an initializer, or a weight's DequantizeLinear
folded at load, constant_steps.py): the weight's float64 copy is made once at load instead of on
every run.

export/SPEC.md §5a's float MatMul is ``T(sum float64(x) * float64(w))``, which dal.npu computes as
``np.matmul(np.asarray(x, float64), np.asarray(w, float64))`` (ops_nn.float_matmul), cast to x's
type. ``ConstWeightMatMul`` makes that same call on the same float64 array (``np.asarray`` of the
same constant, made once), so every output bit is unchanged; any other input (a value handed in
by ``Session.run_layerwise``, a non-float input, a shape error) runs the node step it wraps, which
computes or raises exactly as before.
"""
from __future__ import annotations

import numpy as np

from .tensors import is_float


class ConstWeightMatMul:
    """A MatMul node step (``inner``) with its constant input 1 ``w`` held as float64."""

    kind = "node"

    def __init__(self, inner, w):
        self.inner, self.node, self.node_name = inner, inner.node, inner.node_name
        self.inputs, self.outputs, self.extra_outputs = inner.inputs, inner.outputs, inner.extra_outputs
        self.w_src, self.w64 = w, np.asarray(w, np.float64)

    def run(self, ins, threads, want_extra=False):
        x, w = ins
        if w is not self.w_src or not is_float(x) or x.ndim < 1 or x.shape[-1] != self.w64.shape[0]:
            return self.inner.run(ins, threads, want_extra)
        return {self.outputs[0]: np.matmul(np.asarray(x, np.float64), self.w64).astype(x.dtype)}


def cache_weights(steps: list, constants: dict) -> list:
    """``steps`` with every plain MatMul node step whose input 1 is a float 2-D constant in
    ``constants`` (initializers and folded values, the very arrays each run reads) wrapped in
    ``ConstWeightMatMul``."""
    from .session import NodeStep
    out = []
    for st in steps:
        if (type(st) is NodeStep and st.node.op_type == "MatMul" and len(st.inputs) == 2
                and st.inputs[1] in constants):
            w = constants[st.inputs[1]]
            if isinstance(w, np.ndarray) and w.ndim == 2 and is_float(w):
                st = ConstWeightMatMul(st, w)
        out.append(st)
    return out
