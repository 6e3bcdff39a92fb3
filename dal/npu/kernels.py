"""Python side of the integer kernels: validation, weight packing, im2col + GEMM dispatch.

All functions take integer codes and zero points and return EXACT int32 accumulators

    acc[n, o, y, x] = sum_{c, i, j} (x[n, c, ...] - zx) * (w[o, c, i, j] - zw[o])

computed by the C++ library (dal/npu/csrc) on int16 operands with the zero point already
subtracted (values in [-255, 255], so nothing saturates). Shapes and attributes are checked
here before any C++ call; the C++ checks its own preconditions again (TORCH_CHECK -> Python
RuntimeError), so bad input is always an exception, never a crash.
"""
from __future__ import annotations

import numpy as np

from .errors import NPUError

_MAX_ACC_TERMS = (2**31 - 1) // (255 * 255)  # K beyond this could overflow int32 in theory


def _lib():
    from .build import kernels
    return kernels()


def _torch():
    import torch
    return torch


def _round_up(v: int, m: int) -> int:
    return (v + m - 1) // m * m


def to_s16(q: np.ndarray, zp) -> "object":
    """torch int16 tensor of ``q - zp`` (zp scalar or broadcastable array)."""
    torch = _torch()
    q = np.asarray(q)
    if q.dtype in (np.int8, np.uint8) and np.ndim(zp) == 0 and -32768 + 255 <= int(zp) <= 32767 - 255:
        # 8-bit codes minus an in-range zero point always fit: skip the range scan
        return torch.from_numpy(q.astype(np.int16)).sub_(int(zp))
    d = q.astype(np.int32) - np.asarray(zp, dtype=np.int32)
    if d.size and (d.min() < -32768 or d.max() > 32767):
        raise NPUError("integer operand minus zero point does not fit in int16")
    return torch.from_numpy(np.ascontiguousarray(d.astype(np.int16)))


class PackedA:
    """A static left operand [M, K] (conv/gemm weights, rows = output channels), K padded even."""

    def __init__(self, a16, threads_hint: int = 1):
        torch = _torch()
        m, k = a16.shape
        self.m, self.k = m, k
        self.data = torch.nn.functional.pad(a16, (0, k % 2)).contiguous()


