"""The fused CPU path of ``fake_quantize``: one pass forward, one pass backward (STE only).

Same formula and the same bits as the eager ``FakeQuantizeFunction`` (tests/formats check it),
computed by the C++ kernel of ``native.py`` in one sweep over memory instead of five or six:

    v = x / s;  int: c = clamp(round_half_even(v), qmin - zp, qmax - zp);  fp8: c = rne_fp8(clamp(v, -max, max))
    out = c * s;          grad_x = grad_out * mask,   mask = (qmin <= round(v) + zp <= qmax)  (fp8: |v| <= max)

The forward stores the mask packed to one bit per element (1/32 of the input's size), so the
backward reads the incoming gradient and 1/32 more. Where the mask is all ones (nothing was
clipped, as for most activations of a QAT step) the backward returns the incoming gradient
itself: ``g * 1`` is ``g``, signed zeros, infinities and NaN payloads included. The two
exceptions are inputs no float arithmetic produces, or a non-default mode: a signaling NaN
stays signaling (``* 1`` would quiet it), and a subnormal stays under
``torch.set_flush_denormal(True)``. Only the straight-through estimator is
covered: a learnable scale or zero point (LSQ) needs ``v`` and ``c`` in the backward and uses
the eager path, as do CUDA tensors, non-float32 or non-contiguous inputs, per-group
granularity on an axis other than the last, tracing / compiling, and machines where the kernel
could not be built (``dal.formats.native.status()`` says why).

``KernelOutputFunction`` is the same backward for a forward the caller ran in C++ already (a
QAT quantizer's observer step and fake quantization in one call, ``dal.formats.track``).
"""
from __future__ import annotations

import math

import torch
from torch.autograd.function import once_differentiable

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


def plain_tensor(x: torch.Tensor) -> bool:
    """A plain torch.Tensor with storage, outside tracing / compiling: a raw pointer may be used.
    ``torch.func`` transforms (vmap, grad, jacrev) and functionalization wrap tensors that keep
    ``type(x) is torch.Tensor`` but have no storage of their own: their ``data_ptr()`` raises
    (vmap, grad) or is 0 for a non-empty tensor (functionalize)."""
    # nn.Parameter is a plain tensor too (no __torch_function__ of its own): the weights.
    if type(x) not in (torch.Tensor, torch.nn.Parameter) or torch.jit.is_tracing() or torch.compiler.is_compiling():
        return False
    try:
        return x.data_ptr() != 0 or x.numel() == 0
    except (RuntimeError, NotImplementedError):
        return False


def eligible(x, scale, zero_point, fmt: QFormat, gran: Granularity) -> bool:
    """Whether ``fake_quantize`` may take the fused path for these arguments (see module doc)."""
    if scale.requires_grad or zero_point.requires_grad or not (fmt.is_integer or fmt.name in _MODES):
        return False
    return tensor_eligible(x, gran)


def tensor_eligible(x: torch.Tensor, gran: Granularity) -> bool:
    """The part of ``eligible`` that depends on ``x`` alone (a quantizer decides the rest once,
    at its state change): CPU float32 contiguous, not empty, a plain tensor, a layout the kernel
    has, and the kernel loaded."""
    return kernel_layout(x, gran) is not None


def kernel_layout(x: torch.Tensor, gran: Granularity) -> tuple[int, int, int, int] | None:
    """``layout(x.shape, gran)`` where ``tensor_eligible(x, gran)``, else None."""
    if not (x.is_cpu and x.dtype == torch.float32 and x.is_contiguous() and x.numel()):
        return None
    if not plain_tensor(x) or native.library() is None:
        return None
    return layout(x.shape, gran)


def kernel_mode(fmt: QFormat) -> int:
    """The kernel's format mode: 0 for integers, 1 / 2 for FP8 E4M3 / E5M2."""
    return _MODES.get(fmt.name, 0)


