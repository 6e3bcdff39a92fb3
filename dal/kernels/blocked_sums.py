"""``dal::blocked_linear``: export/SPEC.md §5a's blocked integer linear (exact int32 block sums, combined in
float64 in ascending block order, times the input scale, rounded once to float32) as one registered op,
with int8 weights; dal.convert's ``BlockedWeights`` calls it for a few rows (a decode step).

``blocked_linear(x, w, s, block, s_x) -> v`` with ``x`` [M, K] float32 holding the input codes minus
their zero point (integers in [-255, 255]: 8-bit codes), ``w`` the weight codes minus zero point as
int8 in :func:`pack`'s layout (``nb = K / block`` blocks, ``N`` columns), ``s`` [nb, N] float32 the
block scales, ``s_x`` the input scale (a Python float, i.e. float64)::

    acc_b[m, n] = sum_{k in block b} x[m, k] w[k, n]                 exact integers (int32 in the kernel:
                                                                     blocks up to KERNEL_BLOCK_MAX)
    t[m, n]     = ((acc_0 s_0 + acc_1 s_1) + acc_2 s_2) + ...         float64, b ascending, no FMA
    v[m, n]     = float32(t[m, n] * s_x)

which is dal/convert/blocked_linear.py's reference loop bit for bit, for any codes and scales (the
reference's float64 block sums are the same exact integers). An ``x`` that is not an integer in
[-255, 255] (NaN included) is refused with a ValueError naming the first such element.

:func:`quantized_blocked_linear` takes the float32 input instead of its codes and makes them in the same
C++ call, as ONNX QuantizeLinear minus the zero point (``clamp(round_half_even(in / float32(s_x)), lo,
hi)``): the eager integer model's decode path, a plain function (one ctypes call) rather than an op.
``dal::quantized_blocked_linear(inp, lo, hi, w, s, block, s_x)`` is that call as an op, for a captured
integer model (dal/convert/compiled.py): one node instead of the codes' five and the sums'. It has no
second way to make the codes: a NaN input or arguments the kernel does not take raise a ValueError
naming them.

CPU: the C++ kernel ``dal_blocked_linear`` (``dal/formats/csrc/blocked_sums.cpp``, built on first
use by ``dal.formats.native.compile_library``, AVX2 ``vpmaddwd`` on int8 weights: a quarter of the
float32 block sums' weight bytes, one call instead of nine torch ops; the quantizing entry takes an
AVX-512 VNNI path where the CPU has it, :func:`vnni`), for float32 ``x`` when the
kernel is built; elsewhere (other devices, no compiler) the generic implementation: the same loop in
plain torch on float64, the same bits. It is a ``torch.library.Library`` op rather than a
``torch.library.custom_op`` for the lower per-call dispatch (bench/results/integer_decode.md); a
fake implementation lets torch.compile / torch.export trace it.
"""
from __future__ import annotations

import ctypes
import functools
import os
from typing import Optional

import torch

from ..formats import native

_SOURCE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "formats", "csrc",
                       "blocked_sums.cpp")
_ABI_VERSION = 3
_status = ["not built yet (built on the first blocked linear that can use it)"]
#: the largest ``|x|`` the op takes: 8-bit input codes minus their zero point
X_MAX = 255
#: the longest block whose int32 sums cannot overflow (``block * 255 * 128 < 2^31``); longer blocks take
#: the generic implementation (float64 sums, exact below 2^53)
KERNEL_BLOCK_MAX = (2 ** 31 - 1) // (X_MAX * 128)