def pack_b(b16) -> "object":
    """Pair-pack B [K, N] int16 -> [ceil(K/2), round_up(N, 16), 2] for gemm_s16."""
    torch = _torch()
    k, n = b16.shape
    npad = _round_up(max(n, 1), 16)
    b = torch.nn.functional.pad(b16, (0, npad - n, 0, k % 2))
    return b.reshape((k + 1) // 2, 2, npad).permute(0, 2, 1).contiguous()


def gemm(a: PackedA, b_packed, n: int, threads: int):
    """int32 [M, N] = A x B for a pair-packed B."""
    if a.data.shape[1] != 2 * b_packed.shape[0]:
        raise NPUError(f"gemm: inner dimensions differ ({a.k} vs {2 * b_packed.shape[0]})")
    return _lib().gemm_s16(a.data, b_packed, int(n), int(threads))


def matmul_s16(a16, b16, threads: int):
    """int32 [M, N] = a16 [M, K] x b16 [K, N] (both int16 torch tensors)."""
    if a16.shape[1] != b16.shape[0]:
        raise NPUError(f"matmul: inner dimensions differ ({a16.shape[1]} vs {b16.shape[0]})")
    return gemm(PackedA(a16), pack_b(b16), b16.shape[1], threads)


def conv_out_size(size: int, k: int, s: int, d: int, p0: int, p1: int) -> int:
    return (size + p0 + p1 - d * (k - 1) - 1) // s + 1


def check_conv_attrs(x_shape, w_shape, strides, dilations, pads, group, who: str):
    """Validate a 2-D convolution; returns (OH, OW). Raises NPUError naming ``who``."""
    if len(x_shape) != 4 or len(w_shape) != 4:
        raise NPUError(f"{who}: only 2-D convolution (4-D tensors) is supported, got "
                       f"input {tuple(x_shape)} weight {tuple(w_shape)}")
    n, c, h, w = x_shape
    o, cg, kh, kw = w_shape
    if group is None or group < 1:
        raise NPUError(f"{who}: group must be >= 1, got {group}")
    if c != cg * group or o % group:
        raise NPUError(f"{who}: input channels {c} / weight {tuple(w_shape)} do not match group {group}")
    if len(strides) != 2 or min(strides) < 1 or len(dilations) != 2 or min(dilations) < 1:
        raise NPUError(f"{who}: strides {strides} and dilations {dilations} must be two values >= 1")
    if len(pads) != 4 or min(pads) < 0 or max(pads) > 1 << 16:
        raise NPUError(f"{who}: pads {pads} must be four values in [0, 65536]")
    if kh < 1 or kw < 1:
        raise NPUError(f"{who}: empty kernel {tuple(w_shape)}")
    oh = conv_out_size(h, kh, strides[0], dilations[0], pads[0], pads[2])
    ow = conv_out_size(w, kw, strides[1], dilations[1], pads[1], pads[3])
    if oh < 1 or ow < 1:
        raise NPUError(f"{who}: output would be empty ({oh}x{ow})")
    if cg * kh * kw > _MAX_ACC_TERMS * 64:
        raise NPUError(f"{who}: reduction of {cg * kh * kw} terms is too long for int32")
    return oh, ow


class ConvWeights:
    """Conv weights [O, C/g, kh, kw] minus their zero point, packed once per group.

    ``sparse``: also keep the 2:4 compressed form (values + positions along input channels).
    """

    def __init__(self, wq: np.ndarray, zw, group: int, sparse24=None):
        torch = _torch()
        self.shape = tuple(wq.shape)
        o, cg, kh, kw = self.shape
        zw = np.asarray(zw, dtype=np.int32)
        zw = zw.reshape(-1, 1, 1, 1) if zw.size > 1 else zw.reshape(())
        w16 = to_s16(wq, zw)
        self.group = group
        self.depthwise = group > 1 and cg == 1 and o == group
        og = o // group
        if self.depthwise:
            self.dw = w16.reshape(o, kh * kw).contiguous()
        self.packed = [PackedA(w16[g * og:(g + 1) * og].reshape(og, cg * kh * kw).contiguous())
                       for g in range(group)] if not self.depthwise else []
        self.sparse = None
        if sparse24 is not None:
            from .sparse import compress_conv, im2col_row_perm
            if self.depthwise or cg % 4:
                raise NPUError(f"sparse initializer {sparse24!r}: 2:4 needs a multiple of 4 "
                               f"input channels per group (weight {self.shape}, group {group})")
            self.sparse = [compress_conv(w16[g * og:(g + 1) * og], sparse24)
                           for g in range(group)]
            self.perm = torch.from_numpy(im2col_row_perm(cg, kh, kw))


def conv2d(xq: np.ndarray, zx, wts: ConvWeights, strides, dilations, pads, threads: int,
           who: str = "conv"):
    """Exact int32 conv of codes ``xq`` [N, C, H, W] (zero point zx) with packed weights."""
    torch = _torch()
    lib = _lib()
    oh, ow = check_conv_attrs(xq.shape, wts.shape, strides, dilations, pads, wts.group, who)
    n, c, h, w = xq.shape
    o, cg, kh, kw = wts.shape
    x16 = to_s16(xq, zx)
    if n == 1 and wts.group == 1 and not wts.depthwise and wts.sparse is None:  # common case: no copies
        cols = lib.im2col_s16(x16[0].contiguous(), kh, kw, strides[0], strides[1], dilations[0],
                              dilations[1], pads[0], pads[1], oh, ow, True, threads)
        return lib.gemm_s16(wts.packed[0].data, cols, oh * ow, threads).numpy().reshape(1, o, oh, ow)
    out = torch.empty((n, o, oh, ow), dtype=torch.int32)
    og = o // wts.group
    geo = (kh, kw, strides[0], strides[1], dilations[0], dilations[1], pads[0], pads[1], oh, ow)
    for b in range(n):
        if wts.depthwise:
            out[b] = lib.dwconv_s16(x16[b].contiguous(), wts.dw, *geo, threads)
            continue
        for g in range(wts.group):
            xg = x16[b, g * cg:(g + 1) * cg].contiguous()
            if wts.sparse is not None:
                vals, pos = wts.sparse[g]
                cols = lib.im2col_s16(xg, *geo, False, threads)
                if kh * kw > 1:  # rows into (i, j, c) order: groups of 4 channels consecutive
                    cols = cols.index_select(0, wts.perm)
                acc = lib.sparse24_gemm_s16(vals, pos, cols, oh * ow, threads)
            else:
                cols = lib.im2col_s16(xg, *geo, True, threads)
                acc = lib.gemm_s16(wts.packed[g].data, cols, oh * ow, threads)
            out[b, g * og:(g + 1) * og] = acc.reshape(og, oh, ow)
    return out.numpy()


def requant_float(acc2d: np.ndarray, mult: np.ndarray, bias, y_scale, zp, qmin: int, qmax: int,
                  threads: int) -> np.ndarray:
    """Rows of acc2d [C, P]: clamp(rne(float32(acc * mult[c]) (+ bias[c]) / y_scale[c]) + zp[c])."""
    torch = _torch()
    c = acc2d.shape[0]
    full = lambda v, dt: np.array(np.broadcast_to(np.asarray(v, dtype=dt).reshape(-1), (c,)), dtype=dt)
    b = torch.from_numpy(full(bias, np.float32)) if bias is not None else torch.empty(0, dtype=torch.float32)
    r = _lib().requant_float(torch.from_numpy(np.ascontiguousarray(acc2d, dtype=np.int32)),
                             torch.from_numpy(full(mult, np.float64)), b,
                             torch.from_numpy(full(y_scale, np.float32)),
                             torch.from_numpy(full(zp, np.int32)), int(qmin), int(qmax), int(threads))
    return r.numpy()


ROUNDING = {"half_up": 0, "half_even": 1, "half_away": 2}


def requant_fixed(acc2d: np.ndarray, m: np.ndarray, n: np.ndarray, zp, qmin: int, qmax: int,
                  rounding: str, threads: int) -> np.ndarray:
    """Rows of acc2d: clamp(round_shift(acc * m[c], n[c]) + zp[c]) (see metadata.FixedPoint)."""
    torch = _torch()
    c = acc2d.shape[0]
    full = lambda v, dt: np.array(np.broadcast_to(np.asarray(v, dtype=dt).reshape(-1), (c,)), dtype=dt)
    r = _lib().requant_fixed(torch.from_numpy(np.ascontiguousarray(acc2d, dtype=np.int32)),
                             torch.from_numpy(full(m, np.int64)), torch.from_numpy(full(n, np.int64)),
                             torch.from_numpy(full(zp, np.int32)), int(qmin), int(qmax),
                             ROUNDING[rounding], int(threads))
    return r.numpy()


# ----- fused groups: codes in, codes out (csrc/qconv.cpp) --------------------------------------

PANEL = 16  # output channels per packed weight panel


def pack_panels(wd: np.ndarray):
    """Weights minus zero point [O, K] (K even) -> torch int16 [ceil(O/16), K/2, 16, 2], packed
    once at load: panel p holds output channels 16p..16p+15, k pairs contiguous."""
    torch = _torch()
    o, k = wd.shape
    if k % 2:
        raise NPUError("pack_panels: K must be even")
    if wd.size and (wd.min() < -32768 or wd.max() > 32767):
        raise NPUError("weight minus zero point does not fit in int16")
    op = _round_up(max(o, 1), PANEL)
    w = np.zeros((op, k), dtype=np.int16)
    w[:o] = wd
    return torch.from_numpy(np.ascontiguousarray(w.reshape(op // PANEL, PANEL, k // 2, 2).transpose(0, 2, 1, 3)))


def pack_panels_s8(wd: np.ndarray):
    """VNNI form: weights minus zero point [O, K] within [-128, 127] (K % 4 == 0) -> (torch int8
    [ceil(O/16), K/4, 16, 4], torch int32 wsum[round_up(O, 16)] = sum_k wd[o, k])."""
    torch = _torch()
    o, k = wd.shape
    if k % 4 or (wd.size and (wd.min() < -128 or wd.max() > 127)):
        raise NPUError("pack_panels_s8: K must be a multiple of 4 and weights within [-128, 127]")
    op = _round_up(max(o, 1), PANEL)
    w = np.zeros((op, k), dtype=np.int8)
    w[:o] = wd
    packed = np.ascontiguousarray(w.reshape(op // PANEL, PANEL, k // 4, 4).transpose(0, 2, 1, 3))
    # into torch's own memory (64-byte aligned), not numpy's (16): AMX tile rows must not
    # straddle two cache lines (csrc/qconv_amx.h Aligned; twice as fast measured)
    panels = torch.empty(packed.shape, dtype=torch.int8)
    panels.numpy()[...] = packed
    return panels, torch.from_numpy(w.astype(np.int64).sum(1).astype(np.int32))


def pack_weights(wm: np.ndarray, vnni: bool):
    """``(panels, wsum)`` of a weight matrix [O, K] (minus zero point, K a multiple of the step)
    for the kernel family that will read it: int8 VNNI panels and their row sums
    (:func:`pack_panels_s8`, K % 4 == 0) when ``vnni``, else int16 panels (:func:`pack_panels`)
    and an empty int32 wsum, which those kernels do not read."""
    if vnni:
        return pack_panels_s8(wm)
    return pack_panels(wm), _torch().empty(0, dtype=_torch().int32)


def conv_weight_matrix(wd: np.ndarray, implicit: bool, step: int = 2) -> np.ndarray:
    """[O, C, kh, kw] -> [O, K] in the reduction order of qconv: k = (i*kw + j)*Cp + c with Cp
    = C rounded up to a multiple of ``step`` (implicit), or k = (i*kw + j)*C + c zero padded to
    a multiple of ``step`` (explicit). step: 2 for int16 panels, 4 for int8 (VNNI) panels."""
    o, c, kh, kw = wd.shape
    t = np.transpose(wd, (0, 2, 3, 1))
    if implicit:
        t = np.pad(t, ((0, 0), (0, 0), (0, 0), (0, (-c) % step)))
        return t.reshape(o, -1)
    t = t.reshape(o, kh * kw * c)
    return np.pad(t, ((0, 0), (0, (-(kh * kw * c)) % step)))


def pad_channels(v, o: int, dtype) -> "object":
    """Per-channel vector (scalar broadcast) padded with zeros to round_up(o, 16), as torch."""
    torch = _torch()
    out = np.zeros(_round_up(max(o, 1), PANEL), dtype=dtype)
    out[:o] = np.broadcast_to(np.asarray(v, dtype=dtype).reshape(-1), (o,))
    return torch.from_numpy(out)


def code_tensor(x: np.ndarray, zp: int):
    """(torch tensor of 8-bit codes, zp) as qconv/qgemm read them; other code types (int4) are
    turned into int16 ``x - zp`` first (zp becomes 0)."""
    torch = _torch()
    if x.dtype in (np.dtype(np.uint8), np.dtype(np.int8)):
        return torch.from_numpy(np.ascontiguousarray(x)), zp
    return torch.from_numpy(np.ascontiguousarray(x.astype(np.int32) - zp).astype(np.int16)), 0
