"""Integer groups: DequantizeLinear -> Conv/Gemm/MatMul [-> Add(bias)] [-> Relu/Clip] -> QuantizeLinear.

"integer" semantics (what the NPU computes), per output channel c:

    acc   = sum_k (x_q - zp_x) * (w_q - zp_w[c])          exact int32 (C++ kernels)
            + bias_q[c]   when the bias is an int32 DequantizeLinear with zero point 0 and
                          scale == float32(s_x * s_w[c]) (quantize_static / dal exports);
                          a MatMul's bias is the int32 DequantizeLinear its sole consumer Add
                          adds (a Linear on rank > 2 inputs, group_chain.py)
    v     = float32(float64(acc) * (float64(s_x) * float64(s_w[c])))     one rounding
            (+ b[c] as a float32 add when the bias could not be folded)
    q     = clamp(round_half_even(v / s_y) + zp_y, lo, hi)     float32 division (ONNX Q)

where [lo, hi] is the output type's range narrowed by a fused Relu (lo = Q(0)) or
Clip(a, b) (lo = Q(a), hi = Q(b)); this equals Q(Relu(v)) exactly because Q is monotone.
With ``dal.requantizer`` fixed_point, q = clamp(round_shift(acc * m[c], n[c]) + zp_y, lo, hi)
(metadata.py), and the bias must fold into acc.

The ONNX graph instead rounds every dequantized value and every partial sum to float32; the
two agree whenever that float32 arithmetic is exact (power-of-two s_x, s_w and all partial
sums below 2^24 units of s_x*s_w), and otherwise differ only when v/s_y lies within float32
rounding noise of a .5 boundary. Blocked weights, float16 scales and anything else not matched
here run node by node in float ("onnx" semantics). k >= 2 quantizers reading the group:
fan_out.py; a MaxPool / nearest Resize before them: group_post.py.
"""
from __future__ import annotations

import numpy as np

from . import accumulator, kernels, quant
from .dispatch import has_vnni
from .bias_overflow import acc_bound, bias_overflow_error
from .conv_call import fast_codes
from .errors import NPUError
from .group_chain import for_reader, is_dq as _is_dq, plan_output_chain
from .metadata import requant_params
from .sparse import check_24, compress_rows

_CODES = {np.dtype(np.int8), np.dtype(np.uint8)} | quant.INT4
_X_CODES = _CODES | accumulator.WIDE_CODES  # 16-bit inputs: accumulator.py, exact int64


