"""A fused FP16 island: ``y = h16(act(h16(x)))`` in one C++ pass, and its backward in one.

``h16(t) = t.to(float16).to(float32)``. An FP16 island (dal.prepare.fp16_island) of Hardswish or
Hardsigmoid is, op by op, an FP16 round trip of the input, torch's float32 activation, and an
FP16 round trip of the output: three passes over memory and two fresh tensors forward, and
torch's activation backward (reading the saved ``h16(x)``) behind two identity nodes. In
MobileNetV3 (SSDlite's backbone) these are 20 Hardswish islands over 5.7 M values a step.

:func:`fused_island` computes the same bits in one pass (``csrc/fp16_island.cpp``): forward
reads ``x`` and writes ``y``; the backward reads the incoming gradient and ``x`` (saved; ``h16``
is recomputed in registers) and writes ``grad_x``, with torch's formulas:

    hardswish:    a = h * min(max(h + 3, 0), 6) / 6;   da/dh = 0 (h <= -3), h / 3 + 0.5 (h < 3), 1
    hardsigmoid:  a = min(max(h + 3, 0), 6) / 6;       da/dh = 1/6 (-3 < h < 3), else 0
    grad_x = g * da/dh at h = h16(x)       (both round trips pass the gradient through)

A double backward (``create_graph=True``) takes torch's own differentiable backward op at
``h16(x)`` instead of the kernel, so it behaves as the ops one by one did (Hardswish: the same
second derivative; Hardsigmoid: torch has none for its backward and raises, as it did).

It returns None, and the caller runs the ops one by one, where those are the reference: a NaN
or an infinity in ``h16(x)`` (torch's own kernels then differ between their vector body and
scalar tail, so only torch gives torch's bits), CUDA or other devices, non-float32 or
non-contiguous input, empty tensors, tracing / compiling / functorch (the exporter must see the
Casts), no kernel built (:func:`status`), or this path switched off (:func:`use_fused`, or the
FP16 cast kernel switched off with ``dal.formats.fp_cast.use_kernel(False)``).
tests/formats/test_formats_island.py compares it with the ops one by one, bit for bit.
"""
from __future__ import annotations

import ctypes
import functools
import os
from typing import Optional

import torch

from . import fp_cast, native
from .autograd import fp_cast_fake_quantize
from .fused import plain_tensor

#: the kernel's ``op`` argument of each activation
OPS = {"hardswish": 0, "hardsigmoid": 1}
_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc", "fp16_island.cpp")
_ABI_VERSION = 1
_enabled = [True]
_status = ["not built yet (built on the first fused FP16 island call)"]


def use_fused(enabled: bool = True) -> bool:
    """Switch the fused island on or off for the whole process (off: the ops one by one, the
    reference of tests and benchmarks). Returns the previous setting."""
    previous, _enabled[0] = _enabled[0], bool(enabled)
    return previous


@functools.lru_cache(maxsize=1)
def library():
    """The loaded island kernel (a ``ctypes.CDLL``), or None where it cannot be built or the CPU
    lacks AVX2 / F16C (:func:`status` says why). Built like the fake-quant kernel
    (``native.compile_library``: cached by a hash of source, flags and compiler)."""
    lib, _status[0] = load_library(_SOURCE)
    return lib


def load_library(source: str) -> tuple[Optional[ctypes.CDLL], str]:
    """``(library, status)``: the island kernel built from the C++ file ``source`` with its
    argument types set, or ``(None, why not)``; uncached and without effect on :func:`library`
    (as ``native.load_library``)."""
    try:
        lib = ctypes.CDLL(native.compile_library(source))
    except Exception as e:  # no compiler, compile error, unwritable cache: the ops one by one still work
        return None, f"building the FP16 island kernel from {source} failed: {e}"
    if lib.dal_island_abi_version() != _ABI_VERSION:
        return None, f"the FP16 island kernel built from {source} has an unexpected ABI version"
    if not lib.dal_island_available():
        return None, "the FP16 island kernel needs AVX2 and F16C, which this CPU or compiler lacks"
    p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    lib.dal_island_forward.argtypes = [p, p, i64, i32, i32]
    lib.dal_island_forward.restype = i32
    lib.dal_island_backward.argtypes = [p, p, p, i64, i32, i32]
    lib.dal_island_backward.restype = None
    return lib, "built and loaded"


def status() -> str:
    """Why the fused island kernel is or is not in use."""
    return _status[0]


def fused_island(x: torch.Tensor, op: str) -> Optional[torch.Tensor]:
    """``h16(act(h16(x)))`` for ``op`` "hardswish" / "hardsigmoid", with its backward when ``x``
    needs a gradient (module doc); None where the ops one by one must run instead."""
    code = OPS[op]
    if not (_enabled[0] and fp_cast.kernel_enabled()):
        return None
    # plain_tensor first: under tracing even x.numel() is recorded
    if not plain_tensor(x) or not (x.is_cpu and x.dtype == torch.float32 and x.is_contiguous() and x.numel()):
        return None
    lib = library()
    if lib is None:
        return None
    y = torch.empty_like(x, memory_format=torch.contiguous_format)
    if not lib.dal_island_forward(x.data_ptr(), y.data_ptr(), x.numel(), code, torch.get_num_threads()):
        return None
    if x.requires_grad and torch.is_grad_enabled():
        return _IslandFunction.apply(x, (y, code))
    return y


class _IslandFunction(torch.autograd.Function):
    """The autograd node of an island the kernel has computed: ``apply(x, (y, op))`` returns ``y``
    (in a tuple, so autograd does not see it as an input); backward in one C++ pass."""

    @staticmethod
    def forward(ctx, x, done):
        y, ctx.op = done
        ctx.save_for_backward(x)  # the version counter guards against an in-place write before backward
        return y

    @staticmethod
    def backward(ctx, grad_out):
        (x,) = ctx.saved_tensors
        if torch.is_grad_enabled():
            # create_graph=True (a double backward): torch's own backward op at h16(x), which is
            # differentiable, as the ops one by one were; the same first-order values as the kernel.
            h = fp_cast_fake_quantize(x, torch.float16)  # the input round trip, identity gradient
            backward_op = torch.ops.aten.hardswish_backward if ctx.op == 0 else torch.ops.aten.hardsigmoid_backward
            return backward_op(grad_out, h), None
        g = grad_out.to(torch.float32).contiguous()
        grad_x = torch.empty_like(g)
        library().dal_island_backward(g.data_ptr(), x.data_ptr(), grad_x.data_ptr(), g.numel(), ctx.op,
                                      torch.get_num_threads())
        return grad_x, None
