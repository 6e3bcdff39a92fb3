"""N:M magnitude masks: keep the N largest ``|w|`` of every group of M along an axis.

Ranking without sort or topk
----------------------------
Each group's elements are ranked by pairwise duels: element ``i`` beats ``j`` when
``key_i > key_j``, or ``key_i == key_j`` and ``i < j`` (the lower index wins ties, so the
mask is deterministic). An element is kept when it wins at least ``M - N`` of its ``M - 1``
duels, i.e. when its rank is below N. The duel outcomes are a total order, so every group
keeps exactly N elements. For 2:4 that is 6 vectorized comparisons and a majority vote
per position.

The key is the bit pattern of ``|w|`` read as a signed integer of the same width: for
non-negative floats it orders exactly like the float, and it makes NaN the largest value
instead of breaking the total order. Positions excluded by a ``prior`` mask get key ``-1``,
below every real magnitude, so they are pruned first (this is how schedules keep pruned
weights pruned).

On the CPU the work is done in chunks that stay in cache, with preallocated scratch, so a
4096x4096 mask costs less than one allocating ``w.abs()`` pass (see ``bench/sparsity.py``).
"""
from __future__ import annotations

import torch
from torch import Tensor

from .layout import from_groups, to_groups

__all__ = ["nm_mask", "nm_mask_partial"]

_INT_OF_WIDTH = {2: torch.int16, 4: torch.int32, 8: torch.int64}
_CHUNK_GROUPS = 1 << 16  # 1 MiB of float32 per chunk: stays in L2/L3


def _check_weight(weight: Tensor) -> None:
    if not weight.is_floating_point():
        raise TypeError(f"N:M masks are computed from floating-point weights, got {weight.dtype}")
    if weight.element_size() not in _INT_OF_WIDTH:
        raise TypeError(f"unsupported weight dtype {weight.dtype} (use float16/32/64 or bfloat16)")


def _majority(p: Tensor, q: Tensor, r: Tensor, dst: Tensor, x: Tensor, y: Tensor) -> None:
    """dst = at least two of (p, q, r); x, y are scratch of the same shape."""
    torch.bitwise_and(p, q, out=x)
    torch.bitwise_or(p, q, out=y)
    torch.bitwise_and(y, r, out=y)
    torch.bitwise_or(x, y, out=dst)


def _keep_2of4(k: Tensor, out: Tensor, cmp: Tensor, scratch: Tensor) -> None:
    """out[g, i] = rank of k[g, i] within its group < 2, for k of shape [C, 4]."""
    k0, k1, k2, k3 = k.unbind(1)
    c01, c02, c03, c12, c13, c23 = cmp.unbind(0)  # c_ij: i beats j (i < j)
    torch.ge(k0, k1, out=c01)
    torch.ge(k0, k2, out=c02)
    torch.ge(k0, k3, out=c03)
    torch.ge(k1, k2, out=c12)
    torch.ge(k1, k3, out=c13)
    torch.ge(k2, k3, out=c23)
    x, y = scratch.unbind(0)
    _majority(c01, c02, c03, out[:, 0], x, y)
    _majority(c03, c13, c23, out[:, 3], x, y)  # 3 loses all three -> not kept; negate below
    out[:, 3].logical_not_()
    c01.logical_not_()                      # now: 1 beats 0
    _majority(c01, c12, c13, out[:, 1], x, y)
    c02.logical_not_()                      # 2 beats 0
    c12.logical_not_()                      # 2 beats 1
    _majority(c02, c12, c23, out[:, 2], x, y)


def _keep_general(k: Tensor, n: int, out: Tensor) -> None:
    """out[g, i] = element i wins >= m - n of its duels, for k of shape [C, m]."""
    c, m = k.shape
    wins = torch.zeros(m, c, dtype=torch.uint8, device=k.device)
    for i in range(m):
        for j in range(i + 1, m):
            beats = k[:, i] >= k[:, j]
            wins[i] += beats
            wins[j] += ~beats
    for i in range(m):
        torch.ge(wins[i], m - n, out=out[:, i])


