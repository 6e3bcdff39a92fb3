"""Float normalisations and linear / cubic Resize, node by node, with ONNX semantics in numpy.

What detectors and segmenters export besides convolutions: an unfolded ``BatchNormalization``
(a stem BN whose conv is not its only producer), ``InstanceNormalization`` (torch exports
GroupNorm as InstanceNormalization -> Mul -> Add), and bilinear ``Resize`` (DeepLabV3, LRASPP,
FCN upsample their logits with ``F.interpolate(mode="bilinear")``).

Precision (the contract of ops_float, extended): each op is computed in float64 from the
float32 (or widened float16) inputs and rounded ONCE to the tensor type. onnxruntime computes in
float32 in its own order, so the two differ by an ulp now and then; after the next
QuantizeLinear that is a code flip on a near-tie only (<= 1 LSB, layer by layer).

Resize ``linear`` on any axes (bilinear on H, W), every ``coordinate_transformation_mode``
torch exports: ``half_pixel`` (align_corners=False, opset >= 11 export), ``pytorch_half_pixel``,
``align_corners`` (align_corners=True) and ``asymmetric``; the source coordinate is clamped to
``[0, n_in - 1]`` as the ONNX reference does. ``nearest`` stays with ops_nn's kernel.

Resize ``cubic`` (bicubic on H, W: ``F.interpolate(mode="bicubic")``), the same coordinate modes,
separable like linear: each output takes the four inputs ``floor(src) - 1 .. floor(src) + 2``
with the Keys kernel of ``cubic_coeff_a`` (default -0.75, torch's) at distances ``1 + t, t,
1 - t, 2 - t`` (``t = src - floor(src)``). The source coordinate is not clamped; taps beyond
the edge read the edge value (the ONNX reference pads by repeating it), or with
``exclude_outside=1`` get weight 0 and the others are renormalised to sum to 1.
"""
from __future__ import annotations

import numpy as np

from .errors import NPUError, UnsupportedNode
from . import ops_nn  # noqa: F401  (registers the nearest Resize this module extends)
from .ops_float import OPS, op
from .tensors import as_compute_type, is_float

_NEAREST = OPS.get("Resize")  # ops_nn's nearest Resize, registered before this module
_CONV, _CONV_T, _GEMM = OPS.get("Conv"), OPS.get("ConvTranspose"), OPS.get("Gemm")  # ops_nn's


def _f64(v):
    return None if v is None else np.asarray(v).astype(np.float64)


def _half_with_bias(original):
    """A float16 Conv / ConvTranspose (an FP16 region, export/SPEC.md §6): the bias is part of
    the float64 sum and the result is rounded ONCE to float16, ``y = f16(sum x*w + b)``, as an
    accumulator holding the bias does; other types: ops_nn's kernel (float32: the sum rounded
    to float32, then the bias added in float32, onnxruntime's order)."""
    def run(ctx, ins, a):
        if np.asarray(ins[0]).dtype != np.float16:
            return original(ctx, ins, a)
        s = original(ctx, [_f64(ins[0]), _f64(ins[1])], a)[0]  # float64 in: the float64 sum, unrounded
        b = ins[2] if len(ins) > 2 and ins[2] is not None else None
        if b is not None:
            s = s + _f64(b).reshape((1, -1) + (1,) * (s.ndim - 2))
        return [s.astype(np.float16)]
    return run


if _CONV is not None:
    op("Conv")(_half_with_bias(_CONV))
if _CONV_T is not None:
    op("ConvTranspose")(_half_with_bias(_CONV_T))


@op("Gemm")
def _gemm(ctx, ins, a):
    """Gemm. float16 (an FP16 region, export/SPEC.md §6): ``y = f16(alpha * A @ B + beta * C)``
    with the products, the sum and the bias term in float64, one rounding. Other types:
    ops_nn's Gemm."""
    x, w = ins[0], ins[1]
    if np.asarray(x).dtype != np.float16 or _GEMM is None:
        return _GEMM(ctx, ins, a)
    c = ins[2] if len(ins) > 2 else None
    if not (is_float(w) and x.ndim == 2 and w.ndim == 2):
        raise UnsupportedNode(ctx.node, [x.dtype, w.dtype], "Gemm needs 2-D float inputs")
    x = x.T if a.get("transA", 0) else x
    w = w.T if a.get("transB", 0) else w
    if x.shape[1] != w.shape[0]:
        raise NPUError(f"node {ctx.node.name!r}: Gemm shapes {x.shape} x {w.shape}")
    y = float(np.float32(a.get("alpha", 1.0))) * np.matmul(_f64(x), _f64(w))
    if c is not None:
        y = y + float(np.float32(a.get("beta", 1.0))) * _f64(c)
    return [y.astype(np.float16)]


