"""A Linear whose weight is quantized per group of input channels (INT4 blocks of the LLM
recipes), as export/SPEC.md §5a's blocked integer group computes it, in torch.

With ``x_i = x_q - zp_x`` (exact integers), the integer weight ``w_i[k, n] = w_q - zp_w`` and
its float32 scale ``s_w[b, n]`` per block ``b`` of ``B`` input channels (``nb = K / B``; dal's
per-group quantizers need ``B`` to divide ``K``):

    acc_b[m, n] = sum_{k in block b} x_i[m, k] w_i[k, n]      one float64 batched matmul of the
                                                               codes: exact (integers below 2^53)
    t[m, n]     = acc_0 s_0 + acc_1 s_1 + ... + acc_{nb-1} s_{nb-1}
                  float64, added left to right (b ascending); each product exact (|acc_b| < 2^29,
                  s_b a float32)
    v[m, n]     = float32(float64(s_x) * t)

Where every partial sum of ``x_i w_i s_w`` is exact in float64 whatever the order (trained scales:
``exact_scaled_weight``), ``t`` is the exact real sum, so any order gives it: one float64 matmul of
``x_i`` with the pre-scaled weight, or, for a few rows on the CPU (a decode step, fewer than
:data:`BLOCK_ROWS`), the block sums ``acc_b`` as one float32 batched matmul of the codes (exact:
every partial sum is an integer of magnitude at most ``B max|x_i| max|w_i| <= 2^24``) multiplied by
``s_b`` and summed over ``b`` in float64 (half the weight bytes of the float64 weight). Both return
the same ``t``, the same ``v``. Before both, for fewer than :data:`BLOCK_ROWS` rows on the CPU where the
weight code differences fit int8 and the C++ kernel is built: ``dal::blocked_linear``
(dal/kernels/blocked_sums.py), the int32 block sums ``acc_b`` on int8 weights (a quarter of the float32
bytes) combined in float64 left to right as above, the reference loop's ``v`` for any scales. Where that
kernel runs on AVX-512 VNNI (``blocked_sums.vnni()``) and the input codes span at most 256 values, the
layer takes it, input codes included, at any number of rows (a prefill too): it outruns the float64
matmul there (bench/results/integer_decode.md).

The output quantizer then rounds ``v`` (ONNX's float32 division; probe.py finds it) exactly as
the NPU's requantizer ``clamp(round_half_even(v / s_y) + zp_y, lo, hi)`` does (Q is monotone, so
a Relu / Clip applied to ``v`` first changes nothing). When the Linear's output is read by
anything else (a float op, a graph output, its float bias Add on rank > 2 inputs), ``v`` itself
is the MatMul's output: export/SPEC.md §5a's blocked linear with a float output (layers.py
``_blocked_float``). dal.npu computes the same numbers from the file in numpy
(dal/npu/blocked_groups.py); this is written separately from the trained layer.
"""
from __future__ import annotations

from typing import Optional

import torch

from .accumulate import F32_EXACT, float32_is_ieee

#: a block sum at or above this bound would make ``acc_b * s_b`` inexact in float64
ACC_LIMIT = 2 ** 29
#: calls with fewer rows than this take the float32 block sums when they are exact (module doc):
#: on the tiny Llama's decode step (one row, weights 256 x 256 .. 768) they read half the bytes of
#: the float64 pre-scaled weight; at 128 rows (prefill) the one float64 matmul is faster
BLOCK_ROWS = 8
#: the form (``IntegerModel.layer_forms``) of a blocked Linear whose output is read by anything but
#: one or several quantizers: export/SPEC.md §5a's blocked linear with a float output
BLOCKED_FLOAT = "blocked linear, float output (export/SPEC.md §5a)"


def blocked_sums_op(x: torch.Tensor, w8: torch.Tensor, s32: torch.Tensor, block: int, s_x: float) -> torch.Tensor:
    """``dal::blocked_linear`` (dal/kernels/blocked_sums.py: the module doc's ``v`` by exact int32 block
    sums combined in ascending block order), imported on first use."""
    from ..kernels.blocked_sums import blocked_linear
    return blocked_linear(x, w8, s32, block, s_x)


def quantized_blocked_sums_op(x, lo: int, hi: int, w8, s32, block: int, s_x: float) -> torch.Tensor:
    """``dal::quantized_blocked_linear`` (dal/kernels/blocked_sums.py: :func:`quantized_blocked_sums` as one
    op, for a captured graph), imported on first use."""
    from ..kernels.blocked_sums import quantized_blocked_linear_op
    return quantized_blocked_linear_op(x, lo, hi, w8, s32, block, s_x)


