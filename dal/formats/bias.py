"""The int32 bias of a layer with integer input and weight, fake-quantized in one C++ call.

Integer hardware adds the bias in the accumulator: as int32 codes at ``scale = s_in * s_w``
(per output channel when the weight is), zero point 0, which is what the exporter writes and
``QATModule.quantized_bias`` trains against. Written op by op that is about fifteen small torch
ops per layer and step (the scale product, its reshapes, a zero-point tensor, the kernel's
bounds, the autograd node) for a few hundred values, each seen by a torch function mode inside a
detection head. :func:`bias_fake_quantize` is the same numbers in
one call of the C++ kernel (``dal_bias_fq_forward``): the float32 product ``s_in * s_w[c]``,
the bounds ``(float)qmin - 0`` / ``(float)qmax - 0`` and the fused fake quantization, whose
backward is the fused one (``grad * mask``). It returns None where the op-by-op path must run
(no kernel, tracing or compiling, other dtypes, devices or shapes); tests/formats/test_formats_bias.py
compares the two bit for bit, forward and backward.
"""
from __future__ import annotations

from typing import Optional

import torch

from . import native
from .fused import KernelOutputFunction, plain_tensor
from .qformat import INT32
from .qparams import code_range

_QMIN, _QMAX = code_range(INT32, False)


def _cpu_f32(t: torch.Tensor) -> bool:
    return t.dtype == torch.float32 and t.is_cpu and t.is_contiguous()


def bias_fake_quantize(bias: torch.Tensor, s_in: torch.Tensor, s_w: torch.Tensor) -> Optional[torch.Tensor]:
    """``fake_quantize(bias, INT32, s, None, g)`` with ``s = float32(s_in) * float32(s_w)``
    (``s_in`` one value; ``g`` per tensor when ``s_w`` has one value, else per channel of the
    1-D ``bias``, one ``s_w`` value each), scales detached: the gradient reaches ``bias`` only,
    ``d out / d bias = 1`` where ``round(bias / s)`` is within int32, else 0. None where the
    kernel does not apply (module doc)."""
    n, n_w = bias.numel(), s_w.numel()
    if not (bias.dim() == 1 and n and _cpu_f32(bias) and _cpu_f32(s_in) and s_in.numel() == 1 and _cpu_f32(s_w)
            and n_w in (1, n) and plain_tensor(bias)):
        return None
    lib = native.library()
    if lib is None:
        return None
    need = bias.requires_grad and torch.is_grad_enabled()
    rows, row_len = (1, n) if n_w == 1 else (n, 1)
    out = torch.empty_like(bias)
    mask = torch.empty(rows * ((row_len + 7) // 8), dtype=torch.uint8) if need else None
    lib.dal_bias_fq_forward(bias.data_ptr(), out.data_ptr(), mask.data_ptr() if need else None, n, s_in.data_ptr(),
                            s_w.data_ptr(), n_w, float(_QMIN), float(_QMAX))
    return KernelOutputFunction.apply(bias, (out, mask, rows, row_len)) if need else out