class FusedStep:
    """One integer group; ``outputs[0]`` is the QuantizeLinear output. Conv groups on the fused
    kernel read and write pixel-major codes (layout.py) as the session plans it."""

    kind = "fused"
    nhwc_in, nhwc_out = (), False

    @property
    def nhwc_capable(self):
        return self.op == "Conv" and self.fast and self.acc_model is None

    def __init__(self, g, node, plan: dict, requantizer, threads_default):
        self.node = node
        self.node_name = node.name
        self.__dict__.update(plan)
        self.inputs = [plan["x_name"]]
        self.outputs = [plan["q_out"]]
        self.extra_outputs = [plan["op_out"]] + [plan[k] for k in ("add_out", "act_out") if plan[k]]
        self.rq = requantizer
        ys, yz = np.float32(plan["y_scale"]), int(plan["y_zp"])
        qmin, qmax = quant.int_range(plan["y_dtype"])
        q = lambda v: int(quant.quantize(np.float32(v), ys, np.array(yz), plan["y_dtype"]))
        self.lo = max(qmin, q(plan["act_lo"])) if plan["act_lo"] is not None else qmin
        self.hi = min(qmax, q(plan["act_hi"])) if plan["act_hi"] is not None else qmax
        c = plan["channels"]
        self.mult = np.broadcast_to(np.float64(plan["x_scale"]) * plan["w_scale"].astype(np.float64).reshape(-1), (c,)).copy()
        if requantizer.integer:
            if plan["bias_f"] is not None:
                raise NPUError(f"node {node.name!r}: the {requantizer.kind} requantizer needs an int32 "
                               "bias with scale s_x*s_w and zero point 0")
            mn = [requant_params(requantizer, float(m / np.float64(ys)), node.name) for m in self.mult]
            self.fp_m = np.array([v[0] for v in mn], dtype=np.int64)
            self.fp_n = np.array([v[1] for v in mn], dtype=np.int64)
        self.fast = False
        # accumulator width / 16-bit inputs: modelled in accumulator.py (exact, then saturate or wrap)
        self.acc_model = accumulator.attach(g, self, requantizer)
        if plan["w_fast"] is not None and self.acc_model is None:
            self._pack_fast(plan["w_fast"])

    def _pack_fast(self, wd, allow_vnni=True):
        """One C++ call per run (csrc/qconv.cpp): weights packed into panels here, once.

        int8 panels (vpdpbusd, exact u8 x s8 sums in int32) when the kernel variant has VNNI, the
        input codes are 8-bit and every weight minus its zero point lies in [-128, 127]; else
        int16 panels (vpmaddwd). Both give the same exact int32 accumulators."""
        import torch
        c = self.channels
        k_total = int(np.prod(wd.shape[1:]))
        vnni = (allow_vnni and has_vnni(self.isa) and np.dtype(self.x_dtype).itemsize == 1
                and str(np.dtype(self.x_dtype)) in ("int8", "uint8") and wd.size > 0
                and wd.min() >= -128 and wd.max() <= 127 and (k_total + 64) * 255 * 128 < 2**31)
        step = 4 if vnni else 2
        if self.op == "Conv":
            # few input channels: an explicit patch matrix beats 2-element int16 inner loops;
            # the int8 panels read 4 channels per step and gain nothing from it (measured)
            self.implicit = wd.shape[1] >= 16 or vnni
            wm = kernels.conv_weight_matrix(wd, self.implicit, step)
        else:
            wm = np.pad(wd, ((0, 0), (0, (-wd.shape[1]) % step)))
        self.fast_b, self.fast_wsum = kernels.pack_weights(wm, vnni)
        self.vnni = vnni
        self.fast_mult = kernels.pad_channels(self.mult, c, np.float64)
        empty = lambda dt: torch.empty(0, dtype=dt)
        if self.bias_q is not None:
            if self.bias_q.min() < -2**31 or self.bias_q.max() >= 2**31:
                return
            self.fast_bq = kernels.pad_channels(self.bias_q, c, np.int32)
        else:
            self.fast_bq = empty(torch.int32)
        self.fast_bf = kernels.pad_channels(self.bias_f, c, np.float32) if self.bias_f is not None else empty(torch.float32)
        if self.rq.integer:
            self.fast_m = kernels.pad_channels(self.fp_m, c, np.int64)
            self.fast_n = kernels.pad_channels(self.fp_n, c, np.int64)
            self.fast_round = kernels.ROUNDING[self.rq.rounding]
        else:
            self.fast_m, self.fast_n, self.fast_round = empty(torch.int64), empty(torch.int64), 0
        self.fast_out = {np.dtype(np.uint8): 1, np.dtype(np.int8): 2}.get(np.dtype(self.y_dtype), 0)
        # per-run constants, built once: the requantizer arguments, an empty accumulator tensor
        # (no accumulators wanted), and the checked output size per input shape (_run_fast)
        self.fast_rq = (self.fast_mult, self.fast_bq, self.fast_bf, self.fast_m, self.fast_n, self.fast_round,
                        float(self.y_scale), int(self.y_zp), int(self.lo), int(self.hi), self.fast_out)
        self.fast_no_acc, self.fast_geo, self.conv_calls = empty(torch.int32), {}, {}
        self.fast = True

    def _run_fast(self, xq, threads, want_extra, layout=0):
        """(codes, rows) by the fused kernel; rows = int32 accumulators [C, -1] (+ bias_q) when
        want_extra, else None. layout (Conv): bit 0 xq is [N, H, W, C], bit 1 the codes come
        back [N, OH, OW, C]."""
        import torch
        from .build import kernels as lib
        c, rq = self.channels, self.fast_rq
        if self.op == "Conv":
            strides, dil, pads = self.conv_geo
            geo = self.fast_geo.get((xq.shape, layout & 1))
            if geo is None:  # the other arguments are fixed: checked once per input shape
                shape = xq.shape if not layout & 1 or xq.ndim != 4 else tuple(xq.shape[i] for i in (0, 3, 1, 2))
                geo = self.fast_geo[xq.shape, layout & 1] = kernels.check_conv_attrs(
                    shape, self.conv_w.shape, strides, dil, pads, 1, repr(self.node_name))
            oh, ow = geo
            _, _, kh, kw = self.conv_w.shape
            x, zx = kernels.code_tensor(xq, self.x_zp)
            n = xq.shape[0]
            accs = torch.empty((n, c, oh * ow), dtype=torch.int32) if want_extra else self.fast_no_acc
            # the whole batch in one call: its pixels share the threads and the weight streams
            q = lib().qconv(x, zx, self.fast_b, self.fast_wsum, c, kh, kw, strides[0], strides[1], dil[0], dil[1],
                            pads[0], pads[1], oh, ow, self.implicit, *rq, accs, threads,
                            self.isa, layout).numpy()
            q = q.reshape((n, oh, ow, c) if layout & 2 else (n, c, oh, ow))
            self.out_shape = (n, c, oh, ow)
            if want_extra:  # [N, P, C] (pixel-major) or [N, C, P] -> [C, N * P]
                a = accs.numpy()
                rows = a.reshape(-1, c).T if layout & 2 else a.transpose(1, 0, 2).reshape(c, -1)
            else:
                rows = None
        else:
            x2 = xq.reshape(-1, self.k)
            x, zx = kernels.code_tensor(x2, self.x_zp)
            acc = torch.empty((x2.shape[0], c), dtype=torch.int32) if want_extra else self.fast_no_acc
            q = lib().qgemm(x, zx, self.fast_b, self.fast_wsum, c, *rq, acc, threads, self.isa).numpy()
            q = q.reshape(xq.shape[:-1] + (c,))
            rows = np.ascontiguousarray(acc.numpy().T) if want_extra else None
        if q.dtype != self.y_dtype:
            q = q.astype(self.y_dtype)
        return q, rows

    def rows_of(self, xq, threads, layout=0):
        """(codes, exact int32 accumulators [C, N*P] incl. bias_q, pixels in (n, p) order) of the
        fused kernel, or None off it (fan_out.py: the accumulator of a group read k times)."""
        if not self.fast:
            return None
        self._check_x(xq)
        return self._run_fast(xq, threads, True, layout)

    def codes_of_rows(self, rows, like, xq, threads):
        """This step's requantizer on another step's accumulators ``rows`` (same weights);
        ``like`` is that step (its output shape); NCHW codes."""
        if self.rq.integer:
            q = kernels.requant_fixed(rows, self.fp_m, self.fp_n, self.y_zp, self.lo, self.hi,
                                      self.rq.rounding, threads)
        else:
            q = kernels.requant_float(rows, self.mult, self.bias_f, self.y_scale, self.y_zp,
                                      self.lo, self.hi, threads)
        self.out_shape = getattr(like, "out_shape", None)
        return self.rows_to_output(q, xq).astype(self.y_dtype)

    def _check_x(self, xq):
        if xq.dtype not in _X_CODES or xq.dtype != self.x_dtype:
            raise NPUError(f"node {self.node_name!r}: input codes are {xq.dtype}, the zero point says {self.x_dtype}")
        if self.op != "Conv" and (xq.ndim < 1 or xq.shape[-1] != self.k):
            raise NPUError(f"node {self.node_name!r}: input shape {xq.shape} does not match "
                           f"reduction length {self.k}")

    def accumulators(self, xq, threads):
        """int32 accumulators, channels first: Conv [N, O, H, W]; Gemm/MatMul [N_out, M]."""
        if self.op == "Conv":
            return kernels.conv2d(xq, self.x_zp, self.conv_w, *self.conv_geo, threads,
                                  repr(self.node_name))
        if xq.ndim < 1 or xq.shape[-1] != self.k:
            raise NPUError(f"node {self.node_name!r}: input shape {xq.shape} does not match "
                           f"reduction length {self.k}")
        x2 = xq.reshape(-1, self.k)
        if self.lin_sparse is not None:
            bt = kernels.to_s16(np.ascontiguousarray(x2.T), self.x_zp)
            import torch
            bt = torch.nn.functional.pad(bt, (0, (-bt.shape[1]) % 16))
            vals, pos = self.lin_sparse
            from .build import kernels as lib
            return lib().sparse24_gemm_s16(vals, pos, bt.contiguous(), x2.shape[0], threads).numpy()
        a = kernels.PackedA(kernels.to_s16(x2, self.x_zp))
        return kernels.gemm(a, self.lin_b, self.channels, threads).numpy().T

    def run(self, ins, threads, want_extra=False):
        nin, nout = bool(self.nhwc_in and self.nhwc_in[0]), self.nhwc_out
        if (not want_extra and self.fast and self.acc_model is None  # conv_call.py
                and (q := fast_codes(self, ins[0], threads, nin | nout << 1)) is not None):
            return {self.q_out: q}
        if (nin or nout) and not self.nhwc_capable:  # planned pixel-major, now on another path
            from .layout import to_nchw, to_nhwc
            out = self._run_group(to_nchw(ins[0]) if nin else ins[0], threads, want_extra)
            if nout:
                out[self.q_out] = to_nhwc(out[self.q_out])
            return out
        return self._run_group(ins[0], threads, want_extra, nin | nout << 1)

    def _run_group(self, xq, threads, want_extra, layout=0):
        """The group on codes xq; layout (fused Conv only, see _run_fast) 0: NCHW in and out."""
        self._check_x(xq)
        if self.acc_model is not None:
            return self.acc_model.run(xq, threads, want_extra)
        if self.fast:
            try:
                q, rows = self._run_fast(xq, threads, want_extra, layout)
            except RuntimeError as e:  # the kernel's overflow flag: recheck exactly, name the numbers
                if "accumulator plus bias overflows int32" not in str(e):
                    raise
                from .layout import to_nchw
                raise self._bias_overflow(to_nchw(xq) if layout & 1 else xq, threads) from None
            out = {self.q_out: q}
            if want_extra:
                self.add_op_values(out, rows, xq)
            return out
        acc = self.accumulators(xq, threads)
        c = self.channels
        if self.op == "Conv":
            rows = np.moveaxis(acc, 1, 0).reshape(c, -1)
        else:
            rows = np.ascontiguousarray(acc)
        if self.bias_q is not None:
            r64 = rows.astype(np.int64) + self.bias_q.reshape(-1, 1)
            if r64.size and (r64.min() < -2**31 or r64.max() >= 2**31):
                raise self._bias_overflow(xq, threads, rows)
            rows = r64.astype(np.int32)
        rows = np.ascontiguousarray(rows)
        self.out_shape = acc.shape
        out = {self.q_out: self.codes_of_rows(rows, self, xq, threads)}
        if want_extra:
            self.add_op_values(out, rows, xq)
        return out

    def _bias_overflow(self, xq, threads, rows=None) -> NPUError:
        """The overflow error with its numbers, from the exact accumulators of the int16 path
        (independent of the fused kernel that raised the flag)."""
        if rows is None:
            acc = self.accumulators(xq, threads)
            rows = np.moveaxis(acc, 1, 0).reshape(self.channels, -1) if self.op == "Conv" else acc
        t = rows.astype(np.int64) + self.bias_q.reshape(-1, 1)
        if not (t.size and (t.min() < -2**31 or t.max() >= 2**31)):
            return NPUError(f"node {self.node_name!r}: the fused kernel ({self.isa}) flagged an int32 "
                            "overflow the exact accumulators do not have (a kernel fault; please report)")
        bound = acc_bound(self.w_fast, self.x_dtype, self.x_zp)
        return bias_overflow_error(self.node_name, rows, self.bias_q, self.x_scale, self.w_scale, bound)

    def add_op_values(self, out, rows, xq):
        """Into ``out``: the float values of the op (bias Add, Relu/Clip) outputs, from the int32 accumulators."""
        v = (rows.astype(np.float64) * self.mult.reshape(-1, 1)).astype(np.float32)
        if self.bias_f is not None:
            v = v + self.bias_f.reshape(-1, 1)
        v = self.rows_to_output(v, xq)
        if self.bias_add:  # MatMul -> Add(bias) (group_chain.py): the MatMul's value has no bias
            mm = (rows.astype(np.float64) - self.bias_q.reshape(-1, 1)) * self.mult.reshape(-1, 1)
            out[self.op_out] = self.rows_to_output(mm.astype(np.float32), xq)
            if self.add_out:
                out[self.add_out] = v
        else:
            out[self.op_out] = v
        if self.act_out:
            lo = -np.inf if self.act_lo is None else self.act_lo
            hi = np.inf if self.act_hi is None else self.act_hi
            out[self.act_out] = np.minimum(np.maximum(v, np.float32(lo)), np.float32(hi)).astype(np.float32)

    def rows_to_output(self, r, xq):
        """Per-channel rows ``r`` [C, N*P] as the output layout: Conv [N, C, H, W] (``out_shape``), else [..., C]."""
        if self.op == "Conv":
            n, _, h, w = self.out_shape
            return np.ascontiguousarray(np.moveaxis(r.reshape(self.channels, n, h, w), 0, 1))
        return np.ascontiguousarray(r.T).reshape(xq.shape[:-1] + (self.channels,))


