"""ReduceMin / ReduceMax (what DynamicQuantizeLinear's expanded form needs), ReduceSum
(ResNeSt's split attention sums its radix branches, ``x.sum(dim=1)``) and ReduceMean (timm's
``x.mean((2, 3))`` pooling, LayerNorm below opset 17), node by node; and CumSum, the running sum
(Hugging Face DETR-family sine position embeddings, ``pixel_mask.cumsum(1)``).

    y = min (max, sum, mean) of x over ``axes`` (all axes when none are given, unless
        noop_with_empty_axes=1, which returns x), keepdims as the attribute says

Min / max are exact for every type: a minimum is one of its inputs, so there is no rounding to
specify. NaN propagates (numpy's minimum/maximum). Over an empty set the result is the type's
identity element: +inf / -inf for floats, the largest / smallest integer, as ONNX's reference
gives. Axes come from the attribute before opset 18 and from the second input from opset 18 on
(ReduceSum: from opset 13 on).

ReduceSum of a float tensor follows export/SPEC.md §5a's reductions: the sum in float64 from the
float32 / float16 values, rounded ONCE to the input type, ``T(sum float64(x))`` (0 over an empty
set). Of an integer tensor: the exact sum, refused naming the node when it does not fit the type
(ONNX leaves integer overflow to the implementation; a silently wrapped sum is a wrong model).

ReduceMean (float tensors only) is one rounding too: ``T(sum float64(x) / float64(n))``, n the
count of reduced elements (``mean_once``, which GlobalAveragePool shares). Not ``T(T(sum) / n)``:
the second rounding moves the mean by an ulp of T near a tie, and a float16 sum overflows
(65504) long before the mean does.
"""
from __future__ import annotations

import numpy as np

from .errors import NPUError, UnsupportedNode
from .ops_float import op


def _axes(ctx, ins, a, ndim, input_from: int = 18):
    """The reduced axes (normalised, None: all), from the attribute below opset ``input_from``
    and from the second input from it on."""
    if ctx.opset < input_from:
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


@op("ReduceSum")
def _reduce_sum(ctx, ins, a):
    """``T(sum float64(x))`` over the axes for a float x (one rounding); the exact integer sum
    for an integer x, refused naming the node when it leaves x's type (module doc)."""
    x = np.asarray(ins[0])
    if x.dtype.kind not in "fiu":
        raise UnsupportedNode(ctx.node, [str(x.dtype)], "ReduceSum of this type (float or integer only)")
    axes = _axes(ctx, ins, a, x.ndim, input_from=13)
    keep = bool(a.get("keepdims", 1))
    if axes is None and a.get("noop_with_empty_axes", 0) and ctx.opset >= 13:
        return [x]
    if x.dtype.kind == "f":
        return [np.asarray(x.astype(np.float64).sum(axis=axes, keepdims=keep)).astype(x.dtype)]
    # 64-bit codes as Python ints: their exact sum may not fit any numpy integer
    s = np.asarray(x.astype(object if x.dtype.itemsize == 8 else np.int64).sum(axis=axes, keepdims=keep))
    info = np.iinfo(x.dtype)
    if s.size and (s.min() < info.min or s.max() > info.max):
        raise NPUError(f"node {ctx.node.name!r} (ReduceSum): the sum leaves {x.dtype} "
                       f"([{s.min()}, {s.max()}] outside [{info.min}, {info.max}])")
    return [s.astype(x.dtype)]


def mean_once(x: np.ndarray, axes, keepdims: bool) -> np.ndarray:
    """``T(sum_float64(x over axes) / float64(count))`` for a float x of type T, rounded ONCE to T
    (export/SPEC.md §5a; ReduceMean, GlobalAveragePool). ``axes`` None: all of them."""
    axes = tuple(range(x.ndim)) if axes is None else tuple(axes)
    n = int(np.prod([x.shape[i] for i in axes]))
    return np.asarray(x.astype(np.float64).sum(axis=axes, keepdims=keepdims) / np.float64(n)).astype(x.dtype)


@op("ReduceMean")
def _reduce_mean(ctx, ins, a):
    """``T(sum float64(x) / count)`` over the axes, one rounding (module doc)."""
    x = np.asarray(ins[0])
    if x.dtype.kind != "f":
        raise UnsupportedNode(ctx.node, [str(x.dtype)], "ReduceMean of a non-float tensor")
    axes = _axes(ctx, ins, a, x.ndim)
    if axes is None and a.get("noop_with_empty_axes", 0) and ctx.opset >= 18:
        return [x]
    return [mean_once(x, axes, bool(a.get("keepdims", 1)))]


@op("CumSum")
def _cumsum(ctx, ins, a):
    """ONNX CumSum along the scalar ``axis`` input (``exclusive``, ``reverse`` attributes): for a
    float x each output is ``T(running sum in float64)``, the float64 sum taken in order along the
    axis and rounded once per element (export/SPEC.md §5a); for an integer x the exact sum, refused
    naming the node when it leaves x's type."""
    x = np.asarray(ins[0])
    if x.dtype.kind not in "fiu":
        raise UnsupportedNode(ctx.node, [str(x.dtype)], "CumSum of this type (float or integer only)")
    axis = np.asarray(ins[1]).reshape(-1)
    if axis.size != 1 or axis.dtype.kind not in "iu" or not -x.ndim <= int(axis[0]) < max(x.ndim, 1):
        raise NPUError(f"node {ctx.node.name!r} (CumSum): axis {axis.tolist()} is not one axis of a rank-{x.ndim} input")
    ax = int(axis[0]) % max(x.ndim, 1)
    wide = x.astype(np.float64 if x.dtype.kind == "f" else object if x.dtype.itemsize == 8 else np.int64)
    if a.get("reverse", 0):
        wide = np.flip(wide, ax)
    s = np.cumsum(wide, axis=ax)
    if a.get("exclusive", 0) and s.shape[ax]:  # the sum of the elements before each one: shift by one, 0 first
        s = np.concatenate([np.zeros_like(np.take(s, [0], axis=ax)), np.delete(s, -1, axis=ax)], axis=ax)
    if a.get("reverse", 0):
        s = np.flip(s, ax)
    if x.dtype.kind != "f" and s.size:
        info = np.iinfo(x.dtype)
        if s.min() < info.min or s.max() > info.max:
            raise NPUError(f"node {ctx.node.name!r} (CumSum): the sum leaves {x.dtype} "
                           f"([{s.min()}, {s.max()}] outside [{info.min}, {info.max}])")
    return [np.ascontiguousarray(s).astype(x.dtype)]
