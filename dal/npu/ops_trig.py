"""Sin and Cos (Hugging Face DETR-family sine position embeddings), node by node.

    y = T(sin(float64(x)))     y = T(cos(float64(x)))     T = x's float type, one rounding

export/SPEC.md §5a: the float64 result rounded once to ``T``, as Tanh; float32 sin / cos routines
(numpy's, torch's) are vectorised approximations that do not agree to the last bit.
"""
from __future__ import annotations

import numpy as np

from .errors import UnsupportedNode
from .ops_float import op
from .tensors import as_compute_type, is_float


def _rounded_once(fn):
    def run(ctx, ins, a):
        x = ins[0]
        if not is_float(x):
            raise UnsupportedNode(ctx.node, [x.dtype], "expects a float tensor")
        return [np.asarray(fn(as_compute_type(x).astype(np.float64))).astype(x.dtype)]
    return run


op("Sin")(_rounded_once(np.sin))
op("Cos")(_rounded_once(np.cos))