def match(g, node, sparse24: dict):
    """Plan dict for a fusable group rooted at Conv/Gemm/MatMul ``node``, a list of plans (one
    per reader, group_chain.for_reader) when k >= 2 quantizers read it, else None. A MatMul with
    a blocked weight: blocked_groups.match (always a list)."""
    plan = _match_one(g, node, sparse24)
    if plan is None and node.op_type == "MatMul":  # blocked weights: blocked_groups.py
        from .blocked_groups import match as match_blocked
        return match_blocked(g, node)
    if plan is None or len(plan["q_readers"]) < 2:
        return plan
    return [for_reader(g, plan, q) for q in plan["q_readers"]]


def _match_one(g, node, sparse24: dict):
    if node.op_type not in ("Conv", "Gemm", "MatMul") or len(node.input) < 2:
        return None
    found = _input_dequantizers(g, node)
    if found is None:
        return None
    dqx, dqw, xs, xz, wq, ws, wz = found
    a = g.attrs(node)
    w_axis = g.attrs(dqw).get("axis", 1)
    plan = {"op": node.op_type, "x_name": dqx.input[0], "x_dtype": xz.dtype,
            "x_scale": np.float32(xs.reshape(())), "x_zp": int(xz.reshape(-1)[0]),
            "lin_sparse": None, "lin_b": None, "conv_w": None, "w_fast": None}
    sparse_axis = sparse24.get(dqw.input[0])
    if wz.size > 1 and (wq.ndim < 1 or wz.size != wq.shape[w_axis % max(wq.ndim, 1)]):
        raise NPUError(f"node {dqw.name!r}: weight zero point of {wz.size} elements does not match "
                       f"axis {w_axis} of weight {dqw.input[0]!r} {list(wq.shape)}")
    wd = wq.astype(np.int32) - (wz.astype(np.int32).reshape(_pc_shape(wq.ndim, w_axis, wz.size)) if wz.size > 1 else wz.astype(np.int32))
    if sparse_axis is not None:
        check_24(wd, sparse_axis, dqw.input[0])
    plan_weights = _plan_conv_weights if node.op_type == "Conv" else _plan_linear_weights
    found = plan_weights(g, node, a, plan, wq, wz, wd, dqw.input[0], sparse_axis)
    if found is None:
        return None
    ch_axis, channels = found
    if ws.size > 1 and not (ws.ndim == 1 and w_axis % wq.ndim == ch_axis and ws.size == channels):
        return None
    if wz.size > 1 and wz.size != channels:
        return None
    plan["channels"], plan["w_scale"] = channels, ws.reshape(-1)
    if not _plan_bias(g, node, plan, xs, ws, channels):
        return None
    if not plan_output_chain(g, node, plan):
        return None
    return plan