@functools.lru_cache(maxsize=1)
def library() -> Optional[ctypes.CDLL]:
    """The loaded kernel, or None where it cannot be built (:func:`status` says why)."""
    try:
        lib = ctypes.CDLL(native.compile_library(_SOURCE))
    except Exception as e:  # no compiler, compile error, unwritable cache: the generic form still works
        _status[0] = f"building the blocked-linear kernel from {_SOURCE} failed: {e}"
        return None
    if lib.dal_blocked_abi_version() != _ABI_VERSION:
        _status[0] = f"the blocked-linear kernel built from {_SOURCE} has ABI version {lib.dal_blocked_abi_version()}"
        return None
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.dal_blocked_linear.argtypes = [p, i64, p, p, i64, i64, i64, ctypes.c_double, p]
    lib.dal_blocked_linear.restype = i64
    f32 = ctypes.c_float
    lib.dal_blocked_linear_q.argtypes = [p, i64, p, p, i64, i64, i64, f32, f32, f32, ctypes.c_double, p, ctypes.c_int]
    lib.dal_blocked_linear_q.restype = i64
    lib.dal_blocked_vnni.restype = ctypes.c_int
    _status[0] = "built and loaded"
    return lib


@functools.lru_cache(maxsize=1)
def vnni() -> bool:
    """Whether :func:`quantized_blocked_linear` runs on AVX-512 VNNI here (the kernel is built and this CPU
    has it): four products per int32 lane and each weight vector shared by four rows, so the kernel
    outruns a float64 matmul at any number of rows (bench/results/integer_decode.md)."""
    lib = library()
    return lib is not None and bool(lib.dal_blocked_vnni())


def status() -> str:
    """Why the blocked-linear kernel is or is not in use."""
    return _status[0]


def pack(w: torch.Tensor) -> Optional[torch.Tensor]:
    """The integer weight ``w`` [nb, B, N] (integer values, any dtype) in the op's layout: int8
    [nb, ceil(B / 2), N, 2], rows ``2j`` and ``2j + 1`` of each block side by side per column (a
    zero row pads an odd ``B``); None when a value is outside [-128, 127]."""
    if w.numel() and (float(w.min()) < -128 or float(w.max()) > 127):
        return None
    nb, block, n = w.shape
    if block % 2:
        w = torch.cat([w, w.new_zeros(nb, 1, n)], dim=1)
    return w.reshape(nb, -1, 2, n).transpose(2, 3).contiguous().to(torch.int8)


def unpack(w: torch.Tensor, block: int) -> torch.Tensor:
    """:func:`pack`'s inverse as float64 [nb, block, N]."""
    nb, pairs, n, _ = w.shape
    return w.transpose(2, 3).reshape(nb, 2 * pairs, n)[:, :block].double()


def _refuse(x: torch.Tensor, flat: int) -> None:
    raise ValueError(f"dal::blocked_linear: input element {flat} (of {tuple(x.shape)}) is "
                     f"{float(x.reshape(-1)[flat])!r}, not an integer code difference in [-{X_MAX}, {X_MAX}]")


def generic(x: torch.Tensor, w: torch.Tensor, s: torch.Tensor, block: int, s_x: float) -> torch.Tensor:
    """The op in plain torch on any device (module docstring): float64 block sums (exact), the
    ascending float64 combination, the float64 product with ``s_x``, one rounding to float32."""
    bad = ~((x >= -X_MAX) & (x <= X_MAX) & (x == torch.round(x)))
    if bool(bad.any()):
        _refuse(x, int(torch.nonzero(bad.reshape(-1))[0]))
    wd = unpack(w, block).to(x.device)
    nb = wd.shape[0]
    acc = torch.bmm(x.double().reshape(-1, nb, block).transpose(0, 1), wd)  # [nb, M, N], exact
    sd = s.double()
    t = acc[0] * sd[0]
    for b in range(1, nb):
        t = t + acc[b] * sd[b]
    return (t * s_x).float()


