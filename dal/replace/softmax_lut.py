"""Softmax through an exponential lookup table, as an int8 DSP / vector engine runs it.

TFLite-style int8 softmax. The input ``x`` (scores plus additive biases and masks) is quantized
per tensor to codes ``c`` with scale ``s``; on each row the largest code ``c_max`` is found and

    k        = c_max - c                         (0 .. qmax - qmin: 256 values for int8)
    table[k] = float32(exp(-s * k))              (computed in float64, rounded once)
    y        = table[k] / sum_row(table[k])

which is ``softmax(DQ(c))`` evaluated with a table instead of ``exp``: the zero point cancels in
``c_max - c``, and ``exp(DQ(c) - DQ(c_max)) = exp(-s * k)``. There is no output quantizer: the
following matmul's input quantizer (uint8 for P in ``P @ V``) quantizes the probabilities.

Masks. QuantizeLinear saturates ``-inf`` to ``qmin``, which would give a masked entry the
non-zero weight ``exp(-s * (c_max - qmin))``. Entries below ``-MASKED_BELOW`` (``-inf``, or
``torch.finfo(float32).min`` as some libraries write masks) are masks instead: their weight is
exactly 0, and the input quantizer's observer never sees them (observers skip non-finite
values; they are set to ``-inf`` first). Finite large negatives above the threshold (``-1e9``;
torchvision Swin's -100, which NpuShiftedWindowAttention writes as ``-inf`` for this reason)
are ordinary inputs: the observer sees them (they widen the int8 range) and they saturate like
the hardware would saturate them. A row with every entry masked gives NaN, as
``F.softmax`` does.

Export writes ``QuantizeLinear -> DequantizeLinear -> Softmax`` (a deployment compiler maps a
QDQ Softmax to its table softmax); with additive biases or masks the DQ output gets the mask
term ``Clip(x + MASKED_BELOW, max=0)``, which is exactly 0 for every entry above the threshold and
below ``-6e22`` (one ulp of 1e30) for every masked one, so ``Softmax`` gives masked entries 0.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..formats import quantize

#: Inputs below ``-MASKED_BELOW`` are masked positions (probability exactly 0).
MASKED_BELOW = 1e30


def exp_table(scale: torch.Tensor, entries: int) -> torch.Tensor:
    """``table[k] = float32(exp(-scale * k))``, ``k = 0 .. entries - 1``, computed in float64.

    >>> exp_table(torch.tensor(0.5), 3).tolist()  # doctest: +ELLIPSIS
    [1.0, 0.60653..., 0.36787...]
    """
    k = torch.arange(entries, dtype=torch.float64, device=scale.device)
    return torch.exp(-scale.detach().double().reshape(()) * k).float()


def _normalised(table: torch.Tensor, k: torch.Tensor, masked, dim: int) -> torch.Tensor:
    e = table[k]
    if masked is not None:
        e = e.masked_fill(masked, 0.0)
    return e / e.sum(dim=dim, keepdim=True)


class _TableSoftmax(torch.autograd.Function):
    """Forward: ``table[k] / sum(table[k])`` (masked entries 0). Backward: the gradient of ``y``
    (``F.softmax`` at the quantized input, with the quantizer's STE behind it)."""

    @staticmethod
    def forward(ctx, y, table, k, masked, dim):
        return _normalised(table, k, masked, dim)

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None, None, None


def lut_softmax(module, x: torch.Tensor, has_addends: bool) -> torch.Tensor:
    """The forward of an :class:`~dal.replace.softmax.NpuSoftmax` in mode ``"lut"``.

    ``x`` already holds the additive biases / masks (``has_addends``: some were given, so
    masked entries are possible). Table values when ``module.uses_table()``; otherwise (observe /
    off states, formats the table cannot hold) ``F.softmax`` of the input quantizer's output.
    """
    q, dim = module.input_quant, module.dim
    if torch.onnx.is_in_onnx_export() or torch.jit.is_tracing():
        xq = q(x)
        if has_addends:  # masks: see the module docstring
            xq = xq + torch.clamp(x + MASKED_BELOW, max=0.0)
        return F.softmax(xq, dim=dim)
    masked = None
    if has_addends:
        masked = x < -MASKED_BELOW
        x = x.masked_fill(masked, float("-inf"))  # observers skip non-finite values
    xq = q(x)
    if masked is not None:
        xq = xq.masked_fill(masked, float("-inf"))  # the quantizer saturated them to qmin
    if not module.uses_table():
        return F.softmax(xq, dim=dim)
    scale, zp = module.input_params()
    codes = quantize(xq.detach(), q.fmt, scale, zp).to(torch.int32)  # exact: xq is on the grid
    k = (codes.amax(dim=dim, keepdim=True) - codes).long()
    table = exp_table(scale, q.qmax - q.qmin + 1)
    if not (torch.is_grad_enabled() and xq.requires_grad):
        return _normalised(table, k, masked, dim)  # inference: no F.softmax needed for a gradient
    return _TableSoftmax.apply(F.softmax(xq, dim=dim), table, k, masked, dim)
