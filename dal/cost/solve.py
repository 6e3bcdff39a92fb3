"""Pick one option per group, minimising the summed score under latency and size budgets, exactly.

A multiple-choice knapsack solved by dynamic programming over Pareto fronts: after deciding
groups ``1..k``, keep every partial choice that no other one beats on all of (latency, size,
score); add group ``k+1``'s options to each and prune again. Dominated partial choices can never
complete into an optimum (costs and scores add up), so the best feasible point of the last
front is the exact optimum; the front itself is the Pareto table. Partial choices already over
a budget are dropped as they appear. Front sizes stay small in practice (hundreds to a few
thousands of points for 20-60 groups); the work is ``groups * front * options``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Option:
    """One candidate for a group: its ``key``, summed ``latency`` / ``size`` and ``score``."""

    key: str
    latency: float
    size: float
    score: float


def _prune(lat, size, score, back, use_size: bool):
    """Keep the points no other point beats (<= on every axis, < on one); ties keep the first.
    Without a size budget, size is not an axis (the front is over latency and score only)."""
    order = np.lexsort((score, size, lat))
    lat, size, score, back = lat[order], size[order], score[order], back[order]
    if not use_size:  # 2-D: in latency order, a point survives if it beats every earlier score
        best = np.minimum.accumulate(np.concatenate([[np.inf], score[:-1]]))
        keep = score < best
        return lat[keep], size[keep], score[keep], back[keep]
    keep = np.ones(len(lat), dtype=bool)
    # sweep in latency order: a point survives if no earlier (not slower) point is also
    # no larger and no worse; O(n * kept) with numpy over the kept set
    kept_size, kept_score = np.empty(0), np.empty(0)
    for i in range(len(lat)):
        if len(kept_size) and np.any((kept_size <= size[i]) & (kept_score <= score[i])):
            keep[i] = False
            continue
        kept_size = np.append(kept_size, size[i])
        kept_score = np.append(kept_score, score[i])
    return lat[keep], size[keep], score[keep], back[keep]


def pareto_front(groups: list[list[Option]], latency_budget: float = math.inf, size_budget: float = math.inf,
                 base_latency: float = 0.0, base_size: float = 0.0):
    """The final Pareto front: list of (latency, size, score, [option index per group])."""
    lat, size, score = np.array([base_latency]), np.array([base_size]), np.array([0.0])
    history = []  # per group: (parent index, option index) of every point of its front
    back = np.zeros((1, 2), dtype=np.int64)
    for opts in groups:
        ol = np.array([o.latency for o in opts])
        os_ = np.array([o.size for o in opts])
        osc = np.array([o.score for o in opts])
        n, m = len(lat), len(opts)
        nl = (lat[:, None] + ol[None, :]).ravel()
        ns = (size[:, None] + os_[None, :]).ravel()
        nsc = (score[:, None] + osc[None, :]).ravel()
        nb = np.stack([np.repeat(np.arange(n), m), np.tile(np.arange(m), n)], 1)
        ok = (nl <= latency_budget * (1 + 1e-12)) & (ns <= size_budget * (1 + 1e-12))
        if not ok.any():
            return []
        lat, size, score, back = _prune(nl[ok], ns[ok], nsc[ok], nb[ok], math.isfinite(size_budget))
        history.append(back)
    out = []
    for i in range(len(lat)):
        picks, j = [], i
        for back in reversed(history):
            parent, opt = back[j]
            picks.append(int(opt))
            j = parent
        out.append((float(lat[i]), float(size[i]), float(score[i]), picks[::-1]))
    return out


def solve(groups: list[list[Option]], latency_budget: float = math.inf, size_budget: float = math.inf,
          base_latency: float = 0.0, base_size: float = 0.0):
    """(best point or None when nothing fits, the whole front): best = least score, then least latency."""
    front = pareto_front(groups, latency_budget, size_budget, base_latency, base_size)
    if not front:
        return None, []
    best = min(front, key=lambda p: (p[2], p[0], p[1]))
    return best, front
