"""A float64 numpy model of dal::fake_quantize_lsq's gradients (dal.kernels.lsq's contract),
written without dal: numpy float32 division and rint (IEEE, half to even), ml_dtypes for FP8,
exact sums by ``math.fsum``, and the contract's error bound."""
import math

import ml_dtypes
import numpy as np

_FP8 = {"fp8_e4m3": ml_dtypes.float8_e4m3fn, "fp8_e5m2": ml_dtypes.float8_e5m2}


def lsq_terms(fmt, x, s, zp, g):
    """Per element, float32 (all arrays broadcast to x's shape, s / zp projected): ``(m, ts, tz)``,
    the clip mask and the float32 products ``g * where(m, c - v, c)`` and ``g * where(m, 0, -s)``."""
    x, s, g = (np.asarray(a, np.float32) for a in (x, s, g))
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        v = x / s
        if fmt.is_float8:
            top = np.float32(fmt.max_value)
            m = np.abs(v) <= top
            c = np.clip(v, -top, top).astype(_FP8[fmt.name]).astype(np.float32)
        else:
            z = np.rint(np.asarray(zp, np.float32))
            lo, hi = np.float32(fmt.qmin) - z, np.float32(fmt.qmax) - z
            r = np.rint(v)
            m = (r >= lo) & (r <= hi)
            c = np.where(r < lo, lo, np.where(r > hi, hi, r)).astype(np.float32)
        ts = g * np.where(m, c - v, c).astype(np.float32)
        tz = g * np.where(m, np.float32(0), -s).astype(np.float32)
    return m, ts.astype(np.float32), tz.astype(np.float32)


def exact_sums(t, groups, grad_scale):
    """``(want, bound)`` per group: ``want = float32(grad_scale * fsum(t[group]))`` (the exact sum
    rounded once; float64 products of float32 terms by grad_scale), and the contract's bound on
    |result - want|: one float32 ulp of want plus the float64 summation error ``n 2^-53 sum|t|``
    scaled by grad_scale. ``groups``: an int array of t's shape naming each element's parameter."""
    t, groups = np.asarray(t, np.float64).reshape(-1), np.asarray(groups).reshape(-1)
    k = int(groups.max()) + 1
    want, bound = np.zeros(k, np.float32), np.zeros(k)
    for p in range(k):
        tp = t[groups == p]
        exact = (math.fsum(tp.tolist()) if np.isfinite(tp).all() else float(tp.sum())) * grad_scale
        want[p] = np.float32(exact)
        bound[p] = np.spacing(np.float32(abs(exact))) + tp.size * 2.0 ** -53 * np.abs(tp).sum() * grad_scale
    return want, bound


def assert_within(got, want, bound, msg=""):
    """``|got - want| <= bound`` element by element (NaN where and only where want is NaN)."""
    got, want = np.asarray(got, np.float64).reshape(-1), np.asarray(want, np.float64).reshape(-1)
    assert np.array_equal(np.isnan(got), np.isnan(want)), f"{msg}: NaN positions differ"
    with np.errstate(invalid="ignore"):
        ok = np.isnan(want) | (got == want) | (np.abs(got - want) <= np.asarray(bound).reshape(-1))
    assert ok.all(), f"{msg}: {got[~ok][:4]} vs {want[~ok][:4]} (bound {np.asarray(bound).reshape(-1)[~ok][:4]})"