def _check(x: torch.Tensor, w: torch.Tensor, s: torch.Tensor, block: int) -> None:
    if x.dim() != 2 or w.dim() != 4 or s.dim() != 2 or w.dtype != torch.int8 or w.shape[3] != 2:
        raise ValueError(f"dal::blocked_linear: x {tuple(x.shape)} must be [M, K], w {tuple(w.shape)} {w.dtype} "
                         "int8 [nb, ceil(block / 2), N, 2] (pack), s [nb, N]")
    nb, pairs, n, _ = w.shape
    if block < 1 or pairs != (block + 1) // 2 or x.shape[1] != nb * block or tuple(s.shape) != (nb, n):
        raise ValueError(f"dal::blocked_linear: x {tuple(x.shape)}, w {tuple(w.shape)}, s {tuple(s.shape)} "
                         f"do not fit block {block} (x [M, nb * block], w [nb, ceil(block / 2), N, 2], s [nb, N])")


_LIB = torch.library.Library("dal", "FRAGMENT")
_LIB.define("blocked_linear(Tensor x, Tensor w, Tensor s, int block, float s_x) -> Tensor")


def _cpu(x, w, s, block, s_x):
    _check(x, w, s, block)
    lib = library()
    if lib is None or x.dtype != torch.float32 or block > KERNEL_BLOCK_MAX:
        return generic(x, w, s, block, s_x)
    x, w, s = x.contiguous(), w.contiguous(), s.float().contiguous()
    out = torch.empty(x.shape[0], w.shape[2], dtype=torch.float32)
    bad = lib.dal_blocked_linear(x.data_ptr(), x.shape[0], w.data_ptr(), s.data_ptr(), w.shape[0], block,
                                 w.shape[2], float(s_x), out.data_ptr())
    if bad:
        _refuse(x, bad - 1)
    return out


def cpu_checked(x, w, s, block, s_x):
    """``dal::blocked_linear``'s CPU implementation called directly (a captured graph's node): refuses a
    tensor that is not on the CPU (a ValueError), as the dispatcher would."""
    if not (x.is_cpu and w.is_cpu and s.is_cpu):
        raise ValueError("dal::blocked_linear: the CPU implementation was handed a tensor on "
                         f"{next(t.device for t in (x, w, s) if not t.is_cpu)}")
    return _cpu(x, w, s, block, s_x)


def _any(x, w, s, block, s_x):
    _check(x, w, s, block)
    return generic(x, w, s, block, s_x)


_LIB.impl("blocked_linear", _cpu, "CPU")
_LIB.impl("blocked_linear", _any, "CompositeExplicitAutograd")


@torch.library.register_fake("dal::blocked_linear")
def _fake(x, w, s, block, s_x):
    return x.new_empty(x.shape[0], w.shape[2], dtype=torch.float32)


def blocked_linear(x: torch.Tensor, w: torch.Tensor, s: torch.Tensor, block: int, s_x: float) -> torch.Tensor:
    """``v`` [M, N] float32 of the module docstring (``dal::blocked_linear``); ``w`` from :func:`pack`."""
    return torch.ops.dal.blocked_linear(x, w, s, block, s_x)


_LIB.define("quantized_blocked_linear(Tensor inp, int lo, int hi, Tensor w, Tensor s, int block, float s_x) -> Tensor")


def quantized_blocked_linear_op(inp: torch.Tensor, lo: int, hi: int, w: torch.Tensor, s: torch.Tensor, block: int,
                                s_x: float) -> torch.Tensor:
    """``v`` [M, N] float32 of :func:`quantized_blocked_linear` as the op ``dal::quantized_blocked_linear``
    (a NaN input raises a ValueError naming the element)."""
    return torch.ops.dal.quantized_blocked_linear(inp, lo, hi, w, s, block, s_x)


def quantized_cpu(inp, lo, hi, w, s, block, s_x):
    """``dal::quantized_blocked_linear`` on the CPU: :func:`quantized_blocked_linear`'s one C++ call. Raises
    a ValueError naming the first NaN of ``inp`` (QuantizeLinear has no code for it), and one naming the
    argument the kernel does not take (a tensor off the CPU included: the captured graph calls this
    directly) instead of computing the codes a second way."""
    why = _why_not(inp, lo, hi, w, s, block)
    if why:
        raise ValueError(f"dal::quantized_blocked_linear: {why}")
    out, bad = _quantized_call(inp.contiguous(), lo, hi, w, s, block, s_x, True)
    if bad:
        raise ValueError(f"dal::quantized_blocked_linear: input element {bad - 1} (of {tuple(inp.shape)}) is NaN: "
                         "ONNX QuantizeLinear has no code for it")
    return out


