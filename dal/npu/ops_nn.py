"""Float Conv / Gemm / MatMul / pooling / Resize (see ops_float for the precision contract).

Float convolutions and matrix products are accumulated in float64 (torch) from the float32 or
float16 inputs and rounded once; this is what the "onnx" semantics of the reference runs for
every DQ -> Conv -> Q group, and what any op on float tensors uses.
"""
from __future__ import annotations

import numpy as np

from .validate import check_group
from .errors import NPUError, UnsupportedNode
from .ops_float import op
from .ops_reduce import mean_once
from .tensors import as_compute_type, is_float


def conv_attrs(ctx, x_shape, w_shape, a):
    """(strides, dilations, pads[t, l, b, r], group) of a 2-D Conv, auto_pad resolved."""
    nd = len(w_shape) - 2
    if nd not in (1, 2):
        raise UnsupportedNode(ctx.node, [], f"{nd}-D convolution")
    ks = a.get("kernel_shape") or list(w_shape[2:])
    if list(ks) != list(w_shape[2:]):
        raise NPUError(f"node {ctx.node.name!r}: kernel_shape {ks} != weight {list(w_shape[2:])}")
    strides = list(a.get("strides") or [1] * nd)
    dil = list(a.get("dilations") or [1] * nd)
    pads = list(a.get("pads") or [0] * (2 * nd))
    group = a.get("group", 1)
    check_group(ctx.node, group, x_shape[1] if x_shape is not None and len(x_shape) > 1 else None, w_shape)
    if max(strides + dil, default=1) > 1 << 16 or max(pads, default=0) > 1 << 16:
        raise NPUError(f"node {ctx.node.name!r}: strides {strides}, dilations {dil} and pads {pads} "
                       "must be at most 65536")
    if len(strides) != nd or len(dil) != nd or len(pads) != 2 * nd:
        raise NPUError(f"node {ctx.node.name!r}: strides/dilations/pads have wrong length")
    if min(strides) < 1 or min(dil) < 1 or min(pads) < 0:
        raise NPUError(f"node {ctx.node.name!r}: strides {strides}, dilations {dil} must be >= 1 "
                       f"and pads {pads} >= 0")
    ap = a.get("auto_pad", "NOTSET")
    if isinstance(ap, bytes):
        ap = ap.decode()
    if ap in ("SAME_UPPER", "SAME_LOWER"):
        pads = [0] * (2 * nd)
        for i in range(nd):
            size = x_shape[2 + i]
            out = -(-size // strides[i])
            total = max(0, (out - 1) * strides[i] + dil[i] * (ks[i] - 1) + 1 - size)
            lo = total // 2 if ap == "SAME_UPPER" else total - total // 2
            pads[i], pads[i + nd] = lo, total - lo
    elif ap == "VALID":
        pads = [0] * (2 * nd)
    elif ap != "NOTSET":
        raise NPUError(f"node {ctx.node.name!r}: unknown auto_pad {ap!r}")
    if nd == 1:  # treat as H = 1
        strides, dil, pads = [1] + strides, [1] + dil, [0, pads[0], 0, pads[1]]
    return strides, dil, pads, group


def float_conv(x, w, strides, dil, pads, group, who):
    """float64-accumulated conv2d of float tensors x [N,C,H,W], w [O,C/g,kh,kw] (no bias)."""
    import torch
    from .kernels import check_conv_attrs
    check_conv_attrs(x.shape, w.shape, strides, dil, pads, group, who)
    xt = torch.from_numpy(np.ascontiguousarray(x, dtype=np.float64))
    xt = torch.nn.functional.pad(xt, (pads[1], pads[3], pads[0], pads[2]))
    wt = torch.from_numpy(np.ascontiguousarray(w, dtype=np.float64))
    return torch.nn.functional.conv2d(xt, wt, None, tuple(strides), 0, tuple(dil), group).numpy()


@op("Conv")
def _conv(ctx, ins, a):
    x, w = ins[0], ins[1]
    b = ins[2] if len(ins) > 2 else None
    if not (is_float(x) and is_float(w)):
        raise UnsupportedNode(ctx.node, [x.dtype, w.dtype], "Conv needs float inputs")
    strides, dil, pads, group = conv_attrs(ctx, x.shape, w.shape, a)
    one_d = w.ndim == 3
    if one_d:
        x, w = x[:, :, None], w[:, :, None]
    y = _add_bias(float_conv(x, w, strides, dil, pads, group, repr(ctx.node.name)), b, x.dtype)
    return [y[:, :, 0] if one_d else y]


def _add_bias(y64, b, dtype):
    """The float64 sum rounded once to the input's type, then the bias added in the compute
    type (float32): onnxruntime's order for float32. (A float16 Conv / ConvTranspose does not
    come here: ops_dense.py registers its single-rounding form over these, export/SPEC.md §6.)"""
    y = y64.astype(dtype)
    if b is None:
        return y
    return (as_compute_type(y) + as_compute_type(b).reshape(1, -1, 1, 1)).astype(dtype)


def float_matmul(x, y):
    return np.matmul(np.asarray(x, np.float64), np.asarray(y, np.float64))


@op("MatMul")
def _matmul(ctx, ins, a):
    x, y = ins
    if not (is_float(x) and is_float(y)):
        raise UnsupportedNode(ctx.node, [x.dtype, y.dtype], "MatMul needs float inputs")
    try:
        return [float_matmul(x, y).astype(x.dtype)]
    except ValueError as e:
        raise NPUError(f"node {ctx.node.name!r}: MatMul shapes {x.shape} x {y.shape}: {e}") from None


@op("Gemm")
def _gemm(ctx, ins, a):
    x, w = ins[0], ins[1]
    c = ins[2] if len(ins) > 2 else None
    if not (is_float(x) and is_float(w)) or x.ndim != 2 or w.ndim != 2:
        raise UnsupportedNode(ctx.node, [x.dtype, w.dtype], "Gemm needs 2-D float inputs")
    if a.get("transA", 0):
        x = x.T
    if a.get("transB", 0):
        w = w.T
    if x.shape[1] != w.shape[0]:
        raise NPUError(f"node {ctx.node.name!r}: Gemm shapes {x.shape} x {w.shape}")
    alpha, beta = np.float32(a.get("alpha", 1.0)), np.float32(a.get("beta", 1.0))
    y = float_matmul(x, w).astype(np.float32)
    if alpha != 1:
        y = y * alpha
    if c is not None:
        y = y + (beta * as_compute_type(c) if beta != 1 else as_compute_type(c))
    return [y.astype(x.dtype)]


def pool_attrs(ctx, x, a):
    """(kernel, strides, dilations, pads[t, l, b, r], ceil_mode) of a 2-D MaxPool / AveragePool,
    checked; shared by the float ops here and the code-domain MaxPool of fused_codes."""
    ks = list(a.get("kernel_shape") or [])
    nd = len(ks)
    if nd != 2 or x.ndim != 4:
        raise UnsupportedNode(ctx.node, [x.dtype], f"only 2-D pooling (kernel {ks}, input rank {x.ndim})")
    strides = list(a.get("strides") or [1, 1])
    dil = list(a.get("dilations") or [1, 1])
    pads = list(a.get("pads") or [0, 0, 0, 0])
    if a.get("auto_pad", "NOTSET") not in ("NOTSET", b"NOTSET", "VALID", b"VALID"):
        raise UnsupportedNode(ctx.node, [x.dtype], "auto_pad SAME for pooling")
    if min(ks) < 1 or min(strides) < 1 or min(dil) < 1 or min(pads) < 0 or max(pads) >= max(ks) * max(dil) + 1:
        raise NPUError(f"node {ctx.node.name!r}: bad pooling attributes kernel {ks} strides "
                       f"{strides} dilations {dil} pads {pads}")
    return ks, strides, dil, pads, bool(a.get("ceil_mode", 0))


@op("MaxPool")
def _maxpool(ctx, ins, a):
    import torch
    x = ins[0]
    if len(ctx.node.output) > 1 and ctx.node.output[1]:
        raise UnsupportedNode(ctx.node, [x.dtype], "MaxPool Indices output")
    ks, st, dil, pads, ceil = pool_attrs(ctx, x, a)
    # max is exact in any type that holds every input: float32 for float16/32 (2x faster than
    # float64 here), float64 for 8/16/32-bit integers
    wide = np.float32 if x.dtype in (np.float16, np.float32) else np.float64
    xt = torch.from_numpy(np.ascontiguousarray(x, dtype=wide))
    xt = torch.nn.functional.pad(xt, (pads[1], pads[3], pads[0], pads[2]), value=-np.inf)
    y = torch.nn.functional.max_pool2d(xt, ks, st, 0, dil, ceil_mode=ceil)
    return [y.numpy().astype(x.dtype)]


def pool_out_size(n: int, k: int, s: int, pb: int, pe: int, ceil: bool) -> int:
    """ONNX's pooled length: ``floor((n + pb + pe - k) / s) + 1``; ceil_mode rounds up instead,
    and then drops a last window that would start in the end padding (or beyond)."""
    span = n + pb + pe - k
    out = (-(-span // s) if ceil else span // s) + 1
    if ceil and (out - 1) * s >= n + pb:
        out -= 1
    return out


@op("AveragePool")
def _avgpool(ctx, ins, a):
    """Window sums in float64 divided by the window's count in float64, rounded once to the type
    (export/SPEC.md §5a): with count_include_pad=0 the input elements in the window;
    with 1 its elements inside the padded input, ``kernel_shape`` but where ceil_mode lets the
    last window run past the end padding (that overhang is not counted: onnxruntime's and
    torch's divisor; onnx.reference's differs on some shapes)."""
    import torch
    x = ins[0]
    if not is_float(x):
        raise UnsupportedNode(ctx.node, [x.dtype], "AveragePool needs a float input")
    ks, st, dil, pads, ceil = pool_attrs(ctx, x, a)
    if dil != [1, 1]:
        raise UnsupportedNode(ctx.node, [x.dtype], "AveragePool with dilations")
    out = [pool_out_size(x.shape[2 + i], ks[i], st[i], pads[i], pads[2 + i], ceil) for i in range(2)]
    if min(out) < 1:
        raise NPUError(f"node {ctx.node.name!r}: AveragePool kernel {ks} larger than the padded input {list(x.shape)}")
    include_pad = bool(a.get("count_include_pad", 0))
    over = any((out[i] - 1) * st[i] + ks[i] > x.shape[2 + i] + pads[i] + pads[2 + i] for i in range(2))
    lrtb = (pads[1], pads[3], pads[0], pads[2])

    def window_sums(t, pad_value=0.0):  # explicit pads, ceil_mode only for the overhang, cropped to ONNX's size
        t = torch.nn.functional.avg_pool2d(torch.nn.functional.pad(t, lrtb, value=pad_value), ks, st, 0,
                                           ceil_mode=over, divisor_override=1)
        return t[:, :, :out[0], :out[1]].numpy()
    s = window_sums(torch.from_numpy(x.astype(np.float64)))
    if include_pad and not over:
        cnt = np.float64(ks[0] * ks[1])
    else:  # count the ones: the input's (pads 0), or the padded input's (pads 1)
        ones = torch.ones((1, 1) + x.shape[2:], dtype=torch.float64)
        cnt = window_sums(ones, 1.0 if include_pad else 0.0)
    return [(s / cnt).astype(x.dtype)]


@op("GlobalAveragePool")
def _gap(ctx, ins, a):
    """``T(sum float64(x over H, W, ...) / (H * W * ...))``, one rounding (export/SPEC.md §5a)."""
    x = ins[0]
    if not is_float(x):
        raise UnsupportedNode(ctx.node, [x.dtype], "GlobalAveragePool needs a float input")
    return [mean_once(x, tuple(range(2, x.ndim)), True)]


@op("GlobalMaxPool")
def _gmp(ctx, ins, a):
    x = ins[0]
    return [x.max(axis=tuple(range(2, x.ndim)), keepdims=True)]


@op("Resize")
def _resize(ctx, ins, a):
    x = ins[0]
    mode = a.get("mode", "nearest")
    mode = mode.decode() if isinstance(mode, bytes) else mode
    if mode != "nearest":
        raise UnsupportedNode(ctx.node, [x.dtype], f"Resize mode {mode!r} (only nearest)")
    ctm = a.get("coordinate_transformation_mode", "half_pixel")
    ctm = ctm.decode() if isinstance(ctm, bytes) else ctm
    nm = a.get("nearest_mode", "round_prefer_floor")
    nm = nm.decode() if isinstance(nm, bytes) else nm
    scales = ins[2] if len(ins) > 2 and ins[2] is not None and ins[2].size else None
    sizes = ins[3] if len(ins) > 3 and ins[3] is not None and ins[3].size else None
    if ctx.opset < 11:
        scales = ins[1]
    if sizes is not None:
        sizes = [int(v) for v in sizes]
        scales = [s / d for s, d in zip(sizes, x.shape)]
    elif scales is not None:
        scales = [float(v) for v in scales]
        sizes = [int(np.floor(d * s)) for d, s in zip(x.shape, scales)]
    else:
        raise NPUError(f"node {ctx.node.name!r}: Resize needs scales or sizes")
    if len(sizes) != x.ndim or min(sizes) < 0 or np.prod(sizes) > 1 << 31:
        raise NPUError(f"node {ctx.node.name!r}: bad Resize output size {sizes}")
    out = x
    for ax, (n_out, sc) in enumerate(zip(sizes, scales)):
        if n_out == x.shape[ax] and sc == 1:
            continue
        o = np.arange(n_out, dtype=np.float64)
        n_in = x.shape[ax]
        if ctm == "asymmetric":
            src = o / sc
        elif ctm == "half_pixel":
            src = (o + 0.5) / sc - 0.5
        elif ctm == "align_corners":
            src = o * (n_in - 1) / (n_out - 1) if n_out > 1 else o * 0
        elif ctm == "pytorch_half_pixel":
            src = (o + 0.5) / sc - 0.5 if n_out > 1 else o * 0
        else:
            raise UnsupportedNode(ctx.node, [x.dtype], f"coordinate_transformation_mode {ctm!r}")
        if nm == "round_prefer_floor":
            idx = np.where(src - np.floor(src) == 0.5, np.floor(src), np.round(src))
        elif nm == "round_prefer_ceil":
            idx = np.where(src - np.floor(src) == 0.5, np.ceil(src), np.round(src))
        elif nm == "floor":
            idx = np.floor(src)
        elif nm == "ceil":
            idx = np.ceil(src)
        else:
            raise UnsupportedNode(ctx.node, [x.dtype], f"nearest_mode {nm!r}")
        idx = np.clip(idx, 0, n_in - 1).astype(np.int64)
        out = np.take(out, idx, axis=ax)
    return [out]


@op("ConvTranspose")
def _conv_transpose(ctx, ins, a):
    """2-D ConvTranspose, float64-accumulated (torch) and rounded once, then + bias:
    full = conv_transpose(x, w) of size (H-1)*s + d*(k-1) + 1, extended by output_padding
    with zeros, cropped by pads[begin]..pads[end] (the ONNX output size formula)."""
    import torch
    x, w = ins[0], ins[1]
    b = ins[2] if len(ins) > 2 else None
    if not (is_float(x) and is_float(w)):
        raise UnsupportedNode(ctx.node, [x.dtype, w.dtype], "ConvTranspose needs float inputs")
    if x.ndim != 4 or w.ndim != 4:
        raise UnsupportedNode(ctx.node, [x.dtype], f"{w.ndim - 2}-D ConvTranspose (2-D only)")
    ap = a.get("auto_pad", "NOTSET")
    if (ap.decode() if isinstance(ap, bytes) else ap) != "NOTSET" or a.get("output_shape"):
        raise UnsupportedNode(ctx.node, [x.dtype], "ConvTranspose auto_pad / output_shape (explicit pads only)")
    g = int(a.get("group", 1))
    s, d = list(a.get("strides") or [1, 1]), list(a.get("dilations") or [1, 1])
    pads, op_ = list(a.get("pads") or [0] * 4), list(a.get("output_padding") or [0, 0])
    ks = list(a.get("kernel_shape") or w.shape[2:])
    if (g < 1 or x.shape[1] % g or w.shape[0] != x.shape[1] or ks != list(w.shape[2:]) or len(s) != 2
            or len(d) != 2 or len(pads) != 4 or len(op_) != 2 or min(s + d) < 1 or min(pads + op_) < 0
            or max(s + d + pads + op_) > 1 << 16 or any(o >= max(si, di) for o, si, di in zip(op_, s, d))):
        raise NPUError(f"node {ctx.node.name!r}: bad ConvTranspose attributes group={g} strides={s} "
                       f"dilations={d} pads={pads} output_padding={op_} for x {list(x.shape)}, w {list(w.shape)}")
    size = [(n - 1) * si + di * (k - 1) + 1 + o - pb - pe
            for n, si, di, k, o, pb, pe in zip(x.shape[2:], s, d, ks, op_, pads[:2], pads[2:])]
    if min(size) < 1:
        raise NPUError(f"node {ctx.node.name!r}: ConvTranspose output size {size} < 1 (pads {pads})")
    xt = torch.from_numpy(np.ascontiguousarray(x, dtype=np.float64))
    wt = torch.from_numpy(np.ascontiguousarray(w, dtype=np.float64))
    full = torch.nn.functional.conv_transpose2d(xt, wt, None, tuple(s), 0, 0, g, tuple(d))
    full = torch.nn.functional.pad(full, (0, op_[1], 0, op_[0])).numpy()
    return [_add_bias(full[:, :, pads[0]:full.shape[2] - pads[2], pads[1]:full.shape[3] - pads[3]], b, x.dtype)]
