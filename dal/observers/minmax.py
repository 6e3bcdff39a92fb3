"""Min-max observers: the running extremes, or their exponential moving average."""
from __future__ import annotations

from typing import Optional

import torch

from ..formats import code_range
from .base import Observer, block_minmax
from .distributed import all_reduce_, world_size


class MinMaxObserver(Observer):
    """Range = the smallest and largest finite values ever seen (per scale)."""

    _lazy_names = ("min_val", "max_val")

    def _batch_range(self, x):
        """(lo, hi, finite): the batch's extremes (all-reduced across ranks) and whether they are
        all finite; a slice with no finite value has lo = +inf, hi = -inf."""
        return self._reduce_range(*block_minmax(x, self.granularity))

    def _reduce_range(self, lo, hi, bad):
        all_reduce_(lo, "min")
        all_reduce_(hi, "max")
        if bad:
            self.nonfinite_count += bad
        # No non-finite value here: every slice has a finite extreme, and min / max with another
        # rank's (finite or +-inf) extremes keep it finite.
        return lo, hi, not bad

    @property
    def accepts_extremes(self) -> bool:
        """Whether ``observe_extremes`` is this observer's update (a subclass that observes the
        tensor itself, by overriding ``_observe``, must see the tensor)."""
        return type(self)._observe is MinMaxObserver._observe

    @torch.no_grad()
    def observe_extremes(self, lo: torch.Tensor, hi: torch.Tensor) -> None:
        """Observe a batch known by its finite per-scale extremes (shape of the scale), computed
        without forming the tensor (``dal.formats.fold.row_minmax`` of a BN-folded weight): the
        same update as ``forward`` of a tensor with these extremes."""
        self._update(*self._reduce_range(lo, hi, 0))
        self.batches_seen += 1

    def track_step(self) -> Optional[tuple]:
        """``(min_val, max_val, batches_seen, ema, fmt, symmetric, qmin, qmax)`` — the arguments
        of ``dal.formats.track.track_qparams`` — when this observer's QAT step (update +
        ``calculate_qparams``) is that C++ step (``ema``: the moving-average constant, None for
        the running min / max); None when only the torch path can do it: a subclass, a
        power-of-two or fixed scale, no range yet, or several processes (all-reduce)."""
        if type(self) not in _TRACKED or self.power_of_two is not None or self.fixed_scale is not None \
                or "min_val" not in self._buffers or world_size() > 1:
            return None
        return (self.min_val, self.max_val, self.batches_seen, getattr(self, "averaging_constant", None), self.fmt,
                self.symmetric, *code_range(self.fmt, self.narrow_range))

    def _observe(self, x: torch.Tensor) -> None:
        self._update(*self._batch_range(x))

    def _update(self, lo, hi, finite) -> None:
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

    def _update(self, lo, hi, finite) -> None:
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


_TRACKED = (MinMaxObserver, MovingAverageMinMaxObserver)