_LIB.impl("quantized_blocked_linear", quantized_cpu, "CPU")


@torch.library.register_fake("dal::quantized_blocked_linear")
def _quantized_fake(inp, lo, hi, w, s, block, s_x):
    return inp.new_empty(inp.shape[0], w.shape[2], dtype=torch.float32)


def _why_not(inp, lo, hi, w, s, block) -> str:
    """Why :func:`quantized_blocked_linear` cannot take these arguments ("" when it can)."""
    off = [t.device for t in (inp, w, s) if not t.is_cpu]
    if off:
        return f"the CPU implementation was handed a tensor on {off[0]}"
    if library() is None:
        return status()
    if inp.dtype != torch.float32 or s.dtype != torch.float32:
        return f"inp ({inp.dtype}) and s ({s.dtype}) must be float32"
    try:
        _check(inp, w, s, block)  # the shapes dal::blocked_linear takes
    except ValueError as e:
        return str(e).removeprefix("dal::blocked_linear: ")
    if not -X_MAX <= lo <= hi <= X_MAX:
        return f"code range [{lo}, {hi}] is not within [-{X_MAX}, {X_MAX}]"
    if block > KERNEL_BLOCK_MAX:
        return f"block {block} is longer than the kernel's int32 sums allow ({KERNEL_BLOCK_MAX})"
    return ""


def _quantized_call(inp, lo, hi, w, s, block, s_x, use_vnni) -> tuple:
    """``(v, 0)`` from ``dal_blocked_linear_q`` on arguments :func:`_why_not` accepts (``inp`` contiguous), or
    ``(None, 1 + the flat index of the first NaN)``."""
    out = torch.empty(inp.shape[0], w.shape[2], dtype=torch.float32)
    bad = library().dal_blocked_linear_q(inp.data_ptr(), inp.shape[0], w.data_ptr(), s.data_ptr(), w.shape[0], block,
                                         w.shape[2], s_x, lo, hi, s_x, out.data_ptr(), int(use_vnni))
    return (None, bad) if bad else (out, 0)


def quantized_blocked_linear(inp: torch.Tensor, lo: int, hi: int, w: torch.Tensor, s: torch.Tensor, block: int,
                             s_x: float, use_vnni: bool = True) -> Optional[torch.Tensor]:
    """``v`` of ``blocked_linear(clamp(round_half_even(inp / float32(s_x)), lo, hi), w, s, block, s_x)`` (the
    input codes minus zero point as ONNX QuantizeLinear makes them, a float32 division) in one C++ call
    (``dal_blocked_linear_q``), for a float32 CPU ``inp`` [M, nb * block] (contiguous) and integers
    ``-255 <= lo <= hi <= 255``; None where the kernel is not built, the arguments are not so, or ``inp``
    holds a NaN (no code: the caller's QuantizeLinear refuses it), or ``w`` / ``s`` are not int8 / float32
    CPU tensors (a module moved or cast after convert). Not an op: the eager integer model's
    fast path, its bits the op's; shapes are the caller's to keep (``w``, ``s`` from :func:`pack` for
    ``nb`` blocks of ``block``). The kernel takes its AVX-512 VNNI path where :func:`vnni` and
    ``hi - lo <= 255`` (``use_vnni=False``: the AVX2 / portable path, the same bits)."""
    if not inp.is_contiguous() or _why_not(inp, lo, hi, w, s, block):
        return None
    return _quantized_call(inp, lo, hi, w, s, block, s_x, use_vnni)[0]
