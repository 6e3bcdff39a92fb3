"""Blocked integer groups: a MatMul whose weight is dequantized per block of input channels
(export/SPEC.md §5a, "blocked integer group"), as a chip with one int32 accumulator per block
and a float rescale computes it:

    DQ(x codes, per tensor) -> MatMul(., DQ(w codes [K, N], axis 0, block_size B))
        [-> Relu | Clip] -> QuantizeLinear (one, or k >= 2 reading the same tensor)

Per row m and output channel n, with nb = ceil(K / B) blocks (the last one holds K - (nb-1) B
channels when B does not divide K, as the blocked DequantizeLinear defines it):

    acc_b = sum_{k in block b} (x_q[k] - zp_x) (w_q[k, n] - zp_w[b, n])     exact integers
    t     = (((acc_0 s_0 + acc_1 s_1) + acc_2 s_2) + ...)                  float64, b ascending,
            s_b = float64(s_w[b, n]); each product acc_b * s_b is exact (|acc_b| < 2^29)
    v     = float32(float64(s_x) * t)                                      two roundings (float64, float32)
    q     = clamp(round_half_even(v / s_y) + zp_y, lo, hi)                 float32 division (ONNX Q)

``[lo, hi]`` narrowed by a Relu / Clip as in integer_groups.py. With one block (nb = 1) this is
the per-channel group's ``float32(float64(acc) * (float64(s_x) * float64(s_w)))``: both are the
float64 rounding of the same exact real number, then float32.

When every partial sum of ``x_i w_i s_w`` is exact in float64 whatever the order (the usual
case: _exact_scaled_weight), ``t`` is one float64 matmul of the codes with the pre-scaled weight.
Otherwise the blocks: their sums are exact in float32 arithmetic when every partial sum is an integer below 2^24
(``B * max|x_q - zp_x| * max|w_q - zp_w| < 2^24``, e.g. 8-bit inputs and 4-bit weights, at most
255 x 15, for B up to 4386): one batched float32 matmul of the codes (numpy, any summation order), else float64
(exact below 2^53). Not matched, and left to the float path (a float island): Gemm, 16-bit
input codes, an integer (fixed-point / power-of-two) requantizer, a declared accumulator narrower
than 32 bits, a block sum that could leave 2^29, float16 scales, a scale that is not finite and
positive.

Where the input codes are 8-bit, the session's C++ kernel computes ``v`` and the readers' codes
(blocked_kernel.py, csrc/blocked_gemm.cpp: exact int32 block sums, the float64 combine in ascending
block order, the same numbers on every element); ``value_numpy`` below is the fallback (int4 input
codes, no C++ build) and the kernel's oracle in tests/npu/test_blocked_kernel.py.

The blocked linear with a float output (SPEC §5a): the same input side, the MatMul's output read
by anything but the chain above (a float node, a bias Add, several readers of any kind, a graph
output). ``BlockedFloatStep`` computes the same ``v`` (``BlockedStep.value``) and writes it as the
MatMul's output tensor; its readers run as their own steps.
"""
from __future__ import annotations

import numpy as np

from . import quant
from .group_chain import is_dq, plan_output_chain

_X = {np.dtype(np.int8), np.dtype(np.uint8)} | quant.INT4
#: from this many input rows on, ``value_numpy`` takes the one-matmul path when it is exact. Measured (one
#: thread, numpy float64 on OpenBLAS, the tiny Llama's shapes K 256 / 768, N 128-768): alone, the
#: pre-scaled float64 matmul is faster at every M (8-30 us at M = 1, 160-820 us at M = 128; the
#: float32 blocks 19-46 us and 230-1350 us); in a whole decode step interleaved with other engines
#: (bench/llm_npu.py: the weights leave the cache between runs) the float32 blocks, which read half
#: the weight bytes, made the step 4% faster (11.4-11.7 against 12.1 CPU ms)
EXACT_GEMM_ROWS = 8
_W = _X


def _positive(s) -> bool:
    return s is not None and s.size > 0 and bool(np.all(np.isfinite(s)) and np.all(s > 0))


