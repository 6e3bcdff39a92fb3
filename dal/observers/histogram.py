"""Histogram observers: the range is chosen by a search over clipping thresholds.

One signed histogram (``bins`` bins over a range that grows as data arrives) is collected per
tensor; the search then picks a clipping range ``[lo, hi]``:

* ``percentile``: the ``p``-th percentile of ``|x|`` (symmetric) or the two tails (affine);
* ``kl``:  TensorRT-style entropy calibration: the threshold whose quantized distribution has
  the smallest KL divergence from the clipped reference distribution;
* ``mse``: the threshold that minimises the expected squared error of fake quantization,
  evaluated at the bin centres with dal's own fake quantizer (so it holds for any format).

Per-channel MSE (weights) searches per channel on the last tensor seen, which for a weight is
the weight itself.
"""
from __future__ import annotations

import numpy as np
import torch

from ..formats import fake_quantize
from .base import Observer, block_minmax
from .distributed import all_reduce_


class HistogramObserver(Observer):
    """Collects a histogram; subclasses choose the clipping range from it (``_search``)."""

    _lazy_names = ("histogram", "hist_min", "hist_max", "min_val", "max_val")
    updates_during_training = False

    def __init__(self, *args, bins: int = 2048, **kwargs):
        super().__init__(*args, **kwargs)
        if bins < 16:
            raise ValueError(f"bins={bins} is too few for a threshold search; use at least 16")
        self.bins = bins

    def _observe(self, x: torch.Tensor) -> None:
        if self.granularity.axis is not None:
            return self._observe_per_channel(x)
        lo, hi, bad = block_minmax(x, self.granularity)
        all_reduce_(lo, "min")
        all_reduce_(hi, "max")
        if bad:
            self.nonfinite_count += bad
        if not (torch.isfinite(lo) and torch.isfinite(hi)):
            return  # nothing finite in this batch on any rank
        if "histogram" not in self._buffers:
            self._lazy_buffer("histogram", torch.zeros(self.bins, dtype=torch.float64))
            self._lazy_buffer("hist_min", lo.clone())
            self._lazy_buffer("hist_max", torch.maximum(hi, lo + 1e-12))
        elif lo < self.hist_min or hi > self.hist_max:
            self._grow(torch.minimum(lo, self.hist_min), torch.maximum(hi, self.hist_max))
        flat = x.detach().float().flatten()
        flat = flat[torch.isfinite(flat)]
        counts = torch.histc(flat, self.bins, float(self.hist_min), float(self.hist_max)).double()
        self.histogram += all_reduce_(counts, "sum")

    def _grow(self, lo: torch.Tensor, hi: torch.Tensor) -> None:
        """Re-bin the histogram onto a wider range: each old bin's count goes to the new bin
        holding its centre (exact in total count; approximate in position by < 1 new bin)."""
        old = self.histogram
        width = (self.hist_max - self.hist_min) / self.bins
        centres = self.hist_min + width * (torch.arange(self.bins, dtype=torch.float64) + 0.5)
        new_width = (hi - lo) / self.bins
        idx = ((centres - lo) / new_width).floor().clamp(0, self.bins - 1).long()
        grown = torch.zeros_like(old)
        grown.index_add_(0, idx, old)
        self.histogram.copy_(grown)
        self.hist_min.copy_(lo)
        self.hist_max.copy_(hi)

    def _observe_per_channel(self, x: torch.Tensor) -> None:
        lo, hi, bad = block_minmax(x, self.granularity)
        all_reduce_(lo, "min")
        all_reduce_(hi, "max")
        if bad:
            self.nonfinite_count += bad
        if "min_val" not in self._buffers:
            self._lazy_buffer("min_val", lo.clone())
            self._lazy_buffer("max_val", hi.clone())
        else:
            torch.minimum(self.min_val, lo, out=self.min_val)
            torch.maximum(self.max_val, hi, out=self.max_val)
        self._last = x.detach().float()

    def fresh_copy(self) -> "HistogramObserver":
        """:meth:`Observer.fresh_copy`, without the last tensor observed (the per-channel search's input)."""
        new = super().fresh_copy()
        new._last = None
        return new

    def _centres(self) -> tuple[np.ndarray, np.ndarray]:
        width = float(self.hist_max - self.hist_min) / self.bins
        centres = float(self.hist_min) + width * (np.arange(self.bins) + 0.5)
        return centres, self.histogram.numpy()

    def _range(self):
        if self.granularity.axis is not None:
            return self._per_channel_range()
        if "histogram" not in self._buffers:
            zero = torch.zeros(())
            return zero, zero
        lo, hi = self._search()
        return torch.tensor(lo, dtype=torch.float32), torch.tensor(hi, dtype=torch.float32)

    def _per_channel_range(self):
        return self.min_val, self.max_val

    def _search(self) -> tuple[float, float]:  # pragma: no cover - interface
        raise NotImplementedError


