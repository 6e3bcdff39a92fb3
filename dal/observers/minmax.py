"""Min-max observers: the running extremes, or their exponential moving average."""
from __future__ import annotations

import torch

from .base import Observer, block_minmax
from .distributed import all_reduce_


class MinMaxObserver(Observer):
    """Range = the smallest and largest finite values ever seen (per scale)."""

    _lazy_names = ("min_val", "max_val")

    def _batch_range(self, x):
        """(lo, hi, finite): the batch's extremes (all-reduced across ranks) and whether they are
        all finite; a slice with no finite value has lo = +inf, hi = -inf."""
        lo, hi, bad = block_minmax(x, self.granularity)
        all_reduce_(lo, "min")
        all_reduce_(hi, "max")
        if bad:
            self.nonfinite_count += bad
        # No non-finite value here: every slice has a finite extreme, and min / max with another
        # rank's (finite or +-inf) extremes keep it finite.
        return lo, hi, not bad

    def _observe(self, x: torch.Tensor) -> None:
        lo, hi, _ = self._batch_range(x)
        if "min_val" not in self._buffers:
            self._lazy_buffer("min_val", lo.clone())
            self._lazy_buffer("max_val", hi.clone())
        else:
            torch.minimum(self.min_val, lo, out=self.min_val)
            torch.maximum(self.max_val, hi, out=self.max_val)

    def _range(self):
        return self.min_val, self.max_val


class MovingAverageMinMaxObserver(MinMaxObserver):
    """Range = exponential moving average of per-batch extremes:
    ``r <- r + c * (r_batch - r)``, starting from the first batch (c = ``averaging_constant``).

    Robust to a rare outlier batch during QAT, which a plain min-max would keep forever.
    """

    def __init__(self, *args, averaging_constant: float = 0.01, **kwargs):
        super().__init__(*args, **kwargs)
        if not 0.0 < averaging_constant <= 1.0:
            raise ValueError(f"averaging_constant={averaging_constant} must be in (0, 1]")
        self.averaging_constant = averaging_constant

    def _observe(self, x: torch.Tensor) -> None:
        lo, hi, finite = self._batch_range(x)
        if "min_val" not in self._buffers:
            self._lazy_buffer("min_val", lo.clone())
            self._lazy_buffer("max_val", hi.clone())
            return
        c = self.averaging_constant
        if not finite:
            # A batch whose slice was entirely non-finite keeps the old value for that slice.
            lo = torch.where(torch.isfinite(lo), lo, self.min_val)
            hi = torch.where(torch.isfinite(hi), hi, self.max_val)
        first = ~torch.isfinite(self.min_val)
        self.min_val.copy_(torch.where(first, lo, self.min_val + c * (lo - self.min_val)))
        self.max_val.copy_(torch.where(first, hi, self.max_val + c * (hi - self.max_val)))