def _input_dequantizers(g, node):
    """(dq_x, dq_w, s_x, zp_x, w_q, s_w, zp_w) when both inputs of ``node`` are DequantizeLinear
    of 8/4-bit codes with a per-tensor input scale and float32 scales, unblocked; else None."""
    dqx, dqw = g.producer(node.input[0]), g.producer(node.input[1])
    if not (_is_dq(dqx) and _is_dq(dqw)):
        return None
    xs, xz = g.const(dqx.input[1]), g.const_opt(dqx, 2)
    wq, ws, wz = g.const(dqw.input[0]), g.const(dqw.input[1]), g.const_opt(dqw, 2)
    if xs is None or xz is None or xs.size != 1 or xz.size != 1 or xz.dtype not in _X_CODES:
        return None
    if wq is None or ws is None or wq.dtype not in _CODES or xs.dtype != np.float32 or ws.dtype != np.float32:
        return None
    if wz is None:
        wz = np.zeros((), wq.dtype)
    if wz.dtype != wq.dtype or g.attrs(dqw).get("block_size", 0) or g.attrs(dqx).get("block_size", 0):
        return None
    return dqx, dqw, xs, xz, wq, ws, wz


def _plan_conv_weights(g, node, a, plan, wq, wz, wd, w_name, sparse_axis):
    """Conv weights and geometry into ``plan``; (channel axis, channels), or None if not fusable."""
    if wq.ndim != 4:
        return None
    ch_axis, channels = 0, wq.shape[0]
    from .ops_nn import conv_attrs
    from types import SimpleNamespace
    ctx = SimpleNamespace(node=node)
    x_shape = g.shape_of(node.input[0])
    if a.get("auto_pad", "NOTSET") not in ("NOTSET", b"NOTSET") and x_shape is None:
        return None
    strides, dil, pads, group = conv_attrs(ctx, x_shape, wq.shape, a)
    if sparse_axis is not None and sparse_axis % 4 != 1:
        raise NPUError(f"sparse initializer {w_name!r}: a Conv weight is 2:4 along axis 1, not {sparse_axis}")
    plan["conv_w"] = kernels.ConvWeights(wq, _per_channel(wz, channels), group,
                                         sparse24=w_name if sparse_axis is not None else None)
    plan["conv_geo"] = (strides, dil, pads)
    plan["k"] = None
    # kept (as int16: 8-bit codes minus zero point fit) so the panels can be re-packed
    plan["w_fast"] = wd.astype(np.int16) if group == 1 and sparse_axis is None else None
    return ch_axis, channels


