"""Parity counting in LSBs: how many elements of two tensors differ, and by how much.

For integer codes the difference is in LSBs of the code; for float tensors it is reported
as a count of unequal elements and the largest absolute difference.
"""
from __future__ import annotations

import numpy as np


def lsb_diff(a, b) -> dict:
    """{"n": elements, "differ": count, "max_lsb": largest |a - b| (codes) or abs diff (floats)}."""
    a, b = np.asarray(a), np.asarray(b)
    if a.shape != b.shape:
        raise ValueError(f"shapes differ: {a.shape} vs {b.shape}")
    if a.dtype.kind in "iu" or str(a.dtype) in ("int4", "uint4"):
        d = np.abs(a.astype(np.int64) - b.astype(np.int64))
        return {"n": int(a.size), "differ": int((d != 0).sum()), "max_lsb": int(d.max(initial=0))}
    fa, fb = a.astype(np.float64), b.astype(np.float64)
    same = (fa == fb) | (np.isnan(fa) & np.isnan(fb))
    d = np.where(same, 0.0, np.abs(fa - fb))
    return {"n": int(a.size), "differ": int((~same).sum()), "max_abs": float(np.nan_to_num(d, nan=np.inf).max(initial=0.0))}


def compare_values(mine: dict, theirs: dict, names=None) -> dict:
    """Per-tensor lsb_diff over the names both dicts hold (or ``names``)."""
    names = names if names is not None else [k for k in mine if k in theirs]
    return {k: lsb_diff(mine[k], theirs[k]) for k in names}


def summarize(per_tensor: dict) -> dict:
    n = sum(v["n"] for v in per_tensor.values())
    d = sum(v["differ"] for v in per_tensor.values())
    m = max((v.get("max_lsb", 0) for v in per_tensor.values()), default=0)
    return {"tensors": len(per_tensor), "elements": n, "differ": d, "max_lsb": m}
