"""A fused Conv group's kernel call with its arguments built once (integer_groups.FusedStep).

The Python around each short fused conv call (geometry lookup, argument tuple, code-tensor
conversion) runs on one thread whatever the thread count, so it is done once, not per call.
``conv_codes`` makes exactly the call ``FusedStep._run_fast(xq, threads, False, layout)`` makes -- the same function, the same
arguments in the same order -- with everything but the input codes taken from a tuple built
on the first run of each (input shape, layout, threads). The codes are the same bits.
"""
from __future__ import annotations

import numpy as np

from . import kernels

_CODES8 = {np.dtype(np.int8), np.dtype(np.uint8)}
#: cached calls per step (shapes, layouts, thread counts); beyond it the plain path runs
MAX_CALLS = 64


def conv_codes(step, xq, threads: int, layout: int):
    """The output codes of ``step`` (a FusedStep on the fused kernel, op Conv, no accumulator
    model) for 8-bit input codes ``xq`` of its input type, without intermediates; None where
    ``step._run_group`` must decide (other codes, a full cache, the kernel's overflow flag: it
    reruns the group and names the numbers)."""
    calls = step.conv_calls
    call = calls.get((xq.shape, layout, threads)) if xq.dtype == step.x_dtype else None
    if call is None:
        if xq.dtype != step.x_dtype or xq.dtype not in _CODES8 or len(calls) >= MAX_CALLS:
            return None
        call = calls[xq.shape, layout, threads] = conv_call(step, xq.shape, threads, layout)
    fn, from_numpy, tail, shape, nchw_shape = call
    try:
        q = fn(from_numpy(np.ascontiguousarray(xq)), *tail).numpy().reshape(shape)
    except RuntimeError:
        return None
    step.out_shape = nchw_shape  # what _run_fast leaves for codes_of_rows / rows_to_output
    return q if q.dtype == step.y_dtype else q.astype(step.y_dtype)


def conv_call(step, x_shape: tuple, threads: int, layout: int) -> tuple:
    """(qconv, torch.from_numpy, the arguments after the codes, output shape, NCHW output shape)
    of ``step._run_fast``'s call on 8-bit codes of shape ``x_shape`` (layout bit 0: [N, H, W, C]
    in, bit 1: [N, OH, OW, C] out); the geometry checked as there (kernels.check_conv_attrs)."""
    import torch
    from .build import kernels as lib
    strides, dil, pads = step.conv_geo
    key = (x_shape, layout & 1)
    geo = step.fast_geo.get(key)
    if geo is None:
        shape = x_shape if not layout & 1 or len(x_shape) != 4 else tuple(x_shape[i] for i in (0, 3, 1, 2))
        geo = step.fast_geo[key] = kernels.check_conv_attrs(
            shape, step.conv_w.shape, strides, dil, pads, 1, repr(step.node_name))
    (oh, ow), c, (_, _, kh, kw), n = geo, step.channels, step.conv_w.shape, x_shape[0]
    # kernels.code_tensor passes an 8-bit code tensor's zero point unchanged
    tail = ((step.x_zp, step.fast_b, step.fast_wsum, c, kh, kw, strides[0], strides[1], dil[0], dil[1],
             pads[0], pads[1], oh, ow, step.implicit) + tuple(step.fast_rq)
            + (step.fast_no_acc, threads, step.isa, layout))
    out = (n, oh, ow, c) if layout & 2 else (n, c, oh, ow)
    return lib().qconv, torch.from_numpy, tail, out, (n, c, oh, ow)


def fast_codes(step, xq, threads: int, layout: int):
    """``conv_codes`` for a Conv group; for a Gemm / MatMul group the same cached call of its
    qgemm (``FusedStep._run_fast``'s, without intermediates: the same function and arguments);
    None where ``step._run_group`` must decide."""
    if step.op == "Conv":
        return conv_codes(step, xq, threads, layout)
    if xq.dtype != step.x_dtype or xq.dtype not in _CODES8 or xq.ndim < 1 or xq.shape[-1] != step.k:
        return None
    call = getattr(step, "gemm_call", None)
    if call is None:
        import torch
        from .build import kernels as lib
        # kernels.code_tensor passes an 8-bit code tensor's zero point unchanged
        call = step.gemm_call = (lib().qgemm, torch.from_numpy, (step.x_zp, step.fast_b, step.fast_wsum, step.channels)
                                 + tuple(step.fast_rq) + (step.fast_no_acc,), (step.isa,))
    fn, from_numpy, head, tail = call
    try:
        q = fn(from_numpy(np.ascontiguousarray(xq.reshape(-1, step.k))), *head, threads, *tail).numpy()
    except RuntimeError:
        return None
    q = q.reshape(xq.shape[:-1] + (step.channels,))
    return q if q.dtype == step.y_dtype else q.astype(step.y_dtype)
