"""TopK (RT-DETR's query selection, ``torch.topk`` of the encoder's class scores), node by node.

    values, indices = the k largest (``largest=1``) or smallest elements along ``axis``, in that
                      order, equal values by ascending index (ONNX: "the lower index first")

Exact: a selection, no arithmetic. The order among equal values is ONNX's, a stable sort's, which
dal.convert follows too (torch.topk promises no order among ties; on dequantized int8 scores ties
are common). ``sorted=0`` may return any order (ONNX); this returns the sorted one. NaN: refused
naming the node (its place in the order is not one every engine agrees on).
"""
from __future__ import annotations

import numpy as np

from .errors import NPUError, UnsupportedNode
from .ops_float import op


@op("TopK")
def _topk(ctx, ins, a):
    x, k = np.asarray(ins[0]), np.asarray(ins[1]).reshape(-1)
    if x.dtype.kind not in "fiu":
        raise UnsupportedNode(ctx.node, [str(x.dtype)], "TopK of this type (float or integer only)")
    axis = int(a.get("axis", -1)) % max(x.ndim, 1)
    if k.size != 1 or not 0 <= int(k[0]) <= x.shape[axis]:
        raise NPUError(f"node {ctx.node.name!r} (TopK): k = {k.tolist()} for an axis of length {x.shape[axis]}")
    if x.dtype.kind == "f" and np.isnan(x).any():
        raise NPUError(f"node {ctx.node.name!r} (TopK): NaN in the input")
    key = x.astype(np.float64 if x.dtype.kind == "f" else np.int64)  # exact widening, negation safe
    order = np.argsort(-key if a.get("largest", 1) else key, axis=axis, kind="stable")
    idx = np.take(order, np.arange(int(k[0])), axis=axis)
    return [np.take_along_axis(x, idx, axis=axis), idx.astype(np.int64)]
