"""Means that a second rounding gets wrong, and their exact oracle (export/SPEC.md §5a: a float
mean is ``T(sum / n)``, rounded once), for dal.npu's (tests/npu/test_reduce_mean.py) and
dal.convert's (tests/convert/test_convert_mean.py) tests. u = half an ulp of 1 in T.

* n = 3: ``[2, 1 + 8u, u + u ulp(1)]`` times ``+-2^s``: the exact mean is just above the midpoint
  ``1 + 3u``, correctly rounded ``1 + 4u``; rounding the sum to T first (``T(T(sum) / n)``)
  gives ``1 + 2u``.
* n = 2^k: ``[n/2, n/2 + n u, eps, 0, ...]``: the exact mean is just above ``1 + u``, correctly
  rounded ``1 + 2u``; ``float16(float32(float32(sum) / n))`` drops eps in the float32 sum,
  lands on the midpoint and ties to even: 1. (In float32 the division by 2^k is exact, so no
  order of roundings shows here.)
"""
from fractions import Fraction

import numpy as np

from oracles import nearest_float


def _groups(x, axes):
    """x with the reduced axes last, as rows of n elements (and the kept shape)."""
    axes = sorted(a % x.ndim for a in axes)
    kept = [a for a in range(x.ndim) if a not in axes]
    y = np.transpose(x, kept + axes)
    return y.reshape(-1, int(np.prod([x.shape[a] for a in axes]))), [x.shape[a] for a in kept]


def exact_mean(x, axes, keepdims=True):
    """The oracle: every group's exact rational mean, rounded once to x's type."""
    rows, kept = _groups(x, axes)
    n = rows.shape[1]
    out = np.array([nearest_float(sum(Fraction(float(v)) for v in r) / n, x.dtype.type) for r in rows],
                   x.dtype).reshape(kept)
    if keepdims:
        for a in sorted(a % x.ndim for a in axes):
            out = np.expand_dims(out, a)
    return out


def rounded_twice(x, axes, via):
    """``T(via(via(sum float64) / n))``: the sum rounded to ``via`` first, as dal.npu did before
    (``via`` float32) and SPEC §5a said (``via`` T). To show a case is a tie case, never as an
    expected value."""
    rows, kept = _groups(x, axes)
    s = rows.astype(np.float64).sum(axis=1).astype(via)
    return (s / via(rows.shape[1])).astype(x.dtype).reshape(kept)


def tie_case(shape, axes, dtype, seed=0):
    """A tensor whose every reduced group (3 or 2^k elements) is a tie case of the module doc."""
    axes = sorted(a % len(shape) for a in axes)
    kept = [a for a in range(len(shape)) if a not in axes]
    n = int(np.prod([shape[a] for a in axes]))
    p = np.finfo(dtype).nmant  # 10 (float16), 23 (float32)
    u = 2.0 ** -(p + 1)
    if n == 3:
        group = [2.0, 1 + 8 * u, u + u * 2.0 ** -p]
    else:
        assert n >= 2 and n & (n - 1) == 0, "the construction needs a group of 3 or 2^k"
        # eps below half a float32 ulp of the sum (a float32 sum drops it), exact in T and float64
        group = [n / 2, n / 2 + n * u, 2.0 ** -24 if dtype == np.float16 else 2.0 ** -40]
    rng = np.random.default_rng(seed)
    rows = np.zeros((int(np.prod([shape[a] for a in kept])), n), np.float64)
    for r in rows:
        r[rng.permutation(n)[:3]] = group
        # scale by +-2^s (s >= 0 keeps float16's eps a subnormal, not zero)
        r *= rng.choice([-1.0, 1.0]) * 2.0 ** int(rng.integers(0, 4))
    assert np.array_equal(rows.astype(dtype).astype(np.float64), rows)  # exact in T
    y = rows.reshape([shape[a] for a in kept] + [shape[a] for a in axes]).astype(dtype)
    return np.ascontiguousarray(np.transpose(y, np.argsort(kept + axes)))