def _text(v, default: str) -> str:
    v = default if v is None else v
    return v.decode() if isinstance(v, bytes) else str(v)


def _per_channel(v: np.ndarray, ndim: int) -> np.ndarray:
    return as_compute_type(v).astype(np.float64).reshape((1, -1) + (1,) * (ndim - 2))


@op("BatchNormalization")
def _batchnorm(ctx, ins, a):
    """Inference form: ``(x - mean) / sqrt(var + epsilon) * scale + B`` per channel (axis 1)."""
    x, scale, bias, mean, var = ins[:5]
    if not is_float(x):
        raise UnsupportedNode(ctx.node, [x.dtype], "expects a float tensor")
    if a.get("training_mode", 0):
        raise UnsupportedNode(ctx.node, [x.dtype], "training_mode=1 (export in eval mode)")
    eps = float(a.get("epsilon", 1e-5))
    x64 = as_compute_type(x).astype(np.float64)
    n = x.ndim
    y = (x64 - _per_channel(mean, n)) / np.sqrt(_per_channel(var, n) + eps) * _per_channel(scale, n) \
        + _per_channel(bias, n)
    return [y.astype(x.dtype)]


@op("InstanceNormalization")
def _instancenorm(ctx, ins, a):
    """``(x - mean) / sqrt(var + epsilon) * scale + B``, mean and (biased) variance over the
    spatial axes of each (sample, channel)."""
    x, scale, bias = ins[:3]
    if not is_float(x) or x.ndim < 3:
        raise UnsupportedNode(ctx.node, [x.dtype], "expects a float tensor (N, C, D1, ...)")
    eps = float(a.get("epsilon", 1e-5))
    axes = tuple(range(2, x.ndim))
    x64 = as_compute_type(x).astype(np.float64)
    mean = x64.mean(axis=axes, keepdims=True)
    var = ((x64 - mean) ** 2).mean(axis=axes, keepdims=True)
    y = (x64 - mean) / np.sqrt(var + eps) * _per_channel(scale, x.ndim) + _per_channel(bias, x.ndim)
    return [y.astype(x.dtype)]


def _source(o: np.ndarray, n_in: int, n_out: int, scale: float, ctm: str, node) -> np.ndarray:
    if ctm == "half_pixel":
        return (o + 0.5) / scale - 0.5
    if ctm == "pytorch_half_pixel":
        return (o + 0.5) / scale - 0.5 if n_out > 1 else o * 0.0
    if ctm == "align_corners":
        return o * (n_in - 1) / (n_out - 1) if n_out > 1 else o * 0.0
    if ctm == "asymmetric":
        return o / scale
    raise UnsupportedNode(node, [], f"Resize coordinate_transformation_mode {ctm!r}")


def _linear_axis(x: np.ndarray, ax: int, n_out: int, scale: float, ctm: str, node) -> np.ndarray:
    n_in = x.shape[ax]
    src = np.clip(_source(np.arange(n_out, dtype=np.float64), n_in, n_out, scale, ctm, node), 0, n_in - 1)
    lo = np.floor(src).astype(np.int64)
    hi = np.minimum(lo + 1, n_in - 1)
    w = (src - lo).reshape([-1 if i == ax else 1 for i in range(x.ndim)])
    return np.take(x, lo, axis=ax) * (1.0 - w) + np.take(x, hi, axis=ax) * w


