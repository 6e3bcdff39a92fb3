"""A float-island MatMul (export/SPEC.md §5a) summed in the order dal.npu sums it.

§5a's float island MatMul is ``T(sum_k float64(x[k]) * float64(w[k, n]))``: the products are exact
in float64, the sum is not, and its order was left to each engine (torch's float64 kernel here,
numpy's in dal.npu). Where the products cancel, the two orders can round the float32 result
apart: seen on a decoder's ``lm_head`` (its logits are a graph output, every bit compared): 1 logit
of ~270k per 10 x 64-step generation run (dal.export_decoder, tests/llm_npu). dal.npu computes
``np.matmul(float64(x), float64(W))`` with ``x [..., K]`` and the dequantized weight ``W [K, N]``
C-contiguous; the same numpy routine on operands of the same shapes and layout performs the same
operations in the same order, so the integer model calls it too (as ``attention.exp_f32`` does for
``exp``). Values go through the CPU (and back to ``x``'s device).
"""
from __future__ import annotations

import weakref

import numpy as np
import torch

#: owner module -> (weight key, its float64 [K, N] copy): see :func:`weight_kn`
_KEPT: "weakref.WeakKeyDictionary[torch.nn.Module, tuple]" = weakref.WeakKeyDictionary()


def matmul_f64(x: torch.Tensor, w_kn) -> torch.Tensor:
    """``x [..., K] @ w_kn [K, N]`` in float64 as dal.npu's MatMul computes it (numpy's float64
    matmul of C-contiguous operands), unrounded (float64), on ``x``'s device. ``w_kn``: a tensor,
    or the numpy float64 C-contiguous array :func:`weight_kn` keeps (the same operand)."""
    a = np.ascontiguousarray(x.detach().to("cpu", torch.float64).numpy())
    b = w_kn if isinstance(w_kn, np.ndarray) else np.ascontiguousarray(w_kn.detach().to("cpu", torch.float64).numpy())
    return torch.from_numpy(np.matmul(a, b)).to(x.device)


def weight_kn(owner: torch.nn.Module, w_nk: torch.Tensor) -> np.ndarray:
    """``w_nk.t()`` as :func:`matmul_f64` hands it to numpy (float64 ``[K, N]``, C-contiguous),
    converted once and kept for ``owner`` (weakly: it goes with the module) until ``w_nk`` changes
    (its storage or ``_version``): a layer's constant weight is not converted on every call."""
    key = (w_nk.data_ptr(), w_nk._version, tuple(w_nk.shape))
    kept = _KEPT.get(owner)
    if kept is None or kept[0] != key:
        kept = (key, np.ascontiguousarray(w_nk.detach().t().to("cpu", torch.float64).numpy()))
        _KEPT[owner] = kept
    return kept[1]


#: id(w_nk) -> (weakref to w_nk, its key, its float64 [K, N] copy): see :func:`weight_kn_of`
_KEPT_BY_TENSOR: dict = {}


def weight_kn_of(w_nk: torch.Tensor) -> np.ndarray:
    """:func:`weight_kn` keyed by the weight tensor itself instead of an owner module (for the
    ``dal_convert::matmul_f64`` operator, host_ops.py, which is handed tensors only): the copy is kept
    while the same tensor object is alive with the same storage, ``_version`` and shape."""
    key = (w_nk.data_ptr(), w_nk._version, tuple(w_nk.shape))
    kept = _KEPT_BY_TENSOR.get(id(w_nk))
    if kept is None or kept[0]() is not w_nk or kept[1] != key:
        kept = (weakref.ref(w_nk, lambda _r, i=id(w_nk): _KEPT_BY_TENSOR.pop(i, None)), key,
                np.ascontiguousarray(w_nk.detach().t().to("cpu", torch.float64).numpy()))
        _KEPT_BY_TENSOR[id(w_nk)] = kept
    return kept[2]


def linear_f64(owner: torch.nn.Module, x: torch.Tensor, w_nk: torch.Tensor) -> torch.Tensor:
    """``matmul_f64(x, weight_kn(owner, w_nk))``: ``x [..., K] @ w_nk.t()`` in float64 (unrounded), numpy's
    order. Inside a ``torch.compile`` capture (compiled.py) the same call runs as the opaque operator
    ``dal_convert::matmul_f64(x, w_nk)`` (host_ops.py: numpy's matmul on the same operands)."""
    if torch.compiler.is_compiling():
        return torch.ops.dal_convert.matmul_f64(x, w_nk)
    return matmul_f64(x, weight_kn(owner, w_nk))
