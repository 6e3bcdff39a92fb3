"""The GPTQ and SparseGPT column loops on one weight matrix and its input Hessian.

GPTQ (Frantar et al., "GPTQ: Accurate Post-Training Quantization for Generative Pre-trained
Transformers", ICLR 2023) and SparseGPT (Frantar & Alistarh, "SparseGPT: Massive Language Models
Can Be Accurately Pruned in One-Shot", ICML 2023) minimise ``||X W^T - X Q^T||^2`` over the
quantized (and pruned) ``Q``, with ``H = 2/N X^T X`` (``N`` rows of layer input ``X``):

    dead columns (H_jj = 0): H_jj = 1, W[:, j] = 0
    H += percdamp * mean(diag H) * I
    U = chol(H^-1)^T  (upper: H^-1 = U^T U)
    for each column j in order:
        q_j = quant(w_j)                       (SparseGPT: 0 where pruned, then quant)
        e_j = (w_j - q_j) / U_jj
        w_k -= e_j * U_jk   for every later column k

``W`` is updated column by column inside blocks of ``block_size`` columns and once per block for
the columns after it (the lazy batch update; exact in arithmetic). Columns are taken in order
of decreasing ``diag H`` with ``act_order``. SparseGPT picks its N:M mask at the first column of
each run of M columns: per row, the N of the M (current) weights with the largest
``w^2 / U_jj^2`` are kept.
"""
from __future__ import annotations

from typing import Optional

import torch

from .column_grid import ColumnGrid


def damped_inverse_cholesky(H: torch.Tensor, percdamp: float) -> torch.Tensor:
    """``U`` upper triangular with ``(H + percdamp * mean(diag H) * I)^-1 = U^T U``. ``H`` must
    have no zero diagonal entry (``solve_columns`` treats dead columns first)."""
    if not 0.0 < percdamp:
        raise ValueError(f"percdamp={percdamp} must be > 0 (a fraction of the mean Hessian diagonal, e.g. 0.01)")
    H = H.clone()
    idx = torch.arange(H.shape[0])
    damp = percdamp * torch.mean(torch.diag(H))
    H[idx, idx] += damp
    L, info = torch.linalg.cholesky_ex(H)
    if int(info):
        raise ValueError(f"the layer's Hessian is not positive definite after damping {percdamp}: raise percdamp")
    Hinv = torch.cholesky_inverse(L)
    return torch.linalg.cholesky(Hinv, upper=True)


@torch.no_grad()
def solve_columns(W: torch.Tensor, H: torch.Tensor, grid: ColumnGrid, *, block_size: int = 128,
                  percdamp: float = 0.01, act_order: bool = False, sparsity: Optional[tuple] = None,
                  mask: Optional[torch.Tensor] = None, latent: bool = False) -> dict:
    """Run GPTQ (``sparsity=None``) or SparseGPT (``sparsity=(n, m)``: keep ``n`` of every ``m``)
    on ``W`` (rows x columns, any float dtype) with Hessian ``H`` (columns x columns); the
    arithmetic is in ``H.dtype``. ``grid`` gives the column quantizer and receives the group
    scales. Returns ``codes`` (rows x columns, float, the integer codes in the original column
    order), ``mask`` (bool, kept weights; None without sparsity), ``dead`` (dead columns),
    ``perm`` (the column order used). A given ``mask`` (rows x columns, bool) is kept fixed:
    weights where it is False are 0 before quantization (a layer already 2:4 sparse).
    ``latent=True`` adds ``latent``: each weight as the loop rounded it (compensated by the earlier
    columns' errors, 0 where pruned; rows x columns, original order): off the grid points.
    """
    if sparsity is not None and (act_order or mask is not None):
        raise ValueError("SparseGPT chooses its own N:M groups in the original column order: no act_order, no mask")
    dtype = H.dtype
    W = W.detach().to(dtype).clone()
    H = H.clone()
    rows, cols = W.shape
    dead = torch.diag(H) == 0
    H[dead, dead] = 1
    W[:, dead] = 0
    perm = torch.arange(cols)
    group = grid.group
    fixed = mask.to(torch.bool).clone() if mask is not None else None
    if act_order:
        if group:
            grid.static_groups(W)  # static groups: scales from the weights in the original order
        perm = torch.argsort(torch.diag(H), descending=True, stable=True)
        W, H = W[:, perm], H[perm][:, perm]
        if fixed is not None:
            fixed = fixed[:, perm]
    U = damped_inverse_cholesky(H, percdamp)
    if sparsity is not None:
        n_keep, m = sparsity
        if cols % m:
            raise ValueError(f"{cols} input columns are not a multiple of the sparsity group size {m}")
    # Blocks hold whole quantization groups and whole N:M groups: a group's scales and a
    # mask are then chosen from weights that every earlier column has already updated.
    step = max(block_size, 1)
    for unit in (group if group and not act_order else 1, sparsity[1] if sparsity else 1):
        step = -(-step // unit) * unit
    # Transposed (columns x rows): a column and the trailing updates are contiguous rows.
    Wt = W.t().contiguous()
    codes = torch.zeros(cols, rows, dtype=dtype)
    mask = torch.ones(cols, rows, dtype=torch.bool) if sparsity is not None else \
        (fixed.t().contiguous() if fixed is not None else None)
    order = perm.tolist()
    lat = torch.zeros(cols, rows, dtype=dtype) if latent else None
    for i1 in range(0, cols, step):
        i2 = min(i1 + step, cols)
        W1 = Wt[i1:i2].clone()
        Err1 = torch.empty_like(W1)
        U1 = U[i1:i2, i1:i2]
        diag = torch.diag(U1)
        d_list = diag.tolist()
        for i in range(i2 - i1):
            j = i1 + i
            col = order[j]
            if group and not act_order and col % group == 0:
                grid.refresh(col, W1[i:i + group].t())
            w = W1[i]
            if sparsity is not None and i % m == 0:
                score = W1[i:i + m] ** 2 / diag[i:i + m].reshape(-1, 1) ** 2
                # drop the m - n smallest scores (among equal scores the lower column goes first: stable sort)
                ranks = torch.argsort(score, dim=0, stable=True)
                pruned = torch.zeros_like(score, dtype=torch.bool)
                pruned.scatter_(0, ranks[:m - n_keep], True)
                mask[j:j + m] = ~pruned
            w_in = w if mask is None else torch.where(mask[j], w, torch.zeros_like(w))
            if lat is not None:
                lat[j] = w_in
            q, _ = grid.quantize(w_in, col, out=codes[j])
            err = torch.sub(w, q, out=Err1[i]).div_(d_list[i])
            W1[i:].addr_(U1[i, i:], err, alpha=-1.0)
        Wt[i2:].addmm_(U[i1:i2, i2:].t(), Err1, alpha=-1.0)
    codes, mask = codes.t(), (mask.t() if mask is not None else None)
    inv = torch.argsort(perm)
    return {"codes": codes[:, inv], "mask": None if mask is None else mask[:, inv], "dead": dead, "perm": perm,
            **({"latent": lat.t()[:, inv]} if lat is not None else {})}
