"""Float64 references of GPTQ and SparseGPT for the tests, written from the papers and independent
of dal: numpy only, one column at a time, no lazy batch updates, no Cholesky (the inverse
Hessian of the remaining columns is updated by Gaussian elimination, the OBS form), and the
INT4 symmetric min-max group scale written out: ``s = float32(max|float32(w)| / 7)``.

Also the one-layer model both test files use: ``nn.Linear(64, 16)`` prepared weight-only with
INT4 symmetric per-group-of-32 min-max weights, 64 calibration rows.
"""
import numpy as np
import torch
from torch import nn

QMIN, QMAX = -8.0, 7.0
GROUP = 32

W4_GROUP = {"name": "w4_g32_weight_only", "rules": [
    {"type": ["linear"],
     "weight": {"format": "int4", "granularity": "per_group", "group_size": GROUP, "axis": 1, "symmetric": True,
                "observer": "minmax"}}]}


def small_layer(seed: int = 0, outlier_columns: bool = True):
    """``(linear, X)``: a 16x64 linear and 64 correlated input rows (a few loud columns, as LLM
    activations have, so the Hessian's diagonal varies and act_order has something to do)."""
    g = torch.Generator().manual_seed(seed)
    lin = nn.Linear(64, 16)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(16, 64, generator=g) * 0.1)
        lin.bias.zero_()
    mix = torch.randn(64, 64, generator=g) * 0.3 + torch.eye(64)
    X = torch.randn(64, 64, generator=g) @ mix
    if outlier_columns:
        X[:, [3, 17, 40]] *= 6.0
    return lin, X


def prepared_small_layer(seed: int = 0):
    """``(q, W, X)``: :func:`small_layer` prepared with :data:`W4_GROUP` and calibrated on ``X``,
    and its float weight ``W`` (float64 numpy) before any PTQ step."""
    import dal

    lin, X = small_layer(seed)
    W = lin.weight.detach().double().numpy().copy()
    q = dal.prepare_qat(nn.Sequential(lin), recipe=W4_GROUP, example_inputs=(X[:4],))
    dal.calibrate(q, [X])
    return q, W, X


def group_scale(w: np.ndarray) -> np.ndarray:
    """INT4 symmetric min-max scale per row of ``w`` (rows x group): ``float32(amax / 7)``, 1 for 0."""
    amax = np.abs(w.astype(np.float32)).max(axis=1).astype(np.float64)
    s = (amax / QMAX).astype(np.float32).astype(np.float64)
    return np.where(s > 0, s, 1.0)


def rtn(w: np.ndarray, s: np.ndarray):
    """``(q, code, v)``: round-half-even codes of ``w / s`` clipped to INT4, ``q = code * s``, ``v = w / s``."""
    v = w / s
    code = np.clip(np.rint(v), QMIN, QMAX)
    return code * s, code, v


def rtn_per_group(W: np.ndarray) -> np.ndarray:
    """Round-to-nearest of ``W`` with its own min-max group scales."""
    Q = np.empty_like(W)
    for c in range(0, W.shape[1], GROUP):
        Q[:, c:c + GROUP] = rtn(W[:, c:c + GROUP], group_scale(W[:, c:c + GROUP])[:, None])[0]
    return Q


def hessian(X: np.ndarray) -> np.ndarray:
    return 2.0 / X.shape[0] * X.T @ X


def output_error(X: np.ndarray, W: np.ndarray, Q: np.ndarray) -> float:
    """``||X W^T - X Q^T||_F`` in float64."""
    return float(np.linalg.norm(X @ W.T - X @ Q.T))


def reference(W, X, percdamp=0.01, act_order=False, sparsity=None, per_channel=False, fixed_mask=None):
    """GPTQ (``sparsity=None``) or SparseGPT (``sparsity=(n, m)``) of ``W`` on inputs ``X``
    (rows x columns); INT4 scales per group of 32 columns, or per row (``per_channel``, from
    the weights before the loop). ``fixed_mask`` (bool, rows x columns): weights where it is False
    are 0 before quantization (a layer that is already sparse).

    Returns ``codes`` (original column order), ``scales`` (rows x groups), ``mask`` (or None)
    and ``v`` (``w / s`` before rounding, per row and column: how close each code was to a tie)."""
    W = np.array(W, dtype=np.float64)
    H = hessian(np.asarray(X, dtype=np.float64))
    rows, cols = W.shape
    dead = np.diag(H) == 0
    H[dead, dead] = 1.0
    W[:, dead] = 0.0
    scales = np.zeros((rows, 1 if per_channel else cols // GROUP))
    perm = np.arange(cols)
    if per_channel:
        scales[:, 0] = group_scale(W)
    elif act_order:
        for g in range(cols // GROUP):  # static groups, from the weights before any update
            scales[:, g] = group_scale(W[:, g * GROUP:(g + 1) * GROUP])
        perm = np.argsort(-np.diag(H), kind="stable")
        W, H = W[:, perm], H[perm][:, perm]
    H = H + percdamp * np.mean(np.diag(H)) * np.eye(cols)
    Hinv = np.linalg.inv(H)
    # [H_F^-1]_jj for the remaining set F = {j, j+1, ...}: what the mask score divides by
    d = np.empty(cols)
    E = Hinv.copy()
    for j in range(cols):
        d[j] = E[j, j]
        E = E - np.outer(E[:, j], E[j, :]) / E[j, j]
    codes = np.zeros((rows, cols))
    v_all = np.zeros((rows, cols))
    mask = np.ones((rows, cols), dtype=bool) if sparsity else None
    if fixed_mask is not None:
        mask = np.asarray(fixed_mask, dtype=bool)[:, perm].copy()
    for j in range(cols):
        col = perm[j]
        g = 0 if per_channel else col // GROUP
        if not act_order and not per_channel and col % GROUP == 0:
            scales[:, col // GROUP] = group_scale(W[:, j:j + GROUP])
        if sparsity and j % sparsity[1] == 0:
            n, m = sparsity
            score = W[:, j:j + m] ** 2 / d[j:j + m][None, :]
            drop = np.argsort(score, axis=1, kind="stable")[:, :m - n]
            np.put_along_axis(mask[:, j:j + m], drop, False, axis=1)
        w = W[:, j].copy()
        w_in = np.where(mask[:, j], w, 0.0) if mask is not None else w
        q, code, v = rtn(w_in, scales[:, g])
        codes[:, j], v_all[:, j] = code, v
        err = (w - q) / Hinv[j, j]
        W[:, j + 1:] -= np.outer(err, Hinv[j, j + 1:])
        Hinv = Hinv - np.outer(Hinv[:, j], Hinv[j, :]) / Hinv[j, j]
    inv = np.argsort(perm)
    return {"codes": codes[:, inv], "scales": scales, "mask": None if mask is None else mask[:, inv],
            "v": v_all[:, inv]}


def first_differences_are_ties(got: np.ndarray, ref: dict, tol: float = 1e-3) -> list:
    """Rows whose first differing code (in the column order the algorithm ran) is *not* a near-tie
    of the reference (``|v - round(v)|`` within ``tol`` of 0.5): after a flip the error feedback
    makes the rest of a row legitimately different, so only the first flip is checked."""
    bad = []
    for r in range(got.shape[0]):
        diff = np.nonzero(got[r] != ref["codes"][r])[0]
        if diff.size:
            v = ref["v"][r, diff[0]]
            if abs(abs(v - np.floor(v)) - 0.5) > tol:
                bad.append((r, int(diff[0]), float(v)))
    return bad
