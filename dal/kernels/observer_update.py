"""``dal::observe_minmax_``: a min-max observer's update as one registered op with declared mutations.

For each scale of the granularity (``axis`` None: per tensor; ``block_size`` 0: per channel; else
blocks along ``axis``), with ``lo`` / ``hi`` the smallest / largest FINITE value of ``x`` in it
(+inf / -inf when it has none):

* running extremes (``averaging_constant == 0``): ``min_val = minimum(min_val, lo)``,
  ``max_val = maximum(max_val, hi)``;
* moving average (``0 < averaging_constant = c <= 1``): a slice with no finite value keeps its
  old value; else ``min_val = lo`` where ``min_val`` is not finite yet, and
  ``min_val + c * (lo - min_val)`` otherwise (likewise ``max_val``), in float32;

and ``batches_seen += 1``, ``nonfinite_count += (number of NaN / inf in x)``. These are the updates of
``dal.observers.MinMaxObserver`` / ``MovingAverageMinMaxObserver`` on one process (no all-reduce)
once their buffers exist. ``min_val`` / ``max_val`` are float32 of the scale's shape.

One implementation for every device, in plain torch: minimum, maximum and the EMA are exact or
elementwise float32 expressions whose bits do not depend on the order of a reduction, so a C++
kernel would buy speed only (``dal_track_qparams`` fuses this step with the scale in eager QAT).
"""
from __future__ import annotations

from typing import Optional

import torch

from ..formats.granularity import Granularity


def batch_extremes(x: torch.Tensor, axis: Optional[int], block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-scale (finite min, finite max) of ``x`` in float32; +inf / -inf where a slice has no finite value."""
    x = x.detach().to(torch.float32)
    finite = torch.isfinite(x)
    inf = torch.tensor(float("inf"), dtype=torch.float32, device=x.device)
    for_min, for_max = torch.where(finite, x, inf), torch.where(finite, x, -inf)
    if axis is None:
        return for_min.amin(), for_max.amax()
    if not block_size:
        dims = Granularity(axis).reduce_dims(x.dim())
        if not dims:
            return for_min.clone(), for_max.clone()
        return for_min.amin(dim=dims), for_max.amax(dim=dims)
    shape = list(x.shape)
    shape[axis:axis + 1] = [shape[axis] // block_size, block_size]
    return for_min.reshape(shape).amin(dim=axis + 1), for_max.reshape(shape).amax(dim=axis + 1)


@torch.library.custom_op("dal::observe_minmax_",
                         mutates_args=("min_val", "max_val", "batches_seen", "nonfinite_count"))
def observe_minmax_(x: torch.Tensor, min_val: torch.Tensor, max_val: torch.Tensor, batches_seen: torch.Tensor,
                    nonfinite_count: torch.Tensor, averaging_constant: float, axis: Optional[int],
                    block_size: int) -> None:
    """Update the observer's buffers in place (module docstring). Does not compute a scale:
    ``dal::minmax_qparams`` does."""
    lo, hi = batch_extremes(x, axis, block_size)
    lo, hi = lo.reshape(min_val.shape), hi.reshape(max_val.shape)
    c = averaging_constant
    if c == 0.0:  # an argument, not a tensor value: fixed at trace time
        torch.minimum(min_val, lo, out=min_val)
        torch.maximum(max_val, hi, out=max_val)
    else:
        lo = torch.where(torch.isfinite(lo), lo, min_val)
        hi = torch.where(torch.isfinite(hi), hi, max_val)
        new_min = torch.where(~torch.isfinite(min_val), lo, min_val + c * (lo - min_val))
        new_max = torch.where(~torch.isfinite(max_val), hi, max_val + c * (hi - max_val))
        min_val.copy_(new_min)
        max_val.copy_(new_max)
    nonfinite_count.add_((~torch.isfinite(x)).sum())
    batches_seen.add_(1)


@observe_minmax_.register_fake
def _fake(x, min_val, max_val, batches_seen, nonfinite_count, averaging_constant, axis, block_size):
    return None