def quantized_blocked_sums(x, lo, hi, w8, s32, block: int, s_x: float) -> Optional[torch.Tensor]:
    """dal/kernels/blocked_sums.py ``quantized_blocked_linear`` (input codes and block sums in one call),
    imported on first use."""
    from ..kernels.blocked_sums import quantized_blocked_linear
    return quantized_blocked_linear(x, lo, hi, w8, s32, block, s_x)


def blocked_why_not(kind: str, has_bias: bool, in_bits: int, rq) -> str:
    """Why a Linear with a per-group weight quantizer has no blocked integer group ("" if it has
    one as far as these conditions go; the block-sum bound is checked on the codes)."""
    if kind != "linear":
        return "weight is not 8/4-bit integer codes per tensor or per channel (per group: a Linear's only)"
    if has_bias:
        return "per-group weight with a bias (the blocked group takes none)"
    if in_bits > 8:
        return "per-group weight with 16-bit input codes"
    if rq.kind != "float":
        return f"per-group weight with the {rq.kind} requantizer (the blocked group is float-rescaled)"
    if rq.accumulator_bits is not None and rq.accumulator_bits < 32:
        return f"per-group weight with a {rq.accumulator_bits}-bit accumulator"
    return ""


def exact_scaled_weight(w: torch.Tensor, s_w: torch.Tensor, x_max: int):
    """``w[b, :, n] * s_w[b, n]`` as float64 ``[nb * B, N]`` when one float64 matmul of the input
    integers with it returns ``t`` of the module doc exactly, in any summation order; else None.

    ``w`` [nb, B, N] the integer weight per block, ``s_w`` [nb, N] its float32 scales (as float64).
    Each scale is ``m 2^q`` with an integer ``m < 2^24``, so each product ``x w s`` (at most
    8 + 8 + 24 bits) is exact and a multiple of ``2^Q``, ``Q`` the column's smallest ``q``; when
    ``sum_b B x_max max|w_b| s_b < 2^52 2^Q`` every partial sum in any order is an exact multiple
    of ``2^Q`` too, so the matmul returns the exact real sum, which the ascending block sum also
    is (its partial sums obey the same bound)."""
    nb, block, n = w.shape
    if w.numel() == 0 or not bool(torch.all(s_w > 0)):
        return None
    _, e = torch.frexp(s_w)  # s = f 2^e, f in [0.5, 1): m = f 2^24 an integer, q = e - 24
    q_min = (e - 24).amin(dim=0).double()
    bound = (float(block) * x_max * w.abs().amax(dim=1) * s_w).sum(dim=0) * torch.exp2(-q_min)
    if not bool(torch.all(bound < 2.0 ** 52)):
        return None
    return (w * s_w[:, None, :]).reshape(nb * block, n).contiguous()  # exact: 8 + 24 bits


