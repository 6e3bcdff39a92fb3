"""A QConvBn2d's training weight, its C++ route bound once (``BoundFold``).

QConvBn2d's training weight ``fq_w(W * f) / f``, ``f = gamma / sqrt(running_var + eps)``, is two
C++ calls forward and two backward (``dal.formats.fold_factor``, ``dal.formats.fold``). Around
them, per layer and step, the per-layer code decides the route again (``fold_factor``'s and
``FakeQuantizer.fold_quantize``'s checks, the observer's ``track_step``, ``fold_track_forward``'s
buffer checks), allocates eight small tensors, and records two autograd Functions. Inside a
step the convolutions between two layers evict that Python from the caches: on SSDlite320 (70
folded layers) the weight path cost ~15 ms of the QAT step's CPU time at 64x64 inputs, of which
the C++ arithmetic is ~4 ms (bench/results/detection_speed.md, session 14).

Once a layer has taken that route, it keeps a ``BoundFold``: the tensors the route read (the
objects and their data pointers) and its constants. At each call :meth:`BoundFold.holds`
re-checks everything the route depended on and code can change between two calls: the
layer's weight, BN gamma / running variance / eps, and weight quantizer are the same objects,
at the same addresses (``.data =`` and ``.to()`` move them), trainable; the quantizer is still
in QAT with the C++ kernel and its observer's QAT step (``quantizer_bound.BoundCall.holds``:
same observer and buffers, same format and configuration, one process); no 2:4 mask. Then it
makes the same two C++ calls on the same tensors, and records ONE autograd Function whose
backward makes the same two C++ calls (``dal_fold_backward``, then ``dal_fold_factor_backward``
on its d f: on this route f has no other use). The same bits and the same buffer writes, at
the same point of the forward (tests/nn/test_fold_bound.py compares steps with and without).
Whatever fails, or a C++ call that declines (it writes nothing then), falls back to the
per-layer code.
"""
from __future__ import annotations

from typing import Optional

import torch

from ..formats import native
from ..formats.first_order import first_order
from ..formats.fold import fold_granularity
from ..formats.fold_factor import kernel_applies
from ..formats.fused import kernel_mode, plain_tensor
from ..formats.share import bump_versions
from ..formats.track import buffers_ok, step_args
from ..quantizer_bound import BoundCall

_F32 = torch.float32
# rows of BoundFold's per-call vector: the fold factor, sqrt(var + eps), this step's scale and code
# bounds, and the backward's d f
_F, _STD, _S, _LO, _HI, _DF = range(6)