class PercentileObserver(HistogramObserver):
    """Clip at the ``percentile``-th percentile of the observed values (per tensor)."""

    def __init__(self, *args, percentile: float = 99.99, **kwargs):
        super().__init__(*args, **kwargs)
        if not 50.0 < percentile <= 100.0:
            raise ValueError(f"percentile={percentile} must be in (50, 100]")
        self.percentile = percentile

    def _search(self):
        centres, counts = self._centres()
        cdf = np.cumsum(counts) / max(counts.sum(), 1.0)
        tail = (100.0 - self.percentile) / 100.0
        if self.symmetric:
            order = np.argsort(np.abs(centres), kind="stable")
            acdf = np.cumsum(counts[order]) / max(counts.sum(), 1.0)
            k = int(np.searchsorted(acdf, 1.0 - tail))
            t = float(np.abs(centres[order[min(k, len(order) - 1)]]))
            return -t, t
        lo = centres[int(np.searchsorted(cdf, tail / 2))]
        hi = centres[min(int(np.searchsorted(cdf, 1.0 - tail / 2)), self.bins - 1)]
        return float(min(lo, 0.0)), float(max(hi, 0.0))


class MSEObserver(HistogramObserver):
    """Clipping threshold minimising E[(x - fake_quant(x))^2] over the observed distribution.

    ``candidates`` thresholds ``t_k = amax * k / candidates`` are tried (symmetric: [-t, t];
    affine: [min * k/n, max * k/n]); per channel the search runs on the last tensor seen.
    """

    def __init__(self, *args, candidates: int = 100, **kwargs):
        super().__init__(*args, **kwargs)
        self.candidates = candidates

    def _error(self, values: torch.Tensor, weights: torch.Tensor, lo: float, hi: float) -> float:
        from ..formats import choose_qparams

        scale, zp = choose_qparams(torch.tensor(lo), torch.tensor(hi), self.fmt, self.symmetric, self.narrow_range,
                                   power_of_two=self.power_of_two)
        q = fake_quantize(values, self.fmt, scale, zp, narrow_range=self.narrow_range, check=False)
        return float((weights * (q - values) ** 2).sum())

    def _search(self):
        centres, counts = self._centres()
        keep = counts > 0
        values = torch.tensor(centres[keep], dtype=torch.float32)
        weights = torch.tensor(counts[keep], dtype=torch.float32)
        lo0, hi0 = min(float(self.hist_min), 0.0), max(float(self.hist_max), 0.0)
        best, best_err = (lo0, hi0), float("inf")
        for f in np.linspace(1.0 / self.candidates, 1.0, self.candidates):
            lo, hi = (lo0 * f, hi0 * f)
            if self.symmetric:
                t = max(-lo, hi)
                lo, hi = -t, t
            err = self._error(values, weights, lo, hi)
            if err < best_err:
                best, best_err = (lo, hi), err
        return best

    def _per_channel_range(self):
        if self.granularity.block_size:
            return self.min_val, self.max_val  # per-group: min-max (groups are small already)
        x = getattr(self, "_last", None)
        if x is None:
            # The search runs on the last tensor seen, which a state_dict does not carry.
            raise RuntimeError(
                f"{type(self).__name__} ({self.granularity}) searches on the last tensor it observed, "
                "and has none since it was loaded from a state_dict: observe a tensor (the weight) first")
        axis = self.granularity.normalized_axis(x.dim())
        rows = x.movedim(axis, 0).reshape(x.shape[axis], -1)
        lo0 = torch.clamp(self.min_val.reshape(-1), max=0.0)
        hi0 = torch.clamp(self.max_val.reshape(-1), min=0.0)
        best_lo, best_hi = lo0.clone(), hi0.clone()
        best_err = torch.full_like(lo0, float("inf"), dtype=torch.float64)
        from ..formats import choose_qparams, per_channel

        # All channels at once per candidate: candidates passes over the tensor, not channels x candidates.
        for f in np.linspace(1.0 / self.candidates, 1.0, self.candidates):
            lo, hi = lo0 * float(f), hi0 * float(f)
            if self.symmetric:
                t = torch.maximum(-lo, hi)
                lo, hi = -t, t
            scale, zp = choose_qparams(lo, hi, self.fmt, self.symmetric, self.narrow_range,
                                       power_of_two=self.power_of_two)
            q = fake_quantize(rows, self.fmt, scale, zp, per_channel(0), self.narrow_range, check=False)
            err = ((q - rows).double() ** 2).sum(dim=1)
            better = err < best_err
            best_err = torch.where(better, err, best_err)
            best_lo = torch.where(better, lo, best_lo)
            best_hi = torch.where(better, hi, best_hi)
        return best_lo.reshape(self.min_val.shape), best_hi.reshape(self.max_val.shape)


