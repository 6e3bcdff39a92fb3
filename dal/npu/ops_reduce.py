"""ReduceMin / ReduceMax (what DynamicQuantizeLinear's expanded form needs), node by node.

    y = min (max) of x over ``axes`` (all axes when none are given, unless
        noop_with_empty_axes=1, which returns x), keepdims as the attribute says

Exact for every type: a minimum is one of its inputs, so there is no rounding to specify.
NaN propagates (numpy's minimum/maximum). Over an empty set the result is the type's identity
element: +inf / -inf for floats, the largest / smallest integer, as ONNX's reference gives.
Axes come from the attribute before opset 18 and from the second input from opset 18 on.
"""
from __future__ import annotations

import numpy as np

from .errors import NPUError, UnsupportedNode
from .ops_float import op


def _axes(ctx, ins, a, ndim):
    if ctx.opset < 18:
        axes = a.get("axes")
    else:
        axes = np.asarray(ins[1]).reshape(-1).tolist() if len(ins) > 1 and ins[1] is not None else None
    if axes is not None and len(axes) == 0:
        axes = None
    if axes is None:
        return None
    out = []
    for ax in axes:
        if not -ndim <= int(ax) < max(ndim, 1):
            raise NPUError(f"node {ctx.node.name!r} ({ctx.node.op_type}): axis {ax} out of range "
                           f"for a rank-{ndim} input")
        out.append(int(ax) % max(ndim, 1))
    if len(set(out)) != len(out):
        raise NPUError(f"node {ctx.node.name!r} ({ctx.node.op_type}): repeated axes {axes}")
    return tuple(out)


def _identity(dtype, largest: bool):
    if dtype.kind == "f":
        return np.inf if largest else -np.inf
    if dtype.kind == "b":
        return largest
    info = np.iinfo(dtype)
    return info.max if largest else info.min


def _reduce(ufunc, largest_identity: bool):
    def run(ctx, ins, a):
        x = np.asarray(ins[0])
        if x.dtype.kind not in "fiub":
            raise UnsupportedNode(ctx.node, [str(x.dtype)], "ReduceMin/ReduceMax of this type")
        axes = _axes(ctx, ins, a, x.ndim)
        keep = bool(a.get("keepdims", 1))
        if axes is None and a.get("noop_with_empty_axes", 0) and ctx.opset >= 18:
            return [x]
        if x.size == 0:
            shape = [1 if (axes is None or i in axes) else d for i, d in enumerate(x.shape)]
            if not keep:
                shape = [d for i, d in enumerate(x.shape) if not (axes is None or i in axes)]
            return [np.full(shape, _identity(x.dtype, largest_identity), dtype=x.dtype)]
        return [np.asarray(ufunc.reduce(x, axis=axes, keepdims=keep)).astype(x.dtype)]
    return run


op("ReduceMin")(_reduce(np.minimum, True))
op("ReduceMax")(_reduce(np.maximum, False))
