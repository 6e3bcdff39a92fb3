"""calibrate(model, data): observers see real data; then quantizers start quantizing.

``calibrate`` resolves the method (the call's, else the recipe's ``calibration:`` section) and
dispatches through ``METHODS``; no method calls ``calibrate`` back: each starts from
``observe.observe_ranges``.
"""
from __future__ import annotations

from typing import Callable, Iterable, Optional

from torch import nn

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
              **method_args) -> nn.Module:
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
    with preserved_on_error(model):
        return METHODS[method](model, data, num_batches, input_fn=input_fn, progress=progress, **method_args)
