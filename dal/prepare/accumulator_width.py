"""Accumulator width: warn, naming the layer, when the worst-case integer accumulation of a
conv / linear layer can exceed the hardware's ``accumulator_bits``.

For output channel c of a layer with weight codes ``w[c, k]`` (minus their zero point) over a
reduction of length K, and input codes ``x - zp_x`` in ``[xlo, xhi]``:

    worst(c) = sum_k max(|w[c,k]| * max(|xlo|, |xhi|))   (each product's largest magnitude)
    worst    = max_c worst(c)

The accumulator holds ``[-2^(B-1), 2^(B-1) - 1]``; ``worst > 2^(B-1) - 1`` means some input in
range overflows it (the chip then saturates or wraps, per ``accumulator_overflow``). The
input range is the calibrated zero point's (``max(zp - qmin, qmax - zp)``) when the input
quantizer has one, else the format's widest (e.g. 255 for uint8 affine, 128 for int8). Weight
codes are the calibrated ones, or, before calibration, those the weight quantizer's own
observer proposes for the current weight. The bias is not included (it is added once).
"""
from __future__ import annotations

import copy
import warnings

import torch
from torch import nn


def _weight_codes(mod) -> torch.Tensor | None:
    wq = getattr(mod, "weight_quant", None)
    weight = mod.folded_weight_and_bias()[0] if hasattr(mod, "folded_weight_and_bias") else getattr(mod, "weight", None)
    if wq is None or not wq.fmt.is_integer or not isinstance(weight, torch.Tensor):
        return None
    from ..formats import quantize
    weight = weight.detach().float()
    if not wq.initialized:
        wq = copy.deepcopy(wq)
        wq.observer(weight)
        wq.compute_qparams()
    scale, zp = wq.effective_qparams()
    codes = quantize(weight, wq.fmt, scale, zp, wq.granularity, wq.narrow_range).double()
    zps = zp.double().reshape([-1] + [1] * (codes.dim() - 1)) if zp.numel() > 1 else zp.double()
    return codes - zps


def _input_span(q) -> float | None:
    if q is None or not q.fmt.is_integer:
        return None
    if q.initialized:
        zp = float(q.effective_qparams()[1].reshape(-1)[0])
    else:
        zp = 0.0 if q.fmt.signed or q.symmetric else float(q.qmin)  # affine: any zp, the widest
        if not q.fmt.signed and q.symmetric:
            zp = float((q.qmin + q.qmax + 1) // 2)
    return max(zp - q.qmin, q.qmax - zp)


def worst_case_accumulation(mod: nn.Module) -> tuple[float, int] | None:
    """``(worst |accumulator|, reduction length K)`` of a conv / linear QAT module, or None
    when it has no integer weight and input quantizers."""
    codes = _weight_codes(mod)
    span = _input_span(getattr(mod, "input_quant", None))
    if codes is None or span is None or codes.dim() < 2:
        return None
    axis = getattr(mod, "weight_channel_axis", 0)
    channels = codes.shape[axis]
    per_channel = codes.abs().movedim(axis, 0).reshape(channels, -1).sum(dim=1)
    return float(per_channel.max()) * span, codes.numel() // channels


def check_accumulators(model: nn.Module, hardware, report=None, warn: bool = True) -> list[str]:
    """One line per layer of ``model`` whose worst case exceeds ``hardware.accumulator_bits``;
    each is also a ``UserWarning`` (``warn``) and a note of ``report`` (when given)."""
    if hardware is None:
        return []
    bits = hardware.accumulator_bits
    limit = 2.0 ** (bits - 1) - 1
    lines = []
    for path, mod in model.named_modules():
        if not hasattr(mod, "weight_quant"):
            continue
        try:
            found = worst_case_accumulation(mod)
        except (RuntimeError, ValueError):
            continue  # a weight quantizer that cannot be evaluated yet (per-channel MSE without data)
        if found is None or found[0] <= limit:
            continue
        worst, k = found
        lines.append(f"{path} ({type(mod).__name__}): worst-case accumulation {worst:.4g} over {k} terms "
                     f"exceeds the {bits}-bit accumulator of {hardware.name!r} (max {limit:.0f}); the chip "
                     f"{'saturates' if hardware.accumulator_overflow == 'saturate' else 'wraps'} there; "
                     "fewer input channels per layer, narrower weights or a smaller input range avoid it")
    for line in lines:
        if warn:
            warnings.warn(f"accumulator overflow possible: {line}", UserWarning, stacklevel=3)
        if report is not None:
            report.notes.append(f"accumulator: {line}")
    return lines
