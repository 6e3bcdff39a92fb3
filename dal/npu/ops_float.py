"""Float and data-movement ops, node by node, with ONNX semantics in numpy (and torch float64).

Float precision contract (export/SPEC.md §5a "float islands" and §6 "FP16 regions", written
once there; dal.convert implements the same rules independently). Each node rounds ONCE to its
output type (float32, or float16 inside an FP16 region):
  * elementwise arithmetic (Add, Sub, Mul, Div, Max, Min, Relu, Clip, ...): one IEEE operation
    in the tensor type (float16 is computed in float32 and rounded once: float32 has at least
    2 * 11 + 2 bits, so that is the correctly rounded float16 result, as numpy's float16 loops);
  * reductions (Conv, Gemm, MatMul, ReduceSum, and the means: ReduceMean, GlobalAveragePool,
    AveragePool) are accumulated in float64 (a mean divided by its count in float64) and rounded
    ONCE to the tensor type: the correctly rounded result up to float64 rounding, independent of
    summation order. A float32 bias (Conv B, Gemm C) is then added in float32,
    as onnxruntime does; a float16 one is part of the float64 sum, rounded once with it
    (ops_dense.py, export/SPEC.md §6);
  * Sigmoid, Tanh, Erf, Gelu, Elu, Softplus, Mish: computed in float64 from the input and
    rounded once; Sqrt is numpy's IEEE square root, correctly rounded (SPEC §5a); Exp, Log and
    Softmax use numpy's float32 routines (they may differ from onnxruntime by an ulp).
"""
from __future__ import annotations

import math

import numpy as np

from .errors import NPUError, UnsupportedNode
from .tensors import as_compute_type, is_float

OPS: dict = {}


def op(*names):
    def deco(fn):
        for n in names:
            OPS[n] = fn
        return fn
    return deco


def _like(r, x):
    return np.asarray(r).astype(x.dtype) if is_float(x) else np.asarray(r)


def _unary(fn):
    def run(ctx, ins, a):
        x = ins[0]
        if not is_float(x):
            raise UnsupportedNode(ctx.node, [x.dtype], "expects a float tensor")
        return [_like(fn(as_compute_type(x), a), x)]
    return run


_erf = np.vectorize(math.erf, otypes=[np.float64])

# The largest argument whose exp is finite, per type (exp of the next float up overflows; both
# are ~1e-6 relative inside the range, far from any implementation's rounding error).
_EXP_MAX = {np.dtype(np.float32): np.nextafter(np.float32(np.log(np.finfo(np.float32).max)), np.float32(0)),
            np.dtype(np.float64): np.log(np.finfo(np.float64).max)}


def _exp(x: np.ndarray) -> np.ndarray:
    """``np.exp(x)`` bit for bit, +inf above ``_EXP_MAX`` as np.exp gives, but computed without
    overflowing (np.exp would print ``RuntimeWarning: overflow encountered in exp``)."""
    limit = _EXP_MAX.get(np.asarray(x).dtype)
    big = x > limit if limit is not None else False
    if not np.any(big):
        return np.exp(x)
    return np.where(big, np.inf, np.exp(np.where(big, 0, x))).astype(x.dtype)


