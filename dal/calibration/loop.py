"""calibrate(model, data): observers see real data; then quantizers start quantizing."""
from __future__ import annotations

import warnings
from typing import Callable, Iterable, Optional

import torch
from torch import nn

from ..nn.modes import eval_mode
from ..prepare.state import quantizers


def _model_inputs(batch, index: int) -> tuple[tuple, dict]:
    """(args, kwargs) for ``model`` from one batch: a tensor, an ``(inputs, targets)`` pair whose
    first element is the input (or a tuple of inputs), or a dict of keyword inputs."""
    if torch.is_tensor(batch):
        return (batch,), {}
    if isinstance(batch, dict):
        return (), batch
    if isinstance(batch, (list, tuple)) and batch:
        first = batch[0]
        if torch.is_tensor(first):
            return (first,), {}
        if isinstance(first, (list, tuple)):
            return tuple(first), {}
        if isinstance(first, dict):
            return (), first
    raise ValueError(f"calibration batch {index} has type {type(batch).__name__}: expected a tensor, an "
                     "(inputs, targets) tuple, or a dict of keyword inputs; pass input_fn=... to unpack it")


def _check_finite(args, kwargs, index: int) -> None:
    for pos, t in list(enumerate(args)) + list(kwargs.items()):
        if torch.is_tensor(t) and t.is_floating_point() and not bool(torch.isfinite(t).all()):
            bad = int((~torch.isfinite(t)).sum())
            raise ValueError(f"calibration batch {index}, input {pos!r}: {bad} NaN/Inf value(s); "
                             "clean the data (scales were not updated from this batch)")


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
            ``num_batches`` when not given here, ``args``); or one of "minmax" (each tensor's
            own observer from the recipe rules: min-max or moving-average min-max),
            "percentile", "kl", "mse", "easyquant" (see ``dal.calibration.methods``), which
            take ``method_args``.

    The model runs in eval mode under ``torch.no_grad()`` and gets its mode back afterwards. A
    batch with NaN/Inf inputs raises before it reaches an observer; an empty ``data`` raises.
    """
    if method is None:
        recipe_cal = getattr(getattr(model, "_dal_recipe", None), "calibration", None)
        if recipe_cal is not None:
            method = recipe_cal.method
            num_batches = recipe_cal.num_batches if num_batches is None else num_batches
            method_args = {**dict(recipe_cal.args), **method_args}
    if method in (None, "recipe", "minmax") and method_args:
        raise TypeError(f"calibrate(method={method!r}) takes no method arguments, got {sorted(method_args)}: "
                        "they belong to percentile / kl / mse / easyquant")
    if method not in (None, "recipe", "minmax"):
        from .methods import calibrate_with_method

        return calibrate_with_method(model, data, method, num_batches=num_batches, input_fn=input_fn,
                                     progress=progress, **method_args)
    qs = list(quantizers(model))
    if not qs:
        raise ValueError("calibrate: the model has no FakeQuantizer; call dal.prepare_qat first")
    for _, q in qs:
        if q.state != "frozen":
            q.set_state("observe")
    seen = 0
    with eval_mode(model):
        from tqdm.auto import tqdm

        it = tqdm(data, total=num_batches, desc="dal.calibrate", disable=not progress, leave=False)
        with torch.no_grad():
            for i, batch in enumerate(it):
                if num_batches is not None and i >= num_batches:
                    break
                args, kwargs = input_fn(batch) if input_fn else _model_inputs(batch, i)
                _check_finite(args, kwargs, i)
                try:
                    model(*args, **kwargs)
                except Exception as err:
                    shapes = [tuple(a.shape) for a in args if torch.is_tensor(a)]
                    raise ValueError(f"calibration batch {i} (input shapes {shapes}) failed in the model: "
                                     f"{type(err).__name__}: {err}") from err
                seen += 1
    if seen == 0:
        raise ValueError("calibrate: data yielded no batch; pass a non-empty DataLoader or list of batches")
    unseen = []
    for name, q in qs:
        if q.state == "observe":
            if q.fmt.is_scaled and not q.observer.has_data:
                unseen.append(name)
                continue
            q.set_state("quantize")
    if unseen:
        # A layer whose forward never runs (its weight used functionally, e.g. torchvision's Swin
        # attention calls F.linear on qkv.weight) cannot be calibrated: turn it off, loudly.
        for name, q in qs:
            if name in unseen:
                q.set_state("off")
        shown = ", ".join(unseen[:10]) + (" ..." if len(unseen) > 10 else "")
        warnings.warn(f"calibrate: {len(unseen)} quantizer(s) saw no data and were turned off (their layers never "
                      f"ran on these inputs): {shown}", stacklevel=2)
    return model
