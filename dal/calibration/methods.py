"""Calibration methods beyond the recipe's own observers: percentile, KL, MSE, EasyQuant.

``dal.calibrate(model, data, method=...)`` dispatches here through ``loop.METHODS``
("minmax" runs the recipe's own observers); ``method=None`` means the method the model's
recipe names in its ``calibration:`` section.

* ``percentile``, ``kl``, ``mse`` (level 0): for the duration of the calibration each
  per-tensor quantizer (activations) gets the method's histogram observer; per-channel weight
  quantizers get a per-channel MSE observer under ``mse`` and keep their own (min-max) under
  ``kl`` / ``percentile`` — clipping weights by a percentile or an entropy criterion is not what
  those methods were designed for (TensorRT's entropy calibration also keeps max for weights).
  Formats, granularity, symmetry and narrow range are the quantizer's own.
* ``easyquant`` (level 1): the recipe's calibration, then a per-layer search of scale
  multipliers maximising the cosine similarity of each layer's output with the float model's
  (see ``easyquant.py``).

After a histogram method the recipe's own observer is handed back to the quantizer, *seeded*
with the range the method chose when it is a min-max observer (so that the scale is the
method's, a ``state_dict`` has the keys a fresh ``prepare_qat`` expects, and QAT continues from
the calibrated range with the recipe's observer). Any other observer is replaced by the method's
(histogram observers share their buffer names, so checkpoints still load).

A failure (empty data, a NaN/Inf batch, a batch of the wrong shape) raises a ``ValueError``
naming the problem and leaves every quantizer exactly as it was: state, observer, scale and
zero point. A NaN batch therefore never reaches a saved scale.
"""
from __future__ import annotations

import contextlib
from typing import Callable, Iterable, Optional

import torch
from torch import nn

from ..observers import MinMaxObserver, make_observer
from ..quantizer import quantizers
from .observe import observe_ranges

#: method -> observer used for per-tensor quantizers
HISTOGRAM_METHODS = {"percentile": "percentile", "kl": "kl", "mse": "mse"}


def minmax_calibration(model: nn.Module, data: Iterable, num_batches: Optional[int] = None, *,
                       input_fn: Optional[Callable] = None, progress: bool = True, **method_args) -> nn.Module:
    """The recipe's own observers (min-max or moving-average min-max) over ``data``; takes no
    method arguments (a stray one is refused: it belongs to another method)."""
    if method_args:
        raise TypeError(f"calibrate(method='minmax') takes no method arguments, got {sorted(method_args)}: "
                        "they belong to percentile / kl / mse / easyquant")
    return observe_ranges(model, data, num_batches, input_fn=input_fn, progress=progress)


def histogram_calibration(method: str) -> Callable:
    """The calibration function of histogram method ``method`` ("percentile", "kl", "mse").

    It takes observer arguments (``percentile=99.9``, ``bins=2048``, ``candidates=100``,
    ``stride=8``); see the module docstring for which quantizers get the method's observer.

    Example:
        >>> dal.calibrate(model, loader, num_batches=16, method="kl")   # doctest: +SKIP
    """
    if method not in HISTOGRAM_METHODS:
        raise ValueError(f"{method!r} is not a histogram method ({', '.join(HISTOGRAM_METHODS)})")

    def run(model: nn.Module, data: Iterable, num_batches: Optional[int] = None, *,
            input_fn: Optional[Callable] = None, progress: bool = True, **method_args) -> nn.Module:
        swapped = _swap_observers(model, method, method_args)
        observe_ranges(model, data, num_batches, input_fn=input_fn, progress=progress)
        for q, original in swapped:
            _hand_back(q, original, method)
        return model

    run.__name__ = run.__qualname__ = f"{method}_calibration"
    return run


@contextlib.contextmanager
def preserved_on_error(model: nn.Module):
    """On an exception, put every quantizer's state, observer, scale and zero point back."""
    saved = [(q, q.snapshot()) for _, q in quantizers(model)]
    try:
        yield
    except BaseException:
        for q, snap in saved:
            q.restore(snap)
        raise


def _swap_observers(model: nn.Module, method: str, method_args: dict):
    """Give each calibratable quantizer the method's observer; returns (quantizer, original)."""
    swapped = []
    for _, q in quantizers(model):
        if not q.fmt.is_scaled or q.observer is None or q.state == "frozen":
            continue
        gran = q.granularity
        if gran.axis is not None and (method != "mse" or gran.block_size):
            continue  # per-channel weights keep their own observer (see the module docstring)
        obs = make_observer(HISTOGRAM_METHODS[method], q.fmt, gran, q.symmetric, q.narrow_range, **method_args)
        swapped.append((q, q.observer))
        q.observer = obs.to(_device_of(q))
    return swapped


def _device_of(q) -> torch.device:
    for t in list(q.buffers()) + list(q.parameters()):
        return t.device
    return torch.device("cpu")


@torch.no_grad()
def _hand_back(q, original, method: str) -> None:
    """Return the recipe's observer to ``q`` seeded with the method's range (see module docstring)."""
    method_obs = q.observer
    if not method_obs.has_data:
        q.observer = original  # never ran (the loop turned the quantizer off): nothing to seed
        return
    if isinstance(original, MinMaxObserver) and original.granularity == method_obs.granularity:
        lo, hi = method_obs.observed_range()
        lo = torch.where(torch.isfinite(lo), lo, torch.zeros_like(lo)).float()
        hi = torch.where(torch.isfinite(hi), hi, torch.zeros_like(hi)).float()
        seed_range(original, lo, torch.maximum(hi, lo), int(method_obs.batches_seen))
        original.nonfinite_count.copy_(method_obs.nonfinite_count)
        q.observer = original
    else:
        # A histogram observer (same buffer names, so checkpoints load) or a custom one we cannot
        # seed: keep the method's, whose range made the scale.
        q.observer_name = HISTOGRAM_METHODS[method]


@torch.no_grad()
def seed_range(observer: MinMaxObserver, lo: torch.Tensor, hi: torch.Tensor, batches_seen: int = 1) -> None:
    """Make a min-max observer's running range ``[lo, hi]`` (shaped like its scale) as if it had
    seen ``batches_seen`` batches: its next ``calculate_qparams`` gives the scale of that range."""
    device = observer.nonfinite_count.device
    observer.register_buffer("min_val", lo.detach().clone().to(device))
    observer.register_buffer("max_val", hi.detach().clone().to(device))
    observer.batches_seen.fill_(max(int(batches_seen), 1))