op("Relu")(_unary(lambda x, a: np.maximum(x, x.dtype.type(0))))
# 1 / (1 + exp(-x)) in float64; exp(-x) = +inf (far left tail) gives exactly 0, as before.
op("Sigmoid")(_unary(lambda x, a: (1.0 / (1.0 + _exp(-x.astype(np.float64))))))
op("Tanh")(_unary(lambda x, a: np.tanh(x.astype(np.float64))))  # float64, rounded once
op("Exp")(_unary(lambda x, a: _exp(x)))
op("Log")(_unary(lambda x, a: np.log(x)))
op("Sqrt")(_unary(lambda x, a: np.sqrt(x)))
op("Neg")(_unary(lambda x, a: -x))
op("Abs")(_unary(lambda x, a: np.abs(x)))
op("Reciprocal")(_unary(lambda x, a: x.dtype.type(1) / x))
op("Erf")(_unary(lambda x, a: _erf(x.astype(np.float64))))
op("LeakyRelu")(_unary(lambda x, a: np.where(x >= 0, x, x * np.float32(a.get("alpha", 0.01)))))
op("HardSigmoid")(_unary(lambda x, a: np.clip(x * np.float32(a.get("alpha", 0.2)) + np.float32(a.get("beta", 0.5)), 0, 1)))
op("HardSwish")(_unary(lambda x, a: x * np.clip(x * np.float32(1 / 6) + np.float32(0.5), 0, 1)))
# float64, rounded once: elu = alpha*(exp(x)-1) for x < 0; softplus = log(1+exp(x)) (log1p,
# large x taken as x); mish = x * tanh(softplus(x))
op("Elu")(_unary(lambda x, a: np.where(x >= 0, x.astype(np.float64),
                                       float(a.get("alpha", 1.0)) * np.expm1(np.minimum(x.astype(np.float64), 0)))))
op("Softplus")(_unary(lambda x, a: np.logaddexp(0.0, x.astype(np.float64))))
op("Mish")(_unary(lambda x, a: x.astype(np.float64) * np.tanh(np.logaddexp(0.0, x.astype(np.float64)))))


@op("Gelu")
def _gelu(ctx, ins, a):
    x = ins[0]
    x64 = as_compute_type(x).astype(np.float64)
    if a.get("approximate", "none") == "tanh":
        # 0.5 x (1 + tanh(u)) == x / (1 + exp(-2u)) (export/SPEC.md §5a): no cancellation in
        # 1 + tanh(u) where tanh(u) ~ -1 (there two float64 tanh routines differ relatively a lot),
        # and x^3 as two float64 products, not pow()
        u = math.sqrt(2 / math.pi) * (x64 + 0.044715 * (x64 * x64 * x64))
        with np.errstate(over="ignore"):
            r = x64 / (1 + np.exp(-2 * u))
    else:
        r = 0.5 * x64 * (1 + _erf(x64 / math.sqrt(2)))
    return [r.astype(x.dtype)]


@op("Identity")
def _identity(ctx, ins, a):
    return [ins[0]]


@op("Dropout")
def _dropout(ctx, ins, a):
    """ONNX Dropout in inference: ``training_mode`` absent or false gives the input unchanged and
    an all-true mask (the ratio is ignored); torch exports it so from an eval-mode
    ``F.dropout(x, p, training=self.training)`` (timm's GhostNet). Training mode is random: refused."""
    training = ins[2] if len(ins) > 2 and ins[2] is not None else False  # an input from opset 12 on
    if np.any(np.asarray(training)):
        raise UnsupportedNode(ctx.node, [np.asarray(i).dtype for i in ins if i is not None],
                              "training_mode is true: a random mask has no fixed result")
    outs = [ins[0]]
    if len(ctx.node.output) > 1 and ctx.node.output[1]:
        outs.append(np.ones(np.shape(ins[0]), dtype=bool))
    return outs


def _binary(fn):
    def run(ctx, ins, a):
        x, y = ins
        if x.dtype != y.dtype:
            raise UnsupportedNode(ctx.node, [x.dtype, y.dtype], "input types differ")
        if is_float(x):
            return [fn(as_compute_type(x), as_compute_type(y)).astype(x.dtype)]
        return [fn(x, y).astype(x.dtype)]
    return run


op("Add")(_binary(np.add))
op("Sub")(_binary(np.subtract))
op("Mul")(_binary(np.multiply))
op("Max")(_binary(np.maximum))
op("Min")(_binary(np.minimum))


@op("Div")
def _div(ctx, ins, a):
    x, y = ins
    if is_float(x):
        return [(as_compute_type(x) / as_compute_type(y)).astype(x.dtype)]
    if np.any(y == 0):
        raise NPUError(f"node {ctx.node.name!r}: integer division by zero")
    return [np.trunc(x / y).astype(x.dtype)]


