"""The observation pass every calibration method starts from: data through the model with
observers on and fake quantization off, then each observed quantizer takes its scale."""
from __future__ import annotations

import warnings
from typing import Callable, Iterable, Optional

import torch
from torch import nn

from ..nn.modes import eval_mode
from ..quantizer import QState, quantizers
from .batches import iter_inputs, run_model


def observe_ranges(model: nn.Module, data: Iterable, num_batches: Optional[int] = None, *,
                   input_fn: Optional[Callable] = None, progress: bool = True) -> nn.Module:
    """Every quantizer not ``frozen`` observes ``data`` (eval mode, no grad), then ends its
    observation in ``quantize`` (``FakeQuantizer.end_observation``: scale from its observer).

    A quantizer whose observer saw nothing (its layer never ran on these inputs, e.g. a weight
    used functionally) is turned ``off`` with a warning naming it. Raises ``ValueError`` for a
    model without quantizers, a NaN/Inf batch (before any observer sees it), a batch the model
    fails on, and data that yields no batch. The model gets its modes back afterwards."""
    qs = list(quantizers(model))
    if not qs:
        raise ValueError("calibrate: the model has no FakeQuantizer; call dal.prepare_qat first")
    for _, q in qs:
        if q.state is not QState.FROZEN:
            q.set_state(QState.OBSERVE)
    with eval_mode(model), torch.no_grad():
        batches = iter_inputs(data, num_batches, input_fn=input_fn, progress=progress, desc="dal.calibrate")
        for i, (args, kwargs) in enumerate(batches):
            run_model(model, args, kwargs, i, what="calibration batch")
    unseen = []
    for name, q in qs:
        if q.state is not QState.OBSERVE:
            continue
        if q.fmt.is_scaled and not q.observer.has_data:
            unseen.append(name)
            q.set_state(QState.OFF)
        else:
            q.end_observation(QState.QUANTIZE)
    if unseen:
        # A layer whose forward never runs (its weight used functionally, e.g. torchvision's Swin
        # attention calls F.linear on qkv.weight) cannot be calibrated: turn it off, loudly.
        shown = ", ".join(unseen[:10]) + (" ..." if len(unseen) > 10 else "")
        warnings.warn(f"calibrate: {len(unseen)} quantizer(s) saw no data and were turned off (their layers never "
                      f"ran on these inputs): {shown}", stacklevel=3)
    collapsed, median = collapsed_ranges(qs)
    if collapsed:
        shown = ", ".join(f"{n} ({r:.2g})" for n, r in collapsed[:6]) + (" ..." if len(collapsed) > 6 else "")
        warnings.warn(f"calibrate: {len(collapsed)} activation quantizer(s) observed a range below "
                      f"{COLLAPSE_RATIO:g} x the model's median activation range ({median:.3g}): {shown}. In eval mode "
                      "these tensors all but vanished (random-init BatchNorm statistics do this); a QAT step clips "
                      "nearly every value there and trains almost nothing through it. Calibrate trained weights, or "
                      "set the BatchNorm statistics from data first", stacklevel=3)
    return model


#: an activation range this many times below the model's median is reported as collapsed
COLLAPSE_RATIO = 1e-6


def collapsed_ranges(qs) -> tuple[list, float]:
    """``([(name, range), ...], median)``: the per-tensor activation quantizers whose observed
    range ``r = max(|min_val|, |max_val|)`` is below ``COLLAPSE_RATIO * median`` (the median r
    over all of them), smallest first. Weight and bias quantizers (names ending in ``weight_quant``
    / ``bias_quant``) and observers without a min / max are not counted."""
    ranges = {}
    for name, q in qs:
        obs = getattr(q, "observer", None)
        lo, hi = getattr(obs, "min_val", None), getattr(obs, "max_val", None)
        if (q.state is not QState.QUANTIZE or not q.fmt.is_scaled or lo is None or hi is None or lo.numel() != 1
                or name.endswith(("weight_quant", "bias_quant"))):
            continue
        r = max(abs(float(lo)), abs(float(hi)))
        if r == r and r != float("inf"):  # finite
            ranges[name] = r
    positive = sorted(r for r in ranges.values() if r > 0)
    if len(positive) < 2:
        return [], 0.0
    median = positive[len(positive) // 2]
    low = sorted((r, n) for n, r in ranges.items() if r < COLLAPSE_RATIO * median)
    return [(n, r) for r, n in low], median
