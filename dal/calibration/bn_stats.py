"""BatchNorm running statistics that were never set (a model built from random weights) are
estimated from the calibration data before any quantizer observes it.

Why (measured, timm ghostnetv2_100 and torchvision mobilenet_v3_small from random weights at
64x64): calibration observes in eval mode, where an untouched BN (mean 0, var 1) passes its
input through nearly unchanged and the random-init activations shrink layer after layer to
~1e-3 ... 1e-2; in a QAT step BN uses batch statistics and the same tensors are ~1. The
quantizers, sized for the eval-mode values, clip the training activations into a tiny range;
the next BN divides that by its tiny batch standard deviation, and the gradient grows by that
factor layer after layer (1e12 against ~1 for the float model). With the statistics estimated
from the data the eval-mode activations are what training sees, and so are the ranges.

The estimate is ``torch.optim.swa_utils.update_bn``'s: each untouched BN is reset, takes
``momentum=None`` (the cumulative average of the batches' statistics) and runs in train mode,
the model under ``torch.no_grad()`` with every quantizer off (the float model); every other
module keeps its mode, every BN whose statistics were set keeps them.
"""
from __future__ import annotations

from typing import Callable, Iterable, Optional

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from ..quantizer import QState, quantizers
from .batches import iter_inputs, run_model


def untouched_batchnorms(model: nn.Module) -> list[tuple[str, _BatchNorm]]:
    """``[(name, bn), ...]``: the BatchNorm modules with running statistics that were never set:
    ``num_batches_tracked == 0``, ``running_mean`` all 0 and ``running_var`` all 1 (torch's
    ``reset_running_stats``). A BN without running statistics is not listed."""
    found = []
    for name, m in model.named_modules():
        if not isinstance(m, _BatchNorm) or not m.track_running_stats or m.running_mean is None:
            continue
        nbt = m.num_batches_tracked
        if (nbt is None or int(nbt) == 0) and not bool(m.running_mean.any()) and bool((m.running_var == 1).all()):
            found.append((name, m))
    return found


def estimate_batchnorm_statistics(model: nn.Module, bns: list[tuple[str, _BatchNorm]], data: Iterable,
                                  num_batches: Optional[int] = None, *, input_fn: Optional[Callable] = None,
                                  progress: bool = True) -> list:
    """Set the running statistics of ``bns`` (from ``untouched_batchnorms``) to the cumulative
    average of the batch mean and (unbiased) variance over ``data``, as
    ``torch.optim.swa_utils.update_bn`` does: for each batch, ``running = running + (batch -
    running) / k`` at batch ``k``. The model runs the float function (quantizers off), under
    no grad; only the modules needed to compute train-mode statistics run in train mode (the
    BNs and the QAT modules holding them, e.g. ``QConvBn2d``). Afterwards the modes, the
    quantizers' states and the BNs' momenta are as before; on an error the BN buffers are too.

    Returns the batches seen as ``[(args, kwargs), ...]`` when ``data`` is a one-shot iterator
    (so that the observation pass can run them again), else ``[]``."""
    one_shot = iter(data) is data
    seen = []
    bn_ids = {id(bn) for _, bn in bns}
    saved = {name: (bn.momentum, {k: v.clone() for k, v in bn.named_buffers(recurse=False)}) for name, bn in bns}
    modes = {path: m.training for path, m in model.named_modules()}
    qstates = [(q, q.state) for _, q in quantizers(model)]
    try:
        for q, _ in qstates:
            q.set_state(QState.OFF)  # the state only: scale, zero point and observer untouched
        model.eval()
        for _, bn in bns:
            bn.reset_running_stats()
            bn.momentum = None
            bn.train()
        for path, m in model.named_modules():
            # a QAT module that folds its BN computes the BN only in train mode
            if any(id(c) in bn_ids for c in m.children()) and hasattr(m, "finish"):
                if getattr(m, "bn_frozen", None) is not None and bool(m.bn_frozen):
                    raise ValueError(f"calibrate: {path} has a frozen BatchNorm whose running statistics were never "
                                     "set; unfreeze it (freeze_bn(False)) or set its statistics first, or pass "
                                     "bn_statistics='keep'")
                m.training = True
        with torch.no_grad():
            for i, (args, kwargs) in enumerate(iter_inputs(data, num_batches, input_fn=input_fn, progress=progress,
                                                           desc="dal.calibrate (BatchNorm statistics)")):
                if one_shot:
                    seen.append((args, kwargs))
                run_model(model, args, kwargs, i, what="calibration batch (BatchNorm statistics)")
    except BaseException:
        for name, bn in bns:
            for k, v in saved[name][1].items():
                getattr(bn, k).copy_(v)
        raise
    finally:
        for name, bn in bns:
            bn.momentum = saved[name][0]
        for path, m in model.named_modules():
            m.training = modes.get(path, m.training)
        for q, state in qstates:
            q.set_state(state)
    return seen
