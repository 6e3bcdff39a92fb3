"""The fused CPU path of ``fake_quantize``: one pass forward, one pass backward (STE only).

Same formula and the same bits as the eager ``FakeQuantizeFunction`` (tests/formats check it),
computed by the C++ kernel of ``native.py`` in one sweep over memory instead of five or six:

    v = x / s;  int: c = clamp(round_half_even(v), qmin - zp, qmax - zp);  fp8: c = rne_fp8(clamp(v, -max, max))
    out = c * s;          grad_x = grad_out * mask,   mask = (qmin <= round(v) + zp <= qmax)  (fp8: |v| <= max)

The forward stores the mask packed to one bit per element (1/32 of the input's size), so the
backward reads the incoming gradient and 1/32 more. Only the straight-through estimator is
covered: a learnable scale or zero point (LSQ) needs ``v`` and ``c`` in the backward and uses
the eager path, as do CUDA tensors, non-float32 or non-contiguous inputs, per-group
granularity on an axis other than the last, tracing / compiling, and machines where the kernel
could not be built (``dal.formats.native.status()`` says why).
"""
from __future__ import annotations

import math

import torch

from . import native
from .granularity import Granularity
from .qformat import QFormat

_MODES = {"fp8_e4m3": 1, "fp8_e5m2": 2}


def layout(shape: torch.Size, gran: Granularity) -> tuple[int, int, int, int] | None:
    """``(rows, row_len, param_div, param_mod)``: x seen as ``rows`` contiguous rows, row ``r``
    quantized with parameter ``(r // param_div) % param_mod``; None if the kernel cannot do it."""
    n = math.prod(shape)
    axis = gran.normalized_axis(len(shape))
    if axis is None:
        return 1, n, 1, 1
    inner = math.prod(shape[axis + 1:])
    if not gran.block_size:
        return n // inner, inner, 1, int(shape[axis])
    if inner != 1:
        return None  # blocks along a non-last axis: every element of a row has its own scale
    return n // gran.block_size, gran.block_size, 1, n // gran.block_size


def _plain_tensor(x: torch.Tensor) -> bool:
    if type(x) is not torch.Tensor or torch.jit.is_tracing() or torch.compiler.is_compiling():
        return False
    try:
        return not torch._C._functorch.is_functorch_wrapped_tensor(x)
    except AttributeError:  # pragma: no cover - older torch
        return True


def eligible(x, scale, zero_point, fmt: QFormat, gran: Granularity) -> bool:
    """Whether ``fake_quantize`` may take the fused path for these arguments (see module doc)."""
    if not (x.device.type == "cpu" and x.dtype == torch.float32 and x.is_contiguous() and x.numel()):
        return False
    if scale.requires_grad or zero_point.requires_grad or not (fmt.is_integer or fmt.name in _MODES):
        return False
    if not _plain_tensor(x) or layout(x.shape, gran) is None:
        return False
    return native.library() is not None


class FusedFakeQuantizeFunction(torch.autograd.Function):
    """Forward / backward of the fused kernel; arguments as ``FakeQuantizeFunction``."""

    @staticmethod
    def forward(ctx, x, scale, zero_point, fmt, gran, qmin, qmax):
        lib = native.library()
        rows, row_len, div, mod = layout(x.shape, gran)
        s = scale.detach().to(torch.float32).contiguous().reshape(-1)
        if fmt.is_float8:
            lo = torch.full_like(s, -fmt.max_value)
            hi = torch.full_like(s, fmt.max_value)
            mode = _MODES[fmt.name]
        else:
            zp = zero_point.detach()
            zp = torch.round(zp.float()) if zp.is_floating_point() else zp.float()
            zp = zp.reshape(-1).expand(s.shape)
            # The same float32 expressions as the eager path: lo = qmin - zp, hi = qmax - zp.
            lo = (qmin - zp).contiguous()
            hi = (qmax - zp).contiguous()
            mode = 0
        out = torch.empty_like(x)
        need_mask = ctx.needs_input_grad[0]
        mask = torch.empty(rows * ((row_len + 7) // 8), dtype=torch.uint8) if need_mask else None
        lib.dal_fq_forward(x.data_ptr(), out.data_ptr(), mask.data_ptr() if need_mask else None,
                           rows, row_len, div, mod, s.data_ptr(), lo.data_ptr(), hi.data_ptr(), mode,
                           torch.get_num_threads())
        if need_mask:
            ctx.save_for_backward(mask)
        ctx.rows, ctx.row_len = rows, row_len
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        grad_x = None
        if ctx.needs_input_grad[0]:
            (mask,) = ctx.saved_tensors
            g = grad_out.to(torch.float32).contiguous()
            grad_x = torch.empty_like(g)
            native.library().dal_fq_backward(g.data_ptr(), mask.data_ptr(), grad_x.data_ptr(),
                                             ctx.rows, ctx.row_len, torch.get_num_threads())
        return grad_x, None, None, None, None, None, None