class BoundFold:
    """A QConvBn2d's training-weight route with the tensors and constants it was bound under (module doc)."""

    __slots__ = ("weight", "gamma", "var", "quant", "quant_bound", "eps", "state", "pointers", "rows", "row_len",
                 "consts", "mode")

    @classmethod
    def of(cls, module) -> Optional["BoundFold"]:
        """A binding for ``module`` (training, BN not frozen, 1/f on the weight), or None where its
        weight does not take the C++ route with the observer's QAT step."""
        q, bn, weight = module._modules.get("weight_quant"), module._modules["bn"], module._parameters.get("weight")
        if q is None or weight is None or getattr(module, "weight_mask", None) is not None:
            return None
        gamma, var = bn._parameters.get("weight"), bn._buffers.get("running_var")
        if gamma is None or var is None or not (weight.requires_grad and gamma.requires_grad) \
                or not kernel_applies(gamma, var) or native.library() is None:
            return None
        if not (q._kernel and fold_granularity(q.granularity) and q.granularity.axis is not None and q._tracking()):
            return None
        rows = weight.shape[0]
        if not (weight.dim() >= 2 and rows == gamma.numel() and weight.dtype is _F32 and weight.is_cpu
                and weight.is_contiguous() and plain_tensor(weight)):
            return None
        step = q._track_step()
        if not step or q.scale.numel() != rows or not buffers_ok(step[0], step[1], step[2], q.scale, q.zero_point):
            return None
        b = cls()
        b.weight, b.gamma, b.var, b.quant, b.eps = weight, gamma, var, q, float(bn.eps)
        b.quant_bound = BoundCall(q, step)
        b.state = (step[0], step[1], step[2], q.scale, q.zero_point)
        b.pointers = b._pointers()
        b.rows, b.row_len = rows, weight.numel() // rows
        b.consts, b.mode = step_args(*step[3:]), kernel_mode(q.fmt)
        return b if b.quant_bound.holds(q) else None

    def _pointers(self) -> tuple:
        return (self.weight.data_ptr(), self.gamma.data_ptr(), self.var.data_ptr()) \
            + tuple(t.data_ptr() for t in self.state)

    def holds(self, module) -> bool:
        """Whether ``module`` still has everything this binding was made under (module doc)."""
        q, bn = module._modules.get("weight_quant"), module._modules["bn"]
        return (q is self.quant and module._parameters.get("weight") is self.weight
                and bn._parameters.get("weight") is self.gamma and bn._buffers.get("running_var") is self.var
                and bn.eps == self.eps and self.weight.requires_grad and self.gamma.requires_grad
                and q._kernel and q._tracks_range and q.training and self.quant_bound.holds(q)
                and getattr(module, "weight_mask", None) is None and self._pointers() == self.pointers
                and not (torch.jit.is_tracing() or torch.compiler.is_compiling()))

    def __call__(self) -> Optional[torch.Tensor]:
        """``fq_w(W * f) / f`` as the per-layer route computes it, or None (nothing written) where
        its C++ step declines (a NaN or a zero extreme: the per-layer code decides)."""
        lib, rows, row_len = native.library(), self.rows, self.row_len
        vec, keep = torch.empty(6, rows), torch.empty(rows, dtype=torch.uint8)
        out, mask = torch.empty_like(self.weight), torch.empty(rows * ((row_len + 7) // 8), dtype=torch.uint8)
        w, gamma, var, mn, mx, seen, scale, zp = self.pointers
        row = vec.data_ptr()
        lib.dal_fold_factor(gamma, var, self.eps, rows, 1, row + 4 * rows * _F, row + 4 * rows * _STD, keep.data_ptr())
        ok = lib.dal_fold_track_forward(w, out.data_ptr(), mask.data_ptr(), rows, row_len, row + 4 * rows * _F, mn,
                                        mx, seen, *self.consts, scale, zp, row + 4 * rows * _S,
                                        row + 4 * rows * _LO, row + 4 * rows * _HI, self.mode, 1,
                                        torch.get_num_threads())
        if not ok:
            return None
        bump_versions(self.state)  # written in place by the C++ step
        return BoundFoldFunction.apply(self.weight, self.gamma, (out, mask, vec, keep))


class BoundFoldFunction(torch.autograd.Function):
    """``(weight, gamma, (out, mask, vec, keep)) -> out``, computed by :class:`BoundFold`; backward
    ``dal_fold_backward`` (d weight, d f) then ``dal_fold_factor_backward`` (d f -> d gamma)."""

    @staticmethod
    def forward(ctx, weight, gamma, done):
        out, ctx.mask, ctx.vec, ctx.keep = done
        ctx.save_for_backward(weight, out)  # autograd checks at the backward that no one changed them
        return out

    @staticmethod
    @first_order
    def backward(ctx, grad_out):
        weight, out = ctx.saved_tensors
        lib, vec = native.library(), ctx.vec
        rows = vec.shape[1]
        g = grad_out.to(_F32).contiguous()
        grad_w, grad_gamma = torch.empty_like(weight), torch.empty(rows)
        row = vec.data_ptr()
        lib.dal_fold_backward(g.data_ptr(), weight.data_ptr(), out.data_ptr(), ctx.mask.data_ptr(), grad_w.data_ptr(),
                              row + 4 * rows * _DF, rows, weight.numel() // rows, row + 4 * rows * _F, 1,
                              torch.get_num_threads())
        lib.dal_fold_factor_backward(row + 4 * rows * _DF, row + 4 * rows * _STD, ctx.keep.data_ptr(), rows,
                                     grad_gamma.data_ptr())
        return grad_w, grad_gamma, None


def bound_folded_weight(module) -> Optional[torch.Tensor]:
    """``module``'s (a training QConvBn2d, 1/f on the weight) folded weight by its ``BoundFold``,
    bound or re-bound here as needed; None: the per-layer code computes it."""
    b = module.__dict__.get("_fold_bound")
    if b is None or not b.holds(module):
        b = module.__dict__["_fold_bound"] = BoundFold.of(module)
        if b is None:
            return None
    return b()