class KLObserver(HistogramObserver):
    """Entropy calibration (TensorRT): the threshold ``t`` minimising KL(P || Q), where P is
    the histogram of ``|x|`` clipped at ``t`` (outliers added to the last bin) and Q is P
    merged into the format's quantization levels and spread back uniformly over the non-empty
    bins of each level. The result is ``[-t, t]``, or ``[0, t]`` for one-sided data with an affine
    format (whose levels then all lie between 0 and t).
    """

    def __init__(self, *args, stride: int = 8, **kwargs):
        super().__init__(*args, **kwargs)
        self.stride = stride

    def _search(self):
        centres, counts = self._centres()
        amax = float(max(-self.hist_min, self.hist_max))
        if amax == 0.0:
            return 0.0, 0.0
        negative = float(self.hist_min) < 0.0
        levels = self._positive_levels(negative)
        if negative and not self.symmetric and self.fmt.is_integer:
            # An affine range need not be symmetric: search each side on its own histogram
            # (folding |x| would let a spike on one side, e.g. an image background, set both).
            lo = self._threshold(np.where(centres < 0, counts, 0.0), -centres, -float(self.hist_min), levels)
            hi = self._threshold(np.where(centres > 0, counts, 0.0), centres, max(float(self.hist_max), 0.0), levels)
            return -lo, hi
        t = self._threshold(counts, np.abs(centres), amax, levels)
        return (-t if negative or self.symmetric else 0.0), t

    def _threshold(self, counts: np.ndarray, magnitudes: np.ndarray, amax: float, levels: int) -> float:
        """KL-optimal clipping threshold for the distribution of ``magnitudes`` (weights ``counts``)."""
        if amax <= 0.0 or counts.sum() == 0:
            return max(amax, 0.0)
        nb = self.bins
        hist = np.zeros(nb)
        idx = np.clip((magnitudes / amax * nb).astype(int), 0, nb - 1)
        np.add.at(hist, idx, np.where(magnitudes >= 0, counts, 0.0))
        # The bin at zero holds ReLU's zeros (often most of the mass). Zero is exact for every
        # threshold, so it says nothing about the clipping choice; left in, its spike makes
        # every wide range look bad and the search clips far too hard.
        hist[0] = 0.0
        best_t, best_kl = amax, float("inf")
        for i in range(max(levels, 16), nb + 1, self.stride):
            p = hist[:i].copy()
            p[i - 1] += hist[i:].sum()
            # Merge the first i bins into `levels` quantization bins, then expand back.
            edges = np.linspace(0, i, levels + 1).astype(int)
            q = np.zeros(i)
            for a, b in zip(edges[:-1], edges[1:]):
                chunk = hist[a:b]
                nz = chunk > 0
                if nz.any():
                    q[a:b][nz] = chunk.sum() / nz.sum()
            kl = _kl(p, q)
            if kl < best_kl:
                best_kl, best_t = kl, (i / nb) * amax
        return best_t

    def _positive_levels(self, negative: bool) -> int:
        """Quantization steps available between 0 and the threshold: all of an affine format's
        codes for one-sided data (uint8 after ReLU: 255), half of them for two-sided data."""
        if not self.fmt.is_integer:
            return 128  # FP8: levels are not uniform; use int8-like resolution for the search
        if not self.symmetric and not negative:
            return int(self.fmt.qmax - self.fmt.qmin)
        if self.fmt.signed:
            return int(self.fmt.qmax)
        return int(self.fmt.qmax - self.fmt.qmin) // 2


def _kl(p: np.ndarray, q: np.ndarray) -> float:
    p = p / max(p.sum(), 1e-12)
    q = q / max(q.sum(), 1e-12)
    mask = p > 0
    if (q[mask] == 0).any():
        return float("inf")
    return float(np.sum(p[mask] * np.log(p[mask] / q[mask])))
