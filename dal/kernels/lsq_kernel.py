"""The CPU kernel of ``dal::fake_quantize_lsq``'s backward (``dal/formats/csrc/lsq.cpp``): build,
load and call.

Nothing happens at import. :func:`library` compiles ``lsq.cpp`` on first use with
``dal.formats.native.compile_library`` (cached by a hash of source, flags and compiler, as the
fake-quant kernel) and loads it through ctypes; a missing compiler or a failed build returns None
(:func:`status` says why) and the op runs its plain-torch form, which keeps the contract of
:mod:`.lsq`. The forward needs no kernel of its own: it is ``dal::fake_quantize``'s
(``dal_fq_forward`` without a mask, :func:`dal.kernels.fake_quant.cpu_kernel`).
"""
from __future__ import annotations

import ctypes
import functools
import os
from typing import Optional

import torch

from ..formats import native
from .fake_quant import kernel_layout, kernel_params

_SOURCE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "formats", "csrc", "lsq.cpp")
_ABI_VERSION = 1
_status = ["not built yet (built on the first CPU backward of dal::fake_quantize_lsq)"]


@functools.lru_cache(maxsize=1)
def library() -> Optional[ctypes.CDLL]:
    """The loaded LSQ backward kernel, or None where it cannot be built (:func:`status`)."""
    try:
        lib = ctypes.CDLL(native.compile_library(_SOURCE))
    except Exception as e:  # no compiler, compile error, unwritable cache: the plain-torch form still works
        _status[0] = f"building the LSQ kernel from {_SOURCE} failed: {e}"
        return None
    if lib.dal_lsq_abi_version() != _ABI_VERSION:
        _status[0] = f"the LSQ kernel built from {_SOURCE} has ABI version {lib.dal_lsq_abi_version()}"
        return None
    p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    lib.dal_lsq_backward.argtypes = [p, p, p, p, p, i64, i64, i64, i64, p, p, p, i32, ctypes.c_double, i32]
    lib.dal_lsq_backward.restype = None
    _status[0] = "built and loaded"
    return lib


def status() -> str:
    """Why the LSQ kernel is or is not in use."""
    return _status[0]


def backward(grad: torch.Tensor, x: torch.Tensor, s: torch.Tensor, zp: torch.Tensor, qmin: float, qmax: float,
             axis: Optional[int], block_size: int, mode: int, grad_scale: float, need_x: bool, need_s: bool,
             need_zp: bool) -> Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """``(dx, ds, dzp)`` of :mod:`.lsq`'s contract by ``dal_lsq_backward`` for the projected ``s`` /
    ``zp``, each empty unless asked (``ds`` / ``dzp`` flat, one value per scale), or None where the
    kernel does not apply: ``x`` and ``grad`` float32 CPU plain tensors with the same strides in a
    layout of the fake-quant kernel (:func:`dal.kernels.fake_quant.kernel_layout`), parameters on
    the CPU, the kernel built."""
    if grad.dtype != torch.float32 or x.dtype != torch.float32 or type(grad) is not torch.Tensor:
        return None
    if not (s.is_cpu and zp.is_cpu and grad.is_cpu) or grad.shape != x.shape or grad.stride() != x.stride():
        return None
    lay = kernel_layout(x, axis, block_size)
    if lay is None or library() is None:
        return None
    rows, row_len, div, mod = lay
    sk, lo, hi = kernel_params(s, zp, qmin, qmax, mode)
    if sk.numel() != mod:
        return None
    dx = torch.empty_like(x) if need_x else x.new_empty(0)  # separate empties: an op's outputs may not alias
    ds = torch.empty(mod if need_s else 0, dtype=torch.float32)
    dzp = torch.empty(mod if need_zp else 0, dtype=torch.float32)
    library().dal_lsq_backward(grad.data_ptr(), x.data_ptr(), dx.data_ptr() if need_x else None,
                               ds.data_ptr() if need_s else None, dzp.data_ptr() if need_zp else None,
                               rows, row_len, div, mod, sk.data_ptr(), lo.data_ptr(), hi.data_ptr(), mode,
                               float(grad_scale), torch.get_num_threads())
    return dx, ds, dzp
