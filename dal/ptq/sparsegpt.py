"""SparseGPT as a dal.ptq step: N:M (2:4) pruning chosen jointly with the weight quantization.

Per linear, with ``H = 2/N sum x x^T`` of its calibration inputs, the SparseGPT column loop
(``gptq_solver``) picks, at the first column of every run of M input columns, the N weights of
each row to keep by ``w^2 / [H^-1]_jj`` (the ``U_jj^2`` of the Cholesky factor ``U`` of the
damped ``H^-1``) over the current weights, zeroes the others, quantizes the column with the
layer's weight quantizer and propagates the error through ``H^-1`` to the later columns.
The layer ends in dal's sparsity form: a ``weight_mask`` buffer (bool, True = kept; updated in
place when a ``dal.sparsity`` controller owns it) and ``weight_sparsity_stats``, so export's
``dal.sparse_24`` metadata and ``dal.sparsity.report`` see it; its weight is
``(code - z) * s`` with pruned entries 0, so its fake-quant weight is SparseGPT's result.
"""
from __future__ import annotations

from typing import Callable, Iterable, Optional

import torch
from torch import nn

from .column_grid import ColumnGrid
from .gptq_solver import solve_columns
from .hessian import candidate_linears, solve_layerwise


def sparsegpt(qmodel: nn.Module, calib: Iterable, num_batches: Optional[int] = None, *,
              input_fn: Optional[Callable] = None, pattern: str = "2:4", block_size: int = 128,
              percdamp: float = 0.01, layers=None, progress: bool = False, sequential: str = "block",
              replay: bool = True, dtype: torch.dtype = torch.float32, latent: bool = False) -> dict:
    """SparseGPT (Frantar & Alistarh 2023) with ``pattern`` ("N:M", along the input columns)
    on every calibrated QLinear of ``qmodel``, in place, jointly with its weight quantization.

    Same passes, batches and arguments as ``dal.ptq.gptq`` (no ``act_order``: the N:M groups
    are runs of M consecutive input columns), QLinears only (a conv's unfolded columns do not
    run along its input channels, where dal's N:M groups are). Per-group scales are chosen at a group's first
    column from its current weights before its masks are. A layer whose input width is not a
    multiple of M raises ``ValueError`` naming it (pass ``layers=`` without it). Returns
    ``gptq``'s report (its ``rtn_error`` is that of the dense round-to-nearest weight).

    The layers must be dense: a layer whose ``weight_mask`` already prunes weights (a recipe rule's
    ``sparsity: "2:4"`` masks by magnitude at ``prepare_qat`` and zeroes the pruned weights) raises
    ``ValueError`` naming it, since SparseGPT could only choose among the weights magnitude kept.
    Prepare without the sparsity rule and let this step choose the masks.

    ``latent=False``: each weight is written on its grid point, ``(code - z) * s``. ``latent=True``:
    each weight is the value the column loop rounded (compensated by the earlier columns' errors, 0
    where pruned): the fake-quant weight is the same, but QAT after this step starts from weights
    that a small update moves to the next code, as from round-to-nearest, rather than from the
    middle of their rounding interval.

    Example:
        >>> dal.calibrate(qmodel, calib); dal.ptq.sparsegpt(qmodel, calib)  # doctest: +SKIP
    """
    from ..sparsity import parse_pattern

    pat = parse_pattern(pattern)
    n, m = pat.n, pat.m

    def solve(W, H, quantizers, rows, mask):
        if W.shape[1] % m:
            names = ", ".join(q.name.rsplit(".", 1)[0] for q in quantizers)
            raise ValueError(f"sparsegpt: {names}: {W.shape[1]} input features are not a multiple of {m} ({pattern})")
        grid = ColumnGrid(quantizers, rows, W.shape[1], H.dtype)
        return grid, solve_columns(W, H, grid, block_size=block_size, percdamp=percdamp, sparsity=(n, m),
                                   latent=latent)

    pruned = [name for name, mod in candidate_linears(qmodel, layers, "dal.ptq.sparsegpt", convs=False)
              if getattr(mod, "weight_mask", None) is not None and not bool(mod.weight_mask.all())]
    if pruned:  # checked before any layer is solved
        raise ValueError(f"sparsegpt: {', '.join(pruned)}: the weight is already pruned by its weight_mask (e.g. a "
                         "recipe rule's sparsity: 2:4, magnitude masks at prepare_qat): SparseGPT needs the dense "
                         "weight to choose the masks; prepare without the sparsity rule (or pass layers= without them)")
    return solve_layerwise(qmodel, calib, num_batches, solve=solve, input_fn=input_fn, layers=layers,
                           sequential=sequential, replay=replay, dtype=dtype, progress=progress, what="dal.ptq.sparsegpt",
                           convs=False)
