"""calibrate(model, data): observers see real data; then quantizers start quantizing.

``calibrate`` resolves the method (the call's, else the recipe's ``calibration:`` section) and
dispatches through ``METHODS``; no method calls ``calibrate`` back: each starts from
``observe.observe_ranges``.
"""
from __future__ import annotations

import warnings
from typing import Callable, Iterable, Optional

from torch import nn

from .bn_stats import estimate_batchnorm_statistics, untouched_batchnorms

from .easyquant import easyquant
from .methods import histogram_calibration, minmax_calibration, preserved_on_error

#: method name -> ``fn(model, data, num_batches, *, input_fn, progress, **method_args)``
METHODS: dict[str, Callable] = {
    "minmax": minmax_calibration,
    "percentile": histogram_calibration("percentile"),
    "kl": histogram_calibration("kl"),
    "mse": histogram_calibration("mse"),
    "easyquant": easyquant,
}


def calibrate(model: nn.Module, data: Iterable, num_batches: Optional[int] = None, *,
              input_fn: Optional[Callable] = None, progress: bool = True, method: Optional[str] = None,
              bn_statistics: str = "keep", **method_args) -> nn.Module:
    """Run ``data`` through ``model`` with observers on and fake quantization off, then switch
    every calibrated quantizer to ``quantize``.

    Args:
        data: any iterable of batches (DataLoader of tensors, ``(inputs, targets)`` tuples or
            dicts of keyword inputs, or a list of tensors).
        num_batches: stop after this many batches (default: all).
        input_fn: ``batch -> (args, kwargs)`` for batches of another shape.
        method: None = what the model's recipe says in its ``calibration:`` section (method,
            ``num_batches`` when not given here, ``args``); or one of ``METHODS``: "minmax"
            (each tensor's own observer from the recipe rules: min-max or moving-average
            min-max), "percentile", "kl", "mse", "easyquant" (see ``dal.calibration.methods``
            and ``easyquant``), which take ``method_args``.
        bn_statistics: "keep" (default) or "auto". Under "auto", BatchNorm layers whose
            running statistics were never set (``num_batches_tracked == 0``, ``running_mean``
            all 0, ``running_var`` all 1: a model built from random weights) get them estimated
            from ``data`` first, with a warning naming how many; the model's BN buffers change
            (``calibration.bn_stats``: the cumulative average of the batch statistics, float
            model, as ``torch.optim.swa_utils.update_bn``). BNs whose statistics were set (any
            trained or loaded model) are never touched, so a trained model calibrates as it
            would without this step. Without the estimate, the ranges observed in eval mode are
            those of activations that untouched BNs let shrink to ~1e-3, while a QAT step (batch
            statistics) sees ~1: the quantizers clip training's activations and the gradients
            explode (1e12 against ~1 for the float model on GhostNetV2 at 64x64). "keep" leaves
            the statistics as they are and warns, naming them. "auto" is not the default: each
            process estimates from its own data, so under DDP the ranks' BN buffers would differ.

    The model runs in eval mode under ``torch.no_grad()`` and gets its mode back afterwards. A
    batch with NaN/Inf inputs raises before it reaches an observer; an empty ``data`` raises;
    a method that fails leaves every quantizer as it was (state, observer, scale, zero point).
    It warns, naming them, about quantizers that saw no data (turned off) and about activation
    quantizers whose observed range collapsed below ``observe.COLLAPSE_RATIO`` times the
    model's median range (random-init BatchNorm statistics in eval mode do this; QAT would
    clip nearly every value there).
    """
    if method is None:
        from ..prepare.handle import find_prepared

        handle = find_prepared(model)
        recipe_cal = handle.recipe.calibration if handle is not None else None
        if recipe_cal is not None:
            method = recipe_cal.method
            num_batches = recipe_cal.num_batches if num_batches is None else num_batches
            method_args = {**dict(recipe_cal.args), **method_args}
    method = "minmax" if method in (None, "recipe") else method
    if method not in METHODS:
        raise ValueError(f"calibration method={method!r} is not known; known methods: {', '.join(METHODS)}")
    if bn_statistics not in ("auto", "keep"):
        raise ValueError(f"calibrate: bn_statistics={bn_statistics!r}; expected 'auto' or 'keep'")
    untouched = untouched_batchnorms(model)
    if untouched:
        names = ", ".join(n for n, _ in untouched[:4]) + (" ..." if len(untouched) > 4 else "")
        what = (f"calibrate: {len(untouched)} BatchNorm layer(s) have running statistics that were never set "
                f"(mean 0, var 1, num_batches_tracked 0: random weights?): {names}. ")
        if bn_statistics == "keep":
            warnings.warn(what + "In eval mode their activations differ from a training step's (batch statistics) by "
                          "orders of magnitude, so these ranges will clip QAT's activations and its gradients "
                          "explode; pass bn_statistics='auto' (or train / load weights) to estimate them first",
                          stacklevel=2)
        else:
            seen = estimate_batchnorm_statistics(model, untouched, data, num_batches, input_fn=input_fn,
                                                 progress=progress)
            warnings.warn(what + "Estimated them from the calibration data first (the model's BN buffers changed); "
                          "pass bn_statistics='keep' to leave them", stacklevel=2)
            if seen:  # a one-shot iterator: observe the same batches again
                data, input_fn = seen, _as_is
    with preserved_on_error(model):
        return METHODS[method](model, data, num_batches, input_fn=input_fn, progress=progress, **method_args)


def _as_is(batch):
    """``(args, kwargs)`` recorded by the BN estimate, handed back unchanged."""
    return batch