def _plan_linear_weights(g, node, a, plan, wq, wz, wd, w_name, sparse_axis):
    """Gemm / MatMul weights into ``plan`` (packed, or 2:4 compressed); (channel axis, channels),
    or None if not fusable."""
    if wq.ndim != 2:
        return None
    trans_b = node.op_type == "Gemm" and a.get("transB", 0)
    if node.op_type == "Gemm" and (a.get("transA", 0) or a.get("alpha", 1.0) != 1.0 or a.get("beta", 1.0) != 1.0):
        return None
    w_kn = wd.T if trans_b else wd  # [K, N] codes minus zero point
    ch_axis = 0 if trans_b else 1
    channels, plan["k"] = w_kn.shape[1], w_kn.shape[0]
    if sparse_axis is not None:
        if sparse_axis % 2 != (1 if trans_b else 0):
            raise NPUError(f"sparse initializer {w_name!r}: axis {sparse_axis} is not the reduction axis")
        import torch
        vals, pos = compress_rows(np.ascontiguousarray(w_kn.T))
        plan["lin_sparse"] = (torch.from_numpy(vals), torch.from_numpy(pos))
    else:
        plan["lin_b"] = kernels.pack_b(kernels.to_s16(np.ascontiguousarray(w_kn), 0))
    plan["w_fast"] = np.ascontiguousarray(w_kn.T, dtype=np.int16) if sparse_axis is None else None
    return ch_axis, channels


