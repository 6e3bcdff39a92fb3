"""Fold what torch's constant folding leaves behind (it does not fold Round, Max, Min, ...).

The int32 fake quantization of a bias, ``clamp(round(b / s), lo, hi) * s``, is computed from
parameters only, yet torch stops at ``Round`` and leaves a small float subgraph in front of
every Conv. Evaluating it here with numpy (float32 elementwise arithmetic is IEEE-exact and
``np.rint`` rounds half to even like ``torch.round``) turns it into the single constant the
bias pass expects. The same pass folds the int64 shape arithmetic Hugging Face models compute
from buffers only (ConstantOfShape, Equal, Where, Expand, GatherElements: exact data movement
and comparison), so that no int64 compare node reaches the chip's graph. Only the operators
below are folded; anything else stays in the graph.
"""
from __future__ import annotations

import numpy as np
from onnx import helper, numpy_helper

from .graph import Graph


def _attr(node, name, default=None):
    for a in node.attribute:
        if a.name == name:
            return helper.get_attribute_value(a)
    return default


def _cast(node, x):
    return x.astype(helper.tensor_dtype_to_np_dtype(_attr(node, "to")))


def _clip(node, x, lo=None, hi=None):
    if lo is not None and np.asarray(lo).size:
        x = np.maximum(x, lo.astype(x.dtype))
    if hi is not None and np.asarray(hi).size:
        x = np.minimum(x, hi.astype(x.dtype))
    return x


def _reshape(node, x, shape):
    shape = [x.shape[k] if s == 0 and not _attr(node, "allowzero", 0) else int(s) for k, s in enumerate(shape)]
    return x.reshape(shape)


def _unsqueeze(node, x, axes=None):
    axes = sorted(int(a) % (x.ndim + len(axes)) for a in (axes if axes is not None else _attr(node, "axes")))
    for a in axes:
        x = np.expand_dims(x, a)
    return x


def _squeeze(node, x, axes=None):
    axes = axes if axes is not None else _attr(node, "axes")
    return np.squeeze(x, axis=tuple(int(a) for a in axes)) if axes is not None else np.squeeze(x)


def _constant_of_shape(node, shape):
    value = _attr(node, "value")
    fill = np.zeros(1, np.float32) if value is None else numpy_helper.to_array(value).reshape(1)
    return np.full(tuple(int(d) for d in shape), fill[0], dtype=fill.dtype)


def _expand(node, x, shape):
    # ONNX Expand broadcasts both ways: the result has the broadcast of x's shape and `shape`.
    return np.broadcast_to(x, np.broadcast_shapes(x.shape, tuple(int(d) for d in shape))).copy()


def _gather_elements(node, x, index):
    axis = _attr(node, "axis", 0)
    index = np.where(index < 0, index + x.shape[axis], index)
    return np.take_along_axis(x, index, axis=axis)


def _same_dtype(fn):
    def run(node, *xs):
        out = fn(*xs)
        return np.asarray(out, dtype=xs[0].dtype)
    return run


_OPS = {
    "Round": _same_dtype(np.rint),
    "Floor": _same_dtype(np.floor),
    "Ceil": _same_dtype(np.ceil),
    "Neg": _same_dtype(np.negative),
    "Abs": _same_dtype(np.abs),
    "Sqrt": _same_dtype(np.sqrt),
    "Reciprocal": _same_dtype(np.reciprocal),
    "Add": _same_dtype(np.add),
    "Sub": _same_dtype(np.subtract),
    "Mul": _same_dtype(np.multiply),
    "Div": _same_dtype(lambda a, b: np.true_divide(a, b) if a.dtype.kind == "f" else np.trunc(a / b)),
    "Max": _same_dtype(lambda *xs: np.maximum.reduce(np.broadcast_arrays(*xs))),
    "Min": _same_dtype(lambda *xs: np.minimum.reduce(np.broadcast_arrays(*xs))),
    "Identity": lambda node, x: x,
    "Cast": _cast,
    "Clip": _clip,
    "Reshape": _reshape,
    "Unsqueeze": _unsqueeze,
    "Squeeze": _squeeze,
    # Shape arithmetic Hugging Face models leave on constants (BERT's buffered token_type_ids:
    # ConstantOfShape -> Equal -> Where -> Expand -> GatherElements); exact data movement.
    "ConstantOfShape": _constant_of_shape,
    "Equal": lambda node, a, b: np.equal(a, b),
    "Where": lambda node, c, a, b: np.where(c, a, b),
    "Expand": _expand,
    "GatherElements": _gather_elements,
}


def fold_constants(graph: Graph) -> None:
    """Replace every foldable node whose inputs are all constants by an initializer."""
    producers = graph.producers()
    known: dict[str, np.ndarray] = {}

    def value(name):
        if name not in known:
            v = graph.const(name, producers)
            if v is not None:
                known[name] = v
        return known.get(name)

    kept = []
    for node in graph.nodes:
        fn = _OPS.get(node.op_type)
        if fn is None or node.domain not in ("", "ai.onnx") or len(node.output) != 1:
            kept.append(node)
            continue
        args = [value(i) if i else None for i in node.input]
        if any(a is None for a, i in zip(args, node.input) if i):
            kept.append(node)
            continue
        with np.errstate(all="ignore"):
            out = np.asarray(fn(node, *args))
        name = node.output[0]
        known[name] = out
        if name in graph.outputs:
            kept.append(node)
            continue
        graph.inits[name] = _tensor(out, name)
    graph.nodes = kept


def _tensor(array, name):
    return numpy_helper.from_array(np.ascontiguousarray(array), name)
