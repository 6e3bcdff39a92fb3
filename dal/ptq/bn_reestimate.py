"""BatchNorm re-estimation after folding (Peters et al. 2023, "QBitOpt"; Nagel et al. 2022,
"Overcoming Oscillations in Quantization-Aware Training", section 4.3).

A QConvBn2d folds ``f = gamma / sqrt(running_var + eps)`` into its weights. After QAT (or after
PTQ changed the weights: AdaRound, equalization) the running statistics describe a network that
no longer exists. Re-estimation resets them and recomputes them as the plain average over
calibration batches, with the quantized weights in place:

    running_mean = mean_b E[y_b],  running_var = mean_b Var[y_b]   (torch's momentum=None rule)

Every quantizer is frozen meanwhile (no scale moves); everything else stays in eval mode.
"""
from __future__ import annotations

from typing import Callable, Iterable, Optional

import torch
from torch import nn

from ..calibration.batches import iter_inputs
from ..nn.conv_bn import QConvBn2d
from ..nn.norm import batch_norm_types
from ..quantizer import quantizer_states


def reestimate_bn(model: nn.Module, data: Iterable, num_batches: Optional[int] = 16, *,
                  input_fn: Optional[Callable] = None, progress: bool = True) -> list[str]:
    """Recompute the running statistics of every BatchNorm (folded in a QConvBn2d or not) of
    ``model`` from ``data``; returns the paths of the BatchNorms re-estimated.

    Example:
        >>> dal.ptq.reestimate_bn(qat_model, train_loader, num_batches=50)   # doctest: +SKIP
    """
    bns = [(n, m) for n, m in model.named_modules() if isinstance(m, batch_norm_types()) and m.track_running_stats]
    if not bns:
        return []
    owners = [m for m in model.modules() if isinstance(m, QConvBn2d)]
    saved = {m: (m.momentum, m.training) for _, m in bns}
    frozen = {m: bool(m.bn_frozen) for m in owners}
    was_training = model.training
    try:
        model.eval()
        for _, m in bns:
            m.reset_running_stats()
            m.momentum = None
            m.train()
        for m in owners:
            m.freeze_bn(False)
            nn.Module.train(m, True)  # the batch-statistics path; m.bn is already in train mode
        with quantizer_states(model, None) as qs, torch.no_grad():
            for q in qs:
                if q.state == "quantize":
                    q.set_state("frozen")
            for args, kwargs in iter_inputs(data, num_batches, input_fn=input_fn, progress=progress,
                                            desc="dal.ptq.reestimate_bn"):
                model(*args, **kwargs)
    finally:
        for m, (momentum, training) in saved.items():
            m.momentum = momentum
        for m in owners:
            m.freeze_bn(frozen[m])
        model.train(was_training)
        for m, (momentum, training) in saved.items():
            m.train(training and was_training)
    return [n for n, _ in bns]
