"""Exact integer accumulation in torch: convolutions and matrix products of integer codes.

The matrix engine computes ``acc[o] = sum_k (x_k - zp_x) * (w[o, k] - zp_w[o])`` in int32,
exactly. torch has no fast exact int32 convolution, so the integer model runs the float
kernels on integer-valued tensors, where they are exact by construction:

* **CPU: float32 over channel chunks.** Every product of an 8-bit code difference and a weight
  code difference is an integer of at most 255 * 255 < 2^16, exact in float32, and every partial
  sum of one chunk is an integer of magnitude at most ``B = max|x - zp_x| * max_o sum_{k in
  chunk} |w[o, k] - zp_w[o]|``. The chunks (slices of input channels, chosen once per layer from
  the actual weights) keep ``B <= 2^24``, so whatever order the kernel sums in, every partial sum
  is an integer float32 holds exactly. Chunk results (exact integers) are summed in float64
  (exact below 2^53). Trained weights usually fit one or two chunks: the same FLOPs as the
  float layer.
* **CUDA: float64**, one call: exact while ``B < 2^53`` (always, for 8-bit codes and K < 2^37),
  and TF32 / Winograd / FFT kernels never see float64.
* Both results are finally rounded to the nearest integer, which repairs any kernel error
  below 0.5 (none is expected: the bound above makes each result exact).

A grouped convolution whose full reduction exceeds the float32 bound runs in float64 on the CPU
too, and so does every call while oneDNN is told to round float32 operands to bf16 / tf32
(``torch.set_float32_matmul_precision`` below "highest", ``torch.backends.mkldnn[.conv|.matmul]
.fp32_precision``): :func:`float32_is_ieee` is read per call, since a user's script may set it
at any time. The caller turns the exact float64 sums into the requantizer's input.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..formats import INT32
from ..formats.qparams import code_range
from .errors import ConvertError

#: integers up to this magnitude are exact in float32, and so is every sum that stays below it
F32_EXACT = 2 ** 24


def float32_is_ieee(op: str) -> bool:
    """Whether torch's CPU float32 ``op`` ("matmul" or "conv") multiplies and adds in float32:
    oneDNN's ``fp32_precision`` for it is "none" / "ieee" (torch resolves "none" from
    ``torch.backends.mkldnn.fp32_precision``); "bf16" or "tf32" round the operands first."""
    return getattr(torch.backends.mkldnn, op).fp32_precision in ("none", "ieee")


def chunk_bounds(w_int: torch.Tensor, x_max: int) -> list[tuple[int, int]]:
    """Slices ``[c0, c1)`` of axis 1 of ``w_int`` ([O, C, ...] weight codes minus zero point)
    such that ``x_max * max_o sum_{c0 <= c < c1} sum_rest |w_int[o, c, ...]| <= 2^24``.

    Returns ``[]`` when a single input channel already exceeds the bound (float64 needed)."""
    per_c = w_int.abs().double().flatten(2).sum(2) * float(x_max)  # [O, C]
    bounds, start, run = [], 0, torch.zeros(per_c.shape[0], dtype=torch.float64)
    for c in range(per_c.shape[1]):
        nxt = run + per_c[:, c]
        if float(nxt.max()) > F32_EXACT:
            if c == start:
                return []
            bounds.append((start, c))
            start, run = c, per_c[:, c].clone()
            if float(run.max()) > F32_EXACT:
                return []
        else:
            run = nxt
    bounds.append((start, per_c.shape[1]))
    return bounds


def conv_exact(x_int: torch.Tensor, w32: torch.Tensor, chunks: list, stride, padding, dilation,
               groups: int) -> torch.Tensor:
    """``conv2d(x_int, w32)`` exactly, as float64 (module docstring). ``x_int``: float32 codes
    minus zero point [N, C, H, W] (zero padding is the zero point's code); ``w32``: float32
    weight codes minus zero point [O, C/g, kh, kw]; ``chunks`` from :func:`chunk_bounds`
    (``[]``: float64)."""
    if x_int.is_cuda or not chunks or not float32_is_ieee("conv"):
        return F.conv2d(x_int.double(), w32.double(), None, stride, padding, dilation, groups).round_()
    if len(chunks) == 1:
        return F.conv2d(x_int, w32, None, stride, padding, dilation, groups).round_().double()
    acc = None
    for c0, c1 in chunks:
        part = F.conv2d(x_int[:, c0:c1], w32[:, c0:c1], None, stride, padding, dilation, groups)
        acc = part.round_().double() if acc is None else acc.add_(part.round_())
    return acc


def linear_exact(x_int: torch.Tensor, w32: torch.Tensor, chunks: list) -> torch.Tensor:
    """``x_int @ w32.T`` exactly, as float64; ``w32`` [O, K], ``chunks`` slices of K."""
    if x_int.is_cuda or not chunks or not float32_is_ieee("matmul"):
        return torch.matmul(x_int.double(), w32.double().t()).round_()
    acc = None
    for k0, k1 in chunks:
        xs, ws = (x_int, w32) if len(chunks) == 1 else (x_int[..., k0:k1], w32[:, k0:k1])
        part = torch.matmul(xs, ws.t())
        acc = part.round_().double() if acc is None else acc.add_(part.round_())
    return acc


#: what a B-bit accumulator does with an exact sum outside its range
OVERFLOWS = ("saturate", "wrap")


def limit(acc: torch.Tensor, bits, overflow: str) -> torch.Tensor:
    """The exact sum ``acc`` (float64 integer values, bias included) as the hardware's ``bits``-wide
    accumulator holds it (export/SPEC.md §5, ``dal.accumulator``), before the requantizer:

    * ``saturate``: ``clamp(acc, -2^(B-1), 2^(B-1) - 1)``;
    * ``wrap``: the B-bit two's complement, ``((acc + 2^(B-1)) mod 2^B) - 2^(B-1)``.

    Both are exact: |acc| < 2^53 (float64 integers) and B <= 53 here. ``bits`` None or >= 53:
    ``acc`` unchanged (no accumulator is narrower than the exact float64 sum then).

    >>> limit(torch.tensor([300.0, -300.0, 5.0], dtype=torch.float64), 9, "wrap").tolist()
    [-212.0, 212.0, 5.0]
    """
    if bits is None or bits >= 53:
        return acc
    if overflow not in OVERFLOWS:
        raise ValueError(f"accumulator overflow {overflow!r} is not one of {OVERFLOWS}")
    half = float(1 << (bits - 1))
    if overflow == "saturate":
        return acc.clamp_(-half, half - 1.0)
    a = acc.to(torch.int64) + (1 << (bits - 1))
    return (torch.remainder(a, 1 << bits) - (1 << (bits - 1))).to(torch.float64)


INT32_MIN, INT32_MAX = code_range(INT32, False)  # the int32 accumulator's range, from dal's one format table


def refuse_int32_overflow(acc: torch.Tensor, axis: int, path: str, bias_q=None) -> None:
    """ConvertError naming layer ``path`` when an exact sum ``acc`` (bias included, float64
    integers) leaves int32 on a chip whose accumulator is 32 bits wide (or undeclared) with
    8-bit or narrower input codes: dal.npu refuses such a file at that group rather than wrap
    or saturate silently (dal/npu/bias_overflow.py), so the integer model does too. Declared
    narrower accumulators (``accumulator_bits`` < 32) saturate or wrap instead (:func:`limit`)."""
    lo, hi = torch.aminmax(acc)  # one pass; the details below only on the error path
    if INT32_MIN <= float(lo) and float(hi) <= INT32_MAX:
        return
    bad = (acc > INT32_MAX) | (acc < INT32_MIN)
    worst = torch.maximum(acc - INT32_MAX, INT32_MIN - acc)
    flat = int(torch.argmax(worst.reshape(-1)))
    idx = [int(i) for i in torch.unravel_index(torch.tensor(flat), acc.shape)]
    c, v = idx[axis], float(acc.reshape(-1)[flat])
    chans = sorted({int(i) for i in torch.nonzero(bad.movedim(axis, 0).reshape(acc.shape[axis], -1).any(1))})
    listed = ", ".join(map(str, chans[:8])) + (", ..." if len(chans) > 8 else "")
    code = "" if bias_q is None else f" (bias code {int(bias_q.reshape(-1)[c])})"
    raise ConvertError(f"{path}: accumulator plus bias overflows int32 at {int(bad.sum())} of {acc.numel()} "
                       f"outputs (channels {listed}); channel {c}: {v:.0f}{code} "
                       f"{'> 2^31-1' if v > INT32_MAX else '< -2^31'}. The chip's 32-bit accumulator cannot "
                       "hold it and dal.npu refuses the file; usually a degenerate input scale (calibration "
                       "saw activations ~0) that makes the bias codes huge")