def kernel_params(scale, zero_point, fmt: QFormat, qmin, qmax) -> tuple:
    """``(s, lo, hi, mode)`` as the kernel reads them: flat float32 scale, code bounds
    ``lo = qmin - zp`` and ``hi = qmax - zp`` (FP8: -+max), and the kernel's format mode."""
    s = scale.detach().to(torch.float32).contiguous().reshape(-1)
    if fmt.is_float8:
        return s, torch.full_like(s, -fmt.max_value), torch.full_like(s, fmt.max_value), _MODES[fmt.name]
    zp = zero_point.detach()
    zp = torch.round(zp.float()) if zp.is_floating_point() else zp.float()
    zp = zp.reshape(-1).expand(s.shape)
    # The same float32 expressions as the eager path: lo = qmin - zp, hi = qmax - zp.
    return s, (qmin - zp).contiguous(), (qmax - zp).contiguous(), 0


class FusedFakeQuantizeFunction(torch.autograd.Function):
    """Forward / backward of the fused kernel; arguments as ``FakeQuantizeFunction``."""

    @staticmethod
    def forward(ctx, x, scale, zero_point, fmt, gran, qmin, qmax, kp=None):
        # kp: ``kernel_params(scale, zero_point, ...)`` when the caller has them already (dal.quantizer)
        lib = native.library()
        rows, row_len, div, mod = layout(x.shape, gran)
        s, lo, hi, mode = kp if kp is not None else kernel_params(scale, zero_point, fmt, qmin, qmax)
        out = torch.empty_like(x)
        need_mask = ctx.needs_input_grad[0]
        mask = torch.empty(rows * ((row_len + 7) // 8), dtype=torch.uint8) if need_mask else None
        lib.dal_fq_forward(x.data_ptr(), out.data_ptr(), mask.data_ptr() if need_mask else None,
                           rows, row_len, div, mod, s.data_ptr(), lo.data_ptr(), hi.data_ptr(), mode,
                           torch.get_num_threads())
        if need_mask:
            ctx.save_for_backward(mask)
            ctx.identity = bool(lib.dal_mask_all_set(mask.data_ptr(), rows, row_len))
        ctx.rows, ctx.row_len = rows, row_len
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        grad_x = None
        if ctx.needs_input_grad[0]:
            (mask,) = ctx.saved_tensors
            g = grad_out.to(torch.float32).contiguous()
            if ctx.identity:
                return g, None, None, None, None, None, None, None  # nothing clipped: g * 1 is g (module doc)
            grad_x = torch.empty_like(g)
            native.library().dal_fq_backward(g.data_ptr(), mask.data_ptr(), grad_x.data_ptr(),
                                             ctx.rows, ctx.row_len, torch.get_num_threads())
        return grad_x, None, None, None, None, None, None, None


class KernelOutputFunction(torch.autograd.Function):
    """The autograd node of a fake quantization the kernel has already computed (``dal.formats.track``:
    the observer's step and the fake quantization in one C++ call): ``apply(x, done)`` with
    ``done = (out, mask, rows, row_len)`` returns ``out``; the backward is the fused one,
    ``grad_x = grad_out * mask``. ``done`` is a tuple, so autograd does not see ``out`` as an input."""

    @staticmethod
    def forward(ctx, x, done):
        out, mask, ctx.rows, ctx.row_len = done
        ctx.save_for_backward(mask)
        ctx.identity = bool(native.library().dal_mask_all_set(mask.data_ptr(), ctx.rows, ctx.row_len))
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        (mask,) = ctx.saved_tensors
        g = grad_out.to(torch.float32).contiguous()
        if ctx.identity:
            return g, None  # nothing clipped: g * 1 is g (module doc)
        grad_x = torch.empty_like(g)
        native.library().dal_fq_backward(g.data_ptr(), mask.data_ptr(), grad_x.data_ptr(), ctx.rows, ctx.row_len,
                                         torch.get_num_threads())
        return grad_x, None
