"""The FP16 / BF16 cast round trip ``float32(half(x))`` in one C++ pass (``dal_fp_cast_round_trip``).

An FP16 island (dal.prepare.fp16_island) rounds its input and output to fp16 on every call:
``x.to(float16).to(float32)`` is two torch kernels and an fp16 temporary per call, a visible part
of a MobileNetV3 QAT step (Hardswish / Hardsigmoid everywhere). The kernel reads float32 and
writes float32 once: F16C's ``vcvtps2ph`` (round to nearest, ties to even) and ``vcvtph2ps`` for
float16, an integer round to nearest even on the low 16 bits for bfloat16, OpenMP over chunks.
The bits are torch's: each value rounded to the nearest float16 / bfloat16, ties to even,
overflow to +-inf, subnormals kept, NaN stays NaN (its payload may differ; torch's does between
its own kernels too). tests/formats/test_formats_fp16_cast.py compares it bit for bit with
torch's conversion.

:func:`kernel_round_trip` returns None where the torch path must run: CUDA or other devices,
non-float32 or non-contiguous input, empty tensors, tracing / compiling / functorch (the
exporter must see the two Casts), no kernel built (``dal.formats.native.status()``), or the
kernel switched off with :func:`use_kernel`.
"""
from __future__ import annotations

from typing import Optional

import torch

from . import native
from .fused import plain_tensor

#: the kernel's ``dtype`` argument of each narrow format
DTYPE_CODES = {torch.float16: 0, torch.bfloat16: 1}
_enabled = True


def use_kernel(enabled: bool = True) -> bool:
    """Switch the C++ round trip on or off for the whole process (off: torch's two casts, the
    reference of tests and benchmarks). Returns the previous setting."""
    global _enabled
    previous, _enabled = _enabled, bool(enabled)
    return previous


def kernel_enabled() -> bool:
    """Whether the C++ round trip is switched on (:func:`use_kernel`); the fused FP16 island
    (dal.formats.island) follows this switch too."""
    return _enabled


def kernel_round_trip(x: torch.Tensor, dtype: torch.dtype) -> Optional[torch.Tensor]:
    """``x.to(dtype).to(torch.float32)`` for ``dtype`` float16 / bfloat16, computed by the C++
    kernel into a new tensor (no autograd); None where the kernel does not apply (module doc)."""
    code = DTYPE_CODES.get(dtype)
    if code is None or not _enabled:
        return None
    # plain_tensor first: under tracing even x.numel() is recorded
    if not plain_tensor(x) or not (x.is_cpu and x.dtype == torch.float32 and x.is_contiguous() and x.numel()):
        return None
    lib = native.library()
    if lib is None:
        return None
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    lib.dal_fp_cast_round_trip(x.data_ptr(), out.data_ptr(), x.numel(), code, torch.get_num_threads())
    return out
