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

A device-generic implementation in plain torch: minimum, maximum and the EMA are exact or
elementwise float32 expressions whose bits do not depend on the order of a reduction. The CPU
implementation reads the batch's extremes first (one ``aminmax`` pass) and, when they are finite
(so is every value), skips the finite masking and the NaN count: the same buffers
(tests/kernels/test_kernels_observe_qparams.py forces both).
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


def all_finite_extremes(x: torch.Tensor, axis: Optional[int], block_size: int
                        ) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
    """:func:`batch_extremes` in one or two passes (``aminmax``; per channel / group ``amin``,
    ``amax``) when every value of ``x`` is finite, else None. amin / amax propagate NaN and keep
    +-inf, so finite extremes everywhere mean a finite ``x``; min and max are exact, so the values
    are batch_extremes'. Reads the extremes on the host: for the CPU implementation only."""
    x = x.detach().to(torch.float32)
    if axis is None:
        lo, hi = torch.aminmax(x)
    elif not block_size:
        dims = Granularity(axis).reduce_dims(x.dim())
        if not dims:
            return None
        lo, hi = x.amin(dim=dims), x.amax(dim=dims)
    else:
        shape = list(x.shape)
        shape[axis:axis + 1] = [shape[axis] // block_size, block_size]
        lo, hi = x.reshape(shape).amin(dim=axis + 1), x.reshape(shape).amax(dim=axis + 1)
    if not bool(torch.isfinite(torch.stack([lo.reshape(-1), hi.reshape(-1)])).all()):
        return None
    return lo, hi


def update_(min_val, max_val, batches_seen, nonfinite_count, lo, hi, nonfinite: Optional[torch.Tensor],
            averaging_constant: float) -> None:
    """The buffers' update from this batch's per-scale finite extremes ``lo`` / ``hi`` and its count of
    NaN / inf (None: none), as the module docstring states."""
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
    if nonfinite is not None:
        nonfinite_count.add_(nonfinite)
    batches_seen.add_(1)


@torch.library.custom_op("dal::observe_minmax_",
                         mutates_args=("min_val", "max_val", "batches_seen", "nonfinite_count"))
def observe_minmax_(x: torch.Tensor, min_val: torch.Tensor, max_val: torch.Tensor, batches_seen: torch.Tensor,
                    nonfinite_count: torch.Tensor, averaging_constant: float, axis: Optional[int],
                    block_size: int) -> None:
    """Update the observer's buffers in place (module docstring). Does not compute a scale:
    ``dal::minmax_qparams`` does."""
    generic(x, min_val, max_val, batches_seen, nonfinite_count, averaging_constant, axis, block_size)


def generic(x, min_val, max_val, batches_seen, nonfinite_count, averaging_constant: float, axis: Optional[int],
            block_size: int) -> None:
    """The op's device-generic implementation (plain torch, no host read)."""
    lo, hi = batch_extremes(x, axis, block_size)
    update_(min_val, max_val, batches_seen, nonfinite_count, lo, hi, (~torch.isfinite(x)).sum(), averaging_constant)


@observe_minmax_.register_kernel("cpu")
def _cpu(x, min_val, max_val, batches_seen, nonfinite_count, averaging_constant, axis, block_size):
    # the same buffers as the generic implementation; a finite x (the usual batch) in one pass
    fast = all_finite_extremes(x, axis, block_size)
    if fast is None:
        lo, hi = batch_extremes(x, axis, block_size)
        nonfinite = (~torch.isfinite(x)).sum()
    else:
        (lo, hi), nonfinite = fast, None
    update_(min_val, max_val, batches_seen, nonfinite_count, lo, hi, nonfinite, averaging_constant)


@observe_minmax_.register_fake
def _fake(x, min_val, max_val, batches_seen, nonfinite_count, averaging_constant, axis, block_size):
    return None