class BlockedWeights(torch.nn.Module):
    """The integer weight of a per-group quantized Linear, per block (module doc)."""

    def __init__(self, codes: torch.Tensor, zp: torch.Tensor, scale: torch.Tensor, block: int, x_max: int):
        """``codes`` [N, K] the weight codes, ``zp`` / ``scale`` [N, K / block] (or a scalar zero
        point), ``x_max`` the largest ``|x_q - zp_x|`` of the input format."""
        super().__init__()
        n, k = codes.shape
        nb = k // block
        zp_full = zp.double().reshape(-1, 1) if zp.numel() == 1 else zp.double().repeat_interleave(block, dim=1)
        w_int = codes.double() - zp_full  # [N, K] exact
        self.block, self.nb, self.n = block, nb, n
        self.bound = block * x_max * int(w_int.abs().max()) if w_int.numel() else 0
        # [nb, B, N]: block b's rows of the [K, N] weight
        self.register_buffer("w", w_int.t().reshape(nb, block, n).contiguous())
        self.register_buffer("s_w", scale.float().double().t().contiguous())  # [nb, N]
        self.register_buffer("w_exact", exact_scaled_weight(self.w, self.s_w, x_max), persistent=False)
        # the float32 block sums of value()'s few-row path: the integer weight as float32 [nb, B, N] and
        # the scales as [nb, 1, N] float64, made once; None where those sums or their float64 combination
        # in any order would not be exact (module doc)
        f32 = self.w_exact is not None and self.bound <= F32_EXACT
        self.register_buffer("w32", self.w.float().contiguous() if f32 else None, persistent=False)
        self.register_buffer("s_w3", self.s_w.unsqueeze(1).contiguous() if f32 else None, persistent=False)
        # value()'s few-row path on the CPU: dal::blocked_linear's C++ kernel on int8 weights (None where a
        # weight code difference leaves int8, the input codes are wider than 8 bits or the kernel is not built)
        w8, self.vnni = None, False
        if x_max <= 255 and self.bound < 2 ** 31 and n and k:
            from ..kernels import blocked_sums
            w8 = blocked_sums.pack(self.w) if blocked_sums.library() is not None else None
            # input_value at any number of rows where the kernel runs on AVX-512 VNNI (it outruns the float64
            # matmul there): a plain flag, read in traced code
            self.vnni = w8 is not None and blocked_sums.vnni()
        self.register_buffer("w8", w8, persistent=False)
        self.register_buffer("s32", scale.float().t().contiguous() if w8 is not None else None, persistent=False)

    def input_value(self, x: torch.Tensor, s_x: float, lo, hi) -> Optional[torch.Tensor]:
        """``value(clamp(round_half_even(x / float32(s_x)), lo, hi), s_x)``: the input codes minus zero
        point made (ONNX QuantizeLinear, float32 division) and the blocked sums in one C++ call, for fewer
        than :data:`BLOCK_ROWS` rows of float32 on the CPU where ``value`` takes the kernel, and for any number
        of rows where the kernel runs on AVX-512 VNNI (``self.vnni``) and ``hi - lo <= 255``; None elsewhere
        and when ``x`` holds a NaN (the caller makes the codes and refuses it). In a captured graph
        (compiled.py) the ``dal::quantized_blocked_linear`` op, which refuses a NaN itself (a ValueError)."""
        w8 = self.w8
        if w8 is None or x.dtype != torch.float32 or not x.is_cpu:
            return None
        if x.numel() >= BLOCK_ROWS * self.nb * self.block and not (self.vnni and hi - lo <= 255):
            return None
        flat = x.reshape(-1, self.nb * self.block)
        if torch.compiler.is_compiling():
            v = quantized_blocked_sums_op(flat, int(lo), int(hi), w8, self.s32, self.block, s_x)
        else:
            v = quantized_blocked_sums(flat, lo, hi, w8, self.s32, self.block, s_x)
        return None if v is None else v.reshape(*x.shape[:-1], self.n)

    def value(self, xi: torch.Tensor, s_x: float) -> torch.Tensor:
        """``v`` (float32, ``xi.shape[:-1] + (N,)``) for ``xi = x_q - zp_x`` (integers)."""
        lead = xi.shape[:-1]
        w8 = self.w8
        if w8 is not None and xi.device.type == "cpu" and xi.numel() < BLOCK_ROWS * self.nb * self.block:
            # exact int32 block sums, combined in float64 in ascending block order: the reference loop's bits
            v = blocked_sums_op(xi.reshape(-1, self.nb * self.block), w8, self.s32, self.block, s_x)
            return v.reshape(*lead, self.n)
        w32 = self.w32
        if w32 is not None and xi.device.type == "cpu" and xi.numel() < BLOCK_ROWS * self.nb * self.block \
                and float32_is_ieee("matmul"):
            # float32 block sums (exact integers), times s_b and summed over b in float64: the exact t
            x = xi.float().reshape(-1, self.nb, self.block).transpose(0, 1)  # [nb, M, B]
            t = torch.bmm(x, w32).double().mul_(self.s_w3).sum(0)
            return t.mul_(s_x).float().reshape(*lead, self.n)
        w = self.w_exact
        if w is not None:  # one float64 matmul, exact in any order (exact_scaled_weight)
            t = torch.matmul(xi.double().reshape(-1, w.shape[0]), w.to(xi.device))
            return t.mul_(s_x).float().reshape(*lead, self.n)  # s_x a Python float: float64 product
        x = xi.double().reshape(-1, self.nb, self.block).transpose(0, 1)  # [nb, M, B]
        acc = torch.bmm(x, self.w.to(x.device))  # [nb, M, N], exact
        s = self.s_w.to(x.device)
        t = acc[0] * s[0]
        for b in range(1, self.nb):
            t = t + acc[b] * s[b]
        v = (t * torch.tensor(s_x, dtype=torch.float64, device=x.device)).float()
        return v.reshape(*lead, self.n)