def _keep_groups(src: Tensor, n: int, prior: "Tensor | None", out: Tensor,
                 chunk: "int | None" = None) -> None:
    """Fill ``out`` ([G, m] bool) with the N:M keep mask of ``src`` ([G, m] float)."""
    g_total, m = src.shape
    if chunk is None:
        chunk = _CHUNK_GROUPS if src.device.type == "cpu" else g_total
    chunk = max(1, min(chunk, g_total))
    itype = _INT_OF_WIDTH[src.element_size()]
    buf = torch.empty(chunk, m, dtype=src.dtype, device=src.device)
    fast = (n, m) == (2, 4)
    if fast:
        cmp = torch.empty(6, chunk, dtype=torch.bool, device=src.device)
        scratch = torch.empty(2, chunk, dtype=torch.bool, device=src.device)
    for g0 in range(0, g_total, chunk):
        g1 = min(g_total, g0 + chunk)
        a = buf[: g1 - g0]
        torch.abs(src[g0:g1], out=a)
        keys = a.view(itype)
        if prior is not None:
            keys.masked_fill_(prior[g0:g1].logical_not(), -1)
        if fast:
            _keep_2of4(keys, out[g0:g1], cmp[:, : g1 - g0], scratch[:, : g1 - g0])
        else:
            _keep_general(keys, n, out[g0:g1])


def nm_mask(weight: Tensor, n: int = 2, m: int = 4, axis: int = -1, *,
            prior: "Tensor | None" = None) -> Tensor:
    """Boolean mask keeping the ``n`` largest ``|weight|`` of every group of ``m``
    consecutive elements along ``axis``.

    Contract: same shape and device as ``weight``, dtype bool, contiguous; every group holds
    exactly ``n`` True. Ties go to the lower index. Where ``prior`` (bool, same shape) is
    False the element ranks below every real magnitude, so already-pruned weights stay
    pruned unless a group has fewer than ``n`` allowed elements. ``weight.shape[axis]`` must
    be a multiple of ``m``. For module weights use ``reduction_axis(module)`` as ``axis``.

    >>> nm_mask(torch.tensor([[0.1, -3.0, 2.0, 0.5]])).tolist()
    [[False, True, True, False]]
    """
    _check_weight(weight)
    w = weight.detach()
    src = to_groups(w, axis, m)
    pri = None if prior is None else to_groups(prior.to(torch.bool), axis, m)
    out = torch.empty(src.shape, dtype=torch.bool, device=w.device)
    _keep_groups(src, n, pri, out)
    return from_groups(out, w.shape, axis)


def nm_mask_partial(weight: Tensor, fraction: float, n: int = 2, m: int = 4, axis: int = -1,
                    *, prior: "Tensor | None" = None) -> Tensor:
    """Mask in which ``round(fraction * G)`` of the ``G`` groups are pruned to N:M and the
    rest stay dense; used by gradual schedules.

    Which groups: those whose pruning drops the least magnitude (sum of the ``m - n``
    smallest ``|w|``), ties to the lower group index. Groups that ``prior`` already prunes
    (any False) come first and keep their pruned positions, and at least that many groups
    are pruned, so a sequence of calls with non-decreasing ``fraction`` feeding each result
    back as ``prior`` has non-increasing density. ``fraction >= 1`` equals :func:`nm_mask`.
    """
    _check_weight(weight)
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"fraction must be in [0, 1], got {fraction}")
    w = weight.detach()
    src = to_groups(w, axis, m)
    pri = None if prior is None else to_groups(prior.to(torch.bool), axis, m)
    keep = torch.empty(src.shape, dtype=torch.bool, device=w.device)
    _keep_groups(src, n, pri, keep)
    g_total = src.shape[0]
    k = int(round(fraction * g_total))
    if pri is not None:
        already = ~pri.all(dim=1)
        k = max(k, int(already.sum()))
    if k < g_total:
        cost = (src.abs() * ~keep).sum(dim=1, dtype=torch.float64)
        if pri is not None:
            cost[already] = -1.0
        order = torch.sort(cost, stable=True).indices
        pruned = torch.zeros(g_total, dtype=torch.bool, device=w.device)
        pruned[order[:k]] = True
        keep |= ~pruned.unsqueeze(1)
    return from_groups(keep, w.shape, axis)