def _keys(d: np.ndarray, A: float) -> np.ndarray:
    """The cubic convolution kernel (Keys 1981) at distances ``d`` in [0, 2]: ONNX Resize's cubic
    coefficients, ``(A+2)d^3 - (A+3)d^2 + 1`` for d <= 1, ``A d^3 - 5A d^2 + 8A d - 4A`` beyond."""
    near = ((A + 2) * d - (A + 3)) * d * d + 1
    far = ((A * d - 5 * A) * d + 8 * A) * d - 4 * A
    return np.where(d <= 1, near, far)


def _cubic_axis(x: np.ndarray, ax: int, n_out: int, scale: float, ctm: str, A: float, exclude: bool,
                node) -> np.ndarray:
    n_in = x.shape[ax]
    src = _source(np.arange(n_out, dtype=np.float64), n_in, n_out, scale, ctm, node)  # not clamped (module doc)
    base = np.floor(src)
    t = (src - base)[:, None]
    taps = base.astype(np.int64)[:, None] + np.arange(-1, 3)
    w = _keys(np.abs(np.array([1.0, 0.0, -1.0, -2.0]) + t), A)
    if exclude:
        w = np.where((taps < 0) | (taps >= n_in), 0.0, w)
        w = w / w.sum(axis=1, keepdims=True)
    taps = np.clip(taps, 0, n_in - 1)
    shape = [-1 if i == ax else 1 for i in range(x.ndim)]
    out = np.take(x, taps[:, 0], axis=ax) * w[:, 0].reshape(shape)
    for k in range(1, 4):
        out = out + np.take(x, taps[:, k], axis=ax) * w[:, k].reshape(shape)
    return out


def _sizes_scales(ctx, ins, x) -> tuple[list[int], list[float]]:
    scales = ins[2] if len(ins) > 2 and ins[2] is not None and ins[2].size else None
    sizes = ins[3] if len(ins) > 3 and ins[3] is not None and ins[3].size else None
    if sizes is not None:
        sizes = [int(v) for v in sizes]
        return sizes, [s / d if d else 0.0 for s, d in zip(sizes, x.shape)]  # d = 0: refused by the caller
    if scales is not None:
        scales = [float(v) for v in scales]
        return [int(np.floor(d * s)) for d, s in zip(x.shape, scales)], scales
    raise NPUError(f"node {ctx.node.name!r}: Resize needs scales or sizes")


@op("Resize")
def _resize(ctx, ins, a):
    """Linear and cubic (separable, float64, rounded once); nearest is ops_nn's kernel."""
    x = ins[0]
    mode = _text(a.get("mode"), "nearest")
    if mode == "nearest" and _NEAREST is not None:
        return _NEAREST(ctx, ins, a)
    if mode not in ("linear", "cubic"):
        raise UnsupportedNode(ctx.node, [x.dtype], f"Resize mode {mode!r} (nearest, linear and cubic only)")
    if ctx.opset < 11:
        raise UnsupportedNode(ctx.node, [x.dtype], f"{mode} Resize before opset 11")
    if not is_float(x):
        raise UnsupportedNode(ctx.node, [x.dtype], f"{mode} Resize expects a float tensor")
    if a.get("antialias", 0):
        raise UnsupportedNode(ctx.node, [x.dtype], "Resize antialias=1")
    ctm = _text(a.get("coordinate_transformation_mode"), "half_pixel")
    sizes, scales = _sizes_scales(ctx, ins, x)
    if len(sizes) != x.ndim or min(sizes) < 0 or np.prod(sizes) > 1 << 31:
        raise NPUError(f"node {ctx.node.name!r}: bad Resize output size {sizes}")
    if any(d == 0 and n > 0 for d, n in zip(x.shape, sizes)):
        raise NPUError(f"node {ctx.node.name!r}: Resize of an empty axis: input {list(x.shape)} to {sizes}")
    A, exclude = float(a.get("cubic_coeff_a", -0.75)), bool(a.get("exclude_outside", 0))
    out = as_compute_type(x).astype(np.float64)
    for ax, (n_out, sc) in enumerate(zip(sizes, scales)):
        if n_out == x.shape[ax] and sc == 1:
            continue
        out = _linear_axis(out, ax, n_out, sc, ctm, ctx.node) if mode == "linear" else \
            _cubic_axis(out, ax, n_out, sc, ctm, A, exclude, ctx.node)
    return [out.astype(x.dtype)]