@op("Pow")
def _pow(ctx, ins, a):
    x, y = ins
    exponent = as_compute_type(y).astype(np.float32) if is_float(y) else y
    return [np.power(as_compute_type(x), exponent).astype(x.dtype)]


@op("Clip")
def _clip(ctx, ins, a):
    x = ins[0]
    lo = ins[1] if len(ins) > 1 and ins[1] is not None else a.get("min")
    hi = ins[2] if len(ins) > 2 and ins[2] is not None else a.get("max")
    r = x
    if lo is not None:
        r = np.maximum(r, np.asarray(lo).astype(x.dtype))
    if hi is not None:
        r = np.minimum(r, np.asarray(hi).astype(x.dtype))
    return [r.astype(x.dtype)]


@op("Softmax")
def _softmax(ctx, ins, a):
    x = ins[0]
    axis = a.get("axis", -1 if ctx.opset >= 13 else 1)
    if ctx.opset < 13:
        raise UnsupportedNode(ctx.node, [x.dtype], "Softmax before opset 13 (2-D coercion)")
    x32 = as_compute_type(x)
    e = np.exp(x32 - x32.max(axis=axis, keepdims=True))
    return [(e / e.sum(axis=axis, keepdims=True, dtype=np.float64).astype(x32.dtype)).astype(x.dtype)]


@op("LayerNormalization")
def _layernorm(ctx, ins, a):
    x, scale = ins[0], ins[1]
    bias = ins[2] if len(ins) > 2 else None
    axis = a.get("axis", -1)
    axis = axis % x.ndim
    axes = tuple(range(axis, x.ndim))
    x64 = as_compute_type(x).astype(np.float64)
    mean = x64.mean(axis=axes, keepdims=True)
    var = ((x64 - mean) ** 2).mean(axis=axes, keepdims=True)
    y = (x64 - mean) / np.sqrt(var + a.get("epsilon", 1e-5))
    y = y.astype(np.float32) * as_compute_type(scale)
    if bias is not None:
        y = y + as_compute_type(bias)
    return [y.astype(x.dtype)]


# ----- data movement --------------------------------------------------------------------------

@op("Reshape")
def _reshape(ctx, ins, a):
    x, shape = ins
    shape = [int(v) for v in shape]
    if not a.get("allowzero", 0):
        shape = [x.shape[i] if v == 0 else v for i, v in enumerate(shape)]
    if sum(v == -1 for v in shape) > 1 or any(v < -1 for v in shape):
        raise NPUError(f"node {ctx.node.name!r}: bad Reshape target {shape}")
    try:
        return [x.reshape(shape)]
    except ValueError as e:
        raise NPUError(f"node {ctx.node.name!r}: cannot reshape {x.shape} to {shape}: {e}") from None


@op("Flatten")
def _flatten(ctx, ins, a):
    x = ins[0]
    ax = a.get("axis", 1) % (x.ndim + 1) if x.ndim else 0
    return [x.reshape(int(np.prod(x.shape[:ax])), -1)]


@op("Transpose")
def _transpose(ctx, ins, a):
    perm = a.get("perm")
    return [np.ascontiguousarray(np.transpose(ins[0], perm))]


def _axes(ctx, ins, a):
    if ctx.opset >= 13 and len(ins) > 1 and ins[1] is not None:
        return [int(v) for v in ins[1]]
    return a.get("axes")


@op("Squeeze")
def _squeeze(ctx, ins, a):
    axes = _axes(ctx, ins, a)
    return [np.squeeze(ins[0], axis=tuple(axes) if axes else None)]


@op("Unsqueeze")
def _unsqueeze(ctx, ins, a):
    x = ins[0]
    axes = sorted(v % (x.ndim + len(_axes(ctx, ins, a))) for v in _axes(ctx, ins, a))
    for ax in axes:
        x = np.expand_dims(x, ax)
    return [x]