def _input_side(g, node):
    """The plan of the input side (module doc's conditions on the codes, scales, requantizer and the
    2^29 block bound) of a MatMul ``node`` with a blocked weight, else None."""
    if node.op_type != "MatMul" or node.domain not in ("", "ai.onnx") or len(node.input) != 2:
        return None
    dqx, dqw = g.producer(node.input[0]), g.producer(node.input[1])
    if not (is_dq(dqx) and is_dq(dqw)) or g.attrs(dqx).get("block_size", 0):
        return None
    bsz = int(g.attrs(dqw).get("block_size", 0))
    if bsz <= 0:
        return None
    xs, xz = g.const(dqx.input[1]), g.const_opt(dqx, 2)
    wq, ws, wz = g.const(dqw.input[0]), g.const(dqw.input[1]), g.const_opt(dqw, 2)
    if xs is None or xz is None or xs.size != 1 or xz.size != 1 or xs.dtype != np.float32 or xz.dtype not in _X:
        return None
    if wq is None or ws is None or wq.ndim != 2 or wq.dtype not in _W or ws.dtype != np.float32:
        return None
    if g.attrs(dqw).get("axis", 1) % 2 != 0:
        return None
    k, n = wq.shape
    nb = -(-k // bsz)
    if ws.shape != (nb, n) or (wz is not None and (wz.shape != (nb, n) or wz.dtype != wq.dtype)):
        return None
    if not (_positive(xs) and _positive(ws)):
        return None
    rq = g.requantizer
    if rq.integer or (rq.accumulator_bits is not None and rq.accumulator_bits < 32):
        return None
    x_dtype = xz.dtype
    zx = int(xz.reshape(-1)[0])
    qmin, qmax = quant.int_range(x_dtype)
    x_max = max(zx - qmin, qmax - zx)
    blk = np.arange(k) // bsz
    wd = wq.astype(np.int64) - (wz.astype(np.int64)[blk] if wz is not None else 0)
    w_max = int(np.abs(wd).max()) if wd.size else 0
    bound = bsz * x_max * w_max
    if bound >= 2**29:
        return None
    return {"op": "MatMul", "blocked": True, "x_name": dqx.input[0], "x_dtype": x_dtype,
            "x_scale": np.float32(xs.reshape(())), "x_zp": zx, "k": k, "channels": n,
            "block_size": bsz, "w_int": wd, "w_scale": ws.astype(np.float64),
            "exact_f32": bound < 2**24, "x_bound": x_max,
            # group_chain.bias_add takes no bias for a blocked weight: the sentinel stops it
            "bias_q": None, "bias_f": "blocked"}


def match(g, node):
    """A list of plans for MatMul ``node`` with a blocked weight (module doc), else None: one per
    QuantizeLinear reader of a blocked group, or, when the input side holds but the MatMul's output
    is read by anything else (a float op, a bias Add, several readers, a graph output), one plan
    with ``float_out`` set: the blocked linear with a float output, whose step writes ``v`` as the
    MatMul's own output and absorbs none of its readers (``op_out`` / ``act_out`` None)."""
    base = _input_side(g, node)
    if base is None:
        return None
    plan = dict(base)
    if (plan_output_chain(g, node, plan) and not plan["bias_add"] and plan["post"] is None
            and all(_positive(g.const(q.input[1])) for q in plan["q_readers"])):
        plan["bias_f"] = None
        return [dict(plan, q_out=q.output[0], q_node=q, y_scale=np.float32(g.const(q.input[1]).reshape(())),
                     y_zp=int(g.const_opt(q, 2).reshape(-1)[0]), y_dtype=g.const_opt(q, 2).dtype, q_readers=[q])
                for q in plan["q_readers"]]
    return [dict(base, bias_f=None, float_out=True, v_out=node.output[0], op_out=None, act_out=None,
                 act_lo=None, act_hi=None, post=None, q_readers=[])]


def _exact_scaled_weight(wd, ws, block, x_max):
    """``w_int[k, n] * s_w[b(k), n]`` as float64 [K, N] when a float64 matmul of the input codes
    with it computes ``t`` of the module doc exactly, whatever its summation order; else None.

    Write each scale as ``m * 2^q`` (m an integer below 2^24). Every product ``x_i * w_i * s_w``
    is exact (at most 8 + 8 + 24 bits) and a multiple of ``2^Q``, Q the smallest q of its column;
    so is every partial sum, in any order. When the column's bound ``sum_b B x_max max|w_i| s_b``
    is below 2^52 units of 2^Q, every partial sum is exact: the matmul returns the exact real sum,
    which is also what the ascending float64 sum of the module doc returns (its partial sums
    are exact too). Trained INT4 scales of one column lie within a few binades (about 2^45
    units on the tiny Llama), so this holds there; adversarial scales fall back to the blocks."""
    k, n = wd.shape
    if wd.size == 0:
        return None
    nb = ws.shape[0]
    _, e = np.frexp(ws)  # ws = f * 2^e, f in [0.5, 1): q = e - 24
    q_min = (e - 24).min(axis=0)
    pad = nb * block - k
    wmax = np.abs(np.pad(wd, ((0, pad), (0, 0)))).reshape(nb, block, n).max(axis=1)
    bound = (float(block) * x_max * wmax * ws).sum(axis=0) * np.exp2(-q_min.astype(np.float64))
    if not np.all(bound < 2.0 ** 52):
        return None
    blk = np.arange(k) // block
    return np.ascontiguousarray(wd.astype(np.float64) * ws[blk])  # exact: 8 + 24 bits


class BlockedStep:
    """One blocked group (module doc): ``outputs`` are its readers' codes."""

    kind = "fused"
    nhwc_capable, nhwc_in, nhwc_out = False, (), False

    def __init__(self, g, node, plans: list):
        p = plans[0]
        self.node, self.node_name, self.op = node, node.name, "MatMul"
        self.isa = p.get("isa")
        self.inputs = [p["x_name"]]
        self.float_out = bool(p.get("float_out"))
        self.outputs = [p["v_out"]] if self.float_out else [q["q_out"] for q in plans]
        self.op_out, self.act_out = p["op_out"], p["act_out"]
        self.extra_outputs = [] if self.float_out else [self.op_out] + ([self.act_out] if self.act_out else [])
        self.x_dtype, self.x_zp, self.k = np.dtype(p["x_dtype"]), p["x_zp"], p["k"]
        self.s_x = np.float64(p["x_scale"])
        self.act_lo, self.act_hi = p["act_lo"], p["act_hi"]
        b, k, n = p["block_size"], p["k"], p["channels"]
        nb = -(-k // b)
        self.pad = nb * b - k
        dt = np.float32 if p["exact_f32"] else np.float64
        self.dt = dt
        w = np.pad(p["w_int"], ((0, self.pad), (0, 0)))
        self.w = np.ascontiguousarray(w.reshape(nb, b, n).astype(dt))  # [nb, B, N], exact
        self.s_w = p["w_scale"][:, None, :]  # [nb, 1, N] float64
        self.nb, self.b, self.n = nb, b, n
        self.w_exact = _exact_scaled_weight(p["w_int"], p["w_scale"], b, p["x_bound"])
        self.readers = []
        for q in ([] if self.float_out else plans):
            ys, yz = np.float32(q["y_scale"]), int(q["y_zp"])
            qmin, qmax = quant.int_range(q["y_dtype"])
            one = lambda v: int(quant.quantize(np.float32(v), ys, np.array(yz), q["y_dtype"]))
            lo = max(qmin, one(self.act_lo)) if self.act_lo is not None else qmin
            hi = min(qmax, one(self.act_hi)) if self.act_hi is not None else qmax
            self.readers.append((q["q_out"], ys, yz, lo, hi, np.dtype(q["y_dtype"])))
        # the C++ kernel (blocked_kernel.py: the same numbers, packed once here); None: numpy below
        from .blocked_kernel import make
        self.kernel = make(p, self.readers, self.isa)

    def _w_exact_t(self):
        """``w_exact`` as a torch tensor sharing its memory (made on first use)."""
        wt = self.__dict__.get("_wt")
        if wt is None:
            import torch
            wt = self._wt = torch.from_numpy(self.w_exact)
        return wt

    def value(self, xq, threads: int = 1):
        """``v`` (float32, shape ``xq.shape[:-1] + (N,)``) of the module doc for codes ``xq``: by the
        C++ kernel (``self.kernel``, blocked_kernel.py) where there is one, else :meth:`value_numpy`."""
        self._check(xq)
        if self.kernel is not None:
            return self.kernel.value(xq, threads)
        return self.value_numpy(xq)

    def _check(self, xq):
        from .errors import NPUError
        if xq.dtype != self.x_dtype:
            raise NPUError(f"node {self.node_name!r}: input codes are {xq.dtype}, the zero point "
                           f"says {self.x_dtype}")
        if xq.ndim < 1 or xq.shape[-1] != self.k:
            raise NPUError(f"node {self.node_name!r}: input shape {xq.shape} does not match "
                           f"reduction length {self.k}")

    def value_numpy(self, xq):
        """:meth:`value` by numpy (the fallback, and the C++ kernel's oracle in tests/npu)."""
        self._check(xq)
        rows = xq.size // self.k if self.k else 0
        # one float64 matmul, exact in any order (_exact_scaled_weight): the same numbers as the
        # blocks; for a few rows (a decode step) the float32 blocks are faster (EXACT_GEMM_ROWS)
        if self.w_exact is not None and rows >= EXACT_GEMM_ROWS:
            x = xq.reshape(-1, self.k).astype(np.float64)
            if self.x_zp:
                x -= np.float64(self.x_zp)  # exact
            # torch's float64 mm: any order gives the exact sum here, and it beat numpy's (OpenBLAS)
            # on these shapes (a 128-token prefill of the tiny Llama: 31.4 against 33.3 CPU ms);
            # like numpy's, its thread count is the process's (torch.set_num_threads), not ``threads``
            import torch
            t = torch.mm(torch.from_numpy(x), self._w_exact_t()).numpy()
            t *= self.s_x
            return t.astype(np.float32).reshape(xq.shape[:-1] + (self.n,))
        x2 = xq.reshape(-1, self.k).astype(self.dt) - self.dt(self.x_zp)  # exact
        if self.pad:
            x2 = np.pad(x2, ((0, 0), (0, self.pad)))
        m = x2.shape[0]
        xb = x2.reshape(m, self.nb, self.b).transpose(1, 0, 2)  # [nb, M, B]
        acc = np.matmul(xb, self.w)  # [nb, M, N]: exact integers (module doc)
        # float64, blocks in ascending order, one block at a time (each product exact)
        t = np.multiply(acc[0], self.s_w[0], dtype=np.float64)
        p = np.empty_like(t)
        for j in range(1, self.nb):
            np.multiply(acc[j], self.s_w[j], out=p, dtype=np.float64)
            t += p
        t *= self.s_x
        v = t.astype(np.float32)
        return v.reshape(xq.shape[:-1] + (self.n,))

    def run(self, ins, threads, want_extra=False):
        if (self.kernel is not None and self.kernel.readers is not None and not want_extra
                and not self.float_out):
            self._check(ins[0])  # every reader's codes in the one C++ call
            return dict(zip(self.outputs, self.kernel.codes(ins[0], threads)))
        v = self.value(ins[0], threads)
        if self.float_out:
            return {self.outputs[0]: v}
        out = {}
        for name, ys, yz, lo, hi, dt in self.readers:
            r = np.rint(v / ys)  # float32 division, half to even
            np.clip(r, np.float32(lo - yz), np.float32(hi - yz), out=r)  # then exact small integers
            r += np.float32(yz)
            out[name] = r.astype(dt) if dt not in quant.INT4 else r.astype(np.int32).astype(dt)
        if want_extra:
            out[self.op_out] = v
            if self.act_out:
                lo = -np.inf if self.act_lo is None else self.act_lo
                hi = np.inf if self.act_hi is None else self.act_hi
                out[self.act_out] = np.minimum(np.maximum(v, np.float32(lo)), np.float32(hi)).astype(np.float32)
        return out


class BlockedFloatStep(BlockedStep):
    """The blocked linear with a float output (export/SPEC.md §5a): the blocked group's ``v``
    (float32, the same arithmetic: ``BlockedStep.value``) written as the MatMul's output tensor,
    which every reader (float nodes, a bias Add, several readers, a graph output) then reads. No
    quantizer is part of the step; its readers run as their own steps."""

    kind = "blocked_float"


def blocked_step(g, node, plans: list):
    """The session's step for ``match``'s plans: BlockedFloatStep for a float output, else BlockedStep."""
    return (BlockedFloatStep if plans[0].get("float_out") else BlockedStep)(g, node, plans)
