"""GPTQ as a dal.ptq step: Hessian-based weight quantization of every calibrated QLinear (and
plain QConv2d).

For each linear, ``H = 2/N sum x x^T`` over its inputs on the calibration data, then the GPTQ
column loop (``gptq_solver``: Cholesky of the damped ``H^-1``, column by column within blocks,
lazy batch updates, dead columns) quantizes ``W`` with the layer's own weight quantizer (format,
granularity, observer rule for per-group scales). The layer keeps GPTQ's result exactly: its
weight becomes ``(code - z) * s`` and, per group, its quantizer the scales GPTQ chose, so the
fake-quant weight, the exported codes and the integer model all carry GPTQ's codes.
"""
from __future__ import annotations

from typing import Callable, Iterable, Optional

import torch
from torch import nn

from .column_grid import ColumnGrid
from .gptq_solver import solve_columns
from .hessian import solve_layerwise


def gptq(qmodel: nn.Module, calib: Iterable, num_batches: Optional[int] = None, *, input_fn: Optional[Callable] = None,
         block_size: int = 128, percdamp: float = 0.01, act_order: bool = False, layers=None,
         progress: bool = False, sequential: str = "block", replay: bool = True,
         dtype: torch.dtype = torch.float32) -> dict:
    """GPTQ (Frantar et al. 2022) on every calibrated QLinear of the prepared ``qmodel``, in place.

    Minimises ``||X W^T - X Q^T||^2`` per layer (``X``: the layer's quantized input on ``calib``,
    batches as ``dal.calibrate`` takes them, ``num_batches`` of them) over ``Q`` on the weight
    quantizer's grid. Per-group scales are chosen when the column loop reaches a group's first
    column, by the quantizer's observer rule over the group's current (updated) weights; with
    ``act_order`` (columns by decreasing ``diag H``) groups are static: every group's scales come
    from the weights before the loop, in the original column order. Per tensor / per channel
    the calibrated scales are kept. Afterwards each layer's fake-quant weight equals GPTQ's
    quantized weight exactly (weight ``(code - z) * s``; the weight quantizer is left ``frozen``
    with GPTQ's scales). QLinears, and QConv2ds with ``groups == 1``, zero padding and per-tensor
    or per-channel weights (over their unfolded input patches: ``dal.ptq.hessian.supported``);
    other layers are left as they are.

    Layers go in execution order; with ``sequential="block"`` the Hessians of one ModuleList
    block (a decoder layer) are captured in one pass, and ``replay`` replays the solved blocks
    before it from recorded outputs instead of running them again; with ``"layer"`` one pass
    per set of linears sharing an input (``dal.ptq.hessian``). Memory: one ``d_in x d_in``
    Hessian per input of the current block, plus with ``replay`` one block's outputs for the
    calibration batches. ``dtype``: the arithmetic (``torch.float64`` for a reference-exact
    run). ``layers``: paths to restrict it to.

    Returns ``{"layers": {path: {"error", "rtn_error", "tokens"}}, "passes": n, "replayed": k}``;
    ``error`` and ``rtn_error`` are ``2/N ||X (W - Q)^T||^2`` for GPTQ's and the calibrated
    round-to-nearest ``Q``.
    Raises ``ValueError`` for an uncalibrated model (run ``dal.calibrate`` first) or one with
    no quantized linear.

    Example:
        >>> dal.calibrate(qmodel, calib)                                # doctest: +SKIP
        >>> dal.ptq.gptq(qmodel, calib, act_order=True)                 # doctest: +SKIP
    """
    if block_size < 1:
        raise ValueError(f"gptq: block_size={block_size} must be >= 1")

    def solve(W, H, quantizers, rows, mask):
        grid = ColumnGrid(quantizers, rows, W.shape[1], H.dtype)
        return grid, solve_columns(W, H, grid, block_size=block_size, percdamp=percdamp, act_order=act_order,
                                   mask=mask)

    return solve_layerwise(qmodel, calib, num_batches, solve=solve, input_fn=input_fn, layers=layers,
                           sequential=sequential, replay=replay, dtype=dtype, progress=progress, what="dal.ptq.gptq")