def _plan_bias(g, node, plan, xs, ws, channels) -> bool:
    """``bias_q`` (int32 codes folded into the accumulator) or ``bias_f`` (a float32 add) into
    ``plan``; False if the bias is not one the group can take."""
    plan["bias_q"] = plan["bias_f"] = None
    if not (len(node.input) > 2 and node.input[2]):
        return True
    bname = g.through_identity(node.input[2])
    dqb = g.producer(bname)
    if _is_dq(dqb):
        bq, bs, bz = g.const(dqb.input[0]), g.const(dqb.input[1]), g.const_opt(dqb, 2)
        if bq is None or bs is None or bq.dtype != np.int32 or bq.size != channels:
            return False
        if bz is not None and np.any(bz != 0):
            return False
        want = (np.float32(xs.reshape(())) * ws.reshape(-1).astype(np.float32)).astype(np.float32)
        if np.array_equal(np.broadcast_to(bs.reshape(-1), (channels,)), np.broadcast_to(want, (channels,))):
            plan["bias_q"] = bq.reshape(-1).astype(np.int64)
        else:
            plan["bias_f"] = quant.dequantize(bq.reshape(-1), bs.reshape(-1) if bs.size > 1 else bs,
                                              None, axis=0).astype(np.float32).reshape(-1)
        return True
    b = g.const(bname)
    if b is None or b.dtype != np.float32 or b.size != channels:
        return False
    plan["bias_f"] = b.reshape(-1).astype(np.float32)
    return True


def _pc_shape(ndim, axis, size):
    s = [1] * ndim
    s[axis % ndim] = size
    return s


def _per_channel(z, channels):
    return z.astype(np.int32).reshape(-1) if z.size > 1 else np.full(channels, int(z.reshape(-1)[0]), np.int32)