@op("Concat")
def _concat(ctx, ins, a):
    if len({x.dtype for x in ins}) != 1:
        raise UnsupportedNode(ctx.node, [x.dtype for x in ins], "Concat of mixed types")
    return [np.concatenate(ins, axis=a.get("axis", 0))]


@op("Split")
def _split(ctx, ins, a):
    """ONNX Split along ``axis``: the sizes from the second input (opset >= 13) or the ``split``
    attribute (< 13); without them ``num_outputs`` (opset 18) or the node's output count parts,
    each ``ceil(n / parts)`` long and the last one what remains. Data movement: exact."""
    x = ins[0]
    axis = int(a.get("axis", 0))
    if not -x.ndim <= axis < x.ndim:
        raise NPUError(f"node {ctx.node.name!r}: Split axis {axis} of a rank-{x.ndim} tensor")
    axis %= x.ndim
    n, k = x.shape[axis], len(ctx.node.output)
    sizes = ins[1] if len(ins) > 1 and ins[1] is not None and np.asarray(ins[1]).size else a.get("split")
    if sizes is None:
        parts = int(a.get("num_outputs", k))
        step = -(-n // max(parts, 1))
        sizes = [step] * (parts - 1) + [n - step * (parts - 1)]
    sizes = [int(v) for v in np.asarray(sizes).reshape(-1)]
    if len(sizes) != k or min(sizes, default=0) < 0 or sum(sizes) != n:
        raise NPUError(f"node {ctx.node.name!r}: Split of {n} along axis {axis} into {sizes} for {k} outputs")
    bounds = np.cumsum([0] + sizes)
    return [np.take(x, np.arange(b, e), axis=axis) for b, e in zip(bounds[:-1], bounds[1:])]


@op("Shape")
def _shape(ctx, ins, a):
    s = np.array(ins[0].shape, dtype=np.int64)
    return [s[a.get("start", 0):a.get("end", None)]]


@op("Slice")
def _slice(ctx, ins, a):
    x, starts, ends = ins[0], ins[1], ins[2]
    axes = ins[3] if len(ins) > 3 and ins[3] is not None else range(len(starts))
    steps = ins[4] if len(ins) > 4 and ins[4] is not None else [1] * len(starts)
    sl = [slice(None)] * x.ndim
    for s, e, ax, st in zip(starts, ends, axes, steps):
        sl[int(ax)] = slice(int(s), int(e), int(st))
    return [x[tuple(sl)]]


@op("Cast")
def _cast(ctx, ins, a):
    from .tensors import np_dtype
    to = np_dtype(a["to"], ctx.node)
    x = ins[0]
    if a.get("saturate", 1) and to in _float8():
        import ml_dtypes
        fmax = np.float32(ml_dtypes.finfo(to).max)
        x = as_compute_type(x).astype(np.float32)
        x = np.where(np.isnan(x), x, np.clip(x, -fmax, fmax))
    elif {x.dtype, to} == _HALF_PAIR and x.size >= 4096:
        return [_torch_cast(x, to)]
    with np.errstate(over="ignore"):  # IEEE: a finite value past the type's range becomes +-inf, as ONNX Cast says
        return [x.astype(to)]


#: float32 <-> float16, the Casts of every FP16 island and region
_HALF_PAIR = {np.dtype(np.float32), np.dtype(np.float16)}


def _torch_cast(x: np.ndarray, to) -> np.ndarray:
    """``x.astype(to)`` for float32 <-> float16 through torch's vectorised (F16C) conversion,
    2.5-4x numpy's here. Measured identical to numpy's cast on all 2^32 float32 bit patterns
    and all 65,536 float16 ones, NaN payloads aside (NaN stays NaN; IEEE round to nearest even,
    overflow to inf)."""
    import torch
    return torch.from_numpy(np.ascontiguousarray(x)).to(torch.float16 if to == np.float16 else torch.float32).numpy()


def _float8():
    from .quant import FLOAT8
    return FLOAT8


# ---- shape arithmetic (int64 tensors the exporter leaves for dynamic shapes) -----------------
@op("ConstantOfShape")
def _constant_of_shape(ctx, ins, a):
    from onnx import numpy_helper

    value = a.get("value")
    fill = numpy_helper.to_array(value).reshape(-1)[0] if value is not None else np.float32(0)
    return [np.full(tuple(int(d) for d in np.asarray(ins[0]).reshape(-1)), fill, dtype=np.asarray(fill).dtype)]


@op("Mod")
def _mod(ctx, ins, a):
    x, y = ins
    if a.get("fmod", 0):
        return [np.fmod(x, y).astype(x.dtype)]
    if is_float(x):
        raise UnsupportedNode(ctx.node, [x.dtype], "float Mod needs fmod=1 (ONNX)")
    return [np.mod(x, y).astype(x.dtype)]  # integer Mod: sign of the divisor, as numpy's


@op("Equal")
def _equal(ctx, ins, a):
    return [np.equal(ins[0], ins[1])]


@op("Less")
def _less(ctx, ins, a):
    return [np.less(ins[0], ins[1])]


@op("Greater")
def _greater(ctx, ins, a):
    return [np.greater(ins[0], ins[1])]


@op("Not")
def _not(ctx, ins, a):
    return [np.logical_not(ins[0])]


@op("And")
def _and(ctx, ins, a):
    return [np.logical_and(ins[0], ins[1])]


@op("Where")
def _where(ctx, ins, a):
    cond, x, y = ins
    return [np.where(cond, x, y).astype(np.result_type(x, y))]


@op("Expand")
def _expand(ctx, ins, a):
    x, shape = ins[0], tuple(int(d) for d in np.asarray(ins[1]).reshape(-1))
    return [x * np.ones(shape, dtype=x.dtype) if x.dtype != np.bool_ else np.broadcast_to(x, np.broadcast_shapes(x.shape, shape)).copy()]


@op("Range")
def _range(ctx, ins, a):
    start, limit, delta = (np.asarray(t).reshape(()) for t in ins)
    return [np.arange(start, limit, delta, dtype=start.dtype)]


@op("Tile")
def _tile(ctx, ins, a):
    return [np.tile(ins[0], tuple(int(r) for r in np.asarray(ins[1]).reshape(-1)))]


@op("Pad")
def _pad(ctx, ins, a):
    """ONNX Pad (opset >= 11: pads as an input; begin values then end values, per axis)."""
    x = ins[0]
    pads = [int(p) for p in np.asarray(ins[1]).reshape(-1)]
    value = ins[2] if len(ins) > 2 and ins[2] is not None else None
    axes = ins[3] if len(ins) > 3 and ins[3] is not None else None
    axes = [int(ax) % x.ndim for ax in np.asarray(axes).reshape(-1)] if axes is not None else list(range(x.ndim))
    if len(pads) != 2 * len(axes):
        raise UnsupportedNode(ctx.node, [x.dtype], f"pads has {len(pads)} values for {len(axes)} axes")
    width = [(0, 0)] * x.ndim
    for i, ax in enumerate(axes):
        width[ax] = (pads[i], pads[i + len(axes)])
    if any(b < 0 or e < 0 for b, e in width):
        # Negative pads crop.
        sl = tuple(slice(-b if b < 0 else None, e if e < 0 else None) for b, e in width)
        x = x[sl]
        width = [(max(b, 0), max(e, 0)) for b, e in width]
    mode = a.get("mode", "constant")
    if mode == "constant":
        fill = np.asarray(value).reshape(-1)[0] if value is not None and np.asarray(value).size else 0
        return [np.pad(x, width, mode="constant", constant_values=fill)]
    if mode in ("reflect", "edge"):
        return [np.pad(x, width, mode=mode)]
    raise UnsupportedNode(ctx.node, [x.dtype], f"Pad mode {mode!r}")
