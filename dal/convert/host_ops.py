"""The integer model's host calls as torch operators, for a captured graph (dal/convert/compiled.py).

Three calls of the eager integer model leave torch: dal.formats' C++ fake quantization of a frozen
per-tensor quantizer and its float16 / bfloat16 cast round trip (quant_calls.py ``_direct``), and
numpy's float32 ``exp`` of the softmax island (attention.py ``exp_f32``: no torch kernel gives its
bits). ``torch.compile`` cannot trace a ctypes or numpy call; as operators of a ``torch.library``
namespace (``dal_convert``), with a fake (shape-only) implementation, each is one opaque node of the
graph that runs the very same call:

* ``dal_convert::fake_quant_fixed(x, scale, zero_point, qmin, qmax, fp8_max, mode)``: ``dal_fq_forward_fixed``
  on ``x`` (float32, made contiguous) with one scale and zero point (float32 / int32, one element each);
* ``dal_convert::cast_round_trip(x, code)``: ``dal_fp_cast_round_trip`` (code 0: float16, 1: bfloat16);
* ``dal_convert::exp_f32(x)``: ``np.exp`` of the float32 C-contiguous array;
* ``dal_convert::matmul_f64(x, w_nk)``: ``x [..., K] @ w_nk.t()`` as matmul_f64.py's ``matmul_f64`` computes
  it (numpy's float64 matmul of C-contiguous operands, the weight's ``[K, N]`` copy kept per tensor),
  float64 ``[..., N]``.

The first three return a new contiguous float32 tensor. They are registered by :func:`register` (once, on first
use: nothing at import), CPU only, no autograd (the integer model runs without one).
"""
from __future__ import annotations

import functools

import numpy as np
import torch

from ..formats import native


def _cpu_only(name: str, *tensors) -> None:
    for t in tensors:
        if not t.is_cpu:
            raise ValueError(f"dal_convert::{name}: the CPU implementation was handed a tensor on {t.device}")


def _fake_quant_fixed(x, scale, zero_point, qmin: float, qmax: float, fp8_max: float, mode: int):
    _cpu_only("fake_quant_fixed", x, scale, zero_point)
    x = x.contiguous()
    out = torch.empty_like(x)
    native.library().dal_fq_forward_fixed(x.data_ptr(), out.data_ptr(), None, 1, x.numel(), 1, 1, scale.data_ptr(),
                                          zero_point.data_ptr(), qmin, qmax, fp8_max, mode, torch.get_num_threads())
    return out


def _cast_round_trip(x, code: int):
    _cpu_only("cast_round_trip", x)
    x = x.contiguous()
    out = torch.empty_like(x)
    native.library().dal_fp_cast_round_trip(x.data_ptr(), out.data_ptr(), x.numel(), code, torch.get_num_threads())
    return out


def _exp_f32(x):
    _cpu_only("exp_f32", x)
    return torch.from_numpy(np.exp(np.ascontiguousarray(x.numpy())))


def _matmul_f64(x, w_nk):
    _cpu_only("matmul_f64", w_nk)
    from .matmul_f64 import matmul_f64, weight_kn_of
    return matmul_f64(x, weight_kn_of(w_nk))


def _matmul_f64_fake(x, w_nk):
    return x.new_empty((*x.shape[:-1], w_nk.shape[0]), dtype=torch.float64)


def _same_shape(x, *args):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@functools.cache
def register() -> bool:
    """Define the ``dal_convert`` operators (module doc); True when dal.formats' kernel is loaded (the
    two quantizer operators need it: without it :func:`available` is False and nothing is captured)."""
    lib = torch.library.Library("dal_convert", "DEF")
    lib.define("fake_quant_fixed(Tensor x, Tensor scale, Tensor zero_point, float qmin, float qmax, float fp8_max, "
               "int mode) -> Tensor")
    lib.define("cast_round_trip(Tensor x, int code) -> Tensor")
    lib.define("exp_f32(Tensor x) -> Tensor")
    for name, fn in (("fake_quant_fixed", _fake_quant_fixed), ("cast_round_trip", _cast_round_trip),
                     ("exp_f32", _exp_f32)):
        lib.impl(name, fn, "CPU")
        torch.library.register_fake(f"dal_convert::{name}", _same_shape, lib=lib)
    lib.define("matmul_f64(Tensor x, Tensor w_nk) -> Tensor")
    lib.impl("matmul_f64", _matmul_f64, "CPU")
    torch.library.register_fake("dal_convert::matmul_f64", _matmul_f64_fake, lib=lib)
    _LIBS.append(lib)  # a Library's registrations last as long as the object
    _READY[0] = native.library() is not None
    return _READY[0]


def direct_calls() -> dict:
    """The CPU implementation of each host operator a captured graph may call, by the graph's call target
    (the operator and its default overload): dal_convert's (:func:`register`) and dal/kernels'
    ``dal::blocked_linear`` / ``dal::quantized_blocked_linear``. Called directly, an implementation returns
    what the operator returns, without the dispatcher's round trip into Python (a few microseconds per
    call); each refuses a tensor that is not on the CPU (a ValueError) as the dispatcher would."""
    from ..kernels import blocked_sums
    register()
    impls = {torch.ops.dal_convert.fake_quant_fixed: _fake_quant_fixed,
             torch.ops.dal_convert.cast_round_trip: _cast_round_trip,
             torch.ops.dal_convert.exp_f32: _exp_f32,
             torch.ops.dal_convert.matmul_f64: _matmul_f64,
             torch.ops.dal.blocked_linear: blocked_sums.cpu_checked,
             torch.ops.dal.quantized_blocked_linear: blocked_sums.quantized_cpu}
    return {**impls, **{op.default: fn for op, fn in impls.items()}}


_LIBS: list = []
#: whether the operators are registered with dal.formats' kernel loaded: a plain flag, read in traced code
_READY = [False]


def available() -> bool:
    """Whether :func:`register` ran and dal.formats' kernel is loaded (a flag: no call into the loader)."""
    return _READY[0]
